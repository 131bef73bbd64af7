"""Megatron <-> Hugging Face name tables, one declarative module per model family.

`table_for_config(config, custom_mapping)` picks the family from ``config.json`` (``model_type``,
then ``architectures``), extended by a ``--custom-mapping`` JSON file when one is given;
`model_dims(config, table)` reads the sizes the mappings need. An unknown family raises
`UnknownArchitecture` listing the supported ones and how to add another.

Adding a family is one file: ``merge_engine/architectures/families/<family>.py`` with a ``TABLE`` (copy
``families/qwen2.py``: a dict of 1:1 names plus the special mappings). The families are found by listing
that package (as storage backends are), and ``tests/merge_engine/architectures/test_tables.py`` runs every
family it finds against transformers' own model (a Llama-shaped family with the tiny default config; give
another shape its config there).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from merge_engine.architectures import families as _families_package
from merge_engine.architectures.lookup import find_table
from merge_engine.errors import InvalidConfig, UnknownArchitecture
from merge_engine.formats.hf_metadata import tie_word_embeddings

if TYPE_CHECKING:  # the mappings import torch; the package itself does not (layouts import its name modules)
    from merge_engine.architectures.mappings import FamilyTable, ModelDims

FAMILY_MODULES: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(_families_package.__path__)))
"""Every module of `merge_engine.architectures.families` (listed, not imported: each table imports torch)."""

HOW_TO_ADD = ("to add one, write merge_engine/architectures/families/<family>.py with a TABLE (a dict of 1:1 names "
              "plus special mappings; see families/qwen2.py), or pass --custom-mapping FILE.json "
              "({\"extends\": \"llama\", \"model_types\": [\"<model_type>\"], \"direct\": {...}})")


def family_tables() -> dict[str, FamilyTable]:
    """Every built-in table by family name, in `FAMILY_MODULES` order."""
    tables = {}
    for name in FAMILY_MODULES:
        table = importlib.import_module(f"{_families_package.__name__}.{name}").TABLE
        tables[table.name] = table
    return tables


def table_for_config(config: Mapping[str, Any], custom_mapping: str | None = None) -> FamilyTable:
    """The family table for ``config`` (see module docstring); raises `UnknownArchitecture`."""
    tables = family_tables()
    if custom_mapping is not None:
        from merge_engine.architectures.custom import load_custom_mapping

        custom = load_custom_mapping(custom_mapping, tables, config)
        tables = {custom.name: custom, **{k: v for k, v in tables.items() if k != custom.name}}
    table = find_table(config, tables)
    if table is None:
        described = config.get("model_type") or "?"
        if config.get("architectures"):
            described += f" ({', '.join(config['architectures'])})"
        raise UnknownArchitecture(f"no Megatron name table for model_type {described}; supported families: "
                                  f"{', '.join(family_tables())}; {HOW_TO_ADD}")
    return table


def model_dims(config: Mapping[str, Any], table: FamilyTable, *, tied: bool | None = None,
               padded_vocab_size: int | None = None) -> ModelDims:
    """Sizes from ``config.json`` (text config of a multimodal config); `InvalidConfig` if one is missing."""
    scope = config.get("text_config") or config
    try:
        hidden = int(scope["hidden_size"])
        heads = int(scope["num_attention_heads"])
        kv_heads = int(scope.get("num_key_value_heads") or heads)
        head_dim = int(scope.get("head_dim") or hidden // heads)
        vocab = int(scope["vocab_size"])
        layers = int(scope["num_hidden_layers"])
        vision_layers = int((config.get("vision_config") or {}).get("depth") or 0)
        experts = next((int(scope[k]) for k in table.experts_keys if scope.get(k)), 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidConfig(f"config.json lacks a size the {table.name} table needs ({exc})") from None
    from merge_engine.architectures.mappings import ModelDims

    return ModelDims(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                     num_layers=layers, tied=tie_word_embeddings(config) if tied is None else tied,
                     num_experts=experts, moe_layers=table.moe_layers(scope) if experts else frozenset(),
                     padded_vocab_size=padded_vocab_size,
                     vision_layers=vision_layers)


__all__ = ["FAMILY_MODULES", "family_tables", "find_table", "model_dims",
           "table_for_config"]
