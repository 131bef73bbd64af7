"""A Megatron-Bridge LoRA adapter under PEFT's Hugging Face names, exactly, through the family tables.

Megatron-Bridge wraps a Megatron linear ``M`` with a ``ParallelLinearAdapter``: ``M.adapter.linear_in``
(A, ``[r, in]``) and ``M.adapter.linear_out`` (B, ``[out_M, r]``), output ``(alpha / r) * B @ A @ x``.
In a torch_dist checkpoint both are GLOBAL tensors (TP / PP / EP cuts are resolved by the DCP chunk
offsets; SwiGLU ``linear_fc1``'s B is stored [all gate rows; all up rows] like its weight, through
megatron-core's swiglu factory), so the conversion is the weight's own:

- A is the same for every Hugging Face part of ``M`` (Megatron-Bridge's export duplicates it);
- B's rows are cut like ``M.weight``'s rows by the table mapping whose Megatron name is
  ``M.weight``: QKV groups -> q, k, v; gate / up halves; 1:1 for ``linear_proj`` / ``linear_fc2``;
- grouped experts (``mlp.experts.linear_fc1``, factors ``[experts, ...]``: the expert axis
  Megatron-Bridge exposes) become one module per expert (``mlp.experts.local_experts.E.linear_fc1``)
  before the table applies; per-expert modules (SequentialMLP) are used as they are.

`MegatronAdapterSource` is the result as a `TensorSource` named as in ``adapter_model.safetensors``
(``base_model.model.<hf module>.lora_A.weight``); `adapter_ranks` gives each Hugging Face module's r.
An adapter module the table does not map, or factors whose shapes disagree, raise `AdapterError`.
Memory: one Megatron module's factors at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from merge_engine.architectures.mappings import FamilyTable, ModelDims, ParamMapping, compile_pattern, fill
from merge_engine.errors import AdapterError
from merge_engine.lora.keys import PEFT_PREFIX
from merge_engine.formats.chunks import flat_slices
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorMeta, TensorSource

ADAPTER_FACTOR = re.compile(r"^(?P<module>.+)\.adapter\.linear_(?P<side>in|out)\.weight$")
GROUPED_EXPERTS = re.compile(r"^(?P<layer>decoder\.layers\.[0-9]+)\.mlp\.experts\.(?:experts\.)?(?P<linear>linear_fc[12])$")


def is_adapter_factor(name: str) -> bool:
    return ADAPTER_FACTOR.match(name) is not None


@dataclass(frozen=True)
class MegatronLora:
    """One adapted Megatron module (per expert for grouped experts): where its factors are stored.
    ``expert``: the index into a grouped factor's leading expert axis (None: a 2-D factor)."""

    module: str
    linear_in: str
    linear_out: str
    expert: int | None
    mapping: ParamMapping
    hf_modules: tuple[str, ...]
    rank: int
    in_features: int
    out_shapes: tuple[tuple[int, ...], ...]


def _mapping_for(weight: str, table: FamilyTable) -> tuple[ParamMapping, tuple[int, ...]] | None:
    for mapping in table.mappings():
        match = compile_pattern(mapping.megatron).match(weight)
        if match:
            return mapping, tuple(int(g) for g in match.groups())
    return None


def megatron_loras(metas: Mapping[str, TensorMeta], table: FamilyTable, dims: ModelDims,
                   where: str | None) -> list[MegatronLora]:
    """Every adapted module of ``metas`` (canonical Megatron names), bound to the family table, from
    shapes alone; `AdapterError` for a half adapter, an unmapped module or inconsistent shapes."""
    pairs: dict[str, dict[str, str]] = {}
    for name in metas:
        match = ADAPTER_FACTOR.match(name)
        if match:
            pairs.setdefault(match.group("module"), {})[match.group("side")] = name
    out = []
    for module, sides in pairs.items():
        if set(sides) != {"in", "out"}:
            missing = "linear_out" if "in" in sides else "linear_in"
            raise AdapterError(f"{module}: the adapter has no {missing}", where)
        a_shape, b_shape = tuple(metas[sides["in"]].shape), tuple(metas[sides["out"]].shape)
        grouped = GROUPED_EXPERTS.match(module)
        if grouped:
            if len(a_shape) != 3 or len(b_shape) != 3 or a_shape[0] != b_shape[0]:
                raise AdapterError(f"{module}: grouped-expert factors {a_shape} / {b_shape} need a common leading "
                                   "expert axis", where)
            targets: list[tuple[str, int | None]] = [(f"{grouped.group('layer')}.mlp.experts.local_experts.{e}.{grouped.group('linear')}", e)
                       for e in range(a_shape[0])]
            a_shape, b_shape = a_shape[1:], b_shape[1:]
        else:
            targets = [(module, None)]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise AdapterError(f"{module}: linear_in {a_shape} and linear_out {b_shape} are not LoRA factors "
                               "[r, in] / [out, r]", where)
        for target, expert in targets:
            bound = _mapping_for(f"{target}.weight", table)
            if bound is None:
                raise AdapterError(f"{target}: adapted in Megatron, but the {table.name} table maps no "
                                   f"{target}.weight", where)
            mapping, numbers = bound
            try:
                out_shapes = tuple(tuple(s) for s in mapping.hf_shapes(b_shape, dims))
            except ValueError as exc:
                raise AdapterError(f"{target}: linear_out {b_shape} does not fit the config ({exc})", where) from None
            hf_modules = tuple(fill(h, numbers).removesuffix(".weight") for h in mapping.hf)
            out.append(MegatronLora(target, sides["in"], sides["out"], expert, mapping, hf_modules,
                                    a_shape[0], a_shape[1], out_shapes))
    return out


def lora_key(hf_module: str, factor: str) -> str:
    """The adapter file's key: ``base_model.model.<module>.lora_A.weight``."""
    return f"{PEFT_PREFIX}{hf_module}.{factor}.weight"


def adapter_ranks(loras: list[MegatronLora]) -> dict[str, int]:
    """Hugging Face module -> r."""
    return {hf: lora.rank for lora in loras for hf in lora.hf_modules}


class MegatronAdapterSource:
    """The adapter of a Megatron source under PEFT adapter-file names (see the module docstring).
    Closing closes the Megatron source."""

    def __init__(self, source: TensorSource, table: FamilyTable, dims: ModelDims, dtype: Any = None) -> None:
        self.url = source.url
        self._source = source
        self._dims = dims
        self.loras = megatron_loras(source.metas(), table, dims, source.url)
        metas = source.metas()
        self._where: dict[str, tuple[MegatronLora, str, int]] = {}
        self._metas: dict[str, TensorMeta] = {}
        for lora in self.loras:
            a_dtype, b_dtype = metas[lora.linear_in].dtype, metas[lora.linear_out].dtype
            for part, hf in enumerate(lora.hf_modules):
                a, b = lora_key(hf, "lora_A"), lora_key(hf, "lora_B")
                self._where[a], self._where[b] = (lora, "A", part), (lora, "B", part)
                self._metas[a] = TensorMeta(a, (lora.rank, lora.in_features), a_dtype)
                self._metas[b] = TensorMeta(b, lora.out_shapes[part], b_dtype)
        self._cache: tuple[str, int | None, tuple[torch.Tensor, ...]] | None = None

    def metas(self) -> Mapping[str, TensorMeta]:
        return self._metas

    def _factor(self, name: str, expert: int | None) -> torch.Tensor:
        tensor = self._source.read(name)
        return tensor[expert] if expert is not None else tensor

    def read(self, name: str) -> torch.Tensor:
        lora, factor, part = self._where[name]
        if factor == "A":
            return self._factor(lora.linear_in, lora.expert).clone()
        if self._cache is None or self._cache[:2] != (lora.linear_out, lora.expert):
            self._cache = (lora.linear_out, lora.expert,
                           tuple(lora.mapping.to_hf(self._factor(lora.linear_out, lora.expert), self._dims)))
        return self._cache[2][part].clone()

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        yield from flat_slices(self.read(name), max_bytes)

    def close(self) -> None:
        self._source.close()
