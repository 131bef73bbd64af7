"""Is ``--base-model`` the model a LoRA step trained? Its ``config.json`` against the step's own.

A step that saved its adapter alone is fused into the base the user names; a base of another size or family gives
either a shape error late in the fuse or, where the adapter happens to fit (a base with more layers), a plausible
but wrong release. `check_same_model` compares the two configs on the keys that define the model (`MODEL_KEYS`:
architecture, family, widths, depth, heads, vocabulary, experts, tied head) before anything is read or written.
Keys that only record how a config was saved (``_name_or_path``, ``transformers_version``, ``torch_dtype`` /
``dtype``, ``use_cache``, ...) are not compared; neither is a key only one of the two states.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from merge_engine import storage
from merge_engine.errors import InvalidConfig
from merge_engine.formats.hf_metadata import CONFIG_FILE

MODEL_KEYS = ("architectures", "model_type",
              "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_layers",
              "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "intermediate_size", "n_inner",
              "moe_intermediate_size", "vocab_size", "num_experts", "num_local_experts", "n_routed_experts",
              "num_experts_per_tok", "tie_word_embeddings")
"""config.json keys a base must share with the step's config (at the top level and in ``text_config``)."""


def model_differences(step: Mapping[str, Any], base: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, base's value, step's value) for each `MODEL_KEYS` key both configs state with different values, at
    the top level and inside ``text_config`` (a multimodal config's language model)."""
    differ: list[tuple[str, Any, Any]] = []
    for prefix, step_scope, base_scope in (("", step, base),
                                           ("text_config.", step.get("text_config"), base.get("text_config"))):
        if isinstance(step_scope, Mapping) and isinstance(base_scope, Mapping):
            differ += [(prefix + key, base_scope[key], step_scope[key]) for key in MODEL_KEYS
                       if key in step_scope and key in base_scope and step_scope[key] != base_scope[key]]
    return differ


def check_same_model(step: Mapping[str, Any], step_dir: str, base: Mapping[str, Any], base_dir: str) -> None:
    """Refuse a base whose config is not the step's model.

    Args:
        step: the step's config.json (saved with the step, or ``--hf_model_path``'s), read from ``step_dir``.
        base: ``--base-model``'s config.json, read from ``base_dir``. When both are the same folder (a step that
            saved no config takes the base's) there is nothing to compare.

    Raises:
        InvalidConfig: a `MODEL_KEYS` key differs; the message names both config files and every key that
            differs (the base's value, then the step's), ``path`` the base's config.json.
    """
    if step_dir.rstrip("/") == base_dir.rstrip("/"):
        return
    differ = model_differences(step, base)
    if differ:
        base_url, step_url = storage.join(base_dir, CONFIG_FILE), storage.join(step_dir, CONFIG_FILE)
        raise InvalidConfig(f"--base-model is not the model this run trained: its {base_url} differs from the "
                            f"step's {step_url} on " + ", ".join(f"{key} ({b!r} vs {s!r})" for key, b, s in differ),
                            base_url)
