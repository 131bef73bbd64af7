"""Which executor a merge task uses, and the names of its unit runs (no Ray needed here; the Ray path
itself runs in tests/flows/test_merge_step_ray.py on the session's cluster).

- the task's executor comes from the tasks' literal registry (`TASK_EXECUTORS`: the engine's plus
  ``prefect-ray``, `task_executor`): a flow parameter ``ray_address`` wins; else ``STEPMERGE_RAY_ADDRESS`` (a deployment job
  variable); else this process's threads with ``workers``;
- the flows refuse a Ray address that is no address, and ``workers`` below 1, before anything runs; the
  Ray runner refuses a dead address (`RayClusterUnreachable`) before Ray is asked to connect.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.params import MergeStepParams
from merge_engine.output.executors.local import LocalExecutor
from merge_engine.errors import RayClusterUnreachable
from tasks.shard_runs import (RAY_ADDRESS_ENV, PrefectRayExecutor, ray_task_runner, task_executor,
                              task_executor_address)
from tests.servers import free_ports


def test_the_flow_parameter_wins_over_the_workers_environment(monkeypatch):
    monkeypatch.setenv(RAY_ADDRESS_ENV, "ray://head:10001")
    assert task_executor_address(2, "127.0.0.1:6379") == "prefect-ray:127.0.0.1:6379"
    chosen = task_executor(2, "127.0.0.1:6379")
    assert isinstance(chosen, PrefectRayExecutor) and chosen.address == "127.0.0.1:6379"
    assert chosen.label is None  # named after the job's step when it runs
    assert task_executor(None, None).address == "ray://head:10001"


def test_without_an_address_the_units_run_on_threads_here(monkeypatch):
    monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    chosen = task_executor(3, None)
    assert isinstance(chosen, LocalExecutor) and chosen.workers == 3


@pytest.mark.parametrize("address", ["auto", "local", "127.0.0.1:6379", "ray://head-node.internal:10001"])
def test_ray_addresses_the_flows_accept(address):
    assert MergeStepParams(run_root="/r", step=1, ray_address=address).settings()["execution"].ray_address == address


@pytest.mark.parametrize("field, value", [("ray_address", "ftp://head:1"), ("ray_address", "head"),
                                          ("ray_address", "auto; rm -rf /"), ("workers", -1)])
def test_bad_execution_parameters_are_refused(field, value):
    with pytest.raises(ValidationError):
        MergeStepParams(run_root="/r", step=1, **{field: value})


def test_workers_0_is_the_forms_one_per_core():
    """The form has no None toggle: 0 (its default) means one shard job per core, as the CLI's default."""
    assert MergeStepParams(run_root="/r", step=1, workers=0).settings()["execution"].workers is None


def test_a_dead_ray_address_is_refused_before_ray_is_asked():
    """A flow's Ray runner checks the address first (Ray itself retries a dead one for minutes)."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(RayClusterUnreachable, match=address):
        ray_task_runner(address)


def test_importing_the_tasks_executors_registers_nothing_in_the_engine():
    """``prefect-ray`` is in the tasks' own table only: the engine's is the same before and after this module is
    imported (in a fresh interpreter), so an address names the same executor whatever was imported first."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[2]
    code = ("import json; from merge_engine.output import executors as e; before = sorted(e.EXECUTORS); "
            "import tasks.shard_runs as s; print(json.dumps([before, sorted(e.EXECUTORS), sorted(s.TASK_EXECUTORS)]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, tasks_table = json.loads(done.stdout)
    assert before == after == ["ray", "threads"]
    assert tasks_table == ["prefect-ray", "ray", "threads"]
