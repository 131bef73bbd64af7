"""The synthetic verl FSDP writer, checked against what verl 0.9 writes and against its own reference.

Specification in brief:
- every variant of `fixture_matrix()` has verl's files, with verl's names, in verl's places;
- the rank files hold the placements of their strategy (DTensor Shard(0) on ("fsdp",), HSDP
  (Replicate(), Shard(0)) on ("ddp", "fsdp"), ShardedTensor without a mesh, plain tensors on one rank,
  Shard(1) from verl's placement function, plain replicated buffers);
- putting the shards back together gives the reference BIT FOR BIT, and the reference is the model
  `build_model(spec, seed)` builds in this process (so the writer is deterministic across processes);
- the reference `hf/` folder loads with `transformers` and gives the reference's logits;
- optimizer and extra-state files hold a real AdamW step, an lr scheduler and RNG state;
- a failing rank raises `SyntheticRunError` with its log, and leaves no process behind.

The matrix is written once per test session (about 20 s on 2 cores).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (registers DTensor for torch.load(weights_only=True))
from safetensors.torch import load_file
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    MEM_FORMAT_ENCODING,
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard as ShardedTensorShard
from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
from torch.distributed.remote_device import _remote_device
from torch.distributed.tensor import DTensor, Replicate, Shard

import synthetic_runs
from synthetic_runs import FsdpSpec, ModelSpec, SyntheticRunError, fixture_matrix
from synthetic_runs.fsdp import StepJob, build_reference_model, write_fsdp_steps, write_verl_run
from synthetic_runs.models import EXTRA_BUFFER_NAME

# What a ShardedTensor pickle references, besides what weights_only allows by default. `getattr` is
# there because protocol 2 pickles the nested class ShardedTensor.ProcessGroupState as
# getattr(ShardedTensor, "ProcessGroupState").
SHARDED_TENSOR_GLOBALS = [
    ShardedTensor,
    ShardedTensor.ProcessGroupState,
    ShardedTensorMetadata,
    TensorProperties,
    MEM_FORMAT_ENCODING,
    ShardedTensorShard,
    ShardMetadata,
    ChunkShardingSpec,
    _remote_device,
    getattr,
]
NUMPY_RNG_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


@pytest.fixture(scope="session")
def fsdp_fixture_runs(fsdp_runs) -> dict[str, synthetic_runs.RunFiles]:
    """Every variant of fixture_matrix(), written once per session (tests/fixtures_checkpoints.py)."""
    return fsdp_runs


def _load(path: str, rank: int, world_size: int, spec: FsdpSpec):
    """torch.load(weights_only=True); ShardedTensor files need a (fake) process group of the saving rank."""
    if spec.strategy != "fsdp1_sharded_tensor":
        return torch.load(path, weights_only=True, mmap=True)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with torch.serialization.safe_globals(SHARDED_TENSOR_GLOBALS):
            return torch.load(path, weights_only=True)
    finally:
        dist.destroy_process_group()


def _chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk semantics: equal chunks of ceil(size / parts), the last short, trailing ones empty."""
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


def _dtensor_slices(value: DTensor, rank: int) -> tuple[slice, ...]:
    """Where `rank`'s local tensor lies in the global tensor (nested Shard placements compose)."""
    mesh = value.device_mesh.mesh
    coordinate = [int(c) for c in (mesh == rank).nonzero()[0]]
    bounds = [(0, size) for size in value.shape]
    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, Shard):
            start, stop = bounds[placement.dim]
            lo, hi = _chunk_bounds(stop - start, mesh.shape[mesh_dim], coordinate[mesh_dim])
            bounds[placement.dim] = (start + lo, start + hi)
        else:
            assert isinstance(placement, Replicate), placement
    return tuple(slice(lo, hi) for lo, hi in bounds)


def _reassemble(states: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's state dict; replicas and plain tensors must agree exactly."""
    full: dict[str, torch.Tensor] = {}
    for name, first in states[0].items():
        if isinstance(first, DTensor):
            out = torch.empty(first.shape, dtype=first.dtype)
            seen = torch.zeros(first.shape, dtype=torch.bool)
            for rank, state in enumerate(states):
                index = _dtensor_slices(state[name], rank)
                local = state[name].to_local()
                assert tuple(local.shape) == tuple(s.stop - s.start for s in index), (name, rank)
                if seen[index].any():  # a replica: must equal what another rank holds
                    assert torch.equal(out[index][seen[index]], local[seen[index]]), (name, rank)
                out[index] = local
                seen[index] = True
            assert seen.all(), f"{name}: not every element is held by some rank"
            full[name] = out
        elif isinstance(first, ShardedTensor):
            out = torch.empty(first.size(), dtype=first.dtype)
            for state in states:
                for shard in state[name].local_shards():
                    index = tuple(
                        slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
                    )
                    out[index] = shard.tensor
            full[name] = out
        else:
            for state in states[1:]:
                assert torch.equal(state[name], first), f"plain tensor {name} differs between ranks"
            full[name] = first
    return full


def _rank_states(files: synthetic_runs.StepFiles) -> list[dict]:
    world = files.spec.world_size
    return [_load(path, rank, world, files.spec) for rank, path in enumerate(files.model_files)]


def test_matrix_covers_what_the_suite_needs():
    """fixture_matrix() spans strategies, families, tying, dtypes, buffers, roles, LoRA and Shard(1)."""
    specs = fixture_matrix().values()
    # FSDP + tensor parallelism is written by the architecture matrix (family_matrix)
    assert {s.strategy for s in specs} == set(synthetic_runs.fsdp.STRATEGIES) - {"fsdp2_tp"}
    assert {s.model.family for s in specs} == {"qwen2", "llama"}
    assert {s.model.tie_word_embeddings for s in specs} == {True, False}
    assert {s.dtype for s in specs} == {"float32", "bfloat16"}
    assert {s.role for s in specs} == {"actor", "critic", ""}
    assert any(s.model.extra_buffer for s in specs)
    assert any(s.shard_dim == 1 for s in specs)
    assert {s.fsdp_version for s in specs if s.lora} == {1, 2}
    assert any(s.lora and s.lora.r < s.world_size for s in specs)
    assert all(s.model.num_kv_heads < s.model.num_heads for s in specs)  # GQA everywhere


def test_family_matrix_covers_every_family():
    """family_matrix() spans every family of model_families at world 2, MoE/VL at world 3, FSDP1,
    verl's Shard(dim>0) on fused experts, FSDP2 + TP on a 2 x 2 mesh, and GPT-NeoX's 4.x head name."""
    from synthetic_runs.fsdp import family_matrix
    from synthetic_runs.model_families import FAMILIES

    specs = family_matrix().values()
    assert {s.model.family for s in specs if s.world_size == 2} == set(FAMILIES)
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "qwen2_vl", "gpt_oss", "qwen3_vl_moe"} <= \
        {s.model.family for s in specs if s.world_size == 3}
    assert {s.strategy for s in specs} == {"fsdp2", "fsdp1_mesh", "fsdp2_tp"}
    assert any(s.shard_dim == 1 and s.world_size == 3 for s in specs)
    assert any(s.key_renames for s in specs)


def test_every_variant_has_verls_files(fsdp_fixture_runs):
    """Names, places and contents of the small files match verl's FSDPCheckpointManager and trainer."""
    for name, run in fsdp_fixture_runs.items():
        step = run.latest
        spec = step.spec
        world = spec.world_size
        expected_dir = os.path.join(run.root, "global_step_1", spec.role) if spec.role else os.path.join(run.root, "global_step_1")
        assert step.checkpoint_dir == expected_dir, name
        listing = set(os.listdir(step.checkpoint_dir))
        for kind, content in (("model", "model"), ("optim", "optimizer"), ("extra_state", "extra")):
            for rank in range(world):
                present = f"{kind}_world_size_{world}_rank_{rank}.pt" in listing
                assert present == (content in spec.save_contents), (name, kind, rank)
        assert len(step.model_files) == world
        for path in step.model_files + step.optim_files + step.extra_state_files:
            assert os.path.getsize(path) > 0
        with open(os.path.join(step.checkpoint_dir, "fsdp_config.json")) as handle:
            assert json.load(handle) == {"FSDP_version": spec.fsdp_version, "world_size": world}, name
        hf = set(os.listdir(os.path.join(step.checkpoint_dir, "huggingface")))
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= hf, name
        # verl saves weights there only when save_contents holds "hf_model"
        assert any(f.endswith(".safetensors") for f in hf) == ("hf_model" in spec.save_contents), name
        assert ("generation_config.json" in hf) == (spec.model.task == "causal_lm"), name
        assert ("lora_train_meta.json" in listing) == (spec.lora is not None), name
        assert os.path.isfile(os.path.join(step.step_dir, "data.pt")), name
        with open(os.path.join(run.root, "latest_checkpointed_iteration.txt")) as handle:
            assert handle.read() == "1"
        with open(os.path.join(step.checkpoint_dir, "huggingface", "config.json")) as handle:
            config = json.load(handle)
        assert config["architectures"] == [spec.model.architecture], name
        assert config["vocab_size"] == spec.model.vocab_size
        assert config["tie_word_embeddings"] == spec.model.tie_word_embeddings


def test_tokenizer_is_real_and_fits_the_vocabulary(fsdp_fixture_runs):
    """The saved tokenizer loads with AutoTokenizer, round-trips text and carries a chat template."""
    from transformers import AutoTokenizer

    for name in ("fsdp2_qwen2", "fsdp2_hsdp_llama"):  # qwen2: transformers rebuilds a Qwen2Tokenizer
        step = fsdp_fixture_runs[name].latest
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(step.checkpoint_dir, "huggingface"))
        assert 256 < len(tokenizer) <= step.spec.model.vocab_size
        text = "The actor saves a checkpoint.\n Ünïcödé 123?"
        ids = tokenizer(text)["input_ids"]
        assert len(ids) < len(text.encode()) and tokenizer.decode(ids) == text
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def _assert_placements(name: str, spec: FsdpSpec, state: dict) -> None:
    for key, value in state.items():
        if key.endswith(EXTRA_BUFFER_NAME):
            assert type(value) is torch.Tensor, f"{name}: buffer {key} should be a plain tensor"
            continue
        if spec.strategy == "single":
            assert type(value) is torch.Tensor, (name, key, type(value))
        elif spec.strategy == "fsdp1_sharded_tensor":
            assert isinstance(value, ShardedTensor), (name, key, type(value))
        else:
            assert isinstance(value, DTensor), (name, key, type(value))
            assert value.device_mesh.mesh_dim_names == spec.mesh_dim_names, (name, key)
            if spec.strategy in ("hsdp", "fsdp2_hsdp"):
                assert value.placements == (Replicate(), Shard(0)), (name, key)
            elif spec.shard_dim == 1 and value.shape[0] % spec.world_size and value.shape[1] % spec.world_size == 0:
                assert value.placements == (Shard(1),), (name, key)  # verl's placement function
            else:
                assert value.placements == (Shard(0),), (name, key, value.placements)


def test_placements_per_strategy(fsdp_fixture_runs):
    """Each strategy's rank files hold the tensor types and placements measured on verl checkpoints."""
    for name, run in fsdp_fixture_runs.items():
        spec = run.spec
        state = _load(run.latest.model_files[-1], spec.world_size - 1, spec.world_size, spec)
        _assert_placements(name, spec, state)
    shard1 = _load(fsdp_fixture_runs["fsdp2_shard_dim1_qwen2"].latest.model_files[0], 0, 4, fixture_matrix()["fsdp2_shard_dim1_qwen2"])
    assert shard1["model.embed_tokens.weight"].placements == (Shard(1),)
    assert shard1["model.embed_tokens.weight"].to_local().shape == (1003, 16)


def test_shards_reassemble_to_the_reference_bit_for_bit(fsdp_fixture_runs):
    """Concatenating every rank's shards gives state_dict.safetensors exactly, key set and dtypes
    included; and that reference is what build_model(spec, seed) gives in this very process."""
    for name, run in fsdp_fixture_runs.items():
        step = run.latest
        full = _reassemble(_rank_states(step))
        reference = load_file(step.reference_state_dict)
        assert set(full) == set(reference), name
        for key, tensor in reference.items():
            assert full[key].dtype == tensor.dtype, (name, key)
            assert torch.equal(full[key], tensor), (name, key)
        rebuilt = build_reference_model(step.spec, step.seed).state_dict()
        assert set(rebuilt) == set(reference), name
        assert all(torch.equal(rebuilt[k], reference[k]) for k in reference), name


def test_uneven_and_padded_shards(fsdp_fixture_runs):
    """vocab 1003 over 4 ranks: 251/251/251/250 rows; FSDP2 keeps the padded storage behind the short
    shard, FSDP1 does not."""
    for name, padded in (("fsdp2_qwen2", True), ("fsdp1_mesh_qwen2", False)):
        step = fsdp_fixture_runs[name].latest
        rows = []
        for rank, path in enumerate(step.model_files):
            local = torch.load(path, weights_only=True)["model.embed_tokens.weight"].to_local()
            rows.append(local.shape[0])
            if rank == 3:
                stored = local.untyped_storage().nbytes() // local.element_size()
                assert (stored == 251 * 64) == padded, name
        assert rows == [251, 251, 251, 250], name


def test_tied_embeddings_keep_both_keys(fsdp_fixture_runs):
    """Tied models save both keys; FSDP1 stores two equal copies, FSDP2 one tensor under two names."""
    fsdp1 = torch.load(fsdp_fixture_runs["fsdp1_mesh_llama_tied_bf16"].latest.model_files[0], weights_only=True)
    a, b = fsdp1["model.embed_tokens.weight"].to_local(), fsdp1["lm_head.weight"].to_local()
    assert torch.equal(a, b) and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert a.dtype == torch.bfloat16
    fsdp2 = torch.load(fsdp_fixture_runs["fsdp2_qwen2_tied_bf16"].latest.model_files[0], weights_only=True)
    a, b = fsdp2["model.embed_tokens.weight"].to_local(), fsdp2["lm_head.weight"].to_local()
    assert torch.equal(a, b) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_lora_keys_empty_shards_and_metadata(fsdp_fixture_runs):
    """PEFT key names; r=2 over 4 ranks leaves ranks 2 and 3 with EMPTY lora_A shards; B is non-zero;
    lora_train_meta.json carries r, lora_alpha and task_type."""
    step = fsdp_fixture_runs["lora_fsdp2_qwen2_r2"].latest
    prefix = "base_model.model.model.layers.0.self_attn.q_proj."
    states = [torch.load(path, weights_only=True) for path in step.model_files]
    assert {prefix + s for s in ("base_layer.weight", "base_layer.bias", "lora_A.default.weight", "lora_B.default.weight")} <= set(states[0])
    assert [s[prefix + "lora_A.default.weight"].to_local().shape[0] for s in states] == [1, 1, 0, 0]
    full = _reassemble(states)
    assert full[prefix + "lora_A.default.weight"].shape == (2, 64)  # r x in
    assert full[prefix + "lora_B.default.weight"].shape == (64, 2)  # out x r
    assert full[prefix + "lora_B.default.weight"].abs().min() > 0
    with open(os.path.join(step.checkpoint_dir, "lora_train_meta.json")) as handle:
        assert json.load(handle) == {"r": 2, "lora_alpha": 16, "task_type": "CAUSAL_LM"}
    assert step.reference_hf_dir is None and not os.path.exists(os.path.join(step.reference_dir, "hf"))


def test_reference_hf_folders_load_and_match(fsdp_fixture_runs):
    """reference hf/ loads with AutoModelFor{CausalLM,TokenClassification} and gives the reference's
    weights; the extra persistent buffer is in state_dict.safetensors (and unknown to the HF class)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    for name in ("fsdp2_qwen2", "fsdp1_mesh_llama_tied_bf16", "critic_fsdp2_qwen2", "fsdp2_llama_buffer_mqa"):
        step = fsdp_fixture_runs[name].latest
        auto = AutoModelForTokenClassification if step.spec.model.task == "token_classification" else AutoModelForCausalLM
        model = auto.from_pretrained(step.reference_hf_dir, dtype="auto")
        reference = load_file(step.reference_state_dict)
        loaded = model.state_dict()
        for key, tensor in loaded.items():
            assert torch.equal(tensor, reference[key]), (name, key)
        assert (f"model.{EXTRA_BUFFER_NAME}" in reference) == step.spec.model.extra_buffer
        if step.spec.model.task == "token_classification":
            assert reference["score.weight"].shape == (1, step.spec.model.hidden_size)


def test_hf_model_in_save_contents_writes_loadable_weights(fsdp_fixture_runs):
    """save_contents with "hf_model": huggingface/ holds the full model, equal to the reference."""
    from transformers import AutoModelForCausalLM

    step = fsdp_fixture_runs["fsdp1_mesh_qwen2_hf_model_no_optim"].latest
    assert step.optim_files == ()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(step.checkpoint_dir, "huggingface"), dtype="auto")
    reference = load_file(step.reference_state_dict)
    assert all(torch.equal(tensor, reference[key]) for key, tensor in model.state_dict().items())


def test_optimizer_and_extra_state_hold_a_real_step(fsdp_fixture_runs):
    """optim: AdamW state after one step (FSDP1: flat 1-D shards; FSDP2: DTensors); extra_state: the
    LambdaLR state and the cpu/numpy/random RNG states, as verl saves them."""
    fsdp1 = fsdp_fixture_runs["fsdp1_mesh_qwen2"].latest
    fsdp2 = fsdp_fixture_runs["fsdp2_qwen2"].latest
    for step, flat in ((fsdp1, True), (fsdp2, False)):
        optim = torch.load(step.optim_files[0], weights_only=True)
        assert optim["param_groups"][0]["weight_decay"] == 0.01
        states = list(optim["state"].values())
        assert states and all(float(s["step"]) == 1.0 for s in states)
        assert any(s["exp_avg"].to_local().abs().sum() > 0 if not flat else s["exp_avg"].abs().sum() > 0 for s in states)
        if flat:
            assert all(type(s["exp_avg"]) is torch.Tensor and s["exp_avg"].dim() == 1 for s in states)
        else:
            assert all(isinstance(s["exp_avg"], DTensor) for s in states)
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
            extra = torch.load(step.extra_state_files[1], weights_only=True)
        assert extra["lr_scheduler"]["last_epoch"] == 1
        assert set(extra["rng"]) == {"cpu", "numpy", "random"}
    lora = torch.load(fsdp_fixture_runs["lora_fsdp1_mesh_qwen2"].latest.optim_files[0], weights_only=True)
    assert len(lora["state"]) == 2 * 2 * 2  # lora_A and lora_B of q_proj and v_proj in 2 layers


def test_write_verl_run_steps_differ_and_tracker_names_the_last(tmp_path):
    """write_verl_run: one folder per step with different weights (seed + N), data.pt each, and the
    tracker holding the last step; world size 2 and the SFT layout (no role folder)."""
    spec = FsdpSpec(model=ModelSpec(family="llama", num_layers=1), world_size=2, strategy="fsdp2", role="")
    steps = write_verl_run(tmp_path / "run", spec, steps=(2, 5), seed=10, reference_root=tmp_path / "refs")
    assert [os.path.basename(s) for s in steps] == ["global_step_2", "global_step_5"]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "5"
    weights = []
    for step in steps:
        assert os.path.isfile(os.path.join(step, "model_world_size_2_rank_1.pt"))
        assert os.path.isfile(os.path.join(step, "data.pt"))
        weights.append(load_file(str(tmp_path / "refs" / os.path.basename(step) / "state_dict.safetensors")))
    assert not torch.equal(weights[0]["model.norm.weight"], weights[1]["model.norm.weight"])
    assert torch.equal(weights[1]["model.norm.weight"], build_reference_model(spec, 15).state_dict()["model.norm.weight"])


def test_a_failing_rank_raises_with_its_log_and_leaves_nothing_running(tmp_path):
    """A rank that cannot write fails the whole write with SyntheticRunError; the others are killed."""
    import psutil

    blocker = tmp_path / "global_step_1"
    blocker.write_text("a file where the step folder should go")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(SyntheticRunError, match="rank 0/2"):
        write_fsdp_steps([StepJob(str(blocker), FsdpSpec(world_size=2, strategy="fsdp2"))], timeout_s=120)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_specs_reject_impossible_layouts():
    """Inconsistent specs fail at construction, before any process starts."""
    with pytest.raises(ValueError):
        FsdpSpec(strategy="single", world_size=4)
    with pytest.raises(ValueError):
        FsdpSpec(strategy="hsdp", world_size=4, ddp_size=4)
    with pytest.raises(ValueError):
        FsdpSpec(strategy="fsdp1_mesh", shard_dim=1)
    with pytest.raises(ValueError):
        ModelSpec(task="token_classification", tie_word_embeddings=True)
    spec = fixture_matrix()["lora_fsdp2_qwen2_r2"]
    assert FsdpSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
