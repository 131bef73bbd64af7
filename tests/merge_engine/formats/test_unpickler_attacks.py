"""Forged pickles against every pickle reader of the formats: nothing in them runs.

Specification, for each forged payload of `tests.forged_pickles` (``subprocess.Popen`` / ``os.popen`` and
``os.system`` reached by a dotted name out of an allowed module, ``os.system``, ``builtins.eval`` / ``exec``,
``getattr`` walks, ``copyreg``, ``functools.partial``, ``operator.attrgetter``, a ``__reduce_ex__`` gadget;
protocols 0-5, GLOBAL and STACK_GLOBAL) read as
- a ``torch.save`` archive's ``data.pkl`` (`TorchArchive.load`),
- a bare pickle (`safe_unpickle`), and a DCP folder's ``.metadata`` (`read_index`):
the read is `UnsafePickle` naming the file, no marker file is created and no child process is started.
Each payload is real: read by the same readers with the allow-list removed, it creates its marker (a sample of
every payload, through the readers of both this file and the rank-file tests, in a child process).
The allow-list is exact (module, name) pairs: a dotted name is refused even under a module whose classes are
records, and ``getattr`` reaches only the nested record classes listed (`pickle_globals.NESTED_RECORDS`).
"""

from __future__ import annotations

import itertools

import pytest

from merge_engine.errors import UnsafePickle
from merge_engine.formats.safe_unpickler import safe_unpickle
from tests.forged_pickles import PAYLOAD_IDS, PAYLOADS, READERS, Inert, forged, unguarded_runs

FORMAT_READERS = ["torch_archive", "torch_archive_engine_module", "dcp_metadata", "bare_pickle"]


@pytest.mark.parametrize("reader", FORMAT_READERS)
@pytest.mark.parametrize(("gadget", "protocol", "opcode"), PAYLOADS, ids=PAYLOAD_IDS)
def test_a_forged_pickle_runs_nothing(reader, gadget, protocol, opcode, tmp_path):
    marker = tmp_path / "pwned"
    path, read = READERS[reader].place(tmp_path, forged(gadget, marker, protocol, opcode, READERS[reader].module))
    with Inert(marker), pytest.raises(UnsafePickle) as error:
        read()
    assert error.value.path == path


def test_every_payload_runs_code_when_the_allow_list_is_removed(tmp_path):
    """The payloads above (and the rank-file tests') are stopped by the allow-list, not inert: each one, for each
    allowed module it starts from, creates its marker through one of the readers when ``find_class`` is a plain
    unpickler's (readers taken in turn, so each reader reads a share)."""
    by_module: dict[str, list[str]] = {}
    for name, reader in READERS.items():
        by_module.setdefault(reader.module, []).append(name)
    turns = {module: itertools.cycle(names) for module, names in by_module.items()}
    cases = [(next(turns[module]), payload) for module in turns for payload in PAYLOAD_IDS]
    assert {reader for reader, _ in cases} == set(READERS)
    ran = unguarded_runs(cases, tmp_path)
    assert sorted(set(cases) - ran) == []


def _global(module: str, name: str, protocol: int) -> bytes:
    """A pickle of the bare global ``module.name`` through STACK_GLOBAL (protocol 4+) or GLOBAL."""
    def short(text: str) -> bytes:
        return b"\x8c" + bytes([len(text)]) + text.encode()

    op = short(module) + short(name) + b"\x93" if protocol >= 4 else f"c{module}\n{name}\n".encode()
    return bytes([0x80, protocol]) + op + b"."


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize(("module", "name"), [
    ("torch.distributed.tensor", "DTensor.__init__"),  # a dotted name under an allowed pair
    ("torch.distributed.checkpoint.metadata", "os.system"),  # a dotted name under a module of records
    ("torch.distributed.checkpoint.metadata", "Unknown"),  # a name no checkpoint pickles, under that module
    ("torch.distributed", "ProcessGroup"),
    ("numpy.dtypes", "ObjectDType"),
    ("numpy", "load"),
    ("torch._utils", "_rebuild_tensor_v2.__globals__"),
])
def test_only_exact_pairs_are_answered(module, name, protocol):
    with pytest.raises(UnsafePickle) as error:
        safe_unpickle(_global(module, name, protocol), "mem://globals")
    assert error.value.path == "mem://globals"


@pytest.mark.parametrize("attribute", ["__init__", "__globals__", "mro", "ProcessGroup", "Shard"])
def test_getattr_reaches_only_the_listed_nested_classes(attribute):
    owner = b"ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n"
    stream = b"\x80\x02cbuiltins\ngetattr\n(" + owner + b"X" + len(attribute).to_bytes(4, "little") \
        + attribute.encode() + b"tR."
    with pytest.raises(UnsafePickle, match="getattr"):
        safe_unpickle(stream, "mem://getattr")
    nested = b"\x80\x02cbuiltins\ngetattr\n(" + owner + b"X\x11\x00\x00\x00ProcessGroupStatetR."
    found = safe_unpickle(nested, "mem://getattr")  # what protocol 2 writes for ShardedTensor.ProcessGroupState
    assert (found.module, found.qualname) == ("torch.distributed._shard.sharded_tensor.api",
                                              "ShardedTensor.ProcessGroupState")
