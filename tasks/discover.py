"""Listing tasks: what checkpoints a run root holds (or one step of it), and what is already released.

These are never cached: a listing is the cheap, always-fresh input every cache key is computed
from. They read no weight (the tracker file and release markers/manifests are a few bytes) and are
retried on transient storage faults like every stage.
"""

from __future__ import annotations

from typing import Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from merge_engine.layouts import discovery
from merge_engine.release.state import published_releases
from merge_engine.release.manifest import read_manifest
from tasks.records import DiscoveryRecord, Record, StepRecord
from tasks.retry import RETRY_OPTIONS


class PublishedRelease(Record):
    """A release readers trust: where, the step listing it was built from, and whether that checkpoint
    holds LoRA factors (as merge_step found them: ``checkpoint_lora``), when recorded."""

    name: str  # release folder name (`merge_engine.release.folders.release_folder_name`)
    step: int
    url: str
    fingerprint: str
    source: str
    source_listing: Optional[str] = None
    lora: Optional[bool] = None


@task(name="discover-steps", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def discover_steps(run_root: str, roles: Optional[tuple[str, ...]] = None,
                   settled: tuple[tuple[str, int, str], ...] = ()) -> DiscoveryRecord:
    """Every (step, role) under ``run_root`` with its status, from one recursive listing. The layouts' second
    look (`merge_engine.layouts.discovery.second_looks`) reads only complete steps of ``roles`` (None: every
    role) that are not ``settled``: (role, step, listing fingerprint) of steps released from that very listing."""
    done = frozenset(settled)
    found = discovery.discover(run_root, lambda s: (roles is None or s.role in roles)
                               and (s.role, s.step, s.fingerprint) not in done)
    return DiscoveryRecord(run_root=run_root, steps=tuple(StepRecord.from_step(s) for s in found.steps),
                           tracker_hint=found.tracker_hint)


@task(name="discover-step", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def discover_step(run_root: str, step: int, role: str, look_again: bool = True) -> Optional[StepRecord]:
    """One (step, role) of ``run_root`` with its status, from a listing of that step's folder only (and, with
    ``look_again``, the layouts' second look: `merge_engine.layouts.discovery.discover_step`)."""
    found = discovery.discover_step(run_root, step, role, look_again)
    return None if found is None else StepRecord.from_step(found)


@task(name="find-published", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def find_published(release_root: str) -> tuple[PublishedRelease, ...]:
    """Every trusted release under ``release_root`` (one listing + marker and manifest of each)."""
    out = []
    for (name, step), url in sorted(published_releases(release_root).items()):
        manifest = read_manifest(url)
        provenance = manifest.provenance
        out.append(PublishedRelease(name=name, step=step, url=url, fingerprint=manifest.fingerprint,
                                    source=manifest.source, source_listing=provenance.source_listing,
                                    lora=provenance.checkpoint_lora))
    return tuple(out)
