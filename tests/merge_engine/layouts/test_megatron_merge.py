"""Megatron -> Hugging Face merges are exact on every real megatron-core checkpoint of the matrix.

Specification (issue 3, points 1, 2, 5, 6), for every fixture (legacy verl, Megatron-LM per-rank,
torch_dist v1 / v2 / Megatron-LM, bridge export; TP x PP 1x1 .. 2x2, VPP 2, TP > KV heads, tied
and untied, EP 2, TE names, all seven families):
- the layout's canonical Megatron tensors == the reference Megatron state, bit for bit (the
  layouts undo TP / PP / VPP / EP and TE names, nothing else);
- the merged Hugging Face folder == the reference Hugging Face weights, bit for bit, same names
  (Mixtral ``block_sparse_moe.experts.N.w1/w2/w3``, Qwen MoE ``mlp.experts.N.gate_proj``...);
- transformers loads it with no missing or unexpected key, and its logits match megatron-core's
  forward pass on the same prompt within 1e-4 (measured by the fixture author: 2.5e-6 untied,
  1.6e-5 tied);
- the written names are the Hub names: exactly what ``save_pretrained`` writes for the merged
  config (per-expert ``mlp.experts.N.gate_proj``, not transformers' fused in-memory tensors);
- mixed dense / MoE layers (first dense layers, ``mlp_only_layers``) from torch_dist (per-layer
  keys) and TE-named legacy files; DeepSeek-V3 (MLA, sigmoid router + bias, shared experts) and GLM-4.5;
- DeepSeek's multi-token-prediction layer is refused unless ``--mtp-layers`` says ``export`` (the
  Hub layout: ``model.layers.L`` with its own embed_tokens / shared_head copies) or ``drop``;
- ``merge --backend megatron`` (verl's flags), ``check`` and ``test`` work from the command line;
  Megatron-LM runs are read from the iteration folder or from the run root (tracker file).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.cli import main
from merge_engine.layouts import check_checkpoint, open_checkpoint
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from tests.fixtures_merged import megatron_checkpoint_url, megatron_hf_model_path
from synthetic_runs.megatron import (
    REFERENCE_HF_DIR,
    REFERENCE_INPUT_IDS_FILE,
    REFERENCE_LOGITS_FILE,
    REFERENCE_STATE_FILE,
    megatron_fixture_matrix,
)

MATRIX = megatron_fixture_matrix()
NAMES = sorted(MATRIX)
MEGATRON_SOURCES = [n for n in NAMES if MATRIX[n].fmt != "bridge_v2"]
LOGITS_TOLERANCE = 1e-4
EXPECTED_LAYOUT = {"legacy": "megatron_legacy", "megatron_lm": "megatron_legacy", "megatron_lm_dist": "megatron_dist",
                   "dist_v1": "megatron_dist", "dist_v2": "megatron_dist", "bridge_v2": "megatron_bridge"}


checkpoint_url = megatron_checkpoint_url  # the names the Megatron tests import
hf_model_path = megatron_hf_model_path


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.fixture(scope="module")
def merged(merged_megatron) -> dict[str, str]:
    """Every fixture merged once with ``--backend megatron`` (the session's `merged_megatron`)."""
    return merged_megatron


@pytest.mark.parametrize("name", MEGATRON_SOURCES)
def test_canonical_tensors_are_the_reference_megatron_state(megatron_runs, name):
    """The layout alone (no family table) reproduces the TP=PP=EP=1 Megatron state exactly."""
    job = megatron_runs[name]
    checkpoint = check_checkpoint(checkpoint_url(job), "megatron")
    assert checkpoint.layout == EXPECTED_LAYOUT[job.spec.fmt]
    reference = load_file(str(job.reference_dir / REFERENCE_STATE_FILE))
    source = open_checkpoint(checkpoint)
    try:
        names = set(source.metas())
        # tied with PP > 1: the last stage's copy of the embedding is kept (the plan checks it)
        tied_copy = {"output_layer.weight"} if job.spec.tie_word_embeddings and job.spec.pp > 1 and \
            job.spec.fmt in ("legacy", "megatron_lm") else set()
        assert names == set(reference) | tied_copy
        for tensor_name, value in reference.items():
            assert torch.equal(source.read(tensor_name), value), tensor_name
        for tensor_name in tied_copy:
            assert torch.equal(source.read(tensor_name), reference["embedding.word_embeddings.weight"])
    finally:
        source.close()


@pytest.mark.parametrize("name", NAMES)
def test_merge_is_bit_exact(megatron_runs, merged, name):
    """Same names, shapes, dtypes and bytes as the reference Hugging Face model."""
    reference = _tensors(str(megatron_runs[name].reference_dir / REFERENCE_HF_DIR))
    ours = _tensors(merged[name])
    assert set(ours) == set(reference)
    for tensor_name, value in reference.items():
        assert ours[tensor_name].dtype == value.dtype and torch.equal(ours[tensor_name], value), tensor_name
    provenance = json.loads(open(os.path.join(merged[name], "stepmerge.json")).read())
    assert provenance["layout"] == EXPECTED_LAYOUT[MATRIX[name].fmt]


@pytest.mark.parametrize("name", NAMES)
def test_transformers_logits_match_megatron_core(megatron_runs, merged, name):
    """transformers loads the merged folder strictly and reproduces megatron-core's logits."""
    from transformers import AutoModelForCausalLM

    job = megatron_runs[name]
    model, info = AutoModelForCausalLM.from_pretrained(merged[name], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
    expected = torch.load(job.reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < LOGITS_TOLERANCE


def test_moe_names_are_the_families_own(merged):
    """Mixtral keeps block_sparse_moe with w1/w2/w3; Qwen MoE mlp.experts.N.*_proj and a shared expert."""
    mixtral = _tensors(merged["mixtral_ep2_legacy"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in mixtral
    assert "model.layers.0.block_sparse_moe.gate.weight" in mixtral
    assert not any(".mlp." in n for n in mixtral)
    qwen2_moe = _tensors(merged["qwen2_moe_ep2_dist_v2"])
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in qwen2_moe
    assert "model.layers.3.mlp.shared_expert_gate.weight" in qwen2_moe


def test_config_and_tokenizer_come_along(merged):
    """verl legacy keeps them in hf_config_and_tokenizer/: copied, dtype recorded."""
    folder = merged["llama_tp2_pp2_vpp2_legacy"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    assert json.loads(open(os.path.join(folder, "config.json")).read())["dtype"] == "float32"


def test_megatron_lm_run_root_uses_the_tracker(megatron_runs, tmp_path):
    """Pointing at a Megatron-LM run root reads the iteration latest_checkpointed_iteration.txt names."""
    job = megatron_runs["qwen2_pp2_vpp2_tied_megatron_lm"]
    checkpoint = check_checkpoint(str(job.step_dir.parent), "megatron")
    assert checkpoint.url == str(job.step_dir)
    assert checkpoint.parallel == {"tp": 1, "pp": 2, "ep": 1, "vpp": 2}
    dist = check_checkpoint(str(megatron_runs["mixtral_tp2_megatron_lm_dist"].step_dir.parent), "megatron")
    assert dist.layout == "megatron_dist" and dist.url.endswith("iter_0000001")


def test_parallel_sizes_are_reported(megatron_runs):
    checkpoint = check_checkpoint(checkpoint_url(megatron_runs["qwen2_moe_pp2_ep2_te_legacy"]))
    assert checkpoint.layout == "megatron_legacy"
    assert checkpoint.parallel == {"tp": 1, "pp": 2, "ep": 2, "vpp": 1}
    assert checkpoint.hf_dir.endswith("hf_config_and_tokenizer")


# ---- the command line ----------------------------------------------------------------------------


def test_cli_merge_with_verl_flags(megatron_runs, tmp_path, capsys):
    """verl's spelling: merge --backend megatron --local_dir ... --target_dir ... --tie-word-embedding."""
    job = megatron_runs["mistral_tp2_pp2_tied_dist_v2"]
    target = tmp_path / "out"
    code = main(["merge", "--backend", "megatron", "--local_dir", checkpoint_url(job), "--target_dir", str(target),
                 "--tie-word-embedding", "--use_cpu_initialization"])
    assert code == 0
    assert "merged megatron_dist checkpoint" in capsys.readouterr().out
    reference = _tensors(str(job.reference_dir / REFERENCE_HF_DIR))
    ours = _tensors(str(target))
    assert set(ours) == set(reference) and all(torch.equal(ours[k], v) for k, v in reference.items())


def test_cli_check_and_test(megatron_runs, capsys):
    job = megatron_runs["llama_tp2_pp2_te_legacy"]
    assert main(["check", "--backend", "megatron", "--local_dir", checkpoint_url(job)]) == 0
    assert "complete megatron_legacy checkpoint" in capsys.readouterr().out
    code = main(["test", "--backend", "megatron", "--local_dir", checkpoint_url(job), "--test_hf_dir",
                 str(job.reference_dir / REFERENCE_HF_DIR), "--atol", "0", "--rtol", "0"])
    assert code == 0
    assert "validation passed (" in capsys.readouterr().out


def test_cli_test_catches_a_different_model(megatron_runs, capsys):
    """`test` against another model (Qwen3, head_dim 32) fails with exit 5 and says where."""
    job = megatron_runs["llama_tp1_pp1_legacy"]
    code = main(["test", "--backend", "megatron", "--local_dir", checkpoint_url(job), "--test_hf_dir",
                 str(megatron_runs["qwen3_tp2_kv1_legacy"].reference_dir / REFERENCE_HF_DIR)])
    assert code == 5
    out = capsys.readouterr().out
    assert "FAILED" in out and "self_attn" in out


# ---- Hub names, DeepSeek's multi-token-prediction layers ---------------------------------------------

HUB_NAME_CASES = ["mixtral_ep2_legacy", "qwen2_moe_mixed_tp2_ep2_te_legacy", "qwen3_moe_dense0_pp2_ep2_dist_v1",
                  "deepseek_v3_pp2_ep2_dist_v2", "glm4_moe_tp2_ep2_dist_v1", "qwen2_tp2_pp1_tied_legacy"]


def save_pretrained_names(config_dir: str, tmp_path) -> set[str]:
    """The tensor names ``save_pretrained`` writes for the config in ``config_dir`` (a tiny random model)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    model.save_pretrained(tmp_path)
    names = set()
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / name), "pt") as f:
                names |= set(f.keys())
    return names


@pytest.mark.parametrize("name", HUB_NAME_CASES)
def test_written_names_are_what_save_pretrained_writes(merged, name, tmp_path):
    """The merged folder holds exactly the names transformers' own save_pretrained writes for its
    config.json (the Hub format every reader loads), dense, mixed, MLA and MoE families alike."""
    assert set(_tensors(merged[name])) == save_pretrained_names(merged[name], tmp_path)


@pytest.mark.parametrize("name", ["deepseek_v3_pp2_ep2_dist_v2", "deepseek_v3_ep2_legacy", "deepseek_v3_tp2_ep2_legacy"])
def test_mtp_layers_are_exported_or_dropped_never_silently(megatron_runs, merged, name, tmp_path):
    """No choice: a MappingError naming --mtp-layers, nothing written. ``drop``: the reference model
    (test_merge_is_bit_exact), num_nextn_predict_layers 0. ``export``: the reference conversion WITH
    the MTP layer (model.layers.4 with enorm, hnorm, eh_proj, shared_head.norm and copies of the
    embedding and head) bit for bit, num_nextn_predict_layers 1; transformers loads it, reporting
    only the MTP layer's keys as unexpected (it skips DeepSeek's MTP layer), with the same logits."""
    from transformers import AutoModelForCausalLM

    from merge_engine.errors import MappingError
    from synthetic_runs.megatron import reference_state_dict, reference_to_hf

    job = megatron_runs[name]
    with pytest.raises(MappingError, match="--mtp-layers export"):
        merge_checkpoint(checkpoint_url(job), str(tmp_path / "refused"), OutputOptions(backend="megatron"))
    assert not (tmp_path / "refused").exists()
    assert json.loads(open(os.path.join(merged[name], "config.json")).read())["num_nextn_predict_layers"] == 0
    exported = str(tmp_path / "exported")
    merge_checkpoint(checkpoint_url(job), exported, OutputOptions(backend="megatron", mtp_layers="export"))
    expected = reference_to_hf(job.spec, reference_state_dict(job.spec, job.seed), mtp=True)
    ours = _tensors(exported)
    assert set(ours) == set(expected) and "model.layers.4.shared_head.head.weight" in ours
    assert all(torch.equal(ours[k], v) for k, v in expected.items())
    assert json.loads(open(os.path.join(exported, "config.json")).read())["num_nextn_predict_layers"] == 1
    from merge_engine.validate import validate_structure

    assert all(check.ok for check in validate_structure(exported).checks)  # MTP keys allowed as the config counts them
    model, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and info["unexpected_keys"]
    assert all(k.startswith("model.layers.4.") for k in info["unexpected_keys"])
    ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected_logits = torch.load(job.reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
    assert (logits - expected_logits).abs().max().item() < LOGITS_TOLERANCE


def test_cli_mtp_layers_flag(megatron_runs, tmp_path, capsys):
    """``--mtp-layers drop`` on the command line; without it the merge fails and says which flag to pass."""
    job = megatron_runs["deepseek_v3_ep2_legacy"]
    assert main(["merge", "--backend", "megatron", "--local_dir", checkpoint_url(job), "--target_dir",
                 str(tmp_path / "refused")]) != 0
    assert "--mtp-layers" in capsys.readouterr().err
    assert main(["merge", "--backend", "megatron", "--local_dir", checkpoint_url(job), "--target_dir",
                 str(tmp_path / "dropped"), "--mtp-layers", "drop"]) == 0
    assert "model.layers.4.enorm.weight" not in _tensors(str(tmp_path / "dropped"))
