"""A checked checkpoint carries its parsed tensor index (`merge_engine.layouts.tensor_index`, issue 18 point 5).

Specification, on the session's verl FSDP2 and legacy Megatron (TP 2) checkpoints:
- a checked checkpoint, pickled (as a Prefect result or a Ray task carries it) and opened, reads not one
  byte and gives the same tensors, bit for bit, as opening it from its rank files' headers;
- a `MergeJob` pickled after its preparation (what every `ShardTask` carries to a Ray worker) prepares
  again in the worker without reading a byte of its checkpoint: no rank file's pickle is read again;
- the carried index stays pinned to what the check listed: a rank file rewritten since is `SourceChanged`
  naming it (local: when opened; s3://: at the first read, S3 refusing the listed ETag);
- bounded: an index over `MAX_INDEX_BYTES` is not carried, and `open` reads the headers as before;
- a carried index is JSON rebuilt by the engine's constructors, never a pickle: a pickle under its tag is
  `UnsafeRecord`; it names dtypes by name (attacks on it: test_tensor_index_attacks.py);
- the check records the LoRA verdict from the names it read (`Checkpoint.lora`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from merge_engine import storage
from merge_engine.commands.merge import MergeJob
from merge_engine.errors import SourceChanged, UnsafeRecord
from merge_engine.layouts import check_checkpoint, open_checkpoint, tensor_index
from merge_engine.output.jobs import OutputOptions
from merge_engine.storage.range_reader import bytes_read
from tests.pickle_reads import pickle_fetches, pickle_range

MEGATRON = "qwen2_tp2_pp1_tied_legacy"


def _checkpoint_dir(name: str, fsdp_runs, megatron_runs) -> str:
    if name == "fsdp":
        return fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    return str(Path(megatron_runs[MEGATRON].step_dir) / "actor")


@pytest.fixture(params=["fsdp", "megatron_legacy"])
def checked(request, fsdp_runs, megatron_runs):
    return check_checkpoint(_checkpoint_dir(request.param, fsdp_runs, megatron_runs))


def test_a_carried_checkpoint_opens_without_reading_and_gives_the_same_tensors(checked):
    assert checked.index is not None and checked.lora is False
    carried = pickle.loads(pickle.dumps(checked))
    before = bytes_read()
    source = open_checkpoint(carried)
    assert bytes_read() == before  # no header, no pickle: nothing read
    reread = open_checkpoint(dataclasses.replace(checked, index=None))  # from the rank files' headers
    try:
        assert source.metas() == reread.metas()
        for name in reread.metas():
            assert torch.equal(source.read(name), reread.read(name)), name
        source.verify_reads()  # the zip records' CRC-32 checked through the carried archives
    finally:
        source.close()
        reread.close()


def test_a_pickled_merge_job_prepares_again_reading_no_byte(megatron_runs, tmp_path, monkeypatch):
    source = str(Path(megatron_runs[MEGATRON].step_dir) / "actor")
    job = MergeJob(source, str(tmp_path / "out"), OutputOptions(dtype="bfloat16"))
    job.fingerprint()
    job.prepare().close()
    blob = pickle.dumps(job)  # what a ShardTask carries to a Ray worker

    reads: list[tuple[str, int, int]] = []
    original = storage.RangeReader.read_into

    def read_into(self, offset, buffer):
        reads.append((self.url, offset, offset + memoryview(buffer).nbytes))
        return original(self, offset, buffer)

    monkeypatch.setattr(storage.RangeReader, "read_into", read_into)
    worker = pickle.loads(blob).prepare()
    worker.close()
    assert reads == []
    ranks = sorted(Path(source).glob("model/mp_rank_*/model.pt"))
    assert len(ranks) == 2 and all(pickle_fetches(reads, str(r), pickle_range(r)) == 0 for r in ranks)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_rank_file_changed_since_the_check_is_a_named_error(where, megatron_runs, tmp_path, request):
    local = tmp_path / "actor"
    shutil.copytree(Path(megatron_runs[MEGATRON].step_dir) / "actor", local)
    url = str(local)
    if where == "s3":
        url = f"{request.getfixturevalue('s3_bucket_url')}/actor"
        storage.copy_tree(str(local), url)
    checked = check_checkpoint(url)
    rank = "model/mp_rank_01/model.pt"
    data = (local / rank).read_bytes()
    changed = data[:-1] + bytes([data[-1] ^ 1])  # same size, one bit of the zip directory's tail flipped
    if where == "s3":
        storage.write_bytes(storage.join(url, rank), changed)
    else:
        os.replace(_written(tmp_path / "new.pt", changed), local / rank)

    with pytest.raises(SourceChanged) as error:
        source = open_checkpoint(checked)
        try:
            for name in source.metas():
                source.read(name)
        finally:
            source.close()
    assert error.value.path == storage.join(url, rank)


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _opens_reading_the_headers(checkpoint, names: set[str]) -> None:
    """``open_checkpoint`` reads the rank files' headers again and finds the tensors ``names``."""
    before = bytes_read()
    opened = open_checkpoint(checkpoint)
    try:
        assert bytes_read() > before
        assert set(opened.metas()) == names
    finally:
        opened.close()


def test_an_index_over_the_bound_is_not_carried_and_open_reads_the_headers(megatron_runs, monkeypatch):
    source = str(Path(megatron_runs[MEGATRON].step_dir) / "actor")
    carried = check_checkpoint(source)
    names = set(tensor_index.restore(carried)[0])
    pickled = len(zlib.decompress(carried.index[len(tensor_index._tag()):]))
    monkeypatch.setattr(tensor_index, "MAX_INDEX_BYTES", pickled - 1)
    bounded = check_checkpoint(source)
    assert bounded.index is None and bounded == carried
    _opens_reading_the_headers(bounded, names)


@pytest.mark.parametrize("callable_", [os.getcwd, storage.remove], ids=["foreign", "an_engine_function"])
def test_a_pickled_index_is_never_unpickled(callable_, fsdp_runs):
    """An index is JSON: a pickle under the right tag (what an older engine carried, or a forgery) is refused."""
    checkpoint = check_checkpoint(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir)
    forged = tensor_index._tag() + zlib.compress(pickle.dumps(({"w": callable_}, ())))
    with pytest.raises(UnsafeRecord, match="not valid JSON") as error:
        tensor_index.restore(dataclasses.replace(checkpoint, index=forged))
    assert error.value.path == checkpoint.url


def test_a_carried_index_names_dtypes_by_name_and_no_global(fsdp_runs):
    import json

    checkpoint = check_checkpoint(fsdp_runs["fsdp2_qwen2_tied_bf16"].latest.checkpoint_dir)
    document = json.loads(zlib.decompress(checkpoint.index[len(tensor_index._tag()):]))
    assert set(document) == {"format", "files", "storages", "tensors"}
    assert {storage[2] for storage in document["storages"]} == {"bfloat16"}
    tensors, handles = tensor_index.restore(checkpoint)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16} and handles


def test_an_index_another_engine_carried_is_not_read_and_open_reads_the_headers(fsdp_runs, monkeypatch):
    """An index from Prefect's result storage of an older engine (another format) is not read."""
    carried = check_checkpoint(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir)
    names = set(tensor_index.restore(carried)[0])
    monkeypatch.setattr(tensor_index, "INDEX_FORMAT", tensor_index.INDEX_FORMAT + 1)
    assert tensor_index.restore(carried) is None
    untagged = dataclasses.replace(carried, index=zlib.compress(pickle.dumps(({}, ()))))
    assert tensor_index.restore(untagged) is None  # no tag at all
    _opens_reading_the_headers(carried, names)


def test_the_check_records_the_lora_verdict(fsdp_runs):
    assert check_checkpoint(fsdp_runs["lora_fsdp2_qwen2_r2"].latest.checkpoint_dir).lora is True
    assert check_checkpoint(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir).lora is False
