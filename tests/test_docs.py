"""The docs run as written (issue 20, point 6): every fenced block tagged ``bash runnable`` in
README.md and deployments/README.md is run by bash (``-euo pipefail``), against the session's real
servers: SeaweedFS S3 (a training run's step 1 copied into a fresh bucket) and the Prefect API.

The environment a reader has after the docs' setup: ``PREFECT_API_URL``, the S3 endpoint and keys,
``STEPMERGE_RUN_ROOT`` (the run), ``stepmerge`` and ``prefect`` on ``PATH`` (this checkout's code);
each block runs in its own empty folder (``./hf_model`` lands there). A block that exits non-zero
fails with its output. Blocks that need what a test cannot give (a GPU worker, systemd, Postgres)
are not tagged; that they are not is visible in the docs themselves.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_pipeline import copy_steps

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "deployments/README.md")


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(doc, line, body) of every ```bash runnable block."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for match in re.finditer(r"^```bash runnable\n(.*?)^```", text, flags=re.M | re.S):
            found.append((doc, text[:match.start()].count("\n") + 1, match.group(1)))
    return found


def test_each_doc_has_runnable_blocks():
    docs = {doc for doc, _, _ in runnable_blocks()}
    assert docs == set(DOCS)


@pytest.fixture
def reader_env(prefect, template_run, s3_env, s3_bucket_url, tmp_path) -> dict[str, str]:
    run_root = f"{s3_bucket_url}/run"
    copy_steps(template_run, run_root, [1])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "stepmerge"  # the console script of THIS checkout (the venv's points at its own install)
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m flows.cli \"$@\"\n")
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPMERGE_S3_BLOCK")}
    env.update(PREFECT_API_URL=prefect.url, STEPMERGE_RUN_ROOT=run_root, PYTHONPATH=str(ROOT),
               PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}")
    return env


@pytest.mark.parametrize("doc, line, body", runnable_blocks(), ids=lambda v: str(v)[:40].replace("\n", " ")
                         if not isinstance(v, int) else str(v))
def test_a_runnable_block_of_the_docs_runs(reader_env, tmp_path, doc, line, body):
    folder = tmp_path / "cwd"
    folder.mkdir()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=folder, env=reader_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{doc}:{line} exited {done.returncode}\n{body}\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
