"""Run layouts: each trainer's step-folder naming, declared once (`merge_engine.layouts.runs`).

Specification:
- verl names a step ``global_step_<N>``, Megatron-LM ``iter_<NNNNNNN>`` (7 digits), DeepSpeed
  ``global_step<N>``, HF Trainer ``checkpoint-<N>``; each name reads back
  to its number, anything else to None: another padding (``global_step_01``, ``iter_7``) or a non-ASCII
  digit (``global_step_١``) names no step;
- listing and lookup agree: every step discovery lists is found by a lookup of its number, and a folder
  a lookup would not find is not listed;
- a step's folder names come in registry order (verl's first: it is looked for first);
- a URL is named from its last step folder on, else by its last component;
- discovery asks the registry: a trainer added to `RUN_LAYOUTS` is discovered (a whole run root, and one
  step from its own folder), with no other change.
"""

from __future__ import annotations

import pytest

from merge_engine import storage
from merge_engine.layouts import runs
from merge_engine.layouts.runs import (DEEPSPEED, MEGATRON_LM, NEMO_RL, VERL, RunLayout, from_step_folder, step_folders,
                                       step_of_folder)


@pytest.mark.parametrize("name, step", [("global_step_40", 40), ("global_step_0", 0), ("iter_0000100", 100),
                                        ("iter_12345678", 12345678), ("iter_7", None), ("iter_00000100", None),
                                        ("global_step_01", None), ("global_step_00", None), ("global_step_\u0661", None),
                                        ("global_step_\uff11", None), ("iter_000000\u0667", None),
                                        ("global_step_", None), ("global_step_4x", None),
                                        ("ckpt_4", None), ("iter_0000100.tmp", None), ("actor", None),
                                        ("checkpoint-500", 500), ("checkpoint_3", 3), ("step-1000", 1000),
                                        ("step_20", 20), ("tmp_step_20", None), ("checkpoint-0500", None),
                                        ("step-\u0661", None), ("global_step12", 12), ("global_step012", None),
                                        ("global_step", None)])
def test_a_folder_name_reads_back_to_its_step(name, step):
    assert step_of_folder(name) == step


def test_each_trainer_writes_its_own_folder_names():
    assert (VERL.folder(40), MEGATRON_LM.folder(100)) == ("global_step_40", "iter_0000100")
    assert step_folders(7) == ("global_step_7", "iter_0000007", "checkpoint-7", "checkpoint_7", "step-7", "step_7",
                             "global_step7")
    assert VERL.roles == ("actor", "critic") and MEGATRON_LM.roles == () and NEMO_RL.roles == ("policy",)
    assert DEEPSPEED.folder(40) == "global_step40"


@pytest.mark.parametrize("url, label", [
    ("s3://bucket/run/global_step_40/actor", "global_step_40/actor"),
    ("/data/run/global_step_7", "global_step_7"),
    ("gs://bucket/mlm/iter_0000100/", "iter_0000100"),
    ("gs://bucket/some/model/", "model"),
    ("s3://bucket/sft/checkpoint-500", "checkpoint-500"),
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


def test_every_listed_step_is_found_by_its_number(tmp_path):
    """``global_step_01`` and ``global_step_١`` (Arabic-Indic one) were listed as step 1, which a lookup of
    step 1 (``global_step_1``) never found: StepNotFound for a step the listing showed. Now neither is a step."""
    from merge_engine.layouts.discovery import discover, discover_step

    root = str(tmp_path)
    for folder in ("global_step_01", "global_step_\u0661", "iter_7", "global_step_2", "iter_0000003"):
        for path in ("model.safetensors", "config.json"):
            storage.write_bytes(storage.join(root, folder, path), b"{}" if path.endswith(".json") else b"x" * 16)
    listed = discover(root).steps
    assert [(s.step, s.url) for s in listed] == [(2, storage.join(root, "global_step_2")),
                                                 (3, storage.join(root, "iter_0000003"))]
    for number in (1, 2, 3, 7):
        found = discover_step(root, number, "")
        assert found == next((s for s in listed if s.step == number), None)


@pytest.mark.parametrize("text, step", [("40\n", 40), (" 7 ", 7), ("", None), ("4x", None), ("\u0661", None),
                                        ("\uff14\uff10", None)])
def test_a_tracker_file_holds_an_ascii_step_number(text, step):
    from merge_engine.layouts.tracker import parse_tracker

    assert parse_tracker(text) == step
