"""Tiny `transformers` models with known, deterministic weights.

Contract:
- `ModelSpec` names a model (family, sizes, tying, task, an optional extra persistent buffer), or carries a
  whole Hugging Face config (``hf_config``, JSON: any class transformers builds from it, e.g. the tiny
  configs of `synthetic_runs.tiny_configs`; the sizes and family fields are then unused).
- `build_config(spec)` gives the Hugging Face config; `build_model(spec, seed, dtype)` the model,
  every parameter and persistent buffer set by `synthetic_value`, so the same spec and seed always
  give bit-identical weights, whatever `transformers` would have initialised.
- `synthetic_value(name, shape, seed, dtype)` is THE definition of a weight: it depends only on the
  canonical Hugging Face name (no PEFT prefix, no `.base_layer`), the shape and the seed. Writers
  that fill sharded parameters in place call it too, so every path agrees on every value.
- `write_hf_metadata(directory, spec)` writes what verl puts in `huggingface/`: config.json,
  generation_config.json (causal LMs only: verl saves one only for models that can generate) and the
  tokenizer with its chat template. No weights.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass

import torch
import transformers

from synthetic_runs.model_families import FAMILIES as OTHER_FAMILIES
from synthetic_runs.model_families import build_family_config
from synthetic_runs.tokenizer import IM_END, PAD_TOKEN, save_tokenizer

DENSE_FAMILIES: tuple[str, ...] = ("qwen2", "llama")
FAMILIES: tuple[str, ...] = DENSE_FAMILIES + tuple(OTHER_FAMILIES)
TASKS: tuple[str, ...] = ("causal_lm", "token_classification")

# Registered on the inner model (`model.extra_persistent_buffer` in the state dict) when asked for.
EXTRA_BUFFER_NAME = "extra_persistent_buffer"

_PEFT_PREFIX = "base_model.model."
_WRAPPED = re.compile(r"(?:\.base_layer)+\.(?!lora_)")


@dataclass(frozen=True)
class ModelSpec:
    """A tiny decoder model. All sizes are small on purpose; `vocab_size` is odd so shards are uneven."""

    family: str = "qwen2"  # "qwen2" (q/k/v bias) | "llama" (no bias); both support GQA; or one of
    # `model_families.FAMILIES` (MoE, vision-language, GPT-NeoX, GPT-2; causal LM only)
    vocab_size: int = 1003
    hidden_size: int = 64
    intermediate_size: int = 112
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = False
    task: str = "causal_lm"  # or "token_classification" (verl's critic: num_labels=1 -> score.*)
    extra_buffer: bool = False  # a PERSISTENT buffer: a plain tensor replicated on every rank
    hf_config: str = ""  # a full config as JSON ("architectures" names the class): defines the model alone

    def __post_init__(self) -> None:
        if self.hf_config:
            if self.task != "causal_lm" or self.extra_buffer:
                raise ValueError("a model given by its config is built as its config's class, nothing added")
            return
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
        if self.task == "token_classification" and self.tie_word_embeddings:
            raise ValueError("a token-classification model has no lm_head to tie")
        if self.family in OTHER_FAMILIES and self.task != "causal_lm":
            raise ValueError(f"family {self.family!r} is built as a causal LM only")

    @property
    def architecture(self) -> str:
        """The class name Hugging Face records in config.json `architectures`."""
        if self.hf_config:
            return self.config_dict["architectures"][0]
        if self.family in OTHER_FAMILIES:
            return OTHER_FAMILIES[self.family].causal_lm
        prefix = {"qwen2": "Qwen2", "llama": "Llama"}[self.family]
        suffix = {"causal_lm": "ForCausalLM", "token_classification": "ForTokenClassification"}[self.task]
        return prefix + suffix

    @property
    def config_dict(self) -> dict:
        import json

        return json.loads(self.hf_config)

    @property
    def text_vocab_size(self) -> int:
        """The vocabulary the tokenizer is built for."""
        if not self.hf_config:
            return self.vocab_size
        config = self.config_dict
        for scope in (config, config.get("text_config") or {}):
            if isinstance(scope.get("vocab_size"), int):
                return scope["vocab_size"]
        return self.vocab_size

    @property
    def decoder_layer_class(self) -> str:
        """The class FSDP wraps per layer (the model's `_no_split_modules`; a config-given model: all of them)."""
        if self.hf_config:
            return ""
        if self.family in OTHER_FAMILIES:
            return OTHER_FAMILIES[self.family].decoder_layer
        return {"qwen2": "Qwen2DecoderLayer", "llama": "LlamaDecoderLayer"}[self.family]


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"float32"`/`"bfloat16"`/`"float16"` (or a dtype) -> the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def _token_ids() -> dict[str, int]:
    from synthetic_runs.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    return {
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "bos_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
    }


def build_config(spec: ModelSpec, dtype: str | torch.dtype = "float32") -> transformers.PretrainedConfig:
    """The Hugging Face config of `spec`; `dtype` is recorded as the config's dtype (verl saves the
    config of a model loaded in that dtype)."""
    if spec.hf_config:
        data = spec.config_dict
        data.pop("model_type", None)
        config = model_class(spec).config_class(**data)
        config.dtype = torch_dtype(dtype)
        return config
    if spec.family in OTHER_FAMILIES:
        config = build_family_config(spec, _token_ids())
        config.dtype = torch_dtype(dtype)
        return config
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        architectures=[spec.architecture],
        **_token_ids(),
    )
    if spec.family == "qwen2":
        config = transformers.Qwen2Config(**common)
    else:
        config = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if spec.task == "token_classification":
        config.num_labels = 1
    config.dtype = torch_dtype(dtype)
    return config


def canonical_name(name: str) -> str:
    """A state-dict key without PEFT's wrapping: the name `synthetic_value` is seeded with."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    # nested wrappers (PEFT's ParamWrapper on two parameters of one module) stack base_layer; a LoRA
    # factor of an inner wrapper keeps its base_layer, so that it stays apart from the outer one's
    return _WRAPPED.sub(".", name)


def synthetic_value(name: str, shape: tuple[int, ...] | torch.Size, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The deterministic value of the weight `name` (canonical or PEFT-prefixed) for `seed`.

    Drawn in float32 from a generator seeded by (seed, name), then cast: norms near 1, biases and
    LoRA B small but non-zero, matrices scaled by 1/sqrt(fan_in) so tiny models give sane logits.
    """
    name = canonical_name(name)
    shape = tuple(shape)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    parts = name.split(".")
    owner = parts[-2] if len(parts) > 1 else ""
    # In place: a 150k-vocabulary embedding is half a gigabyte in float32.
    if name.endswith(EXTRA_BUFFER_NAME):
        values.mul_(0.5).add_(1.0)
    elif "norm" in owner and parts[-1] == "weight":
        values.mul_(0.1).add_(1.0)
    elif name.endswith(".bias"):
        values.mul_(0.02)
    elif "lora_B" in name:
        values.mul_(0.05)
    elif "embed_tokens" in name:
        values.mul_(0.5)
    elif len(shape) == 2:
        values.div_(shape[1] ** 0.5)
    else:
        values.mul_(0.1)
    return values.to(dtype)


def fill_synthetic_(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter and persistent buffer of a full (unsharded) module in place."""
    persistent = set(module.state_dict().keys())
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(synthetic_value(name, param.shape, seed, param.dtype))
        for name, buffer in module.named_buffers():
            if name in persistent and buffer.is_floating_point():
                buffer.copy_(synthetic_value(name, buffer.shape, seed, buffer.dtype))


def register_extra_buffer(model: torch.nn.Module, spec: ModelSpec, dtype: torch.dtype) -> None:
    """Register the persistent extra buffer on the inner model (`model.<EXTRA_BUFFER_NAME>`)."""
    inner = model.model
    inner.register_buffer(EXTRA_BUFFER_NAME, torch.zeros(spec.hidden_size, dtype=dtype), persistent=True)


def model_class(spec: ModelSpec) -> type[transformers.PreTrainedModel]:
    """The `transformers` class for `spec` (e.g. Qwen2ForCausalLM, LlamaForTokenClassification)."""
    return getattr(transformers, spec.architecture)


def build_model(spec: ModelSpec, seed: int, dtype: torch.dtype | str = torch.float32) -> torch.nn.Module:
    """A full model on CPU in `dtype` with the deterministic weights of (spec, seed), in eval mode."""
    dtype = torch_dtype(dtype)
    config = build_config(spec, dtype)
    model = model_class(spec)(config)
    model.to(dtype)
    if spec.extra_buffer:
        register_extra_buffer(model, spec, dtype)
    fill_synthetic_(model, seed)
    return model.eval()


def write_generation_config(directory: str | os.PathLike[str], spec: ModelSpec) -> None:
    """generation_config.json as a Qwen-style instruct model ships it."""
    ids = _token_ids()
    transformers.GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
    ).save_pretrained(os.fspath(directory))


def write_hf_metadata(directory: str | os.PathLike[str], spec: ModelSpec, dtype: str | torch.dtype = "float32") -> None:
    """Write config.json, generation_config.json (causal LMs only) and the tokenizer; no weights."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    build_config(spec, dtype).save_pretrained(directory)
    if spec.task == "causal_lm":
        write_generation_config(directory, spec)
    save_tokenizer(directory, spec.text_vocab_size)
