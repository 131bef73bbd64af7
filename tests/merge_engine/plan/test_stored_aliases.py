"""Output bounded by input (issue 17 point 4): names sharing one stored tensor are refused unless the
config ties them.

Specification:
- a rank file holding 200 names over one 4 MB storage (4 MB on disk; 800 MB if each name were
  written) is `AliasedTensors` naming the rank file, and nothing is written;
- an input embedding and output head stored once under both names merge when the config ties them
  (the tied FSDP2 fixture of `test_merge` does; the head is then not written) but are `AliasedTensors`
  when config.json says ``tie_word_embeddings: false``;
- `AssembledSource.alias_groups` finds the groups from metadata alone.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from merge_engine.errors import AliasedTensors
from merge_engine.layouts import check_checkpoint, open_checkpoint
from merge_engine.commands.merge import merge_checkpoint

VARIANT = "single_qwen2"
RANK_FILE = "model_world_size_1_rank_0.pt"
ALIASES = 200


def _copy(fsdp_runs, tmp_path):
    source = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, source)
    return source, torch.load(source / RANK_FILE, weights_only=True)


def _amplified(fsdp_runs, tmp_path):
    source, state = _copy(fsdp_runs, tmp_path)
    shared = torch.randn(1024, 1024)  # 4 MB
    for i in range(ALIASES):
        state[f"model.layers.0.mlp.alias_{i}.weight"] = shared
    torch.save(state, source / RANK_FILE)
    assert os.path.getsize(source / RANK_FILE) < 6 * 1024 * 1024
    return source


def test_alias_groups_are_found_from_metadata(fsdp_runs, tmp_path):
    source = open_checkpoint(check_checkpoint(str(_amplified(fsdp_runs, tmp_path))))
    try:
        groups = source.alias_groups()
    finally:
        source.close()
    assert len(groups) == 1
    assert len(groups[0].names) == ALIASES and groups[0].nbytes == 4 * 1024 * 1024
    assert groups[0].url.endswith(RANK_FILE)


def test_two_hundred_names_on_one_storage_are_refused_and_nothing_is_written(fsdp_runs, tmp_path):
    source = _amplified(fsdp_runs, tmp_path)
    target = tmp_path / "merged"
    with pytest.raises(AliasedTensors) as caught:
        merge_checkpoint(str(source), str(target))
    assert caught.value.path == str(source / RANK_FILE)
    assert f"{ALIASES} times" in caught.value.message
    assert not target.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".merged")]


def test_an_embedding_shared_with_the_head_under_an_untied_config_is_refused(fsdp_runs, tmp_path):
    source, state = _copy(fsdp_runs, tmp_path)
    config = json.loads((source / "huggingface" / "config.json").read_text())
    assert config.get("tie_word_embeddings") is False
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    torch.save(state, source / RANK_FILE)
    with pytest.raises(AliasedTensors) as caught:
        merge_checkpoint(str(source), str(tmp_path / "merged"))
    assert "tie_word_embeddings=false" in caught.value.message
    assert not (tmp_path / "merged").exists()


def test_the_same_pair_merges_once_the_config_ties_it(fsdp_runs, tmp_path):
    source, state = _copy(fsdp_runs, tmp_path)
    config_path = source / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = True
    config_path.write_text(json.dumps(config))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    torch.save(state, source / RANK_FILE)
    result = merge_checkpoint(str(source), str(tmp_path / "merged"))
    assert result.tensors == len(state) - 1  # the tied head is not written
