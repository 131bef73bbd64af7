"""The records a flow hands its tasks: small, typed, frozen, never a tensor.

Each is a pydantic model (Prefect caches it as JSON, `tasks.result_records`, and shows it in the UI). They carry URLs,
fingerprints, counts and settings; the bytes stay in storage. `from_*` constructors turn
the engine's dataclasses into records, `to_*` turn them back where an engine call needs one.
What the build, validate and publish tasks RETURN is the engine's own frozen dataclasses
(`merge_engine.release.built.BuiltOutput`, `merge_engine.validate.ValidationReport`,
`merge_engine.release.publish.Release`): no twin here.
The settings records (`Settings`: `MergeSettings`, `AdapterSettings`, `ValidationSettings`, `ExecutionSettings`,
by name in `SETTINGS_RECORDS`) carry the options each stage reads, filled from a flow's parameters of the same names.
This module imports no torch (the engine classes are imported inside the `to_*` methods): the
listings-only watcher reads `StepRecord` s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Optional, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from typing_extensions import Self, TypedDict

from merge_engine.option_values import DEFAULT_MAX_SHARD_SIZE, DEFAULT_WEIGHTS_FORMAT, Dtype, WeightsFormat
from merge_engine.storage import FileEntry

if TYPE_CHECKING:  # the engine's classes: imported where a record is turned into one (they import torch)
    from merge_engine.layouts.discovery import Step
    from merge_engine.layouts import Checkpoint
    from merge_engine.output.jobs import OutputOptions


def of_type(value: Any, cls: type, where: Optional[str]) -> Any:
    """``value`` when it is a ``cls``; else `UnsafeRecord` naming ``where``: a stored result of another type (a
    record another party planted at this key) is refused by name, never used until an attribute is missing."""
    if not isinstance(value, cls):
        from merge_engine.errors import UnsafeRecord

        raise UnsafeRecord(f"a stored result is a {type(value).__name__[:100]} where a {cls.__name__} is expected: "
                           "not used", where)
    return value


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StepRecord(Record):
    """One (step, role) of a run as discovery saw it in a listing (`merge_engine.layouts.discovery.Step`)."""

    run_root: str
    step: int
    role: str
    url: str
    status: str  # "complete" | "incomplete" | "invalid"
    layout: str
    fingerprint: str  # digest of the step folder's listing: names, sizes, ETags/generations/mtimes
    reason: str = ""
    needs: tuple[str, ...] = ()  # merge parameters the step does not record (`merge_engine.layouts.discovery.Step.needs`)
    # the listing ``fingerprint`` digests, as (path relative to ``url``, size, version): the check reads it, not
    # a new listing (None: not known, the check lists)
    files: Optional[tuple[tuple[str, int, str], ...]] = Field(default=None, repr=False, exclude=True)

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def listing(self) -> Optional[list[FileEntry]]:
        """``files`` as the engine's entries (None when the record carries no listing)."""
        return None if self.files is None else [FileEntry(*f) for f in self.files]

    @classmethod
    def from_step(cls, step: Step) -> StepRecord:
        return cls(run_root=step.run_root, step=step.step, role=step.role, url=step.url, status=step.status,
                   layout=step.layout, fingerprint=step.fingerprint, reason=step.reason, needs=step.needs,
                   files=tuple((f.path, f.size, f.version) for f in step.files))


class DiscoveryRecord(Record):
    """Every checkpoint under a run root (one listing) and the tracker file's number (a hint only)."""

    run_root: str
    steps: tuple[StepRecord, ...]
    tracker_hint: Optional[int] = None

    def find(self, step: int, role: str) -> Optional[StepRecord]:
        return next((s for s in self.steps if s.step == step and s.role == role), None)


class CheckpointRecord(Record):
    """A checkpoint found complete by its layout's deep check (`merge_engine.layouts.Checkpoint`).

    ``files`` is the listing the check used, as (path, size, version): the merge fingerprint is
    computed from it without listing again. ``lora``, ``adapter_only`` and ``adapter_dir`` are the check's typed
    facts (`merge_engine.layouts.Checkpoint`); ``notes`` its findings for a person (never read back).
    ``index`` is the check's parsed tensor index (`merge_engine.layouts.tensor_index`, bounded): in the run
    that checked, the merge and its workers open the checkpoint from it without reading a header again. It is
    derived from the files, so it takes no part in cache keys or the UI (``exclude``), and it is never
    persisted: a record served from the result store has none (`tasks.result_records`), and its headers are
    read by whoever opens it.
    """

    url: str
    layout: str
    fingerprint: str
    files: tuple[tuple[str, int, str], ...]
    parallel: dict[str, int] = Field(default_factory=dict)
    hf_dir: Optional[str] = None
    lora: bool = False
    total_bytes: int = 0
    notes: tuple[str, ...] = ()
    adapter_only: bool = False
    adapter_dir: Optional[str] = None  # relative to ``url`` (`verified_for`: a path inside it)
    index: Optional[bytes] = Field(default=None, repr=False, exclude=True)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint) -> CheckpointRecord:
        return cls(url=checkpoint.url, layout=checkpoint.layout, fingerprint=checkpoint.fingerprint,
                   files=tuple((f.path, f.size, f.version) for f in checkpoint.files),
                   parallel=dict(checkpoint.parallel), hf_dir=checkpoint.hf_dir, lora=bool(checkpoint.lora),
                   total_bytes=sum(f.size for f in checkpoint.files), notes=tuple(checkpoint.notes),
                   adapter_only=checkpoint.adapter_only, adapter_dir=checkpoint.adapter_dir, index=checkpoint.index)

    def verified_for(self, step: StepRecord) -> CheckpointRecord:
        """This record, when it can be the check of ``step`` (a cached check comes from a result store another
        party may write): its URL is the step's folder or under it, its config folder under that, its files
        relative paths inside it, each listed by discovery with the same size and version (when ``step``
        carries its listing), its adapter folder one whose ``adapter_config.json`` is among those files. Else `UnsafeRecord` naming the record's URL: a forged record cannot send the
        merge to a host file, another bucket or another step."""
        from merge_engine import storage
        from merge_engine.errors import UnsafeRecord

        def inside(url: Optional[str], root: str) -> bool:
            return url is not None and ".." not in url.split("/") and (
                url.rstrip("/") == root.rstrip("/") or url.startswith(root.rstrip("/") + "/"))

        if not inside(self.url, step.url) or (self.hf_dir is not None and not inside(self.hf_dir, self.url)):
            raise UnsafeRecord(f"a checked checkpoint record names {self.url} (config {self.hf_dir}), outside the "
                               f"step it was checked for ({step.url})", self.url)
        listed = None if step.files is None else {storage.join(step.url, p): (size, version)
                                                  for p, size, version in step.files}

        def relative(path: str) -> bool:
            return bool(path) and not path.startswith("/") and "://" not in path and "\\" not in path \
                and ".." not in path.split("/")

        if self.adapter_dir is not None and (not relative(self.adapter_dir) or not any(
                path == self.adapter_dir.rstrip("/") + "/adapter_config.json" for path, _, _ in self.files)):
            raise UnsafeRecord(f"a checked checkpoint record names the adapter folder {self.adapter_dir!r}: not a "
                               "PEFT folder among its listed files", self.url)
        for path, size, version in self.files:
            if not relative(path):
                raise UnsafeRecord(f"a checked checkpoint record lists the file {path!r}: not a path inside it",
                                   self.url)
            if listed is not None and listed.get(storage.join(self.url, path)) != (size, version):
                raise UnsafeRecord(f"a checked checkpoint record lists {path} ({size} bytes, version {version!r}), "
                                   "which the step's listing does not hold", self.url)
        return self

    def to_checkpoint(self) -> Checkpoint:
        from merge_engine.layouts.contract import Checkpoint

        return Checkpoint(url=self.url, layout=self.layout, files=tuple(FileEntry(*f) for f in self.files),
                          parallel=dict(self.parallel), hf_dir=self.hf_dir, fingerprint=self.fingerprint,
                          notes=tuple(self.notes), lora=self.lora, adapter_only=self.adapter_only,
                          adapter_dir=self.adapter_dir, index=self.index)


def size_in_bytes(value: Any) -> Any:
    """A shard size as the engine holds it: ``5GB``, ``500MiB``, ... in bytes (a number as it is)."""
    from merge_engine.option_values import parse_size

    return parse_size(value) if isinstance(value, str) else value


Bytes = Annotated[int, BeforeValidator(size_in_bytes)]


class Settings(Record):
    """A settings record: the options one stage reads, each field a flow parameter of the same name
    (``PARAMETERS`` names those spelled otherwise in the flows), with the engine's value (sizes in bytes).

    ``recorded``: a release's manifest records the parameters that fill this record, and its fields are in the
    cache key of the chain that reads it."""

    PARAMETERS: ClassVar[dict[str, str]] = {}  # field -> the flow parameter that fills it, where the names differ
    recorded: ClassVar[bool] = True

    @classmethod
    def parameter(cls, field: str) -> str:
        """The flow parameter that fills ``field``."""
        return cls.PARAMETERS.get(field, field)

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> Self:
        """This record from a flow's parameters (name -> value): each field the flow takes from its parameter; the
        others keep their defaults."""
        return cls(**{field: parameters[cls.parameter(field)] for field in cls.model_fields
                      if cls.parameter(field) in parameters})

    def recorded_values(self) -> dict[str, Any]:
        """This record's fields under the flow parameters' names: how a release's manifest records them."""
        return {self.parameter(field): value for field, value in self}


class BuildSettings(Settings):
    """The options of a build that a flow exposes (the engine's `OutputOptions` minus target handling), the ones
    a model and an adapter build share."""

    backend: Optional[str] = None
    dtype: Optional[Dtype] = None
    max_shard_size: Bytes = DEFAULT_MAX_SHARD_SIZE
    hf_model_path: Optional[str] = None
    weights_format: WeightsFormat = DEFAULT_WEIGHTS_FORMAT
    lora_alpha: Optional[float] = None
    base_model: Optional[str] = None

    def to_options(self, overwrite: bool = False) -> OutputOptions:
        """The engine's options record of this build."""
        from merge_engine.output.jobs import OutputOptions

        return OutputOptions(backend=self.backend, dtype=self.dtype, max_shard_size=self.max_shard_size,
                             hf_model_path=self.hf_model_path, weights_format=self.weights_format,
                             lora_alpha=self.lora_alpha, base_model=self.base_model, overwrite=overwrite)


class MergeSettings(BuildSettings):
    """The merge options a flow exposes (the engine's `OutputOptions` minus target handling). ``lora_alpha`` matters to
    LoRA checkpoints whose run recorded no alpha: their merged model is the trained one (every update fused with its
    alpha), so the merge needs it as much as the adapter."""


class AdapterSettings(BuildSettings):
    """The adapter-extraction options a flow exposes. ``include_base`` also writes the clean base model under ``base/``
    of the adapter release, so ``PeftModel.from_pretrained(<release>/base, <release>)`` needs nothing else (and
    validation can load it); ``base_model`` names the base of a LoRA-only checkpoint; ``base_model_id`` the Hub id
    the adapter names."""

    base_model_id: Optional[str] = None
    include_base: bool = True

    def to_options(self, overwrite: bool = False) -> OutputOptions:
        return replace(super().to_options(overwrite), base_model_id=self.base_model_id, include_base=self.include_base)


class ValidationSettings(Settings):
    """What to validate: the forward pass (GPU when present), and a reference to compare with."""

    PARAMETERS: ClassVar[dict[str, str]] = {"forward": "validate_forward"}

    forward: bool = True
    reference_url: Optional[str] = None
    device: Optional[str] = None


class ExecutionSettings(Settings):
    """Where a merge's shard jobs run; never part of a cache key or a manifest (the bytes are the same).
    ``ray_address``: Prefect task runs on that Ray cluster (`tasks.shard_runs`; None: the worker's
    ``STEPMERGE_RAY_ADDRESS``, else none); otherwise ``workers`` threads here (None: one per core)."""

    recorded: ClassVar[bool] = False

    workers: Optional[int] = None
    ray_address: Optional[str] = None


class StageSettings(TypedDict):
    """The settings records a flow's stages get (`flows.params.FlowParams.settings`), by name: each stage reads the
    ones it needs, typed (the build the record of its output's kind)."""

    merge: MergeSettings
    adapter: AdapterSettings
    validation: ValidationSettings
    execution: ExecutionSettings


# The settings records by name, as `StageSettings` declares them.
SETTINGS_RECORDS: dict[str, type[Settings]] = dict(get_type_hints(StageSettings))


def recorded_parameters() -> set[str]:
    """The flow parameters a release's manifest records: those filling a field of a recorded settings record."""
    return {record.parameter(field) for record in SETTINGS_RECORDS.values() if record.recorded
            for field in record.model_fields}
