"""MergePlan: every output tensor (name, shape, dtype, how to build it) and its shard file,
decided from metadata alone before any weight is read.

A `PlannedTensor` either copies one source tensor (``build is None``: streamed chunk by chunk,
cast to the output dtype) or names a `TensorBuilder` — a small object that computes the output
from one or more source tensors (Megatron QKV splits, LoRA fusion, ...). Shards are filled
greedily in plan order up to ``max_shard_size`` bytes, like ``save_pretrained``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from merge_engine.errors import InvalidConfig, InvalidOption, UnsupportedLayout
from merge_engine.tensor_source import TensorMeta, TensorSource

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # save_pretrained's historical default ("5GB")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise InvalidOption(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def output_dtype(stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """``--dtype`` casts floating-point tensors only (as save_pretrained does): integer and bool
    buffers keep their dtype, or a cast would change their values."""
    return requested if requested is not None and stored.is_floating_point else stored


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``1024`` -> 1024."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
             "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}
    value = text.strip().upper()
    number = value.rstrip("KMGTIB")
    unit = value[len(number):]
    try:
        size = int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise InvalidOption(f"cannot read size {text!r} (e.g. 5GB, 500MiB)") from None
    if size <= 0:
        raise InvalidOption(f"size must be positive: {text!r}")
    return size


class TensorBuilder(Protocol):
    """Computes one output tensor from source tensors; yields flat chunks in row-major order."""

    inputs: tuple[str, ...]

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]: ...


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source_name: str
    build: Any = None  # a TensorBuilder, or None to copy ``source_name``

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ShardFile:
    filename: str
    tensors: tuple[str, ...]
    size: int  # bytes of tensor data (header excluded)


@dataclass(frozen=True)
class MergePlan:
    tensors: tuple[PlannedTensor, ...]
    shards: tuple[ShardFile, ...]
    config_updates: dict[str, Any] = field(default_factory=dict, hash=False)
    notes: tuple[str, ...] = ()

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_name(self) -> dict[str, PlannedTensor]:
        return {t.name: t for t in self.tensors}


def assign_shards(tensors: Sequence[PlannedTensor], max_shard_size: int) -> tuple[ShardFile, ...]:
    """Greedy, in order: a shard closes when the next tensor would push it past the limit.

    Every planner ends here, before any byte is written: a dtype safetensors cannot store (complex,
    quantized) is refused now with `UnsupportedLayout` naming the tensor, not halfway through a write.
    """
    from merge_engine.safetensors_file import CODES

    for tensor in tensors:
        if tensor.dtype not in CODES:
            raise UnsupportedLayout(f"{tensor.name}: dtype {tensor.dtype} cannot be stored in safetensors "
                                    "(cast it with --dtype if it is floating point, or drop it)")
    groups: list[list[PlannedTensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or (groups[-1] and size + tensor.nbytes > max_shard_size):
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    if len(groups) <= 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    return tuple(ShardFile(name, tuple(t.name for t in g), sum(t.nbytes for t in g)) for name, g in zip(names, groups))


def tie_word_embeddings(config: Mapping[str, Any]) -> bool:
    """The config's tie flag, with the model class default when the key is absent."""
    for scope in (config, config.get("text_config") or {}):
        if "tie_word_embeddings" in scope:
            return bool(scope["tie_word_embeddings"])
    from transformers import AutoConfig  # slow import: only when the config leaves it implicit

    try:
        return bool(AutoConfig.for_model(**dict(config)).tie_word_embeddings)
    except Exception as exc:
        raise InvalidConfig(f"cannot tell whether embeddings are tied ({exc})") from exc


EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
LM_HEAD = "lm_head.weight"
CRITIC_HEAD = "score.weight"


def input_embedding(metas: Mapping[str, TensorMeta], config_url: str | None = None) -> str:
    """The input embedding's name; `InvalidConfig` when there is none to tie ``lm_head`` to."""
    embed = next((n for n in metas if n.endswith(EMBED_SUFFIXES)), None)
    if embed is None:
        raise InvalidConfig("config ties embeddings but the checkpoint has no input embedding to tie lm_head to",
                            config_url)
    return embed


def plan_hf_merge(metas: Mapping[str, TensorMeta], config: Mapping[str, Any], *, dtype: torch.dtype | None = None,
                  max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, tie_flag: bool | None = None,
                  config_url: str | None = None) -> MergePlan:
    """Plan a merge whose source names already are Hugging Face names (FSDP, HF folders).

    - Output dtype: ``dtype`` for floating-point tensors if given, else each tensor's stored dtype.
    - Tied embeddings come from the config; ``lm_head.weight`` is dropped when tied (the caller
      checks the copy equals the embedding). ``tie_flag`` (verl's ``--tie-word-embedding``) may
      only confirm the config; a contradiction raises `InvalidOption`.
    - A critic (``score.weight``, no ``lm_head``) gets a token-classification architecture.
    """
    tied = tie_word_embeddings(config)
    if tie_flag is not None and tie_flag != tied:
        raise InvalidOption(f"--tie-word-embedding={tie_flag} contradicts config.json "
                            f"(tie_word_embeddings={tied})", config_url)
    names = list(metas)
    notes: list[str] = []
    updates: dict[str, Any] = {}
    embed = next((n for n in metas if n.endswith(EMBED_SUFFIXES)), None)
    if CRITIC_HEAD in metas and LM_HEAD not in metas:
        updates.update(critic_config(config, metas[CRITIC_HEAD]))
        notes.append("critic head score.weight -> token classification model")
    elif tied:
        if LM_HEAD in metas:
            input_embedding(metas, config_url)  # the copy we drop is checked against it before writing
            names.remove(LM_HEAD)
            notes.append("tied embeddings: lm_head.weight not written (it equals the embedding)")
    elif embed is not None and LM_HEAD not in metas:
        raise InvalidConfig("config says tie_word_embeddings=false but the checkpoint has no lm_head.weight",
                            config_url)
    tensors = [PlannedTensor(n, metas[n].shape, output_dtype(metas[n].dtype, dtype), n) for n in names]
    if dtype is not None:
        updates["dtype"] = str(dtype).removeprefix("torch.")
    else:
        stored = {metas[n].dtype for n in names if metas[n].dtype.is_floating_point}
        if len(stored) == 1:
            updates["dtype"] = str(stored.pop()).removeprefix("torch.")
    return MergePlan(tuple(tensors), assign_shards(tensors, max_shard_size), updates, tuple(notes))


def critic_config(config: Mapping[str, Any], head: TensorMeta) -> dict[str, Any]:
    architectures = list(config.get("architectures") or [])
    if not architectures:
        raise InvalidConfig("critic checkpoint but config.json names no architecture")
    base = architectures[0]
    for suffix in ("ForCausalLM", "ForTokenClassification", "ForSequenceClassification", "Model"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    labels = int(head.shape[0])
    return {"architectures": [f"{base}ForTokenClassification"],
            "id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
            "label2id": {f"LABEL_{i}": i for i in range(labels)}}
