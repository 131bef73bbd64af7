"""Hugging Face -> canonical Megatron tensors: the split's view of a Hugging Face model.

`MegatronViewOfHf` is a `TensorSource` whose names are canonical Megatron names (see
`megatron_names`) and whose values are computed on demand from the Hugging Face tensors with the
family table's inverse mappings (`to_megatron`): QKV merged per query group, gate/up fused,
vocabulary padded with zero rows to ``dims.padded_vocab_size``. Strict like the merge: every
Hugging Face tensor is used once (a tied ``lm_head`` copy is checked equal to the embedding by
`check_tied_copies`), and every tensor the config implies is produced.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from merge_engine.architectures.binding import Binding, bind_hf, check_coverage, expected_bindings
from merge_engine.architectures.mappings import FamilyTable, GatedMLPMapping, ModelDims
from merge_engine.architectures.megatron_names import order_key
from merge_engine.formats.chunks import flat_slices
from merge_engine.errors import MappingError
from merge_engine.plan.output_heads import check_tied_copy
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorMeta, TensorSource

EMBEDDING = "embedding.word_embeddings.weight"


class MegatronViewOfHf:
    """Canonical Megatron tensors computed from a Hugging Face `TensorSource` (read lazily)."""

    def __init__(self, hf: TensorSource, table: FamilyTable, config: Mapping[str, Any], dims: ModelDims) -> None:
        self.url = hf.url
        self.hf = hf
        self.dims = dims
        self.megatron_prefix = table.megatron_prefix  # where the writer puts the language model
        hf_metas = hf.metas()
        bindings, self.tied_copies = bind_hf(hf_metas, table, config, dims)
        check_coverage(bindings, expected_bindings(table, config, dims), "hf_to_megatron")
        self._bindings: dict[str, Binding] = {}
        metas = {}
        for binding in sorted(bindings, key=lambda b: order_key(b.megatron)):
            inputs = [hf_metas[h] for h in binding.hf]
            dtypes = {m.dtype for m in inputs}
            if len(dtypes) > 1:
                raise MappingError(f"{binding.megatron} would fuse tensors of different dtypes {sorted(map(str, dtypes))}")
            try:
                shape = binding.mapping.megatron_shape(tuple(m.shape for m in inputs), dims)
            except ValueError as exc:
                raise MappingError(f"{binding.megatron}: {exc}") from None
            self._bindings[binding.megatron] = binding
            metas[binding.megatron] = TensorMeta(binding.megatron, tuple(shape), inputs[0].dtype)
        self._metas = metas

    def metas(self) -> Mapping[str, TensorMeta]:
        return self._metas

    def binding(self, name: str) -> Binding:
        """The mapping (and Hugging Face names) that builds the Megatron tensor ``name``."""
        return self._bindings[name]

    def gated(self, name: str) -> bool:
        """Is the Megatron tensor ``name`` a gated MLP's fused ``linear_fc1`` (gate rows, then up rows)?"""
        return isinstance(self._bindings[name].mapping, GatedMLPMapping)

    def read(self, name: str) -> torch.Tensor:
        binding = self._bindings[name]
        tensors = tuple(self.hf.read(h) for h in binding.hf)
        try:
            out = binding.mapping.to_megatron(tensors, self.dims)
        except ValueError as exc:
            raise MappingError(f"{name}: {exc}") from None
        if tuple(out.shape) != self._metas[name].shape:
            raise MappingError(f"{name}: built {tuple(out.shape)}, planned {self._metas[name].shape}")
        return out.contiguous()

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        yield from flat_slices(self.read(name), max_bytes)

    def check_tied_copies(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        """A stored ``lm_head`` of a tied model must equal the embedding: the tied rule of
        `merge_engine.plan.output_heads` (`InvalidConfig` when config.json lies about tying)."""
        if not self.tied_copies:
            return
        embed = self._bindings[EMBEDDING].hf[0]
        for head in self.tied_copies:
            check_tied_copy(self.hf, head, embed, chunk_bytes)

    def close(self) -> None:
        self.hf.close()
