"""Benchmark: what the read checks of issue 17 cost a merge: the zip CRC-32 of every record read, and
reads pinned to the version listed (local fstat per read; S3 If-Match on every ranged GET).

    python -m benchmarks.read_checks                  # the 0.5b FSDP2 benchmark checkpoint, local and S3
    python -m benchmarks.read_checks --repeats 5 --parts local      # cost, local, s3, s3-reads (default: all)

What it does: merges the benchmark checkpoint of `benchmarks.fsdp_merge` (4-rank fp32 FSDP2, Qwen2-0.5B
shape, ~2 GB of rank files; written once under ./.bench/fsdp/0.5b) to bfloat16, each merge in a child
process, in rounds that alternate the variants (so a change of the machine's load hits each alike):
- ``checked``: as shipped (CRC-32 and pinned reads);
- ``no-crc``: `merge_engine.formats.zip_crc.RecordChecks.add` / ``finish`` replaced by no-ops in the child;
- ``unpinned``: `RangeReader.listed` replaced by an unpinned reader (no version) in the child.
Local runs start from a warm page cache (the rank files are read first). With S3 (parts ``s3``, ``s3-reads``),
the checkpoint is uploaded once to a SeaweedFS server started for the run and merged from there to a
local folder; then the reads alone (every rank file read front to back in 16 MiB pieces through
`RangeReader`, read-ahead on, as a merge reads: ``pinned`` = If-Match on every GET, ``unpinned`` =
none), which isolates the pinning's cost from the merge's own CPU. Under load the A/B walls are noisy:
the ``cost`` part measures the checks themselves inside one local merge (thread CPU time spent in
`RecordChecks.add`, and the count of pinned local reads times one ``fstat`` + compare). Prints each run's wall and CPU
(user + system of the child), the medians, and each variant's cost against ``checked``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.fsdp_merge import ensure_checkpoint
from benchmarks.harness import BENCH, measure

PATCHES = {
    "checked": "",
    "no-crc": ("from merge_engine.formats import zip_crc; zip_crc.RecordChecks.add = lambda *a, **k: None; "
               "zip_crc.RecordChecks.finish = lambda *a, **k: None; "),
    "unpinned": ("from merge_engine.storage import RangeReader; "
                 "RangeReader.listed = classmethod(lambda cls, url, entry: cls(url, entry.size)); "),
}


READ_CHILD = """
import sys
from merge_engine import storage
pinned = sys.argv[1] == "pinned"
for entry in storage.list_files(sys.argv[2], recursive=False):
    if not entry.path.startswith("model_world_size_"):
        continue
    url = storage.join(sys.argv[2], entry.path)
    reader = storage.RangeReader.listed(url, entry) if pinned else storage.RangeReader(url, entry.size)
    buffer = bytearray(16 << 20)
    with reader:
        for offset in range(0, entry.size, len(buffer)):
            view = memoryview(buffer)[:min(len(buffer), entry.size - offset)]
            reader.read_into(offset, view)
"""


COST_CHILD = """
import os, sys, time
from merge_engine.formats import zip_crc
from merge_engine.storage.backends import local
spent = {"crc_s": 0.0, "crc_bytes": 0, "reads": 0}
add, read_some = zip_crc.RecordChecks.add, local.LocalRangedFile.read_some
def timed_add(self, name, size, crc, offset, data):
    started = time.thread_time()
    add(self, name, size, crc, offset, data)
    spent["crc_s"] += time.thread_time() - started
    spent["crc_bytes"] += len(data)
def counted_read(self, offset, out):
    spent["reads"] += 1
    return read_some(self, offset, out)
zip_crc.RecordChecks.add, local.LocalRangedFile.read_some = timed_add, counted_read
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
merge_checkpoint(sys.argv[1], sys.argv[2], OutputOptions(dtype="bfloat16", overwrite=True))
fd = os.open(sys.argv[1], os.O_RDONLY)
started = time.thread_time()
for _ in range(100000):
    stat = os.fstat(fd); (stat.st_size, stat.st_mtime_ns, stat.st_ino)
per_read = (time.thread_time() - started) / 100000
print(f"  cost: CRC-32 of {spent['crc_bytes'] / 1e9:.2f} GB read: {spent['crc_s']:.2f} s of thread CPU "
      f"({spent['crc_bytes'] / 1e9 / max(spent['crc_s'], 1e-9):.1f} GB per CPU second); pinned local reads: "
      f"{spent['reads']} x {per_read * 1e6:.2f} us fstat + compare = {spent['reads'] * per_read * 1e3:.1f} ms")
"""


def read_child(variant: str, source: str, target: str) -> list[str]:
    return [sys.executable, "-c", READ_CHILD, "pinned" if variant == "checked" else "unpinned", source]


def merge_child(variant: str, source: str, target: str) -> list[str]:
    code = (PATCHES[variant] + "import sys; from merge_engine.commands.merge import merge_checkpoint; "
            "from merge_engine.output.jobs import OutputOptions; "
            "merge_checkpoint(sys.argv[1], sys.argv[2], OutputOptions(dtype='bfloat16', overwrite=True))")
    return [sys.executable, "-c", code, source, target]


def run_once(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, cpu) seconds of one child; exits with its stderr when it fails."""
    run = measure("merge", command, env)
    return run.wall_s, run.cpu_s


def rounds(label: str, variants: list[str], source: str, target: Path, env: dict[str, str], repeats: int,
           before=None, child=merge_child) -> dict[str, tuple[float, float]]:
    seen: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for round_ in range(repeats):
        for variant in variants:
            shutil.rmtree(target, ignore_errors=True)
            if before is not None:
                before()
            wall, cpu = run_once(child(variant, source, str(target)), env)
            seen[variant].append((wall, cpu))
            print(f"  {label} round {round_ + 1} {variant:9s} wall {wall:6.2f} s   cpu {cpu:6.2f} s", flush=True)
    shutil.rmtree(target, ignore_errors=True)
    medians = {v: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
               for v, runs in seen.items()}
    base_wall, base_cpu = medians["checked"]
    for variant, (wall, cpu) in medians.items():
        print(f"  {label} median {variant:9s} wall {wall:6.2f} s   cpu {cpu:6.2f} s", flush=True)
    for variant, (wall, cpu) in medians.items():
        if variant != "checked":
            print(f"  {label} checked vs {variant}: wall {base_wall - wall:+.2f} s ({base_wall / wall - 1:+.1%}), "
                  f"cpu {base_cpu - cpu:+.2f} s ({base_cpu / cpu - 1:+.1%})", flush=True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="cost,local,s3,s3-reads", help="which of cost, local, s3, s3-reads")
    args = parser.parse_args()
    actor = ensure_checkpoint(args.size)
    ranks = sorted(str(p) for p in actor.glob("model_world_size_*_rank_*.pt"))
    total = sum(os.path.getsize(p) for p in ranks)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"== {args.size}: {total / 1e9:.2f} GB of rank files, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    def warm() -> None:
        subprocess.run(["cat", *ranks], stdout=subprocess.DEVNULL, check=True)

    parts = set(args.parts.split(","))
    if "cost" in parts:
        target = BENCH / "out" / "read_checks_cost"
        subprocess.run([sys.executable, "-c", COST_CHILD, str(actor), str(target)], env=env, check=True)
        shutil.rmtree(target, ignore_errors=True)
    if "local" in parts:
        rounds("local", ["checked", "no-crc", "unpinned"], str(actor), BENCH / "out" / "read_checks", env,
               args.repeats, warm)
    if not parts & {"s3", "s3-reads"}:
        return
    from tests.servers import SeaweedS3Server

    with SeaweedS3Server() as s3:
        s3_env = {**env, **s3.env()}
        for key in s3.unset_env():
            s3_env.pop(key, None)
        source = f"{s3.make_bucket('bench')}/run/global_step_1/actor"
        print(f"== s3: uploading the checkpoint to SeaweedFS ({source}) ...", flush=True)
        subprocess.run([sys.executable, "-c", "import sys; from merge_engine import storage; "
                        "storage.copy_tree(sys.argv[1], sys.argv[2])", str(actor), source], env=s3_env, check=True)
        if "s3" in parts:
            rounds("s3", ["checked", "no-crc", "unpinned"], source, BENCH / "out" / "read_checks_s3", s3_env,
                   args.repeats)
        if "s3-reads" not in parts:
            return
        print("== s3 reads alone (checked = pinned reads, If-Match on every GET)", flush=True)
        rounds("s3-reads", ["checked", "unpinned"], source, BENCH / "out" / "unused", s3_env, args.repeats,
               child=read_child)


if __name__ == "__main__":
    main()
