"""Synthetic training runs: authentic checkpoints from known weights, for tests, demos and benchmarks.

- `models`: tiny `transformers` models (Qwen2, Llama; causal LM or critic) with deterministic weights.
- `tokenizer`: a small real tokenizer trained locally with `tokenizers`.
- `fsdp`: verl-layout FSDP checkpoints written by real `torch.distributed` (gloo, spawned ranks); a step
  can also be saved by verl 0.9.1's own `FSDPCheckpointManager` (`verl_lib`: installed once per machine).

Importable without pytest; `python -m synthetic_runs --help` is the command line.
"""

from synthetic_runs.fsdp import (
    FsdpSpec,
    LoraSpec,
    RunFiles,
    StepFiles,
    StepJob,
    SyntheticRunError,
    fixture_matrix,
    write_fixture_matrix,
    write_fsdp_step,
    write_fsdp_steps,
    write_verl_run,
)
from synthetic_runs.models import ModelSpec, build_config, build_model, write_hf_metadata

__all__ = [
    "FsdpSpec",
    "LoraSpec",
    "ModelSpec",
    "RunFiles",
    "StepFiles",
    "StepJob",
    "SyntheticRunError",
    "build_config",
    "build_model",
    "fixture_matrix",
    "write_fixture_matrix",
    "write_fsdp_step",
    "write_fsdp_steps",
    "write_hf_metadata",
    "write_verl_run",
]
