"""Hugging Face folders for the validation tests: real `transformers` models built from configs (Qwen2
with tied embeddings and GQA, Llama untied, hidden size 32, two layers, odd vocab sizes), written
through `merge_engine.storage` so every test runs on each backend `root_url` offers."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM

from merge_engine import storage
from merge_engine.validate import ValidationReport

QWEN = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])


LLAMA = dict(vocab_size=103, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])

MIXTRAL = dict(vocab_size=107, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2, tie_word_embeddings=False,
               architectures=["MixtralForCausalLM"])


def model_tensors(config) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for a freshly initialised model (tied aliases dropped)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def write_hf_folder(url: str, config, tensors: dict[str, torch.Tensor], *, shards: int = 3,
                    index_edit=None, config_text: str | None = None, provenance: dict | None = None) -> str:
    """A Hugging Face folder: config.json, `shards` safetensors files (1: model.safetensors, no index)
    and an index with the true total_size unless `index_edit` changes it; ``provenance``: a
    ``stepmerge.json`` as a merge writes it."""
    storage.write_bytes(storage.join(url, "config.json"), (config_text or config.to_json_string()).encode())
    if provenance is not None:
        storage.write_bytes(storage.join(url, "stepmerge.json"), json.dumps(provenance).encode())
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

