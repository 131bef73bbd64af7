"""The output-head rules every planner applies (Hugging Face names and Megatron tables alike), once.

Tied embeddings (`embeddings_tied`: the flag config.json states, else the model's own ties where transformers lists
them, else the config class's default, `tie_word_embeddings`):
- ``--tie-word-embedding`` (verl's flag) may only confirm the config: `check_tie_flag` raises
  `InvalidOption` on a contradiction;
- where transformers lists the model's ties (`merge_engine.plan.model_shapes.model_ties`, transformers 5),
  they decide: every tied name is not written, the one it is tied to is (``save_pretrained``'s choice),
  whatever the name (Mamba's ``backbone.embeddings``, ERNIE's decoder bias, Florence-2's shared
  embeddings); a class that ties nothing (BigBird-Pegasus's causal LM) has its head written even under
  ``tie_word_embeddings``. Else the flag decides:
- a tied model's output head is not written (``save_pretrained`` drops it); when the checkpoint
  stores it anyway, the stored copy must equal the input embedding (`check_tied_copy`, or the
  in-stream comparison of a planner that reads both, raising `tied_copy_error`). A copy that differs
  means config.json lies about tying: `InvalidConfig`, never a silently dropped trained head
  (`check_dropped_head` applies it to a Hugging Face-names plan);
- an untied config whose checkpoint has no head is `InvalidConfig` (`untied_without_head`).

Which tensors are the input embedding and the output head (`find_heads`): the common names
(``lm_head.weight``, ``*embed_tokens.weight``, ``*wte.weight``...) when they settle it, else the
model's own names (`merge_engine.plan.model_heads`: GPT-NeoX's head is ``embed_out.weight`` on the Hub).

Critic value heads (`is_critic`): a one-row head (verl's critics; ``score.weight`` in Hugging Face
names) becomes a token-classification model (`critic_config`), never tied.

`merge_engine.validate` asks the same functions, so an output checked there obeys the same rules.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from merge_engine.formats.chunks import aligned_chunks
from merge_engine.errors import InvalidConfig, InvalidOption
from merge_engine.formats.hf_metadata import stated_tie_word_embeddings, tie_word_embeddings
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.plan.model_shapes import model_ties
from merge_engine.formats.tensor_source import TensorMeta, TensorSource

__all__ = ["CRITIC_HEAD", "EMBED_SUFFIXES", "LM_HEAD", "Heads", "check_dropped_head", "find_heads", "check_tie_flag", "check_tied_copy",
           "critic_config", "embeddings_tied",
           "input_embedding", "is_critic", "tie_word_embeddings", "tied_copy_error", "untied_without_head"]

EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
LM_HEAD = "lm_head.weight"
CRITIC_HEAD = "score.weight"


@dataclass(frozen=True)
class Heads:
    """The stored names of the input embedding and of the output head (None: not stored)."""

    embedding: str | None
    head: str | None


def find_heads(names: Collection[str], config: Mapping[str, Any] | None = None) -> Heads:
    """The input embedding and output head among ``names``: the common names, else the model's own
    (`merge_engine.plan.model_heads`, which builds the config's class on the meta device)."""
    embedding = next((n for n in names if n.endswith(EMBED_SUFFIXES)), None)
    head = LM_HEAD if LM_HEAD in names else None
    if (embedding is None or head is None) and config:
        from merge_engine.plan.model_heads import model_head_names

        from_model = model_head_names(config)
        if from_model is not None:
            embedding = embedding or next((n for n in from_model.embedding if n in names), None)
            head = head or next((n for n in from_model.head if n in names), None)
    return Heads(embedding, head)


def check_tie_flag(tie_flag: bool | None, tied: bool, config_url: str | None = None) -> None:
    """``--tie-word-embedding`` may only confirm config.json's ``tie_word_embeddings``."""
    if tie_flag is not None and tie_flag != tied:
        raise InvalidOption(f"--tie-word-embedding={tie_flag} contradicts config.json "
                            f"(tie_word_embeddings={tied})", config_url)


def embeddings_tied(config: Mapping[str, Any], ties: Mapping[str, str] | None) -> bool:
    """Whether the model ties its embeddings: the ``tie_word_embeddings`` config.json states (top level or
    ``text_config``); where it states none, whether the model's own ties (``ties``:
    `merge_engine.plan.model_shapes.model_ties`, None where transformers lists none) tie anything; else the config
    class's default (`tie_word_embeddings`: `InvalidConfig` when the class has no such attribute)."""
    stated = stated_tie_word_embeddings(config)
    if stated is not None:
        return stated
    if ties is not None:
        return bool(ties)
    return tie_word_embeddings(config)


def input_embedding(metas: Mapping[str, TensorMeta], config_url: str | None = None) -> str:
    """The input embedding's name; `InvalidConfig` when there is none to tie ``lm_head`` to."""
    embed = next((n for n in metas if n.endswith(EMBED_SUFFIXES)), None)
    if embed is None:
        raise InvalidConfig("config ties embeddings but the checkpoint has no input embedding to tie lm_head to",
                            config_url)
    return embed


def untied_without_head(where: str | None = None) -> InvalidConfig:
    return InvalidConfig(f"config says tie_word_embeddings=false but the checkpoint has no output head ({LM_HEAD} "
                         "or the model's own name for it)", where)


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


def check_dropped_head(source: TensorSource, plan: MergePlan, chunk_bytes: int,
                       config: Mapping[str, Any] | None = None) -> None:
    """Hugging Face names: a stored head the plan does not write (tied) equals the embedding; where transformers
    lists the ``config`` model's ties (`merge_engine.plan.model_shapes.model_ties`, resolved against the names
    the source stores, as the planner resolves them), every tied name not written equals the one it is tied to."""
    ties = model_ties(config, source.metas()) if config else None
    if ties is not None:
        metas, written = source.metas(), plan.by_name()
        for name in sorted(metas):
            if name not in written and ties.get(name) in metas:
                check_tied_copy(source, name, ties[name], chunk_bytes)
        return
    heads = find_heads(source.metas(), config)
    if heads.head is None or heads.head in plan.by_name():
        return
    if heads.embedding is None:  # the planner refuses a drop without one
        raise InvalidConfig(f"config ties embeddings but there is no input embedding to tie {heads.head} to",
                            source.url)
    check_tied_copy(source, heads.head, heads.embedding, chunk_bytes)


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
