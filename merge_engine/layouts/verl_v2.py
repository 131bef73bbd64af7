"""verl's Megatron checkpoint schema v2 (verl >= 0.9): ``model/{dist_ckpt,huggingface}``,
``optimizer/dist_ckpt``, ``extra/dist_ckpt`` and ``ckpt_contents.json``, which rank 0 writes LAST
(tmp + fsync + replace): the completeness marker of the whole step, whichever layout reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from merge_engine.layouts.contract import DONE, INCOMPLETE, Verdict
from merge_engine.storage import FileEntry

CONTENTS_MARKER = "ckpt_contents.json"
MODEL_DIST_DIR = "model/dist_ckpt/"
MODEL_HF_DIR = "model/huggingface/"


def marker_verdict(files: Sequence[FileEntry]) -> Verdict:
    """Complete exactly when ``ckpt_contents.json`` is listed."""
    if any(f.path == CONTENTS_MARKER for f in files):
        return DONE
    return Verdict(INCOMPLETE, f"{CONTENTS_MARKER} (written last) not present yet")


def _section(obj: dict, key: str) -> dict:
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def trains_lora(contents: dict) -> bool:
    """Does the marker say the run trained a PEFT adapter (``backend.peft``, ``contents.peft_adapters`` or
    ``contents.model.peft_adapter_path``)?"""
    inner = _section(contents, "contents")
    return (_section(contents, "backend").get("peft") is True or "peft_adapters" in inner
            or bool(_section(inner, "model").get("peft_adapter_path")))


def saves_base(contents: dict) -> bool:
    """Does the marker say the base weights were saved beside the adapter (``backend.use_dist_checkpointing``)?"""
    return _section(contents, "backend").get("use_dist_checkpointing") is True


def declared_adapter_dir(contents: dict) -> str | None:
    """The PEFT folder the marker names (``contents.model.peft_adapter_path``, with a trailing ``/``), as
    written: the layout reading it decides whether it may be read; None when it names none."""
    declared = _section(_section(contents, "contents"), "model").get("peft_adapter_path")
    return declared.rstrip("/") + "/" if isinstance(declared, str) and declared else None
