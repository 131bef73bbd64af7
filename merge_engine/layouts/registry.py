"""THE registry of on-disk checkpoint formats: every `merge_engine.layouts.contract.Layout` record, listed once.

`LAYOUTS` is in priority order: the first layout that detects a listing reads it, and discovery's primary
layout is the first present. `BY_NAME` finds a record by its name; `ALIASES` are backend names that stand for
several layouts (verl's ``--backend megatron``), tried in their order. Adding a format is one module that builds
its ``LAYOUT`` plus one entry here. Importing the registry imports no torch (each layout module imports its
readers inside its functions).
"""

from __future__ import annotations

from merge_engine.layouts import (dcp_hf, dcp_model, deepspeed_zero, fsdp, hf, megatron_bridge, megatron_dist,
                                   megatron_legacy, megatron_lora, torchtitan)
from merge_engine.layouts.contract import Layout

__all__ = ["ALIASES", "BY_NAME", "LAYOUTS"]

LAYOUTS: tuple[Layout, ...] = (
    fsdp.LAYOUT,
    megatron_legacy.LAYOUT,
    megatron_lora.LAYOUT,     # before megatron_bridge and megatron_dist: a LoRA step's PEFT export
    megatron_bridge.LAYOUT,   # before megatron_dist: when both are there, the Hugging Face weights are read
    dcp_model.LAYOUT,         # before megatron_dist, which it leaves every folder with Megatron's files
    torchtitan.LAYOUT,        # detects nothing: it refines torch_dcp's check
    megatron_dist.LAYOUT,
    dcp_hf.LAYOUT,            # before hf, which would take the folder for one missing its index
    deepspeed_zero.LAYOUT,    # before hf, which HF Trainer's checkpoint-N/ also is
    hf.LAYOUT,
)
BY_NAME: dict[str, Layout] = {layout.name: layout for layout in LAYOUTS}
ALIASES: dict[str, tuple[str, ...]] = {
    "megatron": ("megatron_legacy", "megatron_lora", "megatron_bridge", "megatron_dist"),
    "megatron_lm": ("megatron_legacy", "megatron_dist"),  # an accepted spelling: Megatron-LM's own files
}
assert len(BY_NAME) == len(LAYOUTS), "two layouts share a name"
assert all(layout.refines in BY_NAME for layout in LAYOUTS if layout.refines is not None), "refines an unknown layout"
