"""A command's target never destroys its input or a file in its way (issue 9, cases 1 and 4).

Specification:
- For every output command (`merge`, `split`, `extract-lora`, `merge-lora`), a target that is the
  input, contains it (the run root holding ``--local_dir``) or lies inside it is refused with
  `TargetOverlapsSource` naming the target, exit code 2, even with ``--overwrite``; every input
  byte and every unrelated file is still there.
- Locations are compared canonically: a symlinked alias, a ``file://`` URL, a trailing slash or a
  ``..`` of the same folder is the same folder; ``/a/b`` does not contain ``/a/bc``; ``s3a://`` is
  ``s3://``.
- A regular file (or a link) at the target is refused with `TargetExists` unless ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from merge_engine.cli import main
from merge_engine.errors import TargetOverlapsSource
from merge_engine.output.target_guard import overlaps, refuse_overlap

VARIANT = "fsdp2_qwen2"


def _tree(root) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256): what must survive a refused command."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.fixture()
def run_root(fsdp_runs, tmp_path):
    """A private run root: global_step_1/actor/<rank files> plus an unrelated file."""
    root = tmp_path / "run"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, root / "global_step_1" / "actor")
    (root / "notes.txt").write_text("unrelated: must survive\n")
    return root


def _merge(source, target, *extra):
    return main(["merge", "--backend", "fsdp", "--local_dir", str(source), "--target_dir", str(target), *extra])


@pytest.mark.parametrize("where", ["itself", "run_root", "inside", "alias", "file_url", "dotdot"])
def test_merge_refuses_a_target_overlapping_its_source(run_root, where, capsys):
    source = run_root / "global_step_1" / "actor"
    alias = run_root.parent / "alias"
    alias.symlink_to(source)
    target = {"itself": str(source), "run_root": str(run_root), "inside": str(source / "merged"),
              "alias": str(alias), "file_url": f"file://{source}/", "dotdot": f"{source}/../actor"}[where]
    before = _tree(run_root)
    assert _merge(source, target, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "TargetOverlapsSource" in err and target in err
    assert _tree(run_root) == before


def test_split_refuses_its_own_hf_source(run_root, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert _merge(run_root / "global_step_1" / "actor", hf) == 0
    before = _tree(hf)
    for target in (hf, hf / "megatron", tmp_path):
        code = main(["split", "--hf-dir", str(hf), "--target_dir", str(target), "--overwrite"])
        assert code == 2 and "TargetOverlapsSource" in capsys.readouterr().err
    assert _tree(hf) == before


def test_adapter_commands_refuse_their_inputs(run_root, tmp_path, capsys):
    source = run_root / "global_step_1" / "actor"
    before = _tree(run_root)
    code = main(["extract-lora", "--local_dir", str(source), "--target_dir", str(run_root), "--overwrite"])
    assert code == 2 and "TargetOverlapsSource" in capsys.readouterr().err
    code = main(["merge-lora", "--base-model", str(source), "--lora-adapter", str(tmp_path / "adapter"),
                 "--target_dir", str(source / "out"), "--overwrite"])
    assert code == 2 and "TargetOverlapsSource" in capsys.readouterr().err
    assert _tree(run_root) == before


def test_a_file_at_the_target_is_refused_without_overwrite(run_root, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_bytes(b"precious")
    assert _merge(run_root / "global_step_1" / "actor", target) == 2
    err = capsys.readouterr().err
    assert "TargetExists" in err and str(target) in err
    assert target.read_bytes() == b"precious"
    assert _merge(run_root / "global_step_1" / "actor", target, "--overwrite") == 0
    assert (target / "config.json").is_file()


def test_canonical_comparison():
    assert overlaps("s3://b/run", "s3a://b/run/global_step_1/actor")
    assert overlaps("gs://b/x/", "gcs://b/x")
    assert overlaps("s3://b/run/./a//", "s3://b/run/a")
    assert not overlaps("s3://b/run", "gs://b/run")
    assert not overlaps("/data/run", "/data/run2")
    assert not overlaps("s3://b/a/b", "s3://b/a/bc")
    assert overlaps("/", "/anything")
    with pytest.raises(TargetOverlapsSource) as info:
        refuse_overlap("s3://b/run", [None, "s3://b/run/global_step_1"])
    assert info.value.path == "s3://b/run"
