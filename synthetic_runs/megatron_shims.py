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
- ``multi_latent_attention.HAVE_TE`` -> False: without TransformerEngine, megatron-core 0.16.1
  binds ``TELinear`` to a ``MagicMock`` stand-in and still sets ``HAVE_TE = True``, so building
  an MLA layer fails with ``TypeError: isinstance() arg 2 must be a type, a tuple of types, or a
  union when instantiating MLASelfAttention`` (the check it guards is for TE's FP8 paths only).
- MLA's core attention: see `mla_core_attention` (used by the DeepSeek fixtures' layer specs).

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
    from megatron.core.transformer import multi_latent_attention

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        multi_latent_attention.HAVE_TE = False
    _INSTALLED = True


def use_cpu_rng_tracker() -> None:
    """Replace megatron's CUDA RNG tracker by its inference tracker (``fork()`` = null context).

    Call after ``parallel_state.initialize_model_parallel``; safe to call again after a re-init.
    """
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def mla_core_attention() -> type:
    """megatron-core's own local ``DotProductAttention``, taking the head sizes MLA passes.

    megatron-core 0.16.1 builds MLA's core attention with ``k_channels`` / ``v_channels``, which
    only TransformerEngine's attention accepts; the local class fails with ``TypeError:
    DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'``. Its math
    already takes the key size from the tensors (``reshape(..., -1)``) and the value size from
    ``config.kv_channels``, so this subclass checks ``v_channels == config.kv_channels`` and drops
    both. The module has no weights: what is saved is unchanged.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: object, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None and v_channels != self.config.kv_channels:
                raise ValueError(f"local attention needs kv_channels == v_head_dim ({self.config.kv_channels} != "
                                 f"{v_channels})")

    return MLADotProductAttention
