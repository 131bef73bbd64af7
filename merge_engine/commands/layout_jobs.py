"""The jobs of a layout with its own semantics: how its checkpoints are merged and extracted.

A layout whose checkpoints are not merged by planning what its `open` gives (a Megatron-Bridge LoRA step:
an adapter to fuse into a base the user names, or into the base saved beside it; a torchtitan step, renamed to the
Hub's names) has a module of this package that answers for it, listed once in `JOBS` by the layout's name;
`jobs_of` finds it, so that `merge_engine.commands.merge` and `merge_engine.commands.extract` name no layout.
The layouts name no command (the commands sit above them). A jobs module is imported only for such a checkpoint
(its library is not free to import).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from merge_engine.layouts import Checkpoint, megatron_lora, torchtitan

if TYPE_CHECKING:
    from merge_engine.commands.input_folders import InputFolders
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.output.jobs import OutputOptions, PreparedJob

class LayoutJobs(Protocol):
    """What a layout's jobs module answers (each from the checked checkpoint, the job's options and, where it reads
    a folder the user names, the job's `merge_engine.commands.input_folders.InputFolders`):

    - ``step_config(checkpoint, options, inputs)``: (config.json, the folder it came from) of a merge;
    - ``prepare_merge(checkpoint, options, source_url, inputs)``: a merge of its own (e.g. an adapter fused into the
      base the user names), or None: the merge plans what ``merge_source`` gives, like any checkpoint's;
    - ``merge_source(checkpoint, source, options)``: what that plan reads, from what `Layout.open` gave
      (e.g. every adapter update fused into the saved base);
    - ``prepare_extract(checkpoint, options, source_url, inputs)``: ``extract-lora``'s job.
    """

    def step_config(self, checkpoint: Checkpoint, options: OutputOptions,
                    inputs: InputFolders) -> tuple[dict[str, Any], str]: ...

    def prepare_merge(self, checkpoint: Checkpoint, options: OutputOptions, source_url: str,
                      inputs: InputFolders) -> PreparedJob | None: ...

    def merge_source(self, checkpoint: Checkpoint, source: TensorSource, options: OutputOptions) -> TensorSource: ...

    def prepare_extract(self, checkpoint: Checkpoint, options: OutputOptions, source_url: str,
                        inputs: InputFolders) -> PreparedJob: ...


def _megatron_lora_jobs() -> LayoutJobs:
    from merge_engine.commands import megatron_lora as jobs

    return jobs  # a module answering the protocol


def _torchtitan_jobs() -> LayoutJobs:
    from merge_engine.commands import torchtitan_jobs as jobs

    return jobs  # type: ignore[return-value]  # a module answering the protocol


JOBS: dict[str, Callable[[], LayoutJobs]] = {
    megatron_lora.NAME: _megatron_lora_jobs,
    torchtitan.NAME: _torchtitan_jobs,
}
"""Layout name -> the function that imports its jobs module (the layouts not listed are merged by their plan)."""


def jobs_of(checkpoint: Checkpoint) -> LayoutJobs | None:
    """The jobs module of ``checkpoint``'s layout (`JOBS`), imported now; None for a layout without one."""
    load = JOBS.get(checkpoint.layout)
    return None if load is None else load()
