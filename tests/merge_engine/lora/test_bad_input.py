"""Bad adapters and bad requests: a named error, and nothing at the target (no temp folder either)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from merge_engine.cli import main
from merge_engine.errors import AdapterError
from merge_engine.commands.combine import merge_lora
from merge_engine.output.jobs import OutputOptions
from merge_engine.commands.extract import extract_lora
from tests.merge_engine.lora.conftest import load_causal_lm, logits, peft_logits, save_adapter
from tests.merge_engine.lora.test_fuse import ATOL, RTOL


def assert_nothing_written(target) -> None:
    target = str(target)
    assert not os.path.exists(target)
    parent, name = os.path.split(target)
    assert not [n for n in os.listdir(parent) if n.startswith(f".{name}.stepmerge-")]


def edited_adapter(source: str, destination, *, config: dict | None = None, tensors=None) -> str:
    """A copy of an adapter folder with config fields replaced and/or tensors edited in place."""
    destination = str(destination)
    shutil.copytree(source, destination)
    if config:
        path = os.path.join(destination, "adapter_config.json")
        data = json.load(open(path))
        data.update(config)
        json.dump(data, open(path, "w"))
    if tensors:
        path = os.path.join(destination, "adapter_model.safetensors")
        state = load_file(path)
        tensors(state)
        save_file(state, path, metadata={"format": "pt"})
    return destination


def test_adapter_for_another_model_shape(tmp_path, tiny_base):
    """A q_proj adapter trained on a 48-wide model does not fit the 64-wide base."""
    import dataclasses

    import peft

    from synthetic_runs.models import ModelSpec, build_model

    other = build_model(dataclasses.replace(ModelSpec(), hidden_size=48), seed=1)
    adapter = save_adapter(other, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]),
                           str(tmp_path / "adapter48"), seed=3)
    with pytest.raises(AdapterError, match="q_proj"):
        merge_lora(tiny_base, [adapter], str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")


def test_target_module_missing_from_the_base(tmp_path, tiny_base, peft_adapters, gpt2_adapter):
    with pytest.raises(AdapterError, match="does not exist in the base"):
        merge_lora(tiny_base, [gpt2_adapter], str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")
    extra = edited_adapter(peft_adapters["qv"], tmp_path / "extra",
                           config={"target_modules": ["q_proj", "v_proj", "nonexistent_proj"]})
    with pytest.raises(AdapterError, match="nonexistent_proj"):
        merge_lora(tiny_base, [extra], str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")


def test_lost_alpha_is_an_error_unless_given(tmp_path, tiny_base, peft_adapters):
    """lora_alpha 0 (verl's old merger wrote it) would be a no-op adapter: refused; --lora-alpha fixes it."""
    zero = edited_adapter(peft_adapters["qv"], tmp_path / "zero", config={"lora_alpha": 0})
    with pytest.raises(AdapterError, match="--lora-alpha"):
        merge_lora(tiny_base, [zero], str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")
    merge_lora(tiny_base, [zero], str(tmp_path / "out"), OutputOptions(lora_alpha=(8.0,)))
    torch.testing.assert_close(logits(load_causal_lm(str(tmp_path / "out"))), peft_logits(tiny_base, peft_adapters["qv"]),
                               atol=ATOL, rtol=RTOL)
    with pytest.raises(AdapterError):
        merge_lora(tiny_base, [zero], str(tmp_path / "two"), OutputOptions(lora_alpha=(8.0, 8.0)))


@pytest.mark.parametrize("options", [
    OutputOptions(method="weighted", weights=(0.5,)),
    OutputOptions(method="weighted", weights=(0.5, 0.2, 0.3)),
    OutputOptions(method="weighted"),
    OutputOptions(method="concat", weights=(0.5, 0.5)),
])
def test_weights_must_match_the_adapters(tmp_path, tiny_base, peft_adapters, options):
    with pytest.raises(AdapterError):
        merge_lora(tiny_base, [peft_adapters["qv"], peft_adapters["qv2"]], str(tmp_path / "out"), options)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("output", ["model", "adapter"])
def test_nan_in_an_adapter(tmp_path, tiny_base, peft_adapters, output):
    """A NaN found while streaming aborts the write: the target never appears."""
    def poison(state):
        key = next(k for k in sorted(state) if k.endswith("layers.1.self_attn.v_proj.lora_B.weight"))
        state[key][3, 1] = float("nan")

    bad = edited_adapter(peft_adapters["qv"], tmp_path / "nan", tensors=poison)
    with pytest.raises(AdapterError, match="NaN"):
        merge_lora(tiny_base, [peft_adapters["qv2"], bad], str(tmp_path / "out"), OutputOptions(output=output))
    assert_nothing_written(tmp_path / "out")


def test_nan_in_a_training_checkpoint(tmp_path, single_rank_lora_checkpoint):
    checkpoint, _, _ = single_rank_lora_checkpoint
    copy = shutil.copytree(checkpoint, str(tmp_path / "actor"))
    path = os.path.join(copy, "model_world_size_1_rank_0.pt")
    state = torch.load(path, weights_only=True)
    key = next(k for k in sorted(state) if k.endswith("o_proj.lora_A.default.weight"))
    state[key][0, 0] = float("inf")
    torch.save(state, path)
    with pytest.raises(AdapterError, match="NaN or Inf"):
        extract_lora(copy, str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")


def test_rank_contradicting_the_config(tmp_path, tiny_base, peft_adapters):
    bad = edited_adapter(peft_adapters["qv"], tmp_path / "r8", config={"r": 8})
    with pytest.raises(AdapterError, match="r=8"):
        merge_lora(tiny_base, [bad], str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")


def test_weights_for_untargeted_modules(tmp_path, tiny_base, peft_adapters):
    bad = edited_adapter(peft_adapters["qv"], tmp_path / "untargeted", config={"target_modules": ["q_proj"]})
    with pytest.raises(AdapterError, match="v_proj"):
        merge_lora(tiny_base, [bad], str(tmp_path / "out"))


@pytest.mark.parametrize("config", [{"use_dora": True}, {"peft_type": "LOHA"}, {"lora_bias": True}])
def test_unsupported_variants(tmp_path, tiny_base, peft_adapters, config):
    bad = edited_adapter(peft_adapters["qv"], tmp_path / "variant", config=config)
    with pytest.raises(AdapterError):
        merge_lora(tiny_base, [bad], str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")


def test_pickled_adapters_are_not_loaded(tmp_path, tiny_base, peft_adapters):
    pickled = edited_adapter(peft_adapters["qv"], tmp_path / "pickled")
    os.rename(os.path.join(pickled, "adapter_model.safetensors"), os.path.join(pickled, "adapter_model.bin"))
    with pytest.raises(AdapterError, match="pickle"):
        merge_lora(tiny_base, [pickled], str(tmp_path / "out"))


def test_embedding_update_on_tied_embeddings(tmp_path):
    """PEFT applies an embedding LoRA to the input side only; with tied weights the fused model cannot
    hold both: refused rather than silently wrong."""
    import dataclasses

    import peft

    from synthetic_runs.models import ModelSpec, build_model, write_hf_metadata

    spec = dataclasses.replace(ModelSpec(), tie_word_embeddings=True)
    base = str(tmp_path / "tied")
    write_hf_metadata(base, spec)
    build_model(spec, seed=2).save_pretrained(base)
    adapter = save_adapter(load_causal_lm(base), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["embed_tokens"]),
                           str(tmp_path / "adapter"), seed=4)
    with pytest.raises(AdapterError, match="ties"):
        merge_lora(base, [adapter], str(tmp_path / "out"))
    assert_nothing_written(tmp_path / "out")


def test_cli_reports_named_errors(tmp_path, tiny_base, peft_adapters, capsys):
    code = main(["merge-lora", "--base-model", tiny_base, "--lora-adapter",
                 f"{peft_adapters['qv']},{peft_adapters['qv2']}", "--merge-method", "weighted",
                 "--adapter-weights", "0.5", "--target-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "AdapterError" in err and "2 adapters" in err
    assert_nothing_written(tmp_path / "out")
    with pytest.raises(SystemExit) as exited:  # a flag's value is read by its parser: argparse's one-line refusal
        main(["merge-lora", "--base-model", tiny_base, "--lora-adapter", peft_adapters["qv"],
              "--adapter-weights", "x", "--merge-method", "weighted", "--target-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--adapter_weights" in err and "takes comma-separated numbers, got 'x'" in err
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("field, value", [
    ("lora_alpha", 1e308), ("lora_alpha", float("inf")), ("lora_alpha", float("nan")), ("lora_alpha", -4),
    ("lora_alpha", "4"), ("r", -2), ("r", 2.5), ("r", 1e308), ("r", True),
])
def test_alpha_or_rank_out_of_range_in_a_training_run(tmp_path, single_rank_lora_checkpoint, field, value):
    """``lora_alpha: 1e308`` was extracted into an adapter (and a traceback on the way); every alpha or r that is
    not a finite positive number in range is a named error naming the metadata file, and nothing is written."""
    checkpoint, _, _ = single_rank_lora_checkpoint
    bad = shutil.copytree(checkpoint, str(tmp_path / "actor"))
    meta = {"r": 2, "lora_alpha": 3, "task_type": "CAUSAL_LM", field: value}
    with open(os.path.join(bad, "lora_train_meta.json"), "w") as handle:
        json.dump(meta, handle)
    with pytest.raises(AdapterError, match=field) as refused:
        extract_lora(bad, str(tmp_path / "out"))
    assert refused.value.path == os.path.join(bad, "lora_train_meta.json")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("config", [{"lora_alpha": 1e308}, {"lora_alpha": -8}, {"r": 0},
                                    {"rank_pattern": {"q_proj": -1}}, {"alpha_pattern": {"q_proj": 1e300}}])
def test_alpha_or_rank_out_of_range_in_an_adapter(tmp_path, tiny_base, peft_adapters, config):
    bad = edited_adapter(peft_adapters["qv"], tmp_path / "bad", config=config)
    with pytest.raises(AdapterError, match="LoRA (alpha|rank) is") as refused:
        merge_lora(tiny_base, [bad], str(tmp_path / "out"))
    assert refused.value.path == bad
    assert_nothing_written(tmp_path / "out")
