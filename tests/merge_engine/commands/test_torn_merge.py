"""No torn merge (issue 17 point 1): a rank file replaced mid-merge by a same-size file of other tensor
bytes is `SourceChanged` naming it, and nothing is written; the fingerprint in ``stepmerge.json`` is
therefore always of the bytes that were read.

Specification, on a local folder, SeaweedFS (S3) and fake-gcs-server (GCS):
- the replacement is a valid torch archive of exactly the same size (every tensor record rewritten,
  its zip CRC-32 fixed), so neither a size check nor the CRC check could see it: only the pinned
  version can;
- it lands after the merge wrote its first chunk (locally: rewritten in place, the same inode);
  read-ahead is off and chunks are small, so later reads must ask the store;
- the merge raises `SourceChanged` with the rank file's URL; the target does not exist afterwards;
- a local rank file replaced by a rename between the check and the open (a new inode) is
  `SourceChanged` too; and a merge whose files did not change still succeeds (control);
- a metadata file (``huggingface/tokenizer_config.json``, read whole, not pinned) rewritten mid-merge is
  `SourceChanged` naming it: the checkpoint is listed again before ``stepmerge.json`` is written.
"""

from __future__ import annotations

import os
import shutil
import zipfile
import io

import pytest

from merge_engine import storage
from merge_engine.errors import SourceChanged
from merge_engine.layouts import check_checkpoint
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.formats.zip_records import rewrite_records

VARIANT = "fsdp2_qwen2"
RANK_FILE = "model_world_size_4_rank_1.pt"
OPTIONS = OutputOptions(chunk_bytes=4096)


@pytest.fixture(autouse=True)
def no_read_ahead(monkeypatch):
    monkeypatch.setattr(storage.tuning, "READ_AHEAD_BUDGET", 0)


def _source(kind: str, fsdp_runs, tmp_path, request) -> str:
    local = fsdp_runs[VARIANT].latest.checkpoint_dir
    if kind == "local":
        target = str(tmp_path / "source")
        shutil.copytree(local, target)
        return target
    bucket = request.getfixturevalue("s3_bucket_url" if kind == "s3" else "gcs_bucket_url")
    remote = storage.join(bucket, "run", "global_step_1", "actor")
    storage.copy_tree(local, remote)
    return remote


def _replacement(original: bytes) -> bytes:
    new = rewrite_records(original)
    assert len(new) == len(original) and new != original
    assert zipfile.ZipFile(io.BytesIO(new)).testzip() is None  # a valid archive: every CRC right
    return new


@pytest.mark.parametrize("kind", ["local", "s3", "gs"])
def test_a_rank_file_replaced_mid_merge_is_source_changed_and_nothing_is_written(kind, fsdp_runs, tmp_path,
                                                                                 request):
    source = _source(kind, fsdp_runs, tmp_path, request)
    rank_url = storage.join(source, RANK_FILE)
    new = _replacement(storage.read_bytes(rank_url))
    target = str(tmp_path / "merged")
    replaced = []

    def replace_once(nbytes: int) -> None:
        if replaced:
            return
        if kind == "local":
            with open(rank_url, "r+b") as f:  # in place: the same inode
                f.write(new)
        else:
            storage.write_bytes(rank_url, new)
        replaced.append(nbytes)

    with pytest.raises(SourceChanged) as caught:
        merge_checkpoint(source, target, OPTIONS, on_bytes=replace_once)
    assert replaced, "the merge never wrote a chunk before failing"
    assert caught.value.path == rank_url
    assert not os.path.exists(target)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".merged")]  # no temp folder left


def test_a_local_rank_file_renamed_over_after_the_check_is_source_changed(fsdp_runs, tmp_path):
    source = _source("local", fsdp_runs, tmp_path, None)
    checkpoint = check_checkpoint(source)
    rank_path = os.path.join(source, RANK_FILE)
    fresh = os.path.join(source, "fresh.tmp")
    with open(fresh, "wb") as f:
        f.write(_replacement(open(rank_path, "rb").read()))
    os.replace(fresh, rank_path)
    target = str(tmp_path / "merged")
    with pytest.raises(SourceChanged) as caught:
        merge_checkpoint(source, target, OPTIONS, checkpoint=checkpoint)
    assert caught.value.path == rank_path
    assert not os.path.exists(target)


def test_an_unchanged_checkpoint_merges_with_pinned_reads(fsdp_runs, tmp_path):
    source = _source("local", fsdp_runs, tmp_path, None)
    result = merge_checkpoint(source, str(tmp_path / "merged"), OPTIONS)
    assert result.tensors > 0 and os.path.exists(os.path.join(result.target_url, "stepmerge.json"))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_metadata_file_changed_mid_merge_is_source_changed(kind, fsdp_runs, tmp_path, request):
    source = _source(kind, fsdp_runs, tmp_path, request)
    changed_url = storage.join(source, "huggingface", "tokenizer_config.json")
    original = storage.read_bytes(changed_url)
    target = str(tmp_path / "merged")
    changed = []

    def change_once(nbytes: int) -> None:
        if not changed:
            storage.write_bytes(changed_url, original.replace(b"}", b', "padding_side": "left"}', 1))
            changed.append(nbytes)

    with pytest.raises(SourceChanged) as caught:
        merge_checkpoint(source, target, OPTIONS, on_bytes=change_once)
    assert changed and caught.value.path == changed_url
    assert not os.path.exists(target)
