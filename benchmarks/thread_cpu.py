"""Where a merge's CPU goes, thread by thread: the floor of ``--workers 2`` / ``--workers 1`` on any machine.

    python -m benchmarks.thread_cpu                      # the 0.5b FSDP2 benchmark checkpoint, workers 1 and 2
    python -m benchmarks.thread_cpu --workers 1,2,4 --actor PATH

Each merge runs in a child process (``--child``) that samples every thread's CPU seconds from
``/proc/self/task/<tid>/stat`` (every 50 ms, by Python thread name), and marks the phases: imports,
prepare (fingerprint, check, open, plan: up to ``on_plan``), write (+ the small files). Thread CPU time
is what a loaded machine cannot hide: wall times of a shared machine are not figures, CPU seconds are.
It prints each phase's process CPU and the write phase's CPU per kind of thread, then the wall a
merge would take on ``--cores`` idle cores: the serial phases, plus the write phase's longest thread
or its total CPU over the cores, whichever is larger; and the ratio of each ``--workers`` to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.harness import BENCH

TICK = os.sysconf("SC_CLK_TCK")
SAMPLER = "thread-cpu-sampler"


def _thread_cpu(tid: int) -> float | None:
    try:
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def child(actor: str, target: str, workers: int) -> None:
    """One merge in this process; prints a JSON record of its phases and threads."""
    seen: dict[tuple[str, int], float] = {}

    def sample() -> None:
        while True:
            for thread in threading.enumerate():
                cpu = _thread_cpu(thread.native_id)
                if cpu is not None:
                    seen[(thread.name, thread.native_id)] = cpu
            time.sleep(0.05)

    def process_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    marks = [("start", time.perf_counter(), process_cpu())]
    threading.Thread(target=sample, daemon=True, name=SAMPLER).start()
    from merge_engine.output.executors.local import LocalExecutor
    from merge_engine.output.jobs import OutputOptions, run_job
    from merge_engine.commands.merge import MergeJob

    marks.append(("imports", time.perf_counter(), process_cpu()))
    at_plan: dict[tuple[str, int], float] = {}

    def on_plan(plan: object) -> None:
        marks.append(("prepare", time.perf_counter(), process_cpu()))
        at_plan.update(seen)

    run_job(MergeJob(actor, target, OutputOptions(dtype="bfloat16", overwrite=True)),
            executor=LocalExecutor(workers), on_plan=on_plan)
    marks.append(("write", time.perf_counter(), process_cpu()))
    time.sleep(0.1)
    threads: dict[str, float] = {}
    for (name, tid), cpu in seen.items():
        if name == SAMPLER:
            continue
        kind = name.rstrip("0123456789_")
        threads.setdefault(kind, 0.0)
        threads[kind] += cpu - (at_plan.get((name, tid), 0.0) if name == "MainThread" else 0.0)
    longest = max((cpu - (at_plan.get((name, tid), 0.0) if name == "MainThread" else 0.0)
                   for (name, tid), cpu in seen.items() if name != SAMPLER), default=0.0)
    print(json.dumps({"phases": {b[0]: [b[1] - a[1], b[2] - a[2]] for a, b in zip(marks, marks[1:])},
                      "threads": threads, "longest": longest,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "load": os.getloadavg()[0]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actor", default=str(BENCH / "fsdp" / "0.5b" / "global_step_1" / "actor"),
                        help="an FSDP actor folder (default: benchmarks.fsdp_merge's 0.5b checkpoint)")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--cores", type=int, default=2, help="idle cores the floor is computed for")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    if not os.path.isdir(args.actor):
        raise SystemExit(f"no checkpoint at {args.actor}: run `python -m benchmarks.fsdp_merge --sizes 0.5b` once")
    floors = {}
    for workers in (int(w) for w in args.workers.split(",")):
        with tempfile.TemporaryDirectory(dir=BENCH) as tmp:
            out = subprocess.run([sys.executable, "-m", "benchmarks.thread_cpu", "--child", args.actor,
                                  os.path.join(tmp, "out"), str(workers)], capture_output=True, text=True, check=True)
        record = json.loads(out.stdout.strip().splitlines()[-1])
        phases = record["phases"]
        serial = phases["imports"][1] + phases["prepare"][1]
        write_cpu = sum(record["threads"].values())
        floors[workers] = serial + max(record["longest"], write_cpu / args.cores)
        print(f"--workers {workers} (load {record['load']:.1f}, peak RSS {record['peak_rss_mb']:.0f} MB)")
        for name, (wall, cpu) in phases.items():
            print(f"  {name:8s} wall {wall:6.2f} s   process CPU {cpu:6.2f} s")
        print("  write phase CPU by thread: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(record["threads"].items()))
              + f"; longest thread {record['longest']:.2f} s")
        print(f"  on {args.cores} idle cores: >= {floors[workers]:.2f} s (serial {serial:.2f} s + write "
              f"max(longest thread, CPU / cores))")
    first = next(iter(floors))
    for workers, floor in floors.items():
        print(f"floor --workers {workers} / --workers {first} on {args.cores} cores: {floor / floors[first]:.2f}")


if __name__ == "__main__":
    main()
