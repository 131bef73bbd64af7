"""The push task: a published release -> its own revision of a Hugging Face Hub repo (`merge_engine.release.hub`).

Thin over `merge_engine.release.hub.push_folder`, which pushes what the manifest lists (card and manifest
included, never ``_COMPLETE``), makes no commit when the revision already holds this manifest, and verifies the
revision against the manifest with the Hub's own file metadata. The task adds:
- where: the revision is the flow's template filled with the step and role (`merge_engine.release.hub_refs`;
  an adapter's gets ``-adapter``), and the moving ref (e.g. ``latest``) follows it;
- the token, read here and never passed, logged or returned: the Prefect Secret block named by
  ``HubTarget.token_secret``, else ``HF_TOKEN`` in the worker's environment (else huggingface_hub's stored login);
- retries: only a transient fault (the Hub out of reach, 429, 5xx: `HubPushRefused.transient`, or a transient
  storage fault reading an object-store release); a refusal (no token, no write access, no repo) fails at once.
The task runs after publish: a failed push fails this stage, never the release, which stays published.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from merge_engine.errors import HubPushRefused
from merge_engine.release.hub import HubPush, push_folder
from merge_engine.release.hub_refs import DEFAULT_REVISION_TEMPLATE, moving_refs_for, revision_for
from tasks.retry import RETRY_OPTIONS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubTarget:
    """Where a flow pushes its releases: ``repo`` (namespace/name), the revision ``template``, an optional
    ``moving_ref``, ``private`` (create the repo private when missing), the Secret block holding the token
    (``token_secret``; None: ``HF_TOKEN``) and ``endpoint`` (None: ``HF_ENDPOINT``, else huggingface.co)."""

    repo: str
    template: str = DEFAULT_REVISION_TEMPLATE
    moving_ref: Optional[str] = None
    private: bool = False
    token_secret: Optional[str] = None
    endpoint: Optional[str] = None


def hub_token(secret: Optional[str]) -> Optional[str]:
    """The token: the Secret block ``secret`` (its value), else ``HF_TOKEN`` (None: huggingface_hub's own lookup).
    Raises `HubPushRefused` (one line) when the block cannot be read."""
    if not secret:
        return os.environ.get("HF_TOKEN") or None
    from prefect.blocks.system import Secret

    try:
        block = Secret.load(secret)
        value = block.get() if isinstance(block, Secret) else None  # a sync caller's block (never a coroutine here)
    except Exception as exc:  # noqa: BLE001 - a missing block, or one of another type: one line
        raise HubPushRefused(f"no Prefect Secret block named {secret!r} to read the Hub token from "
                             f"({type(exc).__name__})", secret) from None
    if not isinstance(value, str) or not value:
        raise HubPushRefused(f"the Prefect Secret block {secret!r} holds no token", secret)
    return value


@task(name="push-to-hub", cache_policy=NO_CACHE, persist_result=False,
      **RETRY_OPTIONS)
def push_release(release: str, target: HubTarget, step: int, role: str, adapter: bool = False) -> HubPush:
    """Push the release at ``release`` (step ``step`` of ``role``; ``adapter``: an adapter release) to ``target``
    (see the module docstring). Raises `HubPushRefused`, `HubPushUnverified`, `ReleaseIncomplete`,
    `InvalidOption` (a template or ref that gives no branch name)."""
    revision = revision_for(target.template, step, role, adapter)
    refs = moving_refs_for([target.moving_ref] if target.moving_ref else [], adapter)
    pushed = push_folder(release, target.repo, revision=revision, private=target.private,
                         token=hub_token(target.token_secret), moving_refs=refs,
                         endpoint=target.endpoint or os.environ.get("HF_ENDPOINT") or None)
    logger.info("%s", pushed.summary())
    return pushed


__all__ = ["HubTarget", "hub_token", "push_release"]
