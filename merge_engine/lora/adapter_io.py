"""PEFT adapter folders: read one into an `Adapter` (metadata + lazy tensors), check it against a
base model, and plan the writing of a new one.

A folder is ``adapter_config.json`` + ``adapter_model.safetensors`` (a pickled ``adapter_model.bin``
is refused: stepmerge never unpickles what it cannot read safely). Reading parses the header only;
tensor bytes are read when a plan streams them. Every inconsistency a user can bring raises
`AdapterError` naming the folder: factors of different ranks, a rank that contradicts the config,
``lora_alpha`` 0 (what verl's merger wrote for months: the real value is lost), modules the config
does not target, modules or shapes the base model does not have.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from merge_engine import storage
from merge_engine.storage import FileEntry
from merge_engine.errors import AdapterError
from merge_engine.formats.json_file import read_json_object
from merge_engine.lora.config import LoraSettings, targets
from merge_engine.lora.fused_experts import check_experts_fit, find_expert_loras, with_scales, wrapper_owner
from merge_engine.lora.keys import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BASE,
    LORA_A,
    LORA_B,
    TRAINED_COPY,
    parse_key,
)
from merge_engine.plan.merge_plan import MergePlan, PlannedTensor, ShardFile
from merge_engine.formats.safetensors_file import SafetensorsFile
from merge_engine.formats.tensor_source import (
    AssembledSource,
    ConcatTensor,
    TensorMeta,
    TensorSource,
)


@dataclass(frozen=True)
class LoraModule:
    """One module's LoRA: factor names (in some source), shapes and PEFT's scaling.

    The update of the module's weight is ``scale * B @ A`` (out, in), laid on a weight stored
    (in, out) as its transpose when ``transposed`` (``fan_in_fan_out`` or an embedding).
    """

    module: str
    a: str
    b: str
    rank: int
    in_features: int
    out_features: int
    scale: float
    embedding: bool = False
    fan_in_fan_out: bool = False
    alpha: float | None = None  # PEFT's lora_alpha of the module (scale = alpha / rank, or / sqrt(rank) rsLoRA)

    @property
    def transposed(self) -> bool:
        return self.embedding or self.fan_in_fan_out

    @property
    def weight_name(self) -> str:
        return f"{self.module}.weight"

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)


@dataclass(frozen=True)
class Adapter:
    """An adapter's settings, its LoRA modules, and the whole tensors it replaces (modules to save,
    saved embedding base layers): Hugging Face tensor name -> name in the adapter's source.
    ``experts``: LoRAs on fused 3-D expert tensors (a training checkpoint's PEFT ``target_parameters``,
    `merge_engine.lora.fused_experts.ExpertLora`), by parameter name."""

    url: str
    settings: LoraSettings
    modules: Mapping[str, LoraModule]
    overrides: Mapping[str, str]
    metas: Mapping[str, TensorMeta]
    experts: Mapping[str, Any] = field(default_factory=dict)
    # an adapter file's target_parameters wrappers (module -> factors), resolved against a base (`with_base`)
    wrapped: Mapping[str, Mapping[str, tuple[str, bool]]] = field(default_factory=dict)


def lora_modules(factors: Mapping[str, Mapping[str, tuple[str, bool]]], metas: Mapping[str, TensorMeta],
                 settings: LoraSettings, where: str | None, *, config_ranks: bool) -> dict[str, LoraModule]:
    """Build and check `LoraModule`s from ``module -> {"lora_A": (key, embedding), "lora_B": ...}``.

    ``config_ranks``: the factors' rank must equal the config's r for the module (rank_pattern
    included), as PEFT requires to load them.
    """
    modules = {}
    for module in sorted(factors):
        parts = factors[module]
        missing = [f for f in (LORA_A, LORA_B) if f not in parts]
        if missing:
            raise AdapterError(f"{module} has {sorted(parts)} but no {missing[0]}", where)
        (a, embedding), (b, _) = parts[LORA_A], parts[LORA_B]
        a_shape, b_shape = metas[a].shape, metas[b].shape
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise AdapterError(f"{module}: lora_A {a_shape} and lora_B {b_shape} are not (r, in) and (out, r)", where)
        rank = a_shape[0]
        if rank == 0:
            raise AdapterError(f"{module}: LoRA factors of rank 0 (unsaved FSDP shards?)", where)
        if config_ranks and rank != settings.rank_of(module):
            raise AdapterError(f"{module}: the config gives r={settings.rank_of(module)} but its factors have rank "
                               f"{rank}", where)
        modules[module] = LoraModule(module, a, b, rank, a_shape[1], b_shape[0], settings.scale_of(module, rank),
                                     embedding, settings.fan_in_fan_out and not embedding, settings.alpha_of(module))
    return modules


def open_safetensors(url: str, entry: FileEntry | None = None) -> TensorSource:
    """A lazy `TensorSource` over one safetensors file; ``entry``: its listing, every read pinned to that version
    (`storage.RangeReader.listed`: `SourceChanged` once the file is rewritten)."""
    handle = SafetensorsFile(url, storage.RangeReader.listed(url, entry) if entry is not None else None)
    tensors = {name: ConcatTensor(t.shape, t.dtype_name, 0, (t,)) for name, t in handle.tensors().items()}
    return AssembledSource(url, tensors, [handle])


def read_adapter_config(url: str) -> dict[str, Any]:
    config = read_json_object(storage.join(url, ADAPTER_CONFIG), error=AdapterError)
    if config is None:
        raise AdapterError(f"no {ADAPTER_CONFIG}: not a PEFT adapter folder", url)
    return config


def read_adapter(url: str, *, lora_alpha: float | None = None, config: Mapping[str, Any] | None = None,
                 files: Sequence[FileEntry] | None = None) -> tuple[Adapter, TensorSource]:
    """Open the adapter folder at ``url``; ``lora_alpha`` replaces the config's (a lost alpha). ``config``: its
    ``adapter_config.json`` as the caller read it (`read_adapter_config`; None: read here); ``files``: its
    listing as the caller made it (None: listed here); its weights are read pinned to that listing."""
    config = read_adapter_config(url) if config is None else dict(config)
    if lora_alpha is not None:
        config = {**config, "lora_alpha": lora_alpha}
    elif not config.get("lora_alpha"):
        raise AdapterError("lora_alpha is 0 or missing in adapter_config.json, so the adapter would do nothing "
                           "(verl's merger wrote 0 for months; the real value is lost): pass --lora-alpha", url)
    settings = LoraSettings.from_config(config, url)
    listed = {e.path: e for e in (storage.list_files(url, recursive=False) if files is None else files)}
    if ADAPTER_WEIGHTS not in listed:
        hint = " (adapter_model.bin is a pickle, which stepmerge does not load; save with safetensors)" \
            if "adapter_model.bin" in listed else ""
        raise AdapterError(f"no {ADAPTER_WEIGHTS}{hint}", url)
    source = open_safetensors(storage.join(url, ADAPTER_WEIGHTS), listed[ADAPTER_WEIGHTS])
    try:
        adapter = describe_adapter(url, settings, source.metas())
    except Exception:
        source.close()
        raise
    return adapter, source


def describe_adapter(url: str, settings: LoraSettings, metas: Mapping[str, TensorMeta]) -> Adapter:
    factors: dict[str, dict[str, tuple[str, bool]]] = {}
    overrides = {}
    for key in metas:
        role = parse_key(key, url)
        if role.kind in (LORA_A, LORA_B):
            factors.setdefault(role.name, {})[role.kind] = (key, role.embedding)
        elif role.kind in (BASE, TRAINED_COPY):
            overrides[role.name] = key
    if not factors:
        raise AdapterError("adapter_model.safetensors holds no lora_A/lora_B tensors", url)
    wrapped = {m: parts for m, parts in factors.items() if _wraps_a_parameter(m, settings.target_parameters)}
    factors = {m: parts for m, parts in factors.items() if m not in wrapped}
    modules = lora_modules(factors, metas, settings, url, config_ranks=True)
    if settings.target_modules is not None:
        stray = [m for m in modules if not targets(settings.target_modules, m)]
        if stray:
            raise AdapterError(f"the adapter holds weights for {stray[0]}, which its target_modules "
                               f"{settings.target_modules!r} do not select (PEFT would ignore them)", url)
    return Adapter(url, settings, modules, overrides, dict(metas), wrapped=wrapped)


def _wraps_a_parameter(module: str, target_parameters: tuple[str, ...]) -> bool:
    """Is ``module`` (``model.layers.0.mlp.experts.base_layer``) a ParamWrapper of a ``target_parameters``
    entry (``mlp.experts.gate_up_proj``)?"""
    owner = wrapper_owner(module)
    holders = {t.rpartition(".")[0] for t in target_parameters}
    return any(owner == h or owner.endswith(f".{h}") for h in holders if h)


def with_base(adapter: Adapter, base_metas: Mapping[str, TensorMeta], base_url: str | None = None) -> Adapter:
    """``adapter`` with its target_parameters wrappers resolved into `ExpertLora`s against the base's fused
    tensors (which wrapper adapts which tensor is told by the shapes); `AdapterError` when one fits none,
    or its rank is not the config's."""
    if not adapter.wrapped:
        return adapter
    shapes = {name: tuple(meta.shape) for name, meta in base_metas.items()}
    experts, rest = find_expert_loras(adapter.wrapped, shapes, adapter.metas, adapter.url)
    if rest:
        raise AdapterError(f"{sorted(rest)[0]}: LoRA factors of a target_parameters wrapper, but the base model "
                           f"{base_url} has no fused tensor there", adapter.url)
    for name, lora in experts.items():
        if lora.rank != adapter.settings.rank_of(name):
            raise AdapterError(f"{name}: the config gives r={adapter.settings.rank_of(name)} but its factors have "
                               f"rank {lora.rank} per expert", adapter.url)
    return dataclasses.replace(adapter, experts={**adapter.experts, **with_scales(experts, adapter.settings)},
                               wrapped={})


def base_modules(base_metas: Mapping[str, TensorMeta]) -> set[str]:
    return {name[: -len(".weight")] for name in base_metas if name.endswith(".weight")}


def check_fits_base(adapter: Adapter, base_metas: Mapping[str, TensorMeta], base_url: str | None = None) -> None:
    """Every LoRA module and replaced tensor exists in the base with the adapter's shape, and every
    ``target_modules`` entry selects some module of the base; else `AdapterError`."""
    adapter = with_base(adapter, base_metas, base_url)
    check_experts_fit(adapter.experts, base_metas, adapter.url, base_url)
    for module in adapter.modules.values():
        meta = base_metas.get(module.weight_name)
        if meta is None:
            raise AdapterError(f"target module {module.module} does not exist in the base model {base_url}",
                               adapter.url)
        if tuple(meta.shape) != module.weight_shape:
            raise AdapterError(f"{module.module}: the adapter updates a {module.weight_shape} weight but the base's "
                               f"is {tuple(meta.shape)} (an adapter for another model, or fan_in_fan_out wrong?)",
                               adapter.url)
    for name, key in adapter.overrides.items():
        meta = base_metas.get(name)
        if meta is None:
            raise AdapterError(f"the adapter replaces {name}, which the base model {base_url} does not have",
                               adapter.url)
        if tuple(meta.shape) != tuple(adapter.metas[key].shape):
            raise AdapterError(f"{name}: the adapter's copy is {tuple(adapter.metas[key].shape)}, the base's "
                               f"{tuple(meta.shape)}", adapter.url)
    target = adapter.settings.target_modules
    candidates = base_modules(base_metas)
    entries = [target] if isinstance(target, str) else list(target or ())
    for entry in entries:
        if not any(targets(entry if isinstance(target, str) else [entry], m) for m in candidates):
            raise AdapterError(f"target module {entry!r} matches no module of the base model {base_url}",
                               adapter.url)


def adapter_plan(tensors: list[PlannedTensor]) -> MergePlan:
    """A plan writing ``tensors`` into the single file adapter_model.safetensors."""
    shard = ShardFile(ADAPTER_WEIGHTS, tuple(t.name for t in tensors), sum(t.nbytes for t in tensors))
    return MergePlan(tuple(tensors), (shard,))


def write_adapter_config(target_url: str, config: Mapping[str, Any]) -> tuple[str, int]:
    data = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    storage.write_bytes(storage.join(target_url, ADAPTER_CONFIG), data)
    return ADAPTER_CONFIG, len(data)
