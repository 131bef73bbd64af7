"""Output jobs: every command that writes a model or an adapter is one `OutputJob`, run by `run_job`.

    fingerprint (metadata only) -> target state -> prepare (check, open, plan) -> write -> stepmerge.json

Contract of `run_job`:
- ``job.fingerprint()`` decides the cache key from listings, small JSON files and the output options
  (`OutputOptions.output_options`), never from weights. Every command's fingerprint is exported
  (`merge_engine.commands.merge.merge_fingerprint`, `merge_engine.commands.extract.extract_fingerprint`, ...), so
  the Prefect tasks use the engine's own key.
- the target's state (`merge_engine.output.target.target_state`): a target overlapping any input
  (`job_inputs`) is refused (`TargetOverlapsSource`), whatever ``overwrite``; a target whose ``stepmerge.json``
  records this fingerprint and whose files are all there is left as it is (``skipped``); one holding
  anything else raises `TargetExists` unless ``overwrite``.
- ``job.prepare()`` runs every check that can fail on metadata, opens the sources and plans; it reads
  weights only where a check or a factorisation must (tied copies, SVD). Nothing is written before.
- the write: each `PlannedOutput` (one folder of the target: its work units, `merge_engine.output.work_unit`) is
  handed to the executor the options name (`merge_engine.output.executors`' registry: threads here, or a Ray
  cluster); then the job's own files (configs, adapter config,
  Megatron files); then ``stepmerge.json`` (provenance), last. The target gets everything or nothing.
- one result type, `OutputResult`, for every command.

Scale-out plugs in at the executor: a plan's ``shards`` are independent units (each lists its tensors;
the index is written from the plan), so an executor writes them in parallel, here or on a cluster,
with the same bytes; each unit hashes what it writes (`OutputResult.checksums`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from merge_engine import __version__, engine_identity, storage
from merge_engine.errors import InvalidOption
from merge_engine.option_values import (
    DEFAULT_MAX_SHARD_SIZE, DEFAULT_WEIGHTS_FORMAT, DTYPES, WEIGHTS_FORMATS, Dtype, WeightsFormat,
)
from merge_engine.options import OUTPUTS, recorded_by, recorded_fields, setting
from merge_engine.layouts.runs import portable_record
from merge_engine.lora.svd import ModuleReport
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.output.target import read_provenance, target_state, write_target
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource
from merge_engine.output.executors import Executor, WrittenFiles, executor_address, executor_at
from merge_engine.output.work_unit import Files, PlannedOutput
from merge_engine.storage.sha256 import sha256_of

__all__ = ["OutputJob", "OutputOptions", "OutputResult", "job_inputs",
           "PreparedJob", "run_job"]


MERGE, EXTRACT, EXTRACT_SVD, MERGE_LORA, SPLIT = OUTPUTS  # the outputs whose records name the fields below
TORCH_DTYPES: dict[Dtype, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}  # `Dtype` -> torch's


@dataclass(frozen=True)
class OutputOptions:
    """The engine's one options record: what every command may be asked (the CLI and the tasks build it).

    Each command reads the fields that concern it. A field's `recorded` marker names the outputs
    (`merge_engine.options.OUTPUTS`) whose fingerprint and provenance record it, always or only when set:
    `output_options` reads them. Values are as the engine takes them, made canonical where they were given
    (``dtype`` a `Dtype`, ``max_shard_size`` in bytes); a value of the wrong form is refused here. A command
    casts to ``torch_dtype``, the torch dtype of ``dtype`` (recorded by its name).

    Raises:
        InvalidOption: ``dtype`` is not one of `DTYPES`, ``weights_format`` not one of `WEIGHTS_FORMATS`, or
            ``max_shard_size`` is not a positive number of bytes.
    """

    backend: str | None = setting(None, recorded_by(EXTRACT, EXTRACT_SVD))
    tie_word_embedding: bool | None = None
    dtype: Dtype | None = setting(None, recorded_by(*OUTPUTS))
    max_shard_size: int = setting(DEFAULT_MAX_SHARD_SIZE, recorded_by(MERGE, EXTRACT, MERGE_LORA))
    hf_model_path: str | None = setting(None, recorded_by(MERGE, EXTRACT))
    custom_mapping: str | None = setting(None, recorded_by(SPLIT, when_set=(MERGE,)))
    weights_format: WeightsFormat = setting(DEFAULT_WEIGHTS_FORMAT, recorded_by(MERGE, EXTRACT, MERGE_LORA))
    mtp_layers: Literal["export", "drop"] | None = setting(None, recorded_by(when_set=(MERGE,)))
    include_base: bool = setting(True, recorded_by(EXTRACT, key="write_base"))
    lora_alpha: float | tuple[float, ...] | None = setting(None, recorded_by(EXTRACT, MERGE_LORA, when_set=(MERGE,)))
    base_model: str | None = setting(None, recorded_by(EXTRACT))
    base_model_id: str | None = setting(None, recorded_by(when_set=(EXTRACT, MERGE_LORA)))
    method: Literal["concat", "weighted", "average"] = setting("concat", recorded_by(MERGE_LORA))
    weights: tuple[float, ...] | None = setting(None, recorded_by(MERGE_LORA))
    output: Literal["model", "adapter"] = setting("model", recorded_by(MERGE_LORA))
    rank: int | None = setting(None, recorded_by(EXTRACT_SVD, MERGE_LORA))
    energy: float | None = setting(None, recorded_by(EXTRACT_SVD, MERGE_LORA))
    target_modules: tuple[str, ...] | None = setting(None, recorded_by(EXTRACT_SVD))
    tp: int = setting(1, recorded_by(SPLIT))
    pp: int = setting(1, recorded_by(SPLIT))
    vpp: int | None = setting(None, recorded_by(SPLIT))
    ep: int = setting(1, recorded_by(SPLIT))
    format: Literal["legacy", "dist"] = setting("legacy", recorded_by(SPLIT))
    make_vocab_size_divisible_by: int = setting(128, recorded_by(SPLIT))
    # how to run: never recorded (the same bytes whatever is chosen)
    overwrite: bool = False
    device: str | None = None
    workers: int | None = None
    ray_address: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # how much of a tensor is read at once: never what is written

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidOption(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)} (read a spelling with "
                                "merge_engine.option_values.parse_dtype)")
        if self.weights_format not in WEIGHTS_FORMATS:
            raise InvalidOption(f"unknown weights format {self.weights_format!r}; "
                                f"choose one of {', '.join(WEIGHTS_FORMATS)}")
        if isinstance(self.max_shard_size, bool) or not isinstance(self.max_shard_size, int) \
                or self.max_shard_size <= 0:
            raise InvalidOption(f"max_shard_size must be a positive number of bytes, got {self.max_shard_size!r} "
                                "(read a size with merge_engine.option_values.parse_size)")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype the output's floating-point tensors are cast to (``dtype``'s); None: as stored."""
        return None if self.dtype is None else TORCH_DTYPES[self.dtype]

    def output_options(self, command: str) -> dict[str, Any]:
        """The options that change the bytes ``command`` (one of `OUTPUTS`) writes, under their recorded keys
        (`recorded_fields`): those recorded only when set are left out while unset, so the fingerprints of other
        outputs stay as they were. A custom mapping is recorded with its content's digest."""
        options = {}
        for name, (key, always) in recorded_fields(type(self), command).items():
            value = getattr(self, name)
            if value is not None or always:
                options[key] = value
        mapping = options.get("custom_mapping")
        if isinstance(mapping, str):  # its content, not just its name, decides the output
            options["custom_mapping"] = {"url": mapping, "sha256": _content_digest(mapping)}
        return options


def _content_digest(url: str) -> str:
    try:
        return hashlib.sha256(storage.read_bytes(url)).hexdigest()
    except FileNotFoundError:
        raise InvalidOption("custom mapping file not found", url) from None


@dataclass(frozen=True)
class OutputResult:
    """What a command wrote, or found already written (``skipped``).

    ``kind``: "model", "adapter", "adapter+base" or "megatron"; ``files``: (name, size) relative to the
    target, ``stepmerge.json`` included; ``modules``: SVD reports (rank, relative error) per module.
    """

    command: str
    target_url: str
    fingerprint: str
    kind: str = "model"
    source_url: str = ""
    layout: str = ""
    fmt: str = ""
    tensors: int = 0
    tensor_bytes: int = 0
    files: tuple[tuple[str, int], ...] = ()
    checksums: tuple[tuple[str, str], ...] = ()  # (file, sha256) of every weight file and index, from the shard jobs
    seconds: float = 0.0
    skipped: bool = False
    notes: tuple[str, ...] = ()
    modules: tuple[ModuleReport, ...] = ()


@dataclass
class PreparedJob:
    """A job ready to write: its plans, its own files, its provenance and what to close afterwards.

    ``write_files(url)`` writes what is not a plan's shard (after every output); ``provenance`` is the
    command's record (the fingerprint, engine version and file list are added by `run_job`). ``written_notes``:
    notes the writing adds, read once it is done (the metadata files a copy left out), after ``notes``.
    """

    outputs: list[PlannedOutput]
    provenance: dict[str, Any]
    kind: str = "model"
    layout: str = ""
    tensors: int | None = None  # default: the plans' tensors
    tensor_bytes: int | None = None
    write_files: Callable[[str], Files] | None = None
    notes: tuple[str, ...] = ()
    modules: tuple[ModuleReport, ...] = ()
    sources: list[TensorSource] = field(default_factory=list)
    written_notes: list[str] = field(default_factory=list)

    def plan(self) -> MergePlan | None:
        """Every safetensors output's tensors and shards as one plan (for progress: ``on_plan``); None
        when the job writes none (split's file jobs)."""
        plans = [o.plan for o in self.outputs if o.plan is not None]
        if len(plans) <= 1:
            return plans[0] if plans else None
        return MergePlan(tuple(t for p in plans for t in p.tensors), tuple(s for p in plans for s in p.shards))

    def all_notes(self) -> tuple[str, ...]:
        """``notes``, then each of ``written_notes`` not among them, once."""
        return self.notes + tuple(n for n in dict.fromkeys(self.written_notes) if n not in self.notes)

    def close(self) -> None:
        for source in self.sources:
            source.close()


class OutputJob(Protocol):
    """One command's output. ``command`` names it (`merge_engine.options.OUTPUTS`); ``source_url`` is what it reads.

    - ``fingerprint()``: the cache key (see the module docstring); may check the input (listing,
      headers) and keep what it learnt for `prepare`;
    - ``prepare()``: every check, the sources opened, the plans made: a `PreparedJob`. Raises the
      named errors of `merge_engine.errors`; whatever it opened is closed when it raises.
    """

    command: str
    kind: str  # what it writes ("model", "adapter", "megatron"): the skipped result's kind
    source_url: str
    target_url: str
    options: OutputOptions

    def fingerprint(self) -> str: ...

    def prepare(self) -> PreparedJob: ...


def job_inputs(job: OutputJob) -> tuple[str | None, ...]:
    """Every URL a job reads, which its target must never overlap (`merge_engine.output.target_guard`): the
    ``source_url`` (or each of ``adapter_urls``), a ``base_url``, and the options' ``hf_model_path``,
    ``base_model`` and ``custom_mapping``. A job reading something else names it in one of these."""
    adapters = tuple(getattr(job, "adapter_urls", ()) or ())
    return (*(adapters or (job.source_url,)), getattr(job, "base_url", None), job.options.hf_model_path,
            job.options.base_model, job.options.custom_mapping)


def run_job(job: OutputJob, *, on_bytes: Callable[[int], None] | None = None,
            on_plan: Callable[[MergePlan], None] | None = None,
            executor: Executor | None = None) -> OutputResult:
    """Fingerprint, target state, prepare, write (see the module docstring). ``executor``: where the shard
    jobs run; by default the one ``job.options`` asks for (``ray_address``, else ``workers`` threads here)."""
    started = time.perf_counter()
    if executor is None:
        executor = executor_at(executor_address(job.options.workers, job.options.ray_address))
    fingerprint = job.fingerprint()
    state = target_state(job.target_url, fingerprint, job.options.overwrite, sources=job_inputs(job))
    if state == "same":
        provenance = read_provenance(job.target_url) or {}
        return OutputResult(job.command, job.target_url, fingerprint, kind=job.kind,
                            source_url=job.source_url, layout=str(provenance.get("layout", "")),
                            fmt=job.options.format if job.command == "split" else "",
                            tensors=int(provenance.get("tensors", 0)),
                            tensor_bytes=int(provenance.get("tensor_bytes", 0)),
                            files=tuple((e.path, e.size) for e in storage.list_files(job.target_url)),
                            seconds=time.perf_counter() - started, skipped=True)
    prepared = job.prepare()
    try:
        plan = prepared.plan() if prepared.outputs else None
        if on_plan is not None and plan is not None:
            on_plan(plan)

        written = WrittenFiles()
        recorded: dict[str, str] = {}  # every output file's sha256, in stepmerge.json: `verify` checks by it

        def write(url: str) -> Files:
            written.checksums.clear()
            shards = executor.write(job, prepared.outputs, url, chunk_bytes=job.options.chunk_bytes,
                                    on_bytes=on_bytes)
            written.checksums.update(shards.checksums)
            files = list(shards.files)
            if prepared.write_files is not None:
                files += prepared.write_files(url)
            recorded.clear()
            recorded.update(written.checksums)  # the shard jobs hashed what they wrote, while writing
            for name, size in files:
                if name not in recorded:  # the job's own small files (config, tokenizer): hashed here, once
                    recorded[name] = sha256_of(storage.join(url, name), size)
            return files

        tensors = prepared.tensors if prepared.tensors is not None else len(plan.tensors) if plan else 0
        tensor_bytes = prepared.tensor_bytes if prepared.tensor_bytes is not None else plan.total_size if plan else 0
        # "sha256" is filled by write() before write_target serialises the record (stepmerge.json, last)
        # a release carries no path of this machine: its sources by URL or by their path under the run root
        provenance = {**portable_record(prepared.provenance), "fingerprint": fingerprint,
                      "engine_version": __version__, "output_revision": engine_identity()["output_revision"],
                      "sha256": recorded}
        files = write_target(job.target_url, state, write, provenance)
    finally:
        prepared.close()
    return OutputResult(job.command, job.target_url, fingerprint, kind=prepared.kind, source_url=job.source_url,
                        layout=prepared.layout, fmt=job.options.format if job.command == "split" else "",
                        tensors=tensors, tensor_bytes=tensor_bytes, files=tuple(files),
                        checksums=tuple(sorted(written.checksums.items())),
                        seconds=time.perf_counter() - started, notes=prepared.all_notes(), modules=prepared.modules)
