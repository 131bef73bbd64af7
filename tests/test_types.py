"""The type checker `make test` runs (mypy, ``[tool.mypy]`` in pyproject.toml) fails on a wrong option field and on a
wrong type given to a flow parameter: a module using the real records is checked clean, then with both planted; and
errors planted in the product's own modules (a stale ``# type: ignore`` among them) are each reported.

It runs on the repository's mypy cache (``make test`` fills it just before pytest): seconds, not the minute of a
cold run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

CLEAN = '''\
from typing import assert_type

import torch

from flows.merge_step import merge_step
from merge_engine.option_values import Dtype
from merge_engine.output.jobs import OutputOptions
from merge_engine.plan.merge_plan import PlannedTensor


def dtype_of(options: OutputOptions) -> str | None:
    return options.dtype


def cast_of(given: OutputOptions, tensor: PlannedTensor) -> None:
    # the dtype path's types, exactly (an Any fails assert_type): the option, the torch dtype, the planned cast
    assert_type(given.dtype, Dtype | None)
    assert_type(given.torch_dtype, torch.dtype | None)
    assert_type(tensor.dtype, torch.dtype)


def run() -> None:
    merge_step(step=3, run_root="/runs/a")
'''


def mypy(module: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration on ``module`` alone (the project's modules it imports come from
    the cache when they are unchanged)."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / ".mypy_cache"), str(module)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)}, timeout=900)


def test_planted_type_errors_fail_the_check(tmp_path):
    module = tmp_path / "uses_the_records.py"
    module.write_text(CLEAN)
    clean = mypy(module)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    module.write_text(CLEAN.replace("options.dtype", "options.dtyp").replace('run_root="/runs/a"', "run_root=7"))
    planted = mypy(module)
    assert planted.returncode == 1, planted.stdout + planted.stderr
    errors = [line for line in planted.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, planted.stdout
    assert '"OutputOptions" has no attribute "dtyp"' in errors[0] and "[attr-defined]" in errors[0]
    # Prefect's Flow.__call__ is overloaded (return_state=True): the call matches none, whose signature is the def's
    assert 'No overload variant of "__call__" of "Flow" matches argument types "int", "int"' in errors[1]
    assert "def __call__(self, step: int, run_root: str," in planted.stdout


# Errors planted inside the product's own modules (each a one-line edit of the real source, checked through mypy's
# --shadow-file, the files on disk untouched): a settings record's field read from the wrong record in a flow, a
# LoRA command handing the options' lora_alpha (one value, or one per adapter) where one value is expected, and a
# ``# type: ignore`` on a line that has no error (warn_unused_ignores: a stale one is reported, not left to hide one).
PLANTED_IN_PRODUCT = {
    "flows/merge_step.py": ('settings["merge"].backend)\n', 'settings["validation"].backend)\n',
                            '"ValidationSettings" has no attribute "backend"  [attr-defined]'),
    "merge_engine/commands/extract.py": ("one_lora_alpha(options),\n", "options.lora_alpha,\n",
                                         'Argument 4 to "resolve_checkpoint_lora" has incompatible type '
                                         '"float | tuple[float, ...] | None"; expected "float | None"  [arg-type]'),
    "merge_engine/storage/hashing_writer.py": ("self._out.abort()\n",
                                               "self._out.abort()  # type: ignore[attr-defined]\n",
                                               'Unused "type: ignore" comment  [unused-ignore]'),
}


def test_planted_errors_in_flows_and_commands_fail_the_check(tmp_path):
    """The flows' settings and the LoRA commands' options are checked at the project's level: no module of theirs
    is exempted (a module whose errors were not reported would let both plants pass)."""
    shadows, expected = [], []
    for path, (right, wrong, error) in PLANTED_IN_PRODUCT.items():
        source = (ROOT / path).read_text()
        assert source.count(right) == 1, f"{path} no longer holds the line planted in: update the plant"
        shadow = tmp_path / pathlib.Path(path).name
        shadow.write_text(source.replace(right, wrong))
        shadows += ["--shadow-file", path, str(shadow)]
        expected.append(error)
    planted = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / ".mypy_cache"), *shadows, *PLANTED_IN_PRODUCT],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)}, timeout=900)
    assert planted.returncode == 1, planted.stdout + planted.stderr
    errors = [line for line in planted.stdout.splitlines() if ": error:" in line]
    assert len(errors) == len(PLANTED_IN_PRODUCT), planted.stdout
    for error in expected:
        assert any(error in line for line in errors), planted.stdout
