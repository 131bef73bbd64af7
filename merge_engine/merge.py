"""One merge, end to end: checkpoint URL -> Hugging Face folder at a target URL.

    check (listing + headers) -> config -> open (lazy) -> plan (metadata only) -> write -> metadata

Contract:
- Every check that can fail on metadata runs before the first output byte is written.
- The target receives a complete model or nothing: a local target is written to a sibling temp
  folder and renamed into place; a remote target is cleaned if the write fails.
- ``stepmerge.json`` (provenance: source, fingerprint, options, engine version) is written last.
  A target whose provenance matches is left as it is (``skipped``); a target holding anything
  else raises `TargetExists` unless ``overwrite``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from merge_engine import __version__, storage
from merge_engine.errors import InvalidOption
from merge_engine.hf_metadata import copy_metadata, read_config
from merge_engine.hub_format import DEFAULT_WEIGHTS_FORMAT, HUB, parse_weights_format, to_hub_format
from merge_engine.layouts import Checkpoint, check_checkpoint, open_checkpoint
from merge_engine.merge_plan import DEFAULT_MAX_SHARD_SIZE, MergePlan, parse_dtype
from merge_engine.output_heads import check_dropped_head
from merge_engine.output_target import PROVENANCE_FILE, read_provenance, target_state, write_target
from merge_engine.planner import plan_checkpoint
from merge_engine.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource
from merge_engine.writer import write_plan

__all__ = ["PROVENANCE_FILE", "MergeOptions", "MergeResult", "merge_checkpoint", "merge_fingerprint", "plan_merge"]


@dataclass(frozen=True)
class MergeOptions:
    """Options that shape the output (all part of the cache key) plus how to treat the target."""

    backend: str | None = None  # layout name; detected when None
    dtype: str | None = None  # output dtype; each tensor's stored dtype when None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    hf_model_path: str | None = None  # config/tokenizer folder overriding the checkpoint's own
    tie_word_embedding: bool | None = None  # verl's flag: may only confirm config.json
    lora_alpha: float | None = None  # for LoRA checkpoints whose run recorded no alpha (never guessed)
    custom_mapping: str | None = None  # Megatron: a JSON file extending the family's name table
    weights_format: str = DEFAULT_WEIGHTS_FORMAT  # "hub" (the Hub checkpoint's names) | "transformers" (as stored)
    overwrite: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def output_options(self) -> dict[str, object]:
        """The options that change the bytes written (for fingerprints and provenance)."""
        options: dict[str, object] = {"dtype": self.dtype, "max_shard_size": self.max_shard_size,
                                      "hf_model_path": self.hf_model_path,
                                      "weights_format": parse_weights_format(self.weights_format)}
        # only when set, so that the fingerprints of other merges stay as they were
        if self.lora_alpha is not None:
            options["lora_alpha"] = self.lora_alpha
        if self.custom_mapping is not None:  # its content, not just its name, decides the output
            try:
                content = storage.read_bytes(self.custom_mapping)
            except FileNotFoundError:
                raise InvalidOption("custom mapping file not found", self.custom_mapping) from None
            options["custom_mapping"] = {"url": self.custom_mapping, "sha256": hashlib.sha256(content).hexdigest()}
        return options


@dataclass(frozen=True)
class MergeResult:
    source_url: str
    target_url: str
    layout: str
    fingerprint: str
    tensors: int
    tensor_bytes: int
    files: tuple[tuple[str, int], ...]
    seconds: float
    skipped: bool = False
    notes: tuple[str, ...] = field(default=())


def merge_fingerprint(checkpoint: Checkpoint, options: MergeOptions) -> str:
    """The cache key of a merge: the checkpoint's listing digest + output options + engine version, and the
    listing of ``hf_model_path`` when one replaces the checkpoint's config (its content decides the output)."""
    extra = {}
    if options.hf_model_path is not None:
        extra["hf_model_listing"] = storage.fingerprint(storage.list_files(options.hf_model_path, recursive=False))
    return storage.fingerprint(checkpoint.files, **options.output_options(), **extra, engine=__version__)


def plan_merge(checkpoint: Checkpoint, source: TensorSource, config: dict, options: MergeOptions) -> MergePlan:
    """`plan_stored_names` in the requested weights format (`merge_engine.hub_format`)."""
    return in_weights_format(plan_stored_names(checkpoint, source, config, options), config, options)


def in_weights_format(plan: MergePlan, config: dict, options: MergeOptions) -> MergePlan:
    """``--weights-format hub`` (default): the Hub checkpoint's names; ``transformers``: as stored."""
    if parse_weights_format(options.weights_format) == HUB:
        return to_hub_format(plan, config, options.max_shard_size)
    return plan


def plan_stored_names(checkpoint: Checkpoint, source: TensorSource, config: dict,
                      options: MergeOptions) -> MergePlan:
    """`merge_engine.planner.plan_checkpoint` with these options: the tensors under their stored names."""
    return plan_checkpoint(checkpoint, source, config, dtype=parse_dtype(options.dtype),
                           max_shard_size=options.max_shard_size, tie_flag=options.tie_word_embedding,
                           lora_alpha=options.lora_alpha, custom_mapping=options.custom_mapping,
                           chunk_bytes=options.chunk_bytes)


def merge_checkpoint(source_url: str, target_url: str, options: MergeOptions = MergeOptions(), *,
                     on_bytes: Callable[[int], None] | None = None,
                     on_plan: Callable[[MergePlan], None] | None = None,
                     checkpoint: Checkpoint | None = None) -> MergeResult:
    """Merge the checkpoint at ``source_url`` into a Hugging Face folder at ``target_url``.

    ``checkpoint``: the result of `check_checkpoint` for ``source_url``, when the caller already ran
    the completeness check (the Prefect check task); it is used as it is, not checked again.
    """
    started = time.perf_counter()
    if checkpoint is None:
        checkpoint = check_checkpoint(source_url, options.backend)
    elif checkpoint.url.rstrip("/") != source_url.rstrip("/"):
        raise InvalidOption(f"the checked checkpoint is {checkpoint.url}, not the source", source_url)
    hf_dir = options.hf_model_path or checkpoint.hf_dir
    config = read_config(hf_dir)
    fingerprint = merge_fingerprint(checkpoint, options)
    state = target_state(target_url, fingerprint, options.overwrite)
    if state == "same":
        provenance = read_provenance(target_url) or {}
        return MergeResult(source_url, target_url, checkpoint.layout, fingerprint,
                           int(provenance.get("tensors", 0)), int(provenance.get("tensor_bytes", 0)),
                           tuple((e.path, e.size) for e in storage.list_files(target_url)),
                           time.perf_counter() - started, skipped=True)
    source = open_checkpoint(checkpoint)
    try:
        stored = plan_stored_names(checkpoint, source, config, options)
        check_dropped_head(source, stored, options.chunk_bytes, config)
        plan = in_weights_format(stored, config, options)
        if on_plan:
            on_plan(plan)

        def write(url: str) -> list[tuple[str, int]]:
            files = write_plan(plan, source, url, chunk_bytes=options.chunk_bytes, on_bytes=on_bytes).files
            return list(files) + copy_metadata(hf_dir, url, config, plan.config_updates)

        written = write_target(target_url, state, write, {
            "source": source_url, "layout": checkpoint.layout, "fingerprint": fingerprint,
            "engine_version": __version__, "options": options.output_options(), "parallel": checkpoint.parallel,
            "tensors": len(plan.tensors), "tensor_bytes": plan.total_size})
    finally:
        source.close()
    return MergeResult(source_url, target_url, checkpoint.layout, fingerprint, len(plan.tensors), plan.total_size,
                       tuple(written), time.perf_counter() - started, notes=plan.notes)
