"""The one safetensors parser: exact reads, and every malformed header refused with the file named.

Specification: tensors read back bit for bit; overlapping ranges, ranges before the data section,
ranges that do not match dtype and shape, a non-object header, trailing bytes and truncation are
`CorruptShard` / `IncompleteCheckpoint` naming the file — never garbage values.
"""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from merge_engine.errors import CorruptShard, IncompleteCheckpoint
from merge_engine.formats.safetensors_file import SafetensorsFile


def _raw(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def test_reads_back_exactly(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int16), "c": torch.randn(2).bfloat16()}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(str(tmp_path / "m.safetensors"))
    for name, value in tensors.items():
        assert torch.equal(f.tensors()[name].read(), value)
    f.close()


BAD = {
    "overlap": ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, CorruptShard),
    "negative": ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, 8, CorruptShard),
    "size_mismatch": ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, CorruptShard),
    "unknown_dtype": ({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, 8, CorruptShard),
    "trailing": ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 12, CorruptShard),
    "truncated": ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, IncompleteCheckpoint),
    # issue 9, case 11: these were tracebacks or silent truncations
    "metadata_a_string": ({"__metadata__": "ab", "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8,
                          CorruptShard),
    "float_shape": ({"x": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}, 8, CorruptShard),
    "entry_a_list": ({"x": [1, 2]}, 8, CorruptShard),
    "dtype_a_list": ({"x": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, 8, CorruptShard),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_headers_are_refused(tmp_path, case):
    header, data_len, error = BAD[case]
    path = _raw(tmp_path / f"{case}.safetensors", header, bytes(data_len))
    with pytest.raises(error) as info:
        SafetensorsFile(path)
    assert info.value.path == path


def test_header_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.safetensors"
    raw = b"[1, 2]"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptShard, match="not a JSON object"):
        SafetensorsFile(str(path))


def test_deeply_nested_header_is_corrupt_not_a_recursion_error(tmp_path):
    """Issue 9, case 11: a header nested 100 000 deep raised RecursionError out of the parser."""
    path = tmp_path / "nested.safetensors"
    raw = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptShard, match="nested too deeply") as info:
        SafetensorsFile(str(path))
    assert info.value.path == str(path)


def test_a_header_naming_a_tensor_twice_is_refused(tmp_path):
    """Found by the fuzz test: Python's json keeps the last of two ``"c"`` entries, the safetensors
    library refuses the header: two readers would disagree about the file, so it is refused."""
    entry = '{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
    raw = ('{"c": ' + entry + ', "c": ' + entry + "}").encode()
    path = tmp_path / "twice.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(CorruptShard, match="'c' twice"):
        SafetensorsFile(str(path))


def test_a_header_listing_too_many_tensors_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    """A header of ~1.34 M zero-size tensors fits the 100 MB header bound and cost 2.9 GB through a merge:
    a file listing more than `MAX_TENSORS` tensors is `CorruptShard` naming it, refused before a single
    entry is built (the parse below is made to fail the test if reached)."""
    import tracemalloc

    from merge_engine.formats import safetensors_file

    count = safetensors_file.MAX_TENSORS + 2
    header = {f"junk.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    path = _raw(tmp_path / "junk.safetensors", header, b"")
    del header
    monkeypatch.setattr(safetensors_file, "parse_json", lambda *a, **k: pytest.fail("the header was parsed"))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptShard, match=f"more than the {safetensors_file.MAX_TENSORS} tensors") as info:
            SafetensorsFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.path == path
    assert peak < 3 * (tmp_path / "junk.safetensors").stat().st_size  # the header's bytes, not its entries


def test_a_header_at_the_tensor_bound_is_read(tmp_path):
    from merge_engine.formats import safetensors_file

    count = 1000
    header = {f"t.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    header["__metadata__"] = {"format": "pt"}
    path = _raw(tmp_path / "ok.safetensors", header, b"")
    assert len(SafetensorsFile(path).tensors()) == count < safetensors_file.MAX_TENSORS
