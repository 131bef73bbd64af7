"""The plan of a source whose tensors already carry Hugging Face names (FSDP, HF folders, a LoRA
checkpoint's base view): each tensor copied under its own name, the output-head rules applied
(`merge_engine.plan.output_heads`). Metadata only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


from merge_engine.plan.merge_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    MergePlan,
    PlannedTensor,
    assign_shards,
    stored_dtype_update,
)
from merge_engine.errors import InvalidConfig
from merge_engine.plan.model_heads import model_head_names
from merge_engine.plan.model_shapes import model_ties
from merge_engine.plan.output_heads import (
    CRITIC_HEAD,
    check_tie_flag,
    critic_config,
    find_heads,
    embeddings_tied,
    tie_word_embeddings,
    untied_without_head,
)
from merge_engine.formats.tensor_source import TensorMeta


def plan_hf_merge(metas: Mapping[str, TensorMeta], config: Mapping[str, Any], *,
                  max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE, tie_flag: bool | None = None,
                  config_url: str | None = None) -> MergePlan:
    """Plan a merge whose source names already are Hugging Face names (FSDP, HF folders).

    - Each tensor in its stored dtype (``--dtype`` is applied to the plan: `MergePlan.with_dtype`).
    - Tied weights come from the model (`merge_engine.plan.model_shapes.model_ties`, transformers 5, each tie
      resolved against the names ``metas`` holds): every tied name is dropped, its copy checked by the caller
      (`merge_engine.plan.output_heads.check_dropped_head`); else from the config: the output head (``lm_head.weight``, or the model's own
      name for it: `merge_engine.plan.output_heads.find_heads`) is dropped when tied (the caller
      checks the copy equals the embedding: `merge_engine.plan.output_heads.check_tied_copy`).
      ``tie_flag`` (verl's ``--tie-word-embedding``) may only confirm the config (`InvalidOption`).
    - A critic (``score.weight``, no ``lm_head``) gets a token-classification architecture.
    """
    ties = model_ties(config, metas)
    if tie_flag is not None:
        check_tie_flag(tie_flag, embeddings_tied(config, ties), config_url)
    names = list(metas)
    notes: list[str] = []
    updates: dict[str, Any] = {}
    heads = find_heads(metas, config)  # the model's own names where the common ones do not apply
    if CRITIC_HEAD in metas and heads.head is None:
        updates.update(critic_config(config, metas[CRITIC_HEAD]))
        notes.append("critic head score.weight -> token classification model")
    elif ties is not None:  # the model's own ties decide what is written (output_heads)
        for name in sorted(t for t in ties if t in metas):
            if ties[name] not in metas:  # the copy we drop is checked against it before writing
                raise InvalidConfig(f"the model ties {name} to {ties[name]}, which the checkpoint does not hold: "
                                    "no input embedding (or other tensor) to tie it to and check it against",
                                    config_url)
            names.remove(name)
            notes.append(f"tied weights: {name} not written (it equals {ties[name]})")
        if heads.embedding is not None and heads.head is None:
            head_names = model_head_names(config)
            if not any(n in ties for n in (head_names.head if head_names else ())):
                raise untied_without_head(config_url)
    elif tie_word_embeddings(config):
        if heads.head is not None:
            if heads.embedding is None:  # the copy we drop is checked against it before writing
                raise InvalidConfig("config ties embeddings but the checkpoint has no input embedding to tie "
                                    f"{heads.head} to", config_url)
            names.remove(heads.head)
            notes.append(f"tied embeddings: {heads.head} not written (it equals {heads.embedding})")
    elif heads.embedding is not None and heads.head is None:
        raise untied_without_head(config_url)
    tensors = [PlannedTensor(n, metas[n].shape, metas[n].dtype, n) for n in names]
    updates.update(stored_dtype_update(tensors, None))
    return MergePlan(tuple(tensors), assign_shards(tensors, max_shard_size), updates, tuple(notes))
