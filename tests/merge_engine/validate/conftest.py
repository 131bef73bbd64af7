"""Fixtures of the validation tests: tiny real models. (The root URL per storage backend, ``root_url``:
local, memory, SeaweedFS S3, fake-GCS, is `tests.fixtures_storage`'s.)"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from tests.merge_engine.validate.hf_folders import LLAMA, MIXTRAL, QWEN, model_tensors

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
