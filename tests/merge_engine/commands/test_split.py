"""``stepmerge split --to megatron``: Hugging Face -> Megatron shards with the same family tables.

Specification (issue 3, point 3), on the reference Hugging Face models of the real fixtures:
- HF -> Megatron -> HF (stepmerge's own merge) is bit-exact, for legacy and dist output, TP x PP
  up to 2 x 2, VPP 2, EP 2, TP > KV heads, tied (PP > 1: the last stage gets its copy) and untied,
  dense and MoE (shared experts too);
- the split loads back into megatron-core (strict load, gloo on CPU) and gives the reference
  megatron-core logits;
- what it writes is what megatron-core itself writes: the legacy rank files hold the same keys and
  tensors as the fixture's, and the torch_dist folder the same global tensors and entries (torch's
  own DCP reader), padding rows aside (Megatron's are random, ours zero);
- ``transformer_config.json`` carries the values the Megatron model must be built with;
- impossible sizes are refused before anything is written; a second identical split is a no-op;
- the legacy writer builds and saves one rank file at a time: while a rank file is saved, the
  tensors alive are that rank's share of the stage, not every TP rank's pieces.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os

import pytest
import torch

from merge_engine.cli import main
from merge_engine.errors import InvalidOption, TargetExists
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from merge_engine.commands.split import split_hf_to_megatron
from merge_engine.formats.torch_archive import TorchArchive
from synthetic_runs.megatron import (
    REFERENCE_HF_DIR,
    REFERENCE_INPUT_IDS_FILE,
    REFERENCE_LOGITS_FILE,
    LogitsJob,
    megatron_forward_logits_many,
)
from tests.merge_engine.layouts.test_megatron_merge import _tensors

# fixture whose reference model is split -> split options (all fit one gloo world of 4)
CASES = {
    "llama_tp1_pp1_legacy": OutputOptions(tp=2, pp=2),
    "qwen3_tp2_kv1_legacy": OutputOptions(tp=2, pp=2, vpp=2, format="dist"),
    "qwen2_tp2_pp1_tied_legacy": OutputOptions(tp=2, pp=2),
    "mixtral_ep2_legacy": OutputOptions(tp=2, ep=2, format="dist"),
    "qwen2_moe_ep2_dist_v2": OutputOptions(pp=2, ep=2),
    "qwen3_moe_tp2_ep2_legacy": OutputOptions(tp=2, ep=2),
    "mistral_tp1_pp2_legacy": OutputOptions(format="dist"),
    # mixed dense / MoE: per-layer torch_dist keys; DeepSeek-V3 (MLA) both ways
    "qwen3_moe_dense0_pp2_ep2_dist_v1": OutputOptions(tp=2, ep=2, format="dist"),
    "qwen2_moe_mixed_tp2_ep2_te_legacy": OutputOptions(pp=2, ep=2),
    "deepseek_v3_pp2_ep2_dist_v2": OutputOptions(ep=4),
    "deepseek_v3_ep2_legacy": OutputOptions(pp=2, ep=2, format="dist"),
    "deepseek_v3_tp2_pp2_dist_v1": OutputOptions(tp=2, pp=2),  # MLA down-projections cut in TP row pieces
    "glm4_moe_tp2_ep2_dist_v1": OutputOptions(pp=2, ep=2),
}


def _reference_hf(job) -> str:
    return str(job.reference_dir / REFERENCE_HF_DIR)


@pytest.fixture(scope="module")
def splits(megatron_runs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("splits")
    out = {}
    for name, options in CASES.items():
        out[name] = str(root / name)
        split_hf_to_megatron(_reference_hf(megatron_runs[name]), out[name], options)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_hf_to_megatron_to_hf_is_bit_exact(megatron_runs, splits, tmp_path, name):
    merged = tmp_path / "merged"
    result = merge_checkpoint(splits[name], str(merged), OutputOptions(backend="megatron"))
    assert result.layout == ("megatron_dist" if CASES[name].format == "dist" else "megatron_legacy")
    reference = _tensors(_reference_hf(megatron_runs[name]))
    ours = _tensors(str(merged))
    assert set(ours) == set(reference)
    assert all(torch.equal(ours[k], v) for k, v in reference.items())


def test_splits_load_into_megatron_core_and_give_its_logits(megatron_runs, splits):
    """One gloo world loads every split strictly (legacy or torch_dist reader) and runs the forward."""
    jobs = []
    for name, options in CASES.items():
        job = megatron_runs[name]
        # the reference Hugging Face models have no MTP layers: the split neither (DeepSeek fixtures have one)
        spec = dataclasses.replace(job.spec, tp=options.tp, pp=options.pp, vpp=options.vpp, ep=options.ep,
                                   fmt="legacy" if options.format == "legacy" else "dist_v1", mtp_layers=0)
        ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
        jobs.append(LogitsJob(splits[name], spec, ids))
    logits = megatron_forward_logits_many(jobs, world_size=4)
    for name, got in zip(CASES, logits):
        expected = torch.load(megatron_runs[name].reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
        assert (got - expected).abs().max().item() < 1e-4, name


def test_legacy_files_are_what_megatron_core_writes(megatron_runs, tmp_path):
    """Same rank folders, same keys (extra states included), same tensors as megatron-core's files."""
    job = megatron_runs["mistral_tp1_pp2_legacy"]
    split_hf_to_megatron(_reference_hf(job), str(tmp_path / "split"), OutputOptions(pp=2))
    theirs_root = job.step_dir / "actor" / "model"
    ours_root = tmp_path / "split" / "model"
    assert sorted(os.listdir(ours_root)) == sorted(os.listdir(theirs_root))
    for folder in os.listdir(theirs_root):
        theirs = TorchArchive(str(theirs_root / folder / "model.pt")).load()
        ours = TorchArchive(str(ours_root / folder / "model.pt")).load()
        assert len(ours) == len(theirs) == 1
        assert set(ours[0]) == set(theirs[0])
        for key, value in theirs[0].items():
            if value is None:
                assert ours[0][key] is None
                continue
            mine, reference = ours[0][key].read(), value.read()
            if key.endswith(("word_embeddings.weight", "output_layer.weight")):  # padding: random vs zero
                mine, reference = mine[:1003], reference[:1003]
            assert torch.equal(mine, reference), key


def test_dist_folder_is_what_megatron_core_writes(megatron_runs, tmp_path):
    """torch's own DCP reader sees the same entries and global tensors as in megatron-core's save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    job = megatron_runs["llama_tp1_pp1_dist_v1"]
    split_hf_to_megatron(_reference_hf(job), str(tmp_path / "split"), OutputOptions(format="dist"))
    theirs = FileSystemReader(str(job.step_dir / "actor" / "dist_ckpt"))
    ours = FileSystemReader(str(tmp_path / "split" / "dist_ckpt"))
    their_meta, our_meta = theirs.read_metadata(), ours.read_metadata()  # our own files: trusted pickles
    their_keys = {k for k in their_meta.state_dict_metadata if not k.startswith("rng_state")}
    assert set(our_meta.state_dict_metadata) == their_keys
    tensors = {k: v for k, v in their_meta.state_dict_metadata.items() if hasattr(v, "chunks")}
    loaded = {}
    for name, reader in (("theirs", theirs), ("ours", ours)):
        state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in tensors.items()}
        dcp.load(state, storage_reader=reader, no_dist=True)
        loaded[name] = state
    for key in tensors:
        a, b = loaded["ours"][key], loaded["theirs"][key]
        if key.endswith(("word_embeddings.weight", "output_layer.weight")):
            a, b = a[:1003], b[:1003]
        assert torch.equal(a, b), key


def _transformer_config(folder: str) -> dict:
    with open(os.path.join(folder, "transformer_config.json")) as f:
        return json.load(f)


def test_transformer_config_values(megatron_runs, splits):
    """Norm epsilon, RoPE theta, KV heads, head dim, padded vocabulary, MoE sizes: what TransformerConfig needs."""
    qwen3 = _transformer_config(splits["qwen3_tp2_kv1_legacy"])
    assert qwen3["num_query_groups"] == 1 and qwen3["kv_channels"] == 32 and qwen3["qk_layernorm"]
    assert qwen3["layernorm_epsilon"] == 1e-6 and qwen3["rotary_base"] == 1_000_000.0
    assert qwen3["padded_vocab_size"] == 1024 and qwen3["tensor_model_parallel_size"] == 2
    assert qwen3["virtual_pipeline_model_parallel_size"] == 2
    llama = _transformer_config(splits["llama_tp1_pp1_legacy"])
    assert llama["layernorm_epsilon"] == 1e-5 and llama["rotary_base"] == 500_000.0 and llama["gated_linear_unit"]
    moe = _transformer_config(splits["qwen2_moe_ep2_dist_v2"])
    assert moe["num_moe_experts"] == 4 and moe["moe_ffn_hidden_size"] == 48
    assert moe["moe_shared_expert_intermediate_size"] == 64 and moe["add_qkv_bias"]
    tied = _transformer_config(splits["qwen2_tp2_pp1_tied_legacy"])
    assert tied["share_embeddings_and_output_weights"] is True


@pytest.mark.parametrize("options,match", [
    (OutputOptions(tp=3), "heads do not split over TP=3"),
    (OutputOptions(pp=3), "do not split into pp x vpp"),
    (OutputOptions(ep=2), "experts do not split"),
    (OutputOptions(pp=2, vpp=3), "do not split into pp x vpp"),
    (OutputOptions(vpp=2), "--vpp needs"),
])
def test_impossible_sizes_are_refused_before_writing(megatron_runs, tmp_path, options, match):
    target = tmp_path / "target"
    with pytest.raises(InvalidOption, match=match):
        split_hf_to_megatron(_reference_hf(megatron_runs["llama_tp1_pp1_legacy"]), str(target), options)
    assert not target.exists()


def test_cli_split_then_merge_and_rerun(megatron_runs, tmp_path, capsys):
    hf = _reference_hf(megatron_runs["qwen2_tp2_pp1_tied_legacy"])
    target = str(tmp_path / "megatron")
    args = ["split", "--to", "megatron", "--tp", "2", "--pp", "2", "--format", "dist", "--hf-dir", hf,
            "--target-dir", target, "--workers", "2"]
    assert main(args) == 0
    assert "split" in capsys.readouterr().out
    assert main(args) == 0
    assert "already holds this split" in capsys.readouterr().out
    with pytest.raises(TargetExists):
        split_hf_to_megatron(hf, target, OutputOptions(tp=1, format="dist"))
    assert main(["merge", "--backend", "megatron", "--local_dir", target, "--target_dir", str(tmp_path / "hf"),
                 "--tie-word-embedding"]) == 0
    reference, ours = _tensors(hf), _tensors(str(tmp_path / "hf"))
    assert set(ours) == set(reference) and all(torch.equal(ours[k], v) for k, v in reference.items())


def test_an_edited_custom_mapping_is_other_input_not_the_same_split(megatron_runs, tmp_path, capsys):
    """The mapping's content decides the split, as it decides a merge: the same URL with other bytes is not
    "already holds this split" (which would keep a split made from the old table), but a target holding other
    input."""
    hf = _reference_hf(megatron_runs["qwen2_tp2_pp1_tied_legacy"])
    mapping = tmp_path / "mapping.json"
    mapping.write_text(json.dumps({"extends": "qwen2", "model_types": ["qwen2"], "direct": {}}))
    args = ["split", "--to", "megatron", "--format", "dist", "--hf-dir", hf, "--target-dir",
            str(tmp_path / "megatron"), "--custom-mapping", str(mapping)]
    assert main(args) == 0
    assert main(args) == 0
    assert "already holds this split" in capsys.readouterr().out
    mapping.write_text(json.dumps({"extends": "qwen2", "model_types": ["qwen2"], "direct": {}}, indent=2))
    assert main(args) != 0
    assert "already holds" not in capsys.readouterr().out


def _live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages behind every live tensor."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_legacy_writer_holds_one_rank_file_at_a_time(megatron_runs, tmp_path, monkeypatch):
    """TP 2, PP 1 (a rank file is half of every tensor), one worker: while each rank file is saved, the
    live tensors are about that rank's half of the model (plus the one tensor being cut), not both
    ranks' pieces (the whole model) at once. (A rank file is one job: ``--workers N`` holds N of them.)"""
    hf = _reference_hf(megatron_runs["llama_tp1_pp1_legacy"])
    model_bytes = sum(t.numel() * t.element_size() for t in _tensors(hf).values())
    baseline = _live_tensor_bytes()
    held = []
    real_save = torch.save

    def measuring_save(obj, f, *args, **kwargs):
        held.append(_live_tensor_bytes() - baseline)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", measuring_save)
    split_hf_to_megatron(hf, str(tmp_path / "split"), OutputOptions(tp=2, workers=1))
    monkeypatch.undo()
    assert len(held) == 2
    assert max(held) < 0.7 * model_bytes, (held, model_bytes)
    merged = tmp_path / "merged"
    merge_checkpoint(str(tmp_path / "split"), str(merged), OutputOptions(backend="megatron"))
    reference, ours = _tensors(hf), _tensors(str(merged))
    assert set(ours) == set(reference) and all(torch.equal(ours[k], v) for k, v in reference.items())
