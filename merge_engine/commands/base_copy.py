"""The base model an operator gives (``--base-model``) written under ``base/`` of an adapter release, so that PEFT
loads the release alone (``PeftModel.from_pretrained(<release>/base, <release>)``).

`base_copy` plans the given base's tensors as a merge of a Hugging Face folder would (`plan_hf_merge`), casts them
to the requested dtype, names them in the requested weights format (`in_weights_format`) and writes its
``config.json``, tokenizer and other files beside them (`InputFolders.copy_metadata`). Used by every adapter
release whose step holds no base weights (a Megatron LoRA step, verl's LoRA-only save, HF Trainer's adapter-only
save).
"""

from __future__ import annotations

import torch

from merge_engine.commands.input_folders import InputFolders
from merge_engine.formats.tensor_source import TensorSource
from merge_engine.lora.keys import BASE_DIR
from merge_engine.output.jobs import OutputOptions
from merge_engine.output.shard_unit import shard_output
from merge_engine.output.work_unit import PlannedOutput
from merge_engine.plan.hf_plan import plan_hf_merge
from merge_engine.plan.hub_format import in_weights_format


def base_copy(options: OutputOptions, base_url: str, base: TensorSource, dtype: torch.dtype | None,
              inputs: InputFolders) -> PlannedOutput:
    """``--base-model`` under ``base/`` of an adapter release.

    Args:
        options: the job's options (``weights_format``, ``max_shard_size``).
        base_url: the base model's folder (its ``config.json`` and other files are copied from it).
        base: the base model's tensors (opened from ``base_url``; the caller closes it).
        dtype: the dtype the tensors are written in (None: as stored).
        inputs: the job's input folders (``base_url``'s config read from its listing).

    Returns:
        The output writing ``base/``; its ``plan`` is the planned base (tensors as the Hub names them).

    Raises:
        InvalidConfig: ``base_url`` holds no readable ``config.json``.
    """
    config = inputs.config(base_url, "base model")
    stored = plan_hf_merge(base.metas(), config, max_shard_size=None, config_url=base_url)
    plan = in_weights_format(stored.with_dtype(dtype), config, options.weights_format, options.max_shard_size)
    return shard_output(plan, base, BASE_DIR, then=lambda url: inputs.copy_metadata(base_url, url, config,
                                                                                    plan.config_updates))
