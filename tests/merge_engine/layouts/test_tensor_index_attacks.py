"""Forged carried tensor indexes and forged rank files (issue 26): nothing runs, nothing outside the checkpoint
is read, nothing allocates past what the files hold.

Specification, on the session's verl FSDP2 checkpoint (a result store or a Ray task hands a worker
`Checkpoint.index` as bytes; whoever can write there can forge them):
- a forged pickle under the index's tag (what the engine carried before, a pickle; one that runs code when
  unpickled) is `UnsafeRecord` naming the checkpoint: the index is JSON, never unpickled, whatever the pickle
  holds (so one payload stands for all): no marker file, no child process;
- a forged JSON index is `UnsafeRecord` too, and opening reads no byte, when it names a file outside the
  checkpoint (a host file, another bucket, a file of another step), pins a listed file to another size, claims
  a storage larger than its zip record or a view past its storage (a tensor a billion elements long over a few
  bytes), names a dtype torch does not have or a record kind the format has none of, holds a bool or a string
  where an integer belongs, nests past the JSON bound or inflates past `MAX_INDEX_BYTES`;
- the rank files themselves (FSDP ``model_world_size_*``, Megatron ``mp_rank_*/model.pt`` and Megatron-LM
  ``model_optim_rng.pt``) holding any forged payload: the check is `UnsafePickle` naming the file, nothing runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
import zlib

import pytest

from merge_engine.errors import UnsafePickle, UnsafeRecord
from merge_engine.layouts import check_checkpoint, open_checkpoint, tensor_index
from merge_engine.storage.range_reader import bytes_read
from tests.forged_pickles import BY_ID, INDEX_MODULE, PAYLOAD_IDS, PAYLOADS, RANK_FILES, READERS, Inert, forged


@pytest.fixture(scope="module")
def checked(fsdp_runs):
    return check_checkpoint(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir)


def _opening_is_refused(checkpoint) -> UnsafeRecord:
    """``open_checkpoint`` of ``checkpoint`` is `UnsafeRecord` naming it, and reads no byte."""
    before = bytes_read()
    with pytest.raises(UnsafeRecord) as error:
        open_checkpoint(checkpoint).close()
    assert error.value.path == checkpoint.url
    assert bytes_read() == before
    return error.value


def test_a_forged_pickle_index_runs_nothing(checked, tmp_path):
    marker = tmp_path / "pwned"
    gadget, protocol, opcode = BY_ID["exec-p5-STACK_GLOBAL"]
    data = forged(gadget, marker, protocol, opcode, INDEX_MODULE)
    with Inert(marker):
        _opening_is_refused(dataclasses.replace(checked, index=tensor_index._tag() + zlib.compress(data)))
    pickle.loads(data)  # what reading it as a pickle would do: the payload is real
    assert marker.exists()


def _document(checkpoint) -> dict:
    return json.loads(zlib.decompress(checkpoint.index[len(tensor_index._tag()):]))


def _carrying(checkpoint, document, raw: bytes | None = None):
    data = json.dumps(document).encode() if raw is None else raw
    return dataclasses.replace(checkpoint, index=tensor_index._tag() + zlib.compress(data))


def _file_url(url):
    def forge(doc):
        doc["files"][0]["url"] = url
    return forge


def _set(path, value):
    """Set ``doc[path[0]][path[1]]...`` to ``value``."""
    def forge(doc):
        at = doc
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = value
    return forge


def _first_piece(doc) -> list:
    return next(entry for entry in doc["tensors"] if entry[1] == "concat")[5][0]


def _huge_view(doc):
    piece = _first_piece(doc)
    piece[2] = [1 << 30] + piece[2][1:]  # a billion rows over the same storage
    piece[3] = [0] * len(piece[3])  # zero strides: every row the same bytes


def _other_step(doc):
    url = doc["files"][0]["url"]
    doc["files"][0]["url"] = re.sub(r"global_step_(\d+)", lambda m: f"global_step_{int(m.group(1)) + 1}", url)
    assert doc["files"][0]["url"] != url


FORGERIES = {
    "host_file": _file_url("/etc/passwd"),
    "file_url": _file_url("file:///etc/shadow"),
    "other_bucket": _file_url("s3://another-bucket/secrets/model_world_size_2_rank_0.pt"),
    "url_with_traversal": lambda doc: _file_url(doc["files"][0]["url"] + "/../../../etc/passwd")(doc),
    "other_step": _other_step,
    "size_not_listed": lambda doc: _set(["files", 0, "size"], doc["files"][0]["size"] + 4096)(doc),
    "version_not_listed": _set(["files", 0, "version"], "forged-etag"),
    "storage_past_its_record": lambda doc: _set(["storages", 0, 3], 1 << 40)(doc),
    "view_past_its_storage": _huge_view,
    "record_outside_data": lambda doc: _set(["files", 0, "records", 0, 0], "../../etc/passwd")(doc),
    "record_past_the_file": lambda doc: _set(["files", 0, "records", 0, 2], 1 << 50)(doc),
    "dtype_not_torch": _set(["storages", 0, 2], "posix.system"),
    "kind_not_in_format": lambda doc: doc["tensors"][0].__setitem__(1, "__reduce__"),
    "bool_for_int": lambda doc: _set(["storages", 0, 3], True)(doc),
    "string_for_int": lambda doc: _set(["storages", 0, 3], "12")(doc),
    "negative_offset": lambda doc: _first_piece(doc).__setitem__(1, -1),
    "storage_out_of_range": lambda doc: _first_piece(doc).__setitem__(0, 10**6),
    "extra_field": _set(["class"], "subprocess.Popen"),
    "other_format": _set(["format"], 2),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_json_index_is_refused_before_any_read(checked, forgery):
    document = copy.deepcopy(_document(checked))
    FORGERIES[forgery](document)
    _opening_is_refused(_carrying(checked, document))


def test_an_index_nested_past_the_bound_or_inflating_past_it_is_refused(checked):
    deep = b"[" * 100_000 + b"]" * 100_000
    assert "nested too deeply" in str(_opening_is_refused(_carrying(checked, None, deep)))
    bomb = b" " * (tensor_index.MAX_INDEX_BYTES + 1)  # ~64 KiB compressed
    assert "inflates past" in str(_opening_is_refused(_carrying(checked, None, bomb)))


def test_the_carried_index_still_opens(checked):
    """The forgeries above are forgeries: the index as carried opens (the same document, re-encoded)."""
    source = open_checkpoint(_carrying(checked, _document(checked)))
    try:
        assert source.metas()
    finally:
        source.close()


# --- the rank files a check reads ----------------------------------------------------------------


@pytest.mark.parametrize("layout", list(RANK_FILES))
@pytest.mark.parametrize(("gadget", "protocol", "opcode"), PAYLOADS, ids=PAYLOAD_IDS)
def test_a_forged_rank_file_runs_nothing(layout, gadget, protocol, opcode, tmp_path):
    """Each payload runs code when read with the allow-list removed (proven in test_unpickler_attacks)."""
    marker = tmp_path / "pwned"
    reader = READERS[f"rank_file_{layout}"]
    path, read = reader.place(tmp_path, forged(gadget, marker, protocol, opcode, reader.module))
    with Inert(marker), pytest.raises(UnsafePickle) as error:
        read()
    assert error.value.path == path


# --- a carried DCP index (`tensor_index.carry_dcp`: a dist or Megatron LoRA step's ``.metadata``) -------------


@pytest.fixture(scope="module")
def dcp_checked(lora_steps):
    checkpoint = check_checkpoint(str(lora_steps["dense_tp2_dist"].step_dir))
    assert checkpoint.index is not None and checkpoint.index.startswith(tensor_index._dcp_tag())
    return checkpoint


def _dcp_document(checkpoint) -> dict:
    return json.loads(zlib.decompress(checkpoint.index[len(tensor_index._dcp_tag()):]))


def _dcp_carrying(checkpoint, document):
    return dataclasses.replace(checkpoint, index=tensor_index._dcp_tag() + zlib.compress(json.dumps(document).encode()))


def _first_chunk(doc) -> list:
    return doc["tensors"][0][3][0]


def _twice(doc):
    doc["tensors"][0][3].append(copy.deepcopy(_first_chunk(doc)))  # one saved chunk standing for two


def _shared_bytes(doc):
    other = next(chunk for entry in doc["tensors"][1:] for chunk in entry[3] if chunk[2] == _first_chunk(doc)[2])
    other[3] = _first_chunk(doc)[3]  # another tensor's item over the same bytes


DCP_FORGERIES = {
    "host_file": lambda doc: _first_chunk(doc).__setitem__(2, "/etc/passwd"),
    "traversal": lambda doc: _first_chunk(doc).__setitem__(2, "../../optimizer/dist_ckpt/__0_0.distcp"),
    "file_not_listed": lambda doc: _first_chunk(doc).__setitem__(2, "__99_0.distcp"),
    "item_past_the_file": lambda doc: _first_chunk(doc).__setitem__(4, 1 << 40),
    "chunk_outside_its_tensor": lambda doc: _first_chunk(doc).__setitem__(0, [1 << 20] * len(_first_chunk(doc)[0])),
    "item_too_short": lambda doc: _first_chunk(doc).__setitem__(4, 1),
    "chunk_twice": _twice,
    "items_sharing_bytes": _shared_bytes,
    "dtype_not_torch": lambda doc: doc["tensors"][0].__setitem__(2, "posix.system"),
    "bool_for_int": lambda doc: _first_chunk(doc).__setitem__(3, True),
    "extra_field": _set(["class"], "subprocess.Popen"),
    "other_format": _set(["format"], 2),
}


@pytest.mark.parametrize("forgery", list(DCP_FORGERIES))
def test_a_forged_dcp_index_is_refused_before_any_read(dcp_checked, forgery):
    document = copy.deepcopy(_dcp_document(dcp_checked))
    DCP_FORGERIES[forgery](document)
    _opening_is_refused(_dcp_carrying(dcp_checked, document))


def test_the_carried_dcp_index_opens_as_the_metadata_file_reads(dcp_checked):
    """The forgeries above are forgeries: the index as carried opens, with the tensors ``.metadata`` gives."""
    carried = open_checkpoint(_dcp_carrying(dcp_checked, _dcp_document(dcp_checked)))
    read = open_checkpoint(dataclasses.replace(dcp_checked, index=None))
    try:
        assert {n: (m.shape, m.dtype) for n, m in carried.metas().items()} == \
               {n: (m.shape, m.dtype) for n, m in read.metas().items()}
        name = next(iter(read.metas()))
        assert carried.read(name).equal(read.read(name))
    finally:
        carried.close()
        read.close()


# --- carried safetensors headers (`tensor_index.carry_headers`: a Hugging Face folder or a bridge export) --------


@pytest.fixture(scope="module")
def hf_checked(lora_steps):
    checkpoint = check_checkpoint(str(lora_steps["dense_tp2"].base_dir), "hf")
    assert checkpoint.index is not None and checkpoint.index.startswith(tensor_index._headers_tag())
    return checkpoint


def _headers_document(checkpoint) -> dict:
    return json.loads(zlib.decompress(checkpoint.index[len(tensor_index._headers_tag()):]))


def _headers_carrying(checkpoint, document):
    return dataclasses.replace(checkpoint,
                               index=tensor_index._headers_tag() + zlib.compress(json.dumps(document).encode()))


def _header_edit(edit):
    def forge(doc):
        header = json.loads(doc["files"][0][2])
        edit(header)
        doc["files"][0][2] = json.dumps(header)
    return forge


def _first_entry(header) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


HEADER_FORGERIES = {
    "host_file": lambda doc: doc["files"][0].__setitem__(0, "/etc/passwd"),
    "traversal": lambda doc: doc["files"][0].__setitem__(0, "../config.json"),
    "file_not_listed": lambda doc: doc["files"][0].__setitem__(0, "other.safetensors"),
    "bytes_past_the_file": _header_edit(lambda h: _first_entry(h).__setitem__("data_offsets", [0, 1 << 40])),
    "shape_not_its_bytes": _header_edit(lambda h: _first_entry(h).__setitem__("shape", [1 << 30])),
    "dtype_not_torch": _header_edit(lambda h: _first_entry(h).__setitem__("dtype", "posix.system")),
    "not_json": lambda doc: doc["files"][0].__setitem__(2, "{not json"),
    "not_text": lambda doc: doc["files"][0].__setitem__(2, 12),
    "extra_field": _set(["class"], "subprocess.Popen"),
    "other_format": _set(["format"], 2),
}


@pytest.mark.parametrize("forgery", list(HEADER_FORGERIES))
def test_forged_safetensors_headers_are_refused_before_any_read(hf_checked, forgery):
    document = copy.deepcopy(_headers_document(hf_checked))
    HEADER_FORGERIES[forgery](document)
    _opening_is_refused(_headers_carrying(hf_checked, document))


def test_the_carried_headers_open_as_the_files_read(hf_checked):
    carried = open_checkpoint(_headers_carrying(hf_checked, _headers_document(hf_checked)))
    read = open_checkpoint(dataclasses.replace(hf_checked, index=None))
    try:
        assert {n: (m.shape, m.dtype) for n, m in carried.metas().items()} == \
               {n: (m.shape, m.dtype) for n, m in read.metas().items()}
        name = next(iter(read.metas()))
        assert carried.read(name).equal(read.read(name))
    finally:
        carried.close()
        read.close()
