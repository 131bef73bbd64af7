"""Flow parameters: flat, typed, the required ones first, checked by the Prefect server before a run exists.

Every flow takes plain keyword parameters (``merge_step(step=40, run_root="s3://b/run")``), so the
UI's form lists ``step`` and ``run_root`` first, each with its description and default, and
``prefect deployment run 'merge-step/gpu' --param step=10`` works (the deployment supplies the run
root). The types below carry JSON Schema constraints that the SERVER enforces when a run is created
from a deployment (``enforce_parameter_schema``): a bad value is refused with HTTP 409 before
anything is scheduled, never sent to a worker:

- `StorageUrl`: a scheme from the storage scheme registry (`merge_engine.storage.schemes.url_schemes`), a
  bucket for object stores, no ``..`` component (plain or percent-encoded), no backslash or control
  character (`url_pattern`); in the flow, `flows.url_checks.checked_url` checks the same again and
  `flows.step_keys.normalized_run_root` gives one spelling (no trailing slash, ``file:///x`` -> ``/x``),
  so one run root has one key per step whatever route named it;
- `ShardSize`: ``5GB``, ``500MiB``, ... (`merge_engine.plan.option_values.SIZE_PATTERN`);
- `DtypeName`: the spellings the command line accepts too (`merge_engine.plan.option_values.DTYPE_SPELLINGS`),
  recorded as the canonical name (``fp16`` -> ``float16``);
- `WeightsFormat`: ``hub`` (the names and per-expert tensors of the model's Hub checkpoint) or
  ``transformers`` (as stored), the command line's ``--weights-format`` (`merge_engine.plan.option_values.WEIGHTS_FORMATS`);
- `StepNumber` (>= 0), `Role` (actor, critic, "" for SFT), positive ``lora_alpha``.

Inside the flows the arguments become one model: `MergeStepParams`, `WatchParams` or `AdapterParams`
(`RunLocation`: run root, release root, staging; `PipelineOptions`: what to do with a step). Each
flow's signature lists exactly its model's fields (tests/flows/test_params.py holds them together).

No ``from __future__ import annotations`` here or in any flow module: Prefect builds the parameter
schema from real annotations, and string annotations break pydantic parameters in deployment runs.
No torch import either: the listings-only watcher imports this module.
"""

import re
from typing import Annotated, Any, Dict, List, Literal, Optional, Sequence

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema

from flows.step_keys import normalized_run_root, step_key
from flows.url_checks import checked_url
from merge_engine.plan.option_values import (
    DEFAULT_WEIGHTS_FORMAT, DTYPE_SPELLINGS, SIZE_PATTERN, WEIGHTS_FORMATS, canonical_dtype, parse_size,
)
from merge_engine.storage.schemes import backend_for_scheme, url_schemes

MAX_URL_LENGTH = 1024


def url_pattern(schemes: Sequence[str]) -> str:
    """The JSON Schema pattern of a safe storage URL with one of ``schemes`` (or a local path).

    The server checks it before creating a run; `checked_url` is the same rule in Python. An object
    store's URL must name a bucket; a local scheme's (``file://``) a path.
    """
    remote = "|".join(re.escape(s) for s in schemes if not backend_for_scheme(s).local)
    local = "|".join(re.escape(s) for s in schemes if backend_for_scheme(s).local)
    clean = r"(?!.*[\x00-\x1f\x7f\\])"  # no control character, no backslash
    no_climb = r"(?!(.*/)?(\.|%2[eE]){2}(/|%2[fF]|$))"  # no ".." component, plain or percent-encoded
    return rf"^{clean}{no_climb}(({remote})://[^/]+(/.*)?|({local})://.+|(?!.*://).+)$"


URL_PATTERN = url_pattern(url_schemes())  # the storage scheme registry's list, when the flows are defined


def url_in_words(schemes: Sequence[str]) -> str:
    """What `url_pattern` admits, in words (the form's and the server's refusal): one example per
    store (its canonical scheme) and a path."""
    stores = [backend_for_scheme(s) for s in schemes]
    examples = list(dict.fromkeys(f"{b.canonical_scheme}://bucket/runs/exp1" for b in stores if not b.local))
    return (f"a storage URL such as {', '.join(examples)} or a path such as /data/runs/exp1, "
            f"with no .. folder, backslash or control character, at most {MAX_URL_LENGTH} characters")


URL_WORDS = url_in_words(url_schemes())
SIZE_WORDS = "a size such as 5GB, 500MiB, 1.5 GB or 1024 (bytes)"
RAY_ADDRESS_PATTERN = r"^(auto|local|(ray://)?[A-Za-z0-9.\-]+:[0-9]{1,5})$"
RAY_ADDRESS_WORDS = "auto, local, host:port or ray://host:port"


def _url(value: str) -> str:
    return normalized_run_root(checked_url(value))


def _dtype(value: Optional[str]) -> Optional[str]:
    return None if value in (None, AS_STORED) else canonical_dtype(value)


def refused_in_words(pattern: str, expected: str, blank: Optional[str] = None,
                     max_length: int = MAX_URL_LENGTH) -> Dict[str, Any]:
    """A JSON Schema admitting a string of at most ``max_length`` characters matching ``pattern`` (or
    equal to ``blank``), whose refusal
    is ``expected`` in words: "'<expected>' was expected", never the regular expression.

    The check sits in ``allOf: [{if: not the pattern, then: const <expected>}]``: the server's
    validator (jsonschema) reports the failed ``const`` as "'<expected>' was expected", with the
    field's name ("Validation failed for field 'run_root'"), for the API, ``prefect deployment run
    --param`` and the form's toast alike; and the UI, which keeps ``allOf`` (not ``pattern`` or
    ``if``) when it asks the server to check its form, shows the same words under the field.
    (A value spelled exactly like ``expected`` passes this schema; the flow's own check refuses it.)
    """
    admitted: Dict[str, Any] = {"pattern": pattern, "maxLength": max_length}
    if blank is not None:
        admitted = {"anyOf": [{"const": blank}, admitted]}
    return {"type": "string", "allOf": [{"if": {"not": admitted}, "then": {"const": expected}}]}


def _matching(pattern: str, expected: str) -> Any:
    """A pydantic check of ``pattern`` that says ``expected`` and the value it got (no regex)."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(f"must be {expected}; got {value!r}")
        return value

    return AfterValidator(check)


def unset_as(inner: Any, blank: Any, schema: Dict[str, Any]) -> Any:
    """An optional value the form shows as a plain control (no "str | None" toggle): ``blank`` (the
    empty text, 0, "as stored") stands for "not set" and is read as None; None is written back as
    ``blank`` in JSON (what a deployment run, the watcher or a trigger sends), so the server's
    schema, which has no null, admits it."""

    def to_none(value: Any) -> Any:
        if value is None or value == blank or (isinstance(value, str) and blank == "" and not value.strip()):
            return None
        return value

    return Annotated[Optional[inner], BeforeValidator(to_none),
                     PlainSerializer(lambda value: blank if value is None else value, when_used="json"),
                     WithJsonSchema(schema)]


AS_STORED = "as stored"
Role = Literal["actor", "critic", ""]
DtypeSpelling = Literal[tuple(DTYPE_SPELLINGS)]  # type: ignore[valid-type]
# The patterns go to the JSON schema only (the server's validator, and the UI's, read lookarounds;
# pydantic's own regex engine does not): in Python, `checked_url` applies the same rule, in words.
# The patterns go to the JSON schema only, behind words (`refused_in_words`; the server's validator reads
# lookarounds, pydantic's regex engine does not): in Python, `checked_url` applies the same rule, in words.
_URL_SCHEMA = refused_in_words(URL_PATTERN, URL_WORDS)
StorageUrl = Annotated[str, Field(max_length=MAX_URL_LENGTH), AfterValidator(_url), WithJsonSchema(_URL_SCHEMA)]
OptionalUrl = unset_as(StorageUrl, "", refused_in_words(URL_PATTERN, f"empty, or {URL_WORDS}", blank=""))
StepNumber = Annotated[int, Field(ge=0)]
ShardSize = Annotated[str, _matching(SIZE_PATTERN, SIZE_WORDS), WithJsonSchema(refused_in_words(SIZE_PATTERN, SIZE_WORDS))]
DtypeName = Annotated[unset_as(DtypeSpelling, AS_STORED, {"type": "string", "enum": [AS_STORED, *DTYPE_SPELLINGS]}),
                      AfterValidator(_dtype)]
LoraAlpha = unset_as(Annotated[float, Field(gt=0)], 0, {"type": "number", "minimum": 0})
WeightsFormat = Literal[WEIGHTS_FORMATS]  # type: ignore[valid-type]
Workers = unset_as(Annotated[int, Field(ge=1)], 0, {"type": "integer", "minimum": 0})
MaxSteps = unset_as(Annotated[int, Field(ge=1)], 0, {"type": "integer", "minimum": 0})
RayAddress = unset_as(Annotated[str, Field(max_length=MAX_URL_LENGTH), _matching(RAY_ADDRESS_PATTERN, RAY_ADDRESS_WORDS)],
                      "", refused_in_words(RAY_ADDRESS_PATTERN, f"empty, or {RAY_ADDRESS_WORDS}", blank=""))

# The form's texts, one per parameter name (every flow that has the parameter shows the same words).
DESCRIPTIONS: Dict[str, str] = {
    "step": "The global step to merge (its folder is global_step_N)",
    "run_root": "The training run's checkpoint folder: a path, file://, s3://bucket/... or gs://bucket/...",
    "role": "actor, critic, or empty for SFT runs (weights in the step folder)",
    "release_root": "Where releases are published; empty: the run root's releases/ folder",
    "staging_root": "Local folder for staging merges; empty: $STEPMERGE_STAGING_DIR or the temp dir",
    "dtype": "Output dtype: as stored (the checkpoint's own), bfloat16/bf16, float16/fp16/half, float32/fp32/float",
    "max_shard_size": "Largest safetensors file, e.g. 5GB or 500MiB",
    "hf_model_path": "Folder with config.json + tokenizer replacing the checkpoint's huggingface/; empty: the "
                     "checkpoint's own",
    "weights_format": "Tensor names written: hub (the model's Hub checkpoint: per-expert MoE tensors, what vLLM, "
                      "SGLang and PEFT read) or transformers (as the training job stored them)",
    "validate_forward": "Load the model and run a forward pass (GPU if present)",
    "reference_url": "A Hugging Face folder to compare values and logits with; empty: none",
    "release_adapter": "For LoRA checkpoints, also release the PEFT adapter",
    "adapter_include_base": "Put the clean base model in the adapter release (base/)",
    "lora_alpha": "LoRA alpha when the run did not record it (lora_train_meta.json); 0: as the run recorded it",
    "overwrite": "Replace a release that was built from a different checkpoint",
    "workers": "Shard jobs at once in the merge (or extraction) task's process; 0: one per core",
    "ray_address": "Run the shard jobs as task runs on this Ray cluster (auto, host:port, ray://host:port); "
                   "empty: the worker's $STEPMERGE_RAY_ADDRESS, else the task's own process",
    "roles": "Roles to merge (actor, critic, empty for SFT)",
    "merge_deployment": "Deployment that merges one step, used when this flow runs from a deployment",
    "max_steps": "Merge at most this many new steps per run (oldest first); 0: every new step",
    "include_base": "Also release the clean base model under base/",
    "base_model": "The base model of a LoRA-only checkpoint (a verl Megatron LoRA step saves no base weights: its "
                  "fused model is this model plus the adapter; the run's adapter_config.json name is never used "
                  "alone); empty: none",
    "compare_with_model_release": "Compare PEFT's logits with the step's released merged model, when it was "
                                  "built from this checkpoint",
}


class FlowParams(BaseModel):
    """Base of the three flows' parameter models: unknown names refused."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    def flow_parameters(self) -> Dict[str, Any]:
        """The flow's keyword arguments (JSON-ready): what a deployment run, a trigger or a test passes."""
        return self.model_dump(mode="json")


class RunLocation(FlowParams):
    """Where a training run is, where its releases go and where merges are staged."""

    run_root: StorageUrl
    release_root: OptionalUrl = ""
    staging_root: OptionalUrl = ""

    @property
    def release_root_url(self) -> str:
        from merge_engine.release.state import default_release_root

        return self.release_root or default_release_root(self.run_root)


class PipelineOptions(RunLocation):
    """What to do with a step: how to merge, validate and release adapters."""

    dtype: DtypeName = AS_STORED
    max_shard_size: ShardSize = "5GB"
    hf_model_path: OptionalUrl = ""
    weights_format: WeightsFormat = DEFAULT_WEIGHTS_FORMAT
    validate_forward: bool = True
    reference_url: OptionalUrl = ""
    release_adapter: bool = True
    adapter_include_base: bool = True
    lora_alpha: LoraAlpha = 0
    base_model: OptionalUrl = ""
    overwrite: bool = False
    workers: Workers = 0
    ray_address: RayAddress = ""

    def merge_settings(self):
        from tasks.records import MergeSettings

        return MergeSettings(dtype=self.dtype, max_shard_size=parse_size(self.max_shard_size),
                             hf_model_path=self.hf_model_path, lora_alpha=self.lora_alpha,
                             weights_format=self.weights_format, base_model=self.base_model)

    def adapter_settings(self):
        from tasks.records import AdapterSettings

        return AdapterSettings(include_base=self.adapter_include_base, lora_alpha=self.lora_alpha, dtype=self.dtype,
                               max_shard_size=parse_size(self.max_shard_size), hf_model_path=self.hf_model_path,
                               weights_format=self.weights_format, base_model=self.base_model)

    def validation_settings(self):
        from tasks.records import ValidationSettings

        return ValidationSettings(forward=self.validate_forward, reference_url=self.reference_url)

    def execution_settings(self):
        """Where the merge's shard jobs run (never recorded in a manifest: the bytes are the same)."""
        from tasks.records import ExecutionSettings

        return ExecutionSettings(workers=self.workers, ray_address=self.ray_address)

    def options(self) -> dict:
        """Every pipeline option (what a watcher passes on to each step), without the run root."""
        return self.model_dump(include=set(PipelineOptions.model_fields) - {"run_root"})

    def recorded_options(self) -> dict:
        """The options that decide a release's content: recorded in its manifest."""
        return self.model_dump(include={"dtype", "max_shard_size", "hf_model_path", "weights_format",
                                        "validate_forward", "reference_url", "adapter_include_base", "lora_alpha",
                                        "base_model"})


class MergeStepParams(PipelineOptions):
    """Merge, validate and publish one step of a run (and its LoRA adapter, if it has one)."""

    step: StepNumber
    role: Role = "actor"

    @property
    def key(self) -> str:
        return step_key(self.run_root, self.role, self.step)


class WatchParams(PipelineOptions):
    """Merge every complete step of a run that is not published yet (scheduled)."""

    roles: List[Role] = ["actor", ""]
    merge_deployment: str = "merge-step/gpu"
    max_steps: MaxSteps = 0

    def step_params(self, step: Any) -> MergeStepParams:
        """The parameters of the merge of ``step`` (a `tasks.records.StepRecord`): this watcher's options."""
        return MergeStepParams(**{**self.options(), "release_root": self.release_root_url},
                               run_root=self.run_root, step=step.step, role=step.role)


class AdapterParams(RunLocation):
    """Extract and publish the LoRA adapter of one step."""

    step: StepNumber
    role: Role = "actor"
    include_base: bool = True
    base_model: OptionalUrl = ""
    lora_alpha: LoraAlpha = 0
    dtype: DtypeName = AS_STORED
    validate_forward: bool = True
    compare_with_model_release: bool = True
    overwrite: bool = False
    workers: Workers = 0
    ray_address: RayAddress = ""

    execution_settings = PipelineOptions.execution_settings  # where the extraction's shard jobs run

    def recorded_options(self) -> dict:
        return self.model_dump(include={"include_base", "base_model", "lora_alpha", "dtype", "validate_forward"})

    def adapter_settings(self):
        from tasks.records import AdapterSettings

        return AdapterSettings(include_base=self.include_base, base_model=self.base_model,
                               lora_alpha=self.lora_alpha, dtype=self.dtype)

    def validation_settings(self):
        from tasks.records import ValidationSettings

        return ValidationSettings(forward=self.validate_forward)


def described(name: str, default: Any = ...) -> Any:
    """The default of flow parameter ``name`` with the form's description (``...``: required)."""
    return Field(default, description=DESCRIPTIONS[name])
