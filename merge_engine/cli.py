"""``stepmerge`` / ``python -m merge_engine``: the command line.

Accepts verl's model-merger spellings (``merge --backend fsdp --local_dir X --target_dir Y``,
``test --test_hf_dir Z``, ``--tie-word-embedding``, ``--trust-remote-code``, ...) with dashes or
underscores, plus stepmerge's own commands. Every `StepmergeError` becomes one line on stderr
(``stepmerge: error: <Kind>: message [path]``) and its exit code; nothing is printed as a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from merge_engine.errors import InvalidOption, StepmergeError



def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--a_b`` with its ``--a-b`` twin (verl mixes both styles)."""
    dashed, underscored = name.replace("_", "-"), name.replace("-", "_")
    names = [f"--{underscored}"] + ([f"--{dashed}"] if dashed != underscored else [])
    parser.add_argument(*names, **kwargs)


def _source_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "backend", default=None, help="checkpoint layout (fsdp, megatron, ...); detected when omitted")
    _flag(parser, "local_dir", required=True, help="checkpoint folder URL (path, file://, s3://, gs://)")
    _flag(parser, "hf_model_path", default=None,
          help="folder with config.json + tokenizer to use instead of the checkpoint's huggingface/")
    _flag(parser, "tie-word-embedding", action="store_true", default=None,
          help="verl compatibility: must agree with config.json's tie_word_embeddings")
    _flag(parser, "is-value-model", action="store_true", help="verl compatibility: critics are detected anyway")
    _flag(parser, "use_cpu_initialization", action="store_true", help="verl compatibility: no effect (always CPU)")
    _flag(parser, "trust-remote-code", action="store_true", help="allow custom model code when validating")
    _flag(parser, "dtype", default=None, help="output dtype (bfloat16, float16, float32); default: as stored")


def _options(args: argparse.Namespace):
    from merge_engine.merge import MergeOptions
    from merge_engine.plan import DEFAULT_MAX_SHARD_SIZE, parse_size

    return MergeOptions(backend=args.backend, dtype=args.dtype,
                        max_shard_size=parse_size(getattr(args, "max_shard_size", None) or DEFAULT_MAX_SHARD_SIZE),
                        hf_model_path=args.hf_model_path, tie_word_embedding=args.tie_word_embedding,
                        overwrite=getattr(args, "overwrite", False))


def _progress(total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, disable=None,
                file=sys.stderr, dynamic_ncols=True)


def cmd_merge(args: argparse.Namespace) -> int:
    from merge_engine.merge import merge_checkpoint

    if args.hf_upload_path:
        raise InvalidOption("uploading to the Hugging Face Hub is not done by stepmerge; write to a target URL "
                            "and publish it (see `stepmerge publish`)")
    bar = None

    def on_plan(plan) -> None:
        nonlocal bar
        print(f"planned {len(plan.tensors)} tensors, {plan.total_size / 1e6:.1f} MB in {len(plan.shards)} file(s)",
              file=sys.stderr)
        for note in plan.notes:
            print(f"  note: {note}", file=sys.stderr)
        bar = _progress(plan.total_size, "merge")

    try:
        result = merge_checkpoint(args.local_dir, args.target_dir, _options(args),
                                  on_bytes=lambda n: bar.update(n) if bar else None, on_plan=on_plan)
    finally:
        if bar is not None:
            bar.close()
    if result.skipped:
        print(f"{result.target_url} already holds this merge (fingerprint {result.fingerprint[:12]}); nothing to do")
        return 0
    rate = result.tensor_bytes / max(result.seconds, 1e-9) / 1e6
    print(f"merged {result.layout} checkpoint {result.source_url} -> {result.target_url}: {result.tensors} tensors, "
          f"{result.tensor_bytes / 1e6:.1f} MB in {result.seconds:.2f} s ({rate:.0f} MB/s)")
    return 0


def _add_merge(parser: argparse.ArgumentParser) -> None:
    _source_flags(parser)
    _flag(parser, "target_dir", required=True, help="output folder URL")
    _flag(parser, "max-shard-size", default=None, help="largest safetensors file, e.g. 5GB (default), 500MiB")
    _flag(parser, "overwrite", action="store_true", help="replace a target that holds a different model")
    _flag(parser, "hf_upload_path", default=None, help=argparse.SUPPRESS)
    _flag(parser, "private", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(run=cmd_merge)


def cmd_check(args: argparse.Namespace) -> int:
    from merge_engine.layouts import check_checkpoint

    checkpoint = check_checkpoint(args.local_dir, args.backend)
    sizes = ", ".join(f"{k}={v}" for k, v in checkpoint.parallel.items())
    total = sum(f.size for f in checkpoint.files)
    print(f"complete {checkpoint.layout} checkpoint at {checkpoint.url} ({sizes}; {len(checkpoint.files)} files, "
          f"{total / 1e6:.1f} MB; fingerprint {checkpoint.fingerprint[:12]})")
    return 0


def _add_check(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "backend", default=None, help="checkpoint layout; detected when omitted")
    _flag(parser, "local_dir", required=True, help="checkpoint folder URL")
    parser.set_defaults(run=cmd_check)


def cmd_test(args: argparse.Namespace) -> int:
    from merge_engine.reference_check import check_against_reference

    report = check_against_reference(args.local_dir, args.test_hf_dir, _options(args), atol=args.atol, rtol=args.rtol)
    print(report.summary())
    return 0 if report.ok else 5


def _add_test(parser: argparse.ArgumentParser) -> None:
    _source_flags(parser)
    _flag(parser, "test_hf_dir", required=True, help="reference Hugging Face folder to compare against")
    _flag(parser, "atol", type=float, default=1e-6, help="absolute tolerance (verl: 1e-6)")
    _flag(parser, "rtol", type=float, default=1e-6, help="relative tolerance (verl: 1e-6)")
    parser.set_defaults(run=cmd_test)


SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "merge": ("merge a checkpoint into a Hugging Face folder", _add_merge),
    "test": ("compare a checkpoint with a reference Hugging Face folder (verl's test)", _add_test),
    "check": ("check that a checkpoint is complete (exit 0) or not (non-zero)", _add_check),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepmerge", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add) in SUBCOMMANDS.items():
        add(commands.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        return args.run(args)
    except StepmergeError as exc:
        print(f"stepmerge: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"stepmerge: interrupted after {time.perf_counter() - started:.1f} s", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
