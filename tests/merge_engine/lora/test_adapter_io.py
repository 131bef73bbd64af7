"""Adapter folder I/O: pointing an adapter at the base it will be published beside."""

from __future__ import annotations

import json

from merge_engine import storage
from merge_engine.lora.adapter_io import point_adapter_at_base, write_adapter_config
from merge_engine.lora.keys import ADAPTER_CONFIG


def test_point_adapter_at_base_rewrites_only_the_base_path(tmp_path):
    """The staged adapter names its staged base; after the call it names the released one, every other
    field as it was, written the way the engine writes configs (sorted, indented, newline)."""
    adapter = str(tmp_path / "adapter")
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "base_model_name_or_path": f"{adapter}/base"}
    write_adapter_config(adapter, config)
    released_base = "s3://bucket/releases/actor-adapter/global_step_3/base"

    point_adapter_at_base(adapter, released_base)
    data = storage.read_bytes(storage.join(adapter, ADAPTER_CONFIG))
    assert json.loads(data) == {**config, "base_model_name_or_path": released_base}
    assert data == (json.dumps(json.loads(data), indent=2, sort_keys=True) + "\n").encode()

    before = (tmp_path / "adapter" / ADAPTER_CONFIG).stat().st_mtime_ns
    point_adapter_at_base(adapter, released_base)  # already right: not rewritten
    assert (tmp_path / "adapter" / ADAPTER_CONFIG).stat().st_mtime_ns == before
