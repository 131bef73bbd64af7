"""Forged pickles that run code when a plain unpickler reads them, and the checks that none did under stepmerge's.

Each `Gadget` builds, for a marker file path, a pickle whose loading would create that file (or start a child
process that does): ``subprocess.Popen`` / ``os.popen`` and ``os.system`` reached by a dotted name out of an
allowed module, ``os.system``, ``builtins.eval`` / ``exec``, ``getattr`` chains (one from an allowed class
through ``__globals__`` to ``exec``), ``copyreg``, ``functools.partial``, ``operator.attrgetter`` and a
``__reduce_ex__`` gadget, in every pickle protocol 0-5 and through both ``GLOBAL`` and ``STACK_GLOBAL``
(`PAYLOADS`). A dotted name is forged only in protocols 4 and 5: a plain unpickler walks one from protocol 4 on,
so an older one would run nothing even unguarded. The opcodes are written by hand where a normal pickler would
not write them (a dotted name, a global in an older protocol), so what is tested is what a forger can write.

`READERS` are stepmerge's pickle readers as the attack tests call them; ``python -m tests.forged_pickles`` runs
cases of them with the allow-list removed (`unguarded_runs`): every payload must create its marker there, so
that each attack test's payload is one the guard stops, not one that never runs. `Inert` asserts that no marker
appeared and no child process was started.
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
    dotted: bool = False  # names a dotted global: a plain unpickler resolves it from protocol 4 on only


# a dotted path from each allowed module to a process-starting function (both modules import os; the engine's
# module imports asyncio too: its path is the one issue 26 ran)
DOTTED_POPEN = {INDEX_MODULE: "asyncio.base_events.subprocess.Popen", TORCH_MODULE: "os.popen"}


def _popen_dotted(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    command = f"touch {marker}; exec sleep 60"
    argument = ["sh", "-c", command] if DOTTED_POPEN[module].endswith("Popen") else command
    return call(module, DOTTED_POPEN[module], (argument,), opcode, protocol)


def _system_dotted(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    return call(module, "os.system", (f"touch {marker}",), opcode, protocol)


def _os_system(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    return call("os", "system", (f"touch {marker}",), opcode, protocol)


def _eval(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    return call("builtins", "eval", (f"open({marker!r}, 'w')",), opcode, protocol)


def _exec(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    return call("builtins", "exec", (f"open({marker!r}, 'w').close()",), opcode, protocol)


# a class of each module whose names an allow-list used to admit wholesale (the walk starts there)
ALLOWED_CLASS = {INDEX_MODULE: "RangedFile", TORCH_MODULE: "Metadata"}


def _getattr_walk(marker: str, opcode: str, protocol: int, module: str) -> bytes:
    """An attribute walk from an allowed class to ``exec``: getattr(getattr(<class>, "__init__"), "__globals__")
    .get("__builtins__").get("exec")("open(marker, 'w').close()")."""
    def getattr_of(obj: bytes, name: str) -> bytes:
        return global_op("builtins", "getattr", opcode, protocol) + b"(" + obj + _string(name, protocol) + b"tR"

    init = getattr_of(global_op(module, ALLOWED_CLASS[module], opcode, protocol), "__init__")
    builtins = getattr_of(getattr_of(init, "__globals__"), "get") + _args(("__builtins__",), protocol) + b"R"
    run = getattr_of(builtins, "get") + _args(("exec",), protocol) + b"R"
    return run + _args((f"open({marker!r}, 'w').close()",), protocol) + b"R"


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


GADGETS = [Gadget("popen_dotted", _popen_dotted, dotted=True), Gadget("system_dotted", _system_dotted, dotted=True),
           Gadget("os_system", _os_system), Gadget("eval", _eval), Gadget("exec", _exec),
           Gadget("getattr_walk", _getattr_walk), Gadget("getattr_import", _getattr_import),
           Gadget("copyreg", _copyreg), Gadget("partial", _partial),
           Gadget("attrgetter", _attrgetter), Gadget("reduce_ex", _reduce_ex)]
# (protocol, opcode): every protocol with GLOBAL, protocols 4 and 5 also with STACK_GLOBAL
ENCODINGS = [(p, "GLOBAL") for p in range(6)] + [(p, "STACK_GLOBAL") for p in (4, 5)]
PAYLOADS = [(g, p, o) for g in GADGETS for p, o in ENCODINGS
            if not (g.name == "reduce_ex" and o == "STACK_GLOBAL") and not (g.dotted and p < 4)]
PAYLOAD_IDS = [f"{g.name}-p{p}-{o}" for g, p, o in PAYLOADS]
BY_ID = dict(zip(PAYLOAD_IDS, PAYLOADS))


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
        started = []
        for process in psutil.Process().children(recursive=True):
            if process.pid not in self.before:
                try:
                    started.append(process.cmdline())
                    process.kill()
                except psutil.Error:  # it ended (or is a zombie) meanwhile: it was still started
                    started.append(process.pid)
        assert not started, f"a payload started {started}"
        assert not self.marker.exists(), f"a payload created {self.marker}"


def zip_with_pickle(path: Path, data: bytes, archive: str = "archive") -> Path:
    """A ``torch.save``-shaped zip holding ``data`` as its ``data.pkl`` (stored, like torch writes it)."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        out.writestr(f"{archive}/data.pkl", data)
        out.writestr(f"{archive}/byteorder", "little")
        out.writestr(f"{archive}/version", "3\n")
    return path


# --- stepmerge's pickle readers, and the same readers with the allow-list removed -----------------------


@dataclass(frozen=True)
class Reader:
    """One of stepmerge's pickle readers as an attack test calls it. ``place(folder, data)`` writes the forged
    pickle ``data`` where the reader looks and returns ``(the path its error must name, the read)``; ``module``
    is the allowed module the payload's dotted names and walks start from."""

    module: str
    place: Callable[[Path, bytes], tuple[str, Callable[[], object]]]


def _archive(folder: Path, data: bytes) -> tuple[str, Callable[[], object]]:
    from merge_engine.formats.torch_archive import TorchArchive

    path = str(zip_with_pickle(folder / "evil.pt", data))
    return path, lambda: TorchArchive(path).load()


def _dcp_metadata(folder: Path, data: bytes) -> tuple[str, Callable[[], object]]:
    from merge_engine.formats.dcp_index import read_index

    (folder / "dcp").mkdir()
    (folder / "dcp" / ".metadata").write_bytes(data)
    return str(folder / "dcp" / ".metadata"), lambda: read_index(str(folder / "dcp"))


def _bare(folder: Path, data: bytes) -> tuple[str, Callable[[], object]]:
    from merge_engine.formats.safe_unpickler import safe_unpickle

    return "mem://forged", lambda: safe_unpickle(data, "mem://forged")


# a rank file a check reads, per layout: (its path in the step, the folder the check is given under the step)
RANK_FILES = {
    "fsdp": ("model_world_size_1_rank_0.pt", ""),
    "megatron_legacy": ("model/mp_rank_00/model.pt", ""),
    "megatron_lm": ("iter_0000010/mp_rank_00/model_optim_rng.pt", "iter_0000010"),
}


def _rank_file(layout: str) -> Callable[[Path, bytes], tuple[str, Callable[[], object]]]:
    def place(folder: Path, data: bytes) -> tuple[str, Callable[[], object]]:
        from merge_engine.layouts import check_checkpoint

        path, root = RANK_FILES[layout]
        rank_file = folder / "step" / path
        rank_file.parent.mkdir(parents=True)
        zip_with_pickle(rank_file, data)
        return str(rank_file), lambda: check_checkpoint(str(folder / "step" / root) if root else str(folder / "step"))

    return place


READERS = {
    "torch_archive": Reader(TORCH_MODULE, _archive),  # a module whose names an old allow-list admitted wholesale
    "torch_archive_engine_module": Reader(INDEX_MODULE, _archive),  # the engine's own
    "dcp_metadata": Reader(TORCH_MODULE, _dcp_metadata),
    "bare_pickle": Reader(INDEX_MODULE, _bare),
    **{f"rank_file_{layout}": Reader(TORCH_MODULE, _rank_file(layout)) for layout in RANK_FILES},
}


def unguarded_runs(cases: list[tuple[str, str]], folder: Path, wait_s: float = 30.0) -> set[tuple[str, str]]:
    """The cases ``(reader name, payload id)`` whose payload creates its marker when the reader reads it with the
    allow-list removed (``SafeUnpickler.find_class`` is then ``pickle.Unpickler``'s), run in a child process
    of its own session; every process a payload started is killed with that session when it ends."""
    import json
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    errors = folder / "unguarded.err"
    with open(errors, "wb") as stderr:  # not a pipe: a started process holding it open would hold the read
        process = subprocess.Popen([sys.executable, "-m", "tests.forged_pickles", str(folder), str(wait_s)],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr,
                                   start_new_session=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        try:
            process.communicate(json.dumps(cases).encode(), timeout=wait_s + 300)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its session: the runner and what the payloads started
            except ProcessLookupError:
                pass
    assert process.returncode == 0, errors.read_text()[-3000:]
    return {tuple(case) for case in json.loads((folder / "ran.json").read_text())}


def _run_unguarded(folder: Path, wait_s: float) -> None:
    """``python -m tests.forged_pickles FOLDER WAIT_S``: the cases on stdin read unguarded; the ones that ran, in
    ``FOLDER/ran.json``."""
    import json
    import sys
    import time

    from merge_engine.formats.safe_unpickler import SafeUnpickler

    SafeUnpickler.find_class = pickle.Unpickler.find_class  # the allow-list removed (in this process only)
    cases = [tuple(case) for case in json.load(sys.stdin)]
    markers = {}
    for number, (reader, payload) in enumerate(cases):
        gadget, protocol, opcode = BY_ID[payload]
        case_folder = folder / str(number)
        case_folder.mkdir(parents=True)
        markers[(reader, payload)] = case_folder / "pwned"
        _, read = READERS[reader].place(case_folder, forged(gadget, markers[(reader, payload)], protocol, opcode,
                                                            READERS[reader].module))
        try:
            read()
        except Exception:  # noqa: BLE001 - what the reader makes of the payload's result does not matter here
            pass
    deadline = time.monotonic() + wait_s  # a started process creates its marker in its own time
    while not all(m.exists() for m in markers.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (folder / "ran.json").write_text(json.dumps([case for case, marker in markers.items() if marker.exists()]))


if __name__ == "__main__":
    import sys

    _run_unguarded(Path(sys.argv[1]), float(sys.argv[2]))


__all__ = ["BY_ID", "ENCODINGS", "GADGETS", "INDEX_MODULE", "Inert", "PAYLOADS", "PAYLOAD_IDS", "RANK_FILES", "READERS",
           "TORCH_MODULE", "forged", "struct", "unguarded_runs", "zip_with_pickle"]
