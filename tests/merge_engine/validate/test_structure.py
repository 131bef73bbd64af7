"""`validate_structure` (`merge_engine.validate.structure`, through `weights`): each check passes on a real
tiny model and fails on purpose."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from merge_engine import storage
from merge_engine.safetensors_file import SafetensorsFile
from merge_engine.validate import expected_tensors, unsafe_file_name, validate_structure
from tests.merge_engine.validate.hf_folders import LLAMA, QWEN, failed, write_hf_folder


class TestStructure:
    def test_sharded_tied_model_passes(self, root_url, qwen):
        """Every structural check runs and passes on a sharded Qwen2 with tied embeddings."""
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), *qwen))
        assert report.ok, report.summary()
        assert [c.name for c in report.checks] == [
            "config", "weights_index", "shard_headers", "index_matches_shards", "total_size",
            "expected_keys", "expected_shapes", "finite"]

    def test_single_file_untied_model_passes(self, root_url, llama):
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), *llama, shards=1))
        assert report.ok, report.summary()
        assert report.check("weights_index").detail == "single model.safetensors"

    def test_dropped_tensor(self, root_url, qwen):
        config, tensors = qwen
        tensors = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.down_proj.weight"}
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, tensors))
        assert set(failed(report)) == {"expected_keys"}
        assert "model.layers.1.mlp.down_proj.weight" in failed(report)["expected_keys"]

    def test_wrong_shape(self, root_url, llama):
        config, tensors = llama
        tensors = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)})  # GQA: 16 x 32
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, tensors))
        assert set(failed(report)) == {"expected_shapes"}
        assert "k_proj.weight: [32, 32] != expected [16, 32]" in failed(report)["expected_shapes"]

    def test_tied_lm_head_must_be_absent(self, root_url, qwen):
        config, tensors = qwen
        tensors = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].clone()})
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, tensors))
        assert set(failed(report)) == {"expected_keys"}
        assert "lm_head.weight" in failed(report)["expected_keys"] and "tied" in failed(report)["expected_keys"]

    @pytest.mark.parametrize("value", [float("nan"), float("inf")])
    def test_nan_or_inf(self, root_url, qwen, value):
        config, tensors = qwen
        bad = tensors["model.layers.1.self_attn.o_proj.weight"].clone()
        bad[3, 5] = value
        tensors = dict(tensors, **{"model.layers.1.self_attn.o_proj.weight": bad})
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, tensors), chunk_bytes=256)
        assert failed(report) == {"finite": "NaN/inf in ['model.layers.1.self_attn.o_proj.weight']"}

    def test_nan_in_bf16(self, root_url, llama):
        config, tensors = llama
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        tensors["model.norm.weight"][7] = float("nan")
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, tensors, shards=1))
        assert set(failed(report)) == {"finite"}

    @pytest.mark.parametrize("name, why", [
        ("../x.safetensors", ".."), ("/etc/x.safetensors", "absolute"), ("sub/x.safetensors", "sub-folder"),
        ("model.bin", "not a .safetensors"),
    ])
    def test_index_names_unsafe_file(self, root_url, qwen, name, why):
        def edit(index):
            index["weight_map"]["model.norm.weight"] = name

        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), *qwen, index_edit=edit))
        assert why in failed(report)["weights_index"]
        assert not report.ok

    @pytest.mark.parametrize("weight_map", [["a"], "model-00001-of-00003.safetensors", {"a": ["x"]},
                                            "[" * 100_000 + "]" * 100_000], ids=["list", "string", "unhashable",
                                                                                 "nested"])
    def test_unusable_weight_map_is_a_failed_check_not_a_traceback(self, root_url, qwen, weight_map):
        """Issue 9 case 11: a weight_map given as a list, a string, with list values, or JSON nested
        100 000 deep (RecursionError) was a traceback; it is a failed ``weights_index`` check."""
        import json

        url = write_hf_folder(storage.join(root_url, "m"), *qwen)
        index = storage.join(url, "model.safetensors.index.json")
        text = weight_map if isinstance(weight_map, str) and weight_map.startswith("[[") else \
            json.dumps({"metadata": {}, "weight_map": weight_map})
        storage.write_bytes(index, text.encode())
        report = validate_structure(url)
        assert not report.ok and "weights_index" in failed(report)

    def test_index_names_missing_file(self, root_url, qwen):
        def edit(index):
            index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"

        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), *qwen, index_edit=edit))
        assert "missing" in failed(report)["weights_index"]

    def test_index_and_shards_disagree(self, root_url, qwen):
        def edit(index):  # points a tensor at a shard that does not hold it
            files = sorted(set(index["weight_map"].values()))
            key = next(k for k, f in index["weight_map"].items() if f == files[0])
            index["weight_map"][key] = files[1]

        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), *qwen, index_edit=edit))
        assert set(failed(report)) == {"index_matches_shards"}

    def test_total_size_wrong(self, root_url, qwen):
        def edit(index):
            index["metadata"]["total_size"] += 4

        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), *qwen, index_edit=edit))
        assert set(failed(report)) == {"total_size"}

    def test_truncated_shard(self, root_url, qwen):
        url = write_hf_folder(storage.join(root_url, "m"), *qwen)
        shard = storage.join(url, "model-00002-of-00003.safetensors")
        storage.write_bytes(shard, storage.read_bytes(shard)[:-10])
        report = validate_structure(url)
        assert "truncated" in failed(report)["shard_headers"]

    def test_broken_config(self, root_url, qwen):
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), *qwen, config_text="{not json"))
        assert set(failed(report)) == {"config"}

    def test_no_weights(self, root_url, qwen):
        storage.write_bytes(storage.join(root_url, "m", "config.json"), qwen[0].to_json_string().encode())
        report = validate_structure(storage.join(root_url, "m"))
        assert "neither" in failed(report)["weights_index"]


class TestExpectedTensors:
    def test_matches_what_save_pretrained_writes(self, tmp_path):
        """The meta-device expectation equals the real save_pretrained output, tied and untied."""
        for config in (Qwen2Config(**QWEN), LlamaConfig(**LLAMA)):
            AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / config.model_type)
            saved = SafetensorsFile(str(tmp_path / config.model_type / "model.safetensors"))
            assert expected_tensors(config) == {k: v.shape for k, v in saved.tensors().items()}
            saved.close()

    def test_unsafe_file_names(self):
        assert unsafe_file_name("model-00001-of-00002.safetensors") is None
        for name in ("..", "../a.safetensors", "a/../../b.safetensors", "C:\\x.safetensors", "", None, 3):
            assert unsafe_file_name(name) is not None

