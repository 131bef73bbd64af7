"""Each LoRA module's (r, lora_alpha, scaling) as PEFT resolved them when the run was trained, asked of PEFT.

PEFT decides a module's rank and alpha from more than the run's ``r`` / ``lora_alpha``: PEFT 0.21 on a
transformers-5 MoE model turns ``target_modules`` (``all-linear`` included) into ``target_parameters`` on the
fused experts, and for a target fused from n modules (``gate_up_proj``) sets ``rank_pattern`` r*n AND
``alpha_pattern`` alpha*n (``peft/utils/transformers_weight_conversion.py``). verl records only ``r``,
``lora_alpha`` and ``task_type``. So stepmerge does not re-write those rules: `resolve_trained_settings`
builds the run's model from its config on the ``meta`` device (no weight), applies the run's LoRA settings
with ``peft.get_peft_model`` and reads every LoRA layer's ``r`` / ``lora_alpha`` / ``scaling`` (and the
parameter a ``ParamWrapper`` adapts). One resolution per (model config, LoRA settings) is cached.

Which settings the run used is decided by the stored factors, never guessed: the candidates, in order,
- the run's own adapter config (``adapter_config.json`` / ``lora_adapter/``) when it names its targets;
- verl's default ``target_modules: all-linear`` when the run recorded none (verl's ``lora_train_meta.json``);
- the stored modules' last names (``q_proj``; fused parameters as ``target_parameters``);
- the stored modules' full names;
each with the run's ``r``, ``lora_alpha`` and recorded patterns. The first whose PEFT model holds exactly the
stored LoRA factors, with exactly their shapes, is the run's. When PEFT builds the stored module set but a
rank differs, `LoraRankMismatch` names the module, the rank found and the rank PEFT gives; when no candidate
builds the stored set, `AdapterError`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from merge_engine.errors import AdapterError, LoraRankMismatch
from merge_engine.lora.fused_experts import wrapper_owner
from merge_engine.lora.keys import LORA_A, LORA_B, PEFT_PREFIX

VERL_DEFAULT_TARGET_MODULES = "all-linear"  # verl's actor_rollout_ref.model.target_modules default
# LoraConfig fields taken from a run's recorded adapter config: those that decide the trained modules' names,
# shapes and scales (the rest are PEFT's defaults; init_lora_weights only decides values the checkpoint replaces)
RUN_CONFIG_FIELDS = ("target_modules", "target_parameters", "rank_pattern", "alpha_pattern", "use_rslora",
                     "layers_to_transform", "layers_pattern", "exclude_modules", "fan_in_fan_out", "modules_to_save",
                     "bias", "use_dora", "lora_bias")


@dataclass(frozen=True)
class ModuleSettings:
    """One LoRA layer as PEFT built it: rank (per expert for a fused expert parameter), alpha, PEFT's
    ``scaling``, the shapes of its factors, and for a ``ParamWrapper`` the parameter it adapts."""

    r: int
    lora_alpha: float
    scaling: float
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    parameter: str | None = None
    peft_key: str = ""  # the name PEFT matches rank/alpha patterns against (a ParamWrapper: module.parameter)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"r": self.r, "lora_alpha": _number(self.lora_alpha), "scaling": self.scaling}
        if self.parameter:
            record["parameter"] = self.parameter
        return record


@dataclass(frozen=True)
class TrainedSettings:
    """Every stored LoRA module (stored name, ``model.layers.0.mlp.experts.base_layer``) -> `ModuleSettings`,
    the LoRA settings PEFT was given, and which candidate they are (``source``)."""

    modules: Mapping[str, ModuleSettings]
    lora_config: Mapping[str, Any]
    source: str
    patterns: Mapping[str, Any] = field(default_factory=dict)  # PEFT's rank/alpha patterns after its own rules

    def to_json(self) -> dict[str, Any]:
        """What ``stepmerge.json`` records: the settings PEFT was given, its resulting patterns, and each
        module's resolved (r, lora_alpha, scaling)."""
        return {"source": self.source, "lora_config": dict(self.lora_config), "peft_patterns": dict(self.patterns),
                "modules": {name: s.to_json() for name, s in sorted(self.modules.items())}}


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return value


@functools.lru_cache(maxsize=32)
def _peft_layers(config_json: str, lora_json: str) -> tuple[tuple[tuple[str, ModuleSettings], ...], str]:
    """(stored module name, settings) of every LoRA layer PEFT builds for the model of ``config_json`` with the
    LoraConfig of ``lora_json``, on the meta device; and PEFT's resulting rank/alpha patterns (JSON)."""
    import peft
    import torch

    from merge_engine.plan.transformers_conversion import fresh_meta_model

    model = fresh_meta_model(json.loads(config_json))
    if model is None:
        raise AdapterError("transformers has no model class for this config: PEFT's LoRA settings cannot be "
                           "resolved")
    kwargs = json.loads(lora_json)
    config = peft.LoraConfig(**kwargs)
    with torch.device("meta"):
        wrapped = peft.get_peft_model(model, config, low_cpu_mem_usage=True)
    resolved = cast(peft.LoraConfig, wrapped.peft_config["default"])  # the LoraConfig given, resolved on the model
    patterns = {"rank_pattern": dict(resolved.rank_pattern or {}), "alpha_pattern": dict(resolved.alpha_pattern or {}),
                "target_parameters": _jsonable(getattr(resolved, "target_parameters", None) or [])}
    layers = []
    from peft.tuners.lora import LoraLayer

    for name, module in wrapped.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in getattr(module, "r", {}):
            continue
        stored = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        a: Any  # a parameter (torch types a submodule's attribute as Tensor | Module)
        b: Any
        if "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        else:
            a, b = module.lora_embedding_A["default"], module.lora_embedding_B["default"]
        parameter = getattr(module, "parameter_name", None)
        key = f"{wrapper_owner(stored)}.{parameter}" if parameter else stored
        layers.append((stored, ModuleSettings(int(module.r["default"]), float(module.lora_alpha["default"]),
                                              float(module.scaling["default"]), tuple(a.shape), tuple(b.shape),
                                              parameter, key)))
    return tuple(layers), json.dumps(patterns, sort_keys=True, default=_jsonable)


def peft_layers(model_config: Mapping[str, Any], lora_config: Mapping[str, Any]
                ) -> tuple[dict[str, ModuleSettings], dict[str, Any]]:
    """Every LoRA layer PEFT builds for ``model_config`` with ``lora_config`` (LoraConfig keyword arguments,
    ``task_type`` CAUSAL_LM unless given), by stored module name; and PEFT's resolved patterns. Cached."""
    lora = {"task_type": "CAUSAL_LM", **dict(lora_config)}
    layers, patterns = _peft_layers(json.dumps(dict(model_config), sort_keys=True, default=str),
                                    json.dumps(lora, sort_keys=True, default=_jsonable))
    return dict(layers), json.loads(patterns)


@dataclass(frozen=True)
class StoredFactors:
    """The LoRA factors a checkpoint holds: stored module name -> (lora_A shape, lora_B shape), and for the
    modules wrapping a fused parameter the parameter's name (``model.layers.0.mlp.experts.gate_up_proj``)."""

    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]
    parameters: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_metas(cls, factors: Mapping[str, Mapping[str, tuple[str, bool]]], metas: Mapping[str, Any],
                   parameters: Mapping[str, str] | None = None) -> StoredFactors:
        shapes = {}
        for module, parts in factors.items():
            if LORA_A in parts and LORA_B in parts:
                shapes[module] = (tuple(metas[parts[LORA_A][0]].shape), tuple(metas[parts[LORA_B][0]].shape))
        return cls(shapes, dict(parameters or {}))


def _below_layer(name: str) -> str:
    parts = name.split(".")
    numbers = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[numbers[-1] + 1:]) if numbers else name


def recorded_settings(run_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `RUN_CONFIG_FIELDS` a run's recorded adapter config sets (unset, empty ones left out)."""
    return {k: v for k, v in dict(run_config or {}).items() if k in RUN_CONFIG_FIELDS and v not in (None, [], {})}


def candidate_configs(r: int, lora_alpha: float, run_config: Mapping[str, Any] | None, stored: StoredFactors
                      ) -> list[tuple[str, dict[str, Any]]]:
    """The LoRA settings the run may have used, in the order they are tried (see the module docstring)."""
    base: dict[str, Any] = {"r": int(r), "lora_alpha": lora_alpha}
    recorded = recorded_settings(run_config)
    candidates: list[tuple[str, dict[str, Any]]] = []
    if recorded.get("target_modules") or recorded.get("target_parameters"):
        candidates.append(("the run's adapter config", {**base, **recorded}))
    extra = {k: v for k, v in recorded.items() if k not in ("target_modules", "target_parameters", "layers_to_transform",
                                                             "layers_pattern", "exclude_modules")}
    if not recorded.get("target_modules"):
        candidates.append((f"verl's default target_modules {VERL_DEFAULT_TARGET_MODULES}",
                           {**base, **extra, "target_modules": VERL_DEFAULT_TARGET_MODULES}))
    modules = sorted(m for m in stored.shapes if m not in stored.parameters)
    parameters = sorted(set(stored.parameters.values()))
    short = {**base, **extra, "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})}
    full = {**base, **extra, "target_modules": modules}
    if parameters:
        short["target_parameters"] = sorted({_below_layer(p) for p in parameters})
        full["target_parameters"] = parameters
    candidates += [("the stored modules' names", short), ("the stored modules' full names", full)]
    return candidates


def _rank_per_expert(a_rows: int, settings: ModuleSettings) -> int:
    """The rank a stored lora_A of ``a_rows`` rows stands for, in PEFT's units of ``settings`` (per expert)."""
    experts = settings.a_shape[0] // settings.r if settings.r else 1
    return a_rows // max(experts, 1)


def resolve_trained_settings(model_config: Mapping[str, Any] | None, r: int, lora_alpha: float,
                             run_config: Mapping[str, Any] | None, stored: StoredFactors,
                             where: str | None) -> TrainedSettings:
    """The run's PEFT settings for every stored LoRA module (see the module docstring).

    `LoraRankMismatch` when PEFT builds the stored modules but one's rank is not the stored one; `AdapterError`
    when no candidate builds the stored modules, or PEFT cannot be asked (no model config, unknown model)."""
    if not model_config:
        raise AdapterError("the run's config.json is needed to resolve each LoRA module's rank and alpha the way "
                           "PEFT trained them", where)
    mismatch: LoraRankMismatch | None = None
    tried = []
    for source, lora_config in candidate_configs(r, lora_alpha, run_config, stored):
        try:
            layers, patterns = peft_layers(model_config, lora_config)
        except AdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - PEFT refuses these settings for this model: not the run's
            tried.append(f"{source}: PEFT refused it ({type(exc).__name__}: {str(exc)[:160]})")
            continue
        if set(layers) != set(stored.shapes):
            missing, extra = sorted(set(stored.shapes) - set(layers)), sorted(set(layers) - set(stored.shapes))
            tried.append(f"{source}: {len(layers)} modules" + (f", not {missing[0]}" if missing else "")
                         + (f", also {extra[0]}" if extra else ""))
            continue
        wrong = [(m, s) for m, s in sorted(layers.items()) if (s.a_shape, s.b_shape) != stored.shapes[m]]
        if not wrong:
            for module, settings in layers.items():
                expected = stored.parameters.get(module)
                if expected and settings.parameter and not expected.endswith(f".{settings.parameter}"):
                    raise AdapterError(f"{module}: PEFT wraps {settings.parameter} there, but the factor shapes fit "
                                       f"{expected}", where)
            return TrainedSettings(layers, lora_config, source, patterns)
        if mismatch is None:
            module, settings = wrong[0]
            found = _rank_per_expert(stored.shapes[module][0][0], settings)
            mismatch = LoraRankMismatch.for_module(module, found, settings.r, source, where)
        tried.append(f"{source}: ranks differ ({wrong[0][0]})")
    if mismatch is not None:
        raise mismatch
    raise AdapterError("PEFT builds other LoRA modules than the checkpoint holds for every setting tried ("
                       + "; ".join(tried) + ")", where)


def check_adapter_loads(model_config: Mapping[str, Any], adapter_json: Mapping[str, Any],
                        expected: Mapping[str, tuple[int, float]], where: str | None) -> None:
    """The adapter config ``adapter_json`` makes PEFT (the installed version, with its own conversion rules)
    build, on ``model_config``'s model (meta device), exactly the LoRA layers of ``expected`` (stored module
    name -> (rank per expert, scaling)); else `AdapterError` naming the first layer that differs. This is
    what ``PeftModel.from_pretrained`` does before it loads the tensors, so a config that would not load,
    or load with another scale, is refused before anything is written."""
    import peft

    try:
        layers, _ = peft_layers(model_config, adapter_config_kwargs(adapter_json))
    except AdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - PEFT refuses the config: it would not load
        raise AdapterError(f"PEFT {peft.__version__} refuses the adapter config stepmerge would write "
                           f"({type(exc).__name__}: {exc})", where) from None
    if set(layers) != set(expected):
        missing, extra = sorted(set(expected) - set(layers)), sorted(set(layers) - set(expected))
        raise AdapterError(f"with the adapter config stepmerge would write, PEFT {peft.__version__} builds other LoRA "
                           f"layers than the trained ones (missing {missing[:1]}, extra {extra[:1]})", where)
    for module, (rank, scaling) in sorted(expected.items()):
        got = layers[module]
        if got.r != rank or abs(got.scaling - scaling) > 1e-9 * max(1.0, abs(scaling)):
            raise AdapterError(f"with the adapter config stepmerge would write, PEFT {peft.__version__} gives {module} "
                               f"rank {got.r} and scaling {got.scaling:g}, not {rank} and {scaling:g}", where)


def adapter_config_kwargs(adapter_json: Mapping[str, Any]) -> dict[str, Any]:
    """The ``peft.LoraConfig`` keyword arguments of an adapter_config.json dict (bookkeeping fields dropped)."""
    import dataclasses

    import peft

    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)} - {"peft_type", "base_model_name_or_path",
                                                                      "revision", "inference_mode", "auto_mapping"}
    return {k: v for k, v in adapter_json.items() if k in fields and v is not None}


def check_adapter_scales(model_config: Mapping[str, Any], adapter_json: Mapping[str, Any],
                         scales: Mapping[str, float], where: str | None) -> dict[str, ModuleSettings]:
    """PEFT's layers for an adapter folder's config on ``model_config``'s model (meta device), by the name PEFT
    matches patterns against; every name of ``scales`` (module, or fused parameter, -> the scale stepmerge
    applies) that PEFT builds must have PEFT's ``scaling``, else `AdapterError`. Names PEFT builds otherwise
    (per-expert Hub modules, which PEFT 0.21 fuses on a transformers-5 model) are not compared. Empty when
    transformers or PEFT cannot build the model with this config (then nothing is asked)."""
    from merge_engine.plan.transformers_conversion import fresh_meta_model

    try:
        if fresh_meta_model(model_config) is None:
            return {}
        layers, _ = peft_layers(model_config, adapter_config_kwargs(adapter_json))
    except Exception:  # noqa: BLE001 - PEFT cannot build this adapter on this model: nothing to compare
        return {}
    by_key = {settings.peft_key: settings for settings in layers.values()}
    for name, scale in sorted(scales.items()):
        settings = by_key.get(name)
        if settings is not None and abs(settings.scaling - scale) > 1e-9 * max(1.0, abs(scale)):
            raise AdapterError(f"{name}: stepmerge would apply scale {scale:g} but PEFT gives it scaling "
                               f"{settings.scaling:g} (r {settings.r}, lora_alpha {settings.lora_alpha:g}) with this "
                               "adapter config", where)
    return by_key
