"""Register a published release as a model version in MLflow's Model Registry, by reference.

Contract of `register_release`:
- What: the release at ``release`` (a valid ``_COMPLETE`` marker vouching for its manifest, else
  `ReleaseIncomplete`) becomes a version of the registered model ``name`` (created when missing) whose ``source``
  is the release's URL: the weights stay where they are, nothing is logged or copied into MLflow's artifact store.
  MLflow's server takes an object-store URL (``s3://``, ``gs://``) as a source; it refuses a local path, so a
  release on local disk is refused here (`RegistryRefused`), before anything is created.
- Tags of the version (`TAGS`): the run root, the step, the release's fingerprint, the manifest's sha256 and the
  release URL; its description names the step and the release.
- Idempotent: a version of ``name`` already tagged with this manifest's sha256 and release URL is returned as it is
  (``created`` False); no second version.
- Refusals, one named line each (`RegistryRefused`): the MLflow client not installed (the ``mlflow`` extra), the
  tracking server out of reach or refusing the request. ``transient`` is True exactly when the server was out of
  reach (a connection fault or timeout) or answered 429 / 5xx (`unreachable`): the same call may succeed later.
- mlflow is imported only when a release is registered: the engine runs without it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from merge_engine import storage
from merge_engine.errors import RegistryRefused, ReleaseIncomplete
from merge_engine.layouts.runs import step_of_folder
from merge_engine.release.folders import MANIFEST, RELEASES_DIR
from merge_engine.release.manifest import released_manifest

TAG_PREFIX = "stepmerge."
TAGS = ("run_root", "step", "fingerprint", "manifest_sha256", "release_url")


@dataclass(frozen=True)
class RegisteredVersion:
    """A model version of a release: ``name`` / ``version``, its ``source`` (the release URL), and whether this call
    created it."""

    name: str
    version: str
    source: str
    created: bool
    tags: dict

    def summary(self) -> str:
        done = "registered" if self.created else "already registered (no new version)"
        return f"{self.name} version {self.version}: {done}, source {self.source}"


def run_root_of(release: str) -> str:
    """The run root of a release under the default release root (``<run_root>/releases/<folder>/global_step_N``),
    else the release root (the folder above the release's folder)."""
    parts = release.rstrip("/").rsplit("/", 3)
    if len(parts) == 4 and parts[1] == RELEASES_DIR:
        return parts[0]
    return release.rstrip("/").rsplit("/", 2)[0]


def release_tags(release: str, run_root: str | None = None, step: int | None = None) -> dict[str, str]:
    """The version's tags (`TAGS`, each prefixed ``stepmerge.``) of the release at ``release``: ``run_root``
    (default `run_root_of`), ``step`` (default: from the release folder's name). Raises `ReleaseIncomplete`."""
    manifest = released_manifest(release)
    if manifest is None:
        raise ReleaseIncomplete("no valid _COMPLETE marker: not a published release to register", release)
    sha = hashlib.sha256(storage.read_bytes(storage.join(release, MANIFEST))).hexdigest()
    found = step if step is not None else step_of_folder(release.rstrip("/").rsplit("/", 1)[-1])
    values = {"run_root": run_root or run_root_of(release), "step": "" if found is None else str(found),
              "fingerprint": manifest.fingerprint, "manifest_sha256": sha, "release_url": release}
    return {TAG_PREFIX + key: values[key] for key in TAGS}


def _client(tracking_uri: str):
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise RegistryRefused("the MLflow client is not installed: pip install 'stepmerge[mlflow]'", tracking_uri) \
            from None
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _existing(client, name: str, tags: dict[str, str]):
    """The version of ``name`` tagged with this manifest and release URL, or None."""
    key = TAG_PREFIX + "manifest_sha256"
    found = client.search_model_versions(f"name = '{name}' and tags.`{key}` = '{tags[key]}'")
    url = tags[TAG_PREFIX + "release_url"]
    return next((v for v in found if v.tags.get(TAG_PREFIX + "release_url") == url), None)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (an MLflow client error) means the server was out of reach or busy: a ``requests`` transport
    error (connection, timeout, retries exhausted) anywhere in its chain, or an answer with HTTP status 429 or 5xx."""
    import requests

    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, requests.exceptions.RequestException):
            return True
        status = getattr(link, "get_http_status_code", None)
        if callable(status):
            code = status()
            if isinstance(code, int) and (code == 429 or code >= 500):
                return True
        link = link.__cause__ or link.__context__
    return False


def register_release(release: str, tracking_uri: str, name: str, *, run_root: str | None = None,
                     step: int | None = None) -> RegisteredVersion:
    """Register ``release`` as a version of ``name`` at the MLflow server ``tracking_uri`` (see the module
    docstring). Raises `ReleaseIncomplete` (not a published release), `RegistryRefused` (one line: a local
    release, no MLflow client, the server out of reach or refusing)."""
    tags = release_tags(release, run_root, step)
    if storage.is_local(release):
        raise RegistryRefused("a release on local disk cannot be registered by reference (MLflow refuses a local "
                              "source): publish it to an object store", release)
    client = _client(tracking_uri)
    try:
        from mlflow.exceptions import MlflowException

        existing = _existing(client, name, tags)
        if existing is not None:
            return RegisteredVersion(name, str(existing.version), existing.source, False, dict(existing.tags))
        try:
            client.create_registered_model(name, description="releases published by stepmerge")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        step_text = tags[TAG_PREFIX + "step"]
        version = client.create_model_version(name, source=release, tags=tags,
                                              description=f"step {step_text} of {tags[TAG_PREFIX + 'run_root']}, "
                                                          f"published by stepmerge at {release}")
    except RegistryRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - MlflowException, or the transport's errors: one line
        first = (str(exc).strip().splitlines() or [""])[0]
        refused = RegistryRefused(f"the MLflow server at {tracking_uri} refused or could not be reached: "
                                  f"{type(exc).__name__}: {first}", release)
        refused.transient = unreachable(exc)
        raise refused from exc
    return RegisteredVersion(name, str(version.version), version.source, True, dict(tags))


__all__ = ["RegisteredVersion", "TAGS", "register_release", "release_tags", "run_root_of", "unreachable"]
