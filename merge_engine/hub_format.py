"""Hub-format output: the names and per-expert tensors of a model's Hugging Face Hub checkpoint.

transformers v5 holds some models in memory under other names than their Hub checkpoints: MoE
experts fused into 3-D tensors (``model.layers.0.mlp.experts.gate_up_proj``), vision-language models
under ``model.language_model``, GPT-NeoX's head as ``lm_head``. It converts at load time and back at
save time (``save_pretrained``), with the conversion mapping of the model type. A checkpoint written
from the in-memory model (verl under transformers v5) carries the in-memory names; serving stacks,
older transformers and PEFT adapters read the Hub names. This module writes the Hub names.

Contract:
- `hub_naming(names_shapes, config)` -> `HubNaming` or None. The conversion is transformers' own:
  the model class of ``config`` is built on the ``meta`` device, its conversion mapping reversed as
  ``save_pretrained`` reverses it, and the reversal is run on meta tensors that record which source
  tensor, and which strided view of it, each output is (`TensorView`). Nothing is re-typed here.
  None when no name changes: transformers has no conversion for the model, or the names already
  are the Hub names (a checkpoint written under transformers 4.x, a dense model).
- A conversion that is not a view of one source tensor (a concatenation, an interleave) is refused
  with `UnsupportedLayout` naming the tensor: ``--weights-format transformers`` writes it as stored.
- `to_hub_format(plan, config)` -> the plan with the Hub names; every output is planned as ranged
  reads of its source (a per-expert slice of a tensor fused on dim 0 is one contiguous byte range),
  so no fused tensor is ever held whole.
- ``--weights-format transformers`` keeps the stored names (`WEIGHTS_FORMATS`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from merge_engine.errors import InvalidOption, UnsupportedLayout
from merge_engine.merge_plan import MergePlan, PlannedTensor, assign_shards
from merge_engine.tensor_source import TensorSource, iter_flat_range

HUB = "hub"
TRANSFORMERS = "transformers"
WEIGHTS_FORMATS = (HUB, TRANSFORMERS)
DEFAULT_WEIGHTS_FORMAT = HUB


def parse_weights_format(name: str | None) -> str:
    value = (name or DEFAULT_WEIGHTS_FORMAT).lower()
    if value not in WEIGHTS_FORMATS:
        raise InvalidOption(f"unknown weights format {name!r}; choose one of {', '.join(WEIGHTS_FORMATS)}")
    return value


@dataclass(frozen=True)
class TensorView:
    """An output tensor that is a strided view of one source tensor, in elements of the source's
    row-major flattening: ``torch.as_strided(source.reshape(-1), shape, stride, offset)``."""

    source: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_whole(self, source_shape: tuple[int, ...]) -> bool:
        return self.offset == 0 and self.shape == tuple(source_shape) and self.is_contiguous()

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def runs(self) -> Iterator[tuple[int, int]]:
        """(start, count) element runs of the source whose concatenation is the view, coalesced."""
        if self.numel == 0:
            return
        if self.is_contiguous():
            yield self.offset, self.numel
            return
        inner = 1  # the trailing dims that are contiguous form one run
        split = len(self.shape)
        while split > 0 and (self.shape[split - 1] == 1 or self.stride[split - 1] == inner):
            inner *= self.shape[split - 1]
            split -= 1
        outer_shape, outer_stride = self.shape[:split], self.stride[:split]
        pending: list[int] | None = None
        for index in range(math.prod(outer_shape)):
            start, rest = self.offset, index
            for size, stride in zip(reversed(outer_shape), reversed(outer_stride)):
                rest, i = divmod(rest, size)
                start += i * stride
            if pending is not None and pending[0] + pending[1] == start:
                pending[1] += inner
            else:
                if pending is not None:
                    yield pending[0], pending[1]
                pending = [start, inner]
        if pending is not None:
            yield pending[0], pending[1]

    def min_run(self) -> int:
        inner = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size == 1 or stride == inner:
                inner *= size
            else:
                break
        return inner


@dataclass(frozen=True)
class HubNaming:
    """Output name -> view of a source tensor, in write order (sources in their order, then offset)."""

    views: dict[str, TensorView]
    description: str


class _Traced(torch.Tensor):
    """A meta tensor for tracing transformers' reverse conversion: ``contiguous()`` keeps the view
    (so a slice stays a view of its source), every other op runs as on any meta tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def _config_object(config: Mapping[str, Any]):
    from transformers import AutoConfig

    data = json.loads(json.dumps(dict(config)))
    model_type = data.pop("model_type", None)
    if not model_type:
        return None
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError):  # a model type this transformers does not know (remote code)
        return None


def _conversion_known(config: Mapping[str, Any]) -> bool:
    """Cheap test, before building any model: does transformers convert names for this config?"""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    keys = list(config.get("architectures") or [])
    scopes = [config] + [v for v in config.values() if isinstance(v, Mapping) and "model_type" in v]
    keys += [s.get("model_type") for s in scopes if s.get("model_type")]
    return any(get_checkpoint_conversion_mapping(k) for k in keys)


@functools.lru_cache(maxsize=8)
def _meta_model(config_json: str):
    import transformers

    config = json.loads(config_json)
    cfg = _config_object(config)
    if cfg is None:
        return None
    architectures = config.get("architectures") or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        if isinstance(cls, type) and hasattr(cls, "_from_config"):
            return cls._from_config(cfg)
        return transformers.AutoModelForCausalLM.from_config(cfg)


def meta_model(config: Mapping[str, Any]):
    """The config's model class on the ``meta`` device (no weights), or None when transformers has no
    class for it. Cached by config content."""
    return _meta_model(json.dumps(dict(config), sort_keys=True, default=str))


def _reverse_transforms(model):
    """transformers' save-time reversal of its load-time conversion for ``model``: (renamings,
    converters, pattern -> converter), exactly as ``revert_weight_conversion`` builds them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    converters = [r for r in reverse if isinstance(r, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}


def trace_reverse_conversion(model, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorView]:
    """Run transformers' save-time conversion of ``model`` on meta tensors of ``shapes`` and return,
    for every output name, the view of the source tensor it is. `UnsupportedLayout` when an output is
    not a view of a single source (its values would have to be computed)."""
    from copy import deepcopy

    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
        dot_natural_key,
    )

    renamings, converters, by_pattern = _reverse_transforms(model)
    bases = {name: torch.empty(tuple(shape), device="meta").as_subclass(_Traced) for name, shape in shapes.items()}
    owner = {bases[name].untyped_storage()._cdata: name for name in bases}
    if len(owner) != len(bases):
        raise RuntimeError("meta tensors share storage: cannot trace the conversion")
    groups: dict[str, Any] = {}
    for name in sorted(shapes, key=dot_natural_key):
        renamed, pattern = apply_converters(name, converters)
        if pattern is not None:
            group = groups.setdefault(renamed, deepcopy(by_pattern[pattern]))
        else:
            renamed = apply_renamings(name, renamings)
            group = groups.setdefault(renamed, WeightRenaming(name, renamed))
            pattern = name
        group.add_tensor(renamed, name, pattern, bases[name])
    views: dict[str, TensorView] = {}
    for first, group in groups.items():
        for out_name, value in group.convert(first, model=model, config=model.config).items():
            value = value[0] if isinstance(value, list) else value
            if isinstance(group, WeightConverter):
                out_name = apply_renamings(out_name, renamings)
            source = owner.get(value.untyped_storage()._cdata)
            if source is None:
                raise UnsupportedLayout(f"{out_name}: transformers computes this Hub tensor from several stored "
                                        f"ones ({group.source_patterns}); pass --weights-format transformers "
                                        "to write the stored names")
            if out_name in views:
                raise UnsupportedLayout(f"{out_name}: two stored tensors map to the same Hub name")
            views[out_name] = TensorView(source, value.storage_offset(), tuple(value.shape), tuple(value.stride()))
    return views


def hub_naming(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> HubNaming | None:
    """The Hub names of tensors stored under ``shapes``' names (see module docstring), or None."""
    if not _conversion_known(config):
        return None
    try:
        model = meta_model(config)
    except Exception as exc:  # noqa: BLE001 - any failure to build the class is reported as one error
        raise UnsupportedLayout(f"cannot build {config.get('architectures') or config.get('model_type')} on the "
                                f"meta device to read its Hub names ({exc}); pass --weights-format transformers")
    if model is None:
        return None
    memory = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    model_hub = trace_reverse_conversion(model, memory)
    in_memory_only = set(memory) - set(model_hub)
    if not in_memory_only & set(shapes):
        return None  # already Hub names (or a model whose names never change)
    views = trace_reverse_conversion(model, shapes)
    order = {name: i for i, name in enumerate(shapes)}
    ordered = dict(sorted(views.items(), key=lambda kv: (order[kv[1].source], kv[1].offset, kv[0])))
    import transformers

    split = sum(1 for v in views.values() if not v.is_whole(shapes[v.source]))
    renamed = sum(1 for name, v in views.items() if name != v.source)
    return HubNaming(ordered, f"Hub names (transformers {transformers.__version__} conversion for "
                              f"{type(model).__name__}): {renamed} of {len(views)} tensors renamed, "
                              f"{split} cut from fused tensors")


@dataclass(frozen=True)
class ViewBuilder:
    """Builds one Hub tensor as ranged reads of the planned tensor it is a view of."""

    base: PlannedTensor
    view: TensorView

    @property
    def inputs(self) -> tuple[str, ...]:
        return getattr(self.base.build, "inputs", (self.base.source_name,))

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        for start, count in self.view.runs():
            yield from _planned_range(self.base, source, start, count, max_bytes)


def _planned_range(tensor: PlannedTensor, source: TensorSource, start: int, count: int,
                   max_bytes: int) -> Iterator[torch.Tensor]:
    if tensor.build is None:
        yield from iter_flat_range(source, tensor.source_name, start, count, max_bytes)
        return
    ranged = getattr(tensor.build, "chunks_range", None)
    if ranged is not None:
        yield from ranged(source, start, count, max_bytes)
        return
    at, end = 0, start + count  # a computed tensor without ranged output: computed, the range kept
    for chunk in tensor.build.chunks(source, max_bytes):
        chunk = chunk.reshape(-1)
        lo, hi = max(start, at), min(end, at + chunk.numel())
        if lo < hi:
            yield chunk[lo - at:hi - at]
        at += chunk.numel()
        if at >= end:
            return


MIN_RUN_BYTES = 512  # a view cut finer than this (a transpose) would be read element by element


def to_hub_format(plan: MergePlan, config: Mapping[str, Any], max_shard_size: int) -> MergePlan:
    """``plan`` with its tensors under their Hub names (per-expert tensors cut from fused ones).
    The plan is returned unchanged when its names already are the Hub names."""
    merged_config = {**dict(config), **plan.config_updates}
    by_name = plan.by_name()
    naming = hub_naming({t.name: t.shape for t in plan.tensors}, merged_config)
    if naming is None:
        return plan
    tensors: list[PlannedTensor] = []
    for out_name, view in naming.views.items():
        base = by_name[view.source]
        if view.is_whole(base.shape):
            tensors.append(replace(base, name=out_name))
            continue
        if view.min_run() * base.dtype.itemsize < MIN_RUN_BYTES and view.numel > view.min_run():
            raise UnsupportedLayout(f"{out_name}: the Hub tensor is a transposed view of {view.source}; "
                                    "pass --weights-format transformers to write the stored names")
        tensors.append(PlannedTensor(out_name, view.shape, base.dtype, base.source_name, ViewBuilder(base, view)))
    return MergePlan(tuple(tensors), assign_shards(tensors, max_shard_size), plan.config_updates,
                     plan.notes + (naming.description,))

