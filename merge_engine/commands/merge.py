"""One merge, end to end: checkpoint URL -> Hugging Face folder at a target URL (a `MergeJob`).

    check (listing + headers) -> config -> fingerprint -> target state -> open (lazy) -> plan -> write

Contract (`merge_engine.output.jobs.run_job` owns the order):
- Every check that can fail on metadata runs before the first output byte is written.
- The target receives a complete model or nothing: a local target is written to a sibling temp
  folder and renamed into place; a remote target is cleaned if the write fails.
- ``stepmerge.json`` (provenance: source, fingerprint, options, engine version) is written last, once
  a fresh listing of the checkpoint still equals the one fingerprinted (`check_unchanged`; the weights'
  reads are pinned to that listing, `storage.RangeReader.listed`): `SourceChanged` otherwise.
  A target whose provenance matches is left as it is (``skipped``); a target holding anything
  else raises `TargetExists` unless ``overwrite``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from merge_engine import engine_identity, storage
from merge_engine.plan.config_shapes import check_config_against_tensors
from merge_engine.plan.legacy_readers import legacy_reader_note
from merge_engine.errors import InvalidConfig, InvalidOption
from merge_engine.formats.hf_metadata import CONFIG_FILE, read_config
from merge_engine.plan import hub_format
from merge_engine.output.jobs import OutputOptions, OutputResult, PreparedJob, run_job
from merge_engine.output.executors import Executor
from merge_engine.output.shard_unit import shard_output
from merge_engine.layouts import Checkpoint, check_checkpoint, check_unchanged, open_checkpoint
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.plan.output_heads import check_dropped_head
from merge_engine.output.target import PROVENANCE_FILE, read_provenance
from merge_engine.planner import plan_checkpoint
from merge_engine.commands.input_folders import InputFolders
from merge_engine.commands.lora_alpha import one_lora_alpha
from merge_engine.commands.layout_jobs import jobs_of
from merge_engine.commands.adapter_fuse import prepare_fused_step, unused_base_note
from merge_engine.formats.tensor_source import TensorSource

__all__ = ["PROVENANCE_FILE", "MergeJob", "merge_checkpoint",
           "merge_fingerprint", "plan_stored_names", "read_provenance"]


def merge_fingerprint(checkpoint: Checkpoint, options: OutputOptions, inputs: InputFolders | None = None) -> str:
    """The cache key of a merge: the checkpoint's listing digest + output options + engine version, and the
    listing of ``hf_model_path`` when one replaces the checkpoint's config (its content decides the output), as
    the job's ``inputs`` list them."""
    inputs = inputs or InputFolders()
    extra: dict[str, object] = {}
    if options.base_model is not None:  # a LoRA step's base: its listing decides the output
        extra["base_model"] = {"url": options.base_model, "listing": inputs.digest(options.base_model)}
    if options.hf_model_path is not None:
        extra["hf_model_listing"] = inputs.digest(options.hf_model_path)
    return storage.fingerprint(checkpoint.files, **options.output_options("merge"), **extra, **engine_identity())


def plan_stored_names(checkpoint: Checkpoint, source: TensorSource, config: dict,
                      options: OutputOptions) -> MergePlan:
    """`merge_engine.planner.plan_checkpoint` with these options: the tensors under their stored names, in their
    stored dtypes, unsharded."""
    return plan_checkpoint(checkpoint, source, config, max_shard_size=None, tie_flag=options.tie_word_embedding,
                           lora_alpha=one_lora_alpha(options), custom_mapping=options.custom_mapping,
                           chunk_bytes=options.chunk_bytes, mtp_layers=options.mtp_layers)


@dataclass
class MergeJob:
    """``stepmerge merge``: the checkpoint at ``source_url`` -> a Hugging Face folder at ``target_url``.

    ``checkpoint``: the result of `check_checkpoint` for ``source_url`` when the caller already ran the
    completeness check (the Prefect check task); it is used as it is, not checked again.
    """

    source_url: str
    target_url: str
    options: OutputOptions
    checkpoint: Checkpoint | None = None
    command = "merge"
    kind = "model"

    def __post_init__(self) -> None:
        self._config: dict | None = None
        self._checked_as: tuple[Checkpoint, str, dict] | None = None
        self._fingerprint: str | None = None
        self.inputs = InputFolders()  # --hf_model_path, --base-model: listed once, read from that listing

    def _checked(self) -> tuple[Checkpoint, str, dict]:
        """The checked checkpoint, the folder its config comes from and that config (once)."""
        if self._checked_as is None:
            if self.checkpoint is None:
                self.checkpoint = check_checkpoint(self.source_url, self.options.backend)
            elif self.checkpoint.url.rstrip("/") != self.source_url.rstrip("/"):
                raise InvalidOption(f"the checked checkpoint is {self.checkpoint.url}, not the source", self.source_url)
            checkpoint = self.checkpoint
            jobs = jobs_of(checkpoint)  # a layout with its own semantics (imported only then: not free)
            if jobs is not None:
                config, hf_dir = jobs.step_config(checkpoint, self.options, self.inputs)
            else:
                hf_model_path, base_model = self.options.hf_model_path, self.options.base_model
                if hf_model_path:
                    config, hf_dir = self.inputs.config(hf_model_path, "checkpoint"), hf_model_path
                elif checkpoint.hf_dir is None and checkpoint.lora and base_model:  # an adapter saved alone: the base's
                    config, hf_dir = self.inputs.config(base_model, "base model"), base_model
                else:
                    config = read_config(checkpoint.hf_dir)  # InvalidConfig when it has none
                    hf_dir = checkpoint.hf_dir or ""
            self._config = config
            self._checked_as = (checkpoint, hf_dir, config)
        return self._checked_as

    def fingerprint(self) -> str:
        """`merge_fingerprint`, computed once per job (the pipeline's build asks first, then `run_job`)."""
        if self._fingerprint is None:
            checkpoint, _, _ = self._checked()
            self._fingerprint = merge_fingerprint(checkpoint, self.options, self.inputs)
        return self._fingerprint

    def prepare(self) -> PreparedJob:
        checkpoint, hf_dir, config = self._checked()
        jobs = jobs_of(checkpoint)  # a layout with its own semantics: its own job, or what the plan reads
        prepared = jobs.prepare_merge(checkpoint, self.options, self.source_url, self.inputs) if jobs is not None else None
        if prepared is not None:
            return prepared
        source = open_checkpoint(checkpoint)
        if jobs is None and checkpoint.lora and self.options.base_model:  # an adapter-only step: fused into the base
            try:
                fused = prepare_fused_step(checkpoint, source, config, hf_dir, self.options, self.source_url,
                                           self.inputs)
            except BaseException:
                source.close()
                raise
            if fused is not None:
                return fused
        if jobs is not None:
            try:
                source = jobs.merge_source(checkpoint, source, self.options)
            except BaseException:
                source.close()
                raise
        try:
            try:
                stored = plan_stored_names(checkpoint, source, config, self.options)
                check_config_against_tensors({**config, **stored.config_updates},  # the config is copied beside them
                                             ((t.name, t.shape) for t in stored.tensors),
                                             storage.join(hf_dir, CONFIG_FILE))
                check_dropped_head(source, stored, self.options.chunk_bytes, config)
            except InvalidConfig as refused:  # transformers' own verdict on the config names no file: this one
                if refused.path:
                    raise
                raise InvalidConfig(f"config.json: {refused.message}", storage.join(hf_dir, CONFIG_FILE)) from None
            options = self.options
            plan = hub_format.in_weights_format(stored.with_dtype(options.torch_dtype), config,
                                                options.weights_format, options.max_shard_size)
            if options.base_model is not None:  # a step holding its own base: said, not refused (the flows give
                # one base to every step of a run; extract-lora's base/ still uses it)
                plan = replace(plan, notes=plan.notes + (unused_base_note(options.base_model, hf_dir),))
        except BaseException:
            source.close()
            raise

        def metadata(url: str) -> list[tuple[str, int]]:
            files = self.inputs.copy_metadata(hf_dir, url, config, plan.config_updates)
            check_unchanged(checkpoint)  # every read done: the listing must still be the fingerprint's
            return files

        provenance = {"source": self.source_url, "layout": checkpoint.layout,
                      "options": self.options.output_options("merge"), "parallel": checkpoint.parallel,
                      "tensors": len(plan.tensors), "tensor_bytes": plan.total_size,
                      "config_translation": [change.to_json() for change in plan.config_changes],
                      **{k: v for k, v in plan.records.items() if k != "transformers_4"}}
        legacy = legacy_reader_note({**config, **plan.config_updates}) or plan.records.get("transformers_4")
        if legacy is not None:  # a family new in transformers 5: no 4.x reader builds it
            provenance["transformers_4"] = legacy
        return PreparedJob([shard_output(plan, source, then=metadata)], provenance, kind=self.kind,
                           layout=checkpoint.layout, notes=plan.notes, sources=[source],
                           written_notes=self.inputs.left_out)


def merge_checkpoint(source_url: str, target_url: str, options: OutputOptions = OutputOptions(), *,
                     on_bytes: Callable[[int], None] | None = None,
                     on_plan: Callable[[MergePlan], None] | None = None,
                     checkpoint: Checkpoint | None = None,
                     executor: Executor | None = None) -> OutputResult:
    """Merge the checkpoint at ``source_url`` into a Hugging Face folder at ``target_url`` (a `MergeJob`).
    ``executor``: where the shard jobs run (default: as ``options`` say, `merge_engine.output.executors.executor_at`)."""
    return run_job(MergeJob(source_url, target_url, options, checkpoint), on_bytes=on_bytes, on_plan=on_plan,
                   executor=executor)
