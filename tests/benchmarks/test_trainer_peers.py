"""`python -m benchmarks.trainer_peers`: stepmerge beside each trainer's own consolidator, on the same inputs.

Specification:
- two outputs are the same only when they hold the same names and, for each, the same dtype, shape and bytes,
  whatever the files they are spread over; otherwise the verdict names what differs;
- the table puts each pair's medians side by side, the stepmerge / peer ratios on stepmerge's line, met only when
  both ratios are at or under the goal and the outputs are identical;
- each pair's commands run the peer's own tool on the input stepmerge merges;
- a run's next step (the config's memo read) gets a line and ratios of its own against the same peer;
- the floor's copy writes exactly the input's bytes, and its sha256 is theirs.
"""

from __future__ import annotations

from pathlib import Path

import hashlib

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import trainer_peers
from benchmarks.trainer_peers import compare, pairs, table


def _write(folder: Path, files: dict[str, dict[str, torch.Tensor]]) -> Path:
    folder.mkdir(parents=True)
    for name, tensors in files.items():
        save_file(tensors, str(folder / name))
    return folder


def test_outputs_are_the_same_only_bit_for_bit(tmp_path):
    a, b = torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(5)
    one = _write(tmp_path / "one", {"model.safetensors": {"a": a, "b": b}})
    assert compare(one, _write(tmp_path / "split", {"m-1.safetensors": {"a": a}, "m-2.safetensors": {"b": b}})) == ""
    flipped = a.clone()
    flipped.view(torch.int32)[1, 2] ^= 1  # one bit of one value
    assert compare(one, _write(tmp_path / "bit", {"model.safetensors": {"a": flipped, "b": b}})).startswith("a:")
    assert compare(one, _write(tmp_path / "cast", {"model.safetensors": {"a": a.bfloat16(), "b": b}})).startswith("a:")
    assert "only in" in compare(one, _write(tmp_path / "less", {"model.safetensors": {"a": a}}))


def _row(peer: str, ours: tuple[float, float], theirs: tuple[float, float], verdict: str = "") -> dict:
    return {"peer": peer, "label": f"{peer} tool", "verdict": verdict, "input_gb": 2.5, "read_once_s": 0.4,
            "runs": {"stepmerge": {"wall_s": ours[0], "peak_rss_mb": ours[1], "cpu_s": 1.0},
                     "peer": {"wall_s": theirs[0], "peak_rss_mb": theirs[1], "cpu_s": 2.0}}}


def test_the_table_gives_each_ratio_and_meets_the_goal_only_with_identical_outputs():
    lines = table([_row("fast", (4.0, 300), (10.0, 3000)), _row("slow", (6.0, 300), (10.0, 3000)),
                   _row("wrong", (1.0, 100), (10.0, 3000), verdict="a: differs")]).splitlines()
    fast, slow, wrong = (next(line for line in lines if line.split()[:2] == [peer, "stepmerge"])
                         for peer in ("fast", "slow", "wrong"))
    assert fast.split()[-3:] == ["0.40", "0.10", "yes"]
    assert slow.split()[-3:] == ["0.60", "0.10", "NO"]
    assert wrong.split()[-1] == "NO" and any("NO: a: differs" in line for line in lines)


@pytest.mark.parametrize("peer, tool", [("accelerate", "merge-weights"), ("dcp_hf", "--consolidate"),
                                        ("zero", "--safe_serialization")])
def test_each_pair_runs_the_peers_tool_on_the_input_stepmerge_merges(tmp_path, monkeypatch, peer, tool):
    monkeypatch.setattr(trainer_peers, "BENCH", tmp_path)
    (tmp_path / "peers" / "tiny" / peer).mkdir(parents=True)
    (tmp_path / "peers" / "tiny" / peer / "written").write_text("ok\n")  # cached: nothing is written
    (pair,) = pairs("tiny", [peer])
    local_dir = pair.stepmerge[pair.stepmerge.index("--local_dir") + 1]
    assert Path(local_dir) == pair.input_dir
    if peer == "zero":  # zero_to_fp32.py takes the run root and the tag
        assert pair.tool[pair.tool.index("--tag") + 1] == pair.input_dir.name
        assert str(pair.input_dir.parent) in pair.tool
    else:
        assert str(pair.input_dir) in pair.tool
    assert tool in pair.tool and "{out}" in pair.tool and "{out}" in pair.stepmerge
    assert str(pair.input_dir).startswith(str(tmp_path))


def test_a_runs_next_step_gets_its_own_ratios_against_the_same_peer():
    row = _row("dcp_hf", (6.0, 400), (10.0, 1000))
    row["runs"]["stepmerge_next"] = {"wall_s": 4.0, "peak_rss_mb": 300, "cpu_s": 1.0}
    lines = table([row]).splitlines()
    (first,) = [line for line in lines if "first step" in line]
    (following,) = [line for line in lines if "next step" in line]
    assert first.split()[-3:] == ["0.60", "0.40", "NO"]
    assert following.split()[-3:] == ["0.40", "0.30", "yes"]


def test_the_floors_copy_writes_the_input_bytes_and_hashes_them(tmp_path):
    from benchmarks.data_path_floor import loop

    parts = [torch.arange(n, dtype=torch.float32).numpy().tobytes() for n in (5, 3 * 1024 * 1024 + 7)]
    files = []
    for i, data in enumerate(parts):
        files.append(tmp_path / f"in{i}")
        files[-1].write_bytes(data)
    out = tmp_path / "out.bin"
    digest = loop(str(out), [str(f) for f in files], cast=False)
    assert out.read_bytes() == b"".join(parts)
    assert digest == hashlib.sha256(b"".join(parts)).hexdigest()
