"""Real models and adapters for the LoRA tests, each written once per session.

- `tiny_base`: a Qwen2 causal LM (synthetic_runs' deterministic weights) saved with save_pretrained.
- `peft_adapters`: real PEFT adapters on that base (peft.get_peft_model + save_pretrained), with
  non-zero B so every adapter changes the logits; they cover rank/alpha patterns, rsLoRA, an
  embedding LoRA and a module to save.
- `gpt2_base` / `gpt2_adapter`: fan_in_fan_out (GPT-2's Conv1D stores weights as (in, out)).
- `fsdp_lora_runs`: the verl FSDP1 and FSDP2 LoRA checkpoints of the session's `fsdp_runs` (the
  fixture matrix, written once for the whole suite; 4 ranks, r=2 leaves ranks 2 and 3 with EMPTY
  lora_A shards).
- `lora_only_checkpoint`: the FSDP2 one with only its LoRA keys kept in every rank file.
- `single_rank_lora_checkpoint`: a world-size-1 checkpoint of a PEFT model with an embedding LoRA and
  a trained lm_head copy (modules_to_save), written the way verl's single-rank save writes it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import pytest
import torch

LORA_RUNS = ("lora_fsdp1_mesh_qwen2", "lora_fsdp2_qwen2_r2")
TOKENS = torch.arange(1, 41).reshape(2, 20)  # inside every synthetic tokenizer's vocabulary


def logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def load_causal_lm(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def peft_logits(base_dir: str, adapter_dir: str, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """Logits of PeftModel.from_pretrained(base, adapter): the reference behaviour."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(base_dir), adapter_dir).eval()
    return logits(model, tokens)


def fill_lora_(model: torch.nn.Module, seed: int) -> None:
    """Random, non-zero LoRA factors (and trained copies), deterministic per seed and name."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name or "modules_to_save" in name:
                scale = 0.3 if "modules_to_save" in name else 0.5 / max(param.shape[-1], 1) ** 0.5
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def save_adapter(base: torch.nn.Module, config, directory: str, seed: int) -> str:
    import peft

    model = peft.get_peft_model(base, config)
    fill_lora_(model, seed)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def base_spec():
    from synthetic_runs.models import ModelSpec

    return ModelSpec(family="qwen2")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, base_spec) -> str:
    from synthetic_runs.models import build_model, write_hf_metadata

    directory = str(tmp_path_factory.mktemp("tiny_base"))
    write_hf_metadata(directory, base_spec)
    build_model(base_spec, seed=11).save_pretrained(directory)
    return directory


ADAPTER_CONFIGS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "qv2": dict(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj"]),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"],
                     rank_pattern={"layers.1.self_attn.q_proj": 2, "gate_proj": 3}, alpha_pattern={"o_proj": 3}),
    "rslora": dict(r=4, lora_alpha=6, target_modules=["up_proj", "down_proj"], use_rslora=True),
    "embed_save": dict(r=3, lora_alpha=6, target_modules=["embed_tokens", "v_proj"], modules_to_save=["lm_head"]),
}


@pytest.fixture(scope="session")
def peft_adapters(tmp_path_factory, tiny_base) -> dict[str, str]:
    import peft

    root = tmp_path_factory.mktemp("adapters")
    adapters = {}
    for seed, (name, kwargs) in enumerate(ADAPTER_CONFIGS.items()):
        config = peft.LoraConfig(task_type="CAUSAL_LM", **kwargs)
        adapters[name] = save_adapter(load_causal_lm(tiny_base), config, str(root / name), seed=100 + seed)
    return adapters


@pytest.fixture(scope="session")
def gpt2_base(tmp_path_factory) -> str:
    import transformers

    directory = str(tmp_path_factory.mktemp("gpt2_base"))
    config = transformers.GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(5)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def gpt2_adapter(tmp_path_factory, gpt2_base) -> str:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                             task_type="CAUSAL_LM")
    return save_adapter(load_causal_lm(gpt2_base), config, str(tmp_path_factory.mktemp("gpt2_adapter")), seed=7)


@dataclass(frozen=True)
class LoraRun:
    """A verl LoRA checkpoint and what it must merge to."""

    checkpoint_dir: str
    spec: object  # synthetic_runs.fsdp.FsdpSpec
    seed: int

    def trained_model(self) -> torch.nn.Module:
        from synthetic_runs.fsdp import build_reference_model

        return build_reference_model(self.spec, self.seed).eval()

    def base_model(self) -> torch.nn.Module:
        from synthetic_runs.models import build_model, torch_dtype

        return build_model(self.spec.model, self.seed, torch_dtype(self.spec.dtype)).eval()


@pytest.fixture(scope="session")
def fsdp_lora_runs(fsdp_runs) -> dict[str, LoraRun]:
    """The LoRA variants of the session's fixture matrix (tests/fixtures_checkpoints.py: written once)."""
    return {name: LoraRun(fsdp_runs[name].latest.checkpoint_dir, fsdp_runs[name].spec, fsdp_runs[name].latest.seed)
            for name in LORA_RUNS}


def copy_checkpoint(source: str, destination: str, *, drop: tuple[str, ...] = ()) -> str:
    shutil.copytree(source, destination, ignore=lambda _, names: [n for n in names if n in drop])
    return destination


@pytest.fixture(scope="session")
def lora_only_checkpoint(tmp_path_factory, fsdp_lora_runs) -> LoraRun:
    """The FSDP2 run with only LoRA keys in each rank file (what a LoRA-only save holds)."""
    import torch.distributed.tensor  # noqa: F401 - DTensor must be importable to load these files

    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    target = copy_checkpoint(run.checkpoint_dir, str(tmp_path_factory.mktemp("lora_only") / "actor"))
    for name in os.listdir(target):
        if name.startswith("model_world_size_"):
            path = os.path.join(target, name)
            state = torch.load(path, weights_only=True)
            torch.save({k: v for k, v in state.items() if ".lora_" in k}, path)
    return LoraRun(target, run.spec, run.seed)


@pytest.fixture(scope="session")
def single_rank_lora_checkpoint(tmp_path_factory, base_spec) -> tuple[str, torch.nn.Module, str]:
    """(checkpoint dir, the trained PEFT model, its base HF folder)."""
    import peft

    from synthetic_runs.models import build_model, write_hf_metadata

    root = tmp_path_factory.mktemp("single_rank_lora")
    base_dir = str(root / "base")
    write_hf_metadata(base_dir, base_spec)
    build_model(base_spec, seed=21).save_pretrained(base_dir)
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=3, target_modules=["embed_tokens", "o_proj"],
                             modules_to_save=["lm_head"])
    model = peft.get_peft_model(load_causal_lm(base_dir), config)
    fill_lora_(model, seed=9)
    checkpoint = root / "actor"
    checkpoint.mkdir()
    torch.save(model.state_dict(), checkpoint / "model_world_size_1_rank_0.pt")
    (checkpoint / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    (checkpoint / "lora_train_meta.json").write_text(json.dumps({"r": 2, "lora_alpha": 3, "task_type": "CAUSAL_LM"}))
    write_hf_metadata(str(checkpoint / "huggingface"), base_spec)
    return str(checkpoint), model.eval(), base_dir


@dataclass(frozen=True)
class PeftCheckpoint:
    """A world-size-1 verl checkpoint of a PEFT-wrapped model, and that trained model."""

    checkpoint_dir: str
    model: torch.nn.Module


# family -> LoRA settings of the single-rank checkpoints (`single_rank_family_loras`)
FAMILY_LORAS = {
    # LoRA on Mixtral's fused experts (PEFT target_parameters): Hub names block_sparse_moe.experts.N.w1/w3/w2
    "mixtral": dict(r=2, lora_alpha=6, target_modules=["k_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # Qwen2-MoE: shared expert + fused experts (PEFT 0.21 does not convert its per-expert adapters under v5)
    "qwen2_moe": dict(r=2, lora_alpha=4, target_modules=["o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # a vision-language model: transformers v5 holds the language model under model.language_model
    "qwen2_vl": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
}


@pytest.fixture(scope="session")
def single_rank_family_loras(tmp_path_factory) -> dict[str, PeftCheckpoint]:
    """`FAMILY_LORAS` as world-size-1 checkpoints (a PEFT model's state dict, verl's small files)."""
    import peft

    from synthetic_runs.models import ModelSpec, build_model, write_hf_metadata

    checkpoints = {}
    for seed, (family, settings) in enumerate(sorted(FAMILY_LORAS.items())):
        spec = ModelSpec(family=family)
        model = peft.get_peft_model(build_model(spec, seed=31 + seed),
                                    peft.LoraConfig(task_type="CAUSAL_LM", **settings))
        fill_lora_(model, seed=41 + seed)
        checkpoint = tmp_path_factory.mktemp(f"single_rank_{family}") / "actor"
        checkpoint.mkdir()
        torch.save(model.state_dict(), checkpoint / "model_world_size_1_rank_0.pt")
        (checkpoint / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
        meta = {"r": settings["r"], "lora_alpha": settings["lora_alpha"], "task_type": "CAUSAL_LM"}
        (checkpoint / "lora_train_meta.json").write_text(json.dumps(meta))
        write_hf_metadata(str(checkpoint / "huggingface"), spec)
        checkpoints[family] = PeftCheckpoint(str(checkpoint), model.eval())
    return checkpoints
