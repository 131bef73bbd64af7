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

import pytest
import torch
from safetensors.torch import load_file

from merge_engine import storage
from merge_engine.errors import TargetExists
from merge_engine.merge import PROVENANCE_FILE, MergeOptions, merge_checkpoint
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
    result = merge_checkpoint(step.checkpoint_dir, str(tmp_path / "bf16"), MergeOptions(dtype="bfloat16"))
    reference = load_file(step.reference_state_dict)
    got = _merged_tensors(result.target_url)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"


def test_small_max_shard_size_gives_index_that_transformers_loads(fsdp_runs, tmp_path):
    step = fsdp_runs["fsdp2_qwen2"].latest
    result = merge_checkpoint(step.checkpoint_dir, str(tmp_path / "sharded"), MergeOptions(max_shard_size=100_000))
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
                                MergeOptions(overwrite=True))
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
