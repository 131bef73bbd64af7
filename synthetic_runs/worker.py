"""Entry point of one spawned rank: `python -m synthetic_runs.worker JOBS.json RANK WORLD PORT`.

Reads the jobs (JSON written by `synthetic_runs.fsdp.write_fsdp_steps`), joins the gloo process group
through the parent's TCPStore on 127.0.0.1:PORT and writes this rank's files. Exit code 0 on success.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    jobs_path, rank, world_size, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    from synthetic_runs.fsdp import StepJob, run_rank_jobs

    with open(jobs_path) as handle:
        jobs = [StepJob.from_dict(item) for item in json.load(handle)]
    run_rank_jobs(jobs, rank, world_size, port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
