"""Plan a Megatron -> Hugging Face merge from metadata: names, shapes and how each output is built.

`plan_megatron_to_hf(source, config, table=...)` binds the source's canonical Megatron names to
the family table (strictly: see `binding`), then emits one `PlannedTensor` per Hugging Face
tensor, in model order. Builders:

- a 1:1 mapping copies its source (streamed; ``build=None``);
- the embedding / output layer stream their first ``vocab_size`` rows (`LeadingRows`): the padding
  is never read. With tied embeddings a stored ``output_layer`` copy (PP > 1) is compared with the
  embedding row for row while streaming, and not written;
- a one-row ``output_layer`` is verl's critic value head: it becomes ``score.weight`` of a
  token-classification model (as FSDP critics do);
- fused tensors (QKV, gate/up) read one layer's fused tensor once (`FusedPart` with a one-entry
  cache shared by the parts), split it, and hand each part to its output.
Memory: one layer's fused tensor, or a few streamed chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from merge_engine.architectures.binding import (
    bind_megatron,
    check_coverage,
    expected_bindings,
    is_tied_head,
)
from merge_engine.architectures.mappings import (
    DirectMapping,
    FamilyTable,
    ModelDims,
    ParamMapping,
    VocabMapping,
)
from merge_engine.architectures.mtp import CONFIG_KEY as MTP_CONFIG_KEY
from merge_engine.architectures.mtp import mtp_view
from merge_engine.formats.chunks import aligned_chunks, flat_slices
from merge_engine.errors import MappingError
from merge_engine.plan.merge_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    MergePlan,
    PlannedTensor,
    assign_shards,
    stored_dtype_update,
)
from merge_engine.plan.output_heads import CRITIC_HEAD, check_tie_flag, critic_config, is_critic, tied_copy_error
from merge_engine.formats.tensor_source import TensorSource

OUTPUT_LAYER = "output_layer.weight"
MTP_CONFIG_ALIASES = ("num_mtp_layers",)  # other config keys counting MTP layers (transformers v5's GLM)


class FusedCache:
    """One fused tensor, read and split once, shared by the builders of its parts.

    The parts are dropped as soon as each has been handed out once (`done`), so a plan holds
    no tensor: memory is one layer's fused tensor while its parts are written.
    """

    def __init__(self) -> None:
        self._key: tuple[int, str] | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken: set[int] = set()

    def parts(self, source: TensorSource, name: str, split) -> tuple[torch.Tensor, ...]:
        key = (id(source), name)
        if key != self._key:
            self._key, self._parts, self._taken = None, (), set()
            self._parts = tuple(split(source.read(name)))
            self._key = key
        return self._parts

    def done(self, part: int) -> None:
        self._taken.add(part)
        if len(self._taken) >= len(self._parts):
            self._key, self._parts, self._taken = None, (), set()


@dataclass(frozen=True)
class FusedPart:
    """Part ``part`` of a fused Megatron tensor split by ``mapping.to_hf``."""

    source_name: str
    mapping: ParamMapping
    dims: ModelDims
    part: int
    cache: FusedCache = field(compare=False, repr=False)

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source_name,)

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        parts = self.cache.parts(source, self.source_name, lambda t: self.mapping.to_hf(t, self.dims))
        part = parts[self.part]
        del parts
        self.cache.done(self.part)
        yield from flat_slices(part, max_bytes)


@dataclass(frozen=True)
class LeadingRows:
    """The first ``rows`` rows of a (vocabulary) tensor, streamed; ``same_as``: a tensor whose first
    ``rows`` rows must be equal (tied copy), compared while streaming (the tied rule of
    `merge_engine.plan.output_heads`: `InvalidConfig` if not)."""

    source_name: str
    rows: int
    row_numel: int
    same_as: str | None = None

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source_name,) + ((self.same_as,) if self.same_as else ())

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]:
        remaining = self.rows * self.row_numel
        if remaining <= 0:
            return
        stream = source.iter_chunks(self.source_name, max_bytes)
        same_as = self.same_as
        if same_as is None:
            pieces: Iterator[tuple[torch.Tensor, ...]] = ((chunk,) for chunk in stream)
        else:
            def size_error(message: str) -> Exception:
                return tied_copy_error(same_as, self.source_name, source.url, f"sizes differ: {message}")

            pieces = aligned_chunks(stream, source.iter_chunks(same_as, max_bytes), error=size_error)
        for chunk, *copy in pieces:
            chunk = chunk[:remaining]
            remaining -= chunk.numel()
            if copy and same_as is not None and not torch.equal(copy[0][:chunk.numel()], chunk):
                raise tied_copy_error(same_as, self.source_name, source.url)
            yield chunk
            if remaining <= 0:
                return  # the padding rows after vocab_size are never read


def plan_megatron_to_hf(source: TensorSource, config: Mapping[str, Any], *, table: FamilyTable, dims: ModelDims,
                        max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
                        tie_flag: bool | None = None, config_url: str | None = None,
                        mtp_layers: str | None = None) -> MergePlan:
    """The merge plan of a canonical Megatron source (see module docstring); metadata only.

    ``mtp_layers``: ``export`` or ``drop`` the multi-token-prediction layers (`merge_engine.architectures.mtp`);
    None refuses a checkpoint that has some. Raises `MappingError` (strictness), `InvalidOption`
    (``tie_flag`` contradicts the config).
    """
    check_tie_flag(tie_flag, dims.tied, config_url)
    metas_all = source.metas()
    view = mtp_view(metas_all, dims, mtp_layers)
    metas, reads = view.metas, view.reads
    dims = view.dims or dims
    updates: dict[str, Any] = dict(view.config_updates)
    for key in MTP_CONFIG_ALIASES:  # transformers v5 names GLM's count num_mtp_layers; keep both honest
        if key in config and MTP_CONFIG_KEY in updates:
            updates[key] = updates[MTP_CONFIG_KEY]
    head = metas.get(OUTPUT_LAYER)
    if head is not None and is_critic(head.shape[0], dims.vocab_size):
        # verl's Megatron critic: a one-row value head, not a vocabulary projection
        table = table.extended(special=tuple(
            DirectMapping(m.megatron, hf_name=CRITIC_HEAD) if isinstance(m, VocabMapping) and m.head else m
            for m in table.special))
        dims = replace(dims, tied=False)
        updates.update(critic_config(config, head), tie_word_embeddings=False)
    bindings = bind_megatron(metas, table, config)
    tied_copy = next((b.megatron for b in bindings if is_tied_head(b.mapping, dims)), None)
    produced = [b for b in bindings if not is_tied_head(b.mapping, dims)]
    check_coverage(produced, expected_bindings(table, config, dims), "megatron_to_hf")
    tensors: list[PlannedTensor] = []
    notes: list[str] = list(view.notes)
    for binding in produced:
        meta = metas[binding.megatron]
        binding = replace(binding, megatron=reads.get(binding.megatron, binding.megatron))  # the source's name
        mapping = binding.mapping
        try:
            shapes = mapping.hf_shapes(meta.shape, dims)
        except ValueError as exc:
            raise MappingError(f"{binding.megatron} {meta.shape}: {exc}") from None
        if isinstance(mapping, DirectMapping):
            tensors.append(PlannedTensor(binding.hf[0], shapes[0], meta.dtype, binding.megatron))
        elif isinstance(mapping, VocabMapping):
            same_as = tied_copy if not mapping.head else None
            rows = shapes[0][0]
            build = LeadingRows(binding.megatron, rows, int(torch.Size(shapes[0][1:]).numel()), same_as)
            tensors.append(PlannedTensor(binding.hf[0], shapes[0], meta.dtype, binding.megatron, build))
            if meta.shape[0] != rows:
                notes.append(f"{binding.megatron}: {meta.shape[0] - rows} padding rows dropped "
                             f"({meta.shape[0]} -> vocab_size {rows})")
        else:
            cache = FusedCache()
            for part, (name, shape) in enumerate(zip(binding.hf, shapes)):
                tensors.append(PlannedTensor(name, shape, meta.dtype, binding.megatron,
                                             FusedPart(binding.megatron, mapping, dims, part, cache)))
    for hf_name, source_name in view.own:  # MTP-only tensors, as they are
        meta = metas_all[source_name]
        tensors.append(PlannedTensor(hf_name, meta.shape, meta.dtype, source_name))
    for hf_name, source_name in view.copies:  # the MTP layer's own embedding / head copies
        meta = metas_all[source_name]
        leading = (dims.vocab_size, *meta.shape[1:])
        tensors.append(PlannedTensor(hf_name, leading, meta.dtype, source_name,
                                     LeadingRows(source_name, dims.vocab_size, int(torch.Size(meta.shape[1:]).numel()))))
    if tied_copy is not None:
        notes.append(f"tied embeddings: {tied_copy} checked equal to the embedding, not written")
    if CRITIC_HEAD in {t.name for t in tensors}:
        notes.append(f"critic: {OUTPUT_LAYER} (one row) -> {CRITIC_HEAD}, a token-classification model")
    updates.update(stored_dtype_update(tensors, None))
    return MergePlan(tuple(tensors), assign_shards(tensors, max_shard_size), updates, tuple(notes))


def plan_megatron_merge(source: TensorSource, config: Mapping[str, Any], *,
                        max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE, tie_flag: bool | None = None,
                        custom_mapping: str | None = None, config_url: str | None = None,
                        mtp_layers: str | None = None) -> MergePlan:
    """The layouts' ``plan`` hook: family table from the config (+ custom mapping), then the plan.

    A source that records its parallel sizes (``source.parallel``) is first checked against the
    config: a tensor-parallel piece count that cannot give the config's shapes is a
    `WorldSizeMismatch` (a TP rank folder missing), not a shape puzzle later.
    """
    from merge_engine.architectures import model_dims, table_for_config

    table = table_for_config(config, custom_mapping)
    dims = model_dims(config, table)
    _check_tensor_parallel(source, dims)
    return plan_megatron_to_hf(source, config, table=table, dims=dims, max_shard_size=max_shard_size,
                               tie_flag=tie_flag, config_url=config_url, mtp_layers=mtp_layers)


def _check_tensor_parallel(source: TensorSource, dims: ModelDims) -> None:
    from merge_engine.errors import WorldSizeMismatch

    parallel = getattr(source, "parallel", None) or {}
    meta = source.metas().get("decoder.layers.0.self_attention.linear_qkv.weight")
    if "tp" not in parallel or meta is None:
        return
    expected = (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim
    rows = meta.shape[0]
    if rows != expected and rows and expected % rows == 0:
        raise WorldSizeMismatch(f"linear_qkv holds {rows} of the {expected} rows config.json implies: the rank "
                                f"folders give TP={parallel['tp']}, the weights need TP={parallel['tp'] * expected // rows}"
                                " (tensor-parallel rank folders missing?)", source.url)
