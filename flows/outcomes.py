"""What a step's run did, as records: each stage call, each output, the step as a whole.

`StageRun` (a stage task call: name, final state, wall time), `ReleaseOutcome` (one output of a
step: where it was published, cached or not, the validation verdict), `HubPushOutcome` (its push to the Hub) and `StepOutcome` (a
``merge_step`` / ``release_adapter`` run: status, releases, stages). Pydantic models: they are flow
results Prefect stores and the watcher's report embeds. No task, engine or torch import here: the
listings-only watcher (`flows.merge_new_steps`) and the summaries import them; the stage chains
that produce them are `flows.stages`.
"""

from typing import List, Optional

from pydantic import BaseModel

from flows.step_keys import step_key
from tasks.result_records import register_result_type


class StageRun(BaseModel):
    """One stage task call: its name, final state and wall time (Prefect overhead included)."""

    name: str
    state: str
    seconds: float

    @property
    def cached(self) -> bool:
        return self.state == "Cached"


class ReleaseOutcome(BaseModel):
    """What one output of a step became."""

    kind: str
    url: str
    fingerprint: str
    already_published: bool
    cached: bool
    validation_ok: Optional[bool]
    validation_summary: str = ""
    tensors: int = 0
    tensor_bytes: int = 0
    files: int = 0
    total_bytes: int = 0


class HubPushOutcome(BaseModel):
    """What the push of one release to the Hugging Face Hub did (``error``: one line, when it failed)."""

    kind: str
    repo: str
    revision: str = ""
    commit: str = ""
    committed: bool = False
    files: int = 0
    total_bytes: int = 0
    moved_refs: List[str] = []
    error: str = ""


class RegistryOutcome(BaseModel):
    """What the registration of one release in MLflow's Model Registry did (``error``: one line, when it failed)."""

    kind: str
    name: str
    version: str = ""
    source: str = ""
    created: bool = False
    error: str = ""


@register_result_type
class StepOutcome(BaseModel):
    """What a merge_step run did: status, releases, and every stage with its state and time."""

    run_root: str
    step: int
    role: str
    status: str  # "published" | "already_published" | "not_ready"
    reason: str = ""
    releases: List[ReleaseOutcome] = []
    stages: List[StageRun] = []
    pushes: List[HubPushOutcome] = []  # the releases pushed to the Hub after publish (none: no hub_repo)
    registrations: List[RegistryOutcome] = []  # the releases registered in MLflow after publish (none: no mlflow_model)
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return step_key(self.run_root, self.role, self.step)

    @property
    def cached(self) -> bool:
        return bool(self.releases) and all(r.cached for r in self.releases)
