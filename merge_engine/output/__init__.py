"""How an output is written: jobs, their units of work, the executors that run them, and targets that appear whole.

- `jobs`              `OutputJob` + `run_job`: every command that writes a model or an adapter
- `shard_job`         one output shard: ranged reads -> cast -> write -> sha256 -> a small record
- `shard_ranges`      one shard cut into byte ranges written in parallel at their offsets
- `writer`            a whole `MergePlan` on this machine's threads, then the index
- `executors/`        where units of work run: threads of this process, or a Ray cluster
- `target`            a folder at any URL that receives everything or nothing
- `target_guard`      refusals that keep an output from destroying its input or a file in its way
- `local_commit`      local folders committed by rename from temp siblings with a live owner
- `owner_record`, `process_identity`  who owns a lease (claim, temp folder, lock) and whether it is dead
- `interrupts`        SIGINT / SIGTERM stop every unit of work and clean up what they started
"""
