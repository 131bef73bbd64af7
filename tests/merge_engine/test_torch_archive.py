"""TorchArchive: lazy, safe reading of torch.save files.

Specification:
- the object tree comes back with StoredTensor leaves whose bytes equal what torch.save wrote,
  for every dtype, views with offsets (padded storage), non-contiguous views and scalars;
- nothing in a pickle runs: a global outside the allow-list raises UnsafePickle before any call;
- empty, truncated and foreign files raise IncompleteCheckpoint / CorruptShard naming the file.
"""

import io
import os
import pickle
import zipfile

import pytest
import torch

from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsafePickle
from merge_engine.torch_archive import StoredTensor, TorchArchive

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]


def _save(path, obj):
    torch.save(obj, path)
    return str(path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_reads_back_exactly(tmp_path, dtype):
    """Each dtype's bytes come back identical, and metadata matches before any byte is read."""
    torch.manual_seed(0)
    value = (torch.randn(7, 5) * 10).to(dtype)
    archive = TorchArchive(_save(tmp_path / "a.pt", {"w": value}))
    stored = archive.load()["w"]
    assert isinstance(stored, StoredTensor)
    assert (stored.shape, stored.dtype) == ((7, 5), dtype)
    assert torch.equal(stored.read(), value)


def test_views_with_offsets_and_strides(tmp_path):
    """Narrowed views of a larger (padded) storage and transposed views read as the view, not the storage."""
    base = torch.arange(60, dtype=torch.float32)
    padded_view = base[10:40].view(6, 5)  # like FSDP2's short shard over padded storage
    transposed = torch.arange(12.0).view(3, 4).t()
    scalar = torch.tensor(3.5)
    tree = TorchArchive(_save(tmp_path / "v.pt", {"p": padded_view, "t": transposed, "s": scalar})).load()
    assert tree["p"].offset == 10
    assert torch.equal(tree["p"].read(), padded_view)
    assert not tree["t"].is_contiguous()
    assert torch.equal(tree["t"].read(), transposed)
    assert torch.equal(tree["s"].read(), scalar)
    assert torch.equal(tree["p"].read_flat(7, 9), padded_view.reshape(-1)[7:16])


def test_nested_containers_and_parameters(tmp_path):
    value = {"model": [{"a": torch.nn.Parameter(torch.ones(2))}, {"b": torch.zeros(3, dtype=torch.int64)}],
             "step": 7, "name": "x", "nothing": None}
    tree = TorchArchive(_save(tmp_path / "n.pt", value)).load()
    assert tree["step"] == 7 and tree["name"] == "x" and tree["nothing"] is None
    assert torch.equal(tree["model"][0]["a"].read(), torch.ones(2))
    assert torch.equal(tree["model"][1]["b"].read(), torch.zeros(3, dtype=torch.int64))


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _zip_with_pickle(path, payload: bytes):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")
    return str(path)


def test_code_in_a_pickle_never_runs(tmp_path):
    """A .pt whose pickle would call os.system raises UnsafePickle and the command does not run."""
    marker = tmp_path / "pwned"
    path = _zip_with_pickle(tmp_path / "evil.pt", pickle.dumps({"w": _Exploit(marker)}, protocol=2))
    with pytest.raises(UnsafePickle) as info:
        TorchArchive(path).load()
    assert "posix.system" in str(info.value) or "os.system" in str(info.value)
    assert info.value.path == path
    assert not marker.exists()


def test_torch_load_weights_only_agrees_that_it_is_unsafe(tmp_path):
    """Sanity: torch's own weights_only loader also refuses the file we refuse."""
    path = _zip_with_pickle(tmp_path / "evil.pt", pickle.dumps(_Exploit(tmp_path / "x"), protocol=2))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


def test_empty_truncated_and_foreign_files(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(IncompleteCheckpoint) as info:
        TorchArchive(str(empty))
    assert info.value.path == str(empty)

    good = _save(tmp_path / "good.pt", {"w": torch.randn(1000)})
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptShard) as info:
        TorchArchive(str(truncated)).load()
    assert info.value.path == str(truncated)

    legacy = tmp_path / "legacy.pt"
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer, _use_new_zipfile_serialization=False)
    legacy.write_bytes(buffer.getvalue())
    with pytest.raises(CorruptShard):
        TorchArchive(str(legacy))


def test_storage_record_shorter_than_pickle_claims(tmp_path):
    """A storage whose record is cut short (zip rewritten) is caught before reading garbage."""
    good = _save(tmp_path / "good.pt", {"w": torch.arange(100, dtype=torch.float32)})
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if "/data/" in info.filename:
                data = data[:40]
            dst.writestr(info.filename, data)
    with pytest.raises(CorruptShard, match="holds 40 bytes"):
        TorchArchive(str(bad)).load()["w"].read()


def test_a_pickle_cannot_alter_the_allow_listed_objects(tmp_path):
    """BUILD on an allow-listed function or class (to poison later loads) is refused, and later loads are clean."""

    def stream(module: str, name: str) -> bytes:
        # GLOBAL module name; EMPTY_DICT; MARK; 'x'; 1; DICT... -> BUILD with slot state {"x": 1}
        return (b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"N}X\x01\x00\x00\x00xK\x01s\x86b.")

    for module, name in [("torch._utils", "_rebuild_parameter"), ("torch", "Tensor"),
                         ("torch.distributed.tensor", "DTensor")]:
        path = _zip_with_pickle(tmp_path / f"{name}.pt", stream(module, name))
        with pytest.raises((UnsafePickle, CorruptShard)):
            TorchArchive(path).load()
    tree = TorchArchive(_save(tmp_path / "clean.pt", {"w": torch.nn.Parameter(torch.ones(2))})).load()
    assert torch.equal(tree["w"].read(), torch.ones(2))
    from merge_engine.torch_archive import record_class

    assert not hasattr(record_class("torch.distributed.tensor", "DTensor"), "x")


def test_a_compressed_pickle_is_refused(tmp_path):
    good = _save(tmp_path / "good.pt", {"w": torch.ones(2)})
    bad = tmp_path / "deflated.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            kind = zipfile.ZIP_DEFLATED if info.filename.endswith("data.pkl") else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info.filename), compress_type=kind)
    with pytest.raises(CorruptShard, match="compressed"):
        TorchArchive(str(bad)).load()
