"""Session fixtures: real checkpoints written once per test session by real torch.distributed code.

`family_runs`: the architecture matrix of `synthetic_runs.fsdp.family_matrix()`.
`fsdp_runs`: every variant of `synthetic_runs.fixture_matrix()` (FSDP1 with and without a mesh,
FSDP2, HSDP, one rank, tied/untied, Qwen2/Llama, fp32/bf16, buffers, critic, SFT, LoRA) as a verl
run root with one step, plus the exact reference weights each was sharded from.
`lora_steps`: verl Megatron LoRA steps (Megatron-Bridge PEFT) of a tiny Qwen2 and Qwen3-MoE at TP 2, PP 2,
TP 2 x EP 2, both ``use_dist_checkpointing`` settings (`synthetic_runs.megatron_lora`: a writer of our own).
`verl_lora_runs`: verl's default LoRA (all-linear) on every MoE family (`synthetic_runs.fsdp.verl_lora_matrix()`);
`verl_saved_lora_run`: the Mixtral one saved by verl 0.9.1's own FSDPCheckpointManager.
`zero_runs`: DeepSpeed ZeRO-2 (bf16, HF Trainer's ``checkpoint-N/global_stepN/``) and ZeRO-3 (fp32, a bare
engine's ``global_stepN/``) runs of 2 ranks, saved by DeepSpeed itself (`synthetic_runs.deepspeed`).
"""

from __future__ import annotations

import pytest

import synthetic_runs


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory) -> dict[str, synthetic_runs.RunFiles]:
    root = tmp_path_factory.mktemp("synthetic_fsdp")
    return synthetic_runs.write_fixture_matrix(root / "runs", reference_root=root / "references", steps=(1,))


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory):
    """Every variant of `synthetic_runs.megatron.megatron_fixture_matrix()` written once by real
    megatron-core on CPU: name -> job (``step_dir``, ``spec``, ``reference_dir``)."""
    from synthetic_runs.megatron import write_fixture_matrix

    return write_fixture_matrix(tmp_path_factory.mktemp("megatron_fixtures"))


@pytest.fixture(scope="session")
def family_runs(tmp_path_factory) -> dict[str, synthetic_runs.RunFiles]:
    """The architecture matrix (`synthetic_runs.fsdp.family_matrix()`: MoE, vision-language, GPT-NeoX,
    GPT-2 on FSDP1/FSDP2, world 2 and 3) with references (state dict + ``save_pretrained`` folder)."""
    from synthetic_runs.fsdp import family_matrix

    root = tmp_path_factory.mktemp("synthetic_families")
    return synthetic_runs.write_fixture_matrix(root / "runs", reference_root=root / "references", steps=(1,),
                                               specs=family_matrix())


@pytest.fixture(scope="session")
def verl_lora_runs(tmp_path_factory) -> dict[str, synthetic_runs.RunFiles]:
    """verl's default LoRA (all-linear, r 4, alpha 16; `synthetic_runs.fsdp.verl_lora_matrix()`) on every MoE
    family, FSDP2 world 2 on gloo, with references: ``build_reference_model(spec, seed)`` is the trained
    PeftModel, built by PEFT itself."""
    from synthetic_runs.fsdp import verl_lora_matrix

    root = tmp_path_factory.mktemp("synthetic_verl_lora")
    return synthetic_runs.write_fixture_matrix(root / "runs", reference_root=root / "references", steps=(1,),
                                               specs=verl_lora_matrix())


LORA_ALPHA = 8.0
LORA_STEPS = {  # name -> (family, tp, pp, ep, use_dist_checkpointing, PEFT export)
    "dense_tp2": ("qwen2", 2, 1, 1, False, True),
    "dense_pp2": ("qwen2", 1, 2, 1, False, True),
    "llama_tp2": ("llama", 2, 1, 1, False, True),
    "dense_pp2_dist": ("qwen2", 1, 2, 1, True, False),
    "dense_tp2_dist": ("qwen2", 2, 1, 1, True, False),
    "dense_tp2_noexport": ("qwen2", 2, 1, 1, False, False),
    "moe_tp2_ep2": ("qwen3_moe", 2, 1, 2, False, True),
    "moe_ep2_dist": ("qwen3_moe", 1, 1, 2, True, False),
}


@pytest.fixture(scope="session")
def lora_steps(tmp_path_factory):
    """name -> `synthetic_runs.megatron_lora.LoraStep`, each a run root with one step (``global_step_1/actor``)."""
    from synthetic_runs.megatron_lora import LoraRunSpec, write_base, write_lora_step
    from synthetic_runs.models import ModelSpec

    root = tmp_path_factory.mktemp("megatron_lora")
    bases = {family: write_base(root / f"base_{family}", ModelSpec(family=family), seed=0)
             for family in ("qwen2", "llama", "qwen3_moe")}
    steps = {}
    for name, (family, tp, pp, ep, dist, export) in LORA_STEPS.items():
        spec = LoraRunSpec(ModelSpec(family=family), tp=tp, pp=pp, ep=ep, use_dist_checkpointing=dist,
                           peft_folder=export, alpha=LORA_ALPHA)
        steps[name] = write_lora_step(root / name / "global_step_1" / "actor", spec, bases[family])
    return steps


@pytest.fixture(scope="session")
def verl_saved_lora_run(tmp_path_factory) -> synthetic_runs.RunFiles:
    """Mixtral with verl's default LoRA, FSDP2 world 2, the step saved by verl 0.9.1's OWN
    ``FSDPCheckpointManager.save_checkpoint`` (`synthetic_runs.verl_lib`: installed once per machine), with
    the same weights as ``verl_lora_runs["mixtral_verl_lora_w2"]``."""
    import dataclasses

    from synthetic_runs.fsdp import verl_lora_matrix

    spec = dataclasses.replace(verl_lora_matrix()["mixtral_verl_lora_w2"], writer="verl")
    root = tmp_path_factory.mktemp("synthetic_verl_saved")
    runs = synthetic_runs.write_fixture_matrix(root / "runs", reference_root=root / "references", steps=(1,),
                                               specs={"mixtral_verl_saved": spec})
    return runs["mixtral_verl_saved"]


DCP_STEP_FOLDERS = {"accelerate": "checkpoint-1", "torch_dcp": "step-1", "dcp_hf": "step-1"}


@pytest.fixture(scope="session")
def dcp_runs(tmp_path_factory) -> dict[str, synthetic_runs.StepFiles]:
    """A tiny Qwen2 sharded by FSDP2 over 2 gloo ranks and saved by each DCP writer of `synthetic_runs.fsdp`
    (``accelerate``: Accelerate's own save_fsdp_model / save_fsdp_optimizer, ``checkpoint-1/pytorch_model_fsdp_0/``
    without a config, as HF Trainer saves it; ``torch_dcp``: ``dcp.save`` into ``step-1/``; ``dcp_hf``:
    ``HuggingFaceStorageWriter`` rank files in ``step-1/``), each in a run root of its own, with references."""
    from synthetic_runs.fsdp import FsdpSpec, StepJob, write_fsdp_steps

    root = tmp_path_factory.mktemp("synthetic_dcp")
    jobs = [StepJob(str(root / writer / "run" / folder), FsdpSpec(world_size=2, role="", writer=writer), seed=3,
                    reference_dir=str(root / writer / "reference"))
            for writer, folder in DCP_STEP_FOLDERS.items()]
    return dict(zip(DCP_STEP_FOLDERS, write_fsdp_steps(jobs)))


ZERO_SPECS = {"zero1_bf16": dict(stage=1, dtype="bfloat16", trainer="hf_trainer"),
              "zero2_bf16": dict(stage=2, dtype="bfloat16", trainer="hf_trainer"),
              "zero3_fp32": dict(stage=3, dtype="float32", trainer="deepspeed")}


@pytest.fixture(scope="session")
def zero_runs(tmp_path_factory):
    """name -> `synthetic_runs.deepspeed.ZeroRun` of `ZERO_SPECS`, step 1, written once by real DeepSpeed."""
    from synthetic_runs.deepspeed import ZeroSpec, write_zero_run

    root = tmp_path_factory.mktemp("zero_fixtures")
    return {name: write_zero_run(root / name, ZeroSpec(**spec), steps=(1,), reference_root=root / f"{name}_ref")
            for name, spec in ZERO_SPECS.items()}


@pytest.fixture(scope="session")
def dcp_lora_runs(tmp_path_factory) -> dict[str, synthetic_runs.StepFiles]:
    """A tiny Qwen2 PEFT-wrapped (LoRA r=4, alpha=8 on q/v), sharded by FSDP2 over 2 gloo ranks and saved by
    Accelerate's own save_fsdp_model into ``checkpoint-1/pytorch_model_fsdp_0/``: ``full``, the whole PEFT model
    (Accelerate's default); ``adapter``, the adapter only (HF Trainer's ``adapter_only=True``). No config saved:
    the model's is in ``<root>/hf``."""
    from synthetic_runs.fsdp import FsdpSpec, LoraSpec, StepJob, write_fsdp_steps
    from synthetic_runs.models import write_hf_metadata

    root = tmp_path_factory.mktemp("synthetic_dcp_lora")
    jobs = [StepJob(str(root / name / "run" / "checkpoint-1"),
                    FsdpSpec(world_size=2, role="", writer="accelerate", lora=LoraSpec(), adapter_only=adapter_only),
                    seed=3, reference_dir=str(root / name / "reference"))
            for name, adapter_only in (("full", False), ("adapter", True))]
    steps = dict(zip(("full", "adapter"), write_fsdp_steps(jobs)))
    write_hf_metadata(root / "hf", jobs[0].spec.model)
    return steps


ZERO_LORA_SPECS = {"lora_zero2_fp32": dict(stage=2, dtype="float32", trainer="deepspeed"),
                   "lora_zero2_hf_trainer": dict(stage=2, dtype="bfloat16", trainer="hf_trainer")}


@pytest.fixture(scope="session")
def zero_lora_runs(tmp_path_factory):
    """name -> `synthetic_runs.deepspeed.ZeroRun` of a PEFT-wrapped tiny Qwen2 (LoRA r=4, alpha=8 on q/v) saved by
    real DeepSpeed over 2 gloo ranks (`ZERO_LORA_SPECS`): a bare engine at stage 2 in fp32 (the frozen base in the model
    states file), HF Trainer's save at stage 2 in bf16 (adapter masters only, PEFT's adapter files beside)."""
    from synthetic_runs.deepspeed import ZeroSpec, write_zero_run
    from synthetic_runs.fsdp import LoraSpec

    root = tmp_path_factory.mktemp("zero_lora_fixtures")
    return {name: write_zero_run(root / name, ZeroSpec(**spec, lora=LoraSpec()), steps=(1,),
                                 reference_root=root / f"{name}_ref")
            for name, spec in ZERO_LORA_SPECS.items()}
