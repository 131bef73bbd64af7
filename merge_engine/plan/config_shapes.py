"""What ``config.json`` implies about the tensors, checked against a plan before anything is written.

The merge copies ``config.json`` next to weights it did not derive from it: a config that
contradicts them (``"vocab_size": 10**12`` beside a 1003-row embedding, 40 layers where 2 were
saved) gives a folder that loads with an error, or worse, with freshly initialised tensors. The
pipeline's validation catches that after the merge by instantiating the model; here the command
itself catches it from metadata, in microseconds and without transformers:

- `IMPLIED_SHAPES`: for the tensor names every Hugging Face decoder family shares (llama, qwen2/3,
  mistral, ...), the shape as a tuple of config quantities (`quantities`: ``vocab_size``,
  ``hidden_size``, ``intermediate_size``, attention rows from heads and ``head_dim``);
- the decoder layers present (``model.layers.N.``) must be exactly ``0 .. num_hidden_layers - 1``
  (plus ``num_nextn_predict_layers`` multi-token-prediction layers after them, when the config has some).

Attention rows are not checked for latent attention (DeepSeek's MLA: ``kv_lora_rank``, ...).

A name outside the table, or a quantity the config does not give, is not checked (MoE experts,
critic heads, custom code are left to validation). A quantity given with the wrong type, and every
contradiction, raises `InvalidConfig` naming the config file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from merge_engine.errors import InvalidConfig

LAYER = r"model\.layers\.\d+\."
# name (full match) -> shape, each dim a quantity of `quantities`
IMPLIED_SHAPES: dict[str, tuple[str, ...]] = {
    r"model\.embed_tokens\.weight": ("vocab_size", "hidden_size"),
    r"lm_head\.weight": ("vocab_size", "hidden_size"),
    r"model\.norm\.weight": ("hidden_size",),
    LAYER + r"input_layernorm\.weight": ("hidden_size",),
    LAYER + r"post_attention_layernorm\.weight": ("hidden_size",),
    LAYER + r"self_attn\.q_proj\.weight": ("q_rows", "hidden_size"),
    LAYER + r"self_attn\.k_proj\.weight": ("kv_rows", "hidden_size"),
    LAYER + r"self_attn\.v_proj\.weight": ("kv_rows", "hidden_size"),
    LAYER + r"self_attn\.o_proj\.weight": ("hidden_size", "q_rows"),
    LAYER + r"self_attn\.q_proj\.bias": ("q_rows",),
    LAYER + r"self_attn\.k_proj\.bias": ("kv_rows",),
    LAYER + r"self_attn\.v_proj\.bias": ("kv_rows",),
    LAYER + r"mlp\.gate_proj\.weight": ("intermediate_size", "hidden_size"),
    LAYER + r"mlp\.up_proj\.weight": ("intermediate_size", "hidden_size"),
    LAYER + r"mlp\.down_proj\.weight": ("hidden_size", "intermediate_size"),
}
_PATTERNS = [(re.compile(pattern), shape) for pattern, shape in IMPLIED_SHAPES.items()]
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
LATENT_ATTENTION_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")
_INTEGER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "num_hidden_layers")


def quantities(config: Mapping[str, Any], config_url: str | None = None) -> dict[str, int]:
    """The config's sizes, and the attention rows they imply; absent (or null) fields are left out."""
    given: dict[str, int] = {}
    for name in _INTEGER_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidConfig(f"{name} is {value!r}, not a positive integer", config_url)
        given[name] = value
    if any(config.get(key) is not None for key in LATENT_ATTENTION_KEYS):
        return given  # multi-head latent attention (DeepSeek): projections are not heads x head_dim
    heads = given.get("num_attention_heads")
    head_dim = given.get("head_dim")
    if head_dim is None and heads and "hidden_size" in given and given["hidden_size"] % heads == 0:
        head_dim = given["hidden_size"] // heads
    if heads and head_dim:
        given["q_rows"] = heads * head_dim
        given["kv_rows"] = given.get("num_key_value_heads", heads) * head_dim
    return given


def config_contradictions(config: Mapping[str, Any], shapes: Iterable[tuple[str, tuple[int, ...]]],
                          config_url: str | None = None) -> list[str]:
    """Each way the tensors ``(name, shape)`` contradict ``config`` (empty: none found)."""
    sizes = quantities(config, config_url)
    problems = []
    layers: set[int] = set()
    for name, shape in shapes:
        match = _LAYER_INDEX.match(name)
        if match:
            layers.add(int(match.group(1)))
        for pattern, implied in _PATTERNS:
            if pattern.fullmatch(name) and all(q in sizes for q in implied):
                expected = tuple(sizes[q] for q in implied)
                if tuple(shape) != expected:
                    problems.append(f"{name} is {list(shape)} but the config implies {list(expected)} "
                                    f"({', '.join(f'{q}={sizes[q]}' for q in dict.fromkeys(implied))})")
                break
    count = sizes.get("num_hidden_layers")
    if count is not None and layers:
        nextn = config.get("num_nextn_predict_layers")  # DeepSeek's MTP layers follow the decoder's
        extra = nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and nextn > 0 else 0
        if not set(range(count)) <= layers or not layers <= set(range(count + extra)):
            problems.append(f"the weights hold decoder layers {_span(layers)}, the config says "
                            f"num_hidden_layers={count}" + (f" (+{extra} MTP)" if extra else ""))
    return problems


def check_config_against_tensors(config: Mapping[str, Any], shapes: Iterable[tuple[str, tuple[int, ...]]],
                                  config_url: str | None = None) -> None:
    """`InvalidConfig` naming ``config_url`` when `config_contradictions` finds any."""
    problems = config_contradictions(config, shapes, config_url)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InvalidConfig("config.json contradicts the weights: " + "; ".join(problems[:3]) + more, config_url)


def _span(layers: set[int]) -> str:
    ordered = sorted(layers)
    return f"{ordered[0]}..{ordered[-1]} ({len(ordered)} layers)" if ordered else "none"
