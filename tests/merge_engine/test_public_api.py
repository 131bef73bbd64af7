"""The Python API (`merge_engine.api`, docs/python.md): what the package exports, and the documented example run
as written on a real verl FSDP2 step, its release compared with the trained weights bit for bit."""

from __future__ import annotations

import glob
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import merge_engine

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPORTED = ["check", "extract_lora", "merge", "merge_lora", "publish", "verify"]


def test_the_package_exports_the_api_typed_and_documented():
    assert set(EXPORTED) <= set(merge_engine.__all__)
    for name in EXPORTED:
        function = getattr(merge_engine, name)
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, name
        assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values()), name
        doc = inspect.getdoc(function) or ""
        assert "Args:" in doc and "Returns:" in doc and "Raises:" in doc, name


def test_importing_the_package_imports_no_torch():
    code = "import sys, merge_engine; merge_engine.merge; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT).stdout
    assert out.strip() == "False"


def example_block() -> str:
    """The first ``python`` block of docs/python.md's Example section."""
    text = (ROOT / "docs" / "python.md").read_text()
    section = text[text.index("## Example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """One verl FSDP2 step (2 ranks, a tiny Qwen2) at run/global_step_1/actor, as the example names it."""
    from synthetic_runs.fsdp import FsdpSpec, StepJob, write_fsdp_steps

    base = tmp_path_factory.mktemp("public_api")
    [files] = write_fsdp_steps([StepJob(str(base / "run" / "global_step_1"), FsdpSpec(world_size=2, strategy="fsdp2"),
                                        1, str(base / "reference"))])
    return base, files


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        found.update(load_file(path))
    return found


def test_the_documented_example_runs_and_releases_the_trained_weights(step):
    base, files = step
    run = subprocess.run([sys.executable, "-c", example_block()], capture_output=True, text=True, cwd=base,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "fsdp" in run.stdout and "tensors" in run.stdout
    release = base / "releases" / "actor" / "global_step_1"
    assert (release / "manifest.json").is_file() and (release / "_COMPLETE").is_file()
    assert not (base / "merged" / "global_step_1").exists()  # the staging folder went into the release
    assert len(glob.glob(str(release / "*.safetensors"))) > 1  # max_shard_size=16 KiB: the option was taken
    released, trained = _tensors(str(release)), _tensors(files.reference_hf_dir)
    assert sorted(released) == sorted(trained)
    for name, tensor in trained.items():
        assert released[name].dtype == tensor.dtype, name
        assert torch.equal(released[name].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    merge_engine.verify(str(release))  # intact: no error


def test_a_damaged_release_is_a_named_error(step, tmp_path):
    from merge_engine.errors import ReleaseDamaged

    base, files = step
    merged = merge_engine.merge(files.checkpoint_dir, str(tmp_path / "merged"))
    release = merge_engine.publish(merged, str(tmp_path / "release"))
    weights = sorted(glob.glob(str(tmp_path / "release" / "*.safetensors")))[0]
    with open(weights, "r+b") as handle:  # one byte of the data flipped, the size kept
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ReleaseDamaged) as refused:
        merge_engine.verify(release.url)
    assert os.path.basename(weights) in str(refused.value)
