"""torchtitan's ``step-N/`` DCP checkpoints: the model state flattened at the top under torchtitan's own module
names (``tok_embeddings``, ``layers.N.attention.qkv_linear.wq``), optimizer, schedulers and dataloader nested under
their own keys. The files are `merge_engine.layouts.dcp_model`'s (``torch_dcp``: its listing verdict, its check);
a checked ``torch_dcp`` checkpoint whose model names are torchtitan's is this layout's (`Layout.refines`), from the
index its check carried (no read).

`open` gives torchtitan's names; the Hub's come from the family table of `merge_engine.architectures.torchtitan`
once the config is known (torchtitan saves none: ``--hf_model_path``), in this layout's jobs
(``merge_engine.commands.torchtitan_jobs``). A family without a table is a one-line `UnsupportedLayout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from merge_engine.errors import UnsupportedLayout
from merge_engine.layouts import dcp_model
from merge_engine.layouts.contract import ABSENT, HF_NAMES, Checkpoint, Layout, Verdict
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    from merge_engine.formats.tensor_source import TensorSource

NAME = "torchtitan"
TENSOR_NAMING = HF_NAMES  # once its jobs have renamed them (`merge_engine.commands.torchtitan_jobs.merge_source`)


def detect(files: Sequence[FileEntry]) -> bool:
    return False  # its listings are torch_dcp's: told apart by the names its check read (`refine`)


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    return ABSENT


def refine(checkpoint: Checkpoint, files: Sequence[FileEntry]) -> Checkpoint | None:
    """``checkpoint`` (a checked ``torch_dcp`` one) as this layout's when its carried names are torchtitan's."""
    from merge_engine.layouts.tensor_index import restore_dcp

    found = dcp_model._folder(checkpoint.files)
    index = restore_dcp(checkpoint, found[0]) if found is not None else None
    if index is None or not any(dcp_model.TORCHTITAN_NAME.match(name) for name in index.tensors):
        return None
    return replace(checkpoint, layout=NAME, notes=("torchtitan",))


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    found = refine(dcp_model.check_complete(url, files), files)
    if found is None:
        raise UnsupportedLayout(f"{NAME}: this DCP checkpoint does not hold torchtitan's names", url)
    return found


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """torchtitan's tensors under its own names (renamed by the jobs, which know the config)."""
    return dcp_model.open(replace(checkpoint, layout=dcp_model.NAME))


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
    refines=dcp_model.NAME,
    refine=refine,
)
