"""Flow parameters as pydantic models: the Prefect UI renders them as forms with defaults and checks.

No ``from __future__ import annotations`` here or in any flow module: Prefect builds the parameter
schema from real annotations, and string annotations break pydantic parameters in deployment runs.

URLs are checked before anything runs (`flows.url_checks.checked_url`): a scheme on the allow-list
(local paths, ``file://``, ``s3://``, ``gs://``), no ``..`` component, no backslash or control
character; trailing slashes are dropped, so one run root has one spelling (and one key per step,
`flows.step_keys`). The webhook applies the same check with its own, stricter, allow-list.

`RunLocation` is where every flow's run is (run root, release root, staging); `PipelineOptions`
what to do with a step; `MergeStepParams`, `WatchParams` and `AdapterParams` are the three forms.
"""

from typing import List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flows.step_keys import step_key
from flows.url_checks import checked_url
from merge_engine.errors import StepmergeError
from merge_engine.merge_plan import parse_size
from merge_engine.release import default_release_root
from tasks.records import AdapterSettings, MergeSettings, StepRecord, ValidationSettings

Role = Literal["actor", "critic", ""]


class RunLocation(BaseModel):
    """Where a training run is, where its releases go and where merges are staged."""

    model_config = ConfigDict(extra="forbid")

    run_root: str = Field(..., description="The training run's checkpoint folder (path, file://, s3://, gs://)")
    release_root: Optional[str] = Field(
        None, description="Where releases are published; default: <run_root>/releases")
    staging_root: Optional[str] = Field(
        None, description="Local folder for staging merges; default: $STEPMERGE_STAGING_DIR or the temp dir")

    @field_validator("run_root")
    @classmethod
    def _safe_root(cls, value: str) -> str:
        return checked_url(value)

    @field_validator("release_root", "staging_root")
    @classmethod
    def _safe_url(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else checked_url(value)

    @property
    def release_root_url(self) -> str:
        return self.release_root or default_release_root(self.run_root)


class PipelineOptions(RunLocation):
    """What to do with a step: how to merge, validate and release adapters."""

    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(
        None, description="Output dtype; default: as stored in the checkpoint")
    max_shard_size: str = Field("5GB", description="Largest safetensors file, e.g. 5GB or 500MiB")
    hf_model_path: Optional[str] = Field(
        None, description="Folder with config.json + tokenizer replacing the checkpoint's huggingface/")
    validate_forward: bool = Field(True, description="Load the model and run a forward pass (GPU if present)")
    reference_url: Optional[str] = Field(
        None, description="A Hugging Face folder to compare values and logits with")
    release_adapter: bool = Field(True, description="For LoRA checkpoints, also release the PEFT adapter")
    adapter_include_base: bool = Field(True, description="Put the clean base model in the adapter release (base/)")
    lora_alpha: Optional[float] = Field(
        None, gt=0, description="LoRA alpha when the run did not record it (lora_train_meta.json)")
    overwrite: bool = Field(False, description="Replace a release that was built from a different checkpoint")

    @field_validator("hf_model_path", "reference_url")
    @classmethod
    def _safe_source(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else checked_url(value)

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str) -> str:
        try:
            parse_size(value)
        except StepmergeError as exc:
            raise ValueError(exc.message) from None
        return value

    def merge_settings(self) -> MergeSettings:
        return MergeSettings(dtype=self.dtype, max_shard_size=parse_size(self.max_shard_size),
                             hf_model_path=self.hf_model_path, lora_alpha=self.lora_alpha)

    def adapter_settings(self) -> AdapterSettings:
        return AdapterSettings(include_base=self.adapter_include_base, lora_alpha=self.lora_alpha, dtype=self.dtype,
                               max_shard_size=parse_size(self.max_shard_size), hf_model_path=self.hf_model_path)

    def validation_settings(self) -> ValidationSettings:
        return ValidationSettings(forward=self.validate_forward, reference_url=self.reference_url)

    def options(self) -> dict:
        """Every pipeline option (what a watcher passes on to each step), without the run root."""
        return self.model_dump(include=set(PipelineOptions.model_fields) - {"run_root"})

    def recorded_options(self) -> dict:
        """The options that decide a release's content: recorded in its manifest."""
        return self.model_dump(include={"dtype", "max_shard_size", "hf_model_path", "validate_forward",
                                        "reference_url", "adapter_include_base", "lora_alpha"})


class MergeStepParams(PipelineOptions):
    """Merge, validate and publish one step of a run (and its LoRA adapter, if it has one)."""

    step: int = Field(..., ge=0, description="The global step to merge (global_step_<N>)")
    role: Role = Field("actor", description="actor, critic, or empty for SFT runs (weights in the step folder)")

    @property
    def key(self) -> str:
        return step_key(self.run_root, self.role, self.step)


class WatchParams(PipelineOptions):
    """Merge every complete step of a run that is not published yet (scheduled)."""

    roles: List[Role] = Field(["actor", ""], description="Roles to merge (actor, critic, empty for SFT)")
    merge_deployment: str = Field(
        "merge-step/gpu", description="Deployment that merges one step, used when this flow runs from a deployment")
    max_steps: Optional[int] = Field(None, ge=1, description="Merge at most this many new steps per run (oldest first)")

    def step_params(self, step: StepRecord) -> MergeStepParams:
        return MergeStepParams(**{**self.options(), "release_root": self.release_root_url},
                               run_root=self.run_root, step=step.step, role=step.role)


class AdapterParams(RunLocation):
    """Extract and publish the LoRA adapter of one step."""

    step: int = Field(..., ge=0, description="The global step (global_step_<N>)")
    role: Role = Field("actor", description="actor, critic, or empty for SFT runs")
    include_base: bool = Field(True, description="Also release the clean base model under base/")
    base_model: Optional[str] = Field(None, description="The base model of a LoRA-only checkpoint")
    lora_alpha: Optional[float] = Field(None, gt=0, description="LoRA alpha when the run did not record it")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(None, description="Output dtype")
    validate_forward: bool = Field(True, description="Load base + adapter with PEFT and run a forward pass")
    compare_with_model_release: bool = Field(
        True, description="Compare PEFT's logits with the step's released merged model, when it was built from "
                          "this checkpoint")
    overwrite: bool = Field(False, description="Replace an adapter release built from a different checkpoint")

    @field_validator("base_model")
    @classmethod
    def _safe_base(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else checked_url(value)

    def recorded_options(self) -> dict:
        return self.model_dump(include={"include_base", "base_model", "lora_alpha", "dtype", "validate_forward"})

    def adapter_settings(self) -> AdapterSettings:
        return AdapterSettings(include_base=self.include_base, base_model=self.base_model,
                               lora_alpha=self.lora_alpha, dtype=self.dtype)

    def validation_settings(self) -> ValidationSettings:
        return ValidationSettings(forward=self.validate_forward)
