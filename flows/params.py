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
- `ShardSize`: ``5GB``, ``500MiB``, ... (`merge_engine.option_values.SIZE_PATTERN`);
- `DtypeName`: the spellings the command line accepts too (`merge_engine.option_values.DTYPE_SPELLINGS`),
  recorded as the canonical name (``fp16`` -> ``float16``);
- a choice (``weights_format``, ``role``): one of the declared choices, the command line's too;
- `StepNumber` (>= 0), positive ``lora_alpha``, ``workers``, ``max_steps`` (`Count`; 0: unset).

Each flow's parameters are written twice, held together by tests/flows/test_params.py: in the flow's ``def``,
from which Prefect builds the form and the deployment's schema, and in its parameter model here
(`MergeStepParams`, `WatchParams`, `AdapterParams`, each a `RunLocation`), which the flow builds from them and
hands its stages. A parameter's type and form text are declared once, on its parameter type below (``Step``,
``RunRoot``, ``Dtype``, ...: a form type with its `FormText`). The settings records the stages get
(`FlowParams.settings`, `tasks.records`) take the parameters of their fields' names; what a release records
(`FlowParams.recorded_options`) is the parameters that fill a recorded settings record.

No ``from __future__ import annotations`` here or in any flow module: Prefect builds the parameter
schema from real annotations, and string annotations break pydantic parameters in deployment runs.
No torch import either: the listings-only watcher imports this module.
"""

import re
from typing import TYPE_CHECKING, Annotated, Any, Dict, Literal, Optional, Sequence, Tuple

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema
from pydantic.json_schema import JsonSchemaValue

from flows.step_keys import normalized_run_root, step_key
from flows.url_checks import checked_url
from merge_engine.errors import one_line
from merge_engine.option_values import (
    DEFAULT_SHARD_SIZE, DEFAULT_WEIGHTS_FORMAT, DTYPE_SPELLINGS, SIZE_PATTERN, WeightsFormat as WeightsFormatName,
    Dtype as OutputDtype, parse_dtype,
)
from merge_engine.storage.schemes import backend_for_scheme, url_schemes
from tasks.records import (
    AdapterSettings, ExecutionSettings, MergeSettings, StageSettings, ValidationSettings, recorded_parameters,
)

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


def _dtype(value: Optional[str]) -> Optional[OutputDtype]:
    """The form's dtype -> the engine's `Dtype` (`parse_dtype`, as the command line's ``--dtype``); as stored: None."""
    return None if value in (None, AS_STORED) else parse_dtype(value)


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
            raise ValueError(f"must be {expected}; got '{one_line(value)}'")
        return value

    return AfterValidator(check)


# An optional value the form shows as a plain control (no "str | None" toggle) is written
# ``Annotated[Optional[T], read_blank(blank), write_blank(blank), WithJsonSchema(<schema without null>)]``:
# ``blank`` (the empty text, 0, "as stored") stands for "not set"; a parameter of that type has it as its default.


def read_blank(blank: Any) -> Any:
    """The form's ``blank`` (and, for an empty text, blank space) read as None: "not set"."""

    def to_none(value: Any) -> Any:
        if value is None or value == blank or (isinstance(value, str) and blank == "" and not value.strip()):
            return None
        return value

    return BeforeValidator(to_none)


def write_blank(blank: Any) -> Any:
    """None written back as ``blank`` in JSON (what a deployment run, the watcher or a trigger sends), so the
    server's schema, which has no null, admits it."""
    return PlainSerializer(lambda value: blank if value is None else value, when_used="json")


# The form types: a kind of value as the form shows it and the server checks it.
AS_STORED = "as stored"
if TYPE_CHECKING:
    DtypeSpelling = str  # one of DTYPE_SPELLINGS
else:
    DtypeSpelling = Literal[tuple(DTYPE_SPELLINGS)]
# The patterns go to the JSON schema only, behind words (`refused_in_words`; the server's validator reads
# lookarounds, pydantic's regex engine does not): in Python, `checked_url` applies the same rule, in words.
_URL_SCHEMA = refused_in_words(URL_PATTERN, URL_WORDS)
StorageUrl = Annotated[str, Field(max_length=MAX_URL_LENGTH), AfterValidator(_url), WithJsonSchema(_URL_SCHEMA)]
OptionalUrl = Annotated[Optional[StorageUrl], read_blank(""), write_blank(""),
                        WithJsonSchema(refused_in_words(URL_PATTERN, f"empty, or {URL_WORDS}", blank=""))]
StepNumber = Annotated[int, Field(ge=0)]
ShardSize = Annotated[str, _matching(SIZE_PATTERN, SIZE_WORDS), WithJsonSchema(refused_in_words(SIZE_PATTERN, SIZE_WORDS))]
DtypeName = Annotated[Optional[DtypeSpelling], read_blank(AS_STORED), write_blank(AS_STORED),
                      WithJsonSchema({"type": "string", "enum": [AS_STORED, *DTYPE_SPELLINGS]}), AfterValidator(_dtype)]
LoraAlpha = Annotated[Optional[Annotated[float, Field(gt=0)]], read_blank(0), write_blank(0),
                      WithJsonSchema({"type": "number", "minimum": 0})]
Count = Annotated[Optional[Annotated[int, Field(ge=1)]], read_blank(0), write_blank(0),
                  WithJsonSchema({"type": "integer", "minimum": 0})]
OptionalText = Annotated[Optional[Annotated[str, Field(max_length=MAX_URL_LENGTH)]], read_blank(""), write_blank(""),
                         WithJsonSchema({"type": "string", "maxLength": MAX_URL_LENGTH})]
RayAddress = Annotated[
    Optional[Annotated[str, Field(max_length=MAX_URL_LENGTH), _matching(RAY_ADDRESS_PATTERN, RAY_ADDRESS_WORDS)]],
    read_blank(""), write_blank(""),
    WithJsonSchema(refused_in_words(RAY_ADDRESS_PATTERN, f"empty, or {RAY_ADDRESS_WORDS}", blank=""))]
RoleName = Literal["actor", "critic", "policy", ""]  # policy: NeMo-RL's; "": an SFT run (weights in the step folder)


class FormText:
    """The text the form shows under a parameter: its JSON schema's ``description``.

    Written on the parameter's type (``Annotated[<form type>, FormText(...)]``), so a flow's ``def`` and its
    parameter model carry the same text. (A pydantic ``Field(description=...)`` there would not reach the form:
    Prefect gives each parameter of a ``def`` a field of its own, whose empty description replaces it.)
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> JsonSchemaValue:
        return {**handler(core_schema), "description": self.text}


# The parameter types: each parameter's form type and text, declared once for every flow that takes it.
Step = Annotated[StepNumber, FormText("The global step to merge (its folder is global_step_N)")]
RunRoot = Annotated[StorageUrl, FormText(
    "The training run's checkpoint folder: a path, file://, s3://bucket/... or gs://bucket/...")]
Role = Annotated[RoleName, FormText("actor, critic, policy (NeMo-RL), or empty for SFT runs (weights in the step "
                                    "folder)")]
ReleaseRoot = Annotated[OptionalUrl, FormText("Where releases are published; empty: the run root's releases/ folder")]
Roles = Annotated[Tuple[RoleName, ...], FormText("Roles to merge (actor, critic, policy for NeMo-RL, empty for SFT)")]
MergeDeployment = Annotated[str, FormText(
    "Deployment that merges one step, used when this flow runs from a deployment")]
MaxSteps = Annotated[Count, FormText(
    "Merge at most this many new steps per run (oldest first); 0: every new step")]
Dtype = Annotated[DtypeName, FormText(
    "Output dtype: as stored (the checkpoint's own), bfloat16/bf16, float16/fp16/half, float32/fp32/float")]
MaxShardSize = Annotated[ShardSize, FormText("Largest safetensors file, e.g. 5GB or 500MiB")]
HfModelPath = Annotated[OptionalUrl, FormText(
    "Folder with config.json + tokenizer replacing the checkpoint's huggingface/; empty: the checkpoint's own")]
WeightsFormat = Annotated[WeightsFormatName, FormText(
    "Tensor names written: hub (the model's Hub checkpoint: per-expert MoE tensors, what vLLM, SGLang and PEFT read) "
    "or transformers (as the training job stored them)")]
ValidateForward = Annotated[bool, FormText("Load the model and run a forward pass (GPU if present)")]
CompareWithModelRelease = Annotated[bool, FormText(
    "Compare PEFT's logits with the step's released merged model, when it was built from this checkpoint")]
ReferenceUrl = Annotated[OptionalUrl, FormText("A Hugging Face folder to compare values and logits with; empty: none")]
ReleaseAdapter = Annotated[bool, FormText("For LoRA checkpoints, also release the PEFT adapter")]
IncludeBase = Annotated[bool, FormText("Put the clean base model in the adapter release (base/)")]
Alpha = Annotated[LoraAlpha, FormText(
    "LoRA alpha when the run did not record it (lora_train_meta.json); 0: as the run recorded it")]
BaseModelUrl = Annotated[OptionalUrl, FormText(
    "The base model of a LoRA-only checkpoint (verl's Megatron LoRA or lora-only saves, an HF Trainer adapter-only "
    "save: its fused model is this model plus the adapter, and its config this model's when the step saved none; "
    "the run's adapter_config.json name is never used alone); empty: none")]
BaseModelId = Annotated[OptionalText, FormText(
    "The base model's Hub id (namespace/name) the adapter names; empty: the run config's _name_or_path when it is a "
    "Hub id, else base/ inside the release")]
Overwrite = Annotated[bool, FormText("Replace a release that was built from a different checkpoint")]
StagingRoot = Annotated[OptionalUrl, FormText(
    "Local folder for staging merges; empty: $STEPMERGE_STAGING_DIR or the temp dir")]
Workers = Annotated[Count, FormText(
    "Shard jobs at once in the merge (or extraction) task's process; 0: one per core")]
RayCluster = Annotated[RayAddress, FormText(
    "Run the shard jobs as task runs on this Ray cluster (auto, host:port, ray://host:port); empty: the worker's "
    "$STEPMERGE_RAY_ADDRESS, else the task's own process")]
HUB_REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"
HUB_REF_PATTERN = r"^[A-Za-z0-9._/-]+$"
HUB_TEMPLATE_PATTERN = r"^([A-Za-z0-9._/-]|\{step(:[^{}]*)?\}|\{role\})+$"
HUB_TEMPLATE_WORDS = ("a branch name with the placeholders {step} and {role} only, e.g. step-{step} or "
                      "{role}/iter_{step:07d}")


def _hub_template(value: str) -> str:
    from merge_engine.release.hub_refs import template_problem

    problem = template_problem(value)
    if problem:
        raise ValueError(f"must be {HUB_TEMPLATE_WORDS}; got '{one_line(value)}': {problem}")
    return value


def _hub_ref(value: Optional[str]) -> Optional[str]:
    from merge_engine.release.hub_refs import ref_problem

    problem = ref_problem(value) if value else None
    if problem:
        raise ValueError(f"must be a branch name such as latest; got '{one_line(value)}': {problem}")
    return value


HubRepoId = Annotated[
    Optional[Annotated[str, Field(max_length=200), _matching(HUB_REPO_PATTERN, "a Hub repo id namespace/name")]],
    read_blank(""), write_blank(""),
    WithJsonSchema(refused_in_words(HUB_REPO_PATTERN, "empty, or a Hub repo id namespace/name", blank="",
                                    max_length=200))]
HubTemplate = Annotated[str, Field(max_length=200), AfterValidator(_hub_template),
                        WithJsonSchema(refused_in_words(HUB_TEMPLATE_PATTERN, HUB_TEMPLATE_WORDS, max_length=200))]
HubRefName = Annotated[Optional[Annotated[str, Field(max_length=200)]], read_blank(""), write_blank(""),
                       WithJsonSchema(refused_in_words(HUB_REF_PATTERN, "empty, or a branch name such as latest",
                                                       blank="", max_length=200)),
                       AfterValidator(_hub_ref)]
HubRepo = Annotated[HubRepoId, FormText(
    "Push each release to this Hugging Face Hub repo (namespace/name), one revision per step; empty: no push")]
HubRevision = Annotated[HubTemplate, FormText(
    "The Hub revision (a branch) of a step: {step} and {role} are filled in; an adapter's ends in -adapter")]
HubMovingRef = Annotated[HubRefName, FormText(
    "A branch moved to each new push's commit, e.g. latest; empty: none")]
HubPrivate = Annotated[bool, FormText("Create the Hub repo, private, when it does not exist (never a public one)")]
HubTokenSecret = Annotated[OptionalText, FormText(
    "The Prefect Secret block holding the Hub token; empty: HF_TOKEN in the worker's environment")]
DEFAULT_HUB_REVISION = "step-{step}"
MlflowModel = Annotated[OptionalText, FormText(
    "Register each release as a version of this model in MLflow's Model Registry (an adapter: <name>-adapter), "
    "by reference: the weights stay where they are; empty: no registration")]
MlflowTrackingUri = Annotated[OptionalText, FormText(
    "The MLflow tracking server (e.g. http://mlflow:5000); empty: MLFLOW_TRACKING_URI in the worker's environment")]
DEFAULT_ROLES: Tuple[RoleName, ...] = ("actor", "")


class FlowParams(BaseModel):
    """Base of the flows' parameter models: unknown names refused, the blanks' defaults read as unset."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    def flow_parameters(self) -> Dict[str, Any]:
        """The flow's keyword arguments (JSON-ready): what a deployment run, a trigger or a test passes."""
        return self.model_dump(mode="json")

    def recorded_options(self) -> Dict[str, Any]:
        """The parameters that decide a release's content, recorded in its manifest: those that fill a field of a
        recorded settings record (`tasks.records.recorded_parameters`: every record but the execution record)."""
        return self.model_dump(include=recorded_parameters() & set(type(self).model_fields))

    def settings(self) -> StageSettings:
        """Every settings record (`tasks.records.StageSettings`, record name -> record) from this flow's
        parameters, each field from the parameter of its name (`Settings.from_parameters`): the stages take the
        ones they read; a record's fields the flow does not take keep their defaults."""
        parameters = dict(self)
        return StageSettings(merge=MergeSettings.from_parameters(parameters),
                             adapter=AdapterSettings.from_parameters(parameters),
                             validation=ValidationSettings.from_parameters(parameters),
                             execution=ExecutionSettings.from_parameters(parameters))


class RunLocation(FlowParams):
    """Where a training run is (``run_root``), where its releases go and where merges are staged."""

    if TYPE_CHECKING:  # every flow's fields, declared in each flow's model in its form's order
        run_root: str
        release_root: Optional[str]
        staging_root: Optional[str]

    @property
    def release_root_url(self) -> str:
        from merge_engine.release.folders import default_release_root

        return self.release_root or default_release_root(self.run_root)


class MergeStepParams(RunLocation):
    """Merge, validate and publish one step of a run (and its LoRA adapter, if it has one)."""

    step: Step
    run_root: RunRoot
    role: Role = "actor"
    release_root: ReleaseRoot = ""
    dtype: Dtype = AS_STORED
    max_shard_size: MaxShardSize = DEFAULT_SHARD_SIZE
    hf_model_path: HfModelPath = ""
    weights_format: WeightsFormat = DEFAULT_WEIGHTS_FORMAT
    validate_forward: ValidateForward = True
    reference_url: ReferenceUrl = ""
    release_adapter: ReleaseAdapter = True
    include_base: IncludeBase = True
    lora_alpha: Alpha = 0
    base_model: BaseModelUrl = ""
    base_model_id: BaseModelId = ""
    overwrite: Overwrite = False
    staging_root: StagingRoot = ""
    workers: Workers = 0
    ray_address: RayCluster = ""
    hub_repo: HubRepo = ""
    hub_revision: HubRevision = DEFAULT_HUB_REVISION
    hub_moving_ref: HubMovingRef = ""
    hub_private: HubPrivate = False
    hub_token_secret: HubTokenSecret = ""
    mlflow_model: MlflowModel = ""
    mlflow_tracking_uri: MlflowTrackingUri = ""

    @property
    def key(self) -> str:
        return step_key(self.run_root, self.role, self.step)


class WatchParams(RunLocation):
    """Merge every complete step of a run that is not published yet (scheduled)."""

    run_root: RunRoot
    release_root: ReleaseRoot = ""
    roles: Roles = DEFAULT_ROLES
    merge_deployment: MergeDeployment = "merge-step/gpu"
    max_steps: MaxSteps = 0
    dtype: Dtype = AS_STORED
    max_shard_size: MaxShardSize = DEFAULT_SHARD_SIZE
    hf_model_path: HfModelPath = ""
    weights_format: WeightsFormat = DEFAULT_WEIGHTS_FORMAT
    validate_forward: ValidateForward = True
    reference_url: ReferenceUrl = ""
    release_adapter: ReleaseAdapter = True
    include_base: IncludeBase = True
    lora_alpha: Alpha = 0
    base_model: BaseModelUrl = ""
    base_model_id: BaseModelId = ""
    overwrite: Overwrite = False
    staging_root: StagingRoot = ""
    workers: Workers = 0
    ray_address: RayCluster = ""
    hub_repo: HubRepo = ""
    hub_revision: HubRevision = DEFAULT_HUB_REVISION
    hub_moving_ref: HubMovingRef = ""
    hub_private: HubPrivate = False
    hub_token_secret: HubTokenSecret = ""
    mlflow_model: MlflowModel = ""
    mlflow_tracking_uri: MlflowTrackingUri = ""

    def step_params(self, step: Any) -> MergeStepParams:
        """The parameters of the merge of ``step`` (a `tasks.records.StepRecord`): this watcher's options."""
        passed = set(type(self).model_fields) & set(MergeStepParams.model_fields) - {"run_root"}
        return MergeStepParams(**{**self.model_dump(include=passed), "release_root": self.release_root_url},
                               run_root=self.run_root, step=step.step, role=step.role)


class AdapterParams(RunLocation):
    """Extract and publish the LoRA adapter of one step."""

    step: Step
    run_root: RunRoot
    role: Role = "actor"
    release_root: ReleaseRoot = ""
    include_base: IncludeBase = True
    dtype: Dtype = AS_STORED
    validate_forward: ValidateForward = True
    compare_with_model_release: CompareWithModelRelease = True
    lora_alpha: Alpha = 0
    base_model: BaseModelUrl = ""
    base_model_id: BaseModelId = ""
    overwrite: Overwrite = False
    staging_root: StagingRoot = ""
    workers: Workers = 0
    ray_address: RayCluster = ""
    hub_repo: HubRepo = ""
    hub_revision: HubRevision = DEFAULT_HUB_REVISION
    hub_moving_ref: HubMovingRef = ""
    hub_private: HubPrivate = False
    hub_token_secret: HubTokenSecret = ""
    mlflow_model: MlflowModel = ""
    mlflow_tracking_uri: MlflowTrackingUri = ""
