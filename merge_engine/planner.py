"""The planner: a checkpoint's tensors + its config -> the `MergePlan` of the model it holds.

Decided once, here, from metadata alone:
- the layout names its tensors the Megatron way (`Layout.tensor_naming` is ``MEGATRON_NAMES``):
  the model family's table plans it (`merge_engine.architectures.megatron_to_hf`);
- Hugging Face names holding LoRA factors: the TRAINED model, every update fused into its base
  (`merge_engine.lora.checkpoint.plan_trained_model`; never the base alone);
- other Hugging Face names: each tensor under its own name (`merge_engine.plan.hf_plan`).
Names sharing one stored tensor are allowed only as the tied embedding and head
(`merge_engine.plan.stored_aliases`: the output never exceeds what the input's distinct bytes justify).
Every planner applies the same output-head rules (`merge_engine.plan.output_heads`: one tied-embedding
rule, one critic rule), re-exported here for the checks that need them (`merge_engine.validate`).
``--custom-mapping`` applies to Megatron names only (`InvalidOption` otherwise).
"""

from __future__ import annotations

from typing import Any


from merge_engine.architectures.megatron_to_hf import plan_megatron_merge
from merge_engine.errors import InvalidOption
from merge_engine.plan.hf_plan import plan_hf_merge
from merge_engine.layouts import MEGATRON_NAMES, Checkpoint, layout_named
from merge_engine.lora.checkpoint import is_lora_checkpoint, plan_trained_model
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.plan.stored_aliases import check_aliases
from merge_engine.plan.output_heads import (
    check_dropped_head,
    check_tie_flag,
    check_tied_copy,
    critic_config,
    input_embedding,
    tie_word_embeddings,
)
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource

__all__ = ["check_dropped_head", "check_tie_flag", "check_tied_copy", "critic_config", "input_embedding",
           "plan_checkpoint", "plan_hf_merge", "tie_word_embeddings"]


def plan_checkpoint(checkpoint: Checkpoint, source: TensorSource, config: dict[str, Any], *,
                    max_shard_size: int | None, tie_flag: bool | None = None,
                    lora_alpha: float | None = None, custom_mapping: str | None = None,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES, mtp_layers: str | None = None) -> MergePlan:
    """The plan of the model ``checkpoint`` holds (see the module docstring). Reads no weight, except
    a LoRA checkpoint's stored tied head, compared with its embedding before it is dropped. Names that
    share stored bytes other than the tied embedding and head are refused first (`check_aliases`)."""
    check_aliases(source, config)
    if layout_named(checkpoint.layout).tensor_naming == MEGATRON_NAMES:
        extra = {"custom_mapping": custom_mapping} if custom_mapping is not None else {}
        return plan_megatron_merge(source, config, max_shard_size=max_shard_size, tie_flag=tie_flag,
                                   mtp_layers=mtp_layers, **extra)
    if mtp_layers is not None:
        raise InvalidOption(f"--mtp-layers applies to Megatron checkpoints, not to a {checkpoint.layout} one")
    if custom_mapping is not None:
        raise InvalidOption(f"--custom-mapping applies to Megatron checkpoints, not to a {checkpoint.layout} one",
                            custom_mapping)
    metas = source.metas()
    if is_lora_checkpoint(metas):
        return plan_trained_model(checkpoint, source, config, max_shard_size=max_shard_size,
                                  tie_flag=tie_flag, lora_alpha=lora_alpha, chunk_bytes=chunk_bytes)
    return plan_hf_merge(metas, config, max_shard_size=max_shard_size, tie_flag=tie_flag,
                         config_url=checkpoint.hf_dir)
