"""Adapters out of training runs: from a PEFT-wrapped checkpoint, and by SVD from a full fine-tune.

From a checkpoint (`extract_lora`): a checkpoint of a PEFT-wrapped model (verl FSDP rank files:
``base_layer``, ``lora_A.default``, ``lora_B.default``, ``modules_to_save`` keys) becomes
- at the target: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``
  with PEFT's names), r and target_modules inferred from the tensors (per-module ranks ->
  ``rank_pattern``);
- at ``<target>/base/``: the clean base model (a Hugging Face folder) when asked for (``include_base``): the
  checkpoint's own base weights, else (a LoRA-only checkpoint) ``base_model``, the base the adapter is checked
  against (`merge_engine.commands.base_copy`).

``lora_alpha`` is never guessed (`merge_engine.lora.checkpoint` resolves it from the run, or the
caller's ``--lora-alpha``). What a plain ``stepmerge merge`` of such a checkpoint writes (the trained
model, every LoRA fused) is planned there too (`plan_trained_model`).

By SVD (`extract_lora_svd`): each target module's ``W_finetuned - W_base`` is factored to a rank (or
an energy threshold), on the GPU when there is one; the relative error of each module is reported,
and so is every other tensor the fine-tune changed (an adapter does not carry them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from merge_engine import engine_identity, storage
from merge_engine.errors import AdapterError, InvalidOption
from merge_engine.formats.hf_metadata import read_config
from merge_engine.plan.hf_plan import plan_hf_merge
from merge_engine.output.jobs import OutputOptions, OutputResult, PreparedJob, run_job
from merge_engine.output.executors import Executor
from merge_engine.output.shard_unit import shard_output
from merge_engine.layouts import (
    HF_NAMES, Checkpoint, check_checkpoint, layout_named, open_checkpoint,
)
from merge_engine.plan.hub_format import in_weights_format
from merge_engine.lora.adapter_io import adapter_plan, check_fits_base, write_adapter_config
from merge_engine.lora.checkpoint import RunLoraMetadata, base_shapes, is_lora_checkpoint, lora_records, plan_trained_model, read_run_metadata, resolve_checkpoint_lora, task_type_of
from merge_engine.lora.combine import TableFactor
from merge_engine.commands.base_copy import base_copy
from merge_engine.commands.input_folders import InputFolders
from merge_engine.commands.layout_jobs import jobs_of
from merge_engine.commands.lora_alpha import one_lora_alpha
from merge_engine.lora.config import adapter_config, infer_target_modules, rank_layout
from merge_engine.lora.extracted_config import extracted_adapter_config
from merge_engine.lora.finetune_delta import changed_tensors, select_modules
from merge_engine.lora.same_model import check_same_model
from merge_engine.lora.fuse import finite_or_raise
from merge_engine.lora.hub_names import check_exported_fits, export_adapter
from merge_engine.lora.base_name import adapter_base_name
from merge_engine.lora.keys import BASE_DIR, LORA_A, LORA_B, adapter_file_key
from merge_engine.lora.sources import RenamedSource
from merge_engine.lora.svd import AUTO, Factors, ModuleReport, check_targets, svd_device
from merge_engine.lora.svd_updates import factor_updates
from merge_engine.commands.adapter_target import inputs_fingerprint, module_reports_json
from merge_engine.plan.merge_plan import MergePlan, PlannedTensor
from merge_engine.plan.output_heads import check_dropped_head
from merge_engine.formats.tensor_source import TensorMeta, TensorSource


# ------------------------------------------------------------------------------------------------
# extract-lora from a checkpoint
# ------------------------------------------------------------------------------------------------


def extract_fingerprint(checkpoint: Checkpoint, options: OutputOptions, run: RunLoraMetadata | None = None,
                        inputs: InputFolders | None = None) -> str:
    """The cache key of an extraction: the checkpoint's listing, the options, the listings of ``base_model``
    and ``hf_model_path``, the run's LoRA metadata as read (alpha, r, adapter config) and the engine
    version. The metadata is read only from files the listing holds (``lora_train_meta.json``,
    ``adapter_config.json``, ``lora_adapter/adapter_config.json``: an FSDP listing includes
    ``lora_adapter/``), so a metadata file is keyed by its listing entry and its content. Reads the
    run's small JSON files unless ``run`` (their `read_run_metadata`) is given, never a weight. The
    pipeline publishes adapters under this very key. ``inputs``: the job's listings of its input folders."""
    inputs = inputs or InputFolders()
    extra: dict[str, str] = {}
    if options.base_model:
        extra["base_listing"] = inputs_fingerprint({"base": options.base_model}, folders=inputs)
    if options.hf_model_path:
        extra["hf_model_listing"] = inputs.digest(options.hf_model_path)
    run = read_run_metadata(checkpoint.url, checkpoint.files) if run is None else run
    return storage.fingerprint(checkpoint.files, **engine_identity(), **options.output_options("extract-lora"),
                               **extra, run_lora={"alpha": run.lora_alpha, "r": run.r, "config": run.config})


@dataclass
class ExtractJob:
    """``stepmerge extract-lora --local_dir``: the checkpoint's adapter at ``target_url`` (and its clean
    base under ``base/``). The adapter's config names its base so that the name resolves wherever the folder is
    copied (`merge_engine.lora.base_name.adapter_base_name`: a Hub id, else ``base``), never the folder it is
    written to (the pipeline's staging dies with the publish). The model's config is ``hf_model_path``'s, else the
    one saved with the checkpoint, else (an adapter-only step saved without one: HF Trainer's save of a PEFT model)
    ``base_model``'s. A ``base_model`` whose config is not that model is refused before anything is read
    (`merge_engine.lora.same_model.check_same_model`: InvalidConfig naming both config files)."""

    source_url: str
    target_url: str
    options: OutputOptions
    checkpoint: Checkpoint | None = None  # already checked (the pipeline's check stage): not checked again
    command = "extract-lora"
    kind = "adapter"

    def __post_init__(self) -> None:
        self._fingerprint: str | None = None
        self._run: RunLoraMetadata | None = None
        self.inputs = InputFolders()  # --hf_model_path, --base-model: listed once, read from that listing

    def _checked(self) -> Checkpoint:
        if self.checkpoint is None:
            self.checkpoint = check_checkpoint(self.source_url, self.options.backend)
        elif self.checkpoint.url.rstrip("/") != self.source_url.rstrip("/"):
            raise InvalidOption(f"the checked checkpoint is {self.checkpoint.url}, not the source", self.source_url)
        return self.checkpoint

    def _run_metadata(self) -> RunLoraMetadata:
        """The run's LoRA metadata (`read_run_metadata` of the checked listing), read once per job: the fingerprint
        keys on it and `prepare` resolves the adapter from it."""
        if self._run is None:
            checkpoint = self._checked()
            self._run = read_run_metadata(checkpoint.url, checkpoint.files)
        return self._run

    def fingerprint(self) -> str:
        """`extract_fingerprint`, computed once per job (the pipeline's build asks first, then `run_job`)."""
        if self._fingerprint is None:
            self._fingerprint = extract_fingerprint(self._checked(), self.options, self._run_metadata(), self.inputs)
        return self._fingerprint

    def prepare(self) -> PreparedJob:
        checkpoint, options = self._checked(), self.options
        jobs = jobs_of(checkpoint)
        if jobs is not None:  # a layout with its own semantics (a Megatron LoRA step: the adapter as saved)
            return jobs.prepare_extract(checkpoint, options, self.source_url, self.inputs)
        source = open_checkpoint(checkpoint)
        opened: list[TensorSource] = [source]
        try:
            return self._prepare(checkpoint, options, source, opened)
        except BaseException:
            for handle in opened:
                handle.close()
            raise

    def _prepare(self, checkpoint: Checkpoint, options: OutputOptions, source: TensorSource,
                 opened: list[TensorSource]) -> PreparedJob:
        if options.hf_model_path:
            hf_dir, config = options.hf_model_path, self.inputs.config(options.hf_model_path, "checkpoint")
        elif checkpoint.hf_dir is None and options.base_model is not None:  # saved without a config: the base's
            hf_dir, config = options.base_model, self.inputs.config(options.base_model, "base model")
        else:
            config = read_config(checkpoint.hf_dir)  # InvalidConfig when it has none
            hf_dir = checkpoint.hf_dir or ""
        lora = resolve_checkpoint_lora(checkpoint.url, checkpoint.files, source.metas(), one_lora_alpha(options),
                                      config, run=self._run_metadata())
        base_view = RenamedSource(source, lora.keys.base) if lora.keys.base else None
        given: TensorSource | None = None  # --base-model's tensors
        if options.base_model is not None:
            check_same_model(config, hf_dir, self.inputs.config(options.base_model, "base model"), options.base_model)
            given = self.inputs.open(options.base_model)
            opened.append(given)
            check_base_metas, check_url = given.metas(), options.base_model
        elif base_view is not None:
            check_base_metas, check_url = base_view.metas(), checkpoint.url
        else:
            raise AdapterError("this checkpoint holds only LoRA weights: pass --base-model URL (the model it was "
                               "trained from) to check the adapter against", checkpoint.url)
        if base_view is not None:
            check_fits_base(lora.adapter, base_view.metas(), checkpoint.url)
        dtype = options.torch_dtype
        base_plan = None
        if base_view is not None:  # metadata only; written when asked
            stored = plan_hf_merge(base_view.metas(), config, max_shard_size=None, config_url=hf_dir)
            check_dropped_head(base_view, stored, options.chunk_bytes, config)
            base_plan = in_weights_format(stored.with_dtype(dtype), config, options.weights_format,
                                          options.max_shard_size)
        exported = export_adapter(lora.adapter.modules, lora.adapter.experts, lora.keys.trained_copies,
                                  lora.adapter.metas, base_shapes(lora.keys, lora.adapter.metas, config), config,
                                  options.weights_format, dtype, checkpoint.url)
        if base_plan is not None and options.base_model is None:
            check_base_metas = {t.name: TensorMeta(t.name, t.shape, t.dtype) for t in base_plan.tensors}
        check_exported_fits(exported, check_base_metas, checkpoint.url, check_url)
        base_output = None  # the clean base under base/, when it is written: the step's own, else the one given
        if options.include_base and base_plan is not None and base_view is not None:
            base_output = shard_output(base_plan, base_view, BASE_DIR,
                                       then=lambda url: self.inputs.copy_metadata(hf_dir, url, config,
                                                                                  base_plan.config_updates))
        elif options.include_base and options.base_model is not None and given is not None:
            base_output = base_copy(options, options.base_model, given, dtype, self.inputs)
        base_written = base_output.plan if base_output is not None else None
        base_out = adapter_base_name(base_model_id=options.base_model_id, config=config,
                                     base_written=base_output is not None, base_model=options.base_model)
        plan = adapter_plan(list(exported.tensors))
        adapter_json = extracted_adapter_config(lora, exported, task_type_of(config, lora.run.task_type), base_out,
                                                config)
        outputs = [shard_output(plan, source, then=lambda url: [write_adapter_config(url, adapter_json)])]
        plans = [plan]
        if base_output is not None and base_written is not None:
            outputs.append(base_output)
            plans.append(base_written)
        provenance = {"command": "extract-lora", "source": self.source_url, "layout": checkpoint.layout,
                      "options": options.output_options("extract-lora"), "lora_alpha_from": lora.alpha_from,
                      "tensors": sum(len(p.tensors) for p in plans), "tensor_bytes": sum(p.total_size for p in plans),
                      **lora_records(lora)}
        if base_written is not None:  # base/config.json in the Hub's form: the keys added for transformers 4.x readers
            provenance["base_config_translation"] = [change.to_json() for change in base_written.config_changes]
        notes = (f"lora_alpha={lora.adapter.settings.lora_alpha:g} from {lora.alpha_from}",
                 f"{len(exported.ranks)} LoRA modules, ranks {sorted(set(exported.ranks.values()))}") + exported.notes
        return PreparedJob(outputs, provenance, kind="adapter+base" if base_written is not None else "adapter",
                           layout=checkpoint.layout, notes=notes, sources=opened, written_notes=self.inputs.left_out)


def extract_lora(checkpoint_url: str, target_url: str, options: OutputOptions = OutputOptions(), *,
                 on_bytes: Callable[[int], None] | None = None,
                 on_plan: Callable[[MergePlan], None] | None = None,
                 checkpoint: Checkpoint | None = None,
                 executor: Executor | None = None) -> OutputResult:
    """Write the checkpoint's adapter at ``target_url`` (and its clean base under ``base/``): an `ExtractJob`.
    ``checkpoint``: the result of an earlier `check_checkpoint` of ``checkpoint_url``, not repeated;
    ``executor``: where the shard jobs run (default: the one the options ask for)."""
    return run_job(ExtractJob(checkpoint_url, target_url, options, checkpoint), on_bytes=on_bytes, on_plan=on_plan,
                   executor=executor)


# ------------------------------------------------------------------------------------------------
# extract-lora by SVD from a full fine-tune
# ------------------------------------------------------------------------------------------------

SVD_REVISION = 2  # the factoring's revision (2: randomized SVD where it serves): other factors, same errors


def svd_extract_fingerprint(base_url: str, finetuned_url: str, options: OutputOptions,
                            inputs: InputFolders | None = None) -> str:
    """The cache key of an SVD extraction: both folders' listings (``inputs``: the job's), the options, the engine
    version and the factoring's revision (`SVD_REVISION`)."""
    return inputs_fingerprint({"base": base_url, "finetuned": finetuned_url}, folders=inputs,
                              svd_revision=SVD_REVISION, **options.output_options("extract-lora --finetuned"))


@dataclass
class SvdExtractJob:
    """``stepmerge extract-lora --finetuned``: each target module's (finetuned - base) factored into a PEFT
    adapter at ``target_url``.

    ``base_url``: a Hugging Face folder. ``source_url`` (the fine-tune): a Hugging Face folder or any
    checkpoint whose tensors carry Hugging Face names (a verl FSDP checkpoint: no merge needed first).
    Updates are read ahead and factored in batches of one shape (`merge_engine.lora.svd_updates`: a few
    updates read ahead plus one batch per shape in memory, and the factors found so far). ``svd_method``:
    `merge_engine.lora.svd.METHODS` (``full``: every module by the full SVD, as before the randomized method).
    """

    base_url: str
    source_url: str
    target_url: str
    options: OutputOptions
    on_module: Callable[[ModuleReport], None] | None = None
    svd_method: str = AUTO
    command = "extract-lora --finetuned"
    kind = "adapter"

    def __post_init__(self) -> None:
        self.inputs = InputFolders()  # the base and the fine-tune: listed once, read from that listing

    def fingerprint(self) -> str:
        check_targets(self.options.rank, self.options.energy)
        svd_device(self.options.device)  # a device this machine cannot use fails before anything is read
        return svd_extract_fingerprint(self.base_url, self.source_url, self.options, self.inputs)

    def prepare(self) -> PreparedJob:
        options, finetuned_url, base_url = self.options, self.source_url, self.base_url
        dtype = options.torch_dtype or torch.float32
        tuned_checkpoint = check_checkpoint(finetuned_url, options.backend, self.inputs.files(finetuned_url))
        if layout_named(tuned_checkpoint.layout).tensor_naming != HF_NAMES:
            raise AdapterError(f"a {tuned_checkpoint.layout} checkpoint's tensors are not Hugging Face tensors: "
                               "merge it first (`stepmerge merge`), then extract from the merged folder", finetuned_url)
        base = self.inputs.open(base_url)
        try:
            tuned = open_checkpoint(tuned_checkpoint)
        except BaseException:
            base.close()
            raise
        try:
            return self._prepare(base, tuned, tuned_checkpoint, dtype)
        except BaseException:
            base.close()
            tuned.close()
            raise

    def _prepare(self, base: TensorSource, tuned: TensorSource, tuned_checkpoint: Checkpoint,
                 dtype: torch.dtype) -> PreparedJob:
        options, finetuned_url, base_url = self.options, self.source_url, self.base_url
        config = read_config(tuned_checkpoint.hf_dir, what="fine-tuned model")
        bm, tm = base.metas(), tuned.metas()
        reshaped = [n for n in bm if n in tm and tuple(bm[n].shape) != tuple(tm[n].shape)]
        candidates = [n[: -len(".weight")] for n in bm if n.endswith(".weight") and n in tm
                      and len(bm[n].shape) == 2 and n not in reshaped]
        modules = select_modules(candidates, options.target_modules, finetuned_url)
        bad = [n for n in reshaped if n[: -len(".weight")] in set(modules)]
        if bad:
            raise AdapterError(f"{bad[0]} is {tuple(bm[bad[0]].shape)} in the base, {tuple(tm[bad[0]].shape)} in "
                               "the fine-tune", finetuned_url)
        device = svd_device(options.device)

        def read_update(module: str) -> torch.Tensor | None:
            name = f"{module}.weight"
            delta = tuned.read(name).to(torch.float32) - base.read(name).to(torch.float32)
            finite_or_raise(delta, name, finetuned_url)
            return delta if bool(delta.any()) else None

        def on_factors(module: str, factors: Factors | None) -> None:
            if factors is not None and self.on_module:
                self.on_module(ModuleReport(module, factors.rank, factors.relative_error))

        found = factor_updates(modules, read_update, rank=options.rank, energy=options.energy, device=device,
                               method=self.svd_method, on_factors=on_factors)
        table: dict[str, Factors] = {m: f for m, f in found.items() if f is not None}
        unchanged = [m for m, f in found.items() if f is None]
        reports = [ModuleReport(m, f.rank, f.relative_error) for m, f in table.items()]
        if not table:
            raise AdapterError("the fine-tuned model equals the base on every target module: nothing to extract",
                               finetuned_url)
        others = [n for n in bm if n in tm and n not in reshaped and n[: -len(".weight")] not in set(modules)]
        changed = changed_tensors(base, tuned, others, options.chunk_bytes)
        tensors = []
        for module, factors in table.items():
            out_features, in_features = factors.b.shape[0], factors.a.shape[1]
            tensors.append(PlannedTensor(adapter_file_key(module, LORA_A, False), (factors.rank, in_features), dtype,
                                         "", TableFactor(table, module, "a")))
            tensors.append(PlannedTensor(adapter_file_key(module, LORA_B, False), (out_features, factors.rank), dtype,
                                         "", TableFactor(table, module, "b")))
        plan = adapter_plan(tensors)
        r, pattern = rank_layout({m: f.rank for m, f in table.items()})
        adapter_json = adapter_config(r=r, lora_alpha=r, rank_pattern=pattern,
                                      alpha_pattern={k: float(v) for k, v in pattern.items()},
                                      target_modules=infer_target_modules(table, set(candidates)),
                                      task_type=task_type_of(config), base_model_name_or_path=adapter_base_name(
                                          base_model_id=options.base_model_id, config=config, base_written=False,
                                          base_model=base_url))
        notes = [f"{len(unchanged)} target modules unchanged (left out)"] if unchanged else []
        notes += [f"{len(reshaped)} tensors change shape (not in the adapter): {', '.join(reshaped[:5])}"] \
            if reshaped else []
        if changed:
            listed = ", ".join(f"{n} (max |diff| {d:.3g})" for n, d in changed[:5])
            notes.append(f"{len(changed)} other tensors changed but are not LoRA targets (the adapter does not "
                         f"carry them): {listed}{' ...' if len(changed) > 5 else ''}")
        provenance = {"command": "extract-lora --finetuned", "base": base_url, "finetuned": finetuned_url,
                      "options": options.output_options(self.command), "device": str(device),
                      "svd_methods": dict(Counter(f.method for f in table.values())),
                      "tensors": len(plan.tensors), "tensor_bytes": plan.total_size,
                      "svd": module_reports_json(reports), "notes": notes}
        output = shard_output(plan, tuned, then=lambda url: [write_adapter_config(url, adapter_json)])
        return PreparedJob([output], provenance, kind="adapter", notes=tuple(notes), modules=tuple(reports),
                           sources=[base, tuned])


def extract_lora_svd(base_url: str, finetuned_url: str, target_url: str,
                     options: OutputOptions = OutputOptions(), *,
                     on_module: Callable[[ModuleReport], None] | None = None) -> OutputResult:
    """Factor each target module's (finetuned - base) into a PEFT adapter at ``target_url`` (`SvdExtractJob`)."""
    return run_job(SvdExtractJob(base_url, finetuned_url, target_url, options, on_module))


__all__ = ["ExtractJob", "SvdExtractJob", "extract_fingerprint", "extract_lora",
           "extract_lora_svd", "is_lora_checkpoint", "plan_trained_model", "svd_extract_fingerprint"]
