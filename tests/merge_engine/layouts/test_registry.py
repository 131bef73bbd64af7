"""The layout registry: every format is one typed `Layout` record, listed once, its hooks named fields.

A layout module builds its ``LAYOUT``; `merge_engine.layouts.registry.LAYOUTS` lists them all; nothing finds a hook
by probing a module's attributes, and no layout names a command (the commands look theirs up by layout name).
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib

import pytest

from merge_engine.layouts import BY_NAME, LAYOUTS, contract, registry
from merge_engine.layouts.contract import HF_NAMES, Layout

LAYOUTS_DIR = pathlib.Path(registry.__file__).parent


def modules_with_a_layout() -> list[str]:
    """The modules under merge_engine/layouts/ that build a `Layout` record (``LAYOUT``)."""
    found = []
    for path in sorted(LAYOUTS_DIR.glob("*.py")):
        module = importlib.import_module(f"merge_engine.layouts.{path.stem}" if path.stem != "__init__"
                                         else "merge_engine.layouts")
        if isinstance(getattr(module, "LAYOUT", None), Layout):
            found.append(module.__name__)
    return found


def test_every_layout_is_a_frozen_record_listed_once():
    assert all(isinstance(layout, Layout) for layout in LAYOUTS)
    assert [layout.name for layout in LAYOUTS] == list(BY_NAME)
    assert len(modules_with_a_layout()) == len(LAYOUTS)  # a module building a record the registry forgot fails here
    with pytest.raises(dataclasses.FrozenInstanceError):
        LAYOUTS[0].name = "other"  # type: ignore[misc]


def test_the_hooks_are_fields_and_no_module_keeps_the_old_attributes():
    hooks = {layout.name: (layout.refines, layout.refine is not None, layout.second_look is not None,
                           layout.writer is not None) for layout in LAYOUTS}
    assert hooks == {
        "fsdp": (None, False, False, False), "megatron_legacy": (None, False, False, True),
        "megatron_lora": ("megatron_dist", True, True, False), "megatron_bridge": (None, False, False, False),
        "torch_dcp": (None, False, True, False), "torchtitan": ("torch_dcp", True, False, False),
        "megatron_dist": (None, False, False, True), "dcp_hf": (None, False, False, False),
        "deepspeed_zero": (None, False, True, False), "hf": (None, False, False, False)}
    for name in modules_with_a_layout():
        module = importlib.import_module(name)
        assert not {"REFINES", "JOBS"} & set(vars(module)), name


def test_a_record_refuses_half_a_refinement_and_an_unknown_naming():
    parts = dict(name="x", tensor_naming=HF_NAMES, detect=lambda files: False, listing_verdict=lambda files: None,
                 check_complete=lambda url, files: None, open=lambda checkpoint: None)
    Layout(**parts)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="refines and refine"):
        Layout(**parts, refines="torch_dcp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_naming"):
        Layout(**{**parts, "tensor_naming": "neither"})  # type: ignore[arg-type]


def test_the_commands_name_their_jobs_by_registered_layouts():
    from merge_engine.commands import layout_jobs

    assert set(layout_jobs.JOBS) == {"megatron_lora", "torchtitan"}
    assert set(layout_jobs.JOBS) <= set(BY_NAME)
    for name, load in layout_jobs.JOBS.items():
        jobs = load()
        assert all(callable(getattr(jobs, hook)) for hook in ("prepare_merge", "prepare_extract")), name


def test_the_contract_holds_no_protocol():
    assert "Protocol" not in vars(contract)
