"""Run layouts: how each trainer names the step folders of a run root, one `RunLayout` per trainer, listed
once in `RUN_LAYOUTS`. Everything that turns a step number into a folder name or back asks here
(discovery, Megatron-LM's tracker, the release layout, the names of a merge's task runs).

- ``verl``: ``global_step_<N>/``; inside it the RL role folders ``actor/`` and ``critic/`` (SFT
  trainers save straight into the step folder: role ``""``);
- ``megatron_lm``: ``iter_<NNNNNNN>/`` (zero-padded to 7 digits), weights straight in;
- ``hf_trainer``: HF Trainer / TRL's ``checkpoint-<N>/`` (Accelerate's ``pytorch_model_fsdp_0/`` or a DeepSpeed tag
  folder ``global_step<N>/`` inside);
- ``deepspeed``: DeepSpeed's own tags ``global_step<N>/`` (``engine.save_checkpoint``'s default, OpenRLHF);
- ``accelerate``: Accelerate's own ``save_state`` with automatic naming, ``checkpoint_<N>/``;
- ``torchtitan``: ``step-<N>/``, the DCP files straight in;
- ``nemo_rl``: NeMo-RL's ``step_<N>/`` (renamed from ``tmp_step_<N>`` once saved), the policy in ``policy/``.

Contract: `run_layout_of(name)` is the run layout that names a step folder ``name`` (its ``roles`` are
the role folders discovery looks for inside), `step_of_folder(name)` the step number it gives, both None
when none names it. A folder names a step only when it is exactly the name its trainer writes for that
number (ASCII digits, the trainer's own zero padding): ``global_step_01``, ``global_step_١`` (an
Arabic-Indic digit) and ``iter_40`` name no step, since a lookup of step 1 (or 40) asks for
``global_step_1`` (``iter_0000040``); listing and lookup follow this one rule, so every step a listing
shows is one a lookup finds;
`step_folders(step)` the folder names of a step, in registry order (the first is looked for first);
`from_step_folder(url)` the URL from its last step folder on; `portable_url(url)` / `portable_record(data)` how a
release names a URL (or every local path in a record) wherever it is copied. Names only: no I/O, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from merge_engine.storage.urls import LOCAL_SCHEMES, is_machine_path, scheme_of

__all__ = ["ACCELERATE", "DEEPSPEED", "HF_TRAINER", "MEGATRON_LM", "NEMO_RL", "RUN_LAYOUTS", "TORCHTITAN", "VERL",
           "RunLayout", "from_step_folder", "portable_record", "portable_url", "run_layout_of", "step_folders",
           "step_of_folder"]


@dataclass(frozen=True)
class RunLayout:
    """One trainer's step folders: ``folder_format`` (``str.format`` with ``step``) writes a step's folder
    name, ``folder_pattern`` (one group: the number) reads one back; ``roles`` are the role folders a
    step may hold (none: the weights lie in the step folder)."""

    NAME: str
    folder_format: str
    folder_pattern: str
    roles: tuple[str, ...] = ()

    def folder(self, step: int) -> str:
        """The folder name of ``step``."""
        return self.folder_format.format(step=int(step))

    def step_of(self, name: str) -> int | None:
        """The step number of the folder ``name``; None when this trainer does not name it so: the name must
        be exactly `folder` of its number (no other padding, ASCII digits only)."""
        match = re.fullmatch(self.folder_pattern, name, flags=re.ASCII)
        if match is None or not match.group(1).isascii():
            return None
        step = int(match.group(1))
        return step if self.folder(step) == name else None


VERL = RunLayout("verl", "global_step_{step}", r"global_step_([0-9]+)", roles=("actor", "critic"))
MEGATRON_LM = RunLayout("megatron_lm", "iter_{step:07d}", r"iter_([0-9]+)")
HF_TRAINER = RunLayout("hf_trainer", "checkpoint-{step}", r"checkpoint-([0-9]+)")
ACCELERATE = RunLayout("accelerate", "checkpoint_{step}", r"checkpoint_([0-9]+)")
TORCHTITAN = RunLayout("torchtitan", "step-{step}", r"step-([0-9]+)")
DEEPSPEED = RunLayout("deepspeed", "global_step{step}", r"global_step([0-9]+)")
NEMO_RL = RunLayout("nemo_rl", "step_{step}", r"step_([0-9]+)", roles=("policy",))

# THE registry of run layouts, in the order a step's folder is looked for
RUN_LAYOUTS: tuple[RunLayout, ...] = (VERL, MEGATRON_LM, HF_TRAINER, ACCELERATE, TORCHTITAN, NEMO_RL,
                                      DEEPSPEED)


def run_layout_of(name: str) -> RunLayout | None:
    """The first run layout that names a step folder ``name``; None when none does."""
    return next((layout for layout in RUN_LAYOUTS if layout.step_of(name) is not None), None)


def step_of_folder(name: str) -> int | None:
    """The step number the folder ``name`` gives under the first run layout that names it; else None."""
    layout = run_layout_of(name)
    return layout.step_of(name) if layout is not None else None


def step_folders(step: int) -> tuple[str, ...]:
    """The folder names ``step`` may have, one per run layout, in registry order."""
    return tuple(layout.folder(step) for layout in RUN_LAYOUTS)


def from_step_folder(url: str) -> str:
    """``url`` from its last step folder on (``s3://b/run/global_step_40/actor`` -> ``global_step_40/actor``),
    else its last component (``gs://b/some/model/`` -> ``model``)."""
    parts = [p for p in url.rstrip("/").split("/") if p]
    for position in range(len(parts) - 1, -1, -1):
        if step_of_folder(parts[position]) is not None:
            return "/".join(parts[position:])
    return parts[-1] if parts else url


def portable_url(url: str) -> str:
    """How a release names ``url`` wherever it is copied: an object store's URL as it is
    (``s3://b/run/global_step_3/actor``); a path of this machine by its path under the run root, i.e. from its
    last step folder on (``/data/run/global_step_3/actor/lora_train_meta.json`` ->
    ``global_step_3/actor/lora_train_meta.json``), else by its last component (``/models/Qwen2-0.5B`` ->
    ``Qwen2-0.5B``). A relative name is already portable and is returned as it is."""
    if not is_machine_path(url):
        return url
    path = url.split(":", 1)[1] if scheme_of(url) in LOCAL_SCHEMES else url
    return from_step_folder(path.replace("\\", "/"))


def portable_record(data: Any) -> Any:
    """``data`` (JSON-like: mappings, lists, strings, ...) with every string that is a path of this machine
    (`is_machine_path`) replaced by its `portable_url`; nothing else changes."""
    if isinstance(data, str):
        return portable_url(data) if is_machine_path(data) else data
    if isinstance(data, Mapping):
        return {key: portable_record(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [portable_record(value) for value in data]
    return data
