"""Two concurrent runs of one step (two worker processes, one Prefect API, one result store) publish once.

Both processes start merge_step for the same step at the same moment (a file barrier); the run that
merges holds its merge until the other run has found the lock held (a file it touches then), so the
second run certainly arrives while the first is merging. With SERIALIZABLE cache
isolation the second waits for the first's lock on the output's chain and then takes its record: exactly one
merge and one publish run, the other run's chain is Cached (no stage of it runs), and the release is whole
with one manifest and
holds the step's own weights (judged from outside stepmerge, `tests.release_checks`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from merge_engine.release.publish import claims_url
from merge_engine.release.manifest import read_manifest
from merge_engine.release.folders import release_url
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import copy_steps
from tests.release_checks import assert_release_of_step

WORKER = r"""
import json, sys, time
from pathlib import Path

import tasks.build
import tasks.locking

run_root, staging, barrier, me = sys.argv[1:5]
run_job = tasks.build.run_job
try_acquire = tasks.locking.CrashSafeFileLockManager._try_acquire
merged = []

def held_merge(job, **kwargs):  # the race, made certain: this run merges until the other waits for its lock
    merged.append(job.source_url)
    deadline = time.monotonic() + 120  # bounds a hang only
    while not [p for p in Path(barrier).glob("blocked-*") if p.name != f"blocked-{me}"]:
        assert time.monotonic() < deadline, "the other run never waited for the lock"
        time.sleep(0.01)
    return run_job(job, **kwargs)

def watched_try_acquire(self, key, holder, hold_timeout):
    got = try_acquire(self, key, holder, hold_timeout)
    if got is False:  # held by the other run: say so
        Path(barrier, f"blocked-{me}").touch()
    return got

tasks.build.run_job = held_merge
tasks.locking.CrashSafeFileLockManager._try_acquire = watched_try_acquire

from flows.merge_step import merge_step

Path(barrier, f"ready-{me}").touch()
while len(list(Path(barrier).glob("ready-*"))) < 2:
    time.sleep(0.01)
outcome = merge_step(run_root=run_root, step=1, staging_root=staging)
print("RESULT " + json.dumps({"stages": {s.name: s.state for s in outcome.stages}, "merged": len(merged),
                               "release": outcome.releases[0].url, "status": outcome.status}))
"""


def test_two_concurrent_runs_of_one_step_publish_once(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PREFECT_API_URL=prefect.url, PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(prefect.results),
               PYTHONPATH=str(repo), PREFECT_LOGGING_LEVEL="WARNING")
    command = [sys.executable, "-c", WORKER, run_root, str(tmp_path / "staging"), str(barrier)]
    workers = [subprocess.Popen(command + [str(i)],
                                env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err[-3000:]
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))

    chains = sorted(results, key=lambda r: r["stages"]["model-release"])
    # one ran the chain; the other waited for its lock and took its record: no stage of it ran there
    assert [r["stages"]["model-release"] for r in chains] == ["Cached", "Completed"]
    assert chains[1]["stages"]["merge"] == chains[1]["stages"]["publish"] == "Completed"
    assert not {"merge", "validate", "publish"} & set(chains[0]["stages"])
    assert sum(r["merged"] for r in results) == 1
    release = release_url(str(tmp_path / "run" / "releases"), "actor", 1)
    assert {r["release"] for r in results} == {release}
    assert verify_folder(release).ok
    assert_release_of_step(release, template_run, 1)
    assert not list(Path(claims_url(str(tmp_path / "run" / "releases" / "actor" / "global_step_1"))).glob("*.json"))
    assert read_manifest(release).attempt
