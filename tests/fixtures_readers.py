"""Session fixture `readers_python`: the interpreter of the transformers 4.57 / peft 0.17 environment
(`tests.readers_env`, built once per machine, cached), and `run_readers` to run `tests.readers_check`
on a list of jobs there: one subprocess for the whole list."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

CHECK_SCRIPT = Path(__file__).with_name("readers_check.py")
READERS_TIMEOUT_S = 900  # a whole matrix in one process, on a loaded 2-core machine


@pytest.fixture(scope="session")
def readers_python() -> Path:
    from tests.readers_env import readers_python as build

    return build()


def run_readers(python: Path, jobs: list[dict[str, Any]], workdir: Path) -> list[dict[str, Any]]:
    """`tests.readers_check` on ``jobs`` in the interpreter ``python``: one result per job, in order."""
    jobs_file, results_file = workdir / "jobs.json", workdir / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    done = subprocess.run([str(python), str(CHECK_SCRIPT), str(jobs_file), str(results_file)], capture_output=True,
                          text=True, timeout=READERS_TIMEOUT_S, cwd=workdir)
    assert done.returncode == 0, f"the readers' process failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results = json.loads(results_file.read_text())
    assert len(results) == len(jobs)
    return results
