"""The plan of a source whose tensors already carry Hugging Face names (FSDP, HF folders, a LoRA
checkpoint's base view): each tensor copied under its own name, the output-head rules applied
(`merge_engine.output_heads`). Metadata only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from merge_engine.merge_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    MergePlan,
    PlannedTensor,
    assign_shards,
    output_dtype,
    stored_dtype_update,
)
from merge_engine.output_heads import (
    CRITIC_HEAD,
    EMBED_SUFFIXES,
    LM_HEAD,
    check_tie_flag,
    critic_config,
    input_embedding,
    tie_word_embeddings,
    untied_without_head,
)
from merge_engine.tensor_source import TensorMeta


def plan_hf_merge(metas: Mapping[str, TensorMeta], config: Mapping[str, Any], *, dtype: torch.dtype | None = None,
                  max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, tie_flag: bool | None = None,
                  config_url: str | None = None) -> MergePlan:
    """Plan a merge whose source names already are Hugging Face names (FSDP, HF folders).

    - Output dtype: ``dtype`` for floating-point tensors if given, else each tensor's stored dtype.
    - Tied embeddings come from the config; ``lm_head.weight`` is dropped when tied (the caller
      checks the copy equals the embedding: `merge_engine.output_heads.check_tied_copy`).
      ``tie_flag`` (verl's ``--tie-word-embedding``) may only confirm the config (`InvalidOption`).
    - A critic (``score.weight``, no ``lm_head``) gets a token-classification architecture.
    """
    tied = tie_word_embeddings(config)
    check_tie_flag(tie_flag, tied, config_url)
    names = list(metas)
    notes: list[str] = []
    updates: dict[str, Any] = {}
    embed = next((n for n in metas if n.endswith(EMBED_SUFFIXES)), None)
    if CRITIC_HEAD in metas and LM_HEAD not in metas:
        updates.update(critic_config(config, metas[CRITIC_HEAD]))
        notes.append("critic head score.weight -> token classification model")
    elif tied:
        if LM_HEAD in metas:
            input_embedding(metas, config_url)  # the copy we drop is checked against it before writing
            names.remove(LM_HEAD)
            notes.append("tied embeddings: lm_head.weight not written (it equals the embedding)")
    elif embed is not None and LM_HEAD not in metas:
        raise untied_without_head(config_url)
    tensors = [PlannedTensor(n, metas[n].shape, output_dtype(metas[n].dtype, dtype), n) for n in names]
    updates.update(stored_dtype_update(tensors, dtype))
    return MergePlan(tuple(tensors), assign_shards(tensors, max_shard_size), updates, tuple(notes))
