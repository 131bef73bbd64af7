"""Adapters at any URL: base, adapters and target on a plain path, file://, S3 (SeaweedFS), GCS
(fake-gcs-server) -- the same bytes as the local fuse, and the atomic-target contract remotely."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from merge_engine import storage
from merge_engine.commands.combine import merge_lora
from merge_engine.output.jobs import OutputOptions


def upload(folder: str, url: str) -> str:
    for entry in storage.list_files(folder):
        storage.copy_file(os.path.join(folder, entry.path), storage.join(url, entry.path))
    return url


def download(url: str, folder: str) -> str:
    for entry in storage.list_files(url):
        storage.copy_file(storage.join(url, entry.path), os.path.join(folder, entry.path))
    return folder


def test_fuse_and_combine_between_urls(tmp_path, storage_root, tiny_base, peft_adapters):
    base = upload(tiny_base, storage.join(storage_root, "base"))
    adapters = [upload(peft_adapters[n], storage.join(storage_root, n)) for n in ("qv", "embed_save")]
    merge_lora(base, adapters, storage.join(storage_root, "fused"))
    merge_lora(None, adapters, storage.join(storage_root, "combined"), OutputOptions(output="adapter", rank=2))
    merge_lora(tiny_base, [peft_adapters["qv"], peft_adapters["embed_save"]], str(tmp_path / "local"))
    remote = load_file(os.path.join(download(storage.join(storage_root, "fused"), str(tmp_path / "fused")),
                                    "model.safetensors"))
    local = load_file(str(tmp_path / "local" / "model.safetensors"))
    assert sorted(remote) == sorted(local) and all(torch.equal(remote[k], local[k]) for k in local)
    combined = {e.path for e in storage.list_files(storage.join(storage_root, "combined"))}
    assert combined == {"adapter_config.json", "adapter_model.safetensors", "stepmerge.json"}
    assert merge_lora(base, adapters, storage.join(storage_root, "fused")).skipped
