"""The Hugging Face folder layout's index checks (issue 9, case 11).

Specification: an index whose ``weight_map`` is not a non-empty object (a list, a string, absent),
or that is not JSON, or JSON nested too deeply, is `CorruptShard` naming the index file — never an
AttributeError or RecursionError traceback; a good index still opens.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from merge_engine.errors import CorruptShard
from merge_engine.layouts import check_checkpoint

INDEX = "model.safetensors.index.json"


def _folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({"a": torch.ones(2)}, str(folder / "model-00001-of-00001.safetensors"))
    return folder


@pytest.mark.parametrize("index", [
    {"weight_map": ["a", "model-00001-of-00001.safetensors"]},
    {"weight_map": "model-00001-of-00001.safetensors"},
    {"weight_map": {}},
    {"metadata": {}},
    [1, 2],
    "[" * 100_000 + "]" * 100_000,
    "{not json",
], ids=["list", "string", "empty", "absent", "not-an-object", "nested", "not-json"])
def test_an_unusable_index_is_a_named_error(tmp_path, index):
    folder = _folder(tmp_path)
    (folder / INDEX).write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(CorruptShard) as info:
        check_checkpoint(str(folder))
    assert info.value.path == str(folder / INDEX)


def test_a_good_index_opens(tmp_path):
    folder = _folder(tmp_path)
    (folder / INDEX).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    assert check_checkpoint(str(folder)).layout == "hf"
