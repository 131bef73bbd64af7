"""Benchmark: shard jobs at the speed of the storage — local, S3 (with and without a simulated network), Ray.

    python -m benchmarks.shard_jobs                       # everything below, medians of --repeats
    python -m benchmarks.shard_jobs --parts local,s3      # a subset: local, s3, ray, rss
    python -m benchmarks.shard_jobs --parts s3 --in-flight 1,16 --networks net --targets local

Every figure is printed as a ratio against a baseline measured in the same run, on the same machine:
- local: merge of the 4-rank fp32 FSDP2 Qwen2-0.5B-shaped checkpoint (2.5 GB, `benchmarks.fsdp_merge`'s)
  to bf16, warm cache; wall / warm ``cp`` of the same rank files (the I/O floor), for ``--workers 1``
  (the data path before shard jobs: one reader, one writer) and ``--workers 2``. ``cp`` neither
  casts nor hashes, so two more floors (`benchmarks.data_path_floor`): the same read + cast + sha256
  + write in the tightest loop (hash overlapped, and serial), and the imports a merge needs.
- s3: the same checkpoint in SeaweedFS (local S3 server), merged to a local target and to an ``s3://``
  target, with 1, 4, 16 and 64 ranged GETs in flight; directly and through a proxy that simulates a real
  network (20 ms per request, 50 MB/s per connection: `tests.fault_proxy.Network`); wall / local merge
  and the read rate in MB/s.
- ray: a private Ray cluster of this machine (2 CPUs) vs ``--workers 2``: the cost of going distributed.
- rss: peak RSS of one merge process at 1x and 2x model size (1.2B-shaped), 1 and 2 workers: flat when
  memory is bounded by chunks, not by the model.
Each run is a child process (wall time, and peak RSS from wait4); this parent never imports torch.
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

from benchmarks.fsdp_merge import ensure_checkpoint
from benchmarks.harness import BENCH, Run, measure, median

IN_FLIGHT = (1, 4, 16, 64)


def merge_command(source: str, target: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "merge_engine", "merge", "--backend", "fsdp", "--local_dir", source,
            "--target_dir", target, "--dtype", "bfloat16", *extra]


def timed(label: str, command: list[str], env: dict[str, str], repeats: int, clean: list[str],
          before=None) -> Run:
    runs = []
    for _ in range(repeats):
        for path in clean:
            _remove(path, env)
        if before is not None:
            before()
        runs.append(measure(label, command, env))
    run = Run(label, median(runs, "wall_s"), median(runs, "peak_rss_mb"))
    print(f"  {label:42s} wall {run.wall_s:7.2f} s   peak RSS {run.peak_rss_mb:6.0f} MB", flush=True)
    return run


def _remove(path: str, env: dict[str, str]) -> None:
    if "://" in path:
        subprocess.run([sys.executable, "-c", "import sys; from merge_engine import storage; "
                        "storage.remove(sys.argv[1], recursive=True)", path], env=env, check=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def bench_local(actor: Path, repeats: int, env: dict[str, str]) -> dict[str, Run]:
    ranks = sorted(str(p) for p in actor.glob("model_world_size_*_rank_*.pt"))

    def warm() -> None:
        subprocess.run(["cat", *ranks], stdout=subprocess.DEVNULL, check=True)

    out = BENCH / "out" / "shard_jobs"
    warm()
    with tempfile.TemporaryDirectory(dir=BENCH) as tmp:
        started = time.perf_counter()
        subprocess.run(["cp", *ranks, tmp], check=True)
        cp = time.perf_counter() - started
    print(f"\n== local: {sum(os.path.getsize(r) for r in ranks) / 1e9:.2f} GB of rank files; warm cp {cp:.2f} s")
    results = {"cp": Run("cp", cp, 0.0)}
    floor_out = str(BENCH / "out" / "floor.bin")
    os.makedirs(os.path.dirname(floor_out), exist_ok=True)
    floor = [sys.executable, "-m", "benchmarks.data_path_floor"]
    results["loop"] = timed("floor: read+cast+sha256+write loop", [*floor, "loop", floor_out, *ranks], env,
                            repeats, [floor_out], warm)
    results["serial"] = timed("floor: the same, sha256 not overlapped", [*floor, "loop", floor_out, *ranks,
                              "--serial"], env, repeats, [floor_out], warm)
    results["imports"] = timed("floor: a merge's imports, nothing run", [*floor, "imports"], env, repeats, [])
    _remove(floor_out, env)
    for workers in (1, 2):
        results[f"workers{workers}"] = timed(f"local merge --workers {workers}", merge_command(
            str(actor), str(out), "--workers", str(workers)), env, repeats, [str(out)], warm)
    shutil.rmtree(out, ignore_errors=True)
    return results


def print_local_ratios(local: dict[str, Run]) -> None:
    cp, loop = local["cp"].wall_s, local["loop"].wall_s
    for workers in (1, 2):
        wall = local[f"workers{workers}"].wall_s
        print(f"  --workers {workers}: {wall:.2f} s = {wall / cp:.2f}x cp, {wall / loop:.2f}x the read+cast+sha256+write "
              f"loop")
    print(f"  the loop itself: {loop / cp:.2f}x cp ({local['serial'].wall_s / cp:.2f}x with sha256 not overlapped); "
          f"a merge's imports alone: {local['imports'].wall_s / cp:.2f}x cp")
    print(f"  --workers 2 / --workers 1: {local['workers2'].wall_s / local['workers1'].wall_s:.2f}")


def bench_s3(actor: Path, repeats: int, env: dict[str, str], local: Run, in_flight: tuple[int, ...] = IN_FLIGHT,
             networks: tuple[str, ...] = ("direct", "net"), targets: tuple[str, ...] = ("local", "s3")
             ) -> dict[str, Run]:
    from tests.fault_proxy import FaultProxy, Network
    from tests.servers import SeaweedS3Server

    total = sum(p.stat().st_size for p in actor.glob("model_world_size_*"))
    results: dict[str, Run] = {}
    with SeaweedS3Server() as s3:
        s3_env = {**env, **s3.env()}
        bucket = s3.make_bucket("bench")
        source = f"{bucket}/run/global_step_1/actor"
        print(f"\n== s3: uploading the checkpoint to SeaweedFS ({source}) ...", flush=True)
        subprocess.run([sys.executable, "-c", "import sys; from merge_engine import storage; "
                        "storage.copy_tree(sys.argv[1], sys.argv[2])", str(actor), source], env=s3_env, check=True)
        local_target = str(BENCH / "out" / "from_s3")
        shapes = {"direct": None, "net": Network(latency=0.02, bandwidth=50e6)}
        for network in (shapes[name] for name in networks):
            label = "direct" if network is None else "20 ms + 50 MB/s per connection"
            print(f"-- {label}")
            with FaultProxy(s3.port, network=network) as proxy:
                proxied = {**s3_env, "STEPMERGE_S3_ENDPOINT": proxy.url}
                for n in in_flight:
                    for kind, target in (("local", local_target), ("s3", f"{bucket}/merged")):
                        if kind not in targets:
                            continue
                        run = timed(f"s3 -> {kind}, {n:2d} in flight ({'net' if network else 'direct'})",
                                    merge_command(source, target, "--requests-in-flight", str(n)),
                                    proxied, repeats, [target])
                        results[f"{label}|{kind}|{n}"] = run
                        print(f"      / local merge {run.wall_s / local.wall_s:5.2f}   read rate "
                              f"{total / run.wall_s / 1e6:6.0f} MB/s", flush=True)
        shutil.rmtree(local_target, ignore_errors=True)
    return results


def bench_ray(actor: Path, repeats: int, env: dict[str, str], workers2: Run) -> Run:
    from tests.fixtures_ray import LOOPBACK_RAY_ENV, free_port, start_ray_head, stop_ray_head

    root = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    port = free_port()
    ray_env = {**env, **LOOPBACK_RAY_ENV}
    print("\n== ray: a private 2-CPU cluster of this machine", flush=True)
    head = start_ray_head(root, port, ray_env)  # stopped alone: never `ray stop`, which stops every cluster here
    out = str(BENCH / "out" / "ray")
    try:
        run = timed("ray merge (2 workers)", merge_command(str(actor), out, "--ray-address", f"127.0.0.1:{port}"),
                    ray_env, repeats, [out])
    finally:
        stop_ray_head(head)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    print(f"      ray / --workers 2: {run.wall_s / workers2.wall_s:.2f}")
    return run


def bench_rss(repeats: int, env: dict[str, str]) -> None:
    print("\n== rss: peak RSS of one merge process at 1x and 2x model size", flush=True)
    out = str(BENCH / "out" / "rss")
    table = {}
    for size in ("0.5b", "1.2b"):
        actor = ensure_checkpoint(size)
        for workers in (1, 2):
            table[size, workers] = timed(f"{size} --workers {workers}", merge_command(
                str(actor), out, "--workers", str(workers)), env, repeats, [out])
    shutil.rmtree(out, ignore_errors=True)
    print(f"  {'':12s} {'1x (0.5b)':>12s} {'2x (1.2b)':>12s} {'2x / 1x':>8s}   peak RSS of the merge process, MB")
    for workers in (1, 2):
        one, two = table["0.5b", workers].peak_rss_mb, table["1.2b", workers].peak_rss_mb
        print(f"  --workers {workers}  {one:12.0f} {two:12.0f} {two / one:8.2f}")
    print("  (one interpreter with torch for every worker: threads of one process; per worker is the "
          "process's RSS for --workers 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="local,s3,ray,rss")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-flight", default=",".join(map(str, IN_FLIGHT)), help="s3: requests in flight to try")
    parser.add_argument("--networks", default="direct,net", help="s3: direct (loopback) and/or net (simulated)")
    parser.add_argument("--targets", default="local,s3", help="s3: merge to a local and/or an s3:// target")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    BENCH.mkdir(exist_ok=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    actor = ensure_checkpoint("0.5b")
    local = bench_local(actor, args.repeats, env)
    print_local_ratios(local)
    if "s3" in parts:
        bench_s3(actor, args.repeats, env, local["workers2"], tuple(int(n) for n in args.in_flight.split(",")),
                 tuple(args.networks.split(",")), tuple(args.targets.split(",")))
    if "ray" in parts:
        bench_ray(actor, args.repeats, env, local["workers2"])
    if "rss" in parts:
        bench_rss(args.repeats, env)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
