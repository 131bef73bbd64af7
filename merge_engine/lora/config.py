"""``adapter_config.json``: PEFT's LoRA settings, their exact semantics, and writing a new one.

Semantics follow peft's source (``tuners/lora/layer.py``, ``utils/other.py::get_pattern_key``,
``tuners_utils.py::check_target_module_exists``):
- scaling = lora_alpha / r, or lora_alpha / sqrt(r) with ``use_rslora``;
- a module's r and alpha come from the FIRST key of ``rank_pattern`` / ``alpha_pattern`` matching
  ``(.*\\.)?(<key>)$`` against the module name (``model.layers.0.self_attn.q_proj``), else r / lora_alpha;
- ``target_modules``: a string is a regex that must match the whole module name; a list matches a
  module equal to an entry or ending in ``.<entry>``;
- ``fan_in_fan_out``: the base weight is stored (in, out) and the update is (B @ A).T.

`LoraSettings.from_config` refuses the variants whose update is not ``scale * B @ A`` (DoRA, LoRA
bias, ...) with an `AdapterError`. ``target_parameters`` (LoRA on fused expert tensors) is read: each
expert's update is ``scale * B_e @ A_e`` (`merge_engine.lora.fused_experts`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from merge_engine.errors import AdapterError
from merge_engine.lora.user_patterns import check_config_patterns, shown

MAX_RANK = 1 << 16  # PEFT ranks are at most the layer's width; the widest layers are ~2^15
MAX_ALPHA = 1e6  # alpha / r scales every update: ~2r in practice; past this the merged weights overflow

# settings that change what the update is; any truthy value means "not plain LoRA"
UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA", "lora_bias": "LoRA bias",
    "layer_replication": "layer replication", "trainable_token_indices": "trainable tokens",
    "alora_invocation_tokens": "activated LoRA (aLoRA)", "use_qalora": "QA-LoRA", "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing",
}


def pattern_key(patterns: Iterable[str], module: str) -> str | None:
    """The first pattern key that PEFT would match against ``module`` (None: no match)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def targets(target_modules: str | Iterable[str] | None, module: str) -> bool:
    """Does PEFT's ``target_modules`` select ``module``?"""
    if target_modules is None:
        return False
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in target_modules)


def checked_rank(value: Any, field: str, where: str | None) -> int:
    """``value`` as a LoRA rank: a whole number in [1, `MAX_RANK`]; else `AdapterError` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or not 1 <= value <= MAX_RANK:
        raise AdapterError(f"{field} is {str(value)[:40]!r}: a LoRA rank is a whole number from 1 to {MAX_RANK}",
                           where)
    return int(value)


def checked_alpha(value: Any, field: str, where: str | None) -> float:
    """``value`` as a LoRA alpha: a finite number in (0, `MAX_ALPHA`]; else `AdapterError` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_ALPHA:
        raise AdapterError(f"{field} is {str(value)[:40]!r}: a LoRA alpha is a finite number above 0 and at most "
                           f"{MAX_ALPHA:g}", where)
    return float(value)


def scaling(alpha: float, r: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


@dataclass(frozen=True)
class LoraSettings:
    """The fields of an adapter config that decide each module's update."""

    r: int
    lora_alpha: float
    target_modules: str | tuple[str, ...] | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    modules_to_save: tuple[str, ...] = ()
    bias: str = "none"
    task_type: str | None = None
    target_parameters: tuple[str, ...] = ()  # LoRA on fused expert tensors (`merge_engine.lora.fused_experts`)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str | None = None) -> LoraSettings:
        """Parse an adapter_config.json dict; `AdapterError` for a non-LoRA or unsupported config, a rank or alpha
        out of range (`checked_rank`, `checked_alpha`), or a pattern outside what stepmerge matches
        (`merge_engine.lora.user_patterns`)."""
        peft_type = str(config.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise AdapterError(f"peft_type is {peft_type}; only LORA adapters are supported", where)
        for key, what in UNSUPPORTED_SETTINGS.items():
            if config.get(key):
                raise AdapterError(f"{what} ({key}={config[key]!r}) is not supported: its update is not "
                                   "scale * B @ A", where)
        if "r" not in config or "lora_alpha" not in config:
            raise AdapterError("adapter config lacks r or lora_alpha", where)
        r = checked_rank(config["r"], "r", where)
        alpha = checked_alpha(config["lora_alpha"], "lora_alpha", where)
        check_config_patterns(config, where)
        ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        if not isinstance(ranks, Mapping) or not isinstance(alphas, Mapping):
            raise AdapterError("rank_pattern and alpha_pattern must be objects", where)
        target = config.get("target_modules")
        if target is not None and not isinstance(target, str):
            target = tuple(target)
        return cls(r=r, lora_alpha=alpha, target_modules=target,
                   rank_pattern={str(k): checked_rank(v, f"rank_pattern[{shown(str(k))}]", where) for k, v in ranks.items()},
                   alpha_pattern={str(k): checked_alpha(v, f"alpha_pattern[{shown(str(k))}]", where)
                                  for k, v in alphas.items()},
                   use_rslora=bool(config.get("use_rslora", False)),
                   fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
                   modules_to_save=tuple(config.get("modules_to_save") or ()),
                   bias=str(config.get("bias") or "none"), task_type=config.get("task_type"),
                   target_parameters=tuple(config.get("target_parameters") or ()))

    def rank_of(self, module: str) -> int:
        key = pattern_key(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def alpha_of(self, module: str) -> float:
        key = pattern_key(self.alpha_pattern, module)
        return self.alpha_pattern[key] if key is not None else self.lora_alpha

    def scale_of(self, module: str, rank: int) -> float:
        """PEFT's ``scaling`` of ``module`` whose factors have ``rank`` rows."""
        return scaling(self.alpha_of(module), rank, self.use_rslora)


def rank_layout(ranks: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """(r, rank_pattern) that give every module its rank under PEFT's matching: r is the most
    common rank (the larger on a tie), the others are listed by their full module name."""
    if not ranks:
        raise AdapterError("no LoRA modules")
    counts = Counter(ranks.values())
    r = max(counts, key=lambda k: (counts[k], k))
    pattern = {module: rank for module, rank in ranks.items() if rank != r}
    for module, rank in ranks.items():  # a full name could match a longer one: verify, never assume
        key = pattern_key(pattern, module)
        if (pattern[key] if key is not None else r) != rank:
            raise AdapterError(f"cannot express the rank of {module} ({rank}) as a PEFT rank_pattern")
    return r, pattern


def settings_layout(pairs: Mapping[str, tuple[int, float]], aliases: Mapping[str, tuple[int, float]] | None = None
                    ) -> tuple[int, float, dict[str, int], dict[str, float]]:
    """(r, lora_alpha, rank_pattern, alpha_pattern) under which PEFT's matching gives every module of ``pairs``
    (full name -> (rank, alpha)) and every name of ``aliases`` (the same modules as PEFT names them on another
    base: a fused expert parameter, ``mlp.gate.weight``) its (rank, alpha).

    r / lora_alpha: the most common pair of ``pairs`` (the larger on a tie). Each name that differs gets a key:
    the shortest dotted suffix (escaped) that every name ending in it shares its pair with, so a per-expert
    module set collapses to one key (``w1``) where it can. Every name a key matches has that key's pair, so the
    keys' order (PEFT takes the first that matches; the file is written with sorted keys) does not matter.
    Every name is then checked with PEFT's matching (`pattern_key`); `AdapterError` if one cannot be expressed."""
    if not pairs:
        raise AdapterError("no LoRA modules")
    everything = {**dict(aliases or {}), **dict(pairs)}
    counts = Counter(pairs.values())
    r, alpha = max(counts, key=lambda k: (counts[k], k))
    keys: dict[str, tuple[int, float]] = {}
    for name, pair in sorted(everything.items()):
        if pair == (r, alpha):
            continue
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            key = re.escape(".".join(parts[-k:]))
            if all(other == pair for other_name, other in everything.items() if pattern_key([key], other_name)):
                keys[key] = pair
                break
    ordered = sorted(keys)
    rank_pattern = {k: int(keys[k][0]) for k in ordered if keys[k][0] != r}
    alpha_pattern = {k: float(keys[k][1]) for k in ordered if keys[k][1] != alpha}
    for name, (rank, module_alpha) in everything.items():
        rank_key, alpha_key = pattern_key(rank_pattern, name), pattern_key(alpha_pattern, name)
        got = (rank_pattern[rank_key] if rank_key is not None else r,
               alpha_pattern[alpha_key] if alpha_key is not None else alpha)
        if got != (rank, module_alpha):
            raise AdapterError(f"cannot express the rank and alpha of {name} ({rank}, {module_alpha:g}) as PEFT "
                               f"rank/alpha patterns (they would give {got})")
    return int(r), float(alpha), rank_pattern, alpha_pattern


def infer_target_modules(modules: Iterable[str], candidates: Iterable[str] | None = None) -> list[str]:
    """``target_modules`` selecting exactly ``modules``: their last name parts when those select no
    other module among ``candidates`` (the base's modules), else the full module names."""
    modules = sorted(set(modules))
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if candidates is not None:
        chosen = {c for c in candidates if targets(short, c)}
        if chosen != set(modules):
            return modules
    return short


def number(value: float) -> int | float:
    """JSON-friendly: 16.0 -> 16."""
    return int(value) if float(value).is_integer() else float(value)


def adapter_config(*, r: int, lora_alpha: float, target_modules: list[str] | str,
                   rank_pattern: Mapping[str, int] | None = None, alpha_pattern: Mapping[str, float] | None = None,
                   use_rslora: bool = False, fan_in_fan_out: bool = False, modules_to_save: list[str] | None = None,
                   bias: str = "none", task_type: str | None = "CAUSAL_LM", base_model_name_or_path: str | None = None,
                   lora_dropout: float = 0.0, target_parameters: list[str] | None = None) -> dict[str, Any]:
    """An adapter_config.json dict that ``PeftModel.from_pretrained`` reads as a plain LoRA (``target_parameters``:
    LoRA on fused expert tensors too, written only when there are some)."""
    extra = {"target_parameters": list(target_parameters)} if target_parameters else {}
    return {**extra,
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(r),
        "lora_alpha": number(lora_alpha),
        "target_modules": target_modules,
        "rank_pattern": dict(rank_pattern or {}),
        "alpha_pattern": {k: number(v) for k, v in (alpha_pattern or {}).items()},
        "use_rslora": bool(use_rslora),
        "fan_in_fan_out": bool(fan_in_fan_out),
        "bias": bias,
        "modules_to_save": list(modules_to_save) if modules_to_save else None,
        "lora_dropout": lora_dropout,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }
