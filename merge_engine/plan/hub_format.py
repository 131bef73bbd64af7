"""Hub-format output: the names and per-expert tensors of a model's Hugging Face Hub checkpoint.

A checkpoint written from transformers v5's in-memory model (verl under v5) carries its in-memory names
(fused 3-D experts, ``model.language_model``, ...); serving stacks, older transformers and PEFT adapters
read the Hub names, which this module writes (why: docs/hub_format.md).

Contract:
- `hub_naming(names_shapes, config)` -> `HubNaming` or None. The conversion is transformers' own:
  the model class of ``config`` is built on the ``meta`` device, its conversion mapping reversed as
  ``save_pretrained`` reverses it, and the reversal is run on meta tensors that record which source
  tensor, and which strided view of it, each output is (`merge_engine.plan.transformers_conversion`).
  Nothing is re-typed here.
  None when no name changes: transformers has no conversion for the model, or the names already
  are the Hub names (a checkpoint written under transformers 4.x, a dense model).
- A transposed view (Qwen3-VL-MoE's fused experts: `transformers_conversion`'s Hub transpose) is read one
  leading index (one expert's matrix) at a time and transposed in memory (`_strided_blocks`). Square ones stay
  in transformers 5's layout: the plan's ``records["transformers_4"]`` (``stepmerge.json``) says 4.x readers
  cannot load the folder (`square_reader_note`).
- A Hub tensor that transformers' reverse conversion computes from several stored tensors (Kimi-K2.5's
  vision ``wqkv``: q, k, v permuted back for rope and concatenated) is computed by that conversion's own
  ops from the whole source tensors (`ComputedBuilder`; such tensors are small: vision projections).
- `to_hub_format(plan, config)` -> the plan with the Hub names; every output is planned as ranged
  reads of its source (a per-expert slice of a tensor fused on dim 0 is one contiguous byte range),
  so no fused tensor is ever held whole.
- A masked-LM head's ``bias`` that transformers 4.x ties to its decoder's in the head itself (one parameter)
  is written as the decoder's bias, the one transformers 5 adds, when the embeddings are untied
  (`merge_engine.plan.hub_biases`; recorded in ``records["tensor_translation"]``).
- ``config.json`` in the Hub's form too (`with_hub_config`, `merge_engine.plan.hub_config`): the keys
  transformers 4.x reads added beside transformers 5's, recorded in the plan's ``config_changes``.
- ``--weights-format transformers`` keeps the stored names and config (`WEIGHTS_FORMATS`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from merge_engine.errors import UnsupportedLayout
from merge_engine.plan.hub_biases import with_legacy_biases
from merge_engine.plan.hub_config_memo import hub_config_memo
from merge_engine.option_values import (  # noqa: F401 - the format names live with the other option values
    DEFAULT_WEIGHTS_FORMAT, HUB, TRANSFORMERS, WEIGHTS_FORMATS, WeightsFormat, parse_weights_format,
)
from merge_engine.plan.merge_plan import MergePlan, PlannedTensor, assign_shards
from merge_engine.formats.tensor_source import TensorSource, iter_flat_range
from merge_engine.plan.transformers_conversion import (
    ComputedTensor,
    TensorView,
    compute_reverse,
    conversion_known,
    meta_model,
    square_hub_transposes,
    trace_reverse_conversion,
)


def in_memory_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """The state dict shapes of ``config``'s model as transformers v5 holds it in memory (built on the
    meta device, no weight), or None when transformers has no class for it."""
    try:
        model = meta_model(config)
    except Exception:  # noqa: BLE001 - an unbuildable config has no known shapes
        return None
    return None if model is None else {k: tuple(v.shape) for k, v in model.state_dict().items()}


def in_weights_format(plan: MergePlan, config: Mapping[str, Any], weights_format: WeightsFormat,
                      max_shard_size: int) -> MergePlan:
    """``hub`` (default): ``plan`` under the Hub checkpoint's names (`to_hub_format`) and its config in
    the Hub's form (`with_hub_config`); ``transformers``: as it is, the stored config kept. Then sharded,
    once: ``plan`` comes planned unsharded (its planner given ``max_shard_size=None``). Every command that
    writes a model (merge, extract-lora's base, merge-lora) asks this."""
    if plan.shards:
        raise ValueError("in_weights_format shards the plan: plan it with max_shard_size=None")
    if weights_format == HUB:
        plan = with_hub_config(to_hub_format(plan, config), config)
    return replace(plan, shards=assign_shards(plan.tensors, max_shard_size))


def with_hub_config(plan: MergePlan, config: Mapping[str, Any]) -> MergePlan:
    """``plan`` whose ``config_updates`` also write the keys transformers 4.x readers need
    (`merge_engine.plan.hub_config`, kept per config: `merge_engine.plan.hub_config_memo`); what was added
    is in ``config_changes`` and a note."""
    translated = hub_config_memo({**dict(config), **plan.config_updates})
    return replace(plan, config_updates={**plan.config_updates, **translated.updates},
                   config_changes=translated.changes, notes=plan.notes + (translated.describe(),))


@dataclass(frozen=True)
class HubNaming:
    """Output name -> view of a source tensor, in write order (sources in their order, then offset)."""

    views: dict[str, TensorView | ComputedTensor]
    description: str
    square: tuple[str, ...] = ()  # written in transformers 5's layout: 4.x readers take it transposed


def hub_naming(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> HubNaming | None:
    """The Hub names of tensors stored under ``shapes``' names (see module docstring), or None."""
    if not conversion_known(config):
        return None
    try:
        model = meta_model(config)
    except Exception as exc:  # noqa: BLE001 - any failure to build the class is reported as one error
        raise UnsupportedLayout(f"cannot build {config.get('architectures') or config.get('model_type')} on the "
                                f"meta device to read its Hub names ({exc}); pass --weights-format transformers")
    if model is None:
        return None
    memory = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    model_hub = trace_reverse_conversion(model, memory, computed=True)
    in_memory_only = set(memory) - set(model_hub)
    relaid = {s for v in model_hub.values() for s in _changed_sources(v, memory)}  # e.g. transposed, computed
    if not (in_memory_only | relaid) & set(shapes):
        return None  # already Hub names (or a model whose names never change)
    views = trace_reverse_conversion(model, shapes, computed=True)
    square = tuple(square_hub_transposes(model, shapes))
    if all(isinstance(v, TensorView) and name == v.source and v.is_whole(shapes[name]) for name, v in views.items()):
        return None  # already the Hub's names and layout (a checkpoint written under transformers 4.x)
    order = {name: i for i, name in enumerate(shapes)}
    ordered = dict(sorted(views.items(), key=lambda kv: (order[_first_source(kv[1])], getattr(kv[1], "offset", 0),
                                                         kv[0])))
    import transformers

    plain = {name: v for name, v in views.items() if isinstance(v, TensorView)}
    split = sum(1 for v in plain.values() if not v.is_whole(shapes[v.source]) and v.is_contiguous())
    transposed = sum(1 for v in plain.values() if not v.is_contiguous())
    renamed = sum(1 for name, v in plain.items() if name != v.source)
    return HubNaming(ordered, f"Hub names (transformers {transformers.__version__} conversion for "
                              f"{type(model).__name__}): {renamed} of {len(views)} tensors renamed, "
                              f"{split} cut from fused tensors, {transposed} transposed, "
                              f"{len(views) - len(plain)} computed from several"
                              + (f", {len(square)} square fused tensors in transformers 5's layout" if square else ""),
                     square)


def _first_source(view: TensorView | ComputedTensor) -> str:
    return view.sources[0] if isinstance(view, ComputedTensor) else view.source


def _changed_sources(view: TensorView | ComputedTensor, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, ...]:
    if isinstance(view, ComputedTensor):
        return view.sources
    return () if view.is_whole(shapes[view.source]) else (view.source,)


@dataclass(frozen=True)
class ComputedBuilder:
    """Builds one Hub tensor that transformers' reverse conversion computes from several planned tensors:
    each read whole, the conversion run on them (`compute_reverse`). Memory: those tensors, twice."""

    bases: tuple[PlannedTensor, ...]
    computed: ComputedTensor
    out_name: str
    config_json: str

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i for base in self.bases for i in getattr(base.build, "inputs", (base.source_name,))))

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        import json

        tensors = {}
        for base in self.bases:
            numel = 1
            for size in base.shape:
                numel *= size
            pieces = [c.reshape(-1) for c in _planned_range(base, source, 0, numel, max_bytes)]
            tensors[base.name] = (torch.cat(pieces) if pieces else torch.empty(0, dtype=base.dtype)).reshape(base.shape)
        value = compute_reverse(meta_model(json.loads(self.config_json)), self.computed, tensors, self.out_name)
        flat = value.reshape(-1)
        step = max(1, max_bytes // max(1, flat.element_size()))
        for start in range(0, flat.numel(), step):
            yield flat[start:start + step]


@dataclass(frozen=True)
class ViewBuilder:
    """Builds one Hub tensor as ranged reads of the planned tensor it is a view of."""

    base: PlannedTensor
    view: TensorView

    @property
    def inputs(self) -> tuple[str, ...]:
        return getattr(self.base.build, "inputs", (self.base.source_name,))

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        if self.view.min_run() * self.base.dtype.itemsize >= MIN_RUN_BYTES or self.view.numel == self.view.min_run():
            for start, count in self.view.runs():
                yield from _planned_range(self.base, source, start, count, max_bytes)
            return
        yield from _strided_blocks(self.base, self.view, source, max_bytes)


def _strided_blocks(base: PlannedTensor, view: TensorView, source: TensorSource,
                    max_bytes: int) -> Iterator[torch.Tensor]:
    """A view whose contiguous runs are short (a transpose), in row-major order of the view: for each
    index of its first dimension (one expert of a fused tensor), the source range it spans read once,
    the strided view taken in memory. Memory: one such range (one expert's matrix), not the tensor."""
    shape, stride = view.shape[1:], view.stride[1:]
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
    for index in range(view.shape[0]):
        start = view.offset + index * view.stride[0]
        block = torch.cat([c.reshape(-1) for c in _planned_range(base, source, start, span, max_bytes)])
        if block.numel() != span:
            raise UnsupportedLayout(f"{base.name}: read {block.numel()} elements of {span} for a transposed view")
        yield torch.as_strided(block, shape, stride, 0).contiguous().reshape(-1)


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


MIN_RUN_BYTES = 512  # a view cut finer than this (a transpose) is read a block at a time (`_strided_blocks`)


def to_hub_format(plan: MergePlan, config: Mapping[str, Any]) -> MergePlan:
    """``plan`` (unsharded) with its tensors under their Hub names (per-expert tensors cut from fused ones),
    unsharded, and a masked-LM head's bias that transformers 4.x holds as one parameter written as the one
    transformers 5 uses (`merge_engine.plan.hub_biases`). The plan is returned unchanged when its names already
    are the Hub names and no such bias is untied."""
    return with_legacy_biases(_hub_named(plan, config), config)


def _hub_named(plan: MergePlan, config: Mapping[str, Any]) -> MergePlan:
    merged_config = {**dict(config), **plan.config_updates}
    by_name = plan.by_name()
    naming = hub_naming({t.name: t.shape for t in plan.tensors}, merged_config)
    if naming is None:
        return plan
    tensors: list[PlannedTensor] = []
    config_json = None
    for out_name, view in naming.views.items():
        if isinstance(view, ComputedTensor):
            import json

            config_json = config_json or json.dumps(merged_config, sort_keys=True, default=str)
            bases = tuple(by_name[name] for name in view.sources)
            tensors.append(PlannedTensor(out_name, view.shape, bases[0].dtype, bases[0].source_name,
                                         ComputedBuilder(bases, view, out_name, config_json)))
            continue
        base = by_name[view.source]
        if view.is_whole(base.shape):
            tensors.append(replace(base, name=out_name))
            continue
        tensors.append(PlannedTensor(out_name, view.shape, base.dtype, base.source_name, ViewBuilder(base, view)))
    records = dict(plan.records)
    if naming.square:
        records["transformers_4"] = square_reader_note(naming.square)
    return MergePlan(tuple(tensors), (), plan.config_updates,
                     plan.notes + (naming.description,), records=records)


def square_reader_note(names: tuple[str, ...]) -> dict[str, Any]:
    """What ``stepmerge.json`` records of a folder whose square fused tensors are in transformers 5's layout."""
    return {"loads": False, "square_tensors": list(names),
            "reason": f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: square fused experts, "
                      "written in transformers 5's layout (transformers 5 transposes them on load only when their "
                      "shape differs, so no layout loads the same in 4.x and 5.x); 4.x readers would read them "
                      "transposed: this folder is for transformers 5"}

