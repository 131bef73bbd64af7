"""Run layouts: each trainer's step-folder naming, declared once (`merge_engine.layouts.runs`).

Specification:
- verl names a step ``global_step_<N>``, Megatron-LM ``iter_<NNNNNNN>`` (7 digits); each name reads back
  to its number (any number of digits), anything else to None;
- a step's folder names come in registry order (verl's first: it is looked for first);
- a URL is named from its last step folder on, else by its last component;
- discovery asks the registry: a trainer added to `RUN_LAYOUTS` is discovered (a whole run root, and one
  step from its own folder), with no other change.
"""

from __future__ import annotations

import pytest

from merge_engine import storage
from merge_engine.layouts import runs
from merge_engine.layouts.runs import MEGATRON_LM, VERL, RunLayout, from_step_folder, step_folders, step_of_folder


@pytest.mark.parametrize("name, step", [("global_step_40", 40), ("global_step_0", 0), ("iter_0000100", 100),
                                        ("iter_7", 7), ("global_step_", None), ("global_step_4x", None),
                                        ("step_4", None), ("iter_0000100.tmp", None), ("actor", None)])
def test_a_folder_name_reads_back_to_its_step(name, step):
    assert step_of_folder(name) == step


def test_each_trainer_writes_its_own_folder_names():
    assert (VERL.folder(40), MEGATRON_LM.folder(100)) == ("global_step_40", "iter_0000100")
    assert step_folders(7) == ("global_step_7", "iter_0000007")
    assert VERL.roles == ("actor", "critic") and MEGATRON_LM.roles == ()


@pytest.mark.parametrize("url, label", [
    ("s3://bucket/run/global_step_40/actor", "global_step_40/actor"),
    ("/data/run/global_step_7", "global_step_7"),
    ("gs://bucket/mlm/iter_0000100/", "iter_0000100"),
    ("gs://bucket/some/model/", "model"),
])
def test_a_url_is_named_from_its_step_folder_on(url, label):
    assert from_step_folder(url) == label


def test_a_trainer_added_to_the_registry_is_discovered(tmp_path, monkeypatch):
    """One `RunLayout` in `RUN_LAYOUTS` is all discovery needs to find a new trainer's steps."""
    from merge_engine.layouts.discovery import discover, discover_step

    root = str(tmp_path)
    for path in ("ckpt-12/model.safetensors", "ckpt-12/config.json"):
        storage.write_bytes(storage.join(root, path), b"{}" if path.endswith(".json") else b"x" * 16)
    assert discover(root).steps == ()
    monkeypatch.setattr(runs, "RUN_LAYOUTS", (*runs.RUN_LAYOUTS, RunLayout("other", "ckpt-{step}", r"ckpt-(\d+)")))
    [step] = discover(root).steps
    assert (step.step, step.role, step.url) == (12, "", storage.join(root, "ckpt-12"))
    assert discover_step(root, 12, "") == step
