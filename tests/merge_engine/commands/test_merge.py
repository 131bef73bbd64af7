"""FSDP -> Hugging Face merges are exact, on every layout verl writes, from every storage backend.

Specification (issue 2, points 5 and 7):
- for every fixture variant (FSDP1 mesh / ShardedTensor, FSDP2, Shard(1), HSDP, 1 rank, tied and
  untied, fp32 and bf16, buffers, critic, SFT): merged tensors == the weights that were sharded,
  bit for bit, in the stored dtype; tied lm_head left out because the config ties it;
- `AutoModelFor*.from_pretrained(merged)` gives exactly the reference model's logits (a critic
  loads as a token-classification model);
- `--dtype bfloat16` is the only cast, and equals torch's own cast of the reference;
- config, generation config, tokenizer and chat template are copied; the tokenizer loads;
- the same merge from s3:// and gs:// (and to s3://) gives the same bytes as from a local path;
- a second merge to the same target is a no-op; a different model there is refused.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from merge_engine import storage
from merge_engine.errors import TargetExists
from merge_engine.commands.merge import PROVENANCE_FILE, merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from synthetic_runs import fixture_matrix

PLAIN_VARIANTS = sorted(name for name, spec in fixture_matrix().items() if spec.lora is None)
TOKENS = torch.tensor([[1, 5, 9, 42, 7, 300, 2, 11]])


def _merged_tensors(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def _auto_class(folder: str):
    import transformers

    architecture = json.load(open(os.path.join(folder, "config.json")))["architectures"][0]
    if architecture.endswith("ForTokenClassification"):
        return transformers.AutoModelForTokenClassification
    return transformers.AutoModelForCausalLM


@pytest.fixture(scope="module")
def merged(fsdp_runs, tmp_path_factory):
    """Every plain variant merged once (local to local) for the checks below."""
    out = tmp_path_factory.mktemp("merged")
    return {name: merge_checkpoint(fsdp_runs[name].latest.checkpoint_dir, str(out / name)) for name in PLAIN_VARIANTS}


@pytest.mark.parametrize("variant", PLAIN_VARIANTS)
def test_merge_is_bit_exact(variant, fsdp_runs, merged):
    """Every output tensor equals the reference in value and dtype; only a tied lm_head is left out."""
    step = fsdp_runs[variant].latest
    reference = load_file(step.reference_state_dict)
    got = _merged_tensors(merged[variant].target_url)
    expected_missing = {"lm_head.weight"} if step.spec.model.tie_word_embeddings else set()
    assert set(reference) - set(got) == expected_missing
    assert set(got) <= set(reference)
    for name, tensor in got.items():
        assert tensor.dtype == reference[name].dtype, name
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("variant", PLAIN_VARIANTS)
def test_merged_model_gives_reference_logits(variant, fsdp_runs, merged):
    step = fsdp_runs[variant].latest
    folder = merged[variant].target_url
    cls = _auto_class(folder)
    model = cls.from_pretrained(folder).eval()
    reference = cls.from_pretrained(step.reference_hf_dir).eval()
    if step.spec.model.task == "token_classification":
        assert type(model).__name__.endswith("ForTokenClassification")
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)


def test_metadata_files_are_copied_and_tokenizer_loads(fsdp_runs, merged):
    from transformers import AutoTokenizer

    folder = merged["fsdp2_qwen2"].target_url
    names = set(os.listdir(folder))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            PROVENANCE_FILE} <= names
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "hello merged world"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["dtype"] == "float32"
    provenance = json.load(open(os.path.join(folder, PROVENANCE_FILE)))
    assert provenance["parallel"]["world_size"] == 4 and provenance["fingerprint"] == merged["fsdp2_qwen2"].fingerprint


def test_dtype_option_is_the_only_cast(fsdp_runs, tmp_path):
    step = fsdp_runs["fsdp1_mesh_qwen2"].latest
    result = merge_checkpoint(step.checkpoint_dir, str(tmp_path / "bf16"), OutputOptions(dtype="bfloat16"))
    reference = load_file(step.reference_state_dict)
    got = _merged_tensors(result.target_url)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"


def test_small_max_shard_size_gives_index_that_transformers_loads(fsdp_runs, tmp_path):
    step = fsdp_runs["fsdp2_qwen2"].latest
    result = merge_checkpoint(step.checkpoint_dir, str(tmp_path / "sharded"), OutputOptions(max_shard_size=100_000))
    index = json.load(open(tmp_path / "sharded" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 3
    assert index["metadata"]["total_size"] == result.tensor_bytes
    reference = load_file(step.reference_state_dict)
    assert set(_merged_tensors(result.target_url)) == set(reference)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result.target_url)
    assert torch.equal(model.state_dict()["model.norm.weight"], reference["model.norm.weight"])


def test_rerun_is_a_noop_and_a_different_model_is_refused(fsdp_runs, tmp_path):
    target = str(tmp_path / "out")
    first = merge_checkpoint(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir, target)
    before = {n: os.path.getmtime(os.path.join(target, n)) for n in os.listdir(target)}
    again = merge_checkpoint(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir, target)
    assert again.skipped and again.fingerprint == first.fingerprint
    assert before == {n: os.path.getmtime(os.path.join(target, n)) for n in os.listdir(target)}
    with pytest.raises(TargetExists) as info:
        merge_checkpoint(fsdp_runs["fsdp2_llama_buffer_mqa"].latest.checkpoint_dir, target)
    assert info.value.path == target
    replaced = merge_checkpoint(fsdp_runs["fsdp2_llama_buffer_mqa"].latest.checkpoint_dir, target,
                                OutputOptions(overwrite=True))
    assert not replaced.skipped
    assert "model.extra_persistent_buffer" in _merged_tensors(target)


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_remote_source_and_target_give_the_same_bytes(backend, fsdp_runs, merged, tmp_path, request):
    """Checkpoint uploaded to a real S3 / GCS server: merged from there (to local and to the bucket)."""
    bucket = request.getfixturevalue("s3_bucket_url" if backend == "s3" else "gcs_bucket_url")
    variant = "fsdp2_qwen2_tied_bf16"
    local_source = fsdp_runs[variant].latest.checkpoint_dir
    remote_source = storage.join(bucket, "run", "global_step_1", "actor")
    storage.copy_tree(local_source, remote_source)

    local_target = str(tmp_path / "from_remote")
    from_remote = merge_checkpoint(remote_source, local_target)
    expected = merged[variant].target_url
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert open(os.path.join(local_target, name), "rb").read() == \
            open(os.path.join(expected, name), "rb").read(), name
    assert from_remote.tensor_bytes == merged[variant].tensor_bytes

    remote_target = storage.join(bucket, "merged")
    merge_checkpoint(remote_source, remote_target)
    assert storage.read_bytes(storage.join(remote_target, "model.safetensors")) == \
        open(os.path.join(expected, "model.safetensors"), "rb").read()
    again = merge_checkpoint(remote_source, remote_target)
    assert again.skipped


def test_a_changed_hf_model_path_config_is_merged_again(fsdp_runs, tmp_path):
    """--hf_model_path's content is part of the cache key: editing its config.json re-merges."""
    import shutil

    step = fsdp_runs["fsdp2_qwen2"].latest
    config_dir = tmp_path / "config"
    shutil.copytree(os.path.join(step.checkpoint_dir, "huggingface"), config_dir)
    target = str(tmp_path / "out")
    options = OutputOptions(hf_model_path=str(config_dir))
    merge_checkpoint(step.checkpoint_dir, target, options)
    config = json.loads((config_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (config_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetExists):  # another output now: never "already holds this merge"
        merge_checkpoint(step.checkpoint_dir, target, options)
    again = merge_checkpoint(step.checkpoint_dir, target, OutputOptions(hf_model_path=str(config_dir), overwrite=True))
    assert not again.skipped
    assert json.load(open(os.path.join(target, "config.json")))["rms_norm_eps"] == 1e-5


def test_a_damaged_output_is_rebuilt_not_skipped(fsdp_runs, tmp_path):
    """A target whose provenance matches but whose weights were deleted or truncated is rebuilt."""
    step = fsdp_runs["fsdp2_qwen2"].latest
    target = tmp_path / "out"
    merge_checkpoint(step.checkpoint_dir, str(target))
    weights = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(weights[:1000])
    rebuilt = merge_checkpoint(step.checkpoint_dir, str(target))
    assert not rebuilt.skipped
    assert (target / "model.safetensors").read_bytes() == weights
    (target / "model.safetensors").unlink()
    assert not merge_checkpoint(step.checkpoint_dir, str(target)).skipped
    assert merge_checkpoint(step.checkpoint_dir, str(target)).skipped


def test_lora_alpha_from_lora_adapter_folder_is_part_of_the_key(fsdp_runs, tmp_path):
    """Older verl runs keep lora_alpha in lora_adapter/adapter_config.json: changing it re-merges."""
    import shutil

    run = tmp_path / "actor"
    shutil.copytree(fsdp_runs["lora_fsdp1_mesh_qwen2"].latest.checkpoint_dir, run)
    meta = json.loads((run / "lora_train_meta.json").read_text())
    (run / "lora_train_meta.json").unlink()
    (run / "lora_adapter").mkdir()
    adapter_config = {"peft_type": "LORA", "r": meta["r"], "lora_alpha": meta["lora_alpha"],
                      "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    (run / "lora_adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    target = str(tmp_path / "out")
    first = merge_checkpoint(str(run), target)
    before = load_file(os.path.join(target, "model.safetensors"))
    adapter_config["lora_alpha"] = meta["lora_alpha"] * 2
    (run / "lora_adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    second = merge_checkpoint(str(run), target, OutputOptions(overwrite=True))
    assert not second.skipped and second.fingerprint != first.fingerprint
    after = load_file(os.path.join(target, "model.safetensors"))
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"],
                           after["model.layers.0.self_attn.q_proj.weight"])


def test_debris_of_killed_runs_never_blocks_a_retry(fsdp_runs, tmp_path, s3_bucket_url):
    """Local: temp folders of dead processes are swept, empty folders at the target are fine.
    Remote: a run killed mid-write leaves a partial marker; the retry rebuilds instead of refusing."""
    import subprocess
    import sys

    from merge_engine.layouts import check_checkpoint
    from merge_engine.commands.merge import merge_fingerprint
    from merge_engine.output.target import PARTIAL_FILE

    from merge_engine.output import local_commit

    from merge_engine.output import process_identity

    source = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / ".out.stepmerge-tmp-deadbeef"
    live = tmp_path / ".out.stepmerge-tmp-cafecafe"
    for folder, pid in ((stale, int(dead.stdout)), (live, os.getppid())):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        owner = {**process_identity.current(), "pid": pid, "start": process_identity.process_start(pid),
                 "heartbeat": time.time()}  # (test_local_commit covers the owner rules in full)
        (tmp_path / (folder.name + local_commit.OWNER_SUFFIX)).write_text(json.dumps(owner))
    (tmp_path / "out" / "empty_subfolder").mkdir(parents=True)
    merge_checkpoint(source, str(tmp_path / "out"))
    assert not stale.exists() and live.exists()
    assert (tmp_path / "out" / "model.safetensors").exists()

    target = storage.join(s3_bucket_url, "merged")
    fingerprint = merge_fingerprint(check_checkpoint(source), OutputOptions())
    storage.write_bytes(storage.join(target, PARTIAL_FILE), json.dumps({"fingerprint": fingerprint}).encode())
    storage.write_bytes(storage.join(target, "model.safetensors"), b"half a shard")
    rebuilt = merge_checkpoint(source, target)
    assert not rebuilt.skipped
    assert PARTIAL_FILE not in {e.path for e in storage.list_files(target)}
    storage.write_bytes(storage.join(target + "2", PARTIAL_FILE), json.dumps({"fingerprint": "another"}).encode())
    with pytest.raises(TargetExists):  # someone else's debris is not ours to delete
        merge_checkpoint(source, target + "2")


def test_an_output_of_an_older_output_revision_is_not_taken_for_current(fsdp_runs, tmp_path, monkeypatch):
    """The same input and options merged by an engine whose output revision (merge_engine.OUTPUT_REVISION,
    bumped when the bytes written change under one __version__) is older: neither the target nor a release
    recorded from it counts as this merge's output; it is refused as other input, rebuilt with overwrite."""
    import merge_engine
    from merge_engine.layouts import check_checkpoint
    from merge_engine.commands.merge import merge_fingerprint
    from merge_engine.release.manifest import Manifest
    from merge_engine.release.state import ReleaseState, PUBLISHED

    step = fsdp_runs["fsdp2_qwen2"].latest
    target = str(tmp_path / "out")
    current = merge_engine.OUTPUT_REVISION
    monkeypatch.setattr(merge_engine, "OUTPUT_REVISION", current - 1)
    old = merge_checkpoint(step.checkpoint_dir, target)
    assert json.load(open(os.path.join(target, PROVENANCE_FILE)))["output_revision"] == current - 1
    monkeypatch.setattr(merge_engine, "OUTPUT_REVISION", current)
    fingerprint = merge_fingerprint(check_checkpoint(step.checkpoint_dir), OutputOptions())
    assert fingerprint != old.fingerprint
    released_old = ReleaseState("mem://r", PUBLISHED, Manifest("src", old.fingerprint, merge_engine.__version__, {},
                                                               None, "now", "a", ()))
    assert not released_old.holds(fingerprint)  # the pipeline does not report 'skipped' on it
    with pytest.raises(TargetExists):
        merge_checkpoint(step.checkpoint_dir, target)
    again = merge_checkpoint(step.checkpoint_dir, target, OutputOptions(overwrite=True))
    assert not again.skipped and again.fingerprint == fingerprint
    assert json.load(open(os.path.join(target, PROVENANCE_FILE)))["output_revision"] == current
    assert merge_checkpoint(step.checkpoint_dir, target).skipped
