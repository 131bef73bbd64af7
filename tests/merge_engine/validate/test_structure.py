"""`validate_structure` (`merge_engine.validate.structure`, through `weights`): each check passes on a real
tiny model and fails on purpose."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from merge_engine import storage
from merge_engine.formats.safetensors_file import SafetensorsFile
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



def _provenance(weights_format: object) -> dict:
    return {"fingerprint": "f", "options": {"weights_format": weights_format}}


class TestWeightsFormat:
    """The expected names are those of the format the folder was written in (``stepmerge.json``)."""

    def test_transformers_format_moe_passes_with_its_stored_names(self, root_url, mixtral_names):
        """A `--weights-format transformers` Mixtral (fused experts, v5's in-memory names) is complete."""
        config, memory, _ = mixtral_names
        assert "model.layers.0.mlp.experts.gate_up_proj" in memory
        url = write_hf_folder(storage.join(root_url, "m"), config, memory, provenance=_provenance("transformers"))
        report = validate_structure(url)
        assert report.ok, report.summary()
        assert "in-memory names" in report.check("expected_keys").detail

    def test_the_same_folder_without_its_record_is_judged_by_hub_names(self, root_url, mixtral_names):
        """Without stepmerge.json the folder must hold the Hub names: fused experts are unexpected there."""
        config, memory, _ = mixtral_names
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, memory))
        assert set(failed(report)) == {"expected_keys"}
        detail = failed(report)["expected_keys"]
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in detail and "gate_up_proj" in detail

    def test_hub_format_passes_and_still_fails_on_a_wrong_name(self, root_url, mixtral_names):
        config, _, hub = mixtral_names
        good = validate_structure(write_hf_folder(storage.join(root_url, "good"), config, hub,
                                                  provenance=_provenance("hub")))
        assert good.ok, good.summary()
        renamed = dict(hub)
        renamed["model.layers.1.block_sparse_moe.experts.2.w9.weight"] = renamed.pop(
            "model.layers.1.block_sparse_moe.experts.2.w1.weight")
        bad = validate_structure(write_hf_folder(storage.join(root_url, "bad"), config, renamed,
                                                 provenance=_provenance("hub")))
        assert set(failed(bad)) == {"expected_keys"}
        assert "experts.2.w9.weight" in failed(bad)["expected_keys"]
        assert "experts.2.w1.weight" in failed(bad)["expected_keys"]

    def test_transformers_format_fails_on_a_wrong_name(self, root_url, mixtral_names):
        config, memory, _ = mixtral_names
        renamed = dict(memory)
        renamed["model.layers.1.mlp.experts.gate_up"] = renamed.pop("model.layers.1.mlp.experts.gate_up_proj")
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, renamed,
                                                    provenance=_provenance("transformers")))
        assert set(failed(report)) == {"expected_keys"}
        assert "model.layers.1.mlp.experts.gate_up_proj" in failed(report)["expected_keys"]

    def test_transformers_format_of_a_4x_checkpoint_holds_hub_names(self, root_url, mixtral_names):
        """A checkpoint saved under transformers 4.x stores the Hub names: as stored, they are complete."""
        config, _, hub = mixtral_names
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, hub,
                                                    provenance=_provenance("transformers")))
        assert report.ok, report.summary()
        assert "Hub names" in report.check("expected_keys").detail

    def test_mixed_names_fail_in_either_format(self, root_url, mixtral_names):
        """One layer fused, the other per expert: equal to neither key set."""
        config, memory, hub = mixtral_names
        mixed = {k: v for k, v in memory.items() if not k.startswith("model.layers.1.")}
        mixed |= {k: v for k, v in hub.items() if k.startswith("model.layers.1.")}
        for fmt in ("transformers", "hub"):
            report = validate_structure(write_hf_folder(storage.join(root_url, fmt), config, mixed,
                                                        provenance=_provenance(fmt)))
            assert set(failed(report)) == {"expected_keys"}, fmt

    @pytest.mark.parametrize("recorded", ["gguf", 3])
    def test_an_unknown_recorded_format_fails_naming_the_record(self, root_url, mixtral_names, recorded):
        config, memory, _ = mixtral_names
        report = validate_structure(write_hf_folder(storage.join(root_url, "m"), config, memory,
                                                    provenance=_provenance(recorded)))
        assert set(failed(report)) == {"expected_keys"}
        assert "stepmerge.json" in failed(report)["expected_keys"] and "weights format" in failed(report)["expected_keys"]

    def test_an_explicit_format_wins_over_the_record(self, root_url, mixtral_names):
        config, memory, _ = mixtral_names
        url = write_hf_folder(storage.join(root_url, "m"), config, memory, provenance=_provenance("transformers"))
        assert not validate_structure(url, weights_format="hub").ok
        assert validate_structure(url, weights_format="transformers").ok

    def test_expected_in_memory_names(self, mixtral_names):
        config, memory, hub = mixtral_names
        assert expected_tensors(config, weights_format="transformers") == {k: tuple(v.shape) for k, v in memory.items()}
        assert expected_tensors(config) == {k: tuple(v.shape) for k, v in hub.items()}
