"""`python -m benchmarks.gpu` on a tiny model: it runs where prefect, pydantic, s3fs and gcsfs cannot be
imported (as in a bare CUDA image), prints each figure it measured and no other, and writes them as JSON.
Its own relative errors, new factoring against the full SVD, agree within 1e-3 (it exits 1 otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "128", "--intermediate", "256", "--vocab", "256", "--heads", "4"]


def test_the_gpu_benchmark_measures_each_figure_it_prints(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", *TINY, "--work", str(tmp_path / "work"),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "imported: none of prefect, pydantic, pydantic_core, s3fs, gcsfs" in done.stdout
    result = json.loads(out.read_text())
    figures, seconds = result["figures"], result["seconds"]
    want = {"svd_new_cpu", "svd_full_cpu", "forward_cpu"} | (
        {"svd_new_cuda", "svd_full_cuda", "forward_cuda"} if torch.cuda.is_available() else set())
    assert set(seconds) == want
    assert figures["SVD full CPU / new CPU (speed-up on this CPU)"] == seconds["svd_full_cpu"] / seconds["svd_new_cpu"]
    assert figures["max |relative error new - full|"] <= 1e-3
    assert ("forward CPU / GPU" in figures) == torch.cuda.is_available()  # a figure without its runs is left out
    for name in figures:
        assert name in done.stdout
