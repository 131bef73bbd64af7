"""A verl Megatron LoRA step (`merge_engine.layouts.megatron_lora`) as an adapter release and as a fused model.

The step's adapter (`step_adapter`), under PEFT's Hugging Face names:
- with a PEFT folder (Megatron-Bridge's ``save_hf_adapter``): read AS IT IS (r, lora_alpha, rank /
  alpha patterns, target_modules: `merge_engine.lora.adapter_io.read_adapter`), and checked tensor for
  tensor, names and values, against the adapter in ``model/dist_ckpt`` converted by the family table
  (`merge_engine.lora.megatron_adapter`): an export that is not what was trained is refused;
- without one (``use_dist_checkpointing: true``, or no bridge export): built from ``model/dist_ckpt``
  exactly; r from the factors (``rank_pattern`` where a module differs), ``lora_alpha`` from
  ``--lora-alpha`` (such a step records none; it is never guessed).

Outputs (the layout's jobs: `merge_engine.commands.layout_jobs.LayoutJobs`):
- `prepare_adapter_release` (`prepare_extract`) (``extract-lora``, the pipeline's adapter stage): the adapter folder,
  ``adapter_config.json`` as the run wrote it (``base_model_name_or_path``: a name that resolves wherever the
  release is copied, `merge_engine.lora.base_name`, else the run's, a hint); checked against ``--base-model``'s shapes when one is given, and that base
  copied under ``base/`` (``include_base``) so PEFT can load the release alone;
  a step holding its base (``use_dist_checkpointing: true``) puts that base under ``base/`` instead: the
  step's Megatron weights with the adapter factors hidden (`StepBaseSource`), through the Megatron planner
  and the family table like any merge (`_step_base`), the adapter NOT applied;
- `prepare_fused_model` (`prepare_merge`: ``merge`` of an adapter-only step): the adapter fused into the base the user
  names (``--base-model``; the run's ``base_model_name_or_path`` is never used on its own), whose
  config must agree with the step's; `BaseModelRequired` without one;
- `merge_source` (``merge`` when the base is in the step): the canonical Megatron tensors
  with every update fused (W + (alpha / r) B @ A on the fused Megatron weight), for the Megatron planner.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from merge_engine.architectures import model_dims, table_for_config
from merge_engine.errors import AdapterError, BaseModelRequired, InvalidOption
from merge_engine.plan.hub_format import in_weights_format
from merge_engine.commands.base_copy import base_copy
from merge_engine.commands.input_folders import InputFolders
from merge_engine.commands.lora_alpha import one_lora_alpha
from merge_engine.output.jobs import OutputOptions, PreparedJob
from merge_engine.output.shard_unit import shard_output
from merge_engine.output.work_unit import PlannedOutput
from merge_engine.layouts import Checkpoint, open_checkpoint
from merge_engine.layouts.megatron_lora import adapter_folder
from merge_engine.lora.adapter_io import (
    Adapter,
    adapter_plan,
    check_fits_base,
    describe_adapter,
    read_adapter,
    read_adapter_config,
    with_base,
)
from merge_engine.lora.config import LoraSettings, adapter_config, rank_layout
from merge_engine.lora.base_name import adapter_base_name
from merge_engine.lora.keys import BASE_DIR
from merge_engine.layouts.runs import portable_record
from merge_engine.lora.same_model import check_same_model
from merge_engine.lora.fuse import BASE_NAMESPACE, WeightedAdapter, finite_or_raise, plan_fused_model
from merge_engine.lora.megatron_adapter import (
    GROUPED_EXPERTS,
    MegatronAdapterSource,
    adapter_ranks,
    is_adapter_factor,
)
from merge_engine.lora.sources import NamespacedSource
from merge_engine.plan.merge_plan import PlannedTensor
from merge_engine.formats.chunks import flat_slices
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorMeta, TensorSource

ADAPTER_NAMESPACE = "adapter0"


def step_config(checkpoint: Checkpoint, options: OutputOptions, inputs: InputFolders) -> tuple[dict[str, Any], str]:
    """The step's config.json (``--hf_model_path`` first; a ``use_dist_checkpointing`` step saves none, then
    ``--base-model``'s) and the folder it came from."""
    folder = options.hf_model_path or checkpoint.hf_dir or options.base_model
    if folder is None:
        raise InvalidOption("this LoRA step saved no config.json (use_dist_checkpointing): pass --hf_model_path or "
                            "--base-model (a folder with the model's config.json)", checkpoint.url)
    return inputs.config(folder, "checkpoint"), folder


def _megatron_adapter(checkpoint: Checkpoint, config: Mapping[str, Any]) -> MegatronAdapterSource:
    source = open_checkpoint(checkpoint)
    try:
        table = table_for_config(config)
        return MegatronAdapterSource(source, table, model_dims(config, table))
    except BaseException:
        source.close()
        raise


def _check_export(folder: str, exported: TensorSource, built: MegatronAdapterSource, chunk_bytes: int) -> None:
    """The PEFT export holds exactly the tensors of ``model/dist_ckpt``'s adapter (names, shapes, values)."""
    names, truth = set(exported.metas()), set(built.metas())
    if names != truth:
        extra, missing = sorted(names - truth), sorted(truth - names)
        raise AdapterError(f"the PEFT export and model/dist_ckpt disagree on the adapter's tensors ("
                           f"{len(extra)} only in the export, e.g. {extra[:1]}; {len(missing)} only in the "
                           f"checkpoint, e.g. {missing[:1]})", folder)
    for name in sorted(names):
        a, b = exported.read(name), built.read(name)
        if tuple(a.shape) != tuple(b.shape) or not torch.equal(a.to(b.dtype), b):
            raise AdapterError(f"{name} in the PEFT export differs from the adapter saved in model/dist_ckpt "
                               "(the export is not what was trained)", folder)


def step_adapter(checkpoint: Checkpoint, config: Mapping[str, Any], options: OutputOptions
                 ) -> tuple[Adapter, TensorSource, dict[str, Any], str]:
    """(adapter, its source, its adapter_config.json, where it came from); see the module docstring."""
    lora_alpha = one_lora_alpha(options)
    built = _megatron_adapter(checkpoint, config)
    folder = adapter_folder(checkpoint)
    try:
        if folder is not None:
            json = dict(read_adapter_config(folder))  # read once: the adapter's settings and the release's config
            adapter, exported = read_adapter(folder, lora_alpha=lora_alpha, config=json)
            try:
                _check_export(folder, exported, built, options.chunk_bytes)
            except BaseException:
                exported.close()
                raise
            built.close()
            if lora_alpha is not None:
                json["lora_alpha"] = lora_alpha
            return adapter, exported, json, "the run's PEFT export (checked against model/dist_ckpt)"
        if lora_alpha is None:
            raise AdapterError("this step records no lora_alpha (no PEFT export beside model/dist_ckpt): pass "
                               "--lora-alpha (the run's lora alpha; never guessed)", checkpoint.url)
        r, pattern = rank_layout(adapter_ranks(built.loras))
        targets = sorted({m.rsplit(".", 1)[-1] for m in adapter_ranks(built.loras)})
        json = adapter_config(r=r, lora_alpha=lora_alpha, target_modules=targets, rank_pattern=pattern,
                              task_type="CAUSAL_LM", base_model_name_or_path=options.base_model)
        adapter = describe_adapter(checkpoint.url, LoraSettings.from_config(json, checkpoint.url), built.metas())
        return adapter, built, json, "model/dist_ckpt (no PEFT export in the step)"
    except BaseException:
        built.close()
        raise


def _base(base_url: str, step: Mapping[str, Any], step_dir: str,
          inputs: InputFolders) -> tuple[TensorSource, dict[str, Any]]:
    """``--base-model``'s tensors and config, once its config is the step's model (`check_same_model`)."""
    config = inputs.config(base_url, "base model")
    check_same_model(step, step_dir, config, base_url)
    return inputs.open(base_url), config


def prepare_adapter_release(checkpoint: Checkpoint, options: OutputOptions, source_url: str,
                            inputs: InputFolders) -> PreparedJob:
    """The step's adapter folder, validated (see the module docstring); its config names the base as
    `merge_engine.lora.base_name.adapter_base_name` says (``base`` when written under ``base/``), else the
    run's own name made portable. ``inputs``: the job's input folders."""
    config, config_dir = step_config(checkpoint, options, inputs)
    adapter, source, json, origin = step_adapter(checkpoint, config, options)
    opened = [source]
    try:
        given: tuple[str, TensorSource] | None = None  # --base-model: its URL and its tensors
        if options.base_model is not None:
            base, _ = _base(options.base_model, config, config_dir, inputs)
            opened.append(base)
            check_fits_base(with_base(adapter, base.metas(), options.base_model), base.metas(), options.base_model)
            given = (options.base_model, base)
        dtype = options.torch_dtype
        tensors = [PlannedTensor(name, tuple(meta.shape), dtype or meta.dtype, name)
                   for name, meta in source.metas().items()]
        plan = adapter_plan(tensors)
        base_output = base_copy(options, *given, dtype, inputs) if options.include_base and given is not None else None
        if base_output is None and options.include_base and not checkpoint.adapter_only:
            base_output, base_source = _step_base(checkpoint, options, dtype, inputs)
            opened.append(base_source)
        # a name that resolves wherever the release is copied; the run's own when nothing better is known
        json["base_model_name_or_path"] = adapter_base_name(
            base_model_id=options.base_model_id, config=config, base_written=base_output is not None,
            base_model=options.base_model) or portable_record(json.get("base_model_name_or_path"))
    except BaseException:
        for handle in opened:
            handle.close()
        raise

    def config_file(url: str) -> list[tuple[str, int]]:
        from merge_engine.lora.adapter_io import write_adapter_config

        return [write_adapter_config(url, json)]

    ranks = sorted({m.rank for m in adapter.modules.values()})
    provenance = {"command": "extract-lora", "source": source_url, "layout": checkpoint.layout,
                  "options": options.output_options("extract-lora"), "adapter_from": origin,
                  "tensors": len(plan.tensors), "tensor_bytes": plan.total_size}
    notes = (f"adapter from {origin}", f"{len(adapter.modules)} LoRA modules, ranks {ranks}, "
             f"lora_alpha={adapter.settings.lora_alpha:g}")
    outputs = [shard_output(plan, source, then=config_file)] + ([base_output] if base_output else [])
    return PreparedJob(outputs, provenance, kind="adapter+base" if base_output else "adapter",
                       layout=checkpoint.layout, notes=notes, sources=opened, written_notes=inputs.left_out)


class StepBaseSource:
    """The step's canonical Megatron tensors without the adapter factors: the base the run trained from,
    exactly as saved (no update applied). Closing closes the wrapped source."""

    def __init__(self, source: TensorSource) -> None:
        self.url = source.url
        self._source = source
        self._metas = {n: m for n, m in source.metas().items() if not is_adapter_factor(n)}

    def metas(self) -> Mapping[str, TensorMeta]:
        return self._metas

    def read(self, name: str) -> torch.Tensor:
        if name not in self._metas:
            raise KeyError(name)
        return self._source.read(name)

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        if name not in self._metas:
            raise KeyError(name)
        return self._source.iter_chunks(name, max_bytes)

    def close(self) -> None:
        self._source.close()


def _step_base(checkpoint: Checkpoint, options: OutputOptions, dtype: torch.dtype | None,
               inputs: InputFolders) -> tuple[PlannedOutput, TensorSource]:
    """``base/`` of the adapter release of a step holding its base: the step's base weights (adapter hidden)
    planned by the Megatron planner as a merge would, in the requested weights format, config beside them; and
    the source it reads (the caller closes it)."""
    from merge_engine.planner import plan_checkpoint

    config, folder = step_config(checkpoint, options, inputs)
    source = StepBaseSource(open_checkpoint(checkpoint))
    try:
        stored = plan_checkpoint(checkpoint, source, config, max_shard_size=None,
                                 tie_flag=options.tie_word_embedding, custom_mapping=options.custom_mapping,
                                 chunk_bytes=options.chunk_bytes, mtp_layers=options.mtp_layers)
        plan = in_weights_format(stored.with_dtype(dtype), config, options.weights_format, options.max_shard_size)
    except BaseException:
        source.close()
        raise
    return shard_output(plan, source, BASE_DIR, then=lambda url: inputs.copy_metadata(folder, url, config,
                                                                                      plan.config_updates)), source


def prepare_fused_model(checkpoint: Checkpoint, options: OutputOptions, source_url: str,
                        inputs: InputFolders) -> PreparedJob:
    """The adapter of an adapter-only step fused into ``options.base_model`` (see the module docstring);
    ``inputs``: the job's input folders."""
    if options.base_model is None:
        hint = ""
        folder = adapter_folder(checkpoint)
        if folder is not None:
            recorded = read_adapter_config(folder).get("base_model_name_or_path")
            if recorded:
                hint = f" (the run's adapter_config.json names {recorded!r}: a hint, not used on its own)"
        raise BaseModelRequired("this step holds a LoRA adapter only (Megatron-Bridge PEFT, base weights not saved): "
                                f"pass --base-model URL, the Hugging Face model the run trained from{hint}; "
                                "or release the adapter alone with extract-lora", checkpoint.url)
    config, hf_dir = step_config(checkpoint, options, inputs)
    adapter, adapter_source, _, origin = step_adapter(checkpoint, config, options)
    sources: dict[str, TensorSource] = {ADAPTER_NAMESPACE: adapter_source}
    try:
        sources[BASE_NAMESPACE], base_config = _base(options.base_model, config, hf_dir, inputs)
        source = NamespacedSource(sources)
        plan = plan_fused_model(sources[BASE_NAMESPACE].metas(), base_config,
                                [WeightedAdapter(ADAPTER_NAMESPACE, adapter, 1.0)],
                                max_shard_size=None, base_url=options.base_model)
        plan = in_weights_format(plan.with_dtype(options.torch_dtype), base_config, options.weights_format,
                                 options.max_shard_size)
    except BaseException:
        for handle in sources.values():
            handle.close()
        raise
    metadata_dir = checkpoint.hf_dir or options.base_model

    def metadata(url: str) -> list[tuple[str, int]]:
        return inputs.copy_metadata(metadata_dir, url, inputs.config(metadata_dir, "checkpoint"), plan.config_updates)

    provenance = {"source": source_url, "layout": checkpoint.layout, "base_model": options.base_model,
                  "adapter_from": origin, "options": options.output_options("merge"),
                  "parallel": checkpoint.parallel, "tensors": len(plan.tensors), "tensor_bytes": plan.total_size}
    notes = plan.notes + (f"adapter from {origin}", f"base: {options.base_model}")
    return PreparedJob([shard_output(plan, source, then=metadata)], provenance, kind="model",
                       layout=checkpoint.layout, notes=notes, sources=[source], written_notes=inputs.left_out)


class TrainedMegatronSource:
    """Canonical Megatron tensors of a step holding base and adapter, every adapted weight replaced by
    ``W + (alpha / r) B @ A`` (computed in float32, stored in W's dtype); the adapter factors hidden.
    Memory: one weight at a time. Closing closes the wrapped source."""

    def __init__(self, source: TensorSource, lora_alpha: float, where: str | None) -> None:
        self.url = source.url
        self._source = source
        metas = source.metas()
        self._updates: dict[str, tuple[str, str, int | None, float]] = {}
        for name in metas:
            if not is_adapter_factor(name) or not name.endswith(".adapter.linear_in.weight"):
                continue
            module = name[:-len(".adapter.linear_in.weight")]
            out = f"{module}.adapter.linear_out.weight"
            if out not in metas:
                raise AdapterError(f"{module}: the adapter has no linear_out", where)
            rank = metas[name].shape[-2]
            grouped = GROUPED_EXPERTS.match(module)
            if grouped:
                for expert in range(metas[name].shape[0]):
                    weight = (f"{grouped.group('layer')}.mlp.experts.local_experts.{expert}."
                              f"{grouped.group('linear')}.weight")
                    self._updates[weight] = (name, out, expert, lora_alpha / rank)
            else:
                self._updates[f"{module}.weight"] = (name, out, None, lora_alpha / rank)
        missing = [w for w in self._updates if w not in metas]
        if missing:
            raise AdapterError(f"the adapter adapts {missing[0]}, which model/dist_ckpt does not hold", where)
        self._metas = {n: m for n, m in metas.items() if not is_adapter_factor(n)}

    def metas(self) -> Mapping[str, TensorMeta]:
        return self._metas

    def read(self, name: str) -> torch.Tensor:
        weight = self._source.read(name)
        if name not in self._updates:
            return weight
        a_name, b_name, expert, scale = self._updates[name]
        a, b = self._source.read(a_name), self._source.read(b_name)
        if expert is not None:
            a, b = a[expert], b[expert]
        a, b = a.to(torch.float32), b.to(torch.float32)
        finite_or_raise(a, f"linear_in of {name}", self.url)
        finite_or_raise(b, f"linear_out of {name}", self.url)
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(weight.shape):
            raise AdapterError(f"{name} {tuple(weight.shape)}: its adapter gives {tuple(b.shape[:1]) + tuple(a.shape[1:])}",
                               self.url)
        return (weight.to(torch.float32) + scale * (b @ a)).to(weight.dtype)

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        if name not in self._updates:
            yield from self._source.iter_chunks(name, max_bytes)
            return
        yield from flat_slices(self.read(name), max_bytes)

    def close(self) -> None:
        self._source.close()


def merge_source(checkpoint: Checkpoint, source: TensorSource, options: OutputOptions) -> TensorSource:
    """What the merge of a step holding its base plans from (`merge_engine.commands.layout_jobs.LayoutJobs`):
    ``source`` (the step's canonical tensors) with the adapter fused; `AdapterError` without ``--lora-alpha``."""
    lora_alpha = one_lora_alpha(options)
    if lora_alpha is None:
        raise AdapterError("this step (use_dist_checkpointing: base and adapter in model/dist_ckpt) records no "
                           "lora_alpha: pass --lora-alpha (the run's lora alpha; never guessed)", checkpoint.url)
    return TrainedMegatronSource(source, lora_alpha, checkpoint.url)


def prepare_merge(checkpoint: Checkpoint, options: OutputOptions, source_url: str,
                  inputs: InputFolders) -> PreparedJob | None:
    """The merge of an adapter-only step: its adapter fused into ``--base-model`` (`prepare_fused_model`); None
    for a step holding its base (planned from `merge_source`)."""
    return prepare_fused_model(checkpoint, options, source_url, inputs) if checkpoint.adapter_only else None


prepare_extract = prepare_adapter_release  # ``extract-lora`` of a step: the adapter as the run saved it
