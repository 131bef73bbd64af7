"""The jobs of a layout with its own semantics: how its checkpoints are merged and extracted.

A layout whose checkpoints are not merged by planning what its `open` gives (a Megatron-Bridge LoRA step:
an adapter to fuse into a base the user names, or into the base saved beside it) names, in its contract,
the module of this package that answers for it (`merge_engine.layouts.contract.Layout`'s ``JOBS``);
`jobs_of` finds it, so that `merge_engine.commands.merge` and `merge_engine.commands.extract` name no layout.
The module is imported only for such a checkpoint (its library is not free to import), and only from this
package: the name comes from the layout registry, never from a record's bytes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from merge_engine.layouts import Checkpoint, layout_named

if TYPE_CHECKING:
    from merge_engine.commands.input_folders import InputFolders
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.output.jobs import OutputOptions, PreparedJob

PACKAGE = __name__.rpartition(".")[0] + "."  # the only modules a layout's ``JOBS`` may name


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


def jobs_of(checkpoint: Checkpoint) -> LayoutJobs | None:
    """The jobs module of ``checkpoint``'s layout (its ``JOBS``), imported now; None for a layout without one."""
    name = getattr(layout_named(checkpoint.layout), "JOBS", None)
    if name is None:
        return None
    if not name.startswith(PACKAGE) or "." in name[len(PACKAGE):]:
        raise TypeError(f"layout {checkpoint.layout!r} names its jobs {name!r}, not a module of {PACKAGE.rstrip('.')}")
    return importlib.import_module(name)  # type: ignore[return-value]
