"""The register task: a published release -> a model version in MLflow's Model Registry (`merge_engine.release.registry`).

Thin over `merge_engine.release.registry.register_release`, which registers the release by reference (its URL is
the version's source: the weights stay where they are), tags the version with the run root, step, fingerprint,
manifest sha256 and release URL, and returns the existing version when this manifest is already registered. The
task adds:
- where: the tracking server is the flow's ``mlflow_tracking_uri``, else ``MLFLOW_TRACKING_URI`` in the worker's
  environment (neither: `RegistryRefused`, one line);
- retries: only a transient fault (the server out of reach, 429, 5xx: `RegistryRefused.transient`, or a transient
  storage fault reading an object-store release); a refusal (no client, a local release, the server refusing the
  request) fails at once.
The task runs after publish: a failed registration fails this stage, never the release, which stays published.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from merge_engine.errors import RegistryRefused
from merge_engine.release.registry import RegisteredVersion, register_release
from tasks.retry import RETRY_OPTIONS

logger = logging.getLogger(__name__)

ADAPTER_SUFFIX = "-adapter"


@dataclass(frozen=True)
class RegistryTarget:
    """Where a flow registers its releases: the registered model ``name`` (an adapter release goes to
    ``<name>-adapter``) at the MLflow server ``tracking_uri`` (None: ``MLFLOW_TRACKING_URI``)."""

    name: str
    tracking_uri: Optional[str] = None

    def model_name(self, adapter: bool) -> str:
        """The registered model of a release: ``name``, or ``<name>-adapter`` for an adapter release."""
        return self.name + ADAPTER_SUFFIX if adapter else self.name


def tracking_uri(target: RegistryTarget) -> str:
    """The target's tracking URI, else ``MLFLOW_TRACKING_URI``. Raises `RegistryRefused` when neither is set."""
    uri = target.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri:
        raise RegistryRefused("no MLflow tracking server: set the flow's mlflow_tracking_uri or "
                              "MLFLOW_TRACKING_URI on the worker", target.name)
    return uri


@task(name="register-in-mlflow", cache_policy=NO_CACHE, persist_result=False,
      **RETRY_OPTIONS)
def register_release_version(release: str, target: RegistryTarget, run_root: str, step: int,
                             adapter: bool = False) -> RegisteredVersion:
    """Register the release at ``release`` (step ``step`` of the run at ``run_root``; ``adapter``: an adapter
    release) as a version of ``target``'s model (see the module docstring). Raises `RegistryRefused`,
    `ReleaseIncomplete`."""
    registered = register_release(release, tracking_uri(target), target.model_name(adapter), run_root=run_root,
                                  step=step)
    logger.info("%s", registered.summary())
    return registered


__all__ = ["RegistryTarget", "register_release_version", "tracking_uri"]
