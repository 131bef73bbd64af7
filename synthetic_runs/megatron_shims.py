"""CPU stand-ins that let megatron-core 0.16.1 build, save and run a GPTModel without CUDA.

Test-only: imported inside the spawned fixture workers of ``synthetic_runs.megatron``, never by
``merge_engine``. Each shim replaces one CUDA call that megatron-core makes unconditionally, and
changes nothing else:

- ``torch.cuda.synchronize`` -> no-op (``parallel_state``, ``dist_checkpointing`` save).
- ``torch.cuda.current_device`` -> ``torch.device("cpu")`` (rotary embedding, checkpoint save).
  Returning a device rather than an int keeps ``tensor.to(device=torch.cuda.current_device())``
  on the CPU.
- ``torch.Tensor.cuda`` -> identity (``LanguageModule.setup_embeddings_and_output_layer`` moves the
  tied embedding to CUDA before the first/last-stage all-reduce when PP > 1).
- The CUDA RNG tracker -> megatron's own inference tracker, whose ``fork()`` is a null context
  (dropout is 0 in the fixtures, so no RNG stream is consumed in a forward pass).

``install_cpu_shims()`` patches the process it runs in; call it only in a throwaway worker process.
"""

from __future__ import annotations

import torch

_INSTALLED = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_op(*_args: object, **_kwargs: object) -> None:
    return None


def _tensor_stays_on_cpu(self: torch.Tensor, *_args: object, **_kwargs: object) -> torch.Tensor:
    return self


def install_cpu_shims() -> None:
    """Patch the three CUDA calls megatron-core makes on CPU; idempotent. Worker processes only."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_available():  # pragma: no cover - the fixtures are CPU-only by design
        raise RuntimeError("megatron CPU shims must not be installed on a machine with CUDA")
    torch.cuda.synchronize = _no_op
    torch.cuda.current_device = _cpu_device
    torch.Tensor.cuda = _tensor_stays_on_cpu
    _INSTALLED = True


def use_cpu_rng_tracker() -> None:
    """Replace megatron's CUDA RNG tracker by its inference tracker (``fork()`` = null context).

    Call after ``parallel_state.initialize_model_parallel``; safe to call again after a re-init.
    """
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
