"""Benchmark: stepmerge vs verl's Megatron merger on a real TP2 x PP2 checkpoint (~1.6 GB fp32), same machine.

    python -m benchmarks.megatron_merge                      # torch_dist (vs verl) and legacy, 3 repeats
    python -m benchmarks.megatron_merge --formats dist --repeats 1 --skip-verl

What it does:
1. Writes (once, reused from ./.bench/megatron/<format>/) a real checkpoint of a Qwen2-0.5B-shaped
   model cut to 8 layers (vocabulary 151936, hidden 896, 14 heads / 2 KV heads, untied: ~390M
   parameters, ~1.6 GB fp32) with megatron-core on CPU (`synthetic_runs.megatron`: 4 gloo ranks,
   TP 2 x PP 2): verl 0.9's torch_dist layout (``model/dist_ckpt`` + ``ckpt_contents.json``) and
   verl's legacy per-rank layout.
2. Measures the I/O floor (cat of the shard files, warm cache).
3. Runs ``stepmerge merge --backend megatron`` and, on the torch_dist checkpoint (the only layout
   verl 0.9.1's merger reads), verl's own Megatron merger, alternately, each in a child process,
   both writing bfloat16; records wall time and peak RSS (ru_maxrss from wait4; the parent never
   imports torch) and prints medians and ratios against verl.
4. Checks stepmerge's output against an independent conversion of the reference weights
   (`synthetic_runs.megatron.reference_to_hf`, cast to bf16) and against verl's, bit for bit.

verl's merger needs a GPU (nccl, set_device, TransformerEngine layer specs). It runs here behind
the CPU shims of `benchmarks.verl_megatron_cpu` (its loading, merging and saving code unchanged),
in its own venv (`VERL_SETUP`, the FSDP benchmark's venv plus megatron-core and two small
packages verl imports). Its time includes building the megatron-core model, which a GPU run pays too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import (
    ROOT,
    VERL_VENV,
    Run,
    load_folder,
    measure,
    median,
    print_runs,
    same_tensors,
)

BENCH = harness.BENCH / "megatron"
FORMATS = {"dist": "dist_v2", "legacy": "legacy"}  # command-line name -> MegatronSpec.fmt
VERL_READS = {"dist"}  # verl 0.9.1's merger reads verl 0.9's torch_dist layout only
MODEL = dict(family="qwen2", vocab_size=151936, hidden_size=896, ffn_hidden_size=4864, num_layers=8, num_heads=14,
             num_kv_heads=2, tie_word_embeddings=False, tp=2, pp=2)
VERL_SETUP = [  # added to harness.VERL_SETUP: what verl's Megatron merger imports
    [str(VERL_VENV / "bin/pip"), "install", "-q", "--no-deps", "-c", str(ROOT / "constraints.txt"),
     "megatron-core==0.16.1"],
    [str(VERL_VENV / "bin/pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"), "codetiming", "orjson"],
]


def ensure_verl() -> Path | None:
    """verl's venv with what its Megatron merger imports; None when it cannot be set up."""
    return harness.ensure_verl(VERL_SETUP, probe="import benchmarks.verl_megatron_cpu as b; b.install()",
                               env={**os.environ, "PYTHONPATH": str(ROOT)})


def checkpoint_dir(fmt: str) -> Path:
    return BENCH / fmt / "run" / "global_step_1" / "actor"


def ensure_checkpoint(fmt: str) -> Path:
    actor = checkpoint_dir(fmt)
    marker = actor.parent / ".complete"
    if marker.exists():
        return actor
    shutil.rmtree(BENCH / fmt, ignore_errors=True)
    print(f"writing a TP2 x PP2 {fmt} checkpoint with megatron-core on CPU to {actor} (once) ...", flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.megatron_merge", "--write-checkpoint", fmt], check=True)
    marker.write_text("ok\n")
    print(f"  written in {time.perf_counter() - started:.0f} s", flush=True)
    return actor


def write_checkpoint(fmt: str) -> None:
    """In a child process (the parent stays small). Reference weights are not kept: `compare` redraws them."""
    from synthetic_runs.megatron import MegatronSpec, write_megatron_step

    spec = MegatronSpec(fmt=FORMATS[fmt], **MODEL)
    write_megatron_step(BENCH / fmt / "run" / "global_step_1", spec, seed=0)


def compare(folder: Path, other: str) -> None:
    """Exit 0 when ``folder`` equals ``other``: a folder, or ``reference:<format>`` (the reference
    weights converted independently and cast to bf16), tensor for tensor."""
    import torch

    if other.startswith("reference:"):
        from synthetic_runs.megatron import (
            MegatronSpec,
            reference_state_dict,
            reference_to_hf,
        )

        spec = MegatronSpec(fmt=FORMATS[other.split(":", 1)[1]], **MODEL)
        expected = {k: v.to(torch.bfloat16) for k, v in reference_to_hf(spec, reference_state_dict(spec, 0)).items()}
    else:
        expected = load_folder(Path(other))
    raise SystemExit(0 if same_tensors(load_folder(folder), expected) else 1)


def same(folder: Path, other: str) -> bool:
    """In a child process (`--compare`): the parent stays small."""
    return subprocess.run([sys.executable, "-m", "benchmarks.megatron_merge", "--compare", str(folder), other]
                          ).returncode == 0


def shard_files(actor: Path) -> list[str]:
    return sorted(str(p) for p in actor.rglob("*") if p.is_file() and (p.suffix in (".pt", ".distcp")
                                                                       or p.name == ".metadata"))


def bench(fmt: str, repeats: int, verl_python: Path | None) -> dict[str, list[Run]]:
    actor = ensure_checkpoint(fmt)
    files = shard_files(actor)
    total = sum(os.path.getsize(f) for f in files)
    for _ in range(2):  # warm the page cache, then time
        started = time.perf_counter()
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        cat = time.perf_counter() - started
    print(f"\n== {fmt}: {len(files)} shard files, {total / 1e9:.2f} GB; I/O floor: cat {cat:.2f} s (warm)")
    out = BENCH / "out" / fmt
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    verl_env = {**env, "PYTHONPATH": str(ROOT)}
    with_verl = verl_python is not None and fmt in VERL_READS
    runs: dict[str, list[Run]] = {"stepmerge": [], "verl": []}
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        runs["stepmerge"].append(measure("stepmerge", [
            sys.executable, "-m", "merge_engine", "merge", "--backend", "megatron", "--local_dir", str(actor),
            "--target_dir", str(out / "stepmerge"), "--dtype", "bfloat16"], env))
        if with_verl:
            runs["verl"].append(measure("verl", [
                str(verl_python), "-m", "benchmarks.verl_megatron_cpu", "merge", "--backend", "megatron",
                "--local_dir", str(actor), "--target_dir", str(out / "verl"), "--use_cpu_initialization"], verl_env))
    print(f"  stepmerge == reference weights (bf16), tensor for tensor: {same(out / 'stepmerge', 'reference:' + fmt)}")
    if with_verl:
        print(f"  stepmerge == verl, tensor for tensor: {same(out / 'stepmerge', str(out / 'verl'))}")
    print_runs(runs)
    shutil.rmtree(out, ignore_errors=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="dist,legacy", help=f"comma-separated, from {sorted(FORMATS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--write-checkpoint", metavar="FORMAT", help=argparse.SUPPRESS)
    parser.add_argument("--compare", nargs=2, metavar=("DIR", "OTHER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoint:
        return write_checkpoint(args.write_checkpoint)
    if args.compare:
        return compare(Path(args.compare[0]), args.compare[1])
    verl_python = None if args.skip_verl else ensure_verl()
    if verl_python is None and not args.skip_verl:
        print("verl could not be set up: printing stepmerge alone")
    results = {fmt: bench(fmt, args.repeats, verl_python) for fmt in args.formats.split(",")}
    print("\n== summary (medians)")
    print(f"{'format':7s} {'tool':9s} {'wall s':>8s} {'peak RSS MB':>12s} {'wall/verl':>10s} {'RSS/verl':>9s}")
    for fmt, runs in results.items():
        for tool in ("stepmerge", "verl"):
            if not runs[tool]:
                continue
            wall, rss = median(runs[tool], "wall_s"), median(runs[tool], "peak_rss_mb")
            ratio = ""
            if runs["verl"]:
                ratio = f"{wall / median(runs['verl'], 'wall_s'):10.2f} {rss / median(runs['verl'], 'peak_rss_mb'):9.2f}"
            print(f"{fmt:7s} {tool:9s} {wall:8.2f} {rss:12.0f} {ratio}")


if __name__ == "__main__":
    main()
