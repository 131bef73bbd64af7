"""Runs of the trainers that save with torch.distributed.checkpoint go through the same pipeline as verl's.

The session's ``dcp_runs`` (a tiny Qwen2, FSDP2 over 2 gloo ranks, saved by Accelerate's own save_fsdp_model into
HF Trainer's ``checkpoint-1/pytorch_model_fsdp_0/``, by ``torch.distributed.checkpoint.save`` into ``step-1/``, and by
torch's HuggingFaceStorageWriter into ``step-1/``) are copied to a bucket of the session's SeaweedFS server (the HF
Trainer step, saved without a config, is not submitted until ``hf_model_path`` names one); merge_new_steps discovers,
checks, merges, validates and publishes each to s3://. So are a NeMo-RL run (its DTensor policy's DCP weights in
``step_N/policy/weights/``, a ``tmp_step_N`` beside still being saved) and a torchtitan run (``step-N/``, its own
names, config from ``hf_model_path``). Each release is judged from outside stepmerge (`tests.release_checks`): the weights the
step was sharded from, bit for bit, and transformers' logits of that model, exactly. Every ranged GET the S3
backend sends is counted: the DCP index (``.metadata``) and each rank file's safetensors header are fetched once
(the check parses them; the merge builds its source from what the check carried); a re-run of the step is a
cache hit that fetches no byte of the step's files.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import MergeStepParams, WatchParams
from merge_engine import storage
from merge_engine.commands.merge import read_provenance
from merge_engine.release.verify import verify_folder
from tests.fixtures_storage import upload_step
from tests.release_checks import assert_model_logits, assert_release_weights_equal, load_model

LAYOUT = {"accelerate": "torch_dcp", "torch_dcp": "torch_dcp", "dcp_hf": "dcp_hf"}




def _metadata_ranges(copied: dict[str, Path]) -> dict[str, int]:
    """URL -> how many leading bytes are metadata: the model's DCP index whole (the optimizer's is never read), a
    safetensors rank file's length + header."""
    ranges = {}
    for url, path in copied.items():
        if path.name == ".metadata" and path.parent.name != "optimizer_0":
            ranges[url] = path.stat().st_size
        elif path.name.startswith("shard-") and path.suffix == ".safetensors":
            with open(path, "rb") as handle:
                ranges[url] = 8 + struct.unpack("<Q", handle.read(8))[0]
    return ranges


@pytest.mark.parametrize("writer", LAYOUT)
def test_a_dcp_run_on_s3_is_discovered_merged_validated_and_published(prefect, dcp_runs, s3_bucket_url, tmp_path,
                                                                      s3_gets, writer):
    step = dcp_runs[writer]
    run_root = f"{s3_bucket_url}/run"
    copied = upload_step(step.step_dir, run_root)
    if writer == "accelerate":  # HF Trainer saved no config: not submitted until one is named, nothing published
        bare = WatchParams(run_root=run_root, release_root=f"{s3_bucket_url}/releases",
                           staging_root=str(tmp_path / "staging"))
        with pytest.raises(RuntimeError, match="not submitted.*no config.json saved with the weights.*hf_model_path"):
            merge_new_steps(**bare.flow_parameters())
        assert not storage.list_files(bare.release_root_url, recursive=True)
    params = WatchParams(run_root=run_root, release_root=f"{s3_bucket_url}/releases",
                         staging_root=str(tmp_path / "staging"),
                         hf_model_path=step.reference_hf_dir if writer == "accelerate" else None)
    watch = merge_new_steps(**params.flow_parameters())
    (outcome,) = watch.outcomes
    (release,) = outcome.releases
    assert outcome.status == "published" and release.validation_ok and release.url.startswith("s3://")
    assert verify_folder(release.url).ok
    assert read_provenance(release.url)["layout"] == LAYOUT[writer]
    # judged from outside: the weights the step was sharded from, and transformers' logits of that model
    assert_release_weights_equal(release.url, load_file(os.path.join(step.reference_dir, "state_dict.safetensors")))
    assert_model_logits(release.url, load_model(step.reference_hf_dir))

    never = [u for u, _, _ in s3_gets if "/optimizer_0/" in u]
    assert not never, never  # Accelerate's optimizer state is not the model's: not a byte of it is read
    metadata = _metadata_ranges(copied)
    assert metadata  # the index, or every rank file's header
    for url, length in metadata.items():
        fetched = sum(max(0, min(end, length) - start) for u, start, end in s3_gets if u == url)
        assert fetched == length, f"{url}: {fetched} metadata bytes fetched for {length}"

    s3_gets.clear()
    again = merge_step(**MergeStepParams(run_root=run_root, step=1, role="", release_root=params.release_root,
                                         staging_root=params.staging_root,
                                         hf_model_path=params.hf_model_path).flow_parameters())
    assert again.cached and [r.url for r in again.releases] == [release.url]
    assert not [u for u, _, _ in s3_gets if u in copied]  # a re-run reads no byte of the step's files


def test_a_nemo_rl_run_on_s3_is_discovered_merged_validated_and_published(prefect, dcp_runs, s3_bucket_url,
                                                                          tmp_path):
    """NeMo-RL saves ``{"model": ModelState}`` by DCP into ``step_N/policy/weights/`` (written as ``tmp_step_N`` and
    renamed once whole); the DCP files here are Accelerate's, which have that shape (NeMo-RL does not run here)."""
    step = dcp_runs["accelerate"]
    weights = Path(step.step_dir) / "pytorch_model_fsdp_0"
    run_root = f"{s3_bucket_url}/nemo_run"
    for folder in ("step_3", "tmp_step_4"):  # tmp_step_4: still being saved, not a step yet
        for path in sorted(p for p in weights.rglob("*") if p.is_file()):
            storage.copy_file(str(path), storage.join(run_root, folder, "policy", "weights",
                                                      path.relative_to(weights).as_posix()))
    params = WatchParams(run_root=run_root, release_root=f"{s3_bucket_url}/nemo_releases", roles=("policy",),
                         staging_root=str(tmp_path / "staging"), hf_model_path=step.reference_hf_dir)
    watch = merge_new_steps(**params.flow_parameters())
    (outcome,) = watch.outcomes
    (release,) = outcome.releases
    assert (outcome.step, outcome.status) == (3, "published") and release.validation_ok
    assert verify_folder(release.url).ok and read_provenance(release.url)["layout"] == "torch_dcp"
    assert_release_weights_equal(release.url, load_file(os.path.join(step.reference_dir, "state_dict.safetensors")))
    assert_model_logits(release.url, load_model(step.reference_hf_dir))


def test_a_torchtitan_run_on_s3_is_discovered_merged_validated_and_published(prefect, s3_bucket_url, tmp_path):
    """A torchtitan ``step-N/`` (torch's own ``dcp.save`` of torchtitan's names, Llama's q/k rows in its RoPE order)
    is published as the Hub model it was converted from, bit for bit (torchtitan saves no config:
    ``hf_model_path``); before its ``.metadata`` is written it is still being written, nothing published."""
    from tests.merge_engine.layouts.test_torchtitan import _torchtitan_step

    step, hf_dir, model = _torchtitan_step(tmp_path / "local", "llama")
    run_root = f"{s3_bucket_url}/titan_run"
    index = step / ".metadata"
    written_last = index.read_bytes()
    index.unlink()  # DCP writes its index last: until then the step is still being written
    upload_step(step, run_root)
    params = WatchParams(run_root=run_root, release_root=f"{s3_bucket_url}/titan_releases",
                         staging_root=str(tmp_path / "staging"), hf_model_path=str(hf_dir))
    waiting = merge_new_steps(**params.flow_parameters())
    assert waiting.outcomes == [] and len(waiting.waiting) == 1 and waiting.waiting[0].startswith("20 ")
    assert not storage.list_files(params.release_root_url, recursive=True)
    storage.write_bytes(storage.join(run_root, step.name, ".metadata"), written_last)
    watch = merge_new_steps(**params.flow_parameters())
    (outcome,) = watch.outcomes
    (release,) = outcome.releases
    assert (outcome.step, outcome.status) == (20, "published") and release.validation_ok
    assert verify_folder(release.url).ok and read_provenance(release.url)["layout"] == "torchtitan"
    assert_release_weights_equal(release.url, model.state_dict())
    assert_model_logits(release.url, model)
