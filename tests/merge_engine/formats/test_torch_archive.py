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
from merge_engine.formats.stored_tensor import StoredTensor
from merge_engine.formats.torch_archive import TorchArchive

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool,
          # no typed storage of their own: torch saves these with ``_rebuild_tensor_v3`` over an untyped storage
          torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32]


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
    read = stored.read()
    assert read.dtype == dtype and read.view(torch.uint8).tolist() == value.view(torch.uint8).tolist()


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
    from merge_engine.formats.safe_unpickler import record_class

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


# --- issue 9, cases 5 and 12: the bytes on disk, not the pickle, bound what a tensor is ---------------


class _Storage:
    """Pickles as a torch storage persistent id: ``('storage', torch.FloatStorage, key, 'cpu', numel)``."""

    def __init__(self, key, numel):
        self.key, self.numel = key, numel


class _View:
    """Pickles as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride)``, whatever the numbers."""

    def __init__(self, storage, offset, shape, stride):
        self.args = (storage, offset, tuple(shape), tuple(stride))

    def __reduce__(self):
        import collections

        return (torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict()))


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def forged_archive(path, tree, records: dict[str, bytes]) -> str:
    """A torch.save-shaped zip whose pickle says whatever ``tree`` says (views forged with `_View`)."""
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=2).dump(tree)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buffer.getvalue())
        for key, data in records.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")
    return str(path)


def test_a_zero_stride_view_cannot_make_one_element_a_matrix(tmp_path):
    """Case 5: torch.save of ``zeros(1).expand(1000, 1000)`` stores 4 bytes and strides (0, 0): the view
    would stand for 4 MB (or, at larger sizes, any output size) from nothing on disk. Refused at load."""
    path = _save(tmp_path / "expanded.pt", {"w": torch.zeros(1).expand(1000, 1000)})
    assert os.path.getsize(path) < 2000
    with pytest.raises(CorruptShard, match="more than once") as info:
        TorchArchive(path).load()
    assert info.value.path == path


@pytest.mark.parametrize("offset, shape, stride, message", [
    (0, (10, 10), (10, 1), "needs 100 elements; its storage holds 10"),
    (8, (4,), (1,), "needs 12 elements"),
    (0, (3, 4), (1, 1), "more than once"),
    (-1, (2,), (1,), "negative"),
    (0, (2, -3), (1, 1), "negative"),
    (0, (2, 2), (1,), "differ in length"),
    (11, (0,), (1,), "past its storage"),
], ids=["past-the-end", "offset-past-the-end", "self-overlap", "negative-offset", "negative-size", "ranks",
        "empty-past-the-end"])
def test_views_that_claim_more_than_their_storage_are_refused(tmp_path, offset, shape, stride, message):
    storage = _Storage("0", 10)
    path = forged_archive(tmp_path / "v.pt", {"w": _View(storage, offset, shape, stride)},
                          {"0": torch.arange(10.0).numpy().tobytes()})
    with pytest.raises(CorruptShard, match=message) as info:
        TorchArchive(path).load()
    assert info.value.path == path


def test_overlapping_views_are_refused_and_aliases_are_not(tmp_path):
    """Two names over the same bytes (tied weights, ``w`` and ``w.view(-1)``) are fine; two different
    views sharing some bytes are refused, so output bytes never exceed stored bytes (plus aliases)."""
    data = {"0": torch.arange(10.0).numpy().tobytes()}
    storage = _Storage("0", 10)
    alias = forged_archive(tmp_path / "alias.pt", {"a": _View(storage, 0, (2, 5), (5, 1)),
                                                   "b": _View(storage, 0, (10,), (1,))}, data)
    tree = TorchArchive(alias).load()
    assert torch.equal(tree["a"].read().reshape(-1), tree["b"].read())
    for name, views in {
        "partial": {"a": _View(storage, 0, (6,), (1,)), "b": _View(storage, 4, (6,), (1,))},
        "inside": {"a": _View(storage, 0, (10,), (1,)), "b": _View(storage, 2, (3,), (1,))},
        "strided-over-dense": {"a": _View(storage, 0, (10,), (1,)), "b": _View(storage, 0, (2, 2), (5, 1))},
    }.items():
        path = forged_archive(tmp_path / f"{name}.pt", views, data)
        with pytest.raises(CorruptShard, match="overlap") as info:
            TorchArchive(path).load()
        assert info.value.path == path
    # torch's own view save: a padded storage with two disjoint narrow views is fine
    base = torch.arange(20.0)
    tree = TorchArchive(_save(tmp_path / "halves.pt", {"x": base[:8], "y": base[10:20].view(2, 5)})).load()
    assert torch.equal(tree["y"].read(), base[10:20].view(2, 5))


def test_storage_record_checked_at_load_so_check_agrees_with_merge(tmp_path):
    """Case 12: a record shorter than the pickle says is refused by ``load`` (what ``check`` runs),
    before any tensor is read; so is a record the zip directory places over the next record."""
    good = _save(tmp_path / "good.pt", {"w": torch.arange(100, dtype=torch.float32)})
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info.filename, data[:40] if "/data/" in info.filename else data)
    with pytest.raises(CorruptShard, match="holds 40 bytes, pickle says 400") as info:
        TorchArchive(str(bad)).load()
    assert info.value.path == str(bad)
    storage = _Storage("0", 10)
    missing = forged_archive(tmp_path / "missing.pt", {"w": _View(storage, 0, (10,), (1,))}, {})
    with pytest.raises(CorruptShard, match="missing"):
        TorchArchive(missing).load()


def test_zip_entries_sharing_bytes_are_refused(tmp_path):
    """Two directory entries pointing at one local header would give two storages the same bytes."""
    path = forged_archive(tmp_path / "twice.pt", {"w": torch.zeros(1)}, {})
    data = bytearray(open(path, "rb").read())
    # point the second central-directory entry at the first entry's local header
    first = data.find(b"PK\x01\x02")
    second = data.find(b"PK\x01\x02", first + 4)
    data[second + 42:second + 46] = data[first + 42:first + 46]
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptShard):
        TorchArchive(path).load()


def test_a_non_contiguous_view_is_read_in_bounded_windows(tmp_path, monkeypatch):
    """A transposed tensor read range by range touches at most GATHER_WINDOW_BYTES of storage per read,
    and every range comes back exact."""
    import merge_engine.formats.stored_tensor as stored_tensor

    value = torch.randn(64, 48)
    path = _save(tmp_path / "t.pt", {"w": value.t()})
    monkeypatch.setattr(stored_tensor, "GATHER_WINDOW_BYTES", 256)
    monkeypatch.setattr(stored_tensor, "GATHER_ELEMENTS", 100)
    archive = TorchArchive(path)
    stored = archive.load()["w"]
    reads = []
    original = archive.read_storage_into

    def counting(storage, element_offset, out):
        reads.append(out.numel() * out.element_size())
        original(storage, element_offset, out)

    archive.read_storage_into = counting
    flat = value.t().reshape(-1)
    for start, count in [(0, 48 * 64), (5, 700), (3000, 72)]:
        assert torch.equal(stored.read_flat(start, count), flat[start:start + count])
    assert max(reads) <= 256


def test_tuples_nested_a_million_deep_are_refused_before_they_crash_the_process(tmp_path):
    """Case 11/14: CPython hashes nested tuples recursively without a limit: a 3 MB pickle whose dict
    key is a tuple nested a million deep killed the process (SIGSEGV) inside the unpickler. The
    opcode scan refuses it first, memo references included; deep lists (hashed never) still load."""
    from merge_engine.formats.safe_unpickler import safe_unpickle

    depth = 1_000_000
    key = b"\x80\x02}" + b")" + b"\x85" * depth + b"K\x01s."  # {((((),),),...): 1}
    memo = b"\x80\x02}" + b")" + b"q\x00h\x00h\x00\x86" * depth + b"K\x01s."  # t = (t, t) via the memo
    for data in (key, memo):
        with pytest.raises(CorruptShard, match="nests tuples") as info:
            safe_unpickle(data, "u")
        assert info.value.path == "u"
        path = _zip_with_pickle(tmp_path / "deep.pt", data)
        with pytest.raises(CorruptShard, match="nests tuples"):
            TorchArchive(path).load()
    nested = safe_unpickle(b"\x80\x02" + b"]" * 1000 + b"a" * 999 + b".", "u")
    for _ in range(999):
        (nested,) = nested
    assert nested == []


def test_a_big_endian_archive_is_refused_not_misread(tmp_path):
    """Found by the fuzz test: the ``byteorder`` record was ignored, so a big-endian archive's floats
    would have been read byte-swapped. Refused; torch's own little-endian archives still load."""
    good = _save(tmp_path / "good.pt", {"w": torch.arange(4.0)})
    bad = tmp_path / "big.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = b"big" if info.filename.endswith("/byteorder") else src.read(info.filename)
            dst.writestr(info.filename, data)
    with pytest.raises(CorruptShard, match="byteorder") as info:
        TorchArchive(str(bad)).load()
    assert info.value.path == str(bad)
    assert torch.equal(TorchArchive(good).load()["w"].read(), torch.arange(4.0))
