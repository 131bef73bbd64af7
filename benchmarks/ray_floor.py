"""Benchmark: what going through Ray costs a merge before any byte is merged (the floor under Ray / --workers 2).

    python -m benchmarks.ray_floor           # a private 2-CPU Ray head of this machine, stopped at the end

Prints, on a fresh private cluster (`tests.fixtures_ray.start_ray_head`), each cost in CPU seconds (what
the machine pays whatever its load) and wall seconds:
- the coordinator's ``import ray`` + ``ray.init`` (connecting a driver);
- a cold worker: its process start (Python + Ray) and its import of the shard job (torch, merge_engine):
  paid once per worker per merge, since Ray binds worker processes to one driver (job);
- a warm task's round trip (submit, run a no-op, get), the per-task overhead once workers are up;
- a worker's re-preparation of the 0.5b benchmark job from the pickled `MergeJob` a `UnitTask` carries
  (listing, config and the check's parsed tensor index carried: no rank file is read again, nothing but the
  plan is computed), against the coordinator's first one, with the bytes the worker read for it.
The merge itself, ``--ray-address`` against ``--workers 2``, is `benchmarks.shard_jobs --parts ray` /
`benchmarks.all`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from benchmarks.fsdp_merge import ensure_checkpoint

PROBE = """
import pickle, sys, time
cpu, wall = time.process_time(), time.perf_counter()
import ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
print(f"driver import ray + ray.init: cpu {time.process_time() - cpu:.2f} s, wall {time.perf_counter() - wall:.2f} s")

def cold():
    started = time.process_time()
    import merge_engine.output.executors.remote, merge_engine.commands.merge, merge_engine.output.shard_job  # noqa: F401
    return started, time.process_time()

wall = time.perf_counter()
started, imported = ray.get(ray.remote(num_cpus=1)(cold).remote())
print(f"cold worker: cpu {started:.2f} s to start (Python + Ray) + {imported - started:.2f} s to import the shard "
      f"job; wall to its first result {time.perf_counter() - wall:.2f} s")
noop = ray.remote(num_cpus=1)(lambda: None)
ray.get(noop.remote())
wall = time.perf_counter()
ray.get([noop.remote() for _ in range(50)])
print(f"warm task round trip: {(time.perf_counter() - wall) / 50 * 1000:.1f} ms")

from merge_engine.output.jobs import OutputOptions
from merge_engine.commands.merge import MergeJob
job = MergeJob(sys.argv[2], sys.argv[3], OutputOptions(dtype="bfloat16"))
cpu = time.process_time()
job.fingerprint()
job.prepare().close()
first = time.process_time() - cpu

def again(blob):
    from merge_engine.storage.range_reader import bytes_read
    cpu, read = time.process_time(), bytes_read()
    pickle.loads(blob).prepare().close()
    return time.process_time() - cpu, bytes_read() - read

blob = pickle.dumps(job)
remote = ray.remote(num_cpus=1)(again)
runs = [ray.get(remote.remote(blob)) for _ in range(3)]  # the first in a worker also pays imports the job needs
print(f"prepare: coordinator {first:.2f} s cpu (check + open + plan, with its imports); a worker again from the "
      f"{len(blob)} byte pickled job: {' / '.join(f'{c:.2f}' for c, _ in runs)} s cpu, "
      f"{' / '.join(str(b) for _, b in runs)} bytes read (3 runs)")
"""


def main() -> None:
    from tests.fixtures_ray import LOOPBACK_RAY_ENV, free_port, start_ray_head, stop_ray_head

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)", flush=True)
    actor = ensure_checkpoint("0.5b")
    env = {**os.environ, **LOOPBACK_RAY_ENV, "PYTHONPATH": os.getcwd()}
    root = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    port = free_port()
    head = start_ray_head(root, port, env)  # stopped alone: never `ray stop`, which stops every cluster here
    try:
        subprocess.run([sys.executable, "-c", PROBE, f"127.0.0.1:{port}", str(actor), os.path.join(root, "out")],
                       env=env, check=True)
    finally:
        stop_ray_head(head)
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
