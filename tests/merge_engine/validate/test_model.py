"""Validation of Hugging Face folders: each check passes on a real tiny model and fails on purpose.

Models are real `transformers` models built from configs (Qwen2 with tied embeddings and GQA, Llama
untied, hidden size 32, two layers, odd vocab sizes). Folders are written through
`merge_engine.storage` under the `root_url` fixture, so every test runs on each backend it offers.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen2ForTokenClassification

from merge_engine import storage
from merge_engine.errors import ValidationFailed
from merge_engine.validate import (
    ValidationReport,
    compare_to_reference,
    expected_tensors,
    forward_check,
    read_safetensors_header,
    unsafe_file_name,
    validate_model,
    validate_structure,
)

# "memory" is fsspec's in-process filesystem: it takes the remote code paths (ranged reads,
# staging) with no server. Add "s3", "gcs" once tests/fixtures_storage.py provides the buckets.
BACKENDS = ["local", "memory"]

QWEN = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
LLAMA = dict(vocab_size=103, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


@pytest.fixture(params=BACKENDS)
def root_url(request, tmp_path) -> str:
    """A fresh, empty root URL on one storage backend."""
    if request.param == "local":
        return str(tmp_path)
    if request.param == "memory":
        return f"memory:///{uuid.uuid4().hex}"
    return request.getfixturevalue(f"{request.param}_bucket_url")


def model_tensors(config) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for a freshly initialised model (tied aliases dropped)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


@pytest.fixture(scope="module")
def qwen():
    config = Qwen2Config(**QWEN)
    return config, model_tensors(config)


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(**LLAMA)
    return config, model_tensors(config)


def write_hf_folder(url: str, config, tensors: dict[str, torch.Tensor], *, shards: int = 3,
                    index_edit=None, config_text: str | None = None) -> str:
    """A Hugging Face folder: config.json, `shards` safetensors files (1: model.safetensors, no index)
    and an index with the true total_size unless `index_edit` changes it."""
    storage.write_bytes(storage.join(url, "config.json"), (config_text or config.to_json_string()).encode())
    names = sorted(tensors)
    if shards == 1:
        storage.write_bytes(storage.join(url, "model.safetensors"), safetensors_bytes(tensors))
        return url
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        storage.write_bytes(storage.join(url, file), safetensors_bytes(part))
        weight_map |= {n: file for n in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if index_edit:
        index_edit(index)
    storage.write_bytes(storage.join(url, "model.safetensors.index.json"), json.dumps(index).encode())
    return url


def failed(report: ValidationReport) -> dict[str, str]:
    return {c.name: c.detail for c in report.failures}


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
            header = read_safetensors_header(str(tmp_path / config.model_type / "model.safetensors"))
            assert expected_tensors(config) == {k: v.shape for k, v in header.tensors.items()}

    def test_unsafe_file_names(self):
        assert unsafe_file_name("model-00001-of-00002.safetensors") is None
        for name in ("..", "../a.safetensors", "a/../../b.safetensors", "C:\\x.safetensors", "", None, 3):
            assert unsafe_file_name(name) is not None


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


class TestForward:
    def test_loads_runs_and_matches_reference(self, root_url, llama):
        config, tensors = llama
        model = write_hf_folder(storage.join(root_url, "m"), config, tensors)
        report = forward_check(model, model, device="cpu")
        assert report.ok, report.summary()
        assert report.check("reference_logits").detail.startswith("max |diff| 0 ")
        assert "LlamaForCausalLM (torch.float32) on cpu" in report.check("load").detail

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


class TestValidateModel:
    def test_everything_passes_and_round_trips(self, root_url, qwen):
        model = write_hf_folder(storage.join(root_url, "m"), *qwen)
        ref = write_hf_folder(storage.join(root_url, "r"), *qwen, shards=1)
        report = validate_model(model, ref)
        assert report.ok, report.summary()
        assert report.model_url == model and report.reference_url == ref
        names = [c.name for c in report.checks]
        assert {"finite", "reference_values", "load", "forward", "reference_logits"} <= set(names)
        assert report.summary().startswith(f"**Validation PASSED** ({len(names)}/{len(names)} checks)")
        assert ValidationReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
        report.raise_for_failure()

    def test_failure_is_reported_and_raisable(self, tmp_path, qwen):
        config, tensors = qwen
        bad = dict(tensors, **{"model.norm.weight": torch.full_like(tensors["model.norm.weight"], float("inf"))})
        report = validate_model(write_hf_folder(str(tmp_path / "m"), config, bad), forward=False)
        assert not report.ok and set(failed(report)) == {"finite"}
        assert "**FAIL** `finite`" in report.summary()
        with pytest.raises(ValidationFailed, match="finite") as err:
            report.raise_for_failure()
        assert err.value.path == str(tmp_path / "m")

    def test_empty_report_is_not_ok(self):
        assert not ValidationReport("x").ok
