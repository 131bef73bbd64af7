"""Output biases that transformers 4.x holds as one parameter under two names: written so 4.x reads the one 5.x uses.

A masked-LM head (BERT's ``cls.predictions``, RoBERTa's ``lm_head``: ERNIE, CamemBERT, XLM-RoBERTa, Data2Vec-text,
...) has a ``bias`` and a ``decoder`` whose bias is tied to it. transformers 4.x ties the two in the head's own
constructor (``self.decoder.bias = self.bias``), whatever ``tie_word_embeddings`` says: one parameter, two names,
and ``save_pretrained`` writes it once, as ``bias``. transformers 5 lists the tie in the model's
``_tied_weights_keys`` with the embeddings' and makes none of them when ``tie_word_embeddings`` is false: then
``decoder.bias`` is a parameter of its own, the one the forward adds, and ``bias`` is used by nothing (a
transformers 5 trainer leaves it at its initial value). A 4.x reader of such a folder loads ``bias`` into its one
parameter (4.57.6's BERT: the ``decoder.bias`` value read is overwritten) and silently gets another head.

Contract:
- `legacy_shared_biases(config, names)` -> {name 4.x reads: the name transformers 5's forward uses}: every tie
  transformers 5 makes between two biases when ``tie_word_embeddings`` is true (``all_tied_weights_keys`` of the
  config with the flag set: `merge_engine.plan.model_shapes.model_ties`, read from transformers' own classes, never
  a list of families) that it does not make for ``config`` as it is, where ``names`` holds the name the forward
  uses. Empty when the model ties them already, when transformers lists no ties (4.x installed, an unknown or
  remote-code model type), or when the config cannot be built with the flag set.
- `with_legacy_biases(plan, config)` -> the plan in which each such 4.x name is written from the same stored
  tensor as the name the forward uses (added when the plan lacked it): transformers 5 reads the same logits (the
  other name is read into an unused parameter), 4.x reads the head 5.x runs. What was written so is in the plan's
  ``records["tensor_translation"]`` (``stepmerge.json``) and a note. ``--weights-format transformers`` keeps the
  stored values of both names.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from merge_engine.errors import InvalidConfig
from merge_engine.plan.hub_config import TIE_FLAG
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.plan.model_shapes import model_ties

BIAS = ".bias"
RECORD = "tensor_translation"


def legacy_shared_biases(config: Mapping[str, Any], names: Collection[str]) -> dict[str, str]:
    """{the bias name 4.x reads: the bias name transformers 5's forward uses} (module docstring).

    Args:
        config: the model's config (``config.json`` with the plan's updates laid over it).
        names: the tensor names the folder is written with.
    Returns:
        The pairs to write alike; empty where transformers 5 ties them itself or lists no ties.
    """
    held = frozenset(names)
    actual = model_ties(config, held)
    if actual is None:
        return {}
    try:
        when_tied = model_ties({**dict(config), TIE_FLAG: True}, held)
    except InvalidConfig:
        return {}
    pairs: dict[str, str] = {}
    for used, kept in sorted((when_tied or {}).items()):
        if used.endswith(BIAS) and kept.endswith(BIAS) and used in held and actual.get(used) != kept:
            pairs[kept] = used
    return pairs


def with_legacy_biases(plan: MergePlan, config: Mapping[str, Any]) -> MergePlan:
    """``plan`` with each 4.x-read bias written from the tensor transformers 5's forward uses (module docstring).

    Args:
        plan: an unsharded plan under the Hub names.
        config: the model's config (the plan's ``config_updates`` are laid over it here).
    Returns:
        ``plan`` itself when no bias needs it, else the plan with those tensors, the record and a note.
    """
    merged = {**dict(config), **plan.config_updates}
    by_name = plan.by_name()
    pairs = legacy_shared_biases(merged, list(by_name))
    if not pairs:
        return plan
    tensors = [replace(by_name[pairs[t.name]], name=t.name) if t.name in pairs else t for t in plan.tensors]
    tensors += [replace(by_name[used], name=kept) for kept, used in pairs.items() if kept not in by_name]
    record = [{"key": kept, "tensor": used,
               "from": "transformers 5 ties these biases only with tied embeddings (_tied_weights_keys); "
                       f"transformers 4.x holds them as one parameter and reads {kept}: written as {used}, the "
                       f"bias transformers 5's forward adds ({kept} is unused there)"}
              for kept, used in pairs.items()]
    note = ("tensors written for transformers 4.x readers: " + ", ".join(f"{k} = {u}" for k, u in pairs.items())
            + " (untied embeddings: transformers 5 adds the decoder's bias, 4.x holds one bias under both names)")
    records = {**plan.records, RECORD: list(plan.records.get(RECORD, [])) + record}
    return replace(plan, tensors=tuple(tensors), notes=plan.notes + (note,), records=records)
