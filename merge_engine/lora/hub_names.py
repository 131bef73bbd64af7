"""An extracted adapter under the Hub checkpoint's module names, the form PEFT loads onto a Hub-format base.

A checkpoint written from a transformers v5 model carries the in-memory names (``model.language_model``
for vision-language models, fused 3-D experts for MoE); the base written beside the adapter, and the
bases serving stacks and PEFT users load, carry the Hub names (`merge_engine.plan.hub_format`). This module
renames the adapter the same way, with transformers' own conversion (`hub_naming`), so nothing is
re-typed:

- a module whose weight keeps its shape under another name is renamed (A and B copied as stored);
- a module whose Hub weights are row bands of its weight (a weight fused on load) becomes one module per
  band: A shared, B cut to the band's rows;
- a LoRA on a fused expert parameter (`merge_engine.lora.fused_experts`) becomes one module per Hub
  expert tensor (``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``):
  A_e = ``A[e*r:(e+1)*r]``, B_e = the band's rows of ``B[:, e::E]``; PEFT fuses them back on load;
- trained copies (``modules_to_save``) are renamed like the tensors they replace.

Anything else (a Hub tensor cut across the input dimension, a transposed view) raises `AdapterError`.
The factors are cut as they are written (`FactorRange`: a ranged read of A_e or of a band of B;
`ExpertColumns`: B_e's columns, from one read of the fused B kept while its experts are written).
With ``--weights-format transformers``, or when no name changes, the names stay as stored, and a LoRA on
fused experts stays in PEFT's own ``target_parameters`` form (the factors as trained; PEFT loads it onto
a base that keeps the fused tensors).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from merge_engine.errors import AdapterError, UnsupportedLayout
from merge_engine.plan.hub_format import HUB, WeightsFormat, hub_naming
from merge_engine.lora.adapter_io import LoraModule
from merge_engine.lora.fuse import CheckedCopy, finite_or_raise
from merge_engine.lora.fused_experts import ExpertLora
from merge_engine.lora.keys import LORA_A, LORA_B, PEFT_PREFIX, adapter_file_key, parse_key
from merge_engine.plan.merge_plan import PlannedTensor, TensorBuilder
from merge_engine.formats.tensor_source import TensorMeta, TensorSource, iter_flat_range
from merge_engine.plan.transformers_conversion import ComputedTensor, TensorView

WEIGHT = ".weight"


@dataclass(frozen=True)
class FactorRange:
    """Elements ``[start, start + count)`` of a factor's row-major flattening (A_e of a fused lora_A:
    its rows ``[e * r, (e + 1) * r)``; a row band of a lora_B), one ranged read, NaN/Inf refused."""

    name: str
    start: int
    count: int

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.name,)

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        for chunk in iter_flat_range(source, self.name, self.start, self.count, max_bytes):
            finite_or_raise(chunk, self.name, source.url)
            yield chunk


class _LastFactor:
    """The last fused lora_B read, kept for the next expert's slice (one factor, a few MB, at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, str] | None = None
        self._value: torch.Tensor | None = None

    def read(self, source: TensorSource, name: str) -> torch.Tensor:
        with self._lock:
            if self._key != (id(source), name):
                value = source.read(name)
                finite_or_raise(value, name, source.url)
                self._key, self._value = (id(source), name), value
                return value
            assert self._value is not None  # read with the key
            return self._value

    def __getstate__(self) -> dict:  # travels to a worker process empty
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]  # arrives empty: the state of a fresh one


@dataclass(frozen=True)
class ExpertColumns:
    """B_e, rows ``[row_start, row_stop)``: ``B[row_start:row_stop, expert::num_experts]`` of a fused lora_B.

    B is read whole once and kept while consecutive tensors slice it (plan them together)."""

    name: str
    expert: int
    num_experts: int
    row_start: int
    row_stop: int
    cache: _LastFactor = field(default_factory=_LastFactor, compare=False, repr=False)

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.name,)

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        b = self.cache.read(source, self.name)
        yield b[self.row_start:self.row_stop, self.expert::self.num_experts].contiguous().reshape(-1)


@dataclass(frozen=True)
class ExportedAdapter:
    """The adapter file's tensors (PEFT's names), each module's rank and the (Hub) shape of the
    weight it updates, the trained copies' names, and what was renamed."""

    tensors: tuple[PlannedTensor, ...]
    ranks: Mapping[str, int]
    weight_shapes: Mapping[str, tuple[int, ...]]
    embeddings: frozenset[str]
    trained_copies: Mapping[str, str]  # output tensor name -> source key
    base_modules: frozenset[str]  # the modules of the base the adapter is named for
    notes: tuple[str, ...] = field(default=())
    # LoRAs kept on fused expert tensors (PEFT target_parameters): tensor name -> (rank, its shape)
    fused_parameters: Mapping[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    # every written module (and kept fused tensor) -> PEFT's lora_alpha of the stored module it comes from
    alphas: Mapping[str, float] = field(default_factory=dict)
    # every written module (and kept fused tensor) -> the stored module it comes from (a fused expert wrapper:
    # ``model.layers.0.mlp.experts.base_layer``), so the trained settings of each are known
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def target_parameters(self) -> list[str]:
        """adapter_config's ``target_parameters``: each fused tensor's name below its layer number
        (``mlp.experts.gate_up_proj``), which PEFT matches as a suffix; PEFT nests the wrappers of one
        module in the order the module registers its tensors, as it did when training."""
        return sorted({_below_layer(name) for name in self.fused_parameters})


def _below_layer(name: str) -> str:
    """``model.layers.3.mlp.experts.gate_up_proj`` -> ``mlp.experts.gate_up_proj`` (the whole name when
    no part is a number)."""
    parts = name.split(".")
    numbers = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[numbers[0] + 1:]) if numbers else name


def _module(weight_name: str) -> str:
    return weight_name[: -len(WEIGHT)] if weight_name.endswith(WEIGHT) else weight_name


def _row_band(view: TensorView, rows_before: int, columns: int) -> tuple[int, int, int] | None:
    """(block, first row, rows) when ``view`` is whole rows of block ``offset // (rows_before * columns)``
    of a tensor laid out (blocks, rows_before, columns); None otherwise."""
    if len(view.shape) != 2 or view.shape[1] != columns or not view.is_contiguous():
        return None
    block, rest = divmod(view.offset, rows_before * columns)
    first, partial = divmod(rest, columns)
    if partial or first + view.shape[0] > rows_before:
        return None
    return block, first, view.shape[0]


def _relaid_whole(views: list[tuple[str, TensorView]] | None, name: str, numel: int) -> TensorView | None:
    """The view when ``name`` is written whole under its own name in another layout (transposed)."""
    if views and len(views) == 1 and views[0][0] == name and views[0][1].offset == 0 \
            and views[0][1].numel == numel and not views[0][1].is_contiguous():
        return views[0][1]
    return None


def _check_covered(views: list[tuple[str, TensorView]], numel: int, name: str, where: str | None) -> None:
    """The Hub tensors cut from ``name`` hold each of its elements once (else a part of its LoRA would be
    dropped or doubled without a word): `AdapterError`."""
    starts = sorted((view.offset, view.numel) for _, view in views)
    at = 0
    for offset, count in starts:
        if offset != at:
            break
        at += count
    if at != numel:
        raise AdapterError(f"the Hub tensors cut from {name} do not cover it exactly once; pass --weights-format "
                           "transformers", where)


class _Builder:
    def __init__(self, metas: Mapping[str, TensorMeta], dtype: torch.dtype | None) -> None:
        self.metas, self.dtype = metas, dtype
        self.tensors: list[PlannedTensor] = []
        self.ranks: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.embeddings: set[str] = set()
        self.alphas: dict[str, float] = {}
        self.sources: dict[str, str] = {}

    def add(self, module: str, rank: int, weight_shape: tuple[int, ...], embedding: bool,
            a: tuple[tuple[int, ...], str, TensorBuilder], b: tuple[tuple[int, ...], str, TensorBuilder], *,
            alpha: float | None, source: str) -> None:
        if module in self.ranks:
            raise AdapterError(f"two LoRA factors would be written as {module}")
        self.ranks[module], self.shapes[module] = rank, weight_shape
        self.sources[module] = source
        if alpha is not None:
            self.alphas[module] = alpha
        if embedding:
            self.embeddings.add(module)
        for factor, (shape, key, build) in ((LORA_A, a), (LORA_B, b)):
            self.tensors.append(PlannedTensor(adapter_file_key(module, factor, embedding), shape,
                                              self.dtype or self.metas[key].dtype, key, build))


def export_adapter(modules: Mapping[str, LoraModule], experts: Mapping[str, ExpertLora],
                   trained_copies: Mapping[str, str], metas: Mapping[str, TensorMeta],
                   base_shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, object],
                   weights_format: WeightsFormat,
                   dtype: torch.dtype | None, where: str | None) -> ExportedAdapter:
    """The adapter under the names of the base written in ``weights_format`` (see the module docstring).

    ``modules`` / ``experts`` / ``trained_copies``: the checkpoint's LoRA under its stored names;
    ``metas``: the factors' source; ``base_shapes``: the base model's tensors under the stored names.
    """
    naming = hub_naming(base_shapes, config) if weights_format == HUB else None
    pieces: dict[str, list[tuple[str, TensorView]]] = {}
    computed: dict[str, str] = {}  # a stored weight -> the Hub tensor computed from it and others
    if naming is not None:
        for hub_name, view in naming.views.items():
            if isinstance(view, ComputedTensor):
                computed.update(dict.fromkeys(view.sources, hub_name))
                continue
            pieces.setdefault(view.source, []).append((hub_name, view))
        base_modules = {_module(n) for n in naming.views if n.endswith(WEIGHT)}
    else:
        base_modules = {_module(n) for n in base_shapes if n.endswith(WEIGHT)}
    out = _Builder(metas, dtype)
    renamed = 0
    for lora in modules.values():
        if lora.weight_name in computed:
            raise UnsupportedLayout(f"{lora.module}: its Hub tensor {computed[lora.weight_name]} is computed from "
                                    "several stored tensors, so no Hub module carries its LoRA: pass "
                                    "--weights-format transformers", where)
        views = pieces.get(lora.weight_name)
        if not views or (len(views) == 1 and views[0][1].is_whole(lora.weight_shape)):
            name = _module(views[0][0]) if views else lora.module
            renamed += name != lora.module
            out.add(name, lora.rank, lora.weight_shape, lora.embedding,
                    (tuple(metas[lora.a].shape), lora.a, CheckedCopy(lora.a)),
                    (tuple(metas[lora.b].shape), lora.b, CheckedCopy(lora.b)), alpha=lora.alpha, source=lora.module)
            continue
        _check_covered(views, lora.out_features * lora.in_features, lora.weight_name, where)
        for hub_name, view in views:
            band = None if lora.transposed else _row_band(view, lora.out_features, lora.in_features)
            if band is None:
                raise AdapterError(f"{lora.module}: its Hub tensor {hub_name} is not a band of rows of "
                                   f"{lora.weight_name}, so its LoRA cannot be split; pass --weights-format "
                                   "transformers", where)
            _, first, rows = band
            renamed += 1
            out.add(_module(hub_name), lora.rank, (rows, lora.in_features), False,
                    ((lora.rank, lora.in_features), lora.a, CheckedCopy(lora.a)),
                    ((rows, lora.rank), lora.b, FactorRange(lora.b, first * lora.rank, rows * lora.rank)),
                    alpha=lora.alpha, source=lora.module)
    fused: dict[str, tuple[int, tuple[int, ...]]] = {}
    for moe in experts.values():
        views = pieces.get(moe.parameter)
        wrapper = parse_key(moe.a, where).name
        relaid = _relaid_whole(views, moe.parameter, moe.num_experts * moe.out_features * moe.in_features)
        if not views or relaid:  # the base keeps the fused tensor: PEFT's own target_parameters form, as trained
            # (a base holding it transposed, the Hub's layout of Qwen3-VL-MoE, takes the same factors: PEFT
            # 0.17 reads (E, in, out), 0.21 the in-memory (E, out, in), both as delta[e] = B_e @ A_e)
            fused[moe.parameter] = (moe.rank, relaid.shape if relaid else moe.weight_shape)
            out.sources[moe.parameter] = wrapper
            if moe.alpha is not None:
                out.alphas[moe.parameter] = moe.alpha
            for factor, key in ((LORA_A, moe.a), (LORA_B, moe.b)):
                out.tensors.append(PlannedTensor(adapter_file_key(parse_key(key, where).name, factor, False),
                                                 tuple(metas[key].shape), dtype or metas[key].dtype, key,
                                                 CheckedCopy(key)))
            continue
        _check_covered(views, moe.num_experts * moe.out_features * moe.in_features, moe.parameter, where)
        b_cache = ExpertColumns(moe.b, 0, 1, 0, 0).cache  # one fused B read for all its experts
        for hub_name, view in sorted(views, key=lambda item: (item[1].offset, item[0])):
            band = _row_band(view, moe.out_features, moe.in_features)
            if band is None:
                raise AdapterError(f"{moe.parameter}: the Hub tensor {hub_name} is not whole rows of one expert; "
                                   "pass --weights-format transformers", where)
            expert, first, rows = band
            span = moe.rank * moe.in_features
            renamed += 1
            out.add(_module(hub_name), moe.rank, (rows, moe.in_features), False,
                    ((moe.rank, moe.in_features), moe.a, FactorRange(moe.a, expert * span, span)),
                    ((rows, moe.rank), moe.b,
                     ExpertColumns(moe.b, expert, moe.num_experts, first, first + rows, b_cache)),
                    alpha=moe.alpha, source=wrapper)
    copies: dict[str, str] = {}
    for name, key in sorted(trained_copies.items()):
        views = pieces.get(name)
        if views and not (len(views) == 1 and views[0][1].is_whole(tuple(metas[key].shape))):
            raise AdapterError(f"the trained copy of {name} is cut into several Hub tensors; pass --weights-format "
                               "transformers", where)
        target = views[0][0] if views else name
        renamed += target != name
        copies[target] = key
        out.tensors.append(PlannedTensor(f"{PEFT_PREFIX}{target}", tuple(metas[key].shape), dtype or metas[key].dtype,
                                         key, CheckedCopy(key)))
    notes: tuple[str, ...] = (f"adapter under the Hub names: {renamed} modules renamed or split "
             f"({len(experts) - len(fused)} fused expert tensors as per-expert modules)",) if renamed else ()
    if fused:
        notes += (f"{len(fused)} fused expert tensors kept in PEFT's target_parameters form",)
    return ExportedAdapter(tuple(out.tensors), out.ranks, out.shapes, frozenset(out.embeddings), copies,
                           frozenset(base_modules), notes, fused, out.alphas, out.sources)


def check_exported_fits(exported: ExportedAdapter, base_metas: Mapping[str, TensorMeta], adapter_url: str,
                        base_url: str | None) -> None:
    """Every module of the exported adapter updates a weight of the base it is written for, of the
    same shape, and every trained copy replaces a tensor of that shape; else `AdapterError`."""
    for module, shape in exported.weight_shapes.items():
        meta = base_metas.get(f"{module}{WEIGHT}")
        if meta is None:
            raise AdapterError(f"target module {module} does not exist in the base model {base_url}", adapter_url)
        if tuple(meta.shape) != tuple(shape):
            raise AdapterError(f"{module}: the adapter updates a {tuple(shape)} weight but the base's is "
                               f"{tuple(meta.shape)}", adapter_url)
    for name, (_, shape) in exported.fused_parameters.items():
        meta = base_metas.get(name)
        if meta is None or tuple(meta.shape) != tuple(shape):
            raise AdapterError(f"the adapter's LoRA on {name} {tuple(shape)} needs that fused tensor in the base "
                               f"model {base_url}, which does not hold it with that shape", adapter_url)
    by_name = {t.name: t for t in exported.tensors}
    for name in exported.trained_copies:
        meta = base_metas.get(name)
        shape = by_name[f"{PEFT_PREFIX}{name}"].shape
        if meta is None or tuple(meta.shape) != tuple(shape):
            raise AdapterError(f"the adapter replaces {name} {tuple(shape)}, which the base model {base_url} does "
                               f"not hold with that shape", adapter_url)
