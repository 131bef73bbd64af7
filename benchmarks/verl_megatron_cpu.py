"""Run verl 0.9.1's own Megatron merger on a CPU-only machine, behind CPU shims (benchmark only).

    .bench/verl-venv/bin/python -m benchmarks.verl_megatron_cpu merge --backend megatron \\
        --local_dir <actor> --target_dir <out> [--use_cpu_initialization]

verl's merger is written for GPUs. What is replaced here, and nothing else (its loading, merging,
renaming and saving code runs unchanged):
- megatron-core's CUDA calls -> `synthetic_runs.megatron_shims` (synchronize, current_device,
  Tensor.cuda, the CUDA RNG tracker -> megatron's CPU inference tracker);
- ``torch.cuda.set_device`` and verl's ``model_parallel_cuda_manual_seed`` -> no-ops / the CPU tracker;
- the process group backend -> gloo (verl asks for nccl);
- the TransformerEngine layer spec (CUDA-only) -> megatron-core's local spec, whose torch_dist keys
  are the same (see /work/notes/megatron_facts.md), with the fused kernels it cannot run switched
  off in the TransformerConfig (persist_layer_norm, bias / RoPE / softmax fusions): model-building
  flags, not weights.
Must run in verl's venv (transformers < 5.11) with megatron-core 0.16.1 installed there.
"""

from __future__ import annotations

import sys
import warnings


def install() -> None:
    warnings.filterwarnings("ignore")
    import torch

    from synthetic_runs.megatron_shims import install_cpu_shims, use_cpu_rng_tracker

    install_cpu_shims()
    torch.cuda.set_device = lambda *args, **kwargs: None

    import verl.model_merger.megatron_model_merger as merger
    import verl.utils.device as device
    from megatron.core.models.gpt import gpt_layer_specs
    from verl.models.mcore import model_initializer

    device.get_nccl_backend = lambda: "gloo"
    merger.get_nccl_backend = lambda: "gloo"
    merger.model_parallel_cuda_manual_seed = lambda *args, **kwargs: use_cpu_rng_tracker()
    local_spec = gpt_layer_specs.get_gpt_decoder_block_spec

    def without_te(config, use_transformer_engine=True, **kwargs):
        return local_spec(config, use_transformer_engine=False, **kwargs)

    model_initializer.get_gpt_decoder_block_spec = without_te
    to_config = merger.hf_to_mcore_config

    def cpu_config(*args, **kwargs):
        config = to_config(*args, **kwargs)
        for flag in ("persist_layer_norm", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                     "masked_softmax_fusion", "gradient_accumulation_fusion"):
            setattr(config, flag, False)
        return config

    merger.hf_to_mcore_config = cpu_config


def main() -> None:
    install()
    from verl.model_merger.__main__ import main as verl_main

    sys.argv = ["verl.model_merger", *sys.argv[1:]]
    verl_main()


if __name__ == "__main__":
    main()
