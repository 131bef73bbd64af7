"""The one forward pass (`merge_engine.validate.forward`): load, run fixed tokens, compare logits."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForTokenClassification

from merge_engine import storage
from merge_engine.validate import forward_check, validate_model
from tests.merge_engine.validate.hf_folders import QWEN, failed, write_hf_folder


def _saved_by_transformers(folder, config, tensors: dict[str, torch.Tensor]) -> str:
    """A reference built independently of the folder under test: transformers' own model of ``tensors``,
    written by its own ``save_pretrained``."""
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tensors, strict=True)
    model.save_pretrained(folder)
    return str(folder)


class TestForward:
    def test_loads_runs_and_matches_reference(self, root_url, llama, tmp_path):
        """The reference is not the folder itself: transformers' own save of the same weights matches (max
        |diff| 0); the same save with one weight changed by one does not."""
        config, tensors = llama
        model = write_hf_folder(storage.join(root_url, "m"), config, tensors)
        reference = _saved_by_transformers(tmp_path / "reference", config, tensors)
        report = forward_check(model, reference, device="cpu")
        assert report.ok, report.summary()
        assert report.check("reference_logits").detail.startswith("max |diff| 0 ")
        assert "LlamaForCausalLM (torch.float32) on cpu" in report.check("load").detail

        weight = tensors["model.layers.1.mlp.down_proj.weight"].clone()
        weight.view(-1)[0] += 1
        mutated = _saved_by_transformers(tmp_path / "mutated", config,
                                         dict(tensors, **{"model.layers.1.mlp.down_proj.weight": weight}))
        assert set(failed(forward_check(model, mutated, device="cpu"))) == {"reference_logits"}

    def test_reference_logits_differ(self, root_url, llama):
        config, tensors = llama
        model = write_hf_folder(storage.join(root_url, "m"), config, tensors)
        other = dict(tensors, **{"lm_head.weight": tensors["lm_head.weight"] * 2})
        ref = write_hf_folder(storage.join(root_url, "r"), config, other)
        assert set(failed(forward_check(model, ref))) == {"reference_logits"}

    def test_nan_weights_give_non_finite_logits(self, tmp_path, llama):
        config, tensors = llama
        bad = dict(tensors, **{"model.norm.weight": torch.full_like(tensors["model.norm.weight"], float("nan"))})
        report = forward_check(write_hf_folder(str(tmp_path / "m"), config, bad))
        assert set(failed(report)) == {"forward"}

    def test_missing_weights_fail_to_load(self, tmp_path, llama):
        storage.write_bytes(str(tmp_path / "m" / "config.json"), llama[0].to_json_string().encode())
        assert set(failed(forward_check(str(tmp_path / "m")))) == {"load"}

    def test_critic_loads_as_token_classification(self, tmp_path):
        """verl critics (score.weight) come out as *ForTokenClassification with one label."""
        config = Qwen2Config(**dict(QWEN, architectures=["Qwen2ForTokenClassification"], num_labels=1))
        Qwen2ForTokenClassification(config).save_pretrained(tmp_path / "critic")
        report = validate_model(str(tmp_path / "critic"))
        assert report.ok, report.summary()
        assert "logits [1, 16, 1]" in report.check("forward").detail

