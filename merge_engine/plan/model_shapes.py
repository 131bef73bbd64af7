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
- Kept on disk like `merge_engine.plan.hub_config_memo` (``$STEPMERGE_CACHE_DIR/model_shapes/``), keyed by
  the config as canonical JSON, the installed transformers' version and this module's and
  `transformers_conversion`'s code: a run's next step imports neither torch's model code nor transformers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from merge_engine.plan import hub_config_memo

ENTRY_FORMAT = 1
Shapes = dict[str, list[tuple[int, ...]]]


def model_shapes(config: Mapping[str, Any]) -> Shapes | None:
    """Every state-dict tensor of ``config``'s transformers model -> its shapes (module docstring)."""
    root = hub_config_memo.cache_root()
    entry = root / "model_shapes" / f"{memo_key(config)}.json" if root is not None else None
    if entry is not None:
        kept = _read(entry)
        if kept is not None:
            return kept[0]
    shapes, reason = compute_model_shapes(config)
    if entry is not None:
        hub_config_memo.write_entry(entry, json.dumps({"format": ENTRY_FORMAT, "shapes": shapes, "reason": reason}))
    return shapes


def compute_model_shapes(config: Mapping[str, Any]) -> tuple[Shapes | None, str | None]:
    """`model_shapes` asked of the installed transformers (no memo): (shapes, why there are none)."""
    from transformers import CONFIG_MAPPING

    from merge_engine.errors import InvalidConfig, UnsupportedLayout
    from merge_engine.plan.transformers_conversion import conversion_known, meta_model, trace_reverse_conversion

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None, "transformers has no class for it"
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
        return None, f"transformers cannot build it: {type(exc).__name__}: {exc}"[:500]
    if model is None:
        return None, "transformers has no class for it"
    memory = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shapes: Shapes = {name: [shape] for name, shape in memory.items()}
    if conversion_known(config):
        try:
            hub = trace_reverse_conversion(model, memory, computed=True)
        except UnsupportedLayout:
            hub = {}  # the Hub names are refused by the merge itself, with its reason
        for name, view in hub.items():
            known = shapes.setdefault(name, [])
            if view.shape not in known:
                known.append(view.shape)
    return shapes, None


def memo_key(config: Mapping[str, Any]) -> str:
    """sha256 of the config (canonical JSON), transformers' version and the code that answers."""
    digest = hashlib.sha256()
    digest.update(json.dumps(dict(config), sort_keys=True, default=str).encode())
    digest.update(b"\0transformers " + hub_config_memo.transformers_version().encode())
    here = Path(__file__)
    for code in (here, here.with_name("transformers_conversion.py")):
        digest.update(b"\0" + code.read_bytes())
    return digest.hexdigest()


def _read(entry: Path) -> tuple[Shapes | None] | None:
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT or "shapes" not in data:
        return None
    shapes = data["shapes"]
    if shapes is None:
        return (None,)
    try:
        return ({str(name): [tuple(int(d) for d in shape) for shape in known] for name, known in shapes.items()},)
    except (AttributeError, TypeError, ValueError):
        return None
