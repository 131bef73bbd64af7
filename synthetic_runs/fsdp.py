"""Authentic verl-layout FSDP checkpoints, written by real `torch.distributed` on CPU.

Contract:
- `write_fsdp_step(step_dir, spec, seed, reference_dir)` spawns `spec.world_size` processes (gloo on
  127.0.0.1, a free port picked at run time), builds the model of `spec.model` with the weights of
  `seed` on every rank, wraps it the way verl 0.9 does for `spec.strategy`, takes one real AdamW
  step (on deterministic gradients), and saves exactly what verl's `FSDPCheckpointManager.save_checkpoint` saves:
      step_dir/<role>/model_world_size_{W}_rank_{R}.pt      model.state_dict() (FSDP1 under
                                                            SHARDED_STATE_DICT; FSDP2 as is)
      step_dir/<role>/optim_world_size_{W}_rank_{R}.pt      optimizer.state_dict()
      step_dir/<role>/extra_state_world_size_{W}_rank_{R}.pt {"lr_scheduler": ..., "rng": ...}
      step_dir/<role>/fsdp_config.json                      {"FSDP_version": 1|2, "world_size": W}
      step_dir/<role>/huggingface/                          config, generation config, tokenizer
      step_dir/<role>/lora_train_meta.json                  {"r", "lora_alpha", "task_type"} (LoRA)
      step_dir/data.pt                                      the dataloader state (the trainer's)
  `role=""` is verl's SFT trainer: the files go straight into step_dir.
- The step's learning rate is 0 (verl's constant schedule in its warm-up), so the saved weights are
  EXACTLY the weights built from (spec, seed): `models.synthetic_value` defines every one of them.
  The writer checks this, and checks that the rank files hold exactly the reference's keys.
- `reference_dir`, when given, receives `state_dict.safetensors` (the full state dict under the rank
  files' key names, LoRA keys and persistent buffers included, in the saved dtype), `spec.json`, and
  for non-LoRA models `hf/`, a `save_pretrained()` of the model with its tokenizer.
- `write_fsdp_steps(jobs)` writes many steps with one group of processes per world size (the
  expensive part of a write is starting processes, not saving); `write_verl_run` writes a run root
  with `latest_checkpointed_iteration.txt`; `fixture_matrix()` names the variants the tests use and
  `write_fixture_matrix` writes them all at once.
- Failures raise `SyntheticRunError` carrying the failing rank's log; no process is left running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from synthetic_runs.models import (
    ModelSpec,
    build_config,
    build_model,
    model_class,
    register_extra_buffer,
    synthetic_value,
    torch_dtype,
    write_hf_metadata,
)

STRATEGIES: tuple[str, ...] = ("fsdp1_mesh", "fsdp1_sharded_tensor", "fsdp2", "hsdp", "fsdp2_hsdp", "single",
                               "fsdp2_tp")
# FSDP + tensor parallelism (torchtitan / VeOmni style): each decoder layer's projections sharded over
# "tp" (column-wise: q/k/v, gate/up; row-wise: o, down), then fully_shard over "dp_shard"
TP_PLAN: dict[str, str] = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                           "mlp.down_proj": "rowwise"}
ROLES: tuple[str, ...] = ("actor", "critic", "")
WRITERS: tuple[str, ...] = ("stepmerge", "verl", "accelerate", "torch_dcp", "dcp_hf")
# writers that save the step with torch.distributed.checkpoint (`_save_with_dcp`), not as verl's rank files
DCP_WRITERS: tuple[str, ...] = ("accelerate", "torch_dcp", "dcp_hf")
SAVE_CONTENTS: tuple[str, ...] = ("model", "optimizer", "extra", "hf_model")
TRACKER_FILE = "latest_checkpointed_iteration.txt"
REFERENCE_STATE_DICT = "state_dict.safetensors"

# verl's defaults: AdamW(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01); a constant schedule with
# warm-up. A warm-up > 0 makes the first step's lr exactly 0, so the weights stay exact.
_LR = 1e-6
_WARMUP_STEPS = 10


class SyntheticRunError(RuntimeError):
    """A rank of a synthetic write failed or timed out; the message holds its log."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA applied with `peft.get_peft_model` before sharding (as verl does). ``target_parameters``:
    PEFT's LoRA on parameters (``ParamWrapper``), how PEFT 0.21 adapts transformers v5's fused 3-D
    expert tensors (``mlp.experts.gate_up_proj``); the first listed is the innermost wrapper.
    ``target_modules`` may be a string, as PEFT takes it: ``"all-linear"`` is verl's default
    (`VERL_DEFAULT_LORA`), which PEFT 0.21 turns into ``target_parameters`` on a v5 MoE model."""

    r: int = 4
    alpha: int = 8
    target_modules: str | tuple[str, ...] = ("q_proj", "v_proj")
    target_parameters: tuple[str, ...] = ()


@dataclass(frozen=True)
class FsdpSpec:
    """One verl FSDP checkpoint: which model, how it is sharded, what is saved.

    strategy:
      "fsdp1_mesh"           FSDP1 FULL_SHARD with a 1-D mesh ("fsdp",) -> DTensor Shard(0)
      "fsdp1_sharded_tensor" FSDP1 FULL_SHARD without a mesh -> ShardedTensor (older verl)
      "fsdp2"                fully_shard on ("fsdp",) -> DTensor Shard(0) (shard_dim=1: verl's
                             placement function, Shard on the first dim that divides evenly)
      "hsdp"                 FSDP1 HYBRID_SHARD on ("ddp", "fsdp") -> DTensor (Replicate(), Shard(0))
      "fsdp2_hsdp"           fully_shard on ("ddp", "fsdp") -> DTensor (Replicate(), Shard(0))
      "single"               world size 1 (FSDP1 falls back to NO_SHARD) -> plain tensors
      "fsdp2_tp"             TP over ("dp_shard", "tp")[1] (`TP_PLAN`), then fully_shard over dp_shard ->
                             2-D DTensors: (Shard(0), Shard(1)) row-wise, (_StridedShard(0), Shard(0))
                             column-wise, the rest Shard(0) on the dp_shard mesh replicated over tp
    """

    model: ModelSpec = ModelSpec()
    world_size: int = 4
    strategy: str = "fsdp2"
    ddp_size: int = 2  # hsdp / fsdp2_hsdp only: number of replicas
    tp_size: int = 2  # fsdp2_tp only: tensor-parallel degree
    shard_dim: int = 0  # fsdp2 only
    dtype: str = "float32"  # dtype of the saved model shards
    lora: LoraSpec | None = None
    role: str = "actor"  # "actor" | "critic" | "" (SFT trainer: straight into global_step_N/)
    save_contents: tuple[str, ...] = ("model", "optimizer", "extra")  # verl's checkpoint.save_contents
    # (old, new) key renames applied to the saved state dicts: the attribute names of the same model
    # under transformers 4.x (GPT-NeoX's head was `embed_out`), which verl's writer saved then
    key_renames: tuple[tuple[str, str], ...] = ()
    # who saves the step: "stepmerge" (this module, verl's file set re-created) or "verl" (verl 0.9.1's own
    # FSDPCheckpointManager.save_checkpoint, imported in the ranks from `synthetic_runs.verl_lib`); the DCP
    # writers (`_save_with_dcp`): "accelerate" (Accelerate's own save_fsdp_model / save_fsdp_optimizer under
    # SHARDED_STATE_DICT, as HF Trainer / TRL call them), "torch_dcp" (torch.distributed.checkpoint.save of the
    # model's state dict), "dcp_hf" (the same through torch's HuggingFaceStorageWriter, one file per rank)
    writer: str = "stepmerge"
    # writer "accelerate" with LoRA: HF Trainer's save, ``save_fsdp_model(..., adapter_only=True)`` (its
    # ``get_fsdp_ckpt_kwargs``): the DCP folder holds PEFT's adapter state dict only (``lora_A.weight``, no base)
    adapter_only: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.writer not in WRITERS:
            raise ValueError(f"writer must be one of {WRITERS}, got {self.writer!r}")
        if self.writer == "verl" and (self.role != "actor" or self.key_renames):
            raise ValueError("verl's own writer saves an actor's files as they are")
        if self.writer in DCP_WRITERS and (self.strategy != "fsdp2" or self.role or self.key_renames):
            raise ValueError("the DCP writers save an FSDP2 model straight into the step folder")
        if self.writer in DCP_WRITERS and self.lora is not None and self.writer != "accelerate":
            raise ValueError("LoRA steps of the DCP writers are Accelerate's (HF Trainer / TRL with PEFT)")
        if self.adapter_only and (self.writer != "accelerate" or self.lora is None):
            raise ValueError("adapter_only is HF Trainer's save of a PEFT model through Accelerate")
        if (self.strategy == "single") != (self.world_size == 1):
            raise ValueError("strategy 'single' is the one (and only) strategy for world_size 1")
        if self.strategy in ("hsdp", "fsdp2_hsdp") and (
            self.ddp_size < 2 or self.world_size % self.ddp_size or self.world_size == self.ddp_size
        ):
            raise ValueError("HSDP needs ddp_size >= 2 dividing world_size, with at least 2 ranks per replica")
        if self.strategy == "fsdp2_tp" and (self.tp_size < 2 or self.world_size % self.tp_size):
            raise ValueError("fsdp2_tp needs tp_size >= 2 dividing world_size")
        if self.shard_dim not in (0, 1) or (self.shard_dim == 1 and self.strategy != "fsdp2"):
            raise ValueError("shard_dim is 0, or 1 with strategy 'fsdp2'")
        torch_dtype(self.dtype)
        if "model" not in self.save_contents or set(self.save_contents) - set(SAVE_CONTENTS):
            raise ValueError(f"save_contents must include 'model' and be drawn from {SAVE_CONTENTS}")
        if self.lora is not None and self.model.task != "causal_lm":
            raise ValueError("LoRA fixtures are causal LMs (verl's actor)")
        if self.lora is not None and "hf_model" in self.save_contents:
            raise ValueError("'hf_model' is not written for LoRA models")

    @property
    def fsdp_version(self) -> int:
        return 2 if self.strategy in ("fsdp2", "fsdp2_hsdp", "fsdp2_tp") else 1

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """Names of the device mesh the shards are laid on (None: no mesh, ShardedTensor)."""
        if self.strategy == "fsdp1_sharded_tensor":
            return None
        if self.strategy == "fsdp2_tp":
            return ("dp_shard", "tp")
        return ("ddp", "fsdp") if self.strategy in ("hsdp", "fsdp2_hsdp") else ("fsdp",)

    @property
    def mesh_shape(self) -> tuple[int, ...] | None:
        if self.strategy == "fsdp1_sharded_tensor":
            return None
        if self.strategy in ("hsdp", "fsdp2_hsdp"):
            return (self.ddp_size, self.world_size // self.ddp_size)
        if self.strategy == "fsdp2_tp":
            return (self.world_size // self.tp_size, self.tp_size)
        return (self.world_size,)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FsdpSpec:
        data = dict(data)
        data["model"] = ModelSpec(**data["model"])
        if data.get("lora") is not None:
            lora = dict(data["lora"])
            if not isinstance(lora["target_modules"], str):
                lora["target_modules"] = tuple(lora["target_modules"])
            lora["target_parameters"] = tuple(lora.get("target_parameters", ()))
            data["lora"] = LoraSpec(**lora)
        data["save_contents"] = tuple(data["save_contents"])
        data["key_renames"] = tuple(tuple(pair) for pair in data.get("key_renames", ()))
        return cls(**data)


@dataclass(frozen=True)
class StepJob:
    """One step to write: where, what, with which weights, and where its reference goes."""

    step_dir: str
    spec: FsdpSpec
    seed: int = 0
    reference_dir: str | None = None

    def to_dict(self) -> dict:
        return {
            "step_dir": self.step_dir,
            "spec": self.spec.to_dict(),
            "seed": self.seed,
            "reference_dir": self.reference_dir,
        }

    @classmethod
    def from_dict(cls, data: dict) -> StepJob:
        return cls(data["step_dir"], FsdpSpec.from_dict(data["spec"]), data["seed"], data["reference_dir"])


@dataclass(frozen=True)
class StepFiles:
    """What a write produced (absolute paths)."""

    step_dir: str
    checkpoint_dir: str  # step_dir/<role>, or step_dir for SFT
    spec: FsdpSpec
    seed: int
    model_files: tuple[str, ...]
    optim_files: tuple[str, ...]
    extra_state_files: tuple[str, ...]
    reference_dir: str | None

    @property
    def reference_state_dict(self) -> str | None:
        """reference_dir/state_dict.safetensors, when a reference was written."""
        return os.path.join(self.reference_dir, REFERENCE_STATE_DICT) if self.reference_dir else None

    @property
    def reference_hf_dir(self) -> str | None:
        """reference_dir/hf (a save_pretrained() folder), for non-LoRA models with a reference."""
        if self.reference_dir is None or self.spec.lora is not None:
            return None
        return os.path.join(self.reference_dir, "hf")


@dataclass(frozen=True)
class RunFiles:
    """A verl run root written by `write_verl_run` / `write_fixture_matrix`."""

    root: str
    spec: FsdpSpec
    steps: tuple[StepFiles, ...]

    @property
    def latest(self) -> StepFiles:
        return self.steps[-1]


def rank_file_name(kind: str, world_size: int, rank: int) -> str:
    """verl's per-rank file name: kind is "model", "optim" or "extra_state"."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def checkpoint_dir(step_dir: str | os.PathLike[str], spec: FsdpSpec) -> str:
    step_dir = os.path.abspath(os.fspath(step_dir))
    return os.path.join(step_dir, spec.role) if spec.role else step_dir


def _step_files(job: StepJob) -> StepFiles:
    directory = checkpoint_dir(job.step_dir, job.spec)
    world = job.spec.world_size

    def files(kind: str, content: str) -> tuple[str, ...]:
        if content not in job.spec.save_contents:
            return ()
        return tuple(os.path.join(directory, rank_file_name(kind, world, r)) for r in range(world))

    return StepFiles(
        step_dir=os.path.abspath(job.step_dir),
        checkpoint_dir=directory,
        spec=job.spec,
        seed=job.seed,
        model_files=files("model", "model"),
        optim_files=files("optim", "optimizer"),
        extra_state_files=files("extra_state", "extra"),
        reference_dir=os.path.abspath(job.reference_dir) if job.reference_dir else None,
    )


# --------------------------------------------------------------------------------------------------
# Public writers (parent side)
# --------------------------------------------------------------------------------------------------


def write_fsdp_step(
    step_dir: str | os.PathLike[str],
    spec: FsdpSpec,
    seed: int = 0,
    reference_dir: str | os.PathLike[str] | None = None,
) -> StepFiles:
    """Write one verl FSDP checkpoint step (see the module docstring); return its files."""
    job = StepJob(os.fspath(step_dir), spec, seed, os.fspath(reference_dir) if reference_dir else None)
    return write_fsdp_steps([job])[0]


def write_verl_run(
    root: str | os.PathLike[str],
    spec: FsdpSpec,
    steps: Sequence[int] = (1, 2, 3),
    seed: int = 0,
    reference_root: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Write root/global_step_N/ for each N (weights of seed + N) and the tracker; return the step dirs.

    References (if asked) go to reference_root/global_step_N/.
    """
    run = _write_runs({"run": (os.fspath(root), spec)}, steps, seed, reference_root and os.fspath(reference_root))
    return [files.step_dir for files in run["run"].steps]


def fixture_matrix() -> dict[str, FsdpSpec]:
    """The variants the test suite writes once per session, by name.

    Covers: FSDP1 with a mesh (DTensor) and without (ShardedTensor), FSDP2, HSDP 2x2 (FSDP1 and
    FSDP2), world size 1, tied and untied embeddings (tied on FSDP1: two stored copies), Qwen2 and
    Llama, GQA (4 query heads over 2 KV heads; 1 KV head on one), fp32 and bf16, a persistent
    buffer, a critic (token classification, `score.*`), an SFT layout (no role folder), verl's
    save_contents with `hf_model` and without `optimizer`, FSDP2 with verl's Shard(1) placement
    function, and LoRA on FSDP1 and FSDP2 (r=2 over 4 ranks leaves ranks 2 and 3 holding EMPTY
    shards of every lora_A).
    """
    qwen = ModelSpec(family="qwen2")
    llama = ModelSpec(family="llama")
    return {
        "fsdp1_mesh_qwen2": FsdpSpec(model=qwen, strategy="fsdp1_mesh"),
        "fsdp1_mesh_llama_tied_bf16": FsdpSpec(
            model=dataclasses.replace(llama, tie_word_embeddings=True), strategy="fsdp1_mesh", dtype="bfloat16"
        ),
        "fsdp1_sharded_tensor_llama": FsdpSpec(model=llama, strategy="fsdp1_sharded_tensor"),
        "fsdp1_sharded_tensor_qwen2_tied": FsdpSpec(
            model=dataclasses.replace(qwen, tie_word_embeddings=True), strategy="fsdp1_sharded_tensor"
        ),
        "fsdp2_qwen2": FsdpSpec(model=qwen, strategy="fsdp2"),
        "fsdp2_qwen2_tied_bf16": FsdpSpec(
            model=dataclasses.replace(qwen, tie_word_embeddings=True), strategy="fsdp2", dtype="bfloat16"
        ),
        "fsdp2_llama_buffer_mqa": FsdpSpec(
            model=dataclasses.replace(llama, extra_buffer=True, num_kv_heads=1), strategy="fsdp2"
        ),
        "fsdp2_shard_dim1_qwen2": FsdpSpec(model=qwen, strategy="fsdp2", shard_dim=1),
        "hsdp_qwen2_buffer": FsdpSpec(
            model=dataclasses.replace(qwen, extra_buffer=True), strategy="hsdp", ddp_size=2
        ),
        "fsdp2_hsdp_llama": FsdpSpec(model=llama, strategy="fsdp2_hsdp", ddp_size=2),
        "single_qwen2": FsdpSpec(model=qwen, strategy="single", world_size=1),
        "critic_fsdp2_qwen2": FsdpSpec(
            model=dataclasses.replace(qwen, task="token_classification"), strategy="fsdp2", role="critic"
        ),
        "sft_fsdp1_mesh_llama": FsdpSpec(model=llama, strategy="fsdp1_mesh", role=""),
        "fsdp1_mesh_qwen2_hf_model_no_optim": FsdpSpec(
            model=qwen, strategy="fsdp1_mesh", save_contents=("model", "extra", "hf_model")
        ),
        "lora_fsdp1_mesh_qwen2": FsdpSpec(model=qwen, strategy="fsdp1_mesh", lora=LoraSpec(r=4, alpha=8)),
        "lora_fsdp2_qwen2_r2": FsdpSpec(
            model=qwen,
            strategy="fsdp2",
            lora=LoraSpec(r=2, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
        ),
    }


def family_matrix() -> dict[str, FsdpSpec]:
    """The architecture matrix (`model_families.FAMILIES`), written once per test session: every
    family on FSDP2 at world 2, the MoE and vision-language ones at world 3 too (4 experts over 3
    ranks: uneven shards), Qwen3-MoE on FSDP1, verl's Shard(dim>0) placement on fused experts,
    Qwen2 on FSDP2 + tensor parallelism (world 4 = 2 x 2), and GPT-NeoX saved under its
    transformers 4.x head name `embed_out`."""
    from synthetic_runs.model_families import FAMILIES

    specs = {f"{family}_w2": FsdpSpec(model=ModelSpec(family=family), world_size=2, save_contents=("model",))
             for family in FAMILIES}
    for family in ("mixtral", "qwen3_moe", "deepseek_v3", "qwen2_vl", "gpt_oss", "qwen3_vl_moe"):
        specs[f"{family}_w3"] = FsdpSpec(model=ModelSpec(family=family), world_size=3, save_contents=("model",))
    specs["qwen3_moe_fsdp1_w2"] = FsdpSpec(model=ModelSpec(family="qwen3_moe"), world_size=2,
                                           strategy="fsdp1_mesh", save_contents=("model",))
    # gate_up_proj (4, 120, 64) -> Shard(1), down_proj (4, 64, 60) -> Shard(2) under verl's placement
    specs["qwen3_moe_shard_dim1_w3"] = FsdpSpec(model=ModelSpec(family="qwen3_moe", intermediate_size=120),
                                                world_size=3, shard_dim=1, save_contents=("model",))
    # FSDP2 over tensor parallelism on a 2 x 2 (dp_shard, tp) mesh: real 2-D DTensor placements
    specs["qwen2_tp_w4"] = FsdpSpec(model=ModelSpec(family="qwen2"), world_size=4, strategy="fsdp2_tp",
                                    save_contents=("model",))
    # LoRA on GPT-2's Conv1D layers (weights stored (in, out): PEFT sets fan_in_fan_out)
    specs["gpt2_lora_w2"] = FsdpSpec(model=ModelSpec(family="gpt2"), world_size=2, save_contents=("model",),
                                     lora=LoraSpec(r=2, alpha=4, target_modules=("c_attn", "c_proj")))
    # LoRA on Qwen3-MoE's fused experts (PEFT target_parameters: ParamWrapper on gate_up_proj and down_proj)
    specs["qwen3_moe_lora_w2"] = FsdpSpec(
        model=ModelSpec(family="qwen3_moe"), world_size=2, save_contents=("model",),
        lora=LoraSpec(r=2, alpha=4, target_modules=("q_proj", "v_proj"),
                      target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")))
    specs["gpt_neox_embed_out_w2"] = FsdpSpec(model=ModelSpec(family="gpt_neox"), world_size=2,
                                              save_contents=("model",),
                                              key_renames=(("lm_head.weight", "embed_out.weight"),))
    return specs


# verl's default LoRA (trainer config `lora_rank` 4, `lora_alpha` 16, `target_modules`
# all-linear): on a transformers-5 MoE model PEFT adapts the fused experts and the router as parameters and gives
# the fused gate/up rank 2r AND alpha 2 * alpha (scale alpha / r unchanged)
VERL_DEFAULT_LORA = LoraSpec(r=4, alpha=16, target_modules="all-linear")
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe")


def verl_lora_matrix() -> dict[str, FsdpSpec]:
    """verl's default LoRA (`VERL_DEFAULT_LORA`) on every MoE family of the architecture matrix, FSDP2 at
    world 2, model files only (what a LoRA run's ``actor/`` holds), named ``<family>_verl_lora_w2``."""
    return {f"{family}_verl_lora_w2": FsdpSpec(model=ModelSpec(family=family), world_size=2, save_contents=("model",),
                                               lora=VERL_DEFAULT_LORA)
            for family in MOE_FAMILIES}


def write_fixture_matrix(
    root: str | os.PathLike[str],
    reference_root: str | os.PathLike[str] | None = None,
    steps: Sequence[int] = (1,),
    seed: int = 0,
    specs: dict[str, FsdpSpec] | None = None,
) -> dict[str, RunFiles]:
    """Write every variant of `specs` (default `fixture_matrix()`) as a run root/<name>/ with `steps`,
    references under reference_root/<name>/global_step_N/; one process group per world size."""
    specs = fixture_matrix() if specs is None else specs
    runs = {name: (os.path.join(os.fspath(root), name), spec) for name, spec in specs.items()}
    references = os.fspath(reference_root) if reference_root else None
    return _write_runs(runs, steps, seed, references, reference_per_name=True)


def _write_runs(
    runs: dict[str, tuple[str, FsdpSpec]],
    steps: Sequence[int],
    seed: int,
    reference_root: str | None,
    reference_per_name: bool = False,
) -> dict[str, RunFiles]:
    if not steps:
        raise ValueError("a run needs at least one step")
    jobs: list[StepJob] = []
    for name, (root, spec) in runs.items():
        for step in steps:
            reference = None
            if reference_root:
                base = os.path.join(reference_root, name) if reference_per_name else reference_root
                reference = os.path.join(base, f"global_step_{step}")
            jobs.append(StepJob(os.path.join(root, f"global_step_{step}"), spec, seed + step, reference))
    written = write_fsdp_steps(jobs)
    result: dict[str, RunFiles] = {}
    for index, (name, (root, spec)) in enumerate(runs.items()):
        step_files = tuple(written[index * len(steps) : (index + 1) * len(steps)])
        _write_tracker(root, steps[-1], atomic=(spec.role == ""))
        result[name] = RunFiles(os.path.abspath(root), spec, step_files)
    return result


def _write_tracker(root: str, step: int, atomic: bool) -> None:
    """verl's PPO trainer writes the tracker in place; its SFT trainer writes it atomically."""
    path = os.path.join(root, TRACKER_FILE)
    if not atomic:
        with open(path, "w") as handle:
            handle.write(str(step))
        return
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        handle.write(str(step))
    os.replace(temporary, path)


def write_fsdp_steps(jobs: Sequence[StepJob], timeout_s: float = 900.0) -> list[StepFiles]:
    """Write every job; jobs of one world size share one group of processes. Returns files in order."""
    by_world: dict[int, list[StepJob]] = {}
    for job in jobs:
        by_world.setdefault(job.spec.world_size, []).append(job)
    with tempfile.TemporaryDirectory(prefix="synthetic_fsdp_") as scratch:
        groups = [_RankGroup(world, group_jobs, scratch) for world, group_jobs in sorted(by_world.items())]
        try:
            for group in groups:
                group.start()
            deadline = time.monotonic() + timeout_s
            for group in groups:
                group.wait(deadline)
        finally:
            for group in groups:
                group.kill()
    return [_step_files(job) for job in jobs]


class _RankGroup:
    """W worker processes sharing a TCPStore hosted here (port picked by the OS: no race)."""

    def __init__(self, world_size: int, jobs: list[StepJob], scratch: str) -> None:
        self.world_size = world_size
        self.jobs = jobs
        self.scratch = scratch
        self.processes: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self.store = None

    def start(self) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        jobs_path = os.path.join(self.scratch, f"jobs_world_{self.world_size}.json")
        with open(jobs_path, "w") as handle:
            json.dump([job.to_dict() for job in self.jobs], handle)
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        verl = None
        if any(job.spec.writer == "verl" for job in self.jobs):
            from synthetic_runs.verl_lib import verl_lib_dir

            verl = verl_lib_dir()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH"), verl) if p)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.setdefault("PYTHONWARNINGS", "ignore")
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        for rank in range(self.world_size):
            log_path = os.path.join(self.scratch, f"world_{self.world_size}_rank_{rank}.log")
            self.logs.append(log_path)
            with open(log_path, "w") as log:
                command = [
                    sys.executable, "-m", "synthetic_runs.fsdp",
                    jobs_path, str(rank), str(self.world_size), str(self.store.port),
                ]  # fmt: skip
                self.processes.append(
                    subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                )

    def wait(self, deadline: float) -> None:
        while True:
            codes = [process.poll() for process in self.processes]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                self.kill()
                raise SyntheticRunError(self._failure_message(failed[0], f"exited with code {codes[failed[0]]}"))
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise SyntheticRunError(self._failure_message(0, "timed out"))
            time.sleep(0.05)

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        self.store = None

    def _failure_message(self, rank: int, what: str) -> str:
        with open(self.logs[rank], errors="replace") as handle:
            tail = handle.read()[-6000:]
        steps = ", ".join(job.step_dir for job in self.jobs)
        return f"synthetic FSDP rank {rank}/{self.world_size} {what} while writing {steps}\n{tail}"


# --------------------------------------------------------------------------------------------------
# Rank side (runs inside the spawned processes: `python -m synthetic_runs.fsdp`, `rank_main`)
# --------------------------------------------------------------------------------------------------


def run_rank_jobs(jobs: Iterable[StepJob], rank: int, world_size: int, port: int) -> None:
    """Join the process group on 127.0.0.1:port and write this rank's part of every job, in order."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        meshes: dict[tuple, object] = {}
        for job in jobs:
            _write_rank(job, rank, world_size, meshes)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _mesh(spec: FsdpSpec, meshes: dict):
    from torch.distributed.device_mesh import init_device_mesh

    if spec.mesh_shape is None:
        return None
    key = (spec.mesh_shape, spec.mesh_dim_names)
    if key not in meshes:
        meshes[key] = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=spec.mesh_dim_names)
    return meshes[key]


def _seed_rank_rngs(seed: int, rank: int) -> None:
    """Per-rank RNG streams, as a trainer has; their state goes into extra_state."""
    import numpy as np

    value = seed * 1009 + rank
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


def _rng_state() -> dict:
    """What verl's BaseCheckpointManager.get_rng_state() returns on a CPU-only machine."""
    import numpy as np

    return {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}


def _apply_lora(model: torch.nn.Module, lora: LoraSpec) -> torch.nn.Module:
    """verl's LoRA wrapping: peft.get_peft_model(model, LoraConfig(task_type=CAUSAL_LM, ...))."""
    import peft

    config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=lora.r,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
        target_parameters=list(lora.target_parameters) or None,
        bias="none",
    )
    return peft.get_peft_model(model, config)


def _fill_lora_(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(synthetic_value(name, param.shape, seed, param.dtype))


def build_reference_model(spec: FsdpSpec, seed: int) -> torch.nn.Module:
    """The full, unsharded model (PEFT-wrapped for LoRA) whose state dict the rank files shard."""
    model = build_model(spec.model, seed, torch_dtype(spec.dtype))
    if spec.lora is not None:
        model = _apply_lora(model, spec.lora)
        _fill_lora_(model, seed)
    return model


def _write_reference(model: torch.nn.Module, job: StepJob) -> None:
    from safetensors.torch import save_file

    spec = job.spec
    os.makedirs(job.reference_dir, exist_ok=True)
    renames = dict(spec.key_renames)
    state = {renames.get(name, name): tensor.detach().clone().contiguous()
             for name, tensor in model.state_dict().items()}
    save_file(state, os.path.join(job.reference_dir, REFERENCE_STATE_DICT), metadata={"seed": str(job.seed)})
    with open(os.path.join(job.reference_dir, "spec.json"), "w") as handle:
        json.dump({"seed": job.seed, "spec": spec.to_dict()}, handle, indent=2)
    if spec.lora is None:
        hf_dir = os.path.join(job.reference_dir, "hf")
        write_hf_metadata(hf_dir, spec.model, spec.dtype)
        model.save_pretrained(hf_dir)


def _decoder_layer_class(model: torch.nn.Module, spec: FsdpSpec) -> type | tuple[type, ...]:
    """The class FSDP wraps per layer; for a model given by its config, every class of its
    ``_no_split_modules`` (verl's wrap policy: decoder layers and vision blocks alike)."""
    wanted = set(getattr(model, "_no_split_modules", None) or ()) if spec.model.hf_config else \
        {spec.model.decoder_layer_class}
    found = tuple(dict.fromkeys(type(module) for module in model.modules() if type(module).__name__ in wanted))
    if not found:
        raise LookupError(f"no {sorted(wanted)} in the model")
    return found[0] if len(found) == 1 else found


def _verl_fsdp1_wrap_policy(model: torch.nn.Module, spec: FsdpSpec):
    """verl's get_fsdp_wrap_policy: decoder layers, plus (LoRA) every leaf with a trainable weight."""
    import functools

    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    policies = []
    if spec.lora is not None:

        def trainable_leaf(module: torch.nn.Module) -> bool:
            weight = getattr(module, "weight", None)
            return len(list(module.children())) == 0 and weight is not None and weight.requires_grad

        policies.append(functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf))
    layer = _decoder_layer_class(model, spec)
    policies.append(functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(layer if isinstance(layer, tuple) else (layer,))))
    return functools.partial(_or_policy, policies=policies)


def _shard_fsdp1(model: torch.nn.Module, spec: FsdpSpec, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    strategy = ShardingStrategy.HYBRID_SHARD if spec.strategy == "hsdp" else ShardingStrategy.FULL_SHARD
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=_verl_fsdp1_wrap_policy(model, spec),
        device_id=torch.device("cpu"),
        sharding_strategy=strategy,
        device_mesh=mesh,
        use_orig_params=False,
    )


def verl_shard_placement_fn(fsdp_size: int):
    """verl's get_shard_placement_fn: Shard the first dim that divides by fsdp_size, else dim 0."""
    from torch.distributed.tensor import Shard

    def placement(param: torch.nn.Parameter) -> Shard:
        for dim, size in enumerate(param.shape):
            if size % fsdp_size == 0:
                return Shard(dim)
        return Shard(0)

    return placement


def _shard_fsdp2(spec: FsdpSpec, seed: int, mesh) -> tuple[torch.nn.Module, list[str]]:
    """Build on the meta device, fully_shard as verl's apply_fsdp2 does, then fill each LOCAL shard
    from the deterministic full value: memory per rank stays about one shard plus one tensor.
    Returns the model and the state-dict keys it had before sharding."""
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    dtype = torch_dtype(spec.dtype)
    with init_empty_weights(include_buffers=False):  # buffers (rotary inv_freq) stay real
        model = model_class(spec.model)(build_config(spec.model, dtype))
    if spec.model.tie_word_embeddings or spec.model.hf_config:
        model.tie_weights()  # parameters registered through init_empty_weights come out untied
    model.to(dtype)
    if spec.model.extra_buffer:
        register_extra_buffer(model, spec.model, dtype)
    if spec.lora is not None:
        model = _apply_lora(model, spec.lora)
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    unsharded_keys = list(model.state_dict().keys())

    kwargs = {"mesh": mesh}
    if spec.strategy == "fsdp2_tp":
        _parallelize_tp(model, spec, mesh["tp"])
        kwargs = {"mesh": mesh["dp_shard"]}
    if spec.shard_dim == 1:
        kwargs["shard_placement_fn"] = verl_shard_placement_fn(mesh.shape[-1])
    layer_class = _decoder_layer_class(model, spec)
    tied = spec.model.tie_word_embeddings or (bool(spec.model.hf_config) and _is_tied(model))
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    modules = list(model.modules())
    if spec.model.hf_config:
        modules.reverse()  # inner wrapped modules before the ones holding them (FSDP2 shards bottom-up)
    for module in modules:
        shared = any(seen.get(id(p), 0) > 1 for p in module.parameters(recurse=False))  # tied: sharded by its root
        if isinstance(module, layer_class) or (isinstance(module, torch.nn.Embedding) and not tied and not shared):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)

    model.to_empty(device="cpu")
    if tied and not _is_tied(model):
        raise AssertionError("tied embeddings came apart while sharding")
    persistent = set(model.state_dict().keys())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
            if name in persistent and buffer.is_floating_point():
                buffer.copy_(synthetic_value(name, buffer.shape, seed, buffer.dtype))
        for name, param in model.named_parameters():
            full = synthetic_value(name, param.shape, seed, param.dtype)
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
    return model, unsharded_keys


def _parallelize_tp(model: torch.nn.Module, spec: FsdpSpec, tp_mesh) -> None:
    """Each decoder layer's projections over the "tp" mesh, as `TP_PLAN` says."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    layer_class = _decoder_layer_class(model, spec)
    for module in list(model.modules()):
        if isinstance(module, layer_class):
            parallelize_module(module, tp_mesh, {name: styles[kind]() for name, kind in TP_PLAN.items()})


def _is_tied(model: torch.nn.Module) -> bool:
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return output is not None and embedding is not None and output.weight is embedding.weight


def _sharded_model(spec: FsdpSpec, seed: int, mesh, job: StepJob, rank: int) -> tuple[torch.nn.Module, list[str]]:
    """The wrapped model and the state-dict keys of its unsharded form."""
    if spec.fsdp_version == 2:
        if rank == 0 and job.reference_dir:
            _write_reference(build_reference_model(spec, seed), job)
        return _shard_fsdp2(spec, seed, mesh)
    model = build_reference_model(spec, seed)
    if rank == 0 and job.reference_dir:
        _write_reference(model, job)
    keys = list(model.state_dict().keys())
    return _shard_fsdp1(model, spec, mesh), keys


def _constant_schedule_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int):
    """verl's get_constant_schedule_with_warmup (a LambdaLR over a plain function)."""

    def lr_lambda(current_step: int) -> float:
        if current_step < warmup_steps:
            return float(current_step) / float(max(1.0, warmup_steps))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def _local_values(model: torch.nn.Module) -> list[torch.Tensor]:
    values = []
    for param in model.parameters():
        data = param.to_local() if hasattr(param, "to_local") else param
        values.append(data.detach().clone())
    return values


def _train_one_step(model: torch.nn.Module, spec: FsdpSpec):
    """One real AdamW step (lr 0 from the warm-up) on deterministic gradients; no forward pass, so a
    large model needs no all-gathered weights or full-size gradients. Optimizer state is exact too."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR, betas=(0.9, 0.999), weight_decay=0.01)
    scheduler = _constant_schedule_with_warmup(optimizer, _WARMUP_STEPS)
    if "optimizer" not in spec.save_contents:
        # Nothing will show the optimizer's state: keep memory at the shards (a large benchmark model).
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore")
            scheduler.step()
        return optimizer, scheduler
    before = _local_values(model)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:  # a deterministic gradient, laid out like the (sharded) parameter
                param.grad = param.detach() * 0.01 + 0.001
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    after = _local_values(model)
    if not all(torch.equal(a, b) for a, b in zip(before, after)):
        raise AssertionError("the warm-up step changed the weights; the reference would be wrong")
    if not optimizer.state:
        raise AssertionError("the optimizer step left no state")
    return optimizer, scheduler


def _state_dict_context(model: torch.nn.Module, spec: FsdpSpec):
    """verl's get_fsdp_state_ctx: SHARDED_STATE_DICT for FSDP1, nothing for FSDP2."""
    if spec.fsdp_version == 2:
        return contextlib.nullcontext()
    from torch.distributed.fsdp import (
        FullyShardedDataParallel,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    return FullyShardedDataParallel.state_dict_type(
        model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
    )


def _dataloader_state(step: int) -> dict:
    """A StatefulDataLoader-shaped state, as verl's trainer saves in global_step_N/data.pt."""
    generator = torch.Generator().manual_seed(step)
    return {
        "_index_sampler_state": None,
        "_sampler_iter_state": {"samples_yielded": 4 * step, "sampler_iter_state": {"generator": generator.get_state()}},
        "_sampler_iter_yielded": step,
        "_num_yielded": step,
        "_IterableDataset_len_called": None,
        "_shared_seed": None,
        "fetcher_state": None,
        "dataset_state": None,
        "_iterator_finished": False,
    }


def _step_number(step_dir: str) -> int:
    """The number of ``global_step_N``, ``checkpoint-N`` or ``step-N`` (0 for any other name)."""
    match = re.fullmatch(r"(?:global_step_|checkpoint-|step-)(\d+)", os.path.basename(os.path.normpath(step_dir)))
    return int(match.group(1)) if match else 0


def _write_rank(job: StepJob, rank: int, world_size: int, meshes: dict) -> None:
    import torch.distributed as dist

    spec = job.spec
    if spec.world_size != world_size:
        raise ValueError(f"job for world size {spec.world_size} sent to a group of {world_size}")
    files = _step_files(job)
    if rank == 0:
        os.makedirs(files.checkpoint_dir, exist_ok=True)
    _seed_rank_rngs(job.seed, rank)
    mesh = _mesh(spec, meshes)
    model, expected_keys = _sharded_model(spec, job.seed, mesh, job, rank)
    optimizer, scheduler = _train_one_step(model, spec)
    dist.barrier()  # verl: local_mkdir_safe + barrier before anyone writes

    if spec.writer == "verl":
        _save_with_verl(job, model, optimizer, scheduler, expected_keys, files)
        del model, optimizer, scheduler
        return
    if spec.writer in DCP_WRITERS:
        _save_with_dcp(job, model, optimizer, expected_keys, files)
        del model, optimizer, scheduler
        return
    with _state_dict_context(model, spec):
        model_state = model.state_dict()
        if sorted(model_state) != sorted(expected_keys):
            raise AssertionError(f"rank file keys differ from the model's: {sorted(set(model_state) ^ set(expected_keys))}")
        if spec.key_renames:
            renames = dict(spec.key_renames)
            model_state = {renames.get(name, name): value for name, value in model_state.items()}
        torch.save(model_state, os.path.join(files.checkpoint_dir, rank_file_name("model", world_size, rank)))
        if "optimizer" in spec.save_contents:
            path = os.path.join(files.checkpoint_dir, rank_file_name("optim", world_size, rank))
            torch.save(optimizer.state_dict(), path)
        if "extra" in spec.save_contents:
            extra = {"lr_scheduler": scheduler.state_dict(), "rng": _rng_state()}
            torch.save(extra, os.path.join(files.checkpoint_dir, rank_file_name("extra_state", world_size, rank)))

    if rank == 0:
        hf_dir = os.path.join(files.checkpoint_dir, "huggingface")
        write_hf_metadata(hf_dir, spec.model, spec.dtype)
        if spec.lora is not None:
            meta = {"r": spec.lora.r, "lora_alpha": spec.lora.alpha, "task_type": "CAUSAL_LM"}
            with open(os.path.join(files.checkpoint_dir, "lora_train_meta.json"), "w") as handle:
                json.dump(meta, handle, indent=4)
        # Written before the last barrier, as verl does: its presence proves nothing about other ranks.
        with open(os.path.join(files.checkpoint_dir, "fsdp_config.json"), "w") as handle:
            json.dump({"FSDP_version": spec.fsdp_version, "world_size": world_size}, handle, indent=4)
    dist.barrier()

    if "hf_model" in spec.save_contents and rank == 0:
        build_model(spec.model, job.seed, torch_dtype(spec.dtype)).save_pretrained(
            os.path.join(files.checkpoint_dir, "huggingface")
        )
    if rank == 0:
        torch.save(_dataloader_state(_step_number(job.step_dir)), os.path.join(files.step_dir, "data.pt"))
    del model, optimizer, scheduler, model_state


ACCELERATE_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate.utils.constants.FSDP_MODEL_NAME + "_0"
DCP_HF_FILES = 2  # the dcp_hf writer spreads the model over this many files (its fqn_to_index_mapping)


def _save_with_dcp(job: StepJob, model: torch.nn.Module, optimizer, expected_keys: list[str],
                   files: StepFiles) -> None:
    """The step saved by torch.distributed.checkpoint, as the trainers that use it save one:

    - ``accelerate``: Accelerate's own ``save_fsdp_model`` and ``save_fsdp_optimizer`` with a real
      ``FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")`` (what HF Trainer and
      TRL call for each ``checkpoint-N/``): ``pytorch_model_fsdp_0/`` (keys ``model.<name>``), ``optimizer_0/``,
      then rank 0's ``trainer_state.json``; no config (HF Trainer saves none under SHARDED_STATE_DICT);
    - ``torch_dcp``: ``dcp.save(get_model_state_dict(model))`` into the step folder (bare names), config and
      tokenizer beside it;
    - ``dcp_hf``: the same state dict through ``HuggingFaceStorageWriter(save_distributed=True)`` with an
      ``fqn_to_index_mapping`` over `DCP_HF_FILES` files: ``shard-0000R-model-0000K-of-0000M.safetensors`` per
      rank, config and tokenizer beside them.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    spec = job.spec
    directory = files.checkpoint_dir
    if spec.writer == "accelerate":
        from accelerate import PartialState
        from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer

        PartialState(cpu=True)  # Accelerate's logging asks for its state (it joins the process group already made)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
        if sorted(get_model_state_dict(model)) != sorted(expected_keys):
            raise AssertionError("the sharded model's keys differ from the unsharded model's")
        # the accelerator is read only by the FULL/LOCAL paths
        save_fsdp_model(plugin, None, model, directory, adapter_only=spec.adapter_only)
        save_fsdp_optimizer(plugin, None, optimizer, model, directory)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(directory, "trainer_state.json"), "w") as handle:
                json.dump({"global_step": _step_number(job.step_dir), "log_history": []}, handle)
        return
    state = get_model_state_dict(model)
    if sorted(state) != sorted(expected_keys):
        raise AssertionError("the sharded model's keys differ from the unsharded model's")
    if spec.writer == "torch_dcp":
        dcp.save(state, checkpoint_id=directory)
    else:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        names = sorted(state)
        mapping = {name: 1 + (i * DCP_HF_FILES) // len(names) for i, name in enumerate(names)}
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(directory, save_distributed=True,
                                                                fqn_to_index_mapping=mapping))
    dist.barrier()
    if dist.get_rank() == 0:
        write_hf_metadata(directory, spec.model, spec.dtype)


def _save_with_verl(job: StepJob, model: torch.nn.Module, optimizer, scheduler, expected_keys: list[str],
                    files: StepFiles) -> None:
    """verl 0.9.1's own FSDPCheckpointManager.save_checkpoint saves the step (rank files, huggingface/ config
    and tokenizer, fsdp_config.json, lora_train_meta.json); then the trainer's data.pt, as verl's trainer does."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    spec = job.spec
    if sorted(model.state_dict()) != sorted(expected_keys):
        raise AssertionError("the sharded model's keys differ from the unsharded model's")
    tokenizer_dir = os.path.join(files.step_dir, ".tokenizer_rank_" + str(dist.get_rank()))
    write_hf_metadata(tokenizer_dir, spec.model, spec.dtype)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = OmegaConf.create({"save_contents": list(spec.save_contents), "load_contents": list(spec.save_contents)})
    manager = FSDPCheckpointManager(model, optimizer, lr_scheduler=scheduler, processing_class=tokenizer,
                                    checkpoint_config=config)
    manager.save_checkpoint(files.checkpoint_dir, global_step=_step_number(job.step_dir))
    dist.barrier()
    import shutil

    shutil.rmtree(tokenizer_dir)
    if dist.get_rank() == 0:
        torch.save(_dataloader_state(_step_number(job.step_dir)), os.path.join(files.step_dir, "data.pt"))


def rank_main(argv: list[str]) -> int:
    """One spawned rank: ``python -m synthetic_runs.fsdp JOBS.json RANK WORLD PORT``. Reads the jobs (JSON written by
    `write_fsdp_steps`), joins the gloo process group through the parent's TCPStore on 127.0.0.1:PORT and writes
    this rank's files. Returns 0 on success."""
    jobs_path, rank, world_size, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    with open(jobs_path) as handle:
        jobs = [StepJob.from_dict(item) for item in json.load(handle)]
    run_rank_jobs(jobs, rank, world_size, port)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
