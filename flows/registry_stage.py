"""The register stage of the flows: each published release of a step -> a model version in MLflow's Model Registry.

Runs after publish (and after the Hub push), one ``register-in-mlflow`` task per release
(`tasks.registry.register_release_version`), only when the flow has an ``mlflow_model``: the model release becomes
a version of ``mlflow_model``, an adapter release one of ``<mlflow_model>-adapter``. A registration that fails is
recorded in the step's outcome (`flows.outcomes.RegistryOutcome`, one line) and in the summary; the release stays
published, and the flow raises the error after its summary is written (`flows.hub_stage.raise_failed_push`), so
the run ends Failed at that stage. Running the flow again for the step is a cache hit for the release and gives
the same version (no second one).
"""

from typing import Any, Optional

from flows.outcomes import RegistryOutcome, ReleaseOutcome, StepOutcome
from merge_engine.errors import one_line
from merge_engine.release.folders import ADAPTER
from tasks.registry import RegistryTarget, register_release_version


def registry_target(params: Any) -> Optional[RegistryTarget]:
    """The flow's registry target from its parameters (``mlflow_model``, ``mlflow_tracking_uri``); None without an
    ``mlflow_model``."""
    name = getattr(params, "mlflow_model", None)
    if not name:
        return None
    return RegistryTarget(name=name, tracking_uri=getattr(params, "mlflow_tracking_uri", None) or None)


def register_releases(timer: Any, outcome: StepOutcome, target: Optional[RegistryTarget]) -> Optional[BaseException]:
    """Register each release of ``outcome`` with ``target`` (a stage per release, timed by ``timer``), recording
    each in ``outcome.registrations``; stops at the first failure and returns its error (None: all registered, or
    no target)."""
    if target is None:
        return None
    for release in outcome.releases:
        adapter = release.kind == ADAPTER
        try:
            version = timer.run("register-adapter" if adapter else "register", register_release_version, release.url,
                                target, outcome.run_root, outcome.step, adapter)
        except Exception as exc:  # noqa: BLE001 - recorded, then raised by the flow after its summary
            outcome.registrations.append(failed_registration(release, target, exc))
            return exc
        outcome.registrations.append(RegistryOutcome(kind=release.kind, name=version.name, version=version.version,
                                                     source=version.source, created=version.created))
    return None


def failed_registration(release: ReleaseOutcome, target: RegistryTarget, exc: BaseException) -> RegistryOutcome:
    return RegistryOutcome(kind=release.kind, name=target.model_name(release.kind == ADAPTER),
                           error=one_line(f"{type(exc).__name__}: {exc}", 400))


__all__ = ["register_releases", "registry_target"]
