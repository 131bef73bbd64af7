"""Benchmark: stepmerge vs verl's model merger on a real 4-rank FSDP2 checkpoint, same machine, same run.

    python -m benchmarks.fsdp_merge                 # Qwen2-0.5B shape (~2.5 GB fp32) and a 2x model
    python -m benchmarks.fsdp_merge --sizes 0.5b --repeats 3

What it does:
1. Writes (once, reused from ./.bench/fsdp/<size>/) a real verl-layout FSDP2 checkpoint, 4 ranks, fp32,
   untied embeddings, with `synthetic_runs` (real torch.distributed on CPU).
2. Sets up verl 0.9.1 in its own venv (./.bench/verl-venv; the exact commands are
   `benchmarks.harness.VERL_SETUP`, printed as they run) with the same pinned torch.
3. Measures the I/O floor (cat and cp of the rank files, warm cache), then runs stepmerge and verl's
   merger alternately, each from a warm page cache (the rank files are read once before each run),
   both writing bfloat16, each in a child process whose wall time and peak RSS
   (ru_maxrss from wait4) are recorded; prints medians and ratios against verl.
4. Checks the two outputs hold the same tensors bit for bit (both cast fp32 -> bf16 the same way).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    BENCH,
    Run,
    ensure_verl,
    load_folder,
    measure,
    median,
    print_runs,
    same_tensors,
)

QWEN2_05B = dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, tie_word_embeddings=False)
SIZES = {"0.5b": QWEN2_05B, "1.2b": {**QWEN2_05B, "num_layers": 66}}  # 66 layers: twice the parameters


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


def write_checkpoint(size: str) -> None:
    """In a child process, so that the parent stays small (see `measure`)."""
    from synthetic_runs import FsdpSpec, ModelSpec, write_fsdp_step

    spec = FsdpSpec(model=ModelSpec(**SIZES[size]), world_size=4, strategy="fsdp2", save_contents=("model", "extra"))
    write_fsdp_step(str(BENCH / "fsdp" / size / "global_step_1"), spec, seed=0)


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


def outputs_identical(a: Path, b: Path) -> bool:
    """Run in a child process (`--compare A B`): the parent stays small."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp_merge", "--compare", str(a), str(b)])
    return proc.returncode == 0


def compare_folders(a: Path, b: Path) -> bool:
    return same_tensors(load_folder(a), load_folder(b))


def bench_size(size: str, repeats: int, verl_python: Path | None) -> dict[str, list[Run]]:
    actor = ensure_checkpoint(size)
    total = sum(p.stat().st_size for p in actor.glob("model_world_size_*"))
    cat, cp = io_floor(actor)
    io_floor(actor)
    print(f"\n== {size}: {total / 1e9:.2f} GB of rank files; I/O floor: cat {cat:.2f} s, cp {cp:.2f} s (warm)")
    runs: dict[str, list[Run]] = {"stepmerge": [], "verl": []}
    out = BENCH / "out" / size
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    ranks = sorted(str(p) for p in actor.glob("model_world_size_*_rank_*.pt"))

    def warm() -> None:  # each tool starts from the same warm page cache (the other's run may have evicted it)
        subprocess.run(["cat", *ranks], stdout=subprocess.DEVNULL, check=True)

    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        warm()
        runs["stepmerge"].append(measure("stepmerge", [
            sys.executable, "-m", "merge_engine", "merge", "--backend", "fsdp", "--local_dir", str(actor),
            "--target_dir", str(out / "stepmerge"), "--dtype", "bfloat16"], env))
        if verl_python:
            warm()
            runs["verl"].append(measure("verl", [
                str(verl_python), "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                "--local_dir", str(actor), "--target_dir", str(out / "verl")], env))
    if verl_python:
        print(f"  outputs identical tensor for tensor: {outputs_identical(out / 'stepmerge', out / 'verl')}")
    print_runs(runs)
    shutil.rmtree(out, ignore_errors=True)
    return runs


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
