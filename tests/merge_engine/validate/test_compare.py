"""The one comparison (`merge_engine.validate.compare`): two HF folders, tensor by tensor."""

from __future__ import annotations

import torch

from merge_engine import storage
from merge_engine.validate import compare_to_reference
from tests.merge_engine.validate.hf_folders import failed, write_hf_folder


class TestCompareToReference:
    def test_identical(self, root_url, qwen):
        model = write_hf_folder(storage.join(root_url, "m"), *qwen)
        ref = write_hf_folder(storage.join(root_url, "r"), *qwen, shards=1)  # sharding may differ
        report = compare_to_reference(model, ref)
        assert report.ok, report.summary()
        assert "max |diff| 0" in report.check("reference_values").detail

    def test_within_and_beyond_tolerance(self, root_url, llama):
        config, tensors = llama
        ref = write_hf_folder(storage.join(root_url, "r"), config, tensors)
        nudged = dict(tensors)
        nudged["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"] + 5e-7
        assert compare_to_reference(write_hf_folder(storage.join(root_url, "a"), config, nudged), ref,
                                    atol=1e-6).ok
        moved = dict(tensors)
        moved["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].clone()
        moved["model.layers.1.mlp.up_proj.weight"][10, 3] += 1e-3
        moved["model.norm.weight"] = tensors["model.norm.weight"] + 1  # sorts after layers.1: not reached
        report = compare_to_reference(write_hf_folder(storage.join(root_url, "b"), config, moved), ref,
                                      atol=1e-6, chunk_bytes=64)
        detail = failed(report)["reference_values"]
        assert set(failed(report)) == {"reference_values"}
        assert detail.startswith("first mismatch in model.layers.1.mlp.up_proj.weight: element 323")  # 10*32+3

    def test_keys_shapes_and_dtypes(self, root_url, llama):
        config, tensors = llama
        ref = write_hf_folder(storage.join(root_url, "r"), config, tensors)
        other = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
        other["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"].half()
        other["model.layers.0.post_attention_layernorm.weight"] = torch.ones(33)
        report = compare_to_reference(write_hf_folder(storage.join(root_url, "m"), config, other), ref)
        problems = failed(report)
        assert "missing ['model.norm.weight']" in problems["reference_keys"]
        assert "post_attention_layernorm" in problems["reference_shapes"]
        assert "input_layernorm.weight: F16 vs F32" in problems["reference_dtypes"]
        assert "reference_values" not in problems  # the comparable tensors are equal

    def test_nan_is_never_close(self, root_url, llama):
        config, tensors = llama
        bad = dict(tensors)
        bad["model.norm.weight"] = tensors["model.norm.weight"].clone()
        bad["model.norm.weight"][0] = float("nan")
        model = write_hf_folder(storage.join(root_url, "m"), config, bad)
        assert not compare_to_reference(model, model).ok  # even against itself, as verl's test

