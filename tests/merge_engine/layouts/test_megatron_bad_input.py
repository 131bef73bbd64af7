"""Broken or contradictory Megatron checkpoints give named errors, and nothing at the target.

Specification (issue 3, point 7), each on a copy of a real fixture with one thing wrong:
- a missing rank directory (a TP rank in the middle, the highest TP rank, a whole pipeline stage),
  an empty or truncated rank file -> `IncompleteCheckpoint` / `WorldSizeMismatch` / `CorruptShard`
  naming the folder or file;
- Megatron-LM ``args`` whose TP size contradicts the folders -> `WorldSizeMismatch`;
- torch_dist: a data file missing or truncated, ``.metadata`` missing, the v2 marker missing ->
  `IncompleteCheckpoint`; a dist_ckpt holding only RNG / optimizer state (a bridge run whose
  Hugging Face weights are gone, or ``extra/dist_ckpt`` itself) -> an error saying there are no
  model weights;
- a table that leaves a tensor unmapped (a config of another family) or maps one twice (a custom
  mapping) -> `MappingError` naming the tensor; an unknown architecture -> `UnknownArchitecture`;
- ``--tie-word-embedding`` contradicting config.json -> `InvalidOption`; a config claiming tied
  embeddings for an untied model -> `InvalidConfig` (the output layer differs from the embedding);
- in every case the target does not exist afterwards and the CLI exits non-zero with one line.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from merge_engine.architectures import FAMILY_MODULES
from merge_engine.cli import main
from merge_engine.errors import (
    CorruptShard,
    IncompleteCheckpoint,
    InvalidConfig,
    InvalidOption,
    MappingError,
    UnknownArchitecture,
    WorldSizeMismatch,
)
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.layouts.test_megatron_merge import checkpoint_url, hf_model_path


def _copy(megatron_runs, name, tmp_path):
    """A private copy of the fixture's run: (step job with paths into the copy, checkpoint URL)."""
    job = megatron_runs[name]
    run = tmp_path / name
    shutil.copytree(job.step_dir.parent, run)
    step = run / job.step_dir.name
    copied = type(job)(step, job.spec, job.seed, job.reference_dir)
    return copied, checkpoint_url(copied)


def _merge_fails(url, tmp_path, error, match, **options):
    target = tmp_path / "target"
    with pytest.raises(error, match=match) as info:
        merge_checkpoint(url, str(target), OutputOptions(backend="megatron", **options))
    assert not target.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".target")]  # no temp folder left
    return info.value


# ---- per-rank layouts ----------------------------------------------------------------------------


def test_missing_tp_rank_folder_in_the_grid(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "llama_tp2_pp2_te_legacy", tmp_path)
    shutil.rmtree(job.step_dir / "actor" / "model" / "mp_rank_00_001")
    error = _merge_fails(url, tmp_path, IncompleteCheckpoint, "rank folder missing")
    assert error.path.endswith("mp_rank_00_001")


def test_missing_highest_tp_rank_is_caught_against_the_config(megatron_runs, tmp_path):
    """Names alone cannot show the last TP rank is gone; the config's shapes can."""
    job, url = _copy(megatron_runs, "qwen2_tp2_pp1_tied_legacy", tmp_path)
    shutil.rmtree(job.step_dir / "actor" / "model" / "mp_rank_01")
    _merge_fails(url, tmp_path, WorldSizeMismatch, "give TP=1, the weights need TP=2")


def test_missing_pipeline_stage(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "mistral_tp1_pp2_legacy", tmp_path)
    shutil.rmtree(job.step_dir / "actor" / "model" / "mp_rank_00_001")
    _merge_fails(url, tmp_path, IncompleteCheckpoint, "no second stage")


def test_missing_last_stage_of_three(megatron_runs, tmp_path):
    """PP=2 + EP=2 with the whole last stage gone: the remaining stage holds no final norm."""
    job, url = _copy(megatron_runs, "qwen2_moe_pp2_ep2_te_legacy", tmp_path)
    for folder in ("mp_rank_00_001_000", "mp_rank_00_001_001"):
        shutil.rmtree(job.step_dir / "actor" / "model" / folder)
    _merge_fails(url, tmp_path, IncompleteCheckpoint, "holds no decoder.final_layernorm.weight")


def test_empty_and_truncated_rank_files(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    rank_file = job.step_dir / "actor" / "model" / "mp_rank_00" / "model.pt"
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[: len(data) // 2])
    _merge_fails(url, tmp_path, CorruptShard, "truncated|not a readable")
    rank_file.write_bytes(b"")
    _merge_fails(url, tmp_path, IncompleteCheckpoint, "empty")


def test_megatron_lm_args_contradicting_the_folders(megatron_runs, tmp_path):
    """args.tensor_model_parallel_size=2 but only mp_rank_00_* folders."""
    import argparse

    import numpy as np
    from numpy._core.multiarray import _reconstruct

    job, url = _copy(megatron_runs, "qwen2_pp2_vpp2_tied_megatron_lm", tmp_path)
    rank_file = job.step_dir / "mp_rank_00_000" / "model_optim_rng.pt"
    allowed = [argparse.Namespace, _reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
    with torch.serialization.safe_globals(allowed):
        payload = torch.load(rank_file, weights_only=True)
    payload["args"].tensor_model_parallel_size = 2
    torch.save(payload, rank_file)
    error = _merge_fails(url, tmp_path, WorldSizeMismatch, "args say tp=2, the rank folders give tp=1",
                         hf_model_path=hf_model_path(job))
    assert "mp_rank_00_000" in error.path


# ---- torch_dist ----------------------------------------------------------------------------------


def test_missing_and_truncated_distcp_files(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "mixtral_tp2_megatron_lm_dist", tmp_path)
    data_file = job.step_dir / "__1_0.distcp"
    data = data_file.read_bytes()
    data_file.unlink()
    error = _merge_fails(url, tmp_path, IncompleteCheckpoint, "missing", hf_model_path=hf_model_path(job))
    assert error.path.endswith("__1_0.distcp")
    data_file.write_bytes(data[:-100])
    _merge_fails(url, tmp_path, IncompleteCheckpoint, "truncated", hf_model_path=hf_model_path(job))


def test_missing_metadata_and_missing_v2_marker(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "qwen2_moe_ep2_dist_v2", tmp_path)
    (job.step_dir / "actor" / "ckpt_contents.json").unlink()
    _merge_fails(url, tmp_path, IncompleteCheckpoint, "ckpt_contents.json")
    job, url = _copy(megatron_runs, "llama_tp1_pp1_dist_v1", tmp_path)
    (job.step_dir / "actor" / "dist_ckpt" / ".metadata").unlink()
    _merge_fails(url, tmp_path, IncompleteCheckpoint, r"\.metadata missing")


def test_bridge_run_without_its_weights_says_so(megatron_runs, tmp_path):
    """verl v2 with a bridge: only extra/dist_ckpt (RNG) is Megatron state; with the Hugging Face
    weights gone there is nothing to merge, and the error says why in plain words."""
    job, url = _copy(megatron_runs, "qwen2_tp2_pp2_bridge_v2", tmp_path)
    for path in (job.step_dir / "actor" / "model" / "huggingface").glob("model*"):
        path.unlink()
    _merge_fails(url, tmp_path, IncompleteCheckpoint, "no model weights here: only extra/dist_ckpt")


def test_dist_ckpt_of_rng_state_only(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "mistral_tp2_pp2_tied_dist_v2", tmp_path)
    _merge_fails(str(job.step_dir / "actor" / "extra" / "dist_ckpt"), tmp_path, IncompleteCheckpoint,
                 "holds no model weights, only rng_state")


def test_bridge_export_missing_a_tensor(megatron_runs, tmp_path):
    """The index and headers agree, but a layer's tensor the config implies is not in the export."""
    job, url = _copy(megatron_runs, "qwen2_tp2_pp2_bridge_v2", tmp_path)
    hf = job.step_dir / "actor" / "model" / "huggingface"
    index_file = hf / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    from safetensors.torch import load_file, save_file

    victim = "model.layers.3.mlp.down_proj.weight"
    shard = hf / index["weight_map"].pop(victim)
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    _merge_fails(url, tmp_path, IncompleteCheckpoint, "model.layers.3.mlp.down_proj.weight")


# ---- tables and configs --------------------------------------------------------------------------


def test_config_of_another_family_leaves_a_tensor_unmapped(megatron_runs, tmp_path):
    """A Qwen3 checkpoint with a Qwen2 config: q_layernorm has no place in the qwen2 table."""
    job, url = _copy(megatron_runs, "qwen3_tp2_kv1_legacy", tmp_path)
    qwen2 = str(megatron_runs["qwen2_tp2_pp1_tied_legacy"].reference_dir / "hf")
    _merge_fails(url, tmp_path, MappingError, "q_layernorm", hf_model_path=qwen2)


def test_custom_mapping_claiming_a_tensor_twice(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"direct": {"decoder.layers.0.input_layernorm.weight": "model.extra_norm.weight"}}))
    _merge_fails(url, tmp_path, MappingError, "claimed by two entries", custom_mapping=str(mapping))


def test_unknown_architecture(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    config_file = job.step_dir / "actor" / "hf_config_and_tokenizer" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(model_type="falcon", architectures=["FalconForCausalLM"])
    config_file.write_text(json.dumps(config))
    error = _merge_fails(url, tmp_path, UnknownArchitecture, "supported families: ")
    assert all(family in error.message for family in FAMILY_MODULES)


def test_tie_flag_contradicting_the_config(megatron_runs, tmp_path):
    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    _merge_fails(url, tmp_path, InvalidOption, "contradicts config.json", tie_word_embedding=True)


def test_config_claiming_tied_embeddings_for_an_untied_model(megatron_runs, tmp_path):
    """verl's bug (dropping an untied lm_head) cannot happen: the output layer is compared first."""
    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    config_file = job.step_dir / "actor" / "hf_config_and_tokenizer" / "config.json"
    config = json.loads(config_file.read_text())
    config["tie_word_embeddings"] = True
    config_file.write_text(json.dumps(config))
    _merge_fails(url, tmp_path, InvalidConfig, "differs from embedding")


def test_cli_reports_one_line_and_exits_non_zero(megatron_runs, tmp_path, capsys):
    job, url = _copy(megatron_runs, "llama_tp2_pp2_te_legacy", tmp_path)
    shutil.rmtree(job.step_dir / "actor" / "model" / "mp_rank_01_000")
    code = main(["merge", "--backend", "megatron", "--local_dir", url, "--target_dir", str(tmp_path / "target")])
    assert code == IncompleteCheckpoint.exit_code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stepmerge: error: IncompleteCheckpoint:") and "mp_rank_01_000" in err[0]
    assert main(["check", "--backend", "megatron", "--local_dir", url]) == IncompleteCheckpoint.exit_code


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_rank_file_asking_for_code_is_refused_unrun(megatron_runs, tmp_path):
    """Megatron-LM's args and numpy RNG state are read as inert records; any other global is refused."""
    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    rank_file = job.step_dir / "actor" / "model" / "mp_rank_00" / "model.pt"
    marker = tmp_path / "pwned"
    torch.save({"model": {"w": torch.zeros(1)}, "args": _RunsCode(str(marker))}, rank_file)
    from merge_engine.errors import UnsafePickle

    _merge_fails(url, tmp_path, UnsafePickle, "not on the allow-list")
    assert not marker.exists()


# ---- issue 9, case 14: adversarial rank files and metadata ------------------------------------------


def _megatron_lm_payload(rank_file):
    import argparse

    import numpy as np
    from numpy._core.multiarray import _reconstruct

    allowed = [argparse.Namespace, _reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(rank_file, weights_only=True)


@pytest.mark.parametrize("value", ["two", [2], 2.5, -1])
def test_megatron_lm_args_that_are_not_sizes_are_corrupt_not_a_crash(megatron_runs, tmp_path, value):
    """The pickled args say anything a file can say: ``"two"`` was a ValueError traceback."""
    job, url = _copy(megatron_runs, "qwen2_pp2_vpp2_tied_megatron_lm", tmp_path)
    rank_file = job.step_dir / "mp_rank_00_000" / "model_optim_rng.pt"
    payload = _megatron_lm_payload(rank_file)
    payload["args"].pipeline_model_parallel_size = value
    torch.save(payload, rank_file)
    error = _merge_fails(url, tmp_path, CorruptShard, "not a parallel size", hf_model_path=hf_model_path(job))
    assert error.path.endswith("mp_rank_00_000/model_optim_rng.pt")


def test_a_legacy_rank_file_cannot_inflate_a_tensor_with_zero_strides(megatron_runs, tmp_path, capsys):
    """Case 5 on the Megatron reader: one stored element viewed as the final norm's whole vector (and a
    4000 x 4000 extra) is refused by ``check`` and ``merge``, naming the rank file."""
    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    rank_file = job.step_dir / "actor" / "model" / "mp_rank_00" / "model.pt"
    states = torch.load(rank_file, weights_only=False)
    state = states[0] if isinstance(states, list) else states["model"]
    norm = state["decoder.final_layernorm.weight"]
    state["decoder.final_layernorm.weight"] = torch.ones(1, dtype=norm.dtype).expand(norm.shape)
    torch.save(states, rank_file)
    assert main(["check", "--local_dir", url]) == 4
    assert "reaches some stored elements more than once" in capsys.readouterr().err
    error = _merge_fails(url, tmp_path, CorruptShard, "more than once")
    assert error.path == str(rank_file)


def test_a_lying_dist_checkpoint_metadata_is_refused_by_check(megatron_runs, tmp_path, capsys):
    """Case 14 on the torch_dist reader: ``.metadata`` pointing two chunks at one item of the data
    file (one stored chunk standing for two) is refused by ``check``, naming ``.metadata``."""
    import pickle

    job, url = _copy(megatron_runs, "mixtral_tp2_megatron_lm_dist", tmp_path)
    (metadata_file,) = [p for p in job.step_dir.rglob(".metadata") if "optimizer" not in str(p)
                        and "extra" not in str(p)]
    metadata = pickle.loads(metadata_file.read_bytes())  # our own fixture, trusted
    entries = [(index, info) for index, info in metadata.storage_data.items() if index.offset is not None]
    by_key = {}
    for index, info in entries:
        by_key.setdefault(index.fqn, []).append((index, info))
    (first, info), (second, _) = next(v for v in by_key.values() if len(v) > 1)[:2]
    metadata.storage_data[second] = info
    metadata_file.write_bytes(pickle.dumps(metadata))
    assert main(["check", "--local_dir", url]) == 4
    err = capsys.readouterr().err
    assert "share bytes" in err and str(metadata_file) in err


def test_rank_files_and_metadata_linking_out_of_the_checkpoint_are_refused(megatron_runs, tmp_path, capsys):
    """Case 14, links: a Megatron rank file or a DCP ``.metadata`` that is a link out of the checkpoint
    (here to a valid archive and to /etc/passwd), or a FIFO in its place, is refused by ``check`` and
    ``merge`` with `UnsafeFile` naming it, before any byte is read — never merged, never a hang.
    The rule is `merge_engine.storage.source_files` (h2), applied by `layouts.check_checkpoint`."""
    from merge_engine.errors import UnsafeFile

    job, url = _copy(megatron_runs, "llama_tp1_pp1_legacy", tmp_path)
    rank_file = job.step_dir / "actor" / "model" / "mp_rank_00" / "model.pt"
    outside = tmp_path / "elsewhere.pt"
    shutil.move(rank_file, outside)
    rank_file.symlink_to(outside)
    error = _merge_fails(url, tmp_path, UnsafeFile, "outside the folder")
    assert error.path == str(rank_file)
    assert main(["check", "--local_dir", url]) == 4
    assert "UnsafeFile" in capsys.readouterr().err
    rank_file.unlink()
    os.mkfifo(rank_file)
    _merge_fails(url, tmp_path, UnsafeFile, "FIFO")

    job, url = _copy(megatron_runs, "mixtral_tp2_megatron_lm_dist", tmp_path)
    (metadata_file,) = [p for p in job.step_dir.rglob(".metadata") if "optimizer" not in str(p)
                        and "extra" not in str(p)]
    metadata_file.unlink()
    metadata_file.symlink_to("/etc/passwd")
    assert main(["check", "--local_dir", url]) == 4
    err = capsys.readouterr().err
    assert "UnsafeFile" in err and str(metadata_file) in err
