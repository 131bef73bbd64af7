"""`python -m benchmarks.all`: every figure of issue 19's goals from runs measured in one invocation.

Specification:
- each figure is the ratio of the medians of two kinds of runs measured in the same invocation (wall,
  peak RSS, or CPU seconds per GB of input), beside its goal, and met only at or under it; a figure whose
  runs were not measured is left out, never printed as a guess;
- the command prints the load average at its start and at its end, and the figures' table (smoke run:
  the startup figure on a session checkpoint, one repeat).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.all import figures
from benchmarks.harness import Run

ROOT = Path(__file__).resolve().parents[2]


def runs(key: str, *measured: tuple[float, float, float]) -> list[Run]:
    return [Run(key, wall, rss, cpu) for wall, rss, cpu in measured]


def test_each_figure_is_a_ratio_of_medians_beside_its_goal():
    found = {f.name: f for f in figures({
        "stepmerge": runs("stepmerge", (4.0, 600, 5), (3.0, 500, 5), (9.0, 700, 5)),  # medians 4.0 s, 600 MB
        "stepmerge_first": runs("stepmerge_first", (5.0, 650, 6)),
        "verl": runs("verl", (8.0, 3000, 9), (10.0, 2800, 9), (12.0, 2900, 9)),  # medians 10.0 s, 2900 MB
        "workers1": runs("workers1", (5.0, 450, 6)),
        "workers2": runs("workers2", (2.5, 500, 7.5)),
        "tiny": runs("tiny", (1.4, 300, 1)),
        "tiny_first": runs("tiny_first", (2.2, 300, 1)),
        "import_torch": runs("import_torch", (1.0, 200, 1)),
        "ray": runs("ray", (3.5, 300, 2)),
        "s3_local": runs("s3_local", (9.0, 900, 9.0)),
        "s3_s3": runs("s3_s3", (12.0, 1000, 15.0)),
    }, input_bytes=int(2.5e9))}
    assert {name: round(f.ratio, 3) for name, f in found.items()} == {
        "wall, stepmerge / verl 0.9.1": 0.4,
        "  the same as a run's first step (no memo)": 0.5,
        "  tiny, as a run's first step (no memo)": 2.2,
        "peak RSS, stepmerge / verl 0.9.1": round(600 / 2900, 3),
        "--workers 2 / --workers 1 (one shard)": 0.5,
        "tiny merge / python -c 'import torch'": 1.4,
        "Ray 2-CPU cluster / --workers 2": 1.4,
        "CPU per GB, s3:// -> local / local": 1.2,  # 3.6 s/GB against 3.0 s/GB
        "CPU per GB, s3:// -> s3:// / local": 2.0,
    }
    assert {name for name, f in found.items() if f.met} == {
        "--workers 2 / --workers 1 (one shard)", "CPU per GB, s3:// -> local / local"}  # at the goal is met
    assert found["CPU per GB, s3:// -> local / local"].numerator == "3.60 s/GB"
    assert found["wall, stepmerge / verl 0.9.1"].goal == 0.35


def test_a_figure_without_its_runs_is_left_out():
    found = figures({"workers2": runs("workers2", (2.0, 500, 5)), "ray": [], "verl": runs("verl", (1, 1, 1))},
                    input_bytes=10**9)
    assert found == []


def test_the_smoke_run_prints_the_load_and_the_startup_figure(fsdp_runs):
    actor = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    proc = subprocess.run([sys.executable, "-m", "benchmarks.all", "--quick", "--parts", "startup", "--checkpoint",
                           str(actor)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"load average at the start: [\d.]+ [\d.]+ [\d.]+", proc.stdout)
    line = re.search(r"tiny merge / python -c 'import torch'\s+([\d.]+) s / ([\d.]+) s\s+([\d.]+)\s+1\.30\s+(yes|NO)",
                     proc.stdout)
    assert line, proc.stdout
    merge, torch_import, ratio = (float(x) for x in line.groups()[:3])
    assert merge > 0 and torch_import > 0 and abs(ratio - merge / torch_import) < 0.02
    assert re.search(r"load average [\d. ]+ at the start, [\d. ]+ at the end", proc.stdout)
