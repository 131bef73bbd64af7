"""A small, real tokenizer built locally, for synthetic checkpoints.

Contract:
- `build_tokenizer(max_vocab_size)` trains a byte-level BPE with the `tokenizers` library on a fixed
  corpus (nothing is downloaded) and wraps it as a `transformers.PreTrainedTokenizerFast` with a
  ChatML chat template. The same call always gives the same vocabulary and merges.
- It is built exactly like Qwen2's tokenizer (NFC, Qwen's split regex, byte-level, no unk token):
  `transformers` 5 rebuilds a `Qwen2Tokenizer` from vocab and merges whenever config.json says
  qwen2, and that rebuild must tokenize the same way. Byte-level also means any text round-trips.
- Its vocabulary never exceeds `max_vocab_size` (the model's `vocab_size`): a `ValueError` says so
  when the requested size cannot hold the alphabet and special tokens.
- `save_tokenizer(directory, max_vocab_size)` writes it with `save_pretrained` (tokenizer.json,
  tokenizer_config.json, the chat template, special tokens map) and returns the tokenizer.
"""

from __future__ import annotations

import copy
import functools
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)

# Largest vocabulary trained: 256 bytes, the special tokens and ~140 merges; small and fast.
_TRAINED_VOCAB_CAP = 400

# Qwen2's pre-tokenization regex (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, the format of Qwen2 instruct models; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A checkpoint is written by every rank at the end of a global step.",
    "Sharded tensors are gathered, concatenated and written as safetensors.",
    "The actor and the critic are trained with proximal policy optimization.",
    "Reinforcement learning from human feedback rewards helpful answers.",
    "Mixture of experts routes each token to a few experts.",
    "The learning rate warms up for ten steps and then stays constant.",
    "Hello world! How are you today? I am fine, thank you.",
    "user: what is two plus two? assistant: two plus two is four.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols - + = * / ( ) [ ] { } < > _ : ; , . ' \" ? !",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz",
    "Tokenizers split text into pieces; models predict the next piece.",
)


@functools.lru_cache(maxsize=8)
def _trained_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(_CORPUS), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(max_vocab_size: int = 1003) -> PreTrainedTokenizerFast:
    """Return a fresh copy of the deterministic tokenizer whose vocabulary fits `max_vocab_size`."""
    tokenizer = _trained_tokenizer(min(max_vocab_size, _TRAINED_VOCAB_CAP))
    if len(tokenizer) > max_vocab_size:
        raise ValueError(
            f"a vocabulary of {max_vocab_size} cannot hold the tokenizer's alphabet and special "
            f"tokens ({len(tokenizer)} entries); use vocab_size >= {len(tokenizer)}"
        )
    return copy.deepcopy(tokenizer)


def save_tokenizer(directory: str | os.PathLike[str], max_vocab_size: int = 1003) -> PreTrainedTokenizerFast:
    """Write the tokenizer (with its chat template) into `directory`; return it."""
    tokenizer = build_tokenizer(max_vocab_size)
    tokenizer.save_pretrained(os.fspath(directory))
    return tokenizer
