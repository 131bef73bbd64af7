"""The tensor shapes transformers' own model of a config holds, under the names a checkpoint may carry.

Whether ``config.json`` agrees with the weights beside it is asked of transformers itself, never of a
table of names: the config's model class is built on the ``meta`` device (no weight:
`merge_engine.plan.transformers_conversion.meta_model`) and its state dict read, under its in-memory names
(what a transformers-5 trainer saves) and, where transformers converts names, under the Hub's names
(``save_pretrained``'s reversal traced on meta tensors, the naming a merge writes). A new attention
variant (a q_proj carrying a gate, a linear-attention layer) is then known as soon as transformers knows it.

Contract:
- `model_shapes(config)` -> {name: [shape, ...]} (two shapes where the Hub holds a tensor transposed
  under its in-memory name), or None when transformers has no class for the config (an unknown or
  remote-code model type) or its model cannot be built on the meta device (validation judges it then).
- A config transformers' own config class refuses (``num_hidden_layers`` beside a ``layer_types`` of
  another length, a value of the wrong type) is `InvalidConfig` with transformers' reason; never kept.
- `model_ties(config, stored)` -> {tied name: the name it is tied to}: every tie the model itself makes
  (transformers 5's ``all_tied_weights_keys``, chains resolved to the name ``save_pretrained`` keeps: an
  input embedding and output head, a decoder's bias and its head's, an encoder-decoder's shared embeddings;
  none at all where the class ties nothing, whatever the config's flag says). Each naming (the in-memory
  names a transformers 5 or recent 4.x trainer saves, the Hub names an older 4.x trainer saves) has its own
  ties, and one naming's entry never replaces another's: a name both namings hold (``lm_head.weight`` of
  Qwen2-VL, tied to ``model.language_model.embed_tokens.weight`` in memory and ``model.embed_tokens.weight`` on
  the Hub) is tied to the name of the naming the checkpoint stores (``stored``: its names), the in-memory
  naming's first where it stores both or neither (or ``stored`` is None). None where there are no shapes or
  transformers does not list ties (4.x): the tie flag's rule applies then.
- Both kept on disk like `merge_engine.plan.hub_config_memo` (``$STEPMERGE_CACHE_DIR/model_shapes/``), keyed by
  the config as canonical JSON, the installed transformers' version and this module's and
  `transformers_conversion`'s code: a run's next step imports neither torch's model code nor transformers.
  An entry is read like a stored result: it names its own key, is a file only this user may write
  (`hub_config_memo.trusted_entry`), its shapes are lists of non-negative dimensions, and every tie joins two
  names the shapes hold with a shape in common; anything else is ignored and computed again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from merge_engine.plan import hub_config_memo

ENTRY_FORMAT = 4
Shapes = dict[str, list[tuple[int, ...]]]
Ties = dict[str, str]
Namings = list[Ties]  # one naming's ties each: in-memory names first, then the Hub's


def model_shapes(config: Mapping[str, Any]) -> Shapes | None:
    """Every state-dict tensor of ``config``'s transformers model -> its shapes (module docstring)."""
    return _facts(config)[0]


def model_ties(config: Mapping[str, Any], stored: Collection[str] | None = None) -> Ties | None:
    """The ties ``config``'s transformers model makes, each resolved against the names ``stored`` (module
    docstring)."""
    namings = _facts(config)[1]
    return None if namings is None else resolve_ties(namings, stored)


def resolve_ties(namings: Sequence[Mapping[str, str]], stored: Collection[str] | None = None) -> Ties:
    """{tied name: the name it is tied to}, from each naming's ties: a tied name's first naming (in order) whose
    kept name ``stored`` holds, else its first naming's (a kept name the checkpoint lacks: the planner's refusal
    names it)."""
    held = frozenset(stored) if stored is not None else frozenset()
    resolved: Ties = {}
    for naming in namings:
        for tied, kept in naming.items():
            if tied not in resolved or resolved[tied] not in held and kept in held:
                resolved[tied] = kept
    return resolved


def _facts(config: Mapping[str, Any]) -> tuple[Shapes | None, Namings | None]:
    root = hub_config_memo.cache_root()
    key = memo_key(config)
    entry = root / "model_shapes" / f"{key}.json" if root is not None else None
    if entry is not None:
        kept = _read(entry, key)
        if kept is not None:
            return kept
    shapes, ties, reason = _compute(config)
    if entry is not None:
        hub_config_memo.write_entry(entry, json.dumps({"format": ENTRY_FORMAT, "key": key, "shapes": shapes,
                                                       "ties": ties, "reason": reason}))
    return shapes, ties


def _compute(config: Mapping[str, Any]) -> tuple[Shapes | None, Namings | None, str | None]:
    """Asked of the installed transformers (no memo): (shapes, ties, why there are none)."""
    from transformers import CONFIG_MAPPING

    from merge_engine.errors import InvalidConfig, UnsupportedLayout
    from merge_engine.plan.transformers_conversion import (
        TensorView,
        conversion_known,
        meta_model,
        trace_reverse_conversion,
    )

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None, None, "transformers has no class for it"
    try:
        data = json.loads(json.dumps(dict(config)))
        data.pop("model_type")
        CONFIG_MAPPING[model_type](**data)
    except Exception as exc:  # noqa: BLE001 - whatever the config class raises is its verdict on the config
        raise InvalidConfig(f"transformers {hub_config_memo.transformers_version()} refuses it: "
                            f"{type(exc).__name__}: {exc}"[:800]) from None
    try:
        model = meta_model(config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build is judged by validation
        return None, None, f"transformers cannot build it: {type(exc).__name__}: {exc}"[:500]
    if model is None:
        return None, None, "transformers has no class for it"
    memory = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shapes: Shapes = {name: [shape] for name, shape in memory.items()}
    hub_name: dict[str, str] = {}
    if conversion_known(config):
        try:
            hub = trace_reverse_conversion(model, memory, computed=True)
        except UnsupportedLayout:
            hub = {}  # the Hub names are refused by the merge itself, with its reason
        for name, view in hub.items():
            known = shapes.setdefault(name, [])
            if view.shape not in known:
                known.append(view.shape)
            if isinstance(view, TensorView) and view.is_whole(memory[view.source]):
                hub_name[view.source] = name
    return shapes, _ties(model, hub_name), None


def _ties(model: Any, hub_name: Mapping[str, str]) -> Namings | None:
    """The model's ties in its in-memory names, then (where transformers converts names) in the Hub's."""
    listed = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(listed, Mapping):
        return None  # transformers 4.x: its models do not list their ties
    ties = {str(target): str(source) for target, source in listed.items()}
    for target in list(ties):  # the name save_pretrained keeps: the end of a chain
        seen = {target}
        while ties[target] in ties and ties[target] not in seen:
            seen.add(ties[target])
            ties[target] = ties[ties[target]]
    hub = {hub_name[t]: hub_name.get(s, s) for t, s in ties.items() if t in hub_name}
    return [ties, hub] if hub and hub != ties else [ties]


def memo_key(config: Mapping[str, Any]) -> str:
    """sha256 of the config (canonical JSON), transformers' version and the code that answers."""
    digest = hashlib.sha256()
    digest.update(json.dumps(dict(config), sort_keys=True, default=str).encode())
    digest.update(b"\0transformers " + hub_config_memo.transformers_version().encode())
    here = Path(__file__)
    for code in (here, here.with_name("transformers_conversion.py")):
        digest.update(b"\0" + code.read_bytes())
    return digest.hexdigest()


def _read(entry: Path, key: str) -> tuple[Shapes | None, Namings | None] | None:
    """The entry's (shapes, ties) when it is one this module wrote for ``key`` (module docstring), else None."""
    if not hub_config_memo.trusted_entry(entry):
        return None
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT or data.get("key") != key \
            or "shapes" not in data:
        return None
    shapes, ties = data["shapes"], data.get("ties")
    if ties is not None and not (isinstance(ties, list) and all(
            isinstance(naming, dict) and all(isinstance(v, str) for v in naming.values()) for naming in ties)):
        return None
    if shapes is None:
        return (None, None) if ties is None else None  # no shapes, no ties: nothing to tie names to
    try:
        read = {str(name): [tuple(int(d) for d in shape) for shape in known] for name, known in shapes.items()}
    except (AttributeError, TypeError, ValueError):
        return None
    if any(d < 0 for known in read.values() for shape in known for d in shape):
        return None
    for naming in ties or ():
        for target, source in naming.items():
            if target not in read or source not in read or not set(read[target]) & set(read[source]):
                return None  # a tie the model could not make: its two tensors of one shape, both in its state dict
    return read, ties
