"""A command imports what its job needs and nothing else (issue 19, point 1: start at once).

Each command runs in a fresh interpreter (``python -m merge_engine ...``, the CLI users run); at exit
it reports which heavy modules are in ``sys.modules``. Specification:
- a merge of an FSDP2 checkpoint of a dense model (DTensor rank files) imports neither
  ``torch.distributed.tensor`` (the placements are read from the unpickler's records:
  `merge_engine.layouts.dtensor_blocks`) nor ``transformers.conversion_mapping`` (the conversion
  table is consulted from its source: `merge_engine.plan.transformers_conversion.conversion_table_keys`),
  and writes the same bytes as the merge in this process; nor transformers at all once the config's Hub form
  is kept for that config (`merge_engine.plan.hub_config_memo`: the merge in this process kept it);
- a checkpoint whose names transformers converts still gets the conversion (the table is imported
  then): test_transformers_conversion.py::TestConversionTable and test_hub_format.py's family matrix;
- ``--help``, ``discover`` and ``verify`` import neither torch nor transformers;
- ``check`` imports neither either, on every layout whose check reads only headers: FSDP1 / FSDP2 / HSDP
  rank archives (DTensor and ShardedTensor), Megatron legacy ``mp_rank_*`` archives, DCP ``.metadata``
  (``megatron_dist``, dist LoRA), safetensors headers (``hf``, ``megatron_bridge``). The records hold
  dtypes by name (`merge_engine.formats.dtype_names`); the verdict line and fingerprint are those the
  check prints in this process, where torch is loaded; a truncated rank file is the same named error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WATCHED = ("torch", "transformers", "torch.distributed.tensor", "transformers.conversion_mapping", "sympy")
RUN_CLI = """
import atexit, json, sys
report, sys.argv = sys.argv[1], ["stepmerge"] + sys.argv[2:]
atexit.register(lambda: open(report, "w").write(json.dumps([m for m in {watched!r} if m in sys.modules])))
import runpy
runpy.run_module("merge_engine", run_name="__main__")
""".format(watched=WATCHED)


def _run(tmp_path: Path, *argv: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """Run ``stepmerge argv`` in a fresh interpreter: (the watched modules it imported, the finished process)."""
    report = tmp_path / f"imported-{argv[0].strip('-')}.json"
    report.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-c", RUN_CLI, str(report), *argv], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    return set(json.loads(report.read_text())), done


def _imported(tmp_path: Path, *argv: str) -> tuple[set[str], str]:
    """Run ``stepmerge argv`` in a fresh interpreter: (the watched modules it imported, its stdout)."""
    imported, done = _run(tmp_path, *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return imported, done.stdout


def _in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """``stepmerge argv`` run in this process (torch loaded): (exit code, stdout, stderr)."""
    from merge_engine.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def dense_merged(fsdp_runs, tmp_path_factory) -> Path:
    """The dense FSDP2 checkpoint merged in this process (where torch's DTensor code may well be loaded)."""
    from merge_engine.cli import main

    target = tmp_path_factory.mktemp("dense_merged") / "out"
    step = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    assert main(["merge", "--backend", "fsdp", "--local_dir", step, "--target_dir", str(target)]) == 0
    return target


def test_a_dense_fsdp2_merge_imports_no_dtensor_code_and_no_conversion_table(fsdp_runs, dense_merged, tmp_path):
    step = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    imported, _ = _imported(tmp_path, "merge", "--backend", "fsdp", "--local_dir", step,
                            "--target_dir", str(tmp_path / "fresh"))
    assert "torch" in imported  # the cast needs it
    # the config's Hub form was kept for this config by the merge above (merge_engine.plan.hub_config_memo)
    assert "transformers" not in imported
    assert "torch.distributed.tensor" not in imported
    assert "transformers.conversion_mapping" not in imported
    assert "sympy" not in imported
    fresh, here = sorted((tmp_path / "fresh").glob("*.safetensors")), sorted(dense_merged.glob("*.safetensors"))
    assert [p.name for p in fresh] == [p.name for p in here] and fresh
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(fresh, here))


def test_commands_that_read_no_weights_import_neither_torch_nor_transformers(fsdp_runs, dense_merged, tmp_path):
    run = fsdp_runs["fsdp2_qwen2"]
    for argv in (["--help"], ["discover", "--run-root", run.root], ["verify", str(dense_merged)]):
        imported, stdout = _imported(tmp_path, *argv)
        assert stdout.strip(), argv
        assert not {"torch", "transformers"} & imported, (argv, imported)


FSDP_CHECKED = ("fsdp2_qwen2", "fsdp1_mesh_qwen2", "fsdp1_sharded_tensor_llama", "hsdp_qwen2_buffer")


def _assert_check_is_torch_free(tmp_path, capsys, *argv: str) -> str:
    imported, done = _run(tmp_path, "check", *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not {"torch", "transformers"} & imported, (argv, imported)
    code, here, _ = _in_process(capsys, "check", *argv)
    assert code == 0 and done.stdout == here and "fingerprint" in here, (done.stdout, here)
    return here


def test_check_of_fsdp_rank_archives_imports_neither_torch_nor_transformers(fsdp_runs, tmp_path, capsys):
    for name in FSDP_CHECKED:
        line = _assert_check_is_torch_free(tmp_path, capsys, "--local_dir", fsdp_runs[name].latest.checkpoint_dir)
        assert line.startswith("complete fsdp checkpoint"), line


def test_check_of_a_truncated_rank_file_is_the_same_named_error_without_torch(fsdp_runs, tmp_path, capsys):
    import shutil

    step = tmp_path / "actor"
    shutil.copytree(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir, step)
    rank1 = next(step.glob("model_world_size_*_rank_1.pt"))
    rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    imported, done = _run(tmp_path, "check", "--local_dir", str(step))
    code, _, err = _in_process(capsys, "check", "--local_dir", str(step))
    assert code == done.returncode == 4  # CorruptShard: not a readable torch zip archive
    assert done.stderr == err and str(rank1) in err, (done.stderr, err)
    assert not {"torch", "transformers"} & imported, imported


def test_check_of_megatron_and_hf_layouts_imports_neither_torch_nor_transformers(megatron_runs, lora_steps,
                                                                                 dense_merged, tmp_path, capsys):
    from tests.fixtures_merged import megatron_checkpoint_url

    for name, layout in (("llama_tp2_pp2_vpp2_legacy", "megatron_legacy"), ("mistral_tp2_pp2_tied_dist_v2",
                         "megatron_dist"), ("qwen2_tp2_pp2_bridge_v2", "megatron_bridge")):
        line = _assert_check_is_torch_free(tmp_path, capsys, "--local_dir", megatron_checkpoint_url(megatron_runs[name]))
        assert f" {layout} checkpoint" in line, (name, line)
    for name in ("dense_tp2", "dense_tp2_dist"):
        line = _assert_check_is_torch_free(tmp_path, capsys, "--local_dir", str(lora_steps[name].step_dir))
        assert "complete" in line, (name, line)
    line = _assert_check_is_torch_free(tmp_path, capsys, "--backend", "hf", "--local_dir", str(dense_merged))
    assert " hf checkpoint" in line, line
