"""Fusing LoRA updates into base weights, one output tensor at a time.

`UpdatedTensor` is the `TensorBuilder` of every fused weight:

    out = W + sum_i w_i * (M_i - W) + sum_j c_j * (B_j @ A_j)      (or its transpose, per term)

computed in float32 over the base's own chunks (the writer casts to the output dtype). ``M_i`` are
whole replacement tensors (modules to save, saved embeddings) with their combination weight; one
replacement of weight 1 is copied exactly. The factors A and B (small: r x in, out x r) are read
whole; the base weight is never held: each chunk gets the rows of ``B @ A`` it covers, computed in
fixed row blocks of ~4 MiB, so memory is a few chunks plus the factors whatever the weight's size,
and the bits do not depend on how the base is chunked or sharded.

`plan_fused_model` turns a base model's metadata and a list of weighted adapters into a `MergePlan`
whose tensors read ``base::<name>`` and ``<namespace>::<key>`` from a `NamespacedSource`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from merge_engine.formats.chunks import aligned_chunks
from merge_engine.errors import AdapterError
from merge_engine.lora.adapter_io import Adapter, check_fits_base, with_base
from merge_engine.lora.sources import qualified
from merge_engine.plan.hf_plan import plan_hf_merge
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.plan.model_shapes import model_ties
from merge_engine.plan.output_heads import EMBED_SUFFIXES, LM_HEAD, embeddings_tied
from merge_engine.formats.tensor_source import TensorMeta, TensorSource, iter_flat_range

BASE_NAMESPACE = "base"
ROW_BLOCK_ELEMENTS = 1 << 20  # LoRA terms are computed in row blocks of about this many elements (4 MiB)


@dataclass(frozen=True)
class LoraTerm:
    """``coefficient * (B @ A)``, added to the weight as is or transposed. ``label`` names it in errors.
    ``experts`` > 1: a LoRA on a fused (experts, out, in) tensor, expert e's term being
    ``B[:, e::E] @ A[e*r:(e+1)*r]`` (PEFT's layout, `merge_engine.lora.fused_experts`)."""

    a: str
    b: str
    coefficient: float
    transposed: bool = False
    label: str = ""
    experts: int = 1


def finite_or_raise(tensor: torch.Tensor, what: str, where: str | None) -> None:
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise AdapterError(f"{what} holds NaN or Inf values", where)


def aligned(streams: Sequence[Iterator[torch.Tensor]]) -> Iterator[tuple[torch.Tensor, ...]]:
    """`merge_engine.formats.chunks.aligned_chunks` over ``streams``; streams of different lengths: `AdapterError`."""
    return aligned_chunks(*streams, error=lambda message: AdapterError(f"tensors to combine differ in length "
                                                                       f"({message})"))


def _source_url(source: TensorSource, name: str) -> str:
    url_of = getattr(source, "url_of", None)
    return url_of(name) if url_of else source.url


@dataclass(frozen=True)
class UpdatedTensor:
    """A base tensor with replacements and LoRA terms applied (see the module docstring)."""

    base: str
    shape: tuple[int, ...]
    replacements: tuple[tuple[str, float], ...] = ()
    terms: tuple[LoraTerm, ...] = ()

    @property
    def inputs(self) -> tuple[str, ...]:
        names = [self.base] + [name for name, _ in self.replacements]
        for term in self.terms:
            names += [term.a, term.b]
        return tuple(names)

    def _factors(self, source: TensorSource) -> list[tuple[float, torch.Tensor, torch.Tensor, bool, int]]:
        factors = []
        for term in self.terms:
            a = source.read(term.a).to(torch.float32)
            b = source.read(term.b).to(torch.float32)
            finite_or_raise(a, f"lora_A of {term.label}", _source_url(source, term.a))
            finite_or_raise(b, f"lora_B of {term.label}", _source_url(source, term.b))
            factors.append((term.coefficient, a, b, term.transposed, term.experts))
        return factors

    def _block(self, factors: list, index: int) -> torch.Tensor:
        """Rows [index * R, (index + 1) * R) of the summed LoRA terms, flat (R: `block_rows`); a 3-D
        (experts, out, in) weight counts its rows across experts."""
        cols = self.shape[-1]
        rows = math.prod(self.shape) // cols
        r0 = index * self.block_rows
        r1 = min(rows, r0 + self.block_rows)
        block = torch.zeros(r1 - r0, cols, dtype=torch.float32)
        for coefficient, a, b, transposed, experts in factors:
            if experts > 1:
                out, rank = self.shape[-2], a.shape[0] // experts
                for expert in range(r0 // out, (r1 - 1) // out + 1):
                    lo, hi = max(r0, expert * out), min(r1, (expert + 1) * out)
                    block[lo - r0:hi - r0].addmm_(b[lo - expert * out:hi - expert * out, expert::experts],
                                                  a[expert * rank:(expert + 1) * rank], alpha=coefficient)
            elif transposed:  # weight (in, out) = (B @ A).T: its rows are A's columns
                block.addmm_(a[:, r0:r1].T, b.T, alpha=coefficient)
            else:
                block.addmm_(b[r0:r1], a, alpha=coefficient)
        return block.reshape(-1)

    @property
    def block_rows(self) -> int:
        return max(1, ROW_BLOCK_ELEMENTS // self.shape[-1])

    def _add_delta(self, out: torch.Tensor, factors: list, start: int, cache: dict[int, torch.Tensor]) -> None:
        """Add elements [start, start + len(out)) of the flattened LoRA terms to ``out``.

        The terms are computed in fixed row blocks (the last one cached), so the result does not
        depend on where the source's chunks begin: same inputs, same bits, however stored."""
        per = self.block_rows * self.shape[-1]
        end = start + out.numel()
        index = start // per
        while index * per < end:
            if index not in cache:
                cache.clear()
                cache[index] = self._block(factors, index)
            lo, hi = max(start, index * per), min(end, (index + 1) * per)
            out[lo - start:hi - start].add_(cache[index][lo - index * per:hi - index * per])
            index += 1

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        return self._chunks(source, max_bytes, lambda name: source.iter_chunks(name, max_bytes), 0)

    def chunks_range(self, source: TensorSource, start: int, count: int, max_bytes: int) -> Iterator[torch.Tensor]:
        """Elements ``[start, start + count)`` of the flattened output, reading only that range of the
        base (a per-expert Hub tensor cut from an updated fused tensor); same bits as `chunks`."""
        return self._chunks(source, max_bytes,
                            lambda name: iter_flat_range(source, name, start, count, max_bytes), start)

    def _chunks(self, source: TensorSource, max_bytes: int, stream, start: int) -> Iterator[torch.Tensor]:
        factors = self._factors(source)
        replacements = list(self.replacements)
        main, main_is_copy = self.base, False
        if len(replacements) == 1 and replacements[0][1] == 1.0:
            (main, _), replacements, main_is_copy = replacements[0], [], True
        streams = [stream(main)] + [stream(n) for n, _ in replacements]
        cache: dict[int, torch.Tensor] = {}
        at = start
        for pieces in aligned(streams):
            first = pieces[0]
            if main_is_copy:
                finite_or_raise(first, main, _source_url(source, main))
            if not factors and not replacements:
                yield first
                at += first.numel()
                continue
            out = first.to(torch.float32, copy=True)
            for (name, weight), piece in zip(replacements, pieces[1:]):
                finite_or_raise(piece, name, _source_url(source, name))
                out.add_(piece.to(torch.float32) - first.to(torch.float32), alpha=weight)
            if factors:
                self._add_delta(out, factors, at, cache)
            at += first.numel()
            yield out


@dataclass(frozen=True)
class CheckedCopy:
    """A tensor copied as stored, refusing NaN / Inf (adapter factors and trained copies)."""

    name: str

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.name,)

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        for chunk in source.iter_chunks(self.name, max_bytes):
            finite_or_raise(chunk, self.name, _source_url(source, self.name))
            yield chunk


@dataclass(frozen=True)
class WeightedAdapter:
    """One adapter of a fusion or combination: its namespace in the source and its weight."""

    namespace: str | None
    adapter: Adapter
    weight: float = 1.0


def tensor_updates(inputs: Sequence[WeightedAdapter]) -> tuple[dict[str, list[LoraTerm]],
                                                               dict[str, list[tuple[str, float]]]]:
    """Per Hugging Face tensor name: its LoRA terms and its weighted replacements."""
    terms: dict[str, list[LoraTerm]] = {}
    replacements: dict[str, list[tuple[str, float]]] = {}
    for item in inputs:
        for module in item.adapter.modules.values():
            terms.setdefault(module.weight_name, []).append(LoraTerm(
                qualified(item.namespace, module.a), qualified(item.namespace, module.b),
                item.weight * module.scale, module.transposed, f"{module.module} in {item.adapter.url}"))
        for name, expert in item.adapter.experts.items():
            terms.setdefault(name, []).append(LoraTerm(
                qualified(item.namespace, expert.a), qualified(item.namespace, expert.b), item.weight * expert.scale,
                False, f"{name} in {item.adapter.url}", expert.num_experts))
        for name, key in item.adapter.overrides.items():
            replacements.setdefault(name, []).append((qualified(item.namespace, key), item.weight))
    return terms, replacements


def check_untied_targets(touched: Sequence[str], config: Mapping[str, Any], where: str | None) -> None:
    """With tied embeddings, an update of the embedding or lm_head cannot be expressed (PEFT applies
    it to one use of the shared matrix only): `AdapterError`."""
    if not embeddings_tied(config, model_ties(config)):
        return
    shared = [name for name in touched if name.endswith(EMBED_SUFFIXES) or name == LM_HEAD]
    if shared:
        raise AdapterError(f"the adapter changes {shared[0]} but the model ties its embeddings: the fused model "
                           "cannot be expressed with tied weights", where)


def plan_fused_model(base_metas: Mapping[str, TensorMeta], config: Mapping[str, Any],
                     inputs: Sequence[WeightedAdapter], *, max_shard_size: int | None,
                     base_url: str | None = None, base_names: Mapping[str, str] | None = None,
                     tie_flag: bool | None = None) -> MergePlan:
    """The base model's plan with every updated tensor built by `UpdatedTensor`.

    Source names: ``base_names[name]`` (default ``base::<name>``) for the base,
    ``<namespace>::<key>`` for each adapter. Checks each adapter against the base first
    (`check_fits_base`).
    """
    inputs = [dataclasses.replace(item, adapter=with_base(item.adapter, base_metas, base_url)) for item in inputs]
    for item in inputs:
        check_fits_base(item.adapter, base_metas, base_url)
    terms, replacements = tensor_updates(inputs)
    touched = sorted(set(terms) | set(replacements))
    check_untied_targets(touched, config, inputs[0].adapter.url if inputs else None)
    plan = plan_hf_merge(base_metas, config, max_shard_size=max_shard_size, tie_flag=tie_flag,
                         config_url=base_url)

    def source_name(name: str) -> str:
        return base_names[name] if base_names is not None else qualified(BASE_NAMESPACE, name)

    planned = plan.by_name()
    dropped = [name for name in touched if name not in planned]
    if dropped:
        raise AdapterError(f"the adapter changes {dropped[0]}, which the fused model does not write", base_url)
    tensors = []
    for tensor in plan.tensors:
        build = None
        if tensor.name in terms or tensor.name in replacements:
            build = UpdatedTensor(source_name(tensor.name), tensor.shape,
                                  tuple(replacements.get(tensor.name, ())), tuple(terms.get(tensor.name, ())))
        tensors.append(dataclasses.replace(tensor, source_name=source_name(tensor.name), build=build))
    notes = plan.notes + (f"LoRA: {sum(len(v) for v in terms.values())} updates on {len(terms)} weights, "
                          f"{len(replacements)} tensors replaced",)
    return MergePlan(tuple(tensors), plan.shards, plan.config_updates, notes)
