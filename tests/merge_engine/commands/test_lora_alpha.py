"""The ``lora_alpha`` option in each adapter command's form (`merge_engine.commands.lora_alpha`): one value for a
checkpoint's adapter (merge, extract-lora), one per adapter for merge-lora; the other form is refused by name
before anything is read.

- `one_lora_alpha` gives the value (or None) and refuses a value per adapter (`InvalidOption`);
- `lora_alpha_per_adapter` gives one value (or None) per adapter, refuses a single value (`InvalidOption`) and a
  count that is not the adapters' (`AdapterError`, naming both counts);
"""

from __future__ import annotations

import pytest

from merge_engine.commands.lora_alpha import lora_alpha_per_adapter, one_lora_alpha
from merge_engine.errors import AdapterError, InvalidOption
from merge_engine.output.jobs import OutputOptions


def test_one_value_for_a_checkpoints_adapter():
    assert one_lora_alpha(OutputOptions(lora_alpha=16.0)) == 16.0
    assert one_lora_alpha(OutputOptions()) is None
    with pytest.raises(InvalidOption, match="one lora_alpha is expected"):
        one_lora_alpha(OutputOptions(lora_alpha=(16.0, 8.0)))


def test_one_value_per_adapter_for_merge_lora():
    assert lora_alpha_per_adapter(OutputOptions(lora_alpha=(16.0, 8.0)), 2) == (16.0, 8.0)
    assert lora_alpha_per_adapter(OutputOptions(), 3) == (None, None, None)
    with pytest.raises(InvalidOption, match="one lora_alpha per adapter"):
        lora_alpha_per_adapter(OutputOptions(lora_alpha=16.0), 1)
    with pytest.raises(AdapterError, match="1 --lora-alpha values for 2 adapters"):
        lora_alpha_per_adapter(OutputOptions(lora_alpha=(16.0,)), 2)
