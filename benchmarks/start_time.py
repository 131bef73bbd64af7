"""Benchmark: how fast a command starts. A merge of the demo's tiny FSDP2 checkpoint against
``python -c "import torch"`` in the same venv, and the commands that read no weights.

    python -m benchmarks.start_time                  # 5 rounds
    python -m benchmarks.start_time --repeats 9 --importtime

What it does:
1. Writes (once, reused from ./.bench/start/) the demo's step: a 4-rank FSDP2 checkpoint of the tiny Qwen2
   (`flows.demo.write_demo_run`'s spec, ~0.8 MB of weights), with `synthetic_runs`.
2. Runs, round after round so that load changes hit every command alike, each in a child process:
   ``python -c "import torch"``; ``python -c "import torch; import transformers; AutoConfig.for_model('qwen2')"``
   (the floor of a merge that writes the config in the Hub's form); the merge (``python -m merge_engine
   merge``, a fresh target each time); ``--help``, ``check``, ``discover``, ``verify``.
3. Prints each command's median wall and CPU seconds (rusage), the merge / ``import torch`` ratios (goal:
   wall <= 1.3), and the load average at start and end. ``--importtime``: the heaviest modules one merge
   imports (``python -X importtime``), by cumulative microseconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import BENCH, Run, measure, median

STEP = BENCH / "start" / "global_step_1"
ACTOR = STEP / "actor"


def ensure_checkpoint() -> Path:
    if (ACTOR / "fsdp_config.json").exists():
        return ACTOR
    shutil.rmtree(STEP, ignore_errors=True)
    print(f"writing the demo's tiny 4-rank FSDP2 checkpoint to {ACTOR} (once) ...", flush=True)
    code = ("from synthetic_runs.fsdp import FsdpSpec, StepJob, write_fsdp_steps; "
            f"write_fsdp_steps([StepJob({str(STEP)!r}, FsdpSpec(world_size=4, strategy='fsdp2'), 1)])")
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return ACTOR


def commands(work: Path, round_: int) -> dict[str, list[str]]:
    engine = [sys.executable, "-m", "merge_engine"]
    return {
        "import torch": [sys.executable, "-c", "import torch"],
        "torch + config": [sys.executable, "-c", "import torch; from transformers import AutoConfig; "
                                                 "AutoConfig.for_model('qwen2')"],
        "merge": engine + ["merge", "--backend", "fsdp", "--local_dir", str(ACTOR),
                           "--target_dir", str(work / f"out{round_}")],
        "--help": engine + ["--help"],
        "check": engine + ["check", "--local_dir", str(ACTOR)],
        "discover": engine + ["discover", "--run-root", str(STEP.parent)],
        "verify": engine + ["verify", str(work / f"out{round_}")],
    }


def import_profile(work: Path) -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "merge_engine", "merge", "--backend", "fsdp",
                           "--local_dir", str(ACTOR), "--target_dir", str(work / "profiled")],
                          capture_output=True, text=True, check=True)
    rows = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            depth = (len(name) - len(name.lstrip())) // 2
            rows.append((int(parts[1]), depth, name.strip()))
    print("heaviest imports of one merge (cumulative; depth 0 = imported by the engine or at run time):")
    for cumulative, depth, name in sorted((r for r in rows if r[1] <= 1), reverse=True)[:12]:
        print(f"  {cumulative / 1e6:6.3f} s  {'  ' * depth}{name}")
    watched = ("torch.distributed.tensor", "transformers.conversion_mapping", "sympy")
    print("  imported: " + ", ".join(f"{m}: {'yes' if any(r[2] == m for r in rows) else 'no'}" for m in watched))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--importtime", action="store_true", help="also list the heaviest imports of one merge")
    args = parser.parse_args()
    ensure_checkpoint()
    load_start = os.getloadavg()
    runs: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="start-time-") as tmp:
        work = Path(tmp)
        for round_ in range(args.repeats):
            for name, command in commands(work, round_).items():
                runs.setdefault(name, []).append(measure(name, command))
        if args.importtime:
            import_profile(work)
    load_end = os.getloadavg()
    print(f"medians of {args.repeats} rounds (load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end):")
    for name, measured in runs.items():
        walls = ", ".join(f"{r.wall_s:.2f}" for r in measured)
        print(f"  {name:15s} wall {median(measured, 'wall_s'):5.2f} s  CPU {median(measured, 'cpu_s'):5.2f} s"
              f"   (walls: {walls})")
    torch_wall, torch_cpu = median(runs["import torch"], "wall_s"), median(runs["import torch"], "cpu_s")
    print(f"merge / import torch: wall {median(runs['merge'], 'wall_s') / torch_wall:.2f}x (goal <= 1.3), "
          f"CPU {median(runs['merge'], 'cpu_s') / torch_cpu:.2f}x; "
          f"floor (torch + transformers config) / import torch: wall "
          f"{median(runs['torch + config'], 'wall_s') / torch_wall:.2f}x")


if __name__ == "__main__":
    main()
