"""Forged pickles that run code when a plain ``pickle.loads`` reads them, and the checks that none did (issue 26).

Each `Gadget` builds, for a marker file path, a pickle whose loading would create that file (or start a child
process that does): ``subprocess.Popen`` reached by a dotted ``STACK_GLOBAL`` name out of an allowed module,
``io.FileIO`` likewise, ``os.system``, ``builtins.eval`` / ``exec``, ``getattr`` chains, ``copyreg``,
``functools.partial``, ``operator.attrgetter`` and a ``__reduce_ex__`` gadget, in every pickle protocol 0-5 and
through both ``GLOBAL`` and ``STACK_GLOBAL`` (`PAYLOADS`). The opcodes are written by hand where a normal
pickler would not write them (a dotted name, a global in an older protocol), so what is tested is what a
forger can write. `Inert` asserts that no marker appeared and no child process was started.
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

# where a reader's allow-list admitted names before issue 26: any name under these modules
INDEX_MODULE = "merge_engine.storage.backend"  # imports asyncio: asyncio.base_events.subprocess.Popen
TORCH_MODULE = "torch.distributed.checkpoint.metadata"


def _value(value: object, protocol: int) -> bytes:
    """Opcodes pushing a str, or a list or tuple of them (MARK-based opcodes: valid in every protocol)."""
    if isinstance(value, str):
        data = value.encode()
        if protocol == 0:
            assert "\n" not in value and "\\" not in value
            return b"V" + data + b"\n"
        return b"X" + struct.pack("<I", len(data)) + data
    items = b"".join(_value(v, protocol) for v in value)
    return b"(" + items + (b"l" if isinstance(value, list) else b"t")


def _args(values: tuple, protocol: int) -> bytes:
    return _value(tuple(values), protocol)


def _string(text: str, protocol: int) -> bytes:
    return _value(text, protocol)


def global_op(module: str, name: str, opcode: str, protocol: int) -> bytes:
    """Push the global ``module.name``: ``GLOBAL`` (any protocol) or ``STACK_GLOBAL`` (protocol 4+)."""
    if opcode == "GLOBAL":
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    assert protocol >= 4
    return _short(module) + _short(name) + b"\x93"


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def call(module: str, name: str, args: tuple, opcode: str, protocol: int) -> bytes:
    """Opcodes pushing ``module.name(*args)`` (REDUCE)."""
    return global_op(module, name, opcode, protocol) + _args(args, protocol) + b"R"


def framed(body: bytes, protocol: int) -> bytes:
    return (bytes([0x80, protocol]) if protocol >= 2 else b"") + body + b"."


@dataclass(frozen=True)
class Gadget:
    name: str
    build: Callable[[str, str, int, str], bytes]  # (marker, opcode, protocol, allowed module) -> body opcodes


def _popen_dotted(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    command = ["sh", "-c", f"touch {marker}; exec sleep 60"]
    return call(module, "asyncio.base_events.subprocess.Popen", (command,), opcode, protocol)


def _fileio_dotted(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    module = "merge_engine.layouts.tensor_index" if module == INDEX_MODULE else module  # it imported io
    return call(module, "io.FileIO", (marker, "w"), opcode, protocol)


def _os_system(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    return call("os", "system", (f"touch {marker}",), opcode, protocol)


def _eval(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    return call("builtins", "eval", (f"open({marker!r}, 'w')",), opcode, protocol)


def _exec(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    return call("builtins", "exec", (f"open({marker!r}, 'w').close()",), opcode, protocol)


# a class of each module whose names an allow-list used to admit wholesale (the walk starts there)
ALLOWED_CLASS = {INDEX_MODULE: "RangedFile", TORCH_MODULE: "Metadata"}


def _getattr_walk(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    """getattr(getattr(<a class of an allowed module>, "__init__"), "__globals__"): an attribute walk from an
    allowed name to a function's globals (from there, any builtin)."""
    first = global_op("builtins", "getattr", opcode, protocol) + b"(" \
        + global_op(module, ALLOWED_CLASS[module], opcode, protocol) + _string("__init__", protocol) + b"tR"
    return global_op("builtins", "getattr", opcode, protocol) + b"(" + first + _string("__globals__", protocol) + b"tR"


def _getattr_import(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    """getattr(__import__("os"), "system")("touch ...")."""
    system = global_op("builtins", "getattr", opcode, protocol) + b"(" \
        + call("builtins", "__import__", ("os",), opcode, protocol) + _string("system", protocol) + b"tR"
    return system + _args((f"touch {marker}",), protocol) + b"R"


def _copyreg(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    """copyreg._reconstructor(Popen, Popen, argv): ``Popen.__init__(obj, argv)`` runs the command."""
    popen = global_op("subprocess", "Popen", opcode, protocol)
    argv = _value(["sh", "-c", f"touch {marker}"], protocol)
    return global_op("copyreg", "_reconstructor", opcode, protocol) + b"(" + popen + popen + argv + b"tR"


def _partial(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    bound = global_op("functools", "partial", opcode, protocol) + b"(" + global_op("os", "system", opcode, protocol) \
        + _string(f"touch {marker}", protocol) + b"tR"
    return bound + b"(tR"


def _attrgetter(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    getter = call("operator", "attrgetter", ("system",), opcode, protocol)
    system = getter + b"(" + call("builtins", "__import__", ("os",), opcode, protocol) + b"tR"
    return system + _args((f"touch {marker}",), protocol) + b"R"


class _ReduceEx:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce_ex__(self, protocol: int):
        return os.system, (f"touch {self.marker}",)


def _reduce_ex(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    """What pickle itself writes for an object whose ``__reduce_ex__`` names ``os.system`` (its own choice of
    GLOBAL or STACK_GLOBAL for the protocol)."""
    body = pickle.dumps(_ReduceEx(marker), protocol=protocol)
    if protocol >= 2:
        body = body[2:]
    if protocol >= 4 and body[:1] == b"\x95":
        body = body[9:]
    return body[:-1]


GADGETS = [Gadget("popen_dotted", _popen_dotted), Gadget("fileio_dotted", _fileio_dotted),
           Gadget("os_system", _os_system), Gadget("eval", _eval), Gadget("exec", _exec),
           Gadget("getattr_walk", _getattr_walk), Gadget("getattr_import", _getattr_import),
           Gadget("copyreg", _copyreg), Gadget("partial", _partial),
           Gadget("attrgetter", _attrgetter), Gadget("reduce_ex", _reduce_ex)]
# (protocol, opcode): every protocol with GLOBAL, protocols 4 and 5 also with STACK_GLOBAL
ENCODINGS = [(p, "GLOBAL") for p in range(6)] + [(p, "STACK_GLOBAL") for p in (4, 5)]
PAYLOADS = [(g, p, o) for g in GADGETS for p, o in ENCODINGS if not (g.name == "reduce_ex" and o == "STACK_GLOBAL")]
PAYLOAD_IDS = [f"{g.name}-p{p}-{o}" for g, p, o in PAYLOADS]


def forged(gadget: Gadget, marker: Path, protocol: int, opcode: str, module: str) -> bytes:
    """The whole forged pickle: ``{"w": <gadget>}`` (a state dict's shape) in ``protocol``."""
    body = gadget.build(str(marker), opcode, protocol, module)
    return framed(b"(d" + _string("w", protocol) + body + b"s", protocol)


class Inert:
    """Context: on exit, no marker file exists and this process has no new child process (any that a payload
    started is killed, by its pid, and the assertion fails)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __enter__(self) -> Inert:
        self.before = {p.pid for p in psutil.Process().children(recursive=True)}
        return self

    def __exit__(self, *exc_info) -> None:
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.before]
        for process in new:
            process.kill()
        assert not new, f"a payload started {[p.cmdline() for p in new]}"
        assert not self.marker.exists(), f"a payload created {self.marker}"


def zip_with_pickle(path: Path, data: bytes, archive: str = "archive") -> Path:
    """A ``torch.save``-shaped zip holding ``data`` as its ``data.pkl`` (stored, like torch writes it)."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        out.writestr(f"{archive}/data.pkl", data)
        out.writestr(f"{archive}/byteorder", "little")
        out.writestr(f"{archive}/version", "3\n")
    return path


__all__ = ["ENCODINGS", "GADGETS", "INDEX_MODULE", "Inert", "PAYLOADS", "PAYLOAD_IDS", "TORCH_MODULE", "forged",
           "struct", "zip_with_pickle"]
