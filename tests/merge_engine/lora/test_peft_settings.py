"""Each LoRA module's (r, lora_alpha, scaling) as PEFT trained it, asked of PEFT (`merge_engine.lora.peft_settings`).

Specification:
- for verl's default LoRA (all-linear, recorded as r and lora_alpha only) the resolution is PEFT's own: every
  layer of the trained PeftModel (built by PEFT in the fixture writer) has the same r, lora_alpha and scaling,
  the fused gate/up rank 2r and alpha 2 * alpha where PEFT adapts the experts; repeated resolutions are cached;
- explicit settings (a run whose target_modules are not all-linear) resolve through the stored modules' names;
- a stored rank that PEFT does not give for the run's settings is `LoraRankMismatch` naming the module, the rank
  found and the rank expected, from ``merge`` and ``extract-lora`` alike, and nothing is written;
- the adapter config `settings_layout` writes gives every module (and every alias PEFT 0.21 matches) its pair.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from merge_engine.errors import AdapterError, LoraRankMismatch
from merge_engine.lora.checkpoint import split_checkpoint
from merge_engine.lora.config import pattern_key, settings_layout
from merge_engine.commands.extract import extract_lora
from merge_engine.output.jobs import OutputOptions
from merge_engine.lora.peft_settings import StoredFactors, _peft_layers, resolve_trained_settings
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.formats.tensor_source import TensorMeta
from synthetic_runs.fsdp import MOE_FAMILIES, build_reference_model


def _stored(model: torch.nn.Module) -> StoredFactors:
    state = model.state_dict()
    metas = {k: TensorMeta(k, tuple(v.shape), v.dtype) for k, v in state.items()}
    return StoredFactors.from_metas(split_checkpoint(metas, None).factors, metas)


def _config(step) -> dict:
    with open(os.path.join(step.checkpoint_dir, "huggingface", "config.json")) as handle:
        return json.load(handle)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_resolution_is_peft_own(verl_lora_runs, family):
    """Every LoRA layer of the trained PeftModel: same r, lora_alpha, scaling as resolved; cached."""
    from peft.tuners.lora import LoraLayer

    step = verl_lora_runs[f"{family}_verl_lora_w2"].latest
    model = build_reference_model(step.spec, step.seed)
    resolved = resolve_trained_settings(_config(step), 4, 16, None, _stored(model), step.checkpoint_dir)
    assert resolved.source == "verl's default target_modules all-linear"
    layers = {name.removeprefix("base_model.model."): m for name, m in model.named_modules()
              if isinstance(m, LoraLayer) and "default" in m.r}
    assert set(layers) == set(resolved.modules)
    for name, layer in layers.items():
        got = resolved.modules[name]
        assert (got.r, got.lora_alpha, got.scaling) == (layer.r["default"], layer.lora_alpha["default"],
                                                        layer.scaling["default"]), name
    hits = _peft_layers.cache_info().hits
    resolve_trained_settings(_config(step), 4, 16, None, _stored(model), step.checkpoint_dir)
    assert _peft_layers.cache_info().hits > hits


def test_explicit_targets_resolve_by_the_stored_names():
    """q_proj / v_proj and explicit target_parameters (not all-linear): PEFT's r and alpha everywhere."""
    import peft

    from synthetic_runs.models import ModelSpec, build_model

    spec = ModelSpec(family="qwen3_moe")
    model = peft.get_peft_model(build_model(spec, seed=2), peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    from synthetic_runs.models import build_config

    config = build_config(spec).to_dict()
    stored = _stored(model)
    parameters = {m: f"{m.removesuffix('.base_layer')}.{'gate_up_proj' if m.endswith('base_layer') else 'down_proj'}"
                  for m in stored.shapes if ".experts" in m}
    resolved = resolve_trained_settings(config, 2, 6, None, StoredFactors(stored.shapes, parameters), "ckpt")
    assert resolved.source == "the stored modules' names"
    assert {(s.r, s.lora_alpha, s.scaling) for s in resolved.modules.values()} == {(2, 6.0, 3.0)}


def test_a_rank_peft_does_not_give_is_a_named_error(verl_lora_runs, tmp_path):
    """lora_train_meta.json says r 8 (alpha 32) but the factors are rank 4 (8 on the fused gate/up): merge and
    extract-lora raise LoraRankMismatch naming the module, the rank found and the rank PEFT gives; no output."""
    checkpoint = verl_lora_runs["mixtral_verl_lora_w2"].latest.checkpoint_dir
    wrong = str(tmp_path / "wrong")
    shutil.copytree(checkpoint, wrong)
    with open(os.path.join(wrong, "lora_train_meta.json"), "w") as handle:
        json.dump({"r": 8, "lora_alpha": 32, "task_type": "CAUSAL_LM"}, handle)
    for run in (lambda out: merge_checkpoint(wrong, out), lambda out: extract_lora(wrong, out, OutputOptions())):
        out = str(tmp_path / "out")
        with pytest.raises(LoraRankMismatch) as caught:
            run(out)
        error = caught.value
        assert isinstance(error, AdapterError) and error.path == wrong
        assert (error.found, error.expected) == (4, 8) or (error.found, error.expected) == (8, 16)
        assert error.module in str(error) and f"rank {error.found}" in str(error)
        assert not os.path.exists(out)


def test_settings_layout_gives_every_name_its_pair():
    """Per-expert modules collapse to one key each; aliases (PEFT 0.21's names) are listed; each name gets its
    pair under PEFT's matching, whatever the keys' order."""
    pairs = {f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}": ((8, 32.0) if w != "w2" else (4, 16.0))
             for layer in range(2) for e in range(4) for w in ("w1", "w2", "w3")}
    pairs.update({f"model.layers.{layer}.self_attn.q_proj": (4, 16.0) for layer in range(2)})
    aliases = {f"model.layers.{layer}.mlp.experts.gate_up_proj": (16, 64.0) for layer in range(2)}
    r, alpha, ranks, alphas = settings_layout(pairs, aliases)
    assert (r, alpha) == (8, 32.0)  # the most common pair: w1 and w3 of every expert
    assert ranks == {"gate_up_proj": 16, "q_proj": 4, "w2": 4} and alphas == {"gate_up_proj": 64.0, "q_proj": 16.0,
                                                                               "w2": 16.0}
    for order in (ranks, dict(reversed(list(ranks.items())))):
        for name, (rank, _) in {**pairs, **aliases}.items():
            key = pattern_key(order, name)
            assert (order[key] if key else r) == rank, name
