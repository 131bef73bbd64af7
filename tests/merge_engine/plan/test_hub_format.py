"""Hub-format output: the names and per-expert tensors of the model's Hub checkpoint.

Specification:
- A merge writes what ``save_pretrained`` writes for the model (default ``--weights-format hub``):
  fused experts split per expert, ``model.language_model`` back to ``model``, GPT-NeoX's head as
  ``embed_out``; the names come from transformers' own conversion mapping.
- Every family of the architecture matrix (FSDP1/FSDP2, world 2 and 3, uneven and dim>0 shards),
  merged: bit for bit equal to the ``save_pretrained`` folder of the model it was sharded from,
  the same names, a transformers load with no missing or unexpected key, and equal logits.
- ``config.json`` in the Hub's form (test_hub_config.py), what was added listed in ``stepmerge.json``.
- ``--weights-format transformers`` writes the names and the config as stored; the choice is in
  ``stepmerge.json``, and validation expects the names of the recorded format.
- Qwen3-VL-MoE's fused experts in the Hub's layout, ``(E, I, hidden)`` for ``down_proj``, not the in-memory
  ``(E, hidden, I)`` ``save_pretrained`` keeps (`HUB_TRANSPOSED`); a checkpoint already in that layout is
  left alone; validation expects it.
- A per-expert tensor is planned as ranged reads: its bytes, not the fused tensor's, are read
  (tests/merge_engine/formats/test_tensor_source.py::TestRanges, test_transformers_conversion.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from merge_engine.cli import main
from merge_engine.errors import InvalidConfig
from merge_engine.plan.hub_format import hub_naming
from merge_engine.plan.output_heads import find_heads
from synthetic_runs.fsdp import family_matrix
from synthetic_runs.models import build_config, build_model, torch_dtype

FAMILY_CASES = sorted(name for name, spec in family_matrix().items() if spec.lora is None)
# family -> tensors transformers 5's save_pretrained writes in its in-memory layout while the Hub's checkpoints
# (and transformers 4.x) hold them transposed (load-time Transpose(1, 2, check_dims=True)): stepmerge writes the Hub's
HUB_TRANSPOSED = {"qwen3_vl_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}


def _load_folder(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
    return tensors


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[(7919 * i + 13) % 1003 for i in range(12)]])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


class TestFamilyMatrix:
    @pytest.mark.parametrize("case", FAMILY_CASES)
    def test_merge_is_the_save_pretrained_checkpoint(self, case, family_runs, merged_families):
        """Same names as save_pretrained (Hub names), every tensor bit for bit, same dtype."""
        written = _load_folder(merged_families[case])
        reference = _load_folder(family_runs[case].latest.reference_hf_dir)
        assert sorted(written) == sorted(reference)
        transposed = HUB_TRANSPOSED.get(family_matrix()[case].model.family, ())
        for name, tensor in reference.items():
            if name.endswith(transposed):  # save_pretrained keeps the in-memory layout; the Hub's is transposed
                tensor = tensor.transpose(1, 2)
            assert written[name].dtype == tensor.dtype, name
            assert written[name].shape == tensor.shape and torch.equal(written[name], tensor), name

    @pytest.mark.parametrize("case", FAMILY_CASES)
    def test_loads_cleanly_with_the_trained_logits(self, case, family_runs, merged_families):
        """transformers loads the folder with no missing/unexpected key; logits equal the model's."""
        import transformers

        step = family_runs[case].latest
        spec = step.spec.model
        cls = getattr(transformers, spec.architecture)
        model, info = cls.from_pretrained(merged_families[case], output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        trained = build_model(spec, step.seed, torch_dtype(step.spec.dtype))
        assert torch.equal(_logits(model.eval()), _logits(trained))

    def test_provenance_records_the_weights_format(self, merged_families):
        with open(os.path.join(merged_families["mixtral_w2"], "stepmerge.json")) as handle:
            assert json.load(handle)["options"]["weights_format"] == "hub"

    def test_config_is_in_the_hub_form_and_recorded(self, merged_families):
        """config.json holds the keys transformers 4.x reads (merge_engine.plan.hub_config), beside 5.x's;
        stepmerge.json lists each one with the transformers code it comes from."""
        folder = merged_families["qwen3_moe_w2"]
        with open(os.path.join(folder, "config.json")) as handle:
            config = json.load(handle)
        assert config["num_experts"] == config["num_local_experts"] == 4
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and config["rope_scaling"] is None
        with open(os.path.join(folder, "stepmerge.json")) as handle:
            translation = {c["key"]: c for c in json.load(handle)["config_translation"]}
        assert set(translation) == {"num_experts", "rope_theta", "rope_scaling"}
        assert "attribute_map" in translation["num_experts"]["from"]
        with open(os.path.join(merged_families["qwen2_vl_w2"], "config.json")) as handle:
            text = json.load(handle)["text_config"]
        assert text["rope_scaling"]["mrope_section"] and text["tie_word_embeddings"] is False

    def test_validation_expects_the_hub_names(self, merged_families):
        from merge_engine.validate import validate_structure

        report = validate_structure(merged_families["qwen3_moe_w3"])
        assert report.ok, report.summary()
        assert report.check("expected_keys").ok


def test_transformers_format_keeps_the_stored_names(family_runs, tmp_path):
    """--weights-format transformers: the stored (in-memory) names and fused tensors, exactly."""
    step = family_runs["mixtral_w2"].latest
    target = tmp_path / "out"
    code = main(["merge", "--backend", "fsdp", "--local_dir", step.checkpoint_dir, "--target_dir", str(target),
                 "--weights-format", "transformers"])
    assert code == 0
    written = _load_folder(str(target))
    stored = _load_folder(step.reference_dir)  # state_dict.safetensors: the rank files' names
    assert sorted(written) == sorted(stored)
    assert "model.layers.0.mlp.experts.gate_up_proj" in written
    assert all(torch.equal(written[k], stored[k]) for k in stored)
    with open(target / "stepmerge.json") as handle:
        provenance = json.load(handle)
    assert provenance["options"]["weights_format"] == "transformers"
    assert provenance["config_translation"] == []  # the stored config, as it is
    with open(target / "config.json") as handle, open(os.path.join(step.checkpoint_dir, "huggingface",
                                                                   "config.json")) as stored:
        written, stored = json.load(handle), json.load(stored)
    assert "num_experts" not in written and "rope_theta" not in written
    assert {k: v for k, v in written.items() if k in stored} == stored
    from merge_engine.validate import validate_structure

    report = validate_structure(str(target))  # judged by the names it was written in (stepmerge.json)
    assert report.ok, report.summary()
    assert "in-memory names" in report.check("expected_keys").detail
    assert not validate_structure(str(target), weights_format="hub").ok  # as Hub names they are wrong


def test_gpt_neox_head_named_by_the_model(family_runs):
    """A checkpoint saved under GPT-NeoX's 4.x head name `embed_out` is untied and complete."""
    step = family_runs["gpt_neox_embed_out_w2"].latest
    names = set(_load_folder(step.reference_dir))
    assert "embed_out.weight" in names and "lm_head.weight" not in names
    heads = find_heads(names, build_config(step.spec.model).to_dict())
    assert (heads.embedding, heads.head) == ("gpt_neox.embed_in.weight", "embed_out.weight")


def test_missing_head_still_refused():
    """Names from the model do not excuse a checkpoint that lost its head."""
    from merge_engine.plan.hf_plan import plan_hf_merge
    from merge_engine.formats.tensor_source import TensorMeta

    config = build_config(__import__("synthetic_runs.models", fromlist=["ModelSpec"]).ModelSpec(family="gpt_neox"))
    metas = {n: TensorMeta(n, (4, 4), torch.float32) for n in ("gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.weight")}
    with pytest.raises(InvalidConfig, match="no output head"):
        plan_hf_merge(metas, config.to_dict())


class TestNaming:
    def test_dense_model_keeps_its_names(self):
        from synthetic_runs.models import ModelSpec

        config = build_config(ModelSpec(family="llama")).to_dict()
        assert hub_naming({"model.embed_tokens.weight": (1003, 64)}, config) is None

    def test_hub_checkpoint_names_are_left_alone(self):
        """A checkpoint written under transformers 4.x already holds Hub names: nothing to convert."""
        from synthetic_runs.models import ModelSpec

        config = build_config(ModelSpec(family="mixtral")).to_dict()
        hub = {"model.layers.0.block_sparse_moe.experts.0.w1.weight": (112, 64), "lm_head.weight": (1003, 64)}
        assert hub_naming(hub, config) is None


def test_a_hub_merge_is_sharded_once_after_the_naming(family_runs, tmp_path, monkeypatch):
    """The stored-name plan is not sharded: the shards are cut once, over the Hub's names (the per-expert
    tensors), and a plan sharded already is refused by `in_weights_format`."""
    from merge_engine.architectures import megatron_to_hf
    from merge_engine.plan import hf_plan, hub_format, merge_plan
    from merge_engine.plan.merge_plan import parse_size

    cuts: list[tuple[tuple[str, ...], int]] = []
    real = merge_plan.assign_shards

    def counted(tensors, max_shard_size):
        if max_shard_size is not None:
            cuts.append((tuple(t.name for t in tensors), max_shard_size))
        return real(tensors, max_shard_size)

    for module in (merge_plan, hf_plan, hub_format, megatron_to_hf):
        monkeypatch.setattr(module, "assign_shards", counted)
    step = family_runs["mixtral_w2"].latest
    target = tmp_path / "out"
    assert main(["merge", "--backend", "fsdp", "--local_dir", step.checkpoint_dir, "--target_dir", str(target),
                 "--max-shard-size", "300KB"]) == 0
    assert len(cuts) == 1, [len(names) for names, _ in cuts]
    names, size = cuts[0]
    assert size == parse_size("300KB") and sorted(names) == sorted(_load_folder(step.reference_hf_dir))
    with open(target / "model.safetensors.index.json") as handle:
        assert sorted(json.load(handle)["weight_map"]) == sorted(names)
    tensors = (merge_plan.PlannedTensor("w", (2,), torch.float32, "w"),)
    with pytest.raises(ValueError, match="max_shard_size=None"):
        hub_format.in_weights_format(merge_plan.MergePlan(tensors, real(tensors, 300_000)), {}, "hub", 300_000)
