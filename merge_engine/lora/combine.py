"""Combining several adapters, exactly: the result's update is ``sum_i w_i * scale_i * B_i @ A_i`` (the maths of
``stepmerge merge-lora``, whose job is `merge_engine.commands.combine`).

Methods (``w_i``): ``concat`` (all 1), ``weighted`` (given, one per adapter), ``average`` (1/n).
Unlike PEFT's ``linear`` combination (which weights A and B separately and so adds cross terms
``B_i @ A_j``), every method here is a weighted sum of the updates themselves. Whole replaced
tensors (modules to save) combine as updates too: ``W + sum_i w_i * (M_i - W)``.

Outputs:
- a fused model (`merge_engine.lora.fuse.plan_fused_model`);
- one adapter, exact by rank stacking: A = [w_1 s_1 A_1; w_2 s_2 A_2; ...], B = [B_1, B_2, ...],
  scale 1 (lora_alpha = r per module), rank = the sum of the ranks. When a multiplier w_i s_i is
  not 1, the stacked factors are written in float32 (at least): w s A computed in float32 and
  rounded back to a bf16 / fp16 adapter's dtype would be off by ~1e-3, so B @ A equals the weighted
  sum of the updates to float32 rounding. With every multiplier 1 the factors are copied as stored
  (exact in any dtype). An explicit ``dtype`` is honoured and rounds the factors to it;
- one adapter re-factored by SVD to ``rank`` (or by ``energy``), with each module's relative error.
"""


from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from merge_engine.errors import AdapterError, InvalidOption
from merge_engine.lora.adapter_io import LoraModule, adapter_plan, base_modules, check_fits_base
from merge_engine.lora.config import adapter_config, infer_target_modules, rank_layout, targets
from merge_engine.lora.fuse import (
    BASE_NAMESPACE,
    CheckedCopy,
    UpdatedTensor,
    WeightedAdapter,
    finite_or_raise,
    tensor_updates,
)
from merge_engine.lora.keys import PEFT_PREFIX, adapter_file_key, module_of
from merge_engine.lora.sources import qualified
from merge_engine.lora.svd import (
    Factors,
    ModuleReport,
    check_targets,
    factor_product,
    svd_device,
)
from merge_engine.plan.merge_plan import MergePlan, PlannedTensor, TensorBuilder
from merge_engine.formats.tensor_source import TensorMeta, TensorSource

METHODS = ("concat", "weighted", "average")


def combination_weights(method: str, count: int, weights: Sequence[float] | None) -> list[float]:
    """The weight of each of ``count`` adapters under ``method``."""
    if method not in METHODS:
        raise InvalidOption(f"unknown merge method {method!r}; choose one of {', '.join(METHODS)}")
    if count < 1:
        raise InvalidOption("give at least one adapter")
    if method == "weighted":
        if weights is None:
            raise AdapterError("--merge-method weighted needs --adapter-weights, one per adapter")
        if len(weights) != count:
            raise AdapterError(f"{len(weights)} weights for {count} adapters: give one weight per adapter")
        return [float(w) for w in weights]
    if weights is not None:
        raise AdapterError(f"--adapter-weights are for --merge-method weighted, not {method}")
    return [1.0] * count if method == "concat" else [1.0 / count] * count


@dataclass(frozen=True)
class StackedFactor:
    """A stacked factor: the parts (source name, multiplier) concatenated along ``dim``
    (0: rows, for A; 1: columns, for B), computed in float32 (float64 inputs: float64)."""

    parts: tuple[tuple[str, float], ...]
    dim: int

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        pieces = []
        for name, multiplier in self.parts:
            piece = source.read(name)
            piece = piece.to(torch.promote_types(piece.dtype, torch.float32))
            finite_or_raise(piece, name, getattr(source, "url_of", lambda _: source.url)(name))
            pieces.append(piece * multiplier if multiplier != 1.0 else piece)
        yield torch.cat(pieces, dim=self.dim).reshape(-1)


@dataclass(frozen=True, eq=False)
class TableFactor:
    """A factor computed before writing (SVD results), taken from ``table[module]``."""

    table: Mapping[str, Factors]
    module: str
    factor: str  # "a" or "b"

    @property
    def inputs(self) -> tuple[str, ...]:
        return ()

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        yield getattr(self.table[self.module], self.factor).reshape(-1)


@dataclass(frozen=True)
class ModuleGroup:
    """The adapters (with their weights) that update one module."""

    module: str
    parts: tuple[tuple[WeightedAdapter, LoraModule], ...]

    @property
    def first(self) -> LoraModule:
        return self.parts[0][1]

    @property
    def rank(self) -> int:
        return sum(m.rank for _, m in self.parts)

    def a_parts(self) -> tuple[tuple[str, float], ...]:
        return tuple((qualified(item.namespace, m.a), item.weight * m.scale) for item, m in self.parts)

    def b_parts(self) -> tuple[tuple[str, float], ...]:
        return tuple((qualified(item.namespace, m.b), 1.0) for item, m in self.parts)

    def dtype(self) -> torch.dtype:
        dtype: torch.dtype | None = None
        for item, m in self.parts:
            for key in (m.a, m.b):
                d = item.adapter.metas[key].dtype
                dtype = d if dtype is None else torch.promote_types(dtype, d)
        assert dtype is not None  # a factor has at least one part
        return dtype

    def stacked_dtype(self) -> torch.dtype:
        """The dtype that keeps rank stacking exact: the adapters' own when every multiplier is 1
        (A and B are copied as stored), else at least float32 (``w * s * A`` rarely fits bf16 / fp16)."""
        if all(c == 1.0 for _, c in self.a_parts()):
            return self.dtype()
        return torch.promote_types(self.dtype(), torch.float32)


def module_groups(inputs: Sequence[WeightedAdapter]) -> dict[str, ModuleGroup]:
    """Modules in name order, each with its adapters; the adapters must agree on its shape and kind."""
    grouped: dict[str, list[tuple[WeightedAdapter, LoraModule]]] = {}
    for item in inputs:
        for module in item.adapter.modules.values():
            grouped.setdefault(module.module, []).append((item, module))
    groups = {}
    for name in sorted(grouped):
        parts = grouped[name]
        first = parts[0][1]
        for item, module in parts[1:]:
            if (module.in_features, module.out_features, module.embedding, module.fan_in_fan_out) != (
                    first.in_features, first.out_features, first.embedding, first.fan_in_fan_out):
                raise AdapterError(f"{name}: adapters disagree on its shape or kind "
                                   f"({first.out_features}x{first.in_features} vs "
                                   f"{module.out_features}x{module.in_features})", item.adapter.url)
        groups[name] = ModuleGroup(name, tuple(parts))
    return groups


def replacement_tensors(inputs: Sequence[WeightedAdapter], groups: Mapping[str, ModuleGroup],
                        base_metas: Mapping[str, TensorMeta] | None, dtype: torch.dtype | None
                        ) -> tuple[list[PlannedTensor], list[str]]:
    """Adapter-file tensors for the replaced tensors, and the ``modules_to_save`` they need."""
    _, replacements = tensor_updates(inputs)
    owners = {qualified(item.namespace, key): (item, meta) for item in inputs for key, meta in item.adapter.metas.items()}
    saved: list[str] = []
    tensors = []
    for name in sorted(replacements):
        parts = replacements[name]
        item, meta = owners[parts[0][0]]
        module = module_of(name)
        if module in groups:  # a LoRA module's own base layer (saved embeddings)
            file_key = f"{PEFT_PREFIX}{module}.base_layer.{name[len(module) + 1:]}"
        else:
            entries = [e for w in inputs for e in w.adapter.settings.modules_to_save if targets([e], module)]
            if not entries:
                raise AdapterError(f"{name} is replaced by the adapter but is not a module to save (bias="
                                   f"{item.adapter.settings.bias!r}?): such adapters can only be fused "
                                   "(--output model)", item.adapter.url)
            saved += [e for e in entries if e not in saved]
            file_key = f"{PEFT_PREFIX}{name}"
        build: TensorBuilder
        if len(parts) == 1 and parts[0][1] == 1.0:
            build = CheckedCopy(parts[0][0])
        elif base_metas is None:
            raise AdapterError(f"combining the replaced tensor {name} needs the base model (--base-model)",
                               item.adapter.url)
        else:
            build = UpdatedTensor(qualified(BASE_NAMESPACE, name), tuple(meta.shape), tuple(parts))
        tensors.append(PlannedTensor(file_key, tuple(meta.shape), dtype or meta.dtype, parts[0][0], build))
    return tensors, saved


def combined_adapter_config(ranks: Mapping[str, int], groups: Mapping[str, ModuleGroup],
                            inputs: Sequence[WeightedAdapter], base_metas: Mapping[str, TensorMeta] | None,
                            base_url: str | None, modules_to_save: list[str]) -> dict:
    """Scale 1 everywhere: lora_alpha = r, and alpha_pattern = rank_pattern."""
    r, pattern = rank_layout(ranks)
    fan = {g.first.fan_in_fan_out for g in groups.values() if not g.first.embedding}
    if len(fan) > 1:
        raise AdapterError("the adapters mix fan_in_fan_out true and false; one adapter cannot hold both")
    return adapter_config(
        r=r, lora_alpha=r, rank_pattern=pattern, alpha_pattern={k: float(v) for k, v in pattern.items()},
        target_modules=infer_target_modules(ranks, base_modules(base_metas) if base_metas is not None else None),
        fan_in_fan_out=bool(fan and fan.pop()), modules_to_save=modules_to_save,
        task_type=inputs[0].adapter.settings.task_type, base_model_name_or_path=base_url)


def plan_combined_adapter(inputs: Sequence[WeightedAdapter], source: TensorSource,
                          base_metas: Mapping[str, TensorMeta] | None, base_url: str | None, *,
                          dtype: torch.dtype | None, rank: int | None = None, energy: float | None = None,
                          device: str | None = None) -> tuple[MergePlan, dict, list[ModuleReport]]:
    """(plan of adapter_model.safetensors, adapter_config.json, SVD reports) of the combination.

    Without ``rank``/``energy``: exact rank stacking, nothing read before writing (factors in
    `ModuleGroup.stacked_dtype` unless ``dtype`` is given). With them:
    each module's stacked update is re-factored by `factor_product` now (the result is held: an
    adapter, not a model) and its relative error reported.
    """
    if base_metas is not None:
        for item in inputs:
            check_fits_base(item.adapter, base_metas, base_url)
    fused = [item.adapter.url for item in inputs if item.adapter.wrapped or item.adapter.experts]
    if fused:
        raise AdapterError("combining adapters with LoRA on fused expert tensors (target_parameters) into one "
                           "adapter is not supported; fuse them into the model (--output model)", fused[0])
    groups = module_groups(inputs)
    refactor = rank is not None or energy is not None
    table: dict[str, Factors] = {}
    reports = []
    if refactor:
        check_targets(rank, energy)
        where = svd_device(device)
        for name, group in groups.items():
            a = torch.cat([source.read(n).to(torch.float32) * c for n, c in group.a_parts()], dim=0)
            b = torch.cat([source.read(n).to(torch.float32) for n, _ in group.b_parts()], dim=1)
            finite_or_raise(a, f"lora_A of {name}", source.url)
            finite_or_raise(b, f"lora_B of {name}", source.url)
            table[name] = factor_product(b, a, rank=rank, energy=energy, device=where)
            reports.append(ModuleReport(name, table[name].rank, table[name].relative_error))
    tensors = []
    ranks = {}
    for name, group in groups.items():
        m = group.first
        k = table[name].rank if refactor else group.rank
        ranks[name] = k
        out_dtype = dtype or (group.dtype() if refactor else group.stacked_dtype())
        a_build = TableFactor(table, name, "a") if refactor else StackedFactor(group.a_parts(), 0)
        b_build = TableFactor(table, name, "b") if refactor else StackedFactor(group.b_parts(), 1)
        tensors.append(PlannedTensor(adapter_file_key(name, "lora_A", m.embedding), (k, m.in_features), out_dtype,
                                     group.a_parts()[0][0], a_build))
        tensors.append(PlannedTensor(adapter_file_key(name, "lora_B", m.embedding), (m.out_features, k), out_dtype,
                                     group.b_parts()[0][0], b_build))
    extra, saved = replacement_tensors(inputs, groups, base_metas, dtype)
    config = combined_adapter_config(ranks, groups, inputs, base_metas, base_url, saved)
    return adapter_plan(tensors + extra), config, reports
