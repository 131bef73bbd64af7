"""Forged pickles against every pickle reader of the formats (issue 26): nothing in them runs.

Specification, for each forged payload of `tests.forged_pickles` (``subprocess.Popen`` and ``io.FileIO`` reached
by a dotted name out of an allowed module, ``os.system``, ``builtins.eval`` / ``exec``, ``getattr`` walks,
``copyreg``, ``functools.partial``, ``operator.attrgetter``, a ``__reduce_ex__`` gadget; protocols 0-5, GLOBAL
and STACK_GLOBAL) read as
- a ``torch.save`` archive's ``data.pkl`` (`TorchArchive.load`),
- a bare pickle (`safe_unpickle`), and a DCP folder's ``.metadata`` (`read_index`):
the read is `UnsafePickle` naming the file, no marker file is created and no child process is started.
The allow-list is exact (module, name) pairs: a dotted name is refused even under a module whose classes are
records, and ``getattr`` reaches only the nested record classes listed (`pickle_globals.NESTED_RECORDS`).
"""

from __future__ import annotations

import pickle

import pytest

from merge_engine.errors import UnsafePickle
from merge_engine.formats.torch_archive import TorchArchive
from merge_engine.formats.safe_unpickler import safe_unpickle
from merge_engine.formats.dcp_index import read_index
from tests.forged_pickles import INDEX_MODULE, PAYLOAD_IDS, PAYLOADS, TORCH_MODULE, Inert, forged, zip_with_pickle

MODULES = [TORCH_MODULE, INDEX_MODULE]  # a module the old allow-list admitted wholesale, and the engine's own


@pytest.mark.parametrize("module", MODULES, ids=["torch_module", "engine_module"])
@pytest.mark.parametrize(("gadget", "protocol", "opcode"), PAYLOADS, ids=PAYLOAD_IDS)
def test_a_forged_torch_archive_runs_nothing(gadget, protocol, opcode, module, tmp_path):
    marker = tmp_path / "pwned"
    path = str(zip_with_pickle(tmp_path / "evil.pt", forged(gadget, marker, protocol, opcode, module)))
    with Inert(marker), pytest.raises(UnsafePickle) as error:
        TorchArchive(path).load()
    assert error.value.path == path


@pytest.mark.parametrize(("gadget", "protocol", "opcode"), PAYLOADS, ids=PAYLOAD_IDS)
def test_a_forged_dcp_metadata_runs_nothing(gadget, protocol, opcode, tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "dcp").mkdir()
    metadata = tmp_path / "dcp" / ".metadata"
    metadata.write_bytes(forged(gadget, marker, protocol, opcode, TORCH_MODULE))
    with Inert(marker), pytest.raises(UnsafePickle) as error:
        read_index(str(tmp_path / "dcp"))
    assert error.value.path == str(metadata)


@pytest.mark.parametrize(("gadget", "protocol", "opcode"), PAYLOADS, ids=PAYLOAD_IDS)
def test_a_forged_bare_pickle_runs_nothing(gadget, protocol, opcode, tmp_path):
    marker = tmp_path / "pwned"
    with Inert(marker), pytest.raises(UnsafePickle) as error:
        safe_unpickle(forged(gadget, marker, protocol, opcode, INDEX_MODULE), "mem://forged")
    assert error.value.path == "mem://forged"


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


def test_a_plain_unpickler_would_have_run_them(tmp_path):
    """The payloads are real: a plain ``pickle.loads`` runs one (so the tests above test something)."""
    from tests.forged_pickles import GADGETS

    marker = tmp_path / "ran"
    gadget = next(g for g in GADGETS if g.name == "exec")
    pickle.loads(forged(gadget, marker, 5, "STACK_GLOBAL", INDEX_MODULE))
    assert marker.exists()
