"""Bind tensor names to a family table's mappings, strictly, in either direction.

A *binding* is one use of a mapping: the mapping plus the numbers its ``*`` stand for (layer,
expert), with the concrete names on both sides. Strict rules (`MappingError` naming the tensor):

- every input tensor is claimed by exactly one mapping (unmapped or claimed twice: error);
- a mapping needing several inputs (q, k, v) finds all of them;
- no output name is produced twice;
- every output the config implies (layers x experts x mappings that apply) is produced, and
  nothing beyond it (a layer the config does not have).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from merge_engine.architectures.mappings import (
    FamilyTable,
    ModelDims,
    ParamMapping,
    VocabMapping,
    compile_pattern,
    fill,
    scope_of,
)
from merge_engine.errors import MappingError

# Hugging Face entries that are not weights of the model (recomputed buffers some exports keep).
HF_NON_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Binding:
    """One mapping applied at one (layer[, expert]): its Megatron name and its Hugging Face names."""

    mapping: ParamMapping
    numbers: tuple[int, ...]
    megatron: str
    hf: tuple[str, ...]


def _binding(mapping: ParamMapping, numbers: tuple[int, ...]) -> Binding:
    return Binding(mapping, numbers, fill(mapping.megatron, numbers), tuple(fill(h, numbers) for h in mapping.hf))


def is_tied_head(mapping: ParamMapping, dims: ModelDims) -> bool:
    return isinstance(mapping, VocabMapping) and mapping.head and dims.tied


def bind_megatron(names: Iterable[str], table: FamilyTable, config: Mapping[str, Any]) -> list[Binding]:
    """Megatron names (in order) -> one binding each; raises on an unmapped or doubly mapped name,
    or a tensor whose mapping the config switches off (``requires``)."""
    mappings = table.mappings()
    bindings, unmapped = [], []
    for name in names:
        found = [(m, match) for m in mappings if (match := compile_pattern(m.megatron).match(name))]
        if not found:
            unmapped.append(name)
            continue
        if len(found) > 1:
            raise MappingError(f"{name!r} is claimed by two entries of the {table.name} table "
                               f"({found[0][0].megatron!r} and {found[1][0].megatron!r})")
        mapping, match = found[0]
        if not mapping.applies(config):
            raise MappingError(f"{name!r} is in the checkpoint but config.json has {mapping.requires} off; "
                               "the config does not describe these weights")
        bindings.append(_binding(mapping, tuple(int(g) for g in match.groups())))
    if unmapped:
        raise MappingError(f"{len(unmapped)} Megatron tensor(s) not in the {table.name} table, e.g. {unmapped[0]!r} "
                           f"(all: {unmapped[:6]}); extend the table with --custom-mapping")
    return bindings


def bind_hf(names: Iterable[str], table: FamilyTable, config: Mapping[str, Any], dims: ModelDims
            ) -> tuple[list[Binding], list[str]]:
    """Hugging Face names -> bindings (each with all its inputs) + the names left for the caller:
    a tied ``lm_head`` (the caller checks it equals the embedding). Raises on anything unmapped."""
    mappings = table.mappings()
    groups: dict[tuple[int, tuple[int, ...]], dict[int, str]] = {}
    order: list[tuple[int, tuple[int, ...]]] = []
    unmapped, tied_heads = [], []
    for name in names:
        if HF_NON_WEIGHTS.search(name):
            continue
        found = [(i, role, match) for i, m in enumerate(mappings) for role, pattern in enumerate(m.hf)
                 if (match := compile_pattern(pattern).match(name))]
        if not found:
            unmapped.append(name)
            continue
        if len(found) > 1:
            a, b = mappings[found[0][0]], mappings[found[1][0]]
            raise MappingError(f"{name!r} is claimed by two entries of the {table.name} table "
                               f"({a.megatron!r} and {b.megatron!r})")
        index, role, match = found[0]
        if is_tied_head(mappings[index], dims):
            tied_heads.append(name)
            continue
        key = (index, tuple(int(g) for g in match.groups()))
        if key not in groups:
            groups[key] = {}
            order.append(key)
        groups[key][role] = name
    if unmapped:
        raise MappingError(f"{len(unmapped)} Hugging Face tensor(s) not in the {table.name} table, e.g. "
                           f"{unmapped[0]!r} (all: {unmapped[:6]}); extend the table with --custom-mapping")
    bindings = []
    for index, numbers in order:
        mapping, roles = mappings[index], groups[(index, numbers)]
        binding = _binding(mapping, numbers)
        missing = [h for role, h in enumerate(binding.hf) if role not in roles]
        if missing:
            raise MappingError(f"{missing[0]!r} is missing: {binding.megatron!r} needs all of {list(binding.hf)}")
        if not mapping.applies(config):
            raise MappingError(f"{binding.hf[0]!r} is in the model but config.json has {mapping.requires} off")
        bindings.append(binding)
    return bindings, tied_heads


def expected_bindings(table: FamilyTable, config: Mapping[str, Any], dims: ModelDims) -> list[Binding]:
    """Every binding the config implies: mappings that apply x their layers (x experts)."""
    out = []
    for mapping in table.mappings():
        if not mapping.applies(config) or is_tied_head(mapping, dims):
            continue
        scope = scope_of(mapping.megatron)
        if scope == "global":
            out.append(_binding(mapping, ()))
        elif scope == "experts":
            out += [_binding(mapping, (layer, e)) for layer in dims.layers_in_scope(scope)
                    for e in range(dims.num_experts)]
        else:
            out += [_binding(mapping, (layer,)) for layer in dims.layers_in_scope(scope)]
    return out


def check_coverage(found: Iterable[Binding], expected: Iterable[Binding], direction: str) -> None:
    """Strictness of the output side: each expected binding found once, nothing unexpected.

    ``direction`` is ``"megatron_to_hf"`` or ``"hf_to_megatron"`` (it picks the names in messages).
    """
    to_hf = direction == "megatron_to_hf"
    seen: dict[str, Binding] = {}
    for binding in found:
        for out in (binding.hf if to_hf else (binding.megatron,)):
            if out in seen:
                raise MappingError(f"{out!r} would be produced twice (from {seen[out].megatron!r} and "
                                   f"{binding.megatron!r})")
            seen[out] = binding
    wanted = {}
    for binding in expected:
        for out in (binding.hf if to_hf else (binding.megatron,)):
            wanted[out] = binding
    missing = [name for name in wanted if name not in seen]
    if missing:
        source = wanted[missing[0]].megatron if to_hf else ", ".join(wanted[missing[0]].hf)
        raise MappingError(f"{missing[0]!r} is not produced: the config implies it, but the input has no {source!r}"
                           f" ({len(missing)} missing in all)")
    extra = [name for name in seen if name not in wanted]
    if extra:
        source = seen[extra[0]].megatron if to_hf else ", ".join(seen[extra[0]].hf)
        raise MappingError(f"{extra[0]!r} (from {source!r}) is beyond what config.json describes "
                           "(more layers or experts than the config has?)")
