"""Benchmark: stepmerge vs verl's model merger on a real 4-rank FSDP2 checkpoint, same machine, same run.

    python -m benchmarks.fsdp_merge                 # Qwen2-0.5B shape (~2.5 GB fp32) and a 2x model
    python -m benchmarks.fsdp_merge --sizes 0.5b --repeats 3

What it does:
1. Writes (once, reused from ./.bench/fsdp/<size>/) a real verl-layout FSDP2 checkpoint, 4 ranks, fp32,
   untied embeddings, with `synthetic_runs` (real torch.distributed on CPU).
2. Sets up verl 0.9.1 in its own venv (./.bench/verl-venv; the exact commands are in `VERL_SETUP`
   and printed) with the same pinned torch.
3. Measures the I/O floor (cat and cp of the rank files, warm cache), then runs stepmerge and verl's
   merger alternately, both writing bfloat16, each in a child process whose wall time and peak RSS
   (ru_maxrss from wait4) are recorded; prints medians and ratios against verl.
4. Checks the two outputs hold the same tensors bit for bit (both cast fp32 -> bf16 the same way).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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

QWEN2_05B = dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, tie_word_embeddings=False)
SIZES = {"0.5b": QWEN2_05B, "1.2b": {**QWEN2_05B, "num_layers": 66}}  # 66 layers: twice the parameters


@dataclass(frozen=True)
class Run:
    tool: str
    wall_s: float
    peak_rss_mb: float


def ensure_checkpoint(size: str) -> Path:
    step_dir = BENCH / "fsdp" / size / "global_step_1"
    actor = step_dir / "actor"
    if (actor / "fsdp_config.json").exists():
        return actor
    shutil.rmtree(step_dir, ignore_errors=True)
    print(f"writing a 4-rank FSDP2 checkpoint of the {size} model to {actor} (once) ...", flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.fsdp_merge", "--write-checkpoint", size], check=True)
    print(f"  written in {time.perf_counter() - started:.0f} s", flush=True)
    return actor


def ensure_verl() -> Path | None:
    python = VERL_VENV / "bin/python"
    probe = [str(python), "-c", "import verl.model_merger.fsdp_model_merger"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print("setting up verl 0.9.1 in its own venv:")
    for command in VERL_SETUP:
        print("  $ " + " ".join(command), flush=True)
        if subprocess.run(command).returncode != 0:
            return None
    return python if subprocess.run(probe, capture_output=True).returncode == 0 else None


def write_checkpoint(size: str) -> None:
    """In a child process, so that the parent stays small (see `measure`)."""
    from synthetic_runs import FsdpSpec, ModelSpec, write_fsdp_step

    spec = FsdpSpec(model=ModelSpec(**SIZES[size]), world_size=4, strategy="fsdp2", save_contents=("model", "extra"))
    write_fsdp_step(str(BENCH / "fsdp" / size / "global_step_1"), spec, seed=0)


def measure(tool: str, command: list[str], env: dict[str, str] | None = None) -> Run:
    """Wall time and peak RSS of one child. The parent never imports torch: a forked child's
    ru_maxrss starts from the parent's resident size, so a large parent would inflate it."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{tool} failed:\n{stderr[-3000:]}")
    return Run(tool, wall, usage.ru_maxrss / 1024)


def io_floor(actor: Path) -> tuple[float, float]:
    ranks = sorted(str(p) for p in actor.glob("model_world_size_*_rank_*.pt"))
    started = time.perf_counter()
    subprocess.run(["cat", *ranks], stdout=subprocess.DEVNULL, check=True)
    cat = time.perf_counter() - started
    with tempfile.TemporaryDirectory(dir=BENCH) as tmp:
        started = time.perf_counter()
        subprocess.run(["cp", *ranks, tmp], check=True)
        cp = time.perf_counter() - started
    return cat, cp


def same_tensors(a: Path, b: Path) -> bool:
    """Run in a child process (`--compare A B`): the parent stays small."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp_merge", "--compare", str(a), str(b)])
    return proc.returncode == 0


def compare_folders(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def load(folder: Path) -> dict:
        out = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    x, y = load(a), load(b)
    return set(x) == set(y) and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def bench_size(size: str, repeats: int, verl_python: Path | None) -> dict[str, list[Run]]:
    actor = ensure_checkpoint(size)
    total = sum(p.stat().st_size for p in actor.glob("model_world_size_*"))
    cat, cp = io_floor(actor)
    io_floor(actor)
    print(f"\n== {size}: {total / 1e9:.2f} GB of rank files; I/O floor: cat {cat:.2f} s, cp {cp:.2f} s (warm)")
    runs: dict[str, list[Run]] = {"stepmerge": [], "verl": []}
    out = BENCH / "out" / size
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        runs["stepmerge"].append(measure("stepmerge", [
            sys.executable, "-m", "merge_engine", "merge", "--backend", "fsdp", "--local_dir", str(actor),
            "--target_dir", str(out / "stepmerge"), "--dtype", "bfloat16"], env))
        if verl_python:
            runs["verl"].append(measure("verl", [
                str(verl_python), "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                "--local_dir", str(actor), "--target_dir", str(out / "verl")], env))
    if verl_python:
        print(f"  outputs identical tensor for tensor: {same_tensors(out / 'stepmerge', out / 'verl')}")
    for tool, measured in runs.items():
        for run in measured:
            print(f"  {tool:9s} wall {run.wall_s:6.2f} s   peak RSS {run.peak_rss_mb:7.0f} MB")
    shutil.rmtree(out, ignore_errors=True)
    return runs


def median(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5b,1.2b", help=f"comma-separated, from {sorted(SIZES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--write-checkpoint", metavar="SIZE", help=argparse.SUPPRESS)
    parser.add_argument("--compare", nargs=2, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoint:
        return write_checkpoint(args.write_checkpoint)
    if args.compare:
        raise SystemExit(0 if compare_folders(Path(args.compare[0]), Path(args.compare[1])) else 1)
    BENCH.mkdir(exist_ok=True)
    verl_python = None if args.skip_verl else ensure_verl()
    if verl_python is None and not args.skip_verl:
        print("verl could not be set up: printing stepmerge alone")
    results = {size: bench_size(size, args.repeats, verl_python) for size in args.sizes.split(",")}
    print("\n== summary (medians)")
    print(f"{'size':6s} {'tool':9s} {'wall s':>8s} {'peak RSS MB':>12s} {'wall/verl':>10s} {'RSS/verl':>9s}")
    for size, runs in results.items():
        for tool in ("stepmerge", "verl"):
            if not runs[tool]:
                continue
            wall, rss = median(runs[tool], "wall_s"), median(runs[tool], "peak_rss_mb")
            ratio = ""
            if runs["verl"]:
                ratio = f"{wall / median(runs['verl'], 'wall_s'):10.2f} {rss / median(runs['verl'], 'peak_rss_mb'):9.2f}"
            print(f"{size:6s} {tool:9s} {wall:8.2f} {rss:12.0f} {ratio}")
    if len(results) > 1:
        sizes = list(results)
        a, b = (median(results[s]["stepmerge"], "peak_rss_mb") for s in sizes[:2])
        print(f"stepmerge peak RSS {sizes[1]} / {sizes[0]}: {b / a:.2f} (flat = memory bounded by a chunk, not the model)")


if __name__ == "__main__":
    main()
