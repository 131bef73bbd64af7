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
- ``--help``, ``discover`` and ``verify`` import neither torch nor transformers.
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


def _imported(tmp_path: Path, *argv: str) -> tuple[set[str], str]:
    """Run ``stepmerge argv`` in a fresh interpreter: (the watched modules it imported, its stdout)."""
    report = tmp_path / f"imported-{argv[0].strip('-')}.json"
    done = subprocess.run([sys.executable, "-c", RUN_CLI, str(report), *argv], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(report.read_text())), done.stdout


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
