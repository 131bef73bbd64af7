"""Output identity: every file stepmerge's command line writes for the test suite's synthetic checkpoints,
as (relative path, size, sha256), so that a refactor can be shown to change no output byte.

    python -m benchmarks.output_identity --out NEW.json                      # every case
    python -m benchmarks.output_identity --out NEW.json --compare BASE.json  # ... and exit 1 on any difference
    python -m benchmarks.output_identity --compare BASE.json --with NEW.json # two saved records, no run
    python -m benchmarks.output_identity --list                              # the cases
    python -m benchmarks.output_identity --out X.json --cases merge/hf_bf16 --keep DIR
    python -m benchmarks.output_identity --out X.json --inputs DIR --jobs 2   # DIR's inputs, cases 2 at a time

What it does:
1. Builds the inputs the cases need into a fresh temp dir with fixed seeds, through `synthetic_runs`' own
   writers (real torch.distributed FSDP/FSDP2/HSDP ranks on gloo, real megatron-core, the Megatron LoRA
   writer) and PEFT itself (adapters on a tiny Qwen2): the variants of the suite's session fixtures
   (tests/fixtures_checkpoints.py, tests/merge_engine/lora/conftest.py), tiny configs.
2. Runs every case (`CASES`) as ``python -m merge_engine ...`` in a child process whose ``PYTHONPATH`` is this
   checkout, so it drives the public command line only and works whatever the engine's modules are called
   (``--batch``: ``--jobs`` children each run their share of the cases one after the other the way ``python -m``
   does, runpy of the package's ``__main__``: the imports paid once per child, the same bytes).
3. Records, per case, the command, its exit code, its stdout (and the ``planned``/``note``/``error`` lines of
   stderr) with durations and the temp dir masked, and every output file: path, size, sha256. The input files'
   hashes are recorded too (``inputs``) and their differences shown, not counted: torch.save writes a random
   ``serialization_id`` into every archive, so the FSDP and Megatron inputs differ on every build.

Normalisation (every output file is recorded, none skipped): the temp dir's path in any file's bytes is replaced
by ``<WORK>`` before hashing (the file is then marked ``"normalized": ["work_root"]``); in ``stepmerge.json`` the
size and sha256 it records for such a file (they follow the temp path) are replaced by ``"<SIZE OF THE FILE>"`` /
``"<SHA256 OF THE FILE>"`` where they are that file's own (``"path_holders"``); JSON files named in
`VOLATILE_KEYS` have those keys' values (each dropped with its reason) replaced by ``"<VOLATILE>"`` in their bytes
before hashing, and the rest of the document is kept as JSON (``"json"``) to say which key differs. Nothing else
is masked. The inputs are built with PYTHONHASHSEED=0 (PEFT writes ``target_modules`` from a set); the cases run
with a random one, as users run them.

``--compare`` prints every difference (case, file, what differs: missing / extra / size / sha256 / each JSON
key / exit code / stdout line) and exits 1 if there is any; 0 when identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1
WORK_MARK = "<WORK>"
VOLATILE_MARK = b'"<VOLATILE>"'
FILE_SIZE_MARK = b'"<SIZE OF THE FILE>"'
FILE_SHA_MARK = b'"<SHA256 OF THE FILE>"'
PROVENANCE_FILE = "stepmerge.json"
CASE_TIMEOUT_S = 600

# (file name, JSON key path) -> why it legitimately differs from run to run. A key path is dot-separated from
# the top of the JSON object. Only these keys' values are masked; the rest of the file is compared byte for byte.
VOLATILE_KEYS: dict[tuple[str, str], str] = {
    ("stepmerge.json", "fingerprint"):
        "sha256 of the source's listing, whose local file versions are mtime_ns-inode of inputs written afresh",
}

# --------------------------------------------------------------------------------------------------
# Inputs: which synthetic checkpoints, built how
# --------------------------------------------------------------------------------------------------

# name -> (matrix, spec name): FSDP variants of synthetic_runs.fsdp's fixture, family and verl-LoRA matrices
FSDP_RUNS: dict[str, tuple[str, str]] = {
    "fsdp1_mesh_qwen2": ("fixture", "fsdp1_mesh_qwen2"),
    "fsdp1_mesh_llama_tied_bf16": ("fixture", "fsdp1_mesh_llama_tied_bf16"),
    "fsdp1_sharded_tensor_llama": ("fixture", "fsdp1_sharded_tensor_llama"),
    "fsdp2_qwen2_tied_bf16": ("fixture", "fsdp2_qwen2_tied_bf16"),
    "fsdp2_llama_buffer_mqa": ("fixture", "fsdp2_llama_buffer_mqa"),
    "fsdp2_shard_dim1_qwen2": ("fixture", "fsdp2_shard_dim1_qwen2"),
    "hsdp_qwen2_buffer": ("fixture", "hsdp_qwen2_buffer"),
    "fsdp2_hsdp_llama": ("fixture", "fsdp2_hsdp_llama"),
    "single_qwen2": ("fixture", "single_qwen2"),
    "critic_fsdp2_qwen2": ("fixture", "critic_fsdp2_qwen2"),
    "sft_fsdp1_mesh_llama": ("fixture", "sft_fsdp1_mesh_llama"),
    "fsdp1_mesh_qwen2_hf_model_no_optim": ("fixture", "fsdp1_mesh_qwen2_hf_model_no_optim"),
    "lora_fsdp1_mesh_qwen2": ("fixture", "lora_fsdp1_mesh_qwen2"),
    "lora_fsdp2_qwen2_r2": ("fixture", "lora_fsdp2_qwen2_r2"),
    "qwen3_moe_w2": ("family", "qwen3_moe_w2"),
    "qwen3_moe_fsdp1_w2": ("family", "qwen3_moe_fsdp1_w2"),
    "mixtral_w3": ("family", "mixtral_w3"),
    "qwen2_vl_w2": ("family", "qwen2_vl_w2"),
    "gpt_neox_embed_out_w2": ("family", "gpt_neox_embed_out_w2"),
    "qwen2_tp_w4": ("family", "qwen2_tp_w4"),
    "gpt2_lora_w2": ("family", "gpt2_lora_w2"),
    "qwen3_moe_lora_w2": ("family", "qwen3_moe_lora_w2"),
    "mixtral_verl_lora_w2": ("verl_lora", "mixtral_verl_lora_w2"),
    "qwen3_moe_verl_lora_w2": ("verl_lora", "qwen3_moe_verl_lora_w2"),
}

# synthetic_runs.megatron.megatron_fixture_matrix() names
MEGATRON_RUNS: tuple[str, ...] = (
    "llama_tp2_pp2_vpp2_legacy", "qwen2_tp2_pp1_tied_legacy", "mixtral_ep2_legacy", "llama_tp2_pp2_te_legacy",
    "qwen2_pp2_vpp2_tied_megatron_lm", "mistral_tp2_pp2_tied_dist_v2", "qwen3_tp2_kv1_pp2_vpp2_dist_v1",
    "qwen2_moe_ep2_dist_v2", "mixtral_tp2_megatron_lm_dist", "qwen2_tp2_pp2_bridge_v2", "deepseek_v3_ep2_legacy",
)

# tests/fixtures_checkpoints.py LORA_STEPS: name -> (family, tp, pp, ep, use_dist_checkpointing, PEFT export)
MEGATRON_LORA_STEPS: dict[str, tuple[str, int, int, int, bool, bool]] = {
    "dense_tp2": ("qwen2", 2, 1, 1, False, True),
    "dense_pp2_dist": ("qwen2", 1, 2, 1, True, False),
    "dense_tp2_noexport": ("qwen2", 2, 1, 1, False, False),
    "moe_tp2_ep2": ("qwen3_moe", 2, 1, 2, False, True),
}
MEGATRON_LORA_ALPHA = 8.0

# tests/merge_engine/lora/conftest.py ADAPTER_CONFIGS (PEFT LoraConfig arguments) on the tiny Qwen2 base
PEFT_ADAPTERS: dict[str, dict] = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "qv2": dict(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj"]),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"],
                     rank_pattern={"layers.1.self_attn.q_proj": 2, "gate_proj": 3}, alpha_pattern={"o_proj": 3}),
    "rslora": dict(r=4, lora_alpha=6, target_modules=["up_proj", "down_proj"], use_rslora=True),
    "embed_save": dict(r=3, lora_alpha=6, target_modules=["embed_tokens", "v_proj"], modules_to_save=["lm_head"]),
}
HF_BASE_SEED, HF_FINETUNED_SEED = 11, 12


@dataclass(frozen=True)
class Case:
    """One command line. ``args`` may hold ``{out}`` (the case's target folder) and ``{KIND:NAME}`` input
    placeholders: ``fsdp:`` a run's checkpoint folder, ``megatron:`` / ``megatron_hf:`` a Megatron
    checkpoint / its reference Hugging Face folder, ``mlora:`` / ``mlora_base:`` a Megatron LoRA step / its base,
    ``hf:`` a Hugging Face folder or PEFT adapter (`PEFT_ADAPTERS`, ``base``, ``finetuned``), ``case:`` the
    output folder of an earlier case (its path inside, after a ``/``)."""

    name: str
    args: tuple[str, ...]

    @property
    def command(self) -> str:
        return self.args[0]

    def inputs(self) -> list[tuple[str, str]]:
        return [(kind, name) for arg in self.args for kind, name in _PLACEHOLDER.findall(arg)]


_PLACEHOLDER = re.compile(r"\{(fsdp|megatron|megatron_hf|mlora|mlora_base|hf|case):([^}]+)\}")


def _merge(name: str, source: str, *extra: str) -> Case:
    return Case(f"merge/{name}", ("merge", "--local_dir", source, "--target_dir", "{out}", *extra))


def _cases() -> list[Case]:
    cases = [
        # FSDP layouts (verl's fsdp checkpoint manager), default options: Hub format, dtype as stored
        _merge("fsdp1_mesh_qwen2", "{fsdp:fsdp1_mesh_qwen2}", "--backend", "fsdp"),
        _merge("fsdp1_mesh_llama_tied_bf16", "{fsdp:fsdp1_mesh_llama_tied_bf16}"),
        _merge("fsdp1_sharded_tensor_llama", "{fsdp:fsdp1_sharded_tensor_llama}"),
        _merge("fsdp2_qwen2_tied_bf16", "{fsdp:fsdp2_qwen2_tied_bf16}"),
        _merge("fsdp2_qwen2_tied_bf16_to_fp32", "{fsdp:fsdp2_qwen2_tied_bf16}", "--dtype", "float32"),
        _merge("fsdp2_llama_buffer_mqa_shards", "{fsdp:fsdp2_llama_buffer_mqa}", "--max-shard-size", "100KB"),
        _merge("fsdp2_shard_dim1_qwen2_bf16", "{fsdp:fsdp2_shard_dim1_qwen2}", "--dtype", "bf16"),
        _merge("hsdp_qwen2_buffer", "{fsdp:hsdp_qwen2_buffer}"),
        _merge("fsdp2_hsdp_llama_bf16", "{fsdp:fsdp2_hsdp_llama}", "--dtype", "bfloat16"),
        _merge("single_qwen2_fp16", "{fsdp:single_qwen2}", "--dtype", "fp16"),
        _merge("critic_fsdp2_qwen2", "{fsdp:critic_fsdp2_qwen2}"),
        _merge("sft_fsdp1_mesh_llama", "{fsdp:sft_fsdp1_mesh_llama}"),
        _merge("fsdp1_mesh_qwen2_hf_model_no_optim", "{fsdp:fsdp1_mesh_qwen2_hf_model_no_optim}"),
        _merge("lora_fsdp1_mesh_qwen2_fused", "{fsdp:lora_fsdp1_mesh_qwen2}"),
        _merge("lora_fsdp2_qwen2_r2_fused_bf16", "{fsdp:lora_fsdp2_qwen2_r2}", "--dtype", "bfloat16"),
        # the architecture matrix: MoE (Hub per-expert tensors vs transformers' fused), VL, TP, renamed heads
        _merge("qwen3_moe_w2_hub", "{fsdp:qwen3_moe_w2}"),
        _merge("qwen3_moe_w2_transformers", "{fsdp:qwen3_moe_w2}", "--weights-format", "transformers"),
        _merge("qwen3_moe_fsdp1_w2", "{fsdp:qwen3_moe_fsdp1_w2}"),
        _merge("mixtral_w3_hub_shards", "{fsdp:mixtral_w3}", "--max-shard-size", "300KB"),
        _merge("qwen2_vl_w2_hub", "{fsdp:qwen2_vl_w2}"),
        _merge("qwen2_vl_w2_transformers", "{fsdp:qwen2_vl_w2}", "--weights-format", "transformers"),
        _merge("gpt_neox_embed_out_w2", "{fsdp:gpt_neox_embed_out_w2}"),
        _merge("qwen2_tp_w4", "{fsdp:qwen2_tp_w4}"),
        _merge("gpt2_lora_w2_fused", "{fsdp:gpt2_lora_w2}"),
        _merge("qwen3_moe_lora_w2_fused", "{fsdp:qwen3_moe_lora_w2}"),
        _merge("mixtral_verl_lora_w2_fused", "{fsdp:mixtral_verl_lora_w2}"),
        # Megatron: legacy TP/PP/VPP/EP (local and TE names), Megatron-LM, torch_dist (v1/v2), bridge, MTP
        *(_merge(name, "{megatron:" + name + "}", "--backend", "megatron") for name in MEGATRON_RUNS
          if not name.startswith(("deepseek", "qwen2_moe")) and "megatron_lm" not in name),
        *(_merge(name, "{megatron:" + name + "}", "--backend", "megatron", "--hf_model_path",
                 "{megatron_hf:" + name + "}") for name in MEGATRON_RUNS if "megatron_lm" in name),
        _merge("qwen2_moe_ep2_dist_v2_hub", "{megatron:qwen2_moe_ep2_dist_v2}"),
        _merge("qwen2_moe_ep2_dist_v2_transformers", "{megatron:qwen2_moe_ep2_dist_v2}", "--weights-format",
               "transformers"),
        _merge("deepseek_v3_ep2_legacy_mtp_export", "{megatron:deepseek_v3_ep2_legacy}", "--mtp-layers", "export"),
        _merge("deepseek_v3_ep2_legacy_mtp_drop_bf16", "{megatron:deepseek_v3_ep2_legacy}", "--mtp-layers", "drop",
               "--dtype", "bfloat16"),
        # Megatron LoRA (verl + Megatron-Bridge PEFT): fused with the named base, or with the base in dist_ckpt
        _merge("mlora_dense_tp2_fused", "{mlora:dense_tp2}", "--base-model", "{mlora_base:dense_tp2}"),
        _merge("mlora_moe_tp2_ep2_fused", "{mlora:moe_tp2_ep2}", "--backend", "megatron", "--base-model",
               "{mlora_base:moe_tp2_ep2}"),
        _merge("mlora_dense_pp2_dist_fused", "{mlora:dense_pp2_dist}", "--hf_model_path",
               "{mlora_base:dense_pp2_dist}", "--lora-alpha", "8"),
        _merge("mlora_dense_tp2_noexport_fused", "{mlora:dense_tp2_noexport}", "--base-model",
               "{mlora_base:dense_tp2_noexport}", "--lora-alpha", "8"),
        # a Hugging Face folder re-written (dtype cast, Hub config)
        _merge("hf_bf16", "{hf:base}", "--backend", "hf", "--dtype", "bf16"),
        # extract-lora: adapter + clean base from a LoRA training checkpoint
        Case("extract/lora_fsdp1_mesh_qwen2", ("extract-lora", "--local_dir", "{fsdp:lora_fsdp1_mesh_qwen2}",
                                               "--target_dir", "{out}")),
        Case("extract/lora_fsdp2_qwen2_r2_adapter_only",
             ("extract-lora", "--local_dir", "{fsdp:lora_fsdp2_qwen2_r2}", "--target_dir", "{out}", "--adapter-only")),
        Case("extract/gpt2_lora_w2", ("extract-lora", "--local_dir", "{fsdp:gpt2_lora_w2}", "--target_dir", "{out}")),
        Case("extract/qwen3_moe_lora_w2_hub", ("extract-lora", "--local_dir", "{fsdp:qwen3_moe_lora_w2}",
                                               "--target_dir", "{out}")),
        Case("extract/qwen3_moe_lora_w2_transformers",
             ("extract-lora", "--local_dir", "{fsdp:qwen3_moe_lora_w2}", "--target_dir", "{out}",
              "--weights-format", "transformers")),
        Case("extract/mixtral_verl_lora_w2", ("extract-lora", "--local_dir", "{fsdp:mixtral_verl_lora_w2}",
                                              "--target_dir", "{out}")),
        Case("extract/qwen3_moe_verl_lora_w2_bf16",
             ("extract-lora", "--local_dir", "{fsdp:qwen3_moe_verl_lora_w2}", "--target_dir", "{out}",
              "--dtype", "bfloat16")),
        Case("extract/mlora_dense_tp2", ("extract-lora", "--local_dir", "{mlora:dense_tp2}", "--target_dir", "{out}",
                                         "--base-model", "{mlora_base:dense_tp2}")),
        Case("extract/mlora_dense_tp2_noexport",
             ("extract-lora", "--local_dir", "{mlora:dense_tp2_noexport}", "--target_dir", "{out}",
              "--adapter-only", "--hf_model_path", "{mlora_base:dense_tp2_noexport}", "--lora-alpha", "8")),
        Case("extract/mlora_moe_tp2_ep2", ("extract-lora", "--local_dir", "{mlora:moe_tp2_ep2}", "--target_dir",
                                           "{out}", "--adapter-only")),
        Case("extract/mlora_dense_pp2_dist_with_base", ("extract-lora", "--local_dir", "{mlora:dense_pp2_dist}",
                                                        "--target_dir", "{out}", "--hf_model_path",
                                                        "{mlora_base:dense_pp2_dist}", "--lora-alpha", "8")),
        # extract-lora --finetuned: SVD of (fine-tune - base)
        Case("svd/hf_rank2", ("extract-lora", "--finetuned", "{hf:finetuned}", "--base-model", "{hf:base}",
                              "--target_dir", "{out}", "--rank", "2", "--device", "cpu")),
        Case("svd/hf_energy_qv", ("extract-lora", "--finetuned", "{hf:finetuned}", "--base-model", "{hf:base}",
                                  "--target_dir", "{out}", "--energy", "0.9", "--rank", "6", "--target-modules",
                                  "q_proj,v_proj", "--device", "cpu")),
        Case("svd/fsdp_single_rank3_bf16", ("extract-lora", "--finetuned", "{fsdp:single_qwen2}", "--base-model",
                                            "{hf:base}", "--target_dir", "{out}", "--rank", "3", "--dtype", "bf16",
                                            "--device", "cpu")),
        # merge-lora: each method, fused model or one adapter (exact stacking or SVD)
        Case("combine/concat_model", ("merge-lora", "--base-model", "{hf:base}", "--lora-adapter",
                                      "{hf:qv},{hf:patterns},{hf:rslora}", "--target_dir", "{out}")),
        Case("combine/weighted_model_bf16", ("merge-lora", "--base-model", "{hf:base}", "--lora-adapter",
                                             "{hf:qv},{hf:qv2}", "--merge-method", "weighted", "--adapter-weights",
                                             "0.7,0.3", "--dtype", "bfloat16", "--target_dir", "{out}")),
        Case("combine/average_model_embed", ("merge-lora", "--base-model", "{hf:base}", "--lora-adapter",
                                             "{hf:qv},{hf:embed_save}", "--merge-method", "average",
                                             "--target_dir", "{out}")),
        Case("combine/concat_adapter", ("merge-lora", "--lora-adapter", "{hf:qv},{hf:patterns}", "--output",
                                        "adapter", "--target_dir", "{out}")),
        Case("combine/weighted_adapter", ("merge-lora", "--lora-adapter", "{hf:qv},{hf:qv2}", "--output", "adapter",
                                          "--merge-method", "weighted", "--adapter-weights", "2,0.5",
                                          "--target_dir", "{out}")),
        Case("combine/average_adapter_svd_rank2", ("merge-lora", "--lora-adapter", "{hf:qv},{hf:qv2}", "--output",
                                                   "adapter", "--merge-method", "average", "--rank", "2",
                                                   "--device", "cpu", "--target_dir", "{out}")),
        Case("combine/concat_adapter_svd_energy", ("merge-lora", "--base-model", "{hf:base}", "--lora-adapter",
                                                   "{hf:qv},{hf:qv2}", "--output", "adapter", "--energy", "0.9",
                                                   "--device", "cpu", "--target_dir", "{out}")),
        Case("combine/extracted_fsdp_lora_model", ("merge-lora", "--base-model",
                                                   "{case:extract/lora_fsdp1_mesh_qwen2/base}", "--lora-adapter",
                                                   "{case:extract/lora_fsdp1_mesh_qwen2}", "--target_dir", "{out}")),
        # split --to megatron: legacy TP/PP/VPP/EP and torch_dist
        Case("split/legacy_tp2_pp2", ("split", "--to", "megatron", "--hf-dir", "{hf:base}", "--tp", "2", "--pp", "2",
                                      "--target_dir", "{out}")),
        Case("split/legacy_pp2_vpp2_bf16", ("split", "--hf-dir", "{megatron_hf:llama_tp2_pp2_vpp2_legacy}", "--pp",
                                            "2", "--vpp", "2", "--dtype", "bf16", "--target_dir", "{out}")),
        Case("split/legacy_moe_tp2_ep2", ("split", "--hf-dir", "{megatron_hf:mixtral_ep2_legacy}", "--tp", "2",
                                          "--ep", "2", "--target_dir", "{out}")),
        Case("split/dist_tp2_pp2", ("split", "--hf-dir", "{hf:base}", "--tp", "2", "--pp", "2", "--format", "dist",
                                    "--target_dir", "{out}")),
        Case("split/dist_moe_ep2", ("split", "--hf-dir", "{megatron_hf:qwen2_moe_ep2_dist_v2}", "--ep", "2",
                                    "--format", "dist", "--target_dir", "{out}")),
    ]
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


CASES: list[Case] = _cases()


# --------------------------------------------------------------------------------------------------
# Building the inputs
# --------------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """Where each built input lives (absolute paths)."""

    root: Path  # masked as <WORK>/in: the built inputs' root, or the reused ones'
    build_root: Path  # where the builders write
    paths: dict[tuple[str, str], Path] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)


def _fsdp_specs(names: Iterable[str]) -> dict:
    from synthetic_runs.fsdp import family_matrix, fixture_matrix, verl_lora_matrix

    matrices = {"fixture": fixture_matrix(), "family": family_matrix(), "verl_lora": verl_lora_matrix()}
    return {name: matrices[FSDP_RUNS[name][0]][FSDP_RUNS[name][1]] for name in names}


def build_fsdp(inputs: Inputs, names: Sequence[str]) -> None:
    """verl FSDP runs (one step, global_step_1, weights of seed 1), one process group per world size."""
    import synthetic_runs

    runs = synthetic_runs.write_fixture_matrix(inputs.build_root / "fsdp", steps=(1,), seed=0,
                                               specs=_fsdp_specs(names))
    for name, run in runs.items():
        inputs.paths["fsdp", name] = Path(run.latest.checkpoint_dir)


def build_megatron(inputs: Inputs, names: Sequence[str]) -> None:
    """Megatron checkpoints written by real megatron-core (one gloo world), with their reference folders."""
    from synthetic_runs.megatron import REFERENCE_HF_DIR, write_fixture_matrix

    jobs = write_fixture_matrix(inputs.build_root / "megatron", names=sorted(names), seed=0)
    for name, job in jobs.items():
        # where a user points stepmerge: verl's global_step_N/actor, Megatron-LM's iter_N (tests/fixtures_merged.py)
        lm = job.spec.fmt in ("megatron_lm", "megatron_lm_dist")
        inputs.paths["megatron", name] = Path(job.step_dir) if lm else Path(job.step_dir) / "actor"
        inputs.paths["megatron_hf", name] = Path(job.reference_dir) / REFERENCE_HF_DIR


def build_megatron_lora(inputs: Inputs, names: Sequence[str]) -> None:
    """verl Megatron LoRA steps (synthetic_runs.megatron_lora), bases as Hugging Face folders (seed 0)."""
    from synthetic_runs.megatron_lora import LoraRunSpec, write_base, write_lora_step
    from synthetic_runs.models import ModelSpec

    root = inputs.build_root / "megatron_lora"
    bases: dict[str, Path] = {}
    for name in sorted(names):
        family, tp, pp, ep, dist, export = MEGATRON_LORA_STEPS[name]
        if family not in bases:
            bases[family] = write_base(root / f"base_{family}", ModelSpec(family=family), seed=0)
        spec = LoraRunSpec(ModelSpec(family=family), tp=tp, pp=pp, ep=ep, use_dist_checkpointing=dist,
                           peft_folder=export, alpha=MEGATRON_LORA_ALPHA)
        step = write_lora_step(root / name / "global_step_1" / "actor", spec, bases[family])
        inputs.paths["mlora", name] = Path(step.step_dir)
        inputs.paths["mlora_base", name] = Path(step.base_dir)


def build_hf(inputs: Inputs, names: Sequence[str]) -> None:
    """The tiny Qwen2 base (seed 11) and a full fine-tune of it (seed 12) as save_pretrained folders, and real
    PEFT adapters on the base with seeded non-zero factors (tests/merge_engine/lora/conftest.py's recipe)."""
    import peft
    import torch

    from synthetic_runs.models import ModelSpec, build_model, write_hf_metadata

    spec = ModelSpec(family="qwen2")
    root = inputs.build_root / "hf"
    for name, seed in (("base", HF_BASE_SEED), ("finetuned", HF_FINETUNED_SEED)):
        if name not in names:
            continue
        folder = root / name
        write_hf_metadata(folder, spec)
        build_model(spec, seed=seed).save_pretrained(folder)
        inputs.paths["hf", name] = folder
    for index, (name, kwargs) in enumerate(PEFT_ADAPTERS.items()):
        if name not in names:
            continue
        model = peft.get_peft_model(build_model(spec, seed=HF_BASE_SEED), peft.LoraConfig(task_type="CAUSAL_LM",
                                                                                          **kwargs))
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for pname, param in sorted(model.named_parameters()):
                if "lora_" in pname or "modules_to_save" in pname:
                    scale = 0.3 if "modules_to_save" in pname else 0.5 / max(param.shape[-1], 1) ** 0.5
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(root / name)
        inputs.paths["hf", name] = root / name


BUILDERS: dict[str, tuple[str, Callable[[Inputs, Sequence[str]], None]]] = {  # kind -> (group, builder)
    "fsdp": ("fsdp", build_fsdp),
    "megatron": ("megatron", build_megatron),
    "megatron_hf": ("megatron", build_megatron),
    "mlora": ("megatron_lora", build_megatron_lora),
    "mlora_base": ("megatron_lora", build_megatron_lora),
    "hf": ("hf", build_hf),
}


def input_path(root: Path, kind: str, name: str) -> Path:
    """Where the builders put input ``kind:name`` under ``root`` (the folder a case names)."""
    if kind == "fsdp":
        step = root / "fsdp" / name / "global_step_1"
        role = _fsdp_specs([name])[name].role
        return step / role if role else step
    if kind in ("megatron", "megatron_hf"):
        from synthetic_runs.megatron import REFERENCE_HF_DIR, megatron_fixture_matrix

        if kind == "megatron_hf":
            return root / "megatron" / name / "reference" / REFERENCE_HF_DIR
        lm = megatron_fixture_matrix()[name].fmt.startswith("megatron_lm")
        step = root / "megatron" / name / "run" / ("iter_0000001" if lm else "global_step_1")
        return step if lm else step / "actor"
    if kind == "mlora":
        return root / "megatron_lora" / name / "global_step_1" / "actor"
    if kind == "mlora_base":
        return root / "megatron_lora" / f"base_{MEGATRON_LORA_STEPS[name][0]}"
    return root / "hf" / name


def _wanted_inputs(cases: Sequence[Case]) -> set[tuple[str, str]]:
    return {(kind, name) for case in cases for kind, name in case.inputs() if kind != "case"}


REUSABLE_GROUPS = ("fsdp", "megatron")  # the costly ones (rank processes); the rest is built afresh in seconds


def build_inputs(root: Path, cases: Sequence[Case], reuse: Path | None = None) -> Inputs:
    """Build only what ``cases`` name, each group in one call (one process group per world size); with ``reuse``
    (an earlier ``--keep`` run's ``in/``), take `REUSABLE_GROUPS` from there instead."""
    inputs = Inputs(reuse or root, root)
    wanted: dict[str, set[str]] = {}
    for kind, name in _wanted_inputs(cases):
        wanted.setdefault(BUILDERS[kind][0], set()).add(name)
    for group, builder in {g: b for g, b in BUILDERS.values()}.items():
        if group in wanted and reuse is not None and group in REUSABLE_GROUPS:
            for kind, name in sorted(_wanted_inputs(cases)):
                if BUILDERS[kind][0] == group:
                    inputs.paths[kind, name] = input_path(reuse, kind, name)
                    if not inputs.paths[kind, name].is_dir():
                        raise SystemExit(f"--inputs: {inputs.paths[kind, name]} is not there")
            print(f"  reused {group}: {len(wanted[group])} input(s) from {reuse}", flush=True)
        elif group in wanted:
            started = time.perf_counter()
            builder(inputs, sorted(wanted[group]))
            inputs.seconds[group] = round(time.perf_counter() - started, 1)
            print(f"  built {group}: {len(wanted[group])} input(s) in {inputs.seconds[group]:.1f} s", flush=True)
    for kind, name in _wanted_inputs(cases):
        expected = input_path(reuse if reuse is not None and BUILDERS[kind][0] in REUSABLE_GROUPS else root, kind,
                              name)
        assert inputs.paths[kind, name] == expected, (kind, name, inputs.paths[kind, name])
    return inputs


# --------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------


def _lookup(value: object, path: Sequence[str]) -> tuple[bool, object]:
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _drop(value: object, path: Sequence[str]) -> None:
    if not path or not isinstance(value, dict):
        return
    if len(path) == 1:
        value.pop(path[0], None)
    else:
        _drop(value.get(path[0]), path[1:])


def _masked(data: bytes, masks: dict[str, str]) -> bytes:
    for text, mark in sorted(masks.items(), key=lambda item: -len(item[0])):  # the longest first: an input
        data = data.replace(text.encode(), mark.encode())                     # root inside the work dir
    return data


def _mask_recorded_files(data: bytes, path_holders: dict[str, tuple[int, str]]) -> bytes:
    """In ``stepmerge.json``'s bytes: each file that holds the temp path (``path_holders``: name -> its size and
    sha256 as written) is recorded with a size and a sha256 that follow the temp path's length and name; where they
    are the file's own, they become `FILE_SIZE_MARK` / `FILE_SHA_MARK` (the file itself is compared, masked).
    A recorded value that is not the file's stays, and differs."""
    for name, (size, sha) in path_holders.items():
        data = re.sub(rb'("' + re.escape(name.encode()) + rb'":\s*)' + str(size).encode() + rb"(?![0-9.])",
                      rb"\1" + FILE_SIZE_MARK, data)
        data = data.replace(b'"' + sha.encode() + b'"', FILE_SHA_MARK)
    return data


def record_file(path: Path, masks: dict[str, str], path_holders: dict[str, tuple[int, str]] | None = None) -> dict:
    """One output file: size and sha256 of its bytes, with the temp paths of ``masks`` replaced by their marks
    (``<WORK>``, `work_masks`); in ``stepmerge.json`` the sizes and sha256 of the files holding a temp path
    (``path_holders``) masked where they are right (`_mask_recorded_files`); in a JSON file named in
    `VOLATILE_KEYS`, those keys' values replaced by `VOLATILE_MARK`, and the document without them kept as
    ``json``."""
    data = path.read_bytes()
    entry: dict = {}
    normalized: list[str] = []
    masked = _masked(data, masks)
    if masked != data:
        data = masked
        normalized.append("work_root")
    if path.name == PROVENANCE_FILE and path_holders:
        data = _mask_recorded_files(data, path_holders)
        normalized.append("path_holders")
    volatile = [key for (file_name, key) in VOLATILE_KEYS if file_name == path.name]
    if volatile:
        # the value's own JSON text in the file's bytes becomes "<VOLATILE>": the rest stays byte-exact (layout,
        # key order, every other value); "json" keeps the document without those keys, to say what differs
        document = json.loads(data)
        for key in volatile:
            found, value = _lookup(document, key.split("."))
            if not found:
                continue
            token = json.dumps(value, ensure_ascii=False).encode()
            if data.count(token) != 1:
                raise ValueError(f"{path}: the volatile {key}'s value {token[:80]!r} is not in the file exactly once")
            data = data.replace(token, VOLATILE_MARK)
            _drop(document, key.split("."))
        normalized.append("volatile_keys")
        entry["json"] = document
    entry["size"] = len(data)
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    if normalized:
        entry["normalized"] = normalized
    return entry


def record_tree(folder: Path, masks: dict[str, str]) -> dict[str, dict]:
    """Every file under ``folder`` (relative ``/`` path -> `record_file`); a symlink is recorded as its target.
    ``stepmerge.json`` files last, told which files beside and below them hold a temp path."""
    files: dict[str, dict] = {}
    raw: dict[str, tuple[int, str]] = {}  # temp-path holders: rel -> size, sha256 as written
    paths = sorted(folder.rglob("*"), key=lambda p: (p.name == PROVENANCE_FILE, p.as_posix()))
    for path in paths:
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            files[rel] = {"symlink": _masked(os.readlink(path).encode(), masks).decode()}
        elif path.is_file():
            holders = None
            if path.name == PROVENANCE_FILE:
                base = path.parent.relative_to(folder).as_posix()
                prefix = "" if base == "." else base + "/"
                holders = {r[len(prefix):]: v for r, v in raw.items() if r.startswith(prefix)}
            files[rel] = record_file(path, masks, holders)
            if "work_root" in files[rel].get("normalized", ()):
                data = path.read_bytes()
                raw[rel] = (len(data), hashlib.sha256(data).hexdigest())
    return dict(sorted(files.items()))


_SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")
_RATE = re.compile(r"\(\d+(?:\.\d+)? [kMG]?B/s\)")


def work_masks(work: Path, inputs_root: Path) -> dict[str, str]:
    """The temp paths to mask: the work dir, and the inputs' root (inside it, or reused from another run)."""
    return {str(work): WORK_MARK, str(inputs_root): f"{WORK_MARK}/in"}


def normalize_output(text: str, masks: dict[str, str]) -> list[str]:
    """Stdout lines with the temp dir, durations and rates masked (they differ run to run, nothing else does)."""
    text = _masked(text.encode(), masks).decode()
    return [_RATE.sub("(<RATE>)", _SECONDS.sub("<T> s", line)) for line in text.splitlines()]


def _stderr_lines(text: str, masks: dict[str, str]) -> list[str]:
    keep = ("planned ", "  note:", "stepmerge:")
    return [line for line in normalize_output(text, masks) if line.startswith(keep)]


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", DO_NOT_TRACK="1", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONHASHSEED", None)  # the engine runs as a user runs it: an output that follows set order differs
    return env


def engine_location() -> str:
    """Where ``python -m merge_engine`` imports the engine from in the cases' environment (must be ROOT)."""
    done = subprocess.run([sys.executable, "-c", "import merge_engine; print(merge_engine.__file__)"], env=_env(),
                          capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return done.stdout.strip()


def _case_dir(work: Path, name: str) -> Path:
    return work / "out" / name.replace("/", "__")


def resolve_args(case: Case, inputs: Inputs, work: Path) -> list[str]:
    def resolve(match: re.Match) -> str:
        kind, name = match.group(1), match.group(2)
        if kind == "case":  # "command/case[/path inside]"
            command, case_name, *inner = name.split("/")
            return str(_case_dir(work, f"{command}/{case_name}").joinpath(*inner))
        return str(inputs.paths[kind, name])

    return [_PLACEHOLDER.sub(resolve, arg).replace("{out}", str(_case_dir(work, case.name))) for arg in case.args]


def _case_record(case: Case, argv: list[str], inputs: Inputs, work: Path, code: int, stdout: str, stderr: str,
                 seconds: float) -> dict:
    masks = work_masks(work, inputs.root)
    target = _case_dir(work, case.name)
    if code != 0:
        print(f"    {case.name} exited {code}:\n{stderr[-2000:]}", flush=True)
    return {
        "command": ["merge_engine", *(_masked(a.encode(), masks).decode() for a in argv)],
        "exit_code": code,
        "stdout": normalize_output(stdout, masks),
        "stderr": _stderr_lines(stderr, masks),
        "files": record_tree(target, masks) if target.exists() else {},
        "seconds": round(seconds, 2),
    }


def run_case(case: Case, inputs: Inputs, work: Path) -> dict:
    """Run one case as ``python -m merge_engine ...`` in a child process of its own; its record (command, exit
    code, output lines, files, seconds)."""
    argv = resolve_args(case, inputs, work)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "merge_engine", *argv], env=_env(), cwd=work, capture_output=True,
                          text=True, timeout=CASE_TIMEOUT_S)
    return _case_record(case, argv, inputs, work, done.returncode, done.stdout, done.stderr,
                        time.perf_counter() - started)


# `--batch`: what ``python -m merge_engine ARGS`` does (runpy of the package's __main__ with sys.argv), case after
# case in one child process, its stdout and stderr (file descriptors 1 and 2) sent to each case's own files:
# the imports (torch, transformers: most of a tiny case's CPU) are paid once per child, not once per case.
_BATCH_RUNNER = r"""
import json, os, runpy, sys, time, traceback
for job in json.load(open(sys.argv[1])):
    sys.stdout.flush(); sys.stderr.flush()
    out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1); os.dup2(err, 2); os.close(out); os.close(err)
    sys.argv = ["merge_engine", *job["argv"]]
    started, code = time.perf_counter(), 0
    try:
        runpy.run_module("merge_engine", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc(); code = 1
    sys.stdout.flush(); sys.stderr.flush()
    with open(job["result"], "w") as handle:
        json.dump({"code": code, "seconds": time.perf_counter() - started}, handle)
"""


def run_batch(cases: Sequence[Case], inputs: Inputs, work: Path) -> dict[str, dict]:
    """Run ``cases`` in order in ONE child process (`_BATCH_RUNNER`); their records."""
    logs = work / "batch" / cases[0].name.replace("/", "__")
    logs.mkdir(parents=True)
    jobs = []
    for index, case in enumerate(cases):
        stem = logs / f"{index:03d}"
        jobs.append({"argv": resolve_args(case, inputs, work), "stdout": f"{stem}.out", "stderr": f"{stem}.err",
                     "result": f"{stem}.json"})
    (logs / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([sys.executable, "-c", _BATCH_RUNNER, str(logs / "jobs.json")], env=_env(), cwd=work,
                   timeout=CASE_TIMEOUT_S * len(cases), check=False)
    records = {}
    for case, job in zip(cases, jobs):
        result = json.loads(Path(job["result"]).read_text()) if Path(job["result"]).exists() else \
            {"code": -1, "seconds": 0.0}  # the child died before this case ended
        records[case.name] = _case_record(case, job["argv"], inputs, work, result["code"],
                                          Path(job["stdout"]).read_text() if Path(job["stdout"]).exists() else "",
                                          Path(job["stderr"]).read_text() if Path(job["stderr"]).exists() else "",
                                          result["seconds"])
    return records


def select_cases(patterns: str | None) -> list[Case]:
    """All cases, or those whose name equals or starts with one of the comma-separated ``patterns``, plus the
    cases their ``{case:...}`` inputs name."""
    if not patterns:
        return list(CASES)
    wanted = [p for p in patterns.split(",") if p]
    chosen = {c.name for c in CASES if any(c.name.startswith(p) for p in wanted)}
    if not chosen:
        raise SystemExit(f"no case matches {patterns!r}; see --list")
    for case in CASES:
        if case.name in chosen:
            chosen |= {"/".join(name.split("/")[:2]) for kind, name in case.inputs() if kind == "case"}
    return [c for c in CASES if c.name in chosen]


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout.strip()


def run_cases(cases: Sequence[Case], inputs: Inputs, work: Path, jobs: int = 1, batch: bool = False
              ) -> dict[str, dict]:
    """Run ``cases``, ``jobs`` at a time (a case naming another's output runs in a later wave), each in a child
    process of its own or (``batch``) ``jobs`` children taking a share of the cases each; records in ``cases``'
    order. Each case writes its own folder, so neither the order nor the grouping changes a byte."""
    from concurrent.futures import ThreadPoolExecutor

    done: dict[str, dict] = {}
    waves = [[c for c in cases if not any(k == "case" for k, _ in c.inputs())],
             [c for c in cases if any(k == "case" for k, _ in c.inputs())]]

    def report(name: str, record: dict) -> None:
        done[name] = record
        print(f"  [{len(done)}/{len(cases)}] {name}: exit {record['exit_code']}, {len(record['files'])} files, "
              f"{record['seconds']:.1f} s", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for wave in (w for w in waves if w):
            if batch:
                shares = [wave[i::jobs] for i in range(min(jobs, len(wave)))]
                for records in pool.map(lambda share: run_batch(share, inputs, work), shares):
                    for name, record in records.items():
                        report(name, record)
            else:
                for case, record in zip(wave, pool.map(lambda c: run_case(c, inputs, work), wave)):
                    report(case.name, record)
    return {case.name: done[case.name] for case in cases}


def run_all(cases: Sequence[Case], keep: Path | None = None, jobs: int = 1, reuse: Path | None = None,
            batch: bool = False) -> dict:
    """Build the inputs (or take those kept in ``reuse``), run ``cases`` (``jobs`` at a time), record everything;
    the work dir is removed unless ``keep``."""
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="stepmerge-identity-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise SystemExit(f"--keep {work}: the folder must be empty")
    location = engine_location()
    if not location.startswith(str(ROOT)):
        raise SystemExit(f"the cases would run the engine at {location}, not this checkout's ({ROOT})")
    try:
        print(f"building the inputs under {work} ...", flush=True)
        inputs = build_inputs(work / "in", cases, reuse.resolve() / "in" if reuse is not None else None)
        built = time.perf_counter() - started
        results = run_cases(cases, inputs, work, jobs, batch)
        recorded_inputs = {}
        for (kind, name), path in sorted(inputs.paths.items()):
            recorded_inputs[f"{kind}:{name}"] = record_tree(path, work_masks(work, inputs.root))
        return {
            "schema": SCHEMA,
            "meta": {  # not compared
                "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
                "engine": location.replace(str(ROOT), "<REPO>"), "python": sys.version.split()[0],
                "build_seconds": inputs.seconds, "inputs_seconds": round(built, 1),
                "total_seconds": round(time.perf_counter() - started, 1),
                "load_average": os.getloadavg(), "jobs": jobs, "batch": batch, "inputs_reused_from": str(reuse) if reuse else None,
                "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            "volatile_keys": {f"{f}:{k}": why for (f, k), why in VOLATILE_KEYS.items()},
            "cases": results,
            "inputs": recorded_inputs,
        }
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------------


def _json_differences(base: object, new: object, where: str) -> list[str]:
    if isinstance(base, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(base) | set(new), key=str):
            if key not in new:
                out.append(f"{where}.{key}: removed (was {json.dumps(base[key])[:200]})")
            elif key not in base:
                out.append(f"{where}.{key}: added ({json.dumps(new[key])[:200]})")
            else:
                out += _json_differences(base[key], new[key], f"{where}.{key}")
        return out
    if isinstance(base, list) and isinstance(new, list) and len(base) == len(new):
        return [d for i, (b, n) in enumerate(zip(base, new)) for d in _json_differences(b, n, f"{where}[{i}]")]
    if base != new or type(base) is not type(new):
        return [f"{where}: {json.dumps(base)[:200]} -> {json.dumps(new)[:200]}"]
    return []


def _file_differences(prefix: str, base: dict[str, dict], new: dict[str, dict]) -> list[str]:
    out = []
    for rel in sorted(set(base) | set(new)):
        if rel not in new:
            out.append(f"{prefix} {rel}: missing (was {base[rel].get('size')} bytes)")
            continue
        if rel not in base:
            out.append(f"{prefix} {rel}: extra file ({new[rel].get('size')} bytes)")
            continue
        b, n = base[rel], new[rel]
        if "json" in b and "json" in n and b["json"] != n["json"]:
            out += [f"{prefix} {rel}: {d}" for d in _json_differences(b["json"], n["json"], "")]
        elif b.get("size") != n.get("size"):
            out.append(f"{prefix} {rel}: size {b.get('size')} -> {n.get('size')}")
        elif b != n:
            changed = [k for k in sorted(set(b) | set(n)) if b.get(k) != n.get(k)]
            out.append(f"{prefix} {rel}: " + ", ".join(f"{k} {b.get(k)} -> {n.get(k)}" for k in changed))
    return out


def _lines_differences(prefix: str, base: list[str], new: list[str]) -> list[str]:
    import difflib

    return [f"{prefix} {line}" for line in difflib.unified_diff(base, new, lineterm="", n=0)
            if not line.startswith(("---", "+++", "@@"))]


def compare(base: dict, new: dict) -> list[str]:
    """Every difference between the cases of two records, one line each (empty: identical). Cases present in
    only one record are differences too; ``meta`` and ``inputs`` (`input_differences`) are not compared here."""
    out = []
    if base.get("volatile_keys") != new.get("volatile_keys"):
        out.append(f"volatile_keys table: {base.get('volatile_keys')} -> {new.get('volatile_keys')}")
    for name in sorted(set(base["cases"]) | set(new["cases"])):
        if name not in new["cases"]:
            out.append(f"[{name}] case missing from the new record")
            continue
        if name not in base["cases"]:
            out.append(f"[{name}] case not in the base record")
            continue
        b, n = base["cases"][name], new["cases"][name]
        prefix = f"[{name}]"
        if b["command"] != n["command"]:
            out.append(f"{prefix} command {b['command']} -> {n['command']}")
        if b["exit_code"] != n["exit_code"]:
            out.append(f"{prefix} exit code {b['exit_code']} -> {n['exit_code']}")
        out += _lines_differences(f"{prefix} stdout", b["stdout"], n["stdout"])
        out += _lines_differences(f"{prefix} stderr", b["stderr"], n["stderr"])
        out += _file_differences(prefix, b["files"], n["files"])
    return out


def input_differences(base: dict, new: dict) -> list[str]:
    """The inputs' differences: shown, not counted. The synthetic writers' ``torch.save`` archives hold a random
    ``.data/serialization_id`` (and DeviceMesh pickles a ``_hash``), so FSDP rank files and Megatron ``.pt`` /
    ``.distcp`` / ``.metadata`` files differ on every build; the outputs made from them must not."""
    out = []
    for name in sorted(set(base.get("inputs", {})) & set(new.get("inputs", {}))):
        out += _file_differences(f"[input {name}]", base["inputs"][name], new["inputs"][name])
    return out


def _load(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)


def _with_fixed_hash_seed(argv: Sequence[str] | None) -> None:
    """Re-run this command with PYTHONHASHSEED=0: the inputs' builders (PEFT writes ``target_modules`` from a set)
    and their rank processes then write the same bytes every time. The cases still run with a random seed."""
    if os.environ.get("PYTHONHASHSEED") == "0":
        return
    args = sys.argv[1:] if argv is None else list(argv)
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.output_identity", *args],
              dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=os.pathsep.join(
                  p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.output_identity", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the record here (JSON)")
    parser.add_argument("--compare", metavar="BASE.json", help="compare with this record; exit 1 on any difference")
    parser.add_argument("--with", dest="with_", metavar="NEW.json", help="with --compare: compare two saved records")
    parser.add_argument("--cases", help="comma-separated case names or prefixes (merge/, split/, ...)")
    parser.add_argument("--keep", type=Path, help="build and write in this (empty) folder and leave it there")
    parser.add_argument("--inputs", type=Path, metavar="DIR",
                        help="take the FSDP and Megatron checkpoints an earlier run kept (--keep DIR) instead of "
                             "building them again (the rest is built afresh)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at a time (default 1; same bytes)")
    parser.add_argument("--batch", action="store_true",
                        help="run the cases in --jobs child processes (python -m merge_engine's runpy, case after "
                             "case) instead of one child each: the imports paid once per child")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        for case in select_cases(args.cases):
            print(f"{case.name:45s} {' '.join(case.args)}")
        return 0
    if args.with_:
        if not args.compare:
            parser.error("--with needs --compare")
        record = _load(args.with_)
    else:
        if not args.out:
            parser.error("--out is required unless --compare BASE --with NEW")
        _with_fixed_hash_seed(argv)
        cases = select_cases(args.cases)
        print(f"output identity: {len(cases)} case(s) of the engine at {ROOT}", flush=True)
        record = run_all(cases, args.keep, args.jobs, args.inputs, args.batch)
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1, sort_keys=True)
        files = sum(len(c["files"]) for c in record["cases"].values())
        failed = [name for name, c in record["cases"].items() if c["exit_code"] != 0]
        meta = record["meta"]
        print(f"recorded {len(record['cases'])} case(s), {files} output files -> {args.out}; inputs "
              f"{meta['inputs_seconds']:.0f} s, total {meta['total_seconds']:.0f} s, load average "
              f"{' '.join(f'{x:.1f}' for x in meta['load_average'])}")
        if failed:
            print(f"{len(failed)} case(s) exited non-zero: {', '.join(failed)}")
    if args.compare:
        base = _load(args.compare)
        if args.cases and not args.with_:
            base = dict(base, cases={k: v for k, v in base["cases"].items() if k in record["cases"]},
                        inputs={k: v for k, v in base.get("inputs", {}).items() if k in record.get("inputs", {})})
        differences = compare(base, record)
        inputs = input_differences(base, record)
        if inputs:
            print(f"inputs: {len(inputs)} file(s) differ (not counted; see input_differences):")
            for line in inputs:
                print(f"  {line}")
        for line in differences:
            print(line)
        files = sum(len(c["files"]) for c in record["cases"].values())
        print(f"{len(differences)} difference(s) against {args.compare}" if differences
              else f"identical to {args.compare}: {len(record['cases'])} case(s), {files} output files")
        return 1 if differences else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
