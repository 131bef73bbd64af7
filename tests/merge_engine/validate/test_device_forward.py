"""Validation forwards on the device asked for (`forward_check`, `check_against_trained`).

On every machine: the CPU runs (``device="cpu"``), and a device this machine cannot use is refused
before anything loads. Where CUDA is present (marked ``cuda``; skipped elsewhere with the reason 'no CUDA
device'): the same checks run on the GPU, their logits equal the CPU's, only one model is on the GPU at a
time, and its memory is handed back after. Self-contained (its models are built here, no session
fixture), so the GPU check runs it with ``pytest --noconftest`` in a bare CUDA image
(benchmarks/gpu_check.sh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from merge_engine.errors import InvalidDevice
from merge_engine.validate.forward import forward_check, model_logits
from merge_engine.validate.model import validate_model
from merge_engine.validate.trained import TRAINED, VS_FUSED, check_against_trained

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> tuple[str, int]:
    """A Qwen2 of ~150 MB in float32 (vocab 32000 dominates), saved by transformers; (folder, its bytes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    folder = str(tmp_path_factory.mktemp("device_forward") / "model")
    model.save_pretrained(folder)
    return folder, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def lora_step(tmp_path_factory) -> tuple[str, str]:
    """A one-rank verl FSDP LoRA step (synthetic_runs, PEFT's own model) and PEFT's merge of it, saved."""
    from synthetic_runs.fsdp import FsdpSpec, LoraSpec, build_reference_model, write_fsdp_step

    root = tmp_path_factory.mktemp("device_trained")
    spec = FsdpSpec(world_size=1, strategy="single", lora=LoraSpec(r=2, alpha=8))
    files = write_fsdp_step(root / "global_step_1", spec, seed=3)
    fused = str(root / "fused")
    build_reference_model(spec, 3).merge_and_unload().save_pretrained(fused)
    return files.checkpoint_dir, fused


def test_the_forward_check_runs_on_the_cpu_when_asked(model_folder):
    folder, _ = model_folder
    report = forward_check(folder, folder, device="cpu")
    assert report.ok, report.summary()
    assert "on cpu" in report.check("load").detail


def test_the_trained_check_runs_on_the_cpu_when_asked(lora_step):
    checkpoint, fused = lora_step
    report = check_against_trained(checkpoint, fused_model_url=fused, device="cpu")
    assert report.ok and report.check(TRAINED).ok and report.check(VS_FUSED).ok, report.text()


@pytest.mark.parametrize("name", ["gpu9"] + (["cuda"] if torch.version.cuda is None else []))
def test_a_device_this_machine_cannot_use_is_refused_before_anything_loads(name, tmp_path):
    missing = str(tmp_path / "not_there")  # nothing is read: the device is refused first
    for check in (lambda: forward_check(missing, device=name), lambda: validate_model(missing, device=name),
                  lambda: check_against_trained(missing, fused_model_url=missing, device=name)):
        with pytest.raises(InvalidDevice, match=rf"^--device .*\[{name}\]$"):  # the value, once, on one line
            check()


@cuda
def test_the_forward_check_runs_on_the_gpu_one_model_at_a_time(model_folder):
    """On cuda: the report says so, the logits equal the CPU's, the peak GPU memory of a check that loads
    the model and its reference stays under two models, and the memory is handed back after."""
    folder, model_bytes = model_folder
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # cuBLAS's workspace, kept for the process
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    report = forward_check(folder, folder, device="cuda")
    assert report.ok, report.summary()
    assert "on cuda" in report.check("load").detail
    assert torch.cuda.max_memory_allocated() - before < 2 * model_bytes
    # handed back: what stays is the allocator's and cuBLAS's per-stream workspaces (33 MiB seen on an H200), no model
    assert torch.cuda.memory_allocated() - before < model_bytes // 4
    on_gpu, _ = model_logits(folder, "cuda", dtype=torch.float32)
    on_cpu, _ = model_logits(folder, "cpu", dtype=torch.float32)
    assert on_gpu.device.type == "cpu"  # compared on the CPU
    torch.testing.assert_close(on_gpu, on_cpu, atol=1e-3, rtol=1e-3)


@cuda
def test_the_trained_check_runs_on_the_gpu_and_frees_it(lora_step):
    checkpoint, fused = lora_step
    model_bytes = sum(f.stat().st_size for f in Path(fused).glob("*.safetensors"))
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # cuBLAS's workspace, kept for the process
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    report = check_against_trained(checkpoint, fused_model_url=fused, device="cuda")
    assert report.ok and report.check(VS_FUSED).ok, report.text()
    assert torch.cuda.memory_allocated() - before < model_bytes // 4  # no model left on the GPU
