"""Names that share stored bytes (`check_aliases`): an output never holds more than the input's distinct bytes justify.

A ``torch.save`` file may give one storage any number of names (tied weights: the input embedding
and the output head are one parameter, pickled once, named twice). Every name becomes a tensor of
its own in the output, so 200 names over one 4 MB storage made an 801 MB output from 11 MB of input.

Rule (issue 17 point 4): names may share stored bytes only where the config ties them: exactly the
input embedding and the output head, in a config with ``tie_word_embeddings`` (the plan then writes
the head not at all, `merge_engine.plan.output_heads`). Any other sharing, and a shared embedding and head
under an untied config, is `AliasedTensors` naming the file, from metadata alone, before a byte is
written. A source that cannot share bytes between names (safetensors, DCP: their readers refuse
overlapping items) has no ``alias_groups`` and passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from merge_engine.errors import AliasedTensors
from merge_engine.plan.output_heads import EMBED_SUFFIXES, LM_HEAD, find_heads, tie_word_embeddings
from merge_engine.formats.tensor_source import AliasGroup

__all__ = ["AliasGroup", "check_aliases"]

MEGATRON_HEAD = "output_layer.weight"


def _tied_pair(names: Sequence[str], config: Mapping[str, Any]) -> bool:
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


def check_aliases(source: object, config: Mapping[str, Any]) -> None:
    """`AliasedTensors` unless every group of names sharing stored bytes is the tied embedding and head."""
    groups = getattr(source, "alias_groups", None)
    if groups is None:
        return
    tied = tie_word_embeddings(dict(config))
    for group in groups():
        if tied and _tied_pair(group.names, config):
            continue
        shown = ", ".join(group.names[:4]) + (f", ... ({len(group.names)} names)" if len(group.names) > 4 else "")
        why = ("only the input embedding and the output head of a tied config may" if not _tied_pair(group.names, config)
               else "the config does not tie the embeddings (tie_word_embeddings=false)")
        raise AliasedTensors(f"{shown} share {group.nbytes} stored bytes: {why}; writing each name would put "
                             f"those bytes {len(group.names)} times into the output", group.url)
