"""A loopback TCP proxy that injects network faults, for testing retries against real servers.

Contract:
- ``FaultProxy(upstream_port).start()`` listens on 127.0.0.1 (a free port) and forwards every
  connection to ``127.0.0.1:upstream_port``, both directions, from an asyncio loop in a daemon thread.
  ``stop()`` closes the listener and every open connection. It is a context manager.
- ``set_fault(Fault...)`` applies a fault to the next ``connections`` TCP connections accepted
  (counted from that call); later connections pass through untouched. ``set_fault(None)`` clears it.
  HTTP clients keep connections alive, so ``set_fault`` first closes (cleanly, FIN) every connection
  already open: the client's next request opens a new one, which meets the fault.
  Faults (all counted per connection):
    * ``Fault.reset(after_bytes)``: forward ``after_bytes`` bytes, then send a TCP RST to the client;
    * ``Fault.stall(seconds, after_bytes)``: forward ``after_bytes`` bytes, then nothing for
      ``seconds``, then carry on;
    * ``Fault.refuse()``: accept and reset at once, before any byte (a listener cannot refuse
      selectively; the client sees a reset connection, as with a server restarting);
    * ``Fault.respond(raw)``: read the request head, answer ``raw`` (e.g. an HTTP 503), close.
  Bytes are counted in the server-to-client direction (``direction="down"``, for downloads) or
  client-to-server (``"up"``, for uploads).
- ``Network(latency, bandwidth)`` (``FaultProxy(port, network=...)`` or ``set_network``) shapes every
  connection like a real network: each request (the client speaking after the server has, or first)
  waits ``latency`` seconds before it is forwarded, and each direction of a connection is capped at
  ``bandwidth`` bytes/s. Loopback storage has neither, which hides exactly the cost of one request at
  a time; with them, throughput grows with the number of requests in flight, as on object storage.
- ``hold()`` stops every byte, both directions, on every connection (open ones included) until
  ``release()``: whatever a client waits for then waits at a known state, for as long as a test
  needs (e.g. a worker caught in the middle of reading a file). Bytes already handed to the kernel
  before ``hold()`` returned may still arrive.
- Every wait the proxy makes for a fault or the network (a stall, a latency, the bandwidth's pacing) goes
  through its ``clock`` (`ProxyClock`: ``time()`` and ``async sleep(seconds)``; default the event loop's
  own), so a test can see each wait and decide when it ends instead of measuring wall time
  (``tests/test_servers.py``: `VirtualClock`, `HeldClock`).
- ``accepted`` counts connections, ``faulted`` the connections a fault was assigned to, and
  ``fired`` the faults that really happened (a reset sent, a stall begun, a connection refused, a
  canned response sent): a reset armed for after N bytes on a connection that carries fewer never
  fires. Assert on ``fired`` to prove a fault was met.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["Fault", "FaultProxy", "LoopClock", "Network", "ProxyClock", "http_response"]

Direction = Literal["down", "up"]  # count server-to-client bytes (downloads) or client-to-server (uploads)


@dataclass(frozen=True)
class Fault:
    """What the proxy does to the first ``connections`` connections after `FaultProxy.set_fault`."""

    kind: Literal["reset", "stall", "refuse", "respond"]
    after_bytes: int = 0
    seconds: float = 0.0
    connections: int = 1
    response: bytes = b""
    direction: Direction = "down"

    @classmethod
    def reset(cls, after_bytes: int = 0, connections: int = 1, direction: Direction = "down") -> Fault:
        return cls("reset", after_bytes=after_bytes, connections=connections, direction=direction)

    @classmethod
    def stall(
        cls, seconds: float, after_bytes: int = 0, connections: int = 1, direction: Direction = "down"
    ) -> Fault:
        return cls("stall", after_bytes=after_bytes, seconds=seconds, connections=connections, direction=direction)

    @classmethod
    def refuse(cls, connections: int = 1) -> Fault:
        return cls("refuse", connections=connections)

    @classmethod
    def respond(cls, response: bytes, connections: int = 1) -> Fault:
        return cls("respond", response=response, connections=connections)


@dataclass(frozen=True)
class Network:
    """A simulated network: ``latency`` seconds per request, ``bandwidth`` bytes/s per connection and
    direction (0: unlimited)."""

    latency: float = 0.0
    bandwidth: float = 0.0


class ProxyClock(Protocol):
    """The time the proxy shapes and stalls by: ``time()`` in seconds, and ``sleep``, awaited on the proxy's
    event loop for every wait it makes (``kind``: "latency", "bandwidth" or "stall")."""

    def time(self) -> float: ...

    async def sleep(self, seconds: float, kind: str) -> None: ...


class LoopClock:
    """The real clock: the event loop's time and `asyncio.sleep`."""

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float, kind: str) -> None:
        await asyncio.sleep(seconds)


class _Link:
    """One connection's shaping state: who spoke last (a request starts when the client speaks after
    the server, or first) and, per direction, when the bytes sent so far may have left."""

    def __init__(self, network: Network, clock: ProxyClock) -> None:
        self.network = network
        self.clock = clock
        self.last_speaker = "down"
        self.free_at = {"down": 0.0, "up": 0.0}

    async def before(self, direction: str, nbytes: int) -> None:
        if direction == "up" and self.last_speaker == "down" and self.network.latency:
            await self.clock.sleep(self.network.latency, "latency")
        self.last_speaker = direction
        if self.network.bandwidth:
            start = max(self.clock.time(), self.free_at[direction])
            self.free_at[direction] = start + nbytes / self.network.bandwidth
            delay = self.free_at[direction] - self.clock.time()
            if delay > 0:
                await self.clock.sleep(delay, "bandwidth")


def http_response(status: int, reason: str, body: bytes = b"", content_type: str = "text/plain") -> bytes:
    """A complete raw HTTP/1.1 response that closes the connection."""
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST, not a clean FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", network: Network | None = None,
                 clock: ProxyClock | None = None) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.network = network
        self.clock: ProxyClock = clock or LoopClock()
        self.port = 0
        self.accepted = 0
        self.faulted = 0
        self.fired = 0
        self._fault: Fault | None = None
        self._fault_left = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._open: set[asyncio.StreamWriter] = set()
        self._links: set[_Link] = set()
        self._flowing: asyncio.Event | None = None  # cleared while held

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_fault(self, fault: Fault | None, close_open: bool = True) -> None:
        if close_open:
            self.close_connections()
        with self._lock:
            self._fault = fault
            self._fault_left = fault.connections if fault else 0

    def set_network(self, network: Network | None, *, open_connections: bool = False) -> None:
        """Shape the connections accepted from now on (``None``: pass through at loopback speed); with
        ``open_connections``, also those already open (a client's pooled keep-alive connections)."""
        self.network = network
        if open_connections:
            for link in list(self._links):
                link.network = network or Network()

    def hold(self) -> None:
        """Stop every byte (both directions, every connection) until `release`; effective on return."""
        self._on_loop(lambda: self._flowing.clear())

    def release(self) -> None:
        """Let bytes flow again after `hold`."""
        self._on_loop(lambda: self._flowing.set())

    def _on_loop(self, call: Callable[[], None]) -> None:
        if self._loop is None:
            return

        async def run() -> None:
            call()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def close_connections(self) -> None:
        """Close every open connection cleanly (the client sees EOF, as from a server's idle timeout)."""
        if self._loop is None:
            return

        async def close_all() -> None:
            for writer in list(self._open):
                writer.close()
            await asyncio.sleep(0.05)  # let clients on other threads see the FIN before their next request

        asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(timeout=10)

    def _fire(self) -> None:
        with self._lock:
            self.fired += 1

    def _take_fault(self) -> Fault | None:
        with self._lock:
            self.accepted += 1
            if self._fault is None or self._fault_left <= 0:
                return None
            self._fault_left -= 1
            self.faulted += 1
            return self._fault

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        future.result(timeout=10)
        return self

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._loop = self._thread = self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- one connection --------------------------------------------------------------------
    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._serve(client_reader, client_writer, self._take_fault())
        except (asyncio.CancelledError, ConnectionError, OSError):
            _reset(client_writer)
        finally:
            self._tasks.discard(task)

    async def _serve(self, client_reader, client_writer, fault: Fault | None) -> None:
        if fault is not None and fault.kind == "refuse":
            self._fire()
            _reset(client_writer)
            return
        if fault is not None and fault.kind == "respond":
            try:
                await client_reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass
            self._fire()
            client_writer.write(fault.response)
            await client_writer.drain()
            client_writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(client_writer)
            return
        self._open.update((client_writer, upstream_writer))
        down_fault = fault if fault is not None and fault.direction == "down" else None
        up_fault = fault if fault is not None and fault.direction == "up" else None
        link = _Link(self.network, self.clock) if self.network is not None else None
        if link is not None:
            self._links.add(link)
        down = asyncio.ensure_future(self._pipe(upstream_reader, client_writer, down_fault, client_writer, self._fire,
                                                link, "down", self._flowing, self.clock))
        up = asyncio.ensure_future(self._pipe(client_reader, upstream_writer, up_fault, client_writer, self._fire,
                                              link, "up", self._flowing, self.clock))
        try:
            done, _ = await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
            # the server closing its side ends the exchange; a client's half-close lets the server finish
            if up in done and not up.cancelled() and up.exception() is None:
                await down
        except (ConnectionError, OSError):
            pass
        finally:
            for pending in (down, up):
                pending.cancel()
            await asyncio.gather(down, up, return_exceptions=True)
            self._open.difference_update((client_writer, upstream_writer))
            self._links.discard(link)  # type: ignore[arg-type]
            upstream_writer.transport.abort()
            if not client_writer.is_closing():
                client_writer.close()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        fault: Fault | None,
        client_writer: asyncio.StreamWriter,
        fired: Callable[[], None],
        link: _Link | None = None,
        direction: Direction = "down",
        flowing: asyncio.Event | None = None,
        clock: ProxyClock | None = None,
    ) -> None:
        passed = 0
        armed = fault is not None and fault.kind in ("reset", "stall")
        while True:
            data = await reader.read(1 << 16)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            if link is not None:
                await link.before(direction, len(data))
            if flowing is not None:
                await flowing.wait()  # held: nothing passes until released
            if armed and passed + len(data) >= fault.after_bytes:
                head, data = data[: fault.after_bytes - passed], data[fault.after_bytes - passed :]
                if head:
                    writer.write(head)
                    await writer.drain()
                    passed += len(head)
                fired()
                if fault.kind == "reset":
                    _reset(client_writer)
                    raise ConnectionResetError("fault proxy: injected reset")
                armed = False
                await (clock or LoopClock()).sleep(fault.seconds, "stall")
            if data:
                writer.write(data)
                await writer.drain()
                passed += len(data)
