"""Benchmark: the cost of the check against the trained model on a Qwen2-0.5B-shaped LoRA checkpoint.

    .venv/bin/python benchmarks/trained_check.py [--rounds 3] [--rank 16] [--workdir .bench/trained_check]

Builds once (reused from the work dir): a verl single-rank FSDP LoRA checkpoint of the Qwen2-0.5B
shape (random float32 base, PEFT's LoRA of verl's default ``all-linear``, rank ``--rank``, alpha 2 x
rank; ``lora_train_meta.json`` with only r / lora_alpha / task_type; ~2 GB), then stepmerge's merge
and extract-lora of it. Each round runs ``stepmerge check-trained --fused-model F --adapter A`` (the
rebuild of PEFT's trained model, then the fused model and PEFT(base/ + adapter), one model at a time,
16 tokens each) and the rebuild alone (``--fused-model`` only), each in a fresh subprocess. Printed
per run: wall time (imports included) and peak RSS (ru_maxrss from wait4; this parent imports no
torch), then the medians; the check's own report once, to show what it judged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from benchmarks.harness import measure  # noqa: E402
from benchmarks.lora_fuse import QWEN2_05B  # noqa: E402


def build_checkpoint(directory: str, rank: int) -> None:
    """The PEFT-wrapped model's state dict as verl's world-size-1 FSDP save writes it."""
    import peft
    import torch
    import transformers
    from accelerate import init_empty_weights

    config = transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], **QWEN2_05B)
    with init_empty_weights(include_buffers=False):
        model = transformers.Qwen2ForCausalLM(config)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank,
                                                       target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, tensor in model.state_dict().items():
        scale = 0.02 if ".lora_" not in name else 0.5 / tensor.shape[-1] ** 0.5
        state[name] = torch.randn(tuple(tensor.shape), generator=generator) * scale
    state["base_model.model.lm_head.weight"] = state["base_model.model.model.embed_tokens.weight"]  # tied
    os.makedirs(os.path.join(directory, "huggingface"), exist_ok=True)
    torch.save(state, os.path.join(directory, "model_world_size_1_rank_0.pt"))
    config.save_pretrained(os.path.join(directory, "huggingface"))
    with open(os.path.join(directory, "fsdp_config.json"), "w") as handle:
        json.dump({"FSDP_version": 2, "world_size": 1}, handle)
    with open(os.path.join(directory, "lora_train_meta.json"), "w") as handle:
        json.dump({"r": rank, "lora_alpha": 2 * rank, "task_type": "CAUSAL_LM"}, handle)


def stepmerge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "merge_engine", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench", "trained_check"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--child", choices=("build",), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "build":
        build_checkpoint(args.checkpoint, args.rank)
        return

    checkpoint = os.path.join(args.workdir, f"lora_r{args.rank}", "actor")
    fused, adapter = os.path.join(args.workdir, "fused"), os.path.join(args.workdir, "adapter")
    if not os.path.exists(os.path.join(checkpoint, "lora_train_meta.json")):
        started = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--child", "build", "--checkpoint", checkpoint, "--rank",
                        str(args.rank)], check=True)
        print(f"built the checkpoint in {time.perf_counter() - started:.1f} s: {checkpoint}")
    for command, target in (("merge", fused), ("extract-lora", adapter)):
        if not os.path.exists(target):
            done = stepmerge(command, "--local_dir", checkpoint, "--target_dir", target)
            if done.returncode:
                raise SystemExit(f"stepmerge {command} failed:\n{done.stderr[-3000:]}")
    size = os.path.getsize(os.path.join(checkpoint, "model_world_size_1_rank_0.pt")) / 1e9
    print(f"checkpoint {size:.2f} GB (float32, LoRA r={args.rank} all-linear); {os.cpu_count()} CPUs; "
          f"load {os.getloadavg()[0]:.1f}")
    report = stepmerge("check-trained", "--local_dir", checkpoint, "--fused-model", fused, "--adapter", adapter)
    print(report.stdout.strip())
    base = [sys.executable, "-m", "merge_engine", "check-trained", "--local_dir", checkpoint, "--fused-model", fused]
    commands = {"fused+adapter": base + ["--adapter", adapter], "fused only": base}
    env = {**os.environ, "PYTHONPATH": REPO}
    runs: dict[str, list] = {name: [] for name in commands}
    for round_ in range(args.rounds):
        for name, command in commands.items():
            run = measure(name, command, env)
            runs[name].append(run)
            print(f"round {round_ + 1} {name:13s}: wall {run.wall_s:6.2f} s, peak RSS {run.peak_rss_mb / 1e3:.2f} GB "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for name, measured in runs.items():
        print(f"median {name:13s}: wall {statistics.median(r.wall_s for r in measured):.2f} s, "
              f"peak RSS {statistics.median(r.peak_rss_mb for r in measured) / 1e3:.2f} GB")


if __name__ == "__main__":
    main()
