"""What every benchmark shares: child-process measurement, verl's venv, output comparison.

Peak RSS is ru_maxrss of each child from wait4. A forked child's ru_maxrss starts from its
parent's resident size, so the benchmark parents never import torch: anything heavy (writing a
checkpoint, comparing outputs) runs in a child of its own.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / ".bench"
VERL_VENV = BENCH / "verl-venv"
VERL_SETUP = [
    [sys.executable, "-m", "venv", str(VERL_VENV)],
    [str(VERL_VENV / "bin/pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"), "torch==2.13.0",
     "transformers>=5.5.3,<5.11", "accelerate", "safetensors", "numpy", "tqdm", "ray", "tensordict", "omegaconf"],
    [str(VERL_VENV / "bin/pip"), "install", "-q", "--no-deps", "verl==0.9.1"],
]


@dataclass(frozen=True)
class Run:
    tool: str
    wall_s: float
    peak_rss_mb: float
    cpu_s: float = 0.0  # the child's user + system seconds (rusage)


def measure(tool: str, command: list[str], env: dict[str, str] | None = None) -> Run:
    """Wall time, peak RSS and CPU seconds of one child process; exits with its stderr if it fails."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{tool} failed:\n{stderr[-3000:]}")
    return Run(tool, wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime)


def print_runs(runs: dict[str, list[Run]]) -> None:
    for tool, measured in runs.items():
        for run in measured:
            print(f"  {tool:9s} wall {run.wall_s:6.2f} s   peak RSS {run.peak_rss_mb:7.0f} MB")


def median(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def ensure_verl(extra_setup: list[list[str]] = (), probe: str = "import verl.model_merger.fsdp_model_merger",
                env: dict[str, str] | None = None) -> Path | None:
    """verl 0.9.1 in its own venv (`VERL_SETUP` + ``extra_setup``, printed as run); None if it cannot be set up."""
    python = VERL_VENV / "bin/python"
    check = [str(python), "-c", probe]
    if python.exists() and subprocess.run(check, capture_output=True, env=env).returncode == 0:
        return python
    print("setting up verl 0.9.1 in its own venv:")
    for command in ([] if python.exists() else VERL_SETUP[:1]) + VERL_SETUP[1:] + list(extra_setup):
        print("  $ " + " ".join(command), flush=True)
        if subprocess.run(command).returncode != 0:
            return None
    return python if subprocess.run(check, capture_output=True, env=env).returncode == 0 else None


def load_folder(folder: Path) -> dict:
    """Every tensor of a folder's safetensors files (run in a child: it imports torch)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def same_tensors(found: dict, expected: dict) -> bool:
    import torch

    return set(found) == set(expected) and all(
        found[k].dtype == v.dtype and torch.equal(found[k], v) for k, v in expected.items())
