"""Fixtures of the validation tests: a root URL per storage backend, and tiny real models."""

from __future__ import annotations

import uuid

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from tests.merge_engine.validate.hf_folders import LLAMA, MIXTRAL, QWEN, model_tensors

# "memory" is fsspec's in-process filesystem: it takes the remote code paths (ranged reads,
# staging) with no server. Add "s3", "gcs" once tests/fixtures_storage.py provides the buckets.
BACKENDS = ["local", "memory"]


@pytest.fixture(params=BACKENDS)
def root_url(request, tmp_path) -> str:
    """A fresh, empty root URL on one storage backend."""
    if request.param == "local":
        return str(tmp_path)
    if request.param == "memory":
        return f"memory:///{uuid.uuid4().hex}"
    return request.getfixturevalue(f"{request.param}_bucket_url")


@pytest.fixture(scope="session")
def qwen():
    config = Qwen2Config(**QWEN)
    return config, model_tensors(config)


@pytest.fixture(scope="session")
def llama():
    config = LlamaConfig(**LLAMA)
    return config, model_tensors(config)



@pytest.fixture(scope="session")
def mixtral_names(tmp_path_factory):
    """A tiny random Mixtral: (config, in-memory tensors, the tensors ``save_pretrained`` writes).

    transformers v5 holds its experts fused (``mlp.experts.gate_up_proj``); its Hub checkpoint holds
    them per expert (``block_sparse_moe.experts.0.w1.weight``)."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**MIXTRAL)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    folder = tmp_path_factory.mktemp("mixtral_hub")
    model.save_pretrained(folder)
    memory = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    return config, memory, load_file(str(folder / "model.safetensors"))
