"""How an output is written: jobs, their units of work, the executors that run them, and targets that appear whole.

- `jobs`              `OutputJob` + `run_job`: every command that writes a model or an adapter
- `work_unit`         THE unit of work (`WorkUnit.run(folder, cancel) -> FileRecord`) and `PlannedOutput`
- `shard_unit`        a safetensors shard as a unit; a `MergePlan` as a job's output (units, then the index)
- `shard_job`         one output shard: ranged reads -> cast -> write -> sha256 -> a small record
- `shard_ranges`      one shard cut into byte ranges written in parallel at their offsets
- `writer`            units on this machine's threads: the one pool loop
- `executors/`        where units run, one registry keyed by address: ``threads:N``, ``ray:...``, ...
- `target`            a folder at any URL that receives everything or nothing
- `target_guard`      refusals that keep an output from destroying its input or a file in its way
- `local_commit`      local folders committed by rename from temp siblings with a live owner
- `owner_record`, `process_identity`  who owns a lease (claim, temp folder, lock) and whether it is dead
- `clock`             where leases read the time and wait (a test passes one it moves)
- `interrupts`        SIGINT / SIGTERM stop every unit of work and clean up what they started
"""
