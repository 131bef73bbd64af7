"""The input embedding and output head of a model, named by the model itself.

A checkpoint's head is not always ``lm_head.weight``: GPT-NeoX's is ``embed_out.weight`` on the Hub
(and in checkpoints written under transformers 4.x), GPT-2's input embedding is
``transformer.wte.weight``, a vision-language model's is ``model.language_model.embed_tokens.weight``
in memory and ``model.embed_tokens.weight`` on the Hub. The planner's tie rule asks this module.

Contract:
- `model_head_names(config)` -> `ModelHeadNames`: every name the model's input embedding and output
  head weights may carry, in memory and on the Hub. The config's model class is built on the ``meta``
  device and asked (`get_input_embeddings`, `get_output_embeddings`); the Hub names come from
  transformers' own save-time conversion (`merge_engine.plan.hub_format`). Cached by config content.
- None for a model transformers cannot build (unknown or remote-code type).
- `conv1d_modules(config)`: the model's Conv1D layers (weights stored (in, out)): a LoRA on them is
  ``fan_in_fan_out``, as PEFT decides when it wraps them.
`merge_engine.plan.output_heads.find_heads` (the planner's tie rule) asks it when the common names
(``lm_head.weight``, ``*embed_tokens.weight``...) do not settle which tensors are the heads.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class ModelHeadNames:
    """Every name the model's input embedding / output head weight may carry (memory and Hub)."""

    embedding: tuple[str, ...]
    head: tuple[str, ...]


def _module_weight_name(model: Any, module: Any) -> str | None:
    if module is None or getattr(module, "weight", None) is None:
        return None
    for name, candidate in model.named_modules():
        if candidate is module:
            return f"{name}.weight" if name else "weight"
    return None


@functools.lru_cache(maxsize=8)
def _head_names(config_json: str) -> ModelHeadNames | None:
    from merge_engine.plan.transformers_conversion import TensorView, meta_model, trace_reverse_conversion

    config = json.loads(config_json)
    try:
        model = meta_model(config)
    except Exception:  # noqa: BLE001 - a class transformers cannot build: only the common names apply
        return None
    if model is None:
        return None
    embedding = _module_weight_name(model, model.get_input_embeddings())
    try:
        head = _module_weight_name(model, model.get_output_embeddings())
    except (AttributeError, NotImplementedError):
        head = None
    shapes = {n: tuple(model.state_dict()[n].shape) for n in (embedding, head) if n is not None and n in model.state_dict()}
    try:
        views = trace_reverse_conversion(model, shapes) if shapes else {}
    except Exception:  # noqa: BLE001 - no Hub rename known: the in-memory names alone
        views = {}
    hub = {view.source: name for name, view in views.items() if isinstance(view, TensorView)}

    def forms(name: str | None) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for n in (name, hub.get(name)) if n)) if name else ()

    return ModelHeadNames(forms(embedding), forms(head))


def model_head_names(config: Mapping[str, Any]) -> ModelHeadNames | None:
    return _head_names(json.dumps(dict(config), sort_keys=True, default=str))



@functools.lru_cache(maxsize=8)
def _conv1d_modules(config_json: str) -> frozenset[str] | None:
    from merge_engine.plan.transformers_conversion import meta_model

    try:
        model = meta_model(json.loads(config_json))
    except Exception:  # noqa: BLE001 - a class transformers cannot build: nothing known
        return None
    if model is None:
        return None
    return frozenset(name for name, module in model.named_modules() if type(module).__name__ == "Conv1D")


def conv1d_modules(config: Mapping[str, Any]) -> frozenset[str] | None:
    """The model's Conv1D layers (GPT-2 style, weight stored (in, out): a LoRA on them is
    ``fan_in_fan_out``), by module name; None when transformers cannot build the model."""
    return _conv1d_modules(json.dumps(dict(config), sort_keys=True, default=str))
