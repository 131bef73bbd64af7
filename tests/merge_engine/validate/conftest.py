"""Fixtures of the validation tests: a root URL per storage backend, and two tiny real models."""

from __future__ import annotations

import uuid

import pytest
from transformers import LlamaConfig, Qwen2Config

from tests.merge_engine.validate.hf_folders import LLAMA, QWEN, model_tensors

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

