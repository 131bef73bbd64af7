"""``merge --base-model`` of an adapter-only LoRA step: the step's adapter fused into the base the user names.

The three adapter-only saves (verl's ``save_lora_only`` rank files: only the LoRA keys in every FSDP2 rank file; HF
Trainer's DCP ``adapter_only`` save through Accelerate; HF Trainer's ZeRO-2 save of a PEFT model, the adapter's fp32
masters only, written by real DeepSpeed) merge with ``--base-model`` into exactly the weights PEFT's own
``merge_and_unload`` gives in fp32, tensor for tensor; without ``--base-model`` each is still refused, nothing
written; a base of another shape is refused by name, nothing written. The base's config.json is checked against
the step's own (saved with it, or ``--hf_model_path``) on the keys that define the model before anything is written;
keys that only record how it was saved do not matter. ``--base-model`` for a step holding its base is noted unused.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from merge_engine.cli import main
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.errors import InvalidConfig
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.lora.conftest import copy_checkpoint
from tests.merge_engine.lora.test_trainer_loras import _save_base, _weights, runs  # noqa: F401 - the fixture


def _assert_pefts_merge(out: Path, trained: torch.nn.Module) -> None:
    expected = copy.deepcopy(trained).float().merge_and_unload().state_dict()
    merged = _weights(out)
    assert sorted(merged) == sorted(expected)
    for key, value in expected.items():
        assert merged[key].dtype == torch.float32 and torch.equal(merged[key], value), key


@pytest.mark.parametrize("name", ["dcp_adapter", "lora_zero2_hf_trainer"])
def test_hf_trainers_adapter_only_step_fuses_into_the_base_bit_for_bit(runs, tmp_path, name):  # noqa: F811
    run = runs(name)
    base_dir = _save_base(run, tmp_path / "base")
    alpha = ["--lora-alpha", "8"] if name.startswith("dcp_") else []  # HF Trainer's ZeRO save has PEFT's config
    refused = tmp_path / "refused"
    assert main(["merge", "--local_dir", run.folder, "--target_dir", str(refused), *alpha]) != 0
    assert not refused.exists()
    out = tmp_path / "fused"
    assert main(["merge", "--local_dir", run.folder, "--target_dir", str(out), "--base-model", base_dir, *alpha]) == 0
    _assert_pefts_merge(out, run.trained)
    recorded = json.load(open(out / "stepmerge.json"))
    assert recorded["base_model"].endswith("base") and recorded["lora"]["lora_alpha"] == 8
    assert json.load(open(out / "config.json"))["model_type"] == "qwen2"


def test_verls_lora_only_save_fuses_into_the_base_bit_for_bit(lora_only_checkpoint, tmp_path):
    run = lora_only_checkpoint
    base_dir = str(tmp_path / "base")
    run.base_model().float().save_pretrained(base_dir)
    out = tmp_path / "fused"
    assert main(["merge", "--local_dir", run.checkpoint_dir, "--target_dir", str(out), "--base-model", base_dir]) == 0
    _assert_pefts_merge(out, run.trained_model())


def test_a_base_of_another_model_is_refused_nothing_written(runs, tmp_path, gpt2_base):  # noqa: F811
    run = runs("dcp_adapter")
    out = tmp_path / "fused"
    code = main(["merge", "--local_dir", run.folder, "--target_dir", str(out), "--base-model", gpt2_base,
                 "--lora-alpha", "8"])
    assert code != 0 and not out.exists()


def _edited_base(base_dir: str, folder: Path, **changes) -> str:
    """A copy of the base folder whose config.json has ``changes`` (the weights as they are)."""
    shutil.copytree(base_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


def _deeper_base(run, folder: Path) -> str:
    """The run's base with one more decoder layer (its other weights the base's): a base the adapter fits."""
    import transformers

    base = run.base_model().float()
    config = copy.deepcopy(base.config)
    config.num_hidden_layers += 1
    if getattr(config, "layer_types", None):  # one attention kind per layer
        config.layer_types = [*config.layer_types, config.layer_types[-1]]
    deeper = transformers.AutoModelForCausalLM.from_config(config).float()
    missing, unexpected = deeper.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(f".{config.num_hidden_layers - 1}." in name for name in missing)
    deeper.save_pretrained(str(folder))
    return str(folder)


def test_the_steps_own_config_decides_which_base_fuses(lora_only_checkpoint, tmp_path):
    """A base saved with other bookkeeping keys fuses bit for bit; a base with one more layer (the adapter fits
    it, so without the check a plausible but wrong model is released) is refused naming both configs."""
    run = lora_only_checkpoint
    base_dir = str(tmp_path / "base")
    run.base_model().float().save_pretrained(base_dir)
    step_config = json.loads((Path(run.checkpoint_dir) / "huggingface" / "config.json").read_text())
    saved = _edited_base(base_dir, tmp_path / "saved_elsewhere", _name_or_path="/elsewhere/base",
                         transformers_version="4.0.0", torch_dtype="bfloat16", dtype="bfloat16",
                         use_cache=not step_config.get("use_cache", True))
    out = tmp_path / "fused"
    merge_checkpoint(run.checkpoint_dir, str(out), OutputOptions(base_model=saved))
    _assert_pefts_merge(out, run.trained_model())

    deeper = _deeper_base(run, tmp_path / "deeper")
    refused = tmp_path / "refused"
    with pytest.raises(InvalidConfig, match="not the model this run trained") as error:
        merge_checkpoint(run.checkpoint_dir, str(refused), OutputOptions(base_model=deeper))
    assert "num_hidden_layers" in error.value.message
    assert os.path.join(deeper, "config.json") in error.value.message
    assert os.path.join(run.checkpoint_dir, "huggingface", "config.json") in error.value.message
    assert error.value.path == os.path.join(deeper, "config.json") and not refused.exists()


@pytest.mark.parametrize("keys", [("hidden_size",), ("vocab_size",), ("num_key_value_heads",),
                                  ("architectures", "model_type")], ids="+".join)
def test_a_base_whose_config_is_another_model_is_refused_nothing_written(lora_only_checkpoint, tmp_path, keys):
    run = lora_only_checkpoint
    base_dir = str(tmp_path / "base")
    run.base_model().float().save_pretrained(base_dir)
    stated = json.loads((Path(base_dir) / "config.json").read_text())
    other_model = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    changes = {key: other_model[key] if key in other_model else stated[key] * 2 for key in keys}
    other = _edited_base(base_dir, tmp_path / "other", **changes)
    out = tmp_path / "fused"
    with pytest.raises(InvalidConfig, match="not the model this run trained") as error:
        merge_checkpoint(run.checkpoint_dir, str(out), OutputOptions(base_model=other))
    assert all(key in error.value.message for key in changes) and not out.exists()


def test_an_adapter_step_with_hf_model_path_is_checked_against_the_base(runs, tmp_path, gpt2_base):  # noqa: F811
    """HF Trainer's DCP adapter-only step saves no config: ``--hf_model_path`` is its config, checked against the
    base's (without it the base's config is the model's, nothing to compare)."""
    run = runs("dcp_adapter")
    out = tmp_path / "fused"
    with pytest.raises(InvalidConfig, match="not the model this run trained") as error:
        merge_checkpoint(run.folder, str(out), OutputOptions(base_model=gpt2_base, hf_model_path=run.hf,
                                                             lora_alpha=8.0))
    assert "model_type ('gpt2' vs 'qwen2')" in error.value.message
    assert os.path.join(run.hf, "config.json") in error.value.message and not out.exists()


def test_base_model_for_a_step_holding_its_base_is_noted_not_used(fsdp_lora_runs, tmp_path, capsys):
    """A step saved with its base (verl's full LoRA save) merges from its own weights; ``--base-model`` (the flows
    give one base to every step of a run) is said to be unused, by the CLI and in the job's notes; where the
    step saved no config, the base's config.json is the one thing taken from it."""
    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    base_dir = str(tmp_path / "base")
    run.base_model().float().save_pretrained(base_dir)
    out = tmp_path / "merged"
    assert main(["merge", "--local_dir", run.checkpoint_dir, "--target_dir", str(out), "--base-model", base_dir]) == 0
    assert f"note: --base-model {base_dir} not used: the step holds full weights" in capsys.readouterr().err
    result = merge_checkpoint(run.checkpoint_dir, str(tmp_path / "again"), OutputOptions(base_model=base_dir))
    assert [n for n in result.notes if "--base-model" in n] == [
        f"--base-model {base_dir} not used: the step holds full weights (its own base), merged from them alone"]
    assert _weights(tmp_path / "again").keys() == _weights(out).keys()

    no_config = copy_checkpoint(run.checkpoint_dir, str(tmp_path / "no_config"), drop=("huggingface",))
    result = merge_checkpoint(no_config, str(tmp_path / "config_from_base"), OutputOptions(base_model=base_dir))
    assert any(n.startswith(f"--base-model {base_dir}: only its config.json used") for n in result.notes)
