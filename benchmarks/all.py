"""One benchmark command: every figure of issue 19's goals, as ratios measured in one run, with the load average.

    python -m benchmarks.all                    # the 2.5 GB FSDP2 checkpoint, medians of 3 (make bench)
    python -m benchmarks.all --repeats 1 --parts verl,workers,startup
    python -m benchmarks.all --quick            # the demo's tiny checkpoint everywhere, 1 repeat, no verl, no Ray
    python -m benchmarks.all --quick --parts startup --checkpoint DIR   # the suite's smoke run (seconds)

Figures (each a ratio of two things measured in this run, on this machine, alternating within a repeat):
- verl: wall and peak RSS of ``stepmerge merge`` (default flags) against verl 0.9.1's merger
  (`benchmarks.fsdp_merge`: verl in its own venv), the 4-rank fp32 FSDP2 Qwen2-0.5B-shaped checkpoint to
  bf16, each from a warm page cache; the outputs compared tensor for tensor once. stepmerge runs as a
  run's next step (the config's Hub form in its memo, `merge_engine.plan.hub_config_memo`, from an untimed
  merge at the start) and, beside it, as a run's first step (``STEPMERGE_CACHE_DIR=``: no memo). Its
  bytecode is compiled once at the start, as ``pip install`` does.
- workers: ``--workers 2`` / ``--workers 1`` on the same checkpoint (its bf16 output is one shard), and the
  peak RSS at ``--workers 1`` (README's memory claim).
- startup: a merge of the demo's tiny checkpoint (4-rank FSDP2, 0.8 MB) against ``python -c "import torch"``,
  as a run's next step and as its first step (no memo), as above.
- ray: a private 2-CPU Ray cluster of this machine (``--ray-address``) against ``--workers 2``.
- s3: the merge process's own CPU seconds (rusage from wait4: user + system of the merge process and its
  children; the SeaweedFS server is another process and is not counted) per GB of input, merging from
  ``s3://`` (SeaweedFS on loopback) to a local folder and to ``s3://``, against the local merge
  (``--workers 2`` each).
- peers: `benchmarks.trainer_peers` (stepmerge against ``accelerate merge-weights``, torch's
  ``consolidate_safetensors_files`` and DeepSpeed's ``zero_to_fp32.py``, each on its trainer's input; the tiny
  model with ``--quick``), its own table after the goals'.
Every run is a child process; this parent never imports torch (ru_maxrss of a forked child starts from
its parent's). The table at the end puts each figure beside its goal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import BENCH, Run, ensure_verl, measure, median
from benchmarks.shard_jobs import _remove
from benchmarks.start_time import ensure_checkpoint as ensure_start_checkpoint

PARTS = ("verl", "workers", "startup", "ray", "s3", "peers")
QUICK_PARTS = ("workers", "startup", "s3")


@dataclass(frozen=True)
class Figure:
    """One goal of issue 19: ``numerator`` / ``denominator`` (what was measured, as text) = ``ratio``,
    met when ``ratio <= goal``."""

    name: str
    numerator: str
    denominator: str
    ratio: float
    goal: float

    @property
    def met(self) -> bool:
        return self.ratio <= self.goal


def figures(runs: dict[str, list[Run]], input_bytes: int) -> list[Figure]:
    """The goals' figures from the medians of the runs measured (a figure whose runs are missing is left out).

    Run keys: ``stepmerge`` / ``verl`` (default flags / verl's merger), ``workers1`` / ``workers2``,
    ``tiny`` / ``import_torch``, ``ray`` (against ``workers2``), ``s3_local`` / ``s3_s3`` (merges from
    ``s3://`` to a local / ``s3://`` target, CPU against ``workers2``'s)."""
    out: list[Figure] = []

    def wall(key: str) -> float:
        return median(runs[key], "wall_s")

    def rss(key: str) -> float:
        return median(runs[key], "peak_rss_mb")

    def cpu_per_gb(key: str) -> float:
        return median(runs[key], "cpu_s") / (input_bytes / 1e9)

    def have(*keys: str) -> bool:
        return all(runs.get(k) for k in keys)

    if have("stepmerge", "verl"):
        out.append(Figure("wall, stepmerge / verl 0.9.1", f"{wall('stepmerge'):.2f} s", f"{wall('verl'):.2f} s",
                          wall("stepmerge") / wall("verl"), 0.35))
        out.append(Figure("peak RSS, stepmerge / verl 0.9.1", f"{rss('stepmerge'):.0f} MB", f"{rss('verl'):.0f} MB",
                          rss("stepmerge") / rss("verl"), 0.15))
    if have("stepmerge_first", "verl"):
        out.append(Figure("  the same as a run's first step (no memo)", f"{wall('stepmerge_first'):.2f} s",
                          f"{wall('verl'):.2f} s", wall("stepmerge_first") / wall("verl"), 0.35))
    if have("workers1", "workers2"):
        out.append(Figure("--workers 2 / --workers 1 (one shard)", f"{wall('workers2'):.2f} s",
                          f"{wall('workers1'):.2f} s", wall("workers2") / wall("workers1"), 0.6))
    if have("tiny", "import_torch"):
        out.append(Figure("tiny merge / python -c 'import torch'", f"{wall('tiny'):.2f} s",
                          f"{wall('import_torch'):.2f} s", wall("tiny") / wall("import_torch"), 1.3))
    if have("tiny_first", "import_torch"):
        out.append(Figure("  tiny, as a run's first step (no memo)", f"{wall('tiny_first'):.2f} s",
                          f"{wall('import_torch'):.2f} s", wall("tiny_first") / wall("import_torch"), 1.3))
    if have("ray", "workers2"):
        out.append(Figure("Ray 2-CPU cluster / --workers 2", f"{wall('ray'):.2f} s", f"{wall('workers2'):.2f} s",
                          wall("ray") / wall("workers2"), 1.2))
    for key, label in (("s3_local", "s3:// -> local"), ("s3_s3", "s3:// -> s3://")):
        if have(key, "workers2"):
            out.append(Figure(f"CPU per GB, {label} / local", f"{cpu_per_gb(key):.2f} s/GB",
                              f"{cpu_per_gb('workers2'):.2f} s/GB", cpu_per_gb(key) / cpu_per_gb("workers2"), 1.2))
    return out


def print_figures(found: list[Figure], runs: dict[str, list[Run]], start_load: tuple[float, ...],
                  end_load: tuple[float, ...]) -> None:
    load = " ".join(f"{x:.2f}" for x in start_load), " ".join(f"{x:.2f}" for x in end_load)
    print(f"\n== issue 19's goals, measured in this run ({os.cpu_count()} cores; load average {load[0]} at the "
          f"start, {load[1]} at the end)")
    print(f"  {'figure':40s} {'measured':>26s} {'ratio':>6s} {'goal':>6s}  met")
    for f in found:
        print(f"  {f.name:40s} {f.numerator + ' / ' + f.denominator:>26s} {f.ratio:6.2f} {f.goal:6.2f}  "
              f"{'yes' if f.met else 'NO'}")
    for key, label in (("workers1", "--workers 1"), ("workers2", "--workers 2"), ("s3_local", "s3:// -> local"),
                       ("s3_s3", "s3:// -> s3://")):
        if runs.get(key):
            print(f"  peak RSS of a merge, {label}: {median(runs[key], 'peak_rss_mb'):.0f} MB")


def merge_command(source: str, target: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "merge_engine", "merge", "--backend", "fsdp", "--local_dir", source,
            "--target_dir", target, "--dtype", "bfloat16", *extra]


class Bench:
    """The runs of one invocation: ``runs[key]`` gathers each repeat's `Run`."""

    def __init__(self, actor: Path, env: dict[str, str]) -> None:
        self.actor = actor
        self.env = env
        self.runs: dict[str, list[Run]] = {}
        self.ranks = sorted(str(p) for p in actor.glob("model_world_size_*_rank_*.pt"))
        self.out = BENCH / "out" / "all"

    def warm(self) -> None:  # every local merge starts from the same warm page cache
        subprocess.run(["cat", *self.ranks], stdout=subprocess.DEVNULL, check=True)

    def run(self, key: str, command: list[str], env: dict[str, str] | None = None, clean: str | None = None,
            warm: bool = True) -> Run:
        if clean:
            _remove(clean, env or self.env)
        if warm:
            self.warm()
        run = measure(key, command, env or self.env)
        self.runs.setdefault(key, []).append(run)
        print(f"  {key:14s} wall {run.wall_s:6.2f} s   peak RSS {run.peak_rss_mb:6.0f} MB   CPU {run.cpu_s:6.2f} s",
              flush=True)
        return run

    def local(self, key: str, *extra: str) -> Run:
        target = str(self.out / key)
        try:
            return self.run(key, merge_command(str(self.actor), target, *extra), clean=target)
        finally:
            shutil.rmtree(target, ignore_errors=True)


def first_step(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a merge as the first step of a run: no memo of the config's Hub form
    (`merge_engine.plan.hub_config_memo`), so transformers is asked."""
    return {**env, "STEPMERGE_CACHE_DIR": ""}


def prepare_engine(env: dict[str, str], checkpoints: list[Path]) -> None:
    """What an installed stepmerge has before its first merge of a run's next step: the engine's bytecode
    compiled (``pip install`` compiles it; this shell may set ``PYTHONDONTWRITEBYTECODE``, and verl's venv
    got its bytecode from pip), and the memo of each checkpoint's config (one untimed merge each, in
    ``STEPMERGE_CACHE_DIR``, a folder of this run)."""
    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "merge_engine"), quiet=1)
    for actor in checkpoints:
        target = BENCH / "out" / "warm-up"
        _remove(str(target), env)
        subprocess.run(merge_command(str(actor), str(target)), env=env, check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(target, ignore_errors=True)


def bench_verl(bench: Bench, verl_python: Path, compare: bool) -> None:
    from benchmarks.fsdp_merge import outputs_identical

    ours, theirs = bench.out / "stepmerge", bench.out / "verl"
    bench.run("stepmerge", merge_command(str(bench.actor), str(ours)), clean=str(ours))
    bench.run("stepmerge_first", merge_command(str(bench.actor), str(ours)), first_step(bench.env), clean=str(ours))
    bench.run("verl", [str(verl_python), "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir",
                       str(bench.actor), "--target_dir", str(theirs)], clean=str(theirs))
    if compare:
        print(f"  outputs identical tensor for tensor: {outputs_identical(ours, theirs)}", flush=True)
    shutil.rmtree(ours, ignore_errors=True)
    shutil.rmtree(theirs, ignore_errors=True)


def bench_startup(bench: Bench, tiny: Path) -> None:
    target = str(bench.out / "tiny")
    bench.run("tiny", merge_command(str(tiny), target), clean=target, warm=False)
    bench.run("tiny_first", merge_command(str(tiny), target), first_step(bench.env), clean=target, warm=False)
    bench.run("import_torch", [sys.executable, "-c", "import torch"], warm=False)
    shutil.rmtree(target, ignore_errors=True)


class RayCluster:
    """A private 2-CPU Ray head of this machine (`tests.fixtures_ray`), stopped alone at exit."""

    def __enter__(self) -> RayCluster:
        from tests.fixtures_ray import LOOPBACK_RAY_ENV, free_port, start_ray_head

        self.root = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.port = free_port()
        self.env = LOOPBACK_RAY_ENV
        self.head = start_ray_head(self.root, self.port, {**os.environ, **LOOPBACK_RAY_ENV})
        return self

    def __exit__(self, *exc: object) -> None:
        from tests.fixtures_ray import stop_ray_head

        stop_ray_head(self.head)  # never `ray stop`: it stops every cluster of this machine
        shutil.rmtree(self.root, ignore_errors=True)


class S3Source:
    """SeaweedFS on loopback holding the benchmark's rank files (`tests.servers.SeaweedS3Server`)."""

    def __init__(self, actor: Path, env: dict[str, str]) -> None:
        self.actor = actor
        self.base_env = env

    def __enter__(self) -> S3Source:
        from tests.servers import SeaweedS3Server

        self.server = SeaweedS3Server().__enter__()
        self.env = {**self.base_env, **self.server.env()}
        self.bucket = self.server.make_bucket("bench")
        self.url = f"{self.bucket}/run/global_step_1/actor"
        subprocess.run([sys.executable, "-c", "import sys; from merge_engine import storage; "
                        "storage.copy_tree(sys.argv[1], sys.argv[2])", str(self.actor), self.url],
                       env=self.env, check=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)


def bench_s3(bench: Bench, s3: S3Source) -> None:
    local_target = str(bench.out / "from_s3")
    bench.run("s3_local", merge_command(s3.url, local_target, "--workers", "2"), s3.env, clean=local_target,
              warm=False)
    shutil.rmtree(local_target, ignore_errors=True)
    bench.run("s3_s3", merge_command(s3.url, f"{s3.bucket}/merged", "--workers", "2"), s3.env,
              clean=f"{s3.bucket}/merged", warm=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", help=f"comma-separated, from {','.join(PARTS)} (default: all; --quick: "
                        f"{','.join(QUICK_PARTS)})")
    parser.add_argument("--repeats", type=int, help="runs of each figure, alternating (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="the demo's tiny checkpoint for every figure")
    parser.add_argument("--checkpoint", type=Path, help="with --quick: an FSDP actor folder to use as the tiny "
                        "checkpoint (default: the demo's model, `benchmarks.start_time`'s)")
    args = parser.parse_args(argv)
    if args.checkpoint and not args.quick:
        parser.error("--checkpoint goes with --quick")
    parts = set((args.parts or ",".join(QUICK_PARTS if args.quick else PARTS)).split(","))
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: choose from {','.join(PARTS)}")
    repeats = args.repeats or (1 if args.quick else 3)
    start_load = os.getloadavg()
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in start_load)} ({os.cpu_count()} cores)",
          flush=True)
    BENCH.mkdir(exist_ok=True)
    memo = BENCH / "memo"
    shutil.rmtree(memo, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "STEPMERGE_CACHE_DIR": str(memo)}
    tiny = args.checkpoint or (ensure_start_checkpoint() if (args.quick or "startup" in parts) else None)
    if args.quick:
        actor = tiny
    else:
        from benchmarks.fsdp_merge import ensure_checkpoint

        actor = ensure_checkpoint("0.5b")
    input_bytes = sum(p.stat().st_size for p in actor.glob("model_world_size_*_rank_*.pt"))
    print(f"checkpoint: {actor} ({input_bytes / 1e9:.3f} GB of rank files); parts {','.join(sorted(parts))}; "
          f"{repeats} repeat(s)", flush=True)
    verl_python = ensure_verl() if "verl" in parts else None
    if "verl" in parts and verl_python is None:
        print("verl could not be set up: no verl figures")
    bench = Bench(actor, env)
    prepare_engine(env, [actor] + ([tiny] if tiny is not None and tiny != actor else []))
    with contextlib.ExitStack() as stack:
        ray = stack.enter_context(RayCluster()) if "ray" in parts else None
        s3 = stack.enter_context(S3Source(actor, env)) if "s3" in parts else None
        for repeat in range(repeats):
            print(f"-- repeat {repeat + 1} of {repeats}", flush=True)
            if verl_python is not None:
                bench_verl(bench, verl_python, compare=repeat == 0)
            if parts & {"workers", "ray", "s3"}:
                bench.local("workers2", "--workers", "2")
            if "workers" in parts:
                bench.local("workers1", "--workers", "1")
            if "startup" in parts:
                bench_startup(bench, tiny)
            if ray is not None:
                target = str(bench.out / "ray")
                bench.run("ray", merge_command(str(actor), target, "--ray-address", f"127.0.0.1:{ray.port}"),
                          {**env, **ray.env}, clean=target)
                shutil.rmtree(target, ignore_errors=True)
            if s3 is not None:
                bench_s3(bench, s3)
    print_figures(figures(bench.runs, input_bytes), bench.runs, start_load, os.getloadavg())
    if "peers" in parts:
        from benchmarks.trainer_peers import PEERS, run_benchmark

        run_benchmark("tiny" if args.quick else "0.5b", list(PEERS), repeats)
    shutil.rmtree(bench.out, ignore_errors=True)


if __name__ == "__main__":
    main()
