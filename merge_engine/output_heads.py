"""The output-head rules every planner applies (Hugging Face names and Megatron tables alike), once.

Tied embeddings (`tie_word_embeddings` reads the config's flag):
- ``--tie-word-embedding`` (verl's flag) may only confirm the config: `check_tie_flag` raises
  `InvalidOption` on a contradiction;
- a tied model's output head is not written (``save_pretrained`` drops it); when the checkpoint
  stores it anyway, the stored copy must equal the input embedding (`check_tied_copy`, or the
  in-stream comparison of a planner that reads both, raising `tied_copy_error`). A copy that differs
  means config.json lies about tying: `InvalidConfig`, never a silently dropped trained head
  (`check_dropped_head` applies it to a Hugging Face-names plan);
- an untied config whose checkpoint has no head is `InvalidConfig` (`untied_without_head`).

Critic value heads (`is_critic`): a one-row head (verl's critics; ``score.weight`` in Hugging Face
names) becomes a token-classification model (`critic_config`), never tied.

`merge_engine.validate` asks the same functions, so an output checked there obeys the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from merge_engine.chunks import aligned_chunks
from merge_engine.errors import InvalidConfig, InvalidOption
from merge_engine.hf_metadata import tie_word_embeddings
from merge_engine.merge_plan import MergePlan
from merge_engine.tensor_source import TensorMeta, TensorSource

__all__ = ["CRITIC_HEAD", "EMBED_SUFFIXES", "LM_HEAD", "check_dropped_head", "check_tie_flag", "check_tied_copy",
           "critic_config",
           "input_embedding", "is_critic", "tie_word_embeddings", "tied_copy_error", "untied_without_head"]

EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
LM_HEAD = "lm_head.weight"
CRITIC_HEAD = "score.weight"


def check_tie_flag(tie_flag: bool | None, tied: bool, config_url: str | None = None) -> None:
    """``--tie-word-embedding`` may only confirm config.json's ``tie_word_embeddings``."""
    if tie_flag is not None and tie_flag != tied:
        raise InvalidOption(f"--tie-word-embedding={tie_flag} contradicts config.json "
                            f"(tie_word_embeddings={tied})", config_url)


def input_embedding(metas: Mapping[str, TensorMeta], config_url: str | None = None) -> str:
    """The input embedding's name; `InvalidConfig` when there is none to tie ``lm_head`` to."""
    embed = next((n for n in metas if n.endswith(EMBED_SUFFIXES)), None)
    if embed is None:
        raise InvalidConfig("config ties embeddings but the checkpoint has no input embedding to tie lm_head to",
                            config_url)
    return embed


def untied_without_head(where: str | None = None) -> InvalidConfig:
    return InvalidConfig("config says tie_word_embeddings=false but the checkpoint has no lm_head.weight", where)


def tied_copy_error(copy: str, embedding: str, where: str | None, detail: str = "") -> InvalidConfig:
    """The one error of a stored head that is not the embedding it is tied to."""
    return InvalidConfig(f"config says tie_word_embeddings=true but {copy} differs from {embedding}"
                         f"{f' ({detail})' if detail else ''}; fix tie_word_embeddings in config.json (or pass a "
                         "correct --hf-model-path)", where)


def check_tied_copy(source: TensorSource, copy: str, embedding: str, chunk_bytes: int) -> None:
    """The stored head ``copy`` equals ``embedding`` (shape, dtype, every byte, streamed chunk by
    chunk), or `tied_copy_error`. Free when the source stores both under one storage."""
    metas = source.metas()
    same_storage = getattr(source, "same_storage", None)
    if same_storage is not None and same_storage(copy, embedding):
        return  # saved once, referenced twice: equal by construction
    a, b = metas[copy], metas[embedding]
    if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
        raise tied_copy_error(copy, embedding, source.url,
                              f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    pairs = aligned_chunks(source.iter_chunks(copy, chunk_bytes), source.iter_chunks(embedding, chunk_bytes))
    if not all(torch.equal(x, y) for x, y in pairs):
        raise tied_copy_error(copy, embedding, source.url)


def check_dropped_head(source: TensorSource, plan: MergePlan, chunk_bytes: int) -> None:
    """Hugging Face names: a stored ``lm_head`` the plan does not write (tied) equals the embedding."""
    metas = source.metas()
    if LM_HEAD not in metas or LM_HEAD in plan.by_name():
        return
    check_tied_copy(source, LM_HEAD, input_embedding(metas), chunk_bytes)  # the planner refused a drop without one


def is_critic(head_rows: int, vocab_size: int | None = None) -> bool:
    """A value head: one output row where a vocabulary projection would have ``vocab_size`` rows."""
    return head_rows == 1 and (vocab_size is None or vocab_size > 1)


def critic_config(config: Mapping[str, Any], head: TensorMeta) -> dict[str, Any]:
    """The config updates of a critic: a token-classification architecture with the head's labels."""
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
