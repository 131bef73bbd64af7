"""Specification of the real Megatron fixtures written by ``synthetic_runs.megatron``.

The whole fixture matrix is written once per module by real megatron-core GPTModels in one gloo
world of 4 CPU processes. These tests pin what the Megatron merge tests rely on:
- the matrix covers every layout the issue names (TP x PP, VPP, TP > KV heads, tied, EP, formats);
- the files are laid out as verl / Megatron-LM lay them out, and hold each rank's slice;
- the torch_dist checkpoints read with plain ``torch.distributed.checkpoint``, with no megatron
  import and no process group, and their global tensors are the reference;
- the Hugging Face oracle gives the megatron-core logits, and that check catches a wrong conversion;
- megatron-core loads the files back (strictly) and reproduces its logits (reverse-split helper).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from itertools import product
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from synthetic_runs.megatron import (
    DIST_FORMATS,
    FAMILIES,
    FORMATS,
    RANK_FILE_FORMATS,
    REFERENCE_HF_DIR,
    REFERENCE_INPUT_IDS_FILE,
    REFERENCE_LOGITS_FILE,
    REFERENCE_STATE_FILE,
    LogitsJob,
    MegatronSpec,
    StepJob,
    megatron_fixture_matrix,
    megatron_forward_logits,
    megatron_forward_logits_many,
    model_dir,
    rank_dir_name,
    rank_state_dict,
    reference_dist_global,
    reference_shapes,
    reference_state_dict,
    reference_to_hf,
    te_legacy_names,
)

MATRIX = megatron_fixture_matrix()
RANK_FILE_NAMES = [n for n, s in MATRIX.items() if s.fmt in RANK_FILE_FORMATS]
DIST_NAMES = [n for n, s in MATRIX.items() if s.fmt in DIST_FORMATS]
V2_NAMES = [n for n, s in MATRIX.items() if s.fmt in ("dist_v2", "bridge_v2")]  # + actor/extra/dist_ckpt
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fixtures(megatron_runs) -> dict[str, StepJob]:
    """Every matrix entry, written once per session (tests/fixtures_checkpoints.py)."""
    return megatron_runs


def _load_rank_file(path: Path) -> object:
    """What a reader needs for Megatron-LM files: weights_only plus argparse/numpy RNG globals."""
    import argparse

    import numpy as np
    from numpy._core.multiarray import _reconstruct

    allowed = [argparse.Namespace, _reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


# ---- the matrix and the spec ---------------------------------------------------------------------


def test_matrix_covers_every_layout_the_issue_names() -> None:
    """TP x PP 1x1/2x1/1x2/2x2, VPP 2, TP > KV heads, tied + untied (tied with PP > 1 too), EP 2,
    expert TP, TE names, mixed dense / MoE layers (torch_dist and legacy), every family and every
    format; all fit one world of 4 processes."""
    specs = list(MATRIX.values())
    assert {(s.tp, s.pp) for s in specs} >= {(1, 1), (2, 1), (1, 2), (2, 2)}
    assert any(s.vpp == 2 for s in specs if s.fmt == "legacy")
    assert any(s.vpp == 2 for s in specs if s.fmt.startswith("dist"))
    assert any(s.tp > s.num_kv_heads for s in specs)
    assert {s.tie_word_embeddings for s in specs} == {True, False}
    assert any(s.tie_word_embeddings and s.pp > 1 for s in specs)
    assert any(s.ep == 2 and s.fmt == "legacy" for s in specs)
    assert any(s.ep == 2 and s.fmt.startswith("dist") for s in specs)
    assert any(s.ep == 2 and s.tp == 2 for s in specs)
    assert any(s.legacy_names == "te" for s in specs)
    assert any(s.mixed_layers and s.fmt == "legacy" for s in specs)
    assert any(s.mixed_layers and s.fmt.startswith("dist") for s in specs)
    assert {s.family for s in specs} == set(FAMILIES)
    assert {s.fmt for s in specs} == set(FORMATS)
    assert all(4 % s.world_size == 0 for s in specs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"family": "gpt2"}, "unknown family"),
        ({"fmt": "zarr"}, "fmt must be one of"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_heads": 8, "num_kv_heads": 8, "tp": 1, "pp": 1, "vpp": 2}, "vpp needs"),
        ({"pp": 3}, "num_layers must be a multiple"),
        ({"family": "llama", "ep": 2}, "dense family"),
        ({"family": "mixtral", "num_experts": 3, "ep": 2}, "num_experts must be a multiple of ep"),
        ({"family": "qwen2", "head_dim": 32}, "cannot have head_dim"),
        ({"family": "llama", "shared_expert_size": 8}, "has no shared expert"),
        ({"fmt": "dist_v1", "legacy_names": "te"}, "per-rank files only"),
        ({"family": "qwen3_moe", "moe_layer_freq": (0, 1)}, "one 0 \\(dense\\) or 1"),
        ({"family": "mixtral", "moe_layer_freq": (0, 1, 1, 1)}, "Mixtral has no dense layers"),
        ({"family": "llama", "moe_layer_freq": (0, 1, 1, 1)}, "takes no moe_layer_freq"),
        ({"family": "deepseek_v3", "num_kv_heads": 4, "moe_layer_freq": (1, 0, 1, 1)}, "first ones"),
        ({"family": "deepseek_v3"}, "num_kv_heads must equal num_heads"),
    ],
)
def test_spec_rejects_layouts_megatron_or_transformers_cannot_build(kwargs: dict, message: str) -> None:
    """A spec that megatron-core or transformers would reject fails at construction, by name."""
    with pytest.raises(ValueError, match=message):
        MegatronSpec(**kwargs)


def test_padded_vocab_follows_megatron_lm() -> None:
    """Vocab is padded to a multiple of 128 * TP, as Megatron-LM does; HF keeps vocab_size."""
    assert MegatronSpec(tp=1).padded_vocab_size == 1024
    assert MegatronSpec(tp=2).padded_vocab_size == 1024
    assert MegatronSpec(tp=2, vocab_size=1030).padded_vocab_size == 1280


# ---- the slicing rules, by hand ------------------------------------------------------------------


def test_rank_slices_follow_megatron_column_row_and_swiglu_rules() -> None:
    """TP=2, kv=1 (TP > KV heads): linear_qkv is split in contiguous halves of the grouped rows
    [q0..q3, k, v] (no KV replication); linear_fc1 per rank is [its gate rows; its up rows];
    linear_proj / linear_fc2 are split on columns; norms are whole; the embedding keeps padding."""
    spec = MegatronSpec(family="qwen3", tp=2, num_kv_heads=1, head_dim=32)
    ref = reference_state_dict(spec)
    r1 = rank_state_dict(spec, ref, tp_rank=1, pp_rank=0)
    qkv = ref["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert torch.equal(r1["decoder.layers.2.self_attention.linear_qkv.weight"], qkv[qkv.shape[0] // 2 :])
    fc1 = ref["decoder.layers.2.mlp.linear_fc1.weight"]
    f = spec.ffn_hidden_size
    assert torch.equal(r1["decoder.layers.2.mlp.linear_fc1.weight"], torch.cat([fc1[f // 2 : f], fc1[f + f // 2 :]]))
    proj = ref["decoder.layers.2.self_attention.linear_proj.weight"]
    assert torch.equal(r1["decoder.layers.2.self_attention.linear_proj.weight"], proj[:, proj.shape[1] // 2 :])
    q_norm = "decoder.layers.2.self_attention.q_layernorm.weight"
    assert torch.equal(r1[q_norm], ref[q_norm])
    assert r1["embedding.word_embeddings.weight"].shape == (spec.padded_vocab_size // 2, spec.hidden_size)


def test_rank_slices_number_layers_and_experts_locally() -> None:
    """PP 2 x VPP 2 with 8 layers: chunk v of stage p holds global layers (2v + p) * 2 + {0, 1},
    renumbered from 0; EP 2: EP rank 1 holds global experts 2, 3 as local experts 0, 1."""
    spec = MegatronSpec(family="llama", pp=2, vpp=2, num_layers=8)
    ref = reference_state_dict(spec)
    chunk = rank_state_dict(spec, ref, tp_rank=0, pp_rank=1, vpp_rank=1)
    assert torch.equal(chunk["decoder.layers.0.mlp.linear_fc2.weight"], ref["decoder.layers.6.mlp.linear_fc2.weight"])
    assert {int(k.split(".")[2]) for k in chunk if k.startswith("decoder.layers.")} == {0, 1}
    assert "output_layer.weight" in chunk and "embedding.word_embeddings.weight" not in chunk
    moe = MegatronSpec(family="mixtral", ep=2)
    mref = reference_state_dict(moe)
    ep1 = rank_state_dict(moe, mref, tp_rank=0, pp_rank=0, ep_rank=1)
    assert torch.equal(
        ep1["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"],
        mref["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"],
    )
    assert not any("local_experts.2" in k for k in ep1)


def test_hf_oracle_splits_qkv_by_query_group() -> None:
    """With rows labelled by (group, slot), q/k/v come out as HF expects: q heads of group g
    at q rows [g*q_per_group*d, ...), k and v one head per group, in group order."""
    spec = MegatronSpec(family="llama", num_heads=4, num_kv_heads=2)
    ref = reference_state_dict(spec)
    d, slots = spec.kv_channels, 4 // 2 + 2  # per group: q, q, k, v
    labels = torch.arange(2 * slots).repeat_interleave(d).float()[:, None].expand(-1, spec.hidden_size)
    ref = dict(ref, **{"decoder.layers.0.self_attention.linear_qkv.weight": labels.clone()})
    hf = reference_to_hf(spec, ref)
    def row_label(t: torch.Tensor) -> list[float]:  # one label per head
        return t[::d, 0].tolist()

    assert row_label(hf["model.layers.0.self_attn.q_proj.weight"]) == [0, 1, 4, 5]
    assert row_label(hf["model.layers.0.self_attn.k_proj.weight"]) == [2, 6]
    assert row_label(hf["model.layers.0.self_attn.v_proj.weight"]) == [3, 7]


# ---- the files on disk ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MATRIX))
def test_files_are_laid_out_as_verl_and_megatron_lm_write_them(fixtures: dict[str, StepJob], name: str) -> None:
    """Rank folders mp_rank_TT[_PPP][_EEE] for every (tp, pp, ep); torch_dist folders with
    .metadata/common.pt/metadata.json/*.distcp; a bridge export as sharded safetensors + complete
    index; verl's HF metadata folder (no weights beside Megatron shards), transformer_config.json,
    ckpt_contents.json written last (v2); the run root's tracker names the step."""
    job = fixtures[name]
    spec, step = job.spec, job.step_dir
    shards = model_dir(step, spec)
    if spec.fmt in RANK_FILE_FORMATS:
        ranks = product(range(spec.tp), range(spec.pp), range(spec.ep))
        expected = {rank_dir_name(spec, t, p, e) for t, p, e in ranks}
        assert {d.name for d in shards.iterdir() if d.name.startswith("mp_rank_")} == expected
        filename = "model.pt" if spec.fmt == "legacy" else "model_optim_rng.pt"
        assert all((shards / d / filename).is_file() for d in expected)
    elif spec.fmt in DIST_FORMATS:
        assert (shards / ".metadata").is_file() and (shards / "common.pt").is_file()
        assert list(shards.glob("__*_*.distcp"))
        assert json.loads((shards / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    else:  # bridge export
        index = json.loads((shards / "model.safetensors.index.json").read_text())
        files = sorted(shards.glob("model-*-of-*.safetensors"))
        assert len(files) == 2 and sorted(set(index["weight_map"].values())) == [f.name for f in files]
        held = {k for f in files for k in load_file(f)}
        assert held == set(index["weight_map"]) == set(reference_to_hf(spec, reference_state_dict(spec, job.seed)))
        assert not (step / "actor" / "model" / "dist_ckpt").exists()
    if spec.fmt in ("dist_v1", "dist_v2", "bridge_v2"):
        assert json.loads((step / "actor" / "transformer_config.json").read_text())["num_layers"] == spec.num_layers
    if spec.fmt == "megatron_lm_dist":
        common = _load_rank_file(shards / "common.pt")
        assert common["args"].ckpt_format == "torch_dist" and common["iteration"] == 1
    meta = {
        "legacy": step / "actor" / "hf_config_and_tokenizer",
        "dist_v1": step / "actor" / "huggingface",
        "dist_v2": step / "actor" / "model" / "huggingface",
        "bridge_v2": step / "actor" / "model" / "huggingface",
    }.get(spec.fmt)
    if meta is not None:
        config = json.loads((meta / "config.json").read_text())
        assert config["architectures"] == [spec.family_info.architecture]
        assert config["vocab_size"] == spec.vocab_size and config["tie_word_embeddings"] == spec.tie_word_embeddings
        assert (meta / "tokenizer.json").is_file()
        assert bool(list(meta.glob("*.safetensors"))) == (spec.fmt == "bridge_v2")
    if spec.fmt in ("dist_v2", "bridge_v2"):
        manifest_path = step / "actor" / "ckpt_contents.json"
        manifest = json.loads(manifest_path.read_text())
        model_path = "model/huggingface" if spec.fmt == "bridge_v2" else "model/dist_ckpt"
        assert manifest["schema_version"] == 2 and manifest["contents"]["model"]["path"] == model_path
        assert manifest["backend"]["has_bridge"] == (spec.fmt == "bridge_v2")
        assert (step / "actor" / "extra" / "dist_ckpt" / ".metadata").is_file()
        newest = max(p.stat().st_mtime_ns for p in (step / "actor").rglob("*") if p.is_file())
        assert manifest_path.stat().st_mtime_ns == newest
    assert (step.parent / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_bridge_export_is_the_oracle_and_gives_the_megatron_logits(fixtures: dict[str, StepJob]) -> None:
    """The bridge fixture's model/huggingface folder loads in transformers and reproduces the
    megatron-core logits of the ranks that 'exported' it."""
    for name in (n for n, s in MATRIX.items() if s.fmt == "bridge_v2"):
        job = fixtures[name]
        ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
        expected = torch.load(job.reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
        torch.testing.assert_close(_hf_logits(model_dir(job.step_dir, job.spec), ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", RANK_FILE_NAMES)
def test_rank_files_hold_each_ranks_slice(fixtures: dict[str, StepJob], name: str) -> None:
    """Each rank file holds one state dict per VPP chunk, local layer numbers, exactly the rank's
    slice of the reference; TE-named files use TE names; verl's model.pt needs no unsafe globals."""
    job = fixtures[name]
    spec = job.spec
    ref = load_file(job.reference_dir / REFERENCE_STATE_FILE)
    for t, p, e in product(range(spec.tp), range(spec.pp), range(spec.ep)):
        folder = model_dir(job.step_dir, spec) / rank_dir_name(spec, t, p, e)
        if spec.fmt == "legacy":
            chunks = torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
            assert isinstance(chunks, list)
        else:
            payload = _load_rank_file(folder / "model_optim_rng.pt")
            assert payload["checkpoint_version"] == 3.0 and payload["iteration"] == 1
            assert payload["args"].tensor_model_parallel_size == spec.tp
            chunks = [payload[f"model{v}"] for v in range(spec.vpp_size)] if spec.vpp else [payload["model"]]
        assert len(chunks) == spec.vpp_size
        for v, chunk in enumerate(chunks):
            expected = rank_state_dict(spec, ref, t, p, v, e)
            if spec.legacy_names == "te":
                expected = te_legacy_names(spec, expected)
                assert not any(k.endswith("input_layernorm.weight") for k in chunk)
            tensors = {k: val for k, val in chunk.items() if not k.endswith("._extra_state")}
            assert sorted(tensors) == sorted(expected), folder
            for key, val in expected.items():
                assert torch.equal(tensors[key], val), f"{folder} chunk {v}: {key}"


@pytest.mark.parametrize("name", list(MATRIX))
def test_reference_folder_is_complete_and_reproducible(fixtures: dict[str, StepJob], name: str) -> None:
    """reference/: the full Megatron state (regenerable from spec and seed, padded vocab), an HF
    folder that transformers loads with no missing or unexpected key, input ids and logits."""
    from transformers import AutoModelForCausalLM

    job = fixtures[name]
    ref = load_file(job.reference_dir / REFERENCE_STATE_FILE)
    assert {k: tuple(v.shape) for k, v in ref.items()} == reference_shapes(job.spec)
    regenerated = reference_state_dict(job.spec, job.seed)
    assert all(torch.equal(ref[k], regenerated[k]) for k in ref)
    model, info = AutoModelForCausalLM.from_pretrained(job.reference_dir / REFERENCE_HF_DIR, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == job.spec.family_info.architecture
    ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
    logits = torch.load(job.reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
    assert logits.shape == (*ids.shape, job.spec.vocab_size) and logits.dtype == torch.float32


# ---- the oracle agrees with megatron-core --------------------------------------------------------


def _hf_logits(hf_dir: Path, input_ids: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("name", list(MATRIX))
def test_hf_oracle_reproduces_megatron_core_logits(fixtures: dict[str, StepJob], name: str) -> None:
    """transformers on reference/hf == megatron-core forward on the ranks, within 1e-4 (fp32 CPU;
    seen here: max |diff| 2.5e-6 for logits of scale ~4, 1.6e-5 for scale ~40)."""
    job = fixtures[name]
    ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
    megatron_logits = torch.load(job.reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
    hf_logits = _hf_logits(job.reference_dir / REFERENCE_HF_DIR, ids)
    torch.testing.assert_close(hf_logits, megatron_logits, rtol=1e-4, atol=1e-4)


def test_logits_check_catches_a_wrong_qkv_or_gate_up_order(fixtures: dict[str, StepJob]) -> None:
    """Swapping k and v (or gate and up) in one layer of the oracle moves the logits far outside
    the tolerance: the logits comparison above can fail."""
    job = fixtures["qwen3_tp2_kv1_legacy"]
    hf_dir = job.reference_dir / REFERENCE_HF_DIR
    ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
    megatron_logits = torch.load(job.reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
    weights = load_file(hf_dir / "model.safetensors")
    p = "model.layers.1."
    def swapped(a: str, b: str) -> dict[str, torch.Tensor]:
        return {p + a: weights[p + b], p + b: weights[p + a]}

    swaps = [("self_attn.k_proj.weight", "self_attn.v_proj.weight"), ("mlp.gate_proj.weight", "mlp.up_proj.weight")]
    for wrong in (swapped(a, b) for a, b in swaps):
        assert (_hf_logits(hf_dir, ids, wrong) - megatron_logits).abs().max() > 1e-2


# ---- torch_dist read without megatron ------------------------------------------------------------

_READ_DCP_WITHOUT_MEGATRON = textwrap.dedent(
    """
    import json, sys
    sys.modules["megatron"] = None  # any import of megatron now raises ImportError
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from safetensors.torch import save_file
    report = {}
    for folder, out in json.loads(sys.argv[1]):
        reader = dcp.FileSystemReader(folder)
        meta = reader.read_metadata()
        tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                   for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        if tensors:
            dcp.load(tensors, storage_reader=reader, no_dist=True)
            save_file(tensors, out)
        others = sorted(k for k, m in meta.state_dict_metadata.items() if not isinstance(m, TensorStorageMetadata))
        try:
            common = repr(torch.load(folder + "/common.pt", weights_only=True))
        except Exception as error:  # Megatron-LM's args
            common = "refused: " + type(error).__name__
        report[folder] = {"tensors": sorted(tensors), "others": others, "common": common}
    report["process_group"] = torch.distributed.is_initialized()
    print(json.dumps(report))
    """
)


def test_dist_checkpoints_read_with_plain_dcp_without_megatron(fixtures: dict[str, StepJob], tmp_path: Path) -> None:
    """In a process where megatron cannot be imported and no process group exists, plain
    torch.distributed.checkpoint reads every torch_dist model folder; its global tensors (layers
    stacked on dim 0, TE-style names, experts [layers, experts, ...], fc1 = [gate; up], padded
    vocab, no output_layer when tied) equal the reference; the only non-tensor entries are
    ``*._extra_state/shard_*`` and ``rng_state/shard_*``; v2's extra/dist_ckpt holds no tensor at all.
    (Megatron-LM's common.pt pickles argparse.Namespace: plain weights_only loading refuses it.)"""
    folders: list[tuple[str, str]] = []
    for name in DIST_NAMES:
        job = fixtures[name]
        folders.append((str(model_dir(job.step_dir, job.spec)), str(tmp_path / f"{name}.safetensors")))
    for name in V2_NAMES:
        extra = fixtures[name].step_dir / "actor" / "extra" / "dist_ckpt"
        folders.append((str(extra), str(tmp_path / f"{name}_extra.safetensors")))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _READ_DCP_WITHOUT_MEGATRON, json.dumps(folders)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["process_group"] is False
    for name in DIST_NAMES:
        job = fixtures[name]
        expected = reference_dist_global(job.spec, load_file(job.reference_dir / REFERENCE_STATE_FILE))
        entry = report[str(model_dir(job.step_dir, job.spec))]
        assert entry["tensors"] == sorted(expected)
        loaded = load_file(tmp_path / f"{name}.safetensors")
        for key, tensor in expected.items():
            assert torch.equal(loaded[key], tensor), f"{name}: {key}"
        assert all(re.fullmatch(r"(.*\._extra_state|rng_state)/shard_[\d.]+_[\d.]+", k) for k in entry["others"])
        assert ("output_layer.weight" in entry["tensors"]) != job.spec.tie_word_embeddings
        if job.spec.fmt in ("dist_v2", "megatron_lm_dist"):
            assert ("dp_reshardable" in entry["common"]) == (job.spec.fmt == "dist_v2")
        if job.spec.fmt == "megatron_lm_dist":
            assert entry["common"].startswith("refused")
    for name in V2_NAMES:  # the "dist_ckpt without model tensors" case (bridge: rng/optimizer only)
        extra = report[str(fixtures[name].step_dir / "actor" / "extra" / "dist_ckpt")]
        assert extra["tensors"] == [] and extra["others"] and all(k.startswith("rng_state/") for k in extra["others"])


# ---- loading back into megatron-core (for the reverse split) -------------------------------------


def test_megatron_core_loads_the_files_back_and_reproduces_its_logits(fixtures: dict[str, StepJob]) -> None:
    """megatron_forward_logits_many reads legacy (local and TE names), Megatron-LM and torch_dist
    folders into fresh GPTModels and gives the logits the writer's models gave, exactly."""
    names = [
        "qwen2_moe_pp2_ep2_te_legacy",
        "llama_tp2_pp2_vpp2_legacy",
        "qwen2_pp2_vpp2_tied_megatron_lm",
        "qwen3_tp2_kv1_pp2_vpp2_dist_v1",
        "mistral_tp2_pp2_tied_dist_v2",
        "qwen3_moe_tp2_ep2_legacy",
        "mixtral_tp2_megatron_lm_dist",
    ]
    jobs = [
        LogitsJob(
            fixtures[n].step_dir,
            fixtures[n].spec,
            torch.load(fixtures[n].reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True),
        )
        for n in names
    ]
    for name, logits in zip(names, megatron_forward_logits_many(jobs, world_size=4)):
        expected = torch.load(fixtures[name].reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6, msg=name)


def test_loading_back_is_strict(fixtures: dict[str, StepJob], tmp_path: Path) -> None:
    """A rank file missing one tensor does not load: the error names the missing key."""
    job = fixtures["llama_tp1_pp1_legacy"]
    broken = tmp_path / "global_step_1"
    shutil.copytree(job.step_dir, broken)
    path = model_dir(broken, job.spec) / "mp_rank_00" / "model.pt"
    chunks = torch.load(path, weights_only=True)
    del chunks[0]["decoder.layers.1.mlp.linear_fc2.weight"]
    torch.save(chunks, path)
    ids = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
    with pytest.raises(Exception, match=r"decoder\.layers\.1\.mlp\.linear_fc2\.weight"):
        megatron_forward_logits(broken, job.spec, ids)
