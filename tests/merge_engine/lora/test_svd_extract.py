"""SVD extraction from a full fine-tune (`stepmerge extract-lora --base-model B --finetuned F`).

The fine-tune here is PEFT's merge_and_unload of a known adapter (updates of rank <= 4 on q/k/o/gate
projections) plus a changed final norm: a full-rank extraction must reproduce it exactly on the
adapted modules, and report the norm it cannot carry.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.errors import AdapterError, InvalidOption
from merge_engine.commands.extract import extract_lora_svd
from merge_engine.output.jobs import OutputOptions
from merge_engine.lora.svd import svd_device
from tests.merge_engine.lora.conftest import load_causal_lm, logits, peft_logits
from tests.merge_engine.lora.test_fuse import ATOL, RTOL


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, tiny_base, peft_adapters) -> dict[str, str]:
    from peft import PeftModel

    root = tmp_path_factory.mktemp("finetuned")
    model = PeftModel.from_pretrained(load_causal_lm(tiny_base), peft_adapters["patterns"]).merge_and_unload()
    model.save_pretrained(str(root / "lora_only"))
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(str(root / "with_norm"))
    return {"lora_only": str(root / "lora_only"), "with_norm": str(root / "with_norm")}


def test_full_rank_extraction_reproduces_the_finetune(tmp_path, tiny_base, finetuned):
    """Rank 8 >= every update's rank: errors ~0, each module keeps its true rank (not 8 with noise),
    PEFT-loaded adapter == fine-tuned logits, only the modules that changed are in the adapter."""
    result = extract_lora_svd(tiny_base, finetuned["lora_only"], str(tmp_path / "ad"), OutputOptions(rank=8))
    assert max(r.relative_error for r in result.modules) < 1e-5
    ranks = {r.module: r.rank for r in result.modules}
    assert ranks["model.layers.1.self_attn.q_proj"] == 2 and ranks["model.layers.0.mlp.gate_proj"] == 3
    assert ranks["model.layers.0.self_attn.k_proj"] == 4  # the adapter's rank_pattern, recovered
    config = json.load(open(tmp_path / "ad" / "adapter_config.json"))
    assert sorted(config["target_modules"]) == ["gate_proj", "k_proj", "o_proj", "q_proj"]
    assert config["lora_alpha"] == config["r"] == 4
    assert config["base_model_name_or_path"] == os.path.basename(tiny_base)  # by its name: no path of this machine
    assert any("unchanged" in note for note in result.notes)
    torch.testing.assert_close(peft_logits(tiny_base, str(tmp_path / "ad")),
                               logits(load_causal_lm(finetuned["lora_only"])), atol=ATOL, rtol=RTOL)


def test_low_rank_error_is_the_true_relative_error(tmp_path, tiny_base, finetuned):
    """Rank 1: each reported error equals ||delta - B @ A||_F / ||delta||_F measured on the files."""
    result = extract_lora_svd(tiny_base, finetuned["lora_only"], str(tmp_path / "ad"), OutputOptions(rank=1))
    base = load_file(os.path.join(tiny_base, "model.safetensors"))
    tuned = load_file(os.path.join(finetuned["lora_only"], "model.safetensors"))
    adapter = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    for report in result.modules:
        delta = (tuned[f"{report.module}.weight"] - base[f"{report.module}.weight"]).double()
        a = adapter[f"base_model.model.{report.module}.lora_A.weight"].double()
        b = adapter[f"base_model.model.{report.module}.lora_B.weight"].double()
        assert a.shape[0] == report.rank == 1
        error = float(torch.linalg.norm(delta - b @ a) / torch.linalg.norm(delta))
        assert error > 0.05 and report.relative_error == pytest.approx(error, rel=1e-3)


def test_energy_threshold_chooses_ranks_per_module(tmp_path, tiny_base, finetuned):
    result = extract_lora_svd(tiny_base, finetuned["lora_only"], str(tmp_path / "ad"),
                              OutputOptions(energy=0.8, rank=3))
    assert all(1 <= r.rank <= 3 for r in result.modules)
    assert all(r.relative_error <= (1 - 0.8) ** 0.5 + 1e-6 or r.rank == 3 for r in result.modules)
    config = json.load(open(tmp_path / "ad" / "adapter_config.json"))
    for report in result.modules:
        assert config["rank_pattern"].get(report.module, config["r"]) == report.rank
    peft_logits(tiny_base, str(tmp_path / "ad"))  # PEFT loads the per-module ranks


def test_changed_tensors_outside_the_adapter_are_reported(tmp_path, tiny_base, finetuned):
    result = extract_lora_svd(tiny_base, finetuned["with_norm"], str(tmp_path / "ad"), OutputOptions(rank=4))
    assert any("model.norm.weight" in note for note in result.notes)
    provenance = json.load(open(tmp_path / "ad" / "stepmerge.json"))
    assert provenance["device"] == str(svd_device()) and set(provenance["svd"]) == {r.module for r in result.modules}


def test_target_modules_select_and_must_exist(tmp_path, tiny_base, finetuned):
    result = extract_lora_svd(tiny_base, finetuned["lora_only"], str(tmp_path / "ad"),
                              OutputOptions(rank=4, target_modules=("q_proj",)))
    assert {r.module.rsplit(".", 1)[-1] for r in result.modules} == {"q_proj"}
    with pytest.raises(AdapterError, match="nonexistent_proj"):
        extract_lora_svd(tiny_base, finetuned["lora_only"], str(tmp_path / "bad"),
                         OutputOptions(rank=4, target_modules=("q_proj", "nonexistent_proj")))
    assert not os.path.exists(tmp_path / "bad")


def test_rank_or_energy_is_required(tmp_path, tiny_base, finetuned):
    with pytest.raises(InvalidOption):
        extract_lora_svd(tiny_base, finetuned["lora_only"], str(tmp_path / "ad"), OutputOptions())


def test_identical_models_have_nothing_to_extract(tmp_path, tiny_base):
    with pytest.raises(AdapterError, match="nothing to extract"):
        extract_lora_svd(tiny_base, tiny_base, str(tmp_path / "ad"), OutputOptions(rank=2))
    assert not os.path.exists(tmp_path / "ad")


def test_svd_runs_on_the_gpu_when_there_is_one():
    assert svd_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert svd_device("cpu").type == "cpu"


def test_the_finetune_can_be_a_verl_fsdp_checkpoint(tmp_path, fsdp_runs):
    """No merge first: a 4-rank FSDP2 checkpoint is read directly. Its base here is the reference with
    a rank-2 change removed from every q_proj, so exactly those updates come back."""
    files = fsdp_runs["fsdp2_qwen2"].latest
    model = load_causal_lm(files.reference_hf_dir)
    want = logits(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.self_attn.q_proj.weight
            weight -= torch.randn(weight.shape[0], 2, generator=generator) @ torch.randn(2, weight.shape[1],
                                                                                         generator=generator) * 0.05
    model.save_pretrained(str(tmp_path / "base"))
    result = extract_lora_svd(str(tmp_path / "base"), files.checkpoint_dir, str(tmp_path / "ad"),
                              OutputOptions(rank=4))
    assert {r.module.rsplit(".", 1)[-1] for r in result.modules} == {"q_proj"}
    assert {r.rank for r in result.modules} == {2} and max(r.relative_error for r in result.modules) < 1e-5
    torch.testing.assert_close(peft_logits(str(tmp_path / "base"), str(tmp_path / "ad")), want, atol=ATOL, rtol=RTOL)


def test_cli_reports_the_error_of_each_module(tmp_path, tiny_base, finetuned, peft_adapters, capsys):
    from merge_engine.cli import main

    assert main(["extract-lora", "--base-model", tiny_base, "--finetuned", finetuned["with_norm"], "--rank", "1",
                 "--target-dir", str(tmp_path / "svd")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.self_attn.q_proj: rank 1, relative error" in out and "model.norm.weight" in out
    assert main(["merge-lora", "--lora-adapter", f"{peft_adapters['qv']},{peft_adapters['qv2']}", "--output",
                 "adapter", "--energy", "0.5", "--target-dir", str(tmp_path / "combined")]) == 0
    assert "relative error max" in capsys.readouterr().out
    assert main(["extract-lora", "--base-model", tiny_base, "--finetuned", finetuned["with_norm"],
                 "--lora-alpha", "3", "--rank", "1", "--target-dir", str(tmp_path / "x")]) == 2
    assert "InvalidOption" in capsys.readouterr().err


@pytest.fixture(scope="module")
def medium_finetune(tmp_path_factory) -> dict[str, str]:
    """A Qwen2 large enough for the randomized SVD (hidden 256, intermediate 512; k/v 128 x 256), and its fine-tune:
    every linear weight + a rank-4 update + noise (a full fine-tune's update: low rank, not exactly)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("medium")
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(str(root / "base"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("proj.weight"):
                out_features, in_features = weight.shape
                weight += 0.02 * torch.randn(out_features, 4, generator=generator) @ torch.randn(
                    4, in_features, generator=generator) / in_features ** 0.5
                weight += 2e-4 * torch.randn(weight.shape, generator=generator)
    model.save_pretrained(str(root / "tuned"))
    return {"base": str(root / "base"), "tuned": str(root / "tuned")}


def test_the_randomized_svd_keeps_the_full_svds_ranks_and_errors(tmp_path, medium_finetune):
    """Every module factored by the randomized SVD has the rank and (within 1e-3) the relative error of the
    full SVD (the factoring before it: ``svd_method="full"``), and the error reported is that of the files."""
    from merge_engine.commands.extract import SvdExtractJob
    from merge_engine.output.jobs import run_job

    base, tuned = medium_finetune["base"], medium_finetune["tuned"]
    fast = extract_lora_svd(base, tuned, str(tmp_path / "fast"), OutputOptions(rank=8))
    full = run_job(SvdExtractJob(base, tuned, str(tmp_path / "full"), OutputOptions(rank=8), svd_method="full"))
    assert len(fast.modules) == 14
    provenance = json.load(open(tmp_path / "fast" / "stepmerge.json"))
    assert provenance["svd_methods"] == {"randomized": 14}
    assert json.load(open(tmp_path / "full" / "stepmerge.json"))["svd_methods"] == {"full": 14}
    exact = {r.module: r for r in full.modules}
    base_weights = load_file(os.path.join(base, "model.safetensors"))
    tuned_weights = load_file(os.path.join(tuned, "model.safetensors"))
    adapter = load_file(str(tmp_path / "fast" / "adapter_model.safetensors"))
    for report in fast.modules:
        assert report.rank == exact[report.module].rank == 8
        assert abs(report.relative_error - exact[report.module].relative_error) <= 1e-3
        delta = (tuned_weights[f"{report.module}.weight"] - base_weights[f"{report.module}.weight"]).double()
        a = adapter[f"base_model.model.{report.module}.lora_A.weight"].double()
        b = adapter[f"base_model.model.{report.module}.lora_B.weight"].double()
        assert float(torch.linalg.norm(delta - b @ a) / torch.linalg.norm(delta)) == pytest.approx(
            report.relative_error, abs=1e-5)
    peft_logits(base, str(tmp_path / "fast"))  # PEFT loads it


def test_a_device_this_machine_cannot_use_is_a_named_error_before_anything_is_read(tmp_path, capsys):
    """``--device gpu9`` (no such device), and ``--device cuda`` with a CPU-only torch: one line, exit 2."""
    from merge_engine.cli import main

    names = ["gpu9"] + (["cuda"] if torch.version.cuda is None else [])
    for name in names:
        assert main(["extract-lora", "--base-model", str(tmp_path / "missing"), "--finetuned",
                     str(tmp_path / "missing2"), "--rank", "8", "--target-dir", str(tmp_path / "out"),
                     "--device", name]) == 2
        err = capsys.readouterr().err
        assert err.startswith("stepmerge: error: InvalidDevice: --device") and err.count("\n") == 1, err
        assert "CPU-only" in err if name == "cuda" else "not a torch device" in err
    assert not os.path.exists(tmp_path / "out")
