"""Command line: write synthetic verl FSDP runs.

    python -m synthetic_runs fsdp --out DIR [--steps 1 2 3] [--strategy fsdp2] [--world-size 4] ...
    python -m synthetic_runs matrix --out DIR [--references DIR]

Prints what it wrote and how long it took; exit code 0 on success, 1 on a failed write.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from synthetic_runs.fsdp import (
    STRATEGIES,
    FsdpSpec,
    LoraSpec,
    SyntheticRunError,
    fixture_matrix,
    write_fixture_matrix,
    write_verl_run,
)
from synthetic_runs.models import ModelSpec


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m synthetic_runs", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("fsdp", help="write one verl FSDP run (global_step_N/... + tracker)")
    run.add_argument("--out", required=True, help="run root to write")
    run.add_argument("--references", help="also write the full reference weights under this folder")
    run.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--strategy", choices=STRATEGIES, default="fsdp2")
    run.add_argument("--world-size", type=int, default=4)
    run.add_argument("--ddp-size", type=int, default=2, help="HSDP replicas")
    run.add_argument("--shard-dim", type=int, default=0, choices=(0, 1))
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run.add_argument("--role", choices=("actor", "critic", "sft"), default="actor")
    run.add_argument("--no-optimizer", action="store_true", help="verl save_contents without 'optimizer'")
    run.add_argument("--family", choices=("qwen2", "llama"), default="qwen2")
    run.add_argument("--vocab-size", type=int, default=ModelSpec.vocab_size)
    run.add_argument("--hidden-size", type=int, default=ModelSpec.hidden_size)
    run.add_argument("--intermediate-size", type=int, default=ModelSpec.intermediate_size)
    run.add_argument("--num-layers", type=int, default=ModelSpec.num_layers)
    run.add_argument("--num-heads", type=int, default=ModelSpec.num_heads)
    run.add_argument("--num-kv-heads", type=int, default=ModelSpec.num_kv_heads)
    run.add_argument("--tie-word-embeddings", action="store_true")
    run.add_argument("--extra-buffer", action="store_true")
    run.add_argument("--lora-r", type=int, help="wrap with LoRA of this rank before sharding")
    run.add_argument("--lora-alpha", type=int, default=8)

    matrix = commands.add_parser("matrix", help="write every variant of fixture_matrix()")
    matrix.add_argument("--out", required=True)
    matrix.add_argument("--references")
    matrix.add_argument("--steps", type=int, nargs="+", default=[1])
    return parser


def _spec(args: argparse.Namespace) -> FsdpSpec:
    model = ModelSpec(
        family=args.family,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        tie_word_embeddings=args.tie_word_embeddings,
        task="token_classification" if args.role == "critic" else "causal_lm",
        extra_buffer=args.extra_buffer,
    )
    return FsdpSpec(
        model=model,
        world_size=1 if args.strategy == "single" else args.world_size,
        strategy=args.strategy,
        ddp_size=args.ddp_size,
        shard_dim=args.shard_dim,
        dtype=args.dtype,
        lora=LoraSpec(r=args.lora_r, alpha=args.lora_alpha) if args.lora_r else None,
        role="" if args.role == "sft" else args.role,
        save_contents=("model", "extra") if args.no_optimizer else ("model", "optimizer", "extra"),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    try:
        if args.command == "fsdp":
            spec = _spec(args)
            steps = write_verl_run(args.out, spec, args.steps, args.seed, args.references)
            print(f"wrote {len(steps)} step(s) of a {spec.world_size}-rank {spec.strategy} run:")
            for step in steps:
                print(f"  {step}")
            print(f"  spec: {dataclasses.asdict(spec)}")
        else:
            runs = write_fixture_matrix(args.out, args.references, args.steps)
            print(f"wrote {len(runs)} runs ({len(fixture_matrix())} variants):")
            for name, run in runs.items():
                print(f"  {name:36s} {run.root}")
    except SyntheticRunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"took {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
