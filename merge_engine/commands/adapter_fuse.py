"""``merge --base-model`` of an adapter-only LoRA step: the step's adapter fused into the base model the user names.

An adapter-only step (verl's ``save_lora_only`` rank files, HF Trainer's DCP ``adapter_only`` save, HF Trainer's
ZeRO save of a PEFT model) holds the LoRA factors (and any trained copies) and no base weight. Its adapter is
resolved as ``extract-lora`` resolves it (`merge_engine.lora.checkpoint.resolve_checkpoint_lora`: ranks, alpha
from the run's records or ``--lora-alpha``, never guessed), then fused into ``--base-model`` as ``merge-lora`` fuses
an adapter (`merge_engine.lora.fuse.plan_fused_model`: W + scale * B @ A, streamed tensor by tensor from the two
sources). The base must be the model the step trained: when the step has its own config (saved with it, or
``--hf_model_path``), the base's ``config.json`` is checked against it first (`merge_engine.lora.same_model`); the
base's ``config.json`` is the one written.

A step holding its own base (full weights) is merged from them alone: ``--base-model`` is not read there (the flows
pass one base for every step of a run), and `unused_base_note` says so in the job's notes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from merge_engine.commands.input_folders import InputFolders
from merge_engine.commands.lora_alpha import one_lora_alpha
from merge_engine.formats.tensor_source import TensorSource
from merge_engine.layouts import Checkpoint, check_unchanged
from merge_engine.lora.checkpoint import lora_records, resolve_checkpoint_lora, split_checkpoint
from merge_engine.lora.fuse import BASE_NAMESPACE, WeightedAdapter, plan_fused_model
from merge_engine.lora.same_model import check_same_model
from merge_engine.lora.sources import NamespacedSource
from merge_engine.output.jobs import OutputOptions, PreparedJob
from merge_engine.output.shard_unit import shard_output
from merge_engine.plan.hub_format import in_weights_format

ADAPTER_NAMESPACE = "adapter0"


def prepare_fused_step(checkpoint: Checkpoint, source: TensorSource, config: dict[str, Any], metadata_dir: str,
                       options: OutputOptions, source_url: str, inputs: InputFolders) -> PreparedJob | None:
    """The fused model of an adapter-only step into ``options.base_model``; None when the step holds its base
    (the plain merge fuses into that). ``source``: the opened step (closed with the job, or here on a refusal);
    ``config``: the model's config (the step's, else the base's); ``metadata_dir``: the folder ``config`` came
    from, whose tokenizer and other metadata files the release carries.

    Raises:
        AdapterError: no LoRA in the step, an adapter that does not fit the base, alpha not known.
        InvalidConfig: the base has no readable config.json, or it is not the step's model (`check_same_model`).
    """
    assert options.base_model is not None
    if split_checkpoint(source.metas(), checkpoint.url).base:  # names only: nothing read for a step with its base
        return None
    base_config = inputs.config(options.base_model, "base model")
    check_same_model(config, metadata_dir, base_config, options.base_model)
    lora = resolve_checkpoint_lora(checkpoint.url, checkpoint.files, source.metas(), one_lora_alpha(options), config)
    base = inputs.open(options.base_model)
    fused = NamespacedSource({BASE_NAMESPACE: base, ADAPTER_NAMESPACE: source})
    try:
        stored = plan_fused_model(base.metas(), base_config, [WeightedAdapter(ADAPTER_NAMESPACE, lora.adapter, 1.0)],
                                  max_shard_size=None, base_url=options.base_model,
                                  tie_flag=options.tie_word_embedding)
        plan = in_weights_format(stored.with_dtype(options.torch_dtype), base_config, options.weights_format,
                                 options.max_shard_size)
    except BaseException:
        base.close()
        raise
    def metadata(url: str) -> list[tuple[str, int]]:
        files = inputs.copy_metadata(metadata_dir, url, base_config, plan.config_updates)
        check_unchanged(checkpoint)  # every read done: the listing must still be the fingerprint's
        return files

    note = (f"LoRA fused into --base-model {options.base_model} (lora_alpha={lora.adapter.settings.lora_alpha:g} "
            f"from {lora.alpha_from}; {len(lora.adapter.modules)} modules, {len(lora.keys.trained_copies)} trained "
            "copies)")
    provenance = {"source": source_url, "layout": checkpoint.layout, "base_model": options.base_model,
                  "options": options.output_options("merge"), "parallel": checkpoint.parallel,
                  "tensors": len(plan.tensors), "tensor_bytes": plan.total_size,
                  "config_translation": [change.to_json() for change in plan.config_changes],
                  **lora_records(lora)}
    plan = replace(plan, notes=plan.notes + (note,))  # the plan's notes: the CLI prints them with the plan
    return PreparedJob([shard_output(plan, fused, then=metadata)], provenance, kind="model",
                       layout=checkpoint.layout, notes=plan.notes, sources=[fused], written_notes=inputs.left_out)


def unused_base_note(base_model: str, config_dir: str) -> str:
    """The note of a merge given ``--base-model`` for a step that holds its own base (full weights), merged from
    them alone; ``config_dir``: the folder the merge's config.json came from (the base's, when the step saved none).
    """
    if config_dir.rstrip("/") == base_model.rstrip("/"):
        return (f"--base-model {base_model}: only its config.json used (the step saved none); its weights were not "
                "used: the step holds full weights (its own base)")
    return (f"--base-model {base_model} not used: the step holds full weights (its own base), merged from them "
            "alone")
