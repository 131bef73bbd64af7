"""CPU stand-ins that let megatron-core 0.16.1 build, save and run a GPTModel without CUDA.

Test-only: imported by the forked fixture workers of ``synthetic_runs.megatron``, never by
``merge_engine``. Each shim replaces one call that fails on a CPU-only install (CUDA, or a name
megatron-core binds only when TransformerEngine imports), and changes nothing else:

- ``torch.cuda.synchronize`` -> no-op (``parallel_state``, ``dist_checkpointing`` save).
- ``torch.cuda.current_device`` -> ``torch.device("cpu")`` (rotary embedding, checkpoint save).
  Returning a device rather than an int keeps ``tensor.to(device=torch.cuda.current_device())``
  on the CPU.
- ``torch.Tensor.cuda`` -> identity (``LanguageModule.setup_embeddings_and_output_layer`` moves the
  tied embedding to CUDA before the first/last-stage all-reduce when PP > 1).
- The CUDA RNG tracker -> megatron's own inference tracker, whose ``fork()`` is a null context
  (dropout is 0 in the fixtures, so no RNG stream is consumed in a forward pass).
- ``moe_utils.te_general_gemm`` -> None when TransformerEngine is absent: megatron-core 0.16.1 only
  binds that name inside ``try: import transformer_engine``, and the MoE router's forward then
  fails with NameError instead of taking its plain ``torch.mm`` branch.

``install_cpu_shims()`` patches the process it runs in (and keeps it on the CPU even where CUDA
exists); call it only in a throwaway worker process.
"""

from __future__ import annotations

import warnings

import torch

# Importing this module first (the fixture forkserver does) silences megatron-core's import-time
# notices that Apex / TransformerEngine are absent: on CPU that absence is the point.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|TransformerEngine).*")

_INSTALLED = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_op(*_args: object, **_kwargs: object) -> None:
    return None


def _tensor_stays_on_cpu(self: torch.Tensor, *_args: object, **_kwargs: object) -> torch.Tensor:
    return self


def install_cpu_shims() -> None:
    """Install the CPU stand-ins listed in the module docstring; idempotent. Worker processes only."""
    global _INSTALLED
    if _INSTALLED:
        return
    torch.cuda.synchronize = _no_op
    torch.cuda.current_device = _cpu_device
    torch.Tensor.cuda = _tensor_stays_on_cpu
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _INSTALLED = True


def use_cpu_rng_tracker() -> None:
    """Replace megatron's CUDA RNG tracker by its inference tracker (``fork()`` = null context).

    Call after ``parallel_state.initialize_model_parallel``; safe to call again after a re-init.
    """
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
