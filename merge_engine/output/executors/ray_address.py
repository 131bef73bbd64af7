"""Check a ``--ray-address`` before Ray is asked to connect to it, without importing Ray.

Ray's own connect (``ray.init(address=...)``) retries a dead or wrong address for minutes, printing
only its warnings. `check_ray_address` answers within ``timeout`` seconds instead:

- "auto", "local" (or nothing): left to Ray (it fails at once when no cluster is found);
- ``host:port`` or ``ray://host:port`` (Ray Client): a port in 1..65535 and a host, else `InvalidOption`;
- the address must accept a TCP connection and speak HTTP/2 (Ray's GCS and its client server are gRPC
  servers: they answer the HTTP/2 preface with a SETTINGS frame) within ``timeout`` s, else
  `RayClusterUnreachable` naming the address (nothing listens there, a firewall drops the packets, or
  something else than Ray listens, e.g. a web server).
"""

from __future__ import annotations

import socket
import time

from merge_engine.errors import InvalidOption, RayClusterUnreachable

__all__ = ["CONNECT_TIMEOUT_S", "check_ray_address", "parse_ray_address"]

CONNECT_TIMEOUT_S = 5.0  # a refused port answers at once; this bounds an address that drops packets
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # length 0, type SETTINGS, no flags, stream 0
_SETTINGS = 0x04
_LEFT_TO_RAY = ("", "auto", "local")


def parse_ray_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` / ``ray://host:port`` (IPv6 hosts in brackets); `InvalidOption`
    naming the address otherwise."""
    rest = address.strip()
    for prefix in ("ray://", "http://", "https://"):
        if rest.startswith(prefix):
            if prefix != "ray://":
                raise InvalidOption("--ray-address takes host:port (the cluster's GCS) or ray://host:port "
                                    "(Ray Client), not a web URL", address)
            rest = rest[len(prefix):]
    host, colon, port_text = rest.rstrip("/").rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536 \
            or any(c in host for c in "/ @?#"):
        raise InvalidOption("--ray-address is not host:port, ray://host:port, 'auto' or 'local'", address)
    return host, int(port_text)


def check_ray_address(address: str | None, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Return once ``address`` looks like a live Ray cluster (see the module docstring); raise
    `InvalidOption` (garbage) or `RayClusterUnreachable` (dead, or not Ray) within ``timeout`` s."""
    if address is None or address.strip() in _LEFT_TO_RAY:
        return
    host, port = parse_ray_address(address)
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(_HTTP2_PREFACE + _EMPTY_SETTINGS)
            header = b""
            while len(header) < 9:
                conn.settimeout(max(0.05, deadline - time.monotonic()))
                data = conn.recv(9 - len(header))
                if not data:
                    break
                header += data
    except socket.gaierror as exc:
        raise RayClusterUnreachable(f"no Ray cluster at the --ray-address: host {host!r} is unknown "
                                    f"({exc.strerror})", address) from None
    except TimeoutError:
        raise RayClusterUnreachable(f"no Ray cluster at the --ray-address: no answer within {timeout:.0f} s",
                                    address) from None
    except OSError as exc:
        raise RayClusterUnreachable(f"no Ray cluster at the --ray-address: {exc.strerror or exc}",
                                    address) from None
    if len(header) < 9 or header[3] != _SETTINGS:
        raise RayClusterUnreachable("no Ray cluster at the --ray-address: something listens there but does not "
                                    "speak gRPC (HTTP/2) as Ray's GCS does", address)
