"""What a full fine-tune changed against its base, for an SVD extraction: the modules it factors
(`select_modules`: the targets given, or every linear weight but embeddings and output heads) and the other
tensors that differ (`changed_tensors`, streamed chunk by chunk: nothing held whole)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from merge_engine.errors import AdapterError
from merge_engine.formats.tensor_source import TensorSource
from merge_engine.lora.config import targets
from merge_engine.lora.fuse import aligned

NOT_LINEAR_LAST_PARTS = ("lm_head", "score", "classifier", "wte", "wpe")


def default_target(module: str) -> bool:
    """PEFT's "all-linear" spirit: every 2-D weight but embeddings and output heads."""
    last = module.rsplit(".", 1)[-1]
    return "embed" not in last and last not in NOT_LINEAR_LAST_PARTS


def select_modules(candidates: Sequence[str], target_modules: Sequence[str] | None, where: str | None) -> list[str]:
    if target_modules is None:
        return [m for m in candidates if default_target(m)]
    for entry in target_modules:
        if not any(targets([entry], m) for m in candidates):
            raise AdapterError(f"target module {entry!r} matches no 2-D weight present in both models", where)
    return [m for m in candidates if targets(list(target_modules), m)]


def changed_tensors(base: TensorSource, tuned: TensorSource, names: Sequence[str], chunk_bytes: int
                    ) -> list[tuple[str, float]]:
    """(name, max |difference|) of every tensor in ``names`` that differs, streamed chunk by chunk."""
    changed = []
    for name in names:
        worst = 0.0
        for a, b in aligned([base.iter_chunks(name, chunk_bytes), tuned.iter_chunks(name, chunk_bytes)]):
            if a.numel():
                worst = max(worst, float((a.to(torch.float64) - b.to(torch.float64)).abs().max()))
        if worst > 0:
            changed.append((name, worst))
    return changed
