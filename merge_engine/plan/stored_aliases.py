"""Names that share stored bytes (`check_aliases`): an output never holds more than the input's distinct bytes justify.

A ``torch.save`` file may give one storage any number of names (tied weights: the input embedding
and the output head are one parameter, pickled once, named twice). Every name becomes a tensor of
its own in the output: a few MB of input could make an output of any size.

Rule: names may share stored bytes only where the model ties them. Where transformers
lists the model's ties (`merge_engine.plan.model_shapes.model_ties`, transformers 5): a group is every name
tied to one of them plus that one (Mamba's ``backbone.embeddings`` and ``lm_head``, ERNIE's decoder bias,
Florence-2's shared embeddings), and the plan writes only that one (`merge_engine.plan.output_heads`).
Besides (and where transformers does not say, or the names are Megatron's): exactly the input embedding and
the output head, in a model whose embeddings are tied (`merge_engine.plan.output_heads.embeddings_tied`). Any other sharing, and a shared embedding and head under an untied
config, is `AliasedTensors` naming the file, from metadata alone, before a byte is written. A source that cannot share bytes between names (safetensors, DCP: their readers refuse
overlapping items) has no ``alias_groups`` and passes. A LoRA checkpoint's names are compared as the model's
own (PEFT's ``base_model.model.`` prefix and ``.base_layer`` wrapping taken away): verl's LoRA of a tied model
stores the embedding and the head once, under PEFT's names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from merge_engine.errors import AliasedTensors
from merge_engine.plan.model_shapes import model_ties
from merge_engine.plan.output_heads import EMBED_SUFFIXES, LM_HEAD, embeddings_tied, find_heads
from merge_engine.formats.tensor_source import AliasGroup

__all__ = ["AliasGroup", "check_aliases"]

MEGATRON_HEAD = "output_layer.weight"
PEFT_PREFIX = "base_model.model."  # a LoRA checkpoint's names: PEFT's wrapper around the model's own
PEFT_BASE_LAYER = ".base_layer."


def _model_name(name: str) -> str:
    """The model's own name of a stored name: PEFT's prefix and base-layer wrapping taken away."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    while PEFT_BASE_LAYER in name:
        name = name.replace(PEFT_BASE_LAYER, ".")
    return name


def _tied_pair(names: Sequence[str], config: Mapping[str, Any]) -> bool:
    names = [_model_name(n) for n in names]
    if len(names) != 2:
        return False
    embedding = [n for n in names if n.endswith(EMBED_SUFFIXES)]
    others = [n for n in names if n not in embedding]
    if len(embedding) != 1 or len(others) != 1:
        return False
    head = others[0]
    if head == LM_HEAD or head.endswith(MEGATRON_HEAD):
        return True
    return find_heads(names, config).head == head


def _model_tied(names: Sequence[str], ties: Mapping[str, str] | None) -> bool:
    """Every name but one is tied by the model to that one."""
    if ties is None:
        return False
    names = [_model_name(n) for n in names]
    kept = {ties.get(n, n) for n in names}
    return len(kept) == 1 and kept <= set(names)


def check_aliases(source: object, config: Mapping[str, Any]) -> None:
    """`AliasedTensors` unless every group of names sharing stored bytes is one the model ties (module docstring)."""
    groups = getattr(source, "alias_groups", None)
    if groups is None:
        return
    groups = groups()
    if not groups:
        return
    ties = model_ties(config, {_model_name(name) for group in groups for name in group.names})
    tied = embeddings_tied(config, ties)
    for group in groups:
        if _model_tied(group.names, ties) or (tied and _tied_pair(group.names, config)):
            continue
        shown = ", ".join(group.names[:4]) + (f", ... ({len(group.names)} names)" if len(group.names) > 4 else "")
        if not tied and _tied_pair(group.names, config):
            why = "the config does not tie the embeddings (tie_word_embeddings=false)"
        elif ties is not None:
            why = "only names the config's model ties to one another may (transformers' all_tied_weights_keys)"
        else:
            why = "only the input embedding and the output head of a tied config may"
        raise AliasedTensors(f"{shown} share {group.nbytes} stored bytes: {why}; writing each name would put "
                             f"those bytes {len(group.names)} times into the output", group.url)
