"""``--custom-mapping FILE.json``: extend a family table (or teach stepmerge a new model_type).

The file is JSON::

    {
      "extends": "llama",                     # base table; default: the family config.json resolves to
      "name": "my_llama",                     # optional name of the result
      "model_types": ["my_llama"],            # config model_type values it serves (added)
      "architectures": ["MyLlamaForCausalLM"],
      "direct": {"megatron.pattern.*": "hf.pattern.*"},           # 1:1 names, added or replacing
      "qkv": [{"megatron": "...", "q": "...", "k": "...", "v": "...", "requires": "attention_bias"}],
      "gated_mlp": [{"megatron": "...", "gate": "...", "up": "..."}],
      "vocab": [{"megatron": "...", "hf": "...", "head": false}],
      "experts_keys": ["num_experts"],
      "moe_layer_rule": "first_k_dense",      # which layers are MoE: all | qwen | first_k_dense
      "dense_layers": [0, 1]                  # layers with a dense MLP whatever the rule says
    }

Mixed dense / MoE models the built-in tables do not know are expressed with ``moe_layer_rule``
and ``dense_layers``: the dense layers then map through the dense MLP entries, the others through
the expert entries (every layer's tensors are checked against that split).

An entry whose Megatron pattern is already in the base table replaces the base entry. Every
pattern must use the same number of ``*`` on both sides. Errors: `InvalidOption` naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from merge_engine.architectures.lookup import find_table
from merge_engine.architectures.mappings import (
    DirectMapping,
    MOE_LAYER_RULES,
    FamilyTable,
    GatedMLPMapping,
    ParamMapping,
    QKVMapping,
    VocabMapping,
)
from merge_engine.errors import InvalidOption
from merge_engine.formats.json_file import read_json_object

KEYS = {"extends", "name", "model_types", "architectures", "direct", "qkv", "gated_mlp", "vocab", "experts_keys",
        "moe_layer_rule", "dense_layers"}


def load_custom_mapping(url: str, tables: Mapping[str, FamilyTable], config: Mapping[str, Any]) -> FamilyTable:
    """The table of ``tables`` the file extends, with the file's entries applied."""
    spec = read_json_object(url, error=InvalidOption)
    if spec is None:
        raise InvalidOption("custom mapping file not found", url)
    unknown = sorted(set(spec) - KEYS)
    if unknown:
        raise InvalidOption(f"unknown keys {unknown} in custom mapping; known: {sorted(KEYS)}", url)
    base = _base_table(spec, tables, config, url)
    try:
        added: list[ParamMapping] = [DirectMapping(m, hf_name=h) for m, h in dict(spec.get("direct") or {}).items()]
        added += [QKVMapping(e["megatron"], q=e["q"], k=e["k"], v=e["v"], requires=e.get("requires"))
                  for e in spec.get("qkv") or ()]
        added += [GatedMLPMapping(e["megatron"], gate=e["gate"], up=e["up"], requires=e.get("requires"))
                  for e in spec.get("gated_mlp") or ()]
        added += [VocabMapping(e["megatron"], hf_name=e["hf"], head=bool(e.get("head", False)))
                  for e in spec.get("vocab") or ()]
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidOption(f"custom mapping entry lacks a field ({exc})", url) from None
    for mapping in added:
        stars = mapping.megatron.count("*")
        bad = [h for h in mapping.hf if not isinstance(h, str) or h.count("*") != stars]
        if not isinstance(mapping.megatron, str) or bad:
            raise InvalidOption(f"custom mapping {mapping.megatron!r}: every name needs the same number of '*' "
                                f"({stars}) on both sides; check {bad}", url)
    rule = spec.get("moe_layer_rule", base.moe_layer_rule)
    if rule not in MOE_LAYER_RULES:
        raise InvalidOption(f"custom mapping moe_layer_rule {rule!r}; known: {sorted(MOE_LAYER_RULES)}", url)
    dense = spec.get("dense_layers", list(base.dense_layers))
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in dense):
        raise InvalidOption(f"custom mapping dense_layers must be a list of layer numbers, got {dense!r}", url)
    replaced = {m.megatron for m in added}
    kept = [m for m in base.mappings() if m.megatron not in replaced]
    merged = kept + added
    direct = {m.megatron: m.hf_name for m in merged if type(m) is DirectMapping}
    special = tuple(m for m in merged if type(m) is not DirectMapping)
    return base.extended(
        name=str(spec.get("name") or base.name),
        model_types=tuple(base.model_types) + tuple(spec.get("model_types") or ()),
        architectures=tuple(base.architectures) + tuple(spec.get("architectures") or ()),
        direct=direct, special=special,
        experts_keys=tuple(spec.get("experts_keys") or base.experts_keys),
        moe_layer_rule=rule, dense_layers=tuple(sorted(set(dense))))


def _base_table(spec: Mapping[str, Any], tables: Mapping[str, FamilyTable], config: Mapping[str, Any],
                url: str) -> FamilyTable:
    name = spec.get("extends")
    if name is not None:
        if name not in tables:
            raise InvalidOption(f"custom mapping extends {name!r}; known families: {', '.join(tables)}", url)
        return tables[name]
    table = find_table(config, tables)
    if table is None:
        raise InvalidOption("custom mapping names no \"extends\" family and config.json's model_type has no "
                            f"table; add \"extends\": one of {', '.join(tables)}", url)
    return table
