"""`synthetic_runs.deepspeed`: the shared-memory all-reduce buffers DeepSpeed's CPU accelerator leaves in /dev/shm
(69 MB a rank, never removed by DeepSpeed: 8.8 GB had piled up on a development machine in a day) are removed for
the group that wrote the run, and only for it."""

from __future__ import annotations

import os

from synthetic_runs import deepspeed as writer


def test_only_the_groups_own_buffers_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "SHM_FOLDER", str(tmp_path))
    ours = [f"deepspeed_allreduce_buffer_0_127.0.0.1_41234_{rank}" for rank in (0, 1)]
    others = ["deepspeed_allreduce_buffer_0_127.0.0.1_4123_0", "deepspeed_allreduce_buffer_0_127.0.0.1_412345_0",
              "unrelated_127.0.0.1_41234_0"]
    for name in ours + others:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(writer.remove_shm_buffers(41234)) == ours
    assert sorted(os.listdir(tmp_path)) == sorted(others)


def test_a_written_run_leaves_no_buffer_in_dev_shm(zero_runs):
    # zero_runs (tests/fixtures_checkpoints.py) wrote every ZeRO fixture of the session through real DeepSpeed
    left = [name for name in os.listdir("/dev/shm") if name.startswith("deepspeed_allreduce_buffer_")
            and any(f"_{port}_" in name for port in writer.PORTS_USED)]
    assert writer.PORTS_USED and left == []
