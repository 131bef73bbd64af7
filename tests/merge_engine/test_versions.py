"""The tested transformers / peft pairs (`merge_engine.versions`) and the start-up refusal of any other.

Specification:
- a pair inside one row of `TESTED` is accepted (each environment of the compatibility matrix, `make compat`);
  a version outside every row, or a pair whose two versions belong to different rows (transformers 4.57 with
  peft 0.19, 5.x with peft 0.17), is refused with one line naming the installed versions and every tested range;
- pyproject's ranges are exactly the rows' union: every release the table accepts, pip accepts, and the
  releases next to each range's ends are refused by both (4.58+ aside: no such 4.x was released);
- what pip resolves beside transformers 4.57 when peft is not pinned (the newest peft pyproject admits: 0.21.2)
  is a tested pair;
- in a real environment holding an untested pair (the main environment's transformers with peft 0.17.1,
  built once per machine like `tests.readers_env`), ``merge`` / ``extract-lora`` / ``merge-lora`` exit 1
  at start with that one line on stderr (`UnsupportedVersions`, no traceback, nothing written), while
  ``check`` and ``--help`` still run there, importing no transformers; ``STEPMERGE_UNTESTED_VERSIONS=1``
  lets the merge run anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from merge_engine.versions import TESTED, installed_versions, unsupported_reason
from tests.compat_matrix import UNTESTED_PAIR

REPO = Path(__file__).resolve().parents[2]
ACCEPTED = [("4.57.0", "0.17.0"), ("4.57.6", "0.17.1"), ("4.57.6", "0.21.2"), ("5.5.3", "0.18.1"), ("5.10.4", "0.19.1"),
            ("5.17.0", "0.21.0"), ("5.25.0", "0.21.2")]
REFUSED = [("4.56.2", "0.17.1"), ("4.58.0", "0.17.1"), ("5.0.0", "0.21.2"), ("5.5.2", "0.21.2"), ("5.26.0", "0.21.2"),
           ("5.26.0rc1", "0.21.2"), ("4.57.6", "0.19.1"), ("4.57.6", "0.18.1"),
           ("5.10.4", "0.17.1"), ("5.25.0", "0.22.0"),
           ("5.25.0", "0.15.2"),
           # pre-releases and dev releases inside a tested range are not tested releases
           ("5.25.1a1", "0.21.2"), ("5.25.0.dev0", "0.21.2"), ("5.25.0", "0.21.0.dev0"), ("5.17.0rc2", "0.21.0"),
           ("4.57.6", "0.17.2b1")]


@pytest.mark.parametrize("transformers,peft", ACCEPTED)
def test_a_tested_pair_is_accepted(transformers, peft):
    assert unsupported_reason({"transformers": transformers, "peft": peft}) is None


@pytest.mark.parametrize("transformers,peft", REFUSED)
def test_an_untested_pair_is_refused_in_one_line_naming_it_and_the_ranges(transformers, peft):
    reason = unsupported_reason({"transformers": transformers, "peft": peft})
    assert reason is not None and "\n" not in reason
    assert f"transformers {transformers} with peft {peft}" in reason
    assert all(pair.describe() in reason for pair in TESTED)


def test_the_newest_peft_pyproject_admits_is_tested_beside_every_transformers_it_admits():
    """pip resolves the newest peft release pyproject admits beside any transformers (peft bounds no transformers):
    beside 4.57.6 that is peft 0.21.2 (`pip install --dry-run --report` of the checkout with transformers==4.57.6,
    measured), a pair of `TESTED` and of the compatibility matrix's environments."""
    from tests.compat_matrix import ENVIRONMENTS

    newest_peft = "0.21.2"
    assert _declared()["peft"].specifier.contains(newest_peft) and not _declared()["peft"].specifier.contains("0.22.0")
    for transformers in ("4.57.6", "5.5.3", "5.10.4", "5.17.0", "5.25.0"):
        assert unsupported_reason({"transformers": transformers, "peft": newest_peft}) is None, transformers
    pinned = [dict(pin.split("==") for pin in env.pins) for env in ENVIRONMENTS if env.pins]
    assert {"transformers": "4.57.6", "peft": newest_peft} in [{k: p.get(k) for k in ("transformers", "peft")}
                                                              for p in pinned]


def test_the_main_environment_is_a_tested_pair():
    assert unsupported_reason(installed_versions()) is None


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    return {r.name: r for r in requirements if r.name in ("transformers", "peft")}


# no transformers 4.x exists after 4.57 (4.57.6 is the registry's last), so pip's range does not exclude 4.58+
PIP_CASES = [case for case in ACCEPTED + REFUSED if case[0] != "4.58.0"]


@pytest.mark.parametrize("transformers,peft", PIP_CASES)
def test_pyproject_declares_the_tested_ranges(transformers, peft):
    """pip accepts each version exactly when some row of the table holds it (pairs aside: pip cannot
    express them, the start-up check does). pip without ``--pre`` never picks a pre- or dev release, and no row
    holds one."""
    declared = _declared()
    in_rows_t = any(unsupported_reason({"transformers": transformers, "peft": p.peft_from}) is None for p in TESTED)
    in_rows_p = any(unsupported_reason({"transformers": p.transformers_from, "peft": peft}) is None for p in TESTED)
    assert declared["transformers"].specifier.contains(transformers, prereleases=False) is in_rows_t
    assert declared["peft"].specifier.contains(peft, prereleases=False) is in_rows_p


@pytest.fixture(scope="module")
def untested_python() -> Path:
    from tests.readers_env import pinned_python

    return pinned_python(*UNTESTED_PAIR)


def _stepmerge(python: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    report = "import atexit, json, sys; atexit.register(lambda: print('IMPORTED', json.dumps('transformers' in sys.modules)))"
    code = f"{report}; import runpy, sys; sys.argv = ['stepmerge'] + sys.argv[1:]; runpy.run_module('merge_engine', run_name='__main__')"
    return subprocess.run([str(python), "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_an_untested_environment_is_refused_at_start(untested_python, fsdp_runs, tmp_path):
    versions = subprocess.run([str(untested_python), "-c", "import importlib.metadata as m; "
                               "print(m.version('transformers'), m.version('peft'))"],
                              capture_output=True, text=True, check=True).stdout.split()
    step = fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir
    for argv in (["merge", "--local_dir", step, "--target_dir", str(tmp_path / "out")],
                 ["extract-lora", "--local_dir", step, "--target-dir", str(tmp_path / "adapter")],
                 ["merge-lora", "--base-model", step, "--lora-adapter", step, "--target-dir", str(tmp_path / "fused")]):
        done = _stepmerge(untested_python, *argv)
        assert done.returncode == 1, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("stepmerge: error: UnsupportedVersions: "), done.stderr[-2000:]
        assert f"transformers {versions[0]} with peft {versions[1]}" in lines[0]
        assert "IMPORTED false" in done.stdout  # refused before transformers was imported
    assert not any(tmp_path.iterdir())
    checked = _stepmerge(untested_python, "check", "--local_dir", step)
    assert checked.returncode == 0 and "complete fsdp checkpoint" in checked.stdout and "IMPORTED false" in checked.stdout
    helped = _stepmerge(untested_python, "--help")
    assert helped.returncode == 0 and "IMPORTED false" in helped.stdout
    forced = _stepmerge(untested_python, "merge", "--local_dir", step, "--target_dir", str(tmp_path / "forced"),
                        STEPMERGE_UNTESTED_VERSIONS="1")
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert json.loads((tmp_path / "forced" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
