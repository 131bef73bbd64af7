"""``python -m merge_engine``: the engine's command line (``stepmerge`` is it plus the pipeline's ``notify``,
`flows.cli`).

Each command builds the engine's one options record (`merge_engine.output.jobs.OutputOptions`) and runs
its job. Accepts verl's model-merger spellings (``merge --backend fsdp --local_dir X --target_dir Y``,
``test --test_hf_dir Z``, ``--tie-word-embedding``, ``--trust-remote-code``, ...) with dashes or
underscores, plus stepmerge's own commands. Every `StepmergeError` becomes one line on stderr
(``stepmerge: error: <Kind>: message [path]``) and its exit code; nothing is printed as a traceback.
SIGINT and SIGTERM stop a command cleanly (`merge_engine.output.interrupts`: the shard jobs stop, their
uploads are aborted, the target is cleaned up), then ``stepmerge: interrupted (SIGINT) after N s`` is
the last thing it does; exit code 130 / 143.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from merge_engine.output import interrupts
from merge_engine.errors import InvalidOption, StepmergeError, StorageUnavailable

class StepmergeParser(argparse.ArgumentParser):
    """argparse without prefix abbreviations, and an unknown flag named with its closest spelling.

    argparse alone reports ``--local-dri X`` as "the following arguments are required: --local_dir"
    (the typo is silently taken for a stray value); here it is "unrecognized flag --local-dri (did you
    mean --local-dir?)", before the required flags are counted.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        for token in sys.argv[1:] if args is None else args:
            if token == "--":
                break
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and flag != "--" and flag not in self._option_string_actions:
                known = [o for o in self._option_string_actions if o.startswith("--")]
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                self.error(f"unrecognized flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
            if not token.startswith("-") and hasattr(self, "_commands"):
                break  # the command's name (known or not): the rest belongs to its parser
        return super().parse_known_args(args, namespace)


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--a_b`` with its ``--a-b`` twin (verl mixes both styles)."""
    dashed, underscored = name.replace("_", "-"), name.replace("-", "_")
    names = [f"--{underscored}"] + ([f"--{dashed}"] if dashed != underscored else [])
    parser.add_argument(*names, **kwargs)


_DTYPE_HELP = "bfloat16/bf16, float16/fp16/half, float32/fp32/float"


def _dtype(text: str) -> str:
    """argparse ``type=``: any spelling of `merge_engine.plan.option_values.DTYPE_SPELLINGS` -> its canonical name
    (what is recorded in stepmerge.json), the same words the Prefect form accepts."""
    from merge_engine.plan.option_values import canonical_dtype

    try:
        return canonical_dtype(text)
    except InvalidOption as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


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
    _flag(parser, "dtype", default=None, type=_dtype, help=f"output dtype ({_DTYPE_HELP}); default: as stored")
    _flag(parser, "custom-mapping", default=None,
          help="Megatron: JSON file extending the model family's name table (see merge_engine/architectures/custom.py)")
    _weights_format_flag(parser)
    _flag(parser, "mtp-layers", default=None, choices=("export", "drop"),
          help="Megatron: multi-token-prediction layers (DeepSeek-V3) written as the Hub checkpoint holds them, "
               "or dropped; a checkpoint with MTP layers is refused without this choice")


def _weights_format_flag(parser: argparse.ArgumentParser, what: str = "") -> None:
    _flag(parser, "weights-format", default="hub", choices=("hub", "transformers"),
          help=f"hub (default): {what}the names and per-expert tensors of the model's Hub checkpoint, what "
               "save_pretrained writes and vLLM/SGLang/PEFT read; transformers: the names as stored (transformers "
               "v5's in-memory names: fused experts, model.language_model)")


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """Where the shard jobs run (same bytes whatever is chosen)."""
    _flag(parser, "workers", type=_positive_int, default=None,
          help="threads writing on this machine, shared out between the output files and their byte "
               "ranges, so a one-file model uses them all (default: one per core)")
    _flag(parser, "ray-address", default=None,
          help="run the shard jobs as tasks of this Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
               "(pip install -c constraints.txt '.[ray]' from the checkout); every worker reads and writes the "
               "storage URLs itself")
    _flag(parser, "requests-in-flight", type=_positive_int, default=None,
          help="ranged GETs in flight per read of an s3:// or gs:// file (default 32, sized for object storage)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _run_options(args: argparse.Namespace) -> dict:
    """``workers`` / ``ray_address`` for `OutputOptions`; ``--requests-in-flight`` set for this process and
    (through its environment) for the Ray workers it starts."""
    in_flight = getattr(args, "requests_in_flight", None)
    if in_flight is not None:
        from merge_engine.storage import tuning

        tuning.REQUESTS_IN_FLIGHT = in_flight
        os.environ["STEPMERGE_REQUESTS_IN_FLIGHT"] = str(in_flight)
    return {"workers": getattr(args, "workers", None), "ray_address": getattr(args, "ray_address", None)}


def _options(args: argparse.Namespace):
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.plan.merge_plan import DEFAULT_MAX_SHARD_SIZE, parse_size

    return OutputOptions(backend=args.backend, dtype=args.dtype,
                         max_shard_size=parse_size(getattr(args, "max_shard_size", None) or DEFAULT_MAX_SHARD_SIZE),
                         hf_model_path=args.hf_model_path, tie_word_embedding=args.tie_word_embedding,
                         custom_mapping=args.custom_mapping, lora_alpha=getattr(args, "lora_alpha", None),
                         weights_format=getattr(args, "weights_format", "hub"),
                         mtp_layers=getattr(args, "mtp_layers", None), base_model=getattr(args, "base_model", None),
                         overwrite=getattr(args, "overwrite", False), **_run_options(args))


def _progress(total: int, label: str, file=None, disable: bool | None = None):
    """A byte progress bar on stderr (off when stderr is not a terminal), in decimal MB like every message."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=label, disable=disable,
                file=file or sys.stderr, dynamic_ncols=True)


def rate_text(n_bytes: int, seconds: float) -> str:
    """``812 MB/s``, ``3.4 MB/s``, ``120 kB/s``: never ``0 MB/s`` for a small, quick merge."""
    rate = n_bytes / max(seconds, 1e-9)
    if rate >= 100e6:
        return f"{rate / 1e6:.0f} MB/s"
    if rate >= 1e6:
        return f"{rate / 1e6:.1f} MB/s"
    return f"{rate / 1e3:.0f} kB/s"


def cmd_merge(args: argparse.Namespace) -> int:
    from merge_engine.commands.merge import merge_checkpoint

    if args.hf_upload_path:
        raise InvalidOption("--hf_upload_path: stepmerge does not upload to the Hugging Face Hub; merge to a folder "
                            "(--target_dir), then upload it with `hf upload REPO_ID FOLDER` (huggingface_hub)")
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
        return _check_trained(args, fused_model_url=result.target_url) if args.check_trained else 0
    print(f"merged {result.layout} checkpoint {result.source_url} -> {result.target_url}: {result.tensors} tensors, "
          f"{result.tensor_bytes / 1e6:.1f} MB in {result.seconds:.2f} s "
          f"({rate_text(result.tensor_bytes, result.seconds)})")
    if args.check_trained:
        return _check_trained(args, fused_model_url=result.target_url)
    return 0


def _check_trained(args: argparse.Namespace, *, fused_model_url: str | None = None,
                   adapter_url: str | None = None) -> int:
    """Run `merge_engine.validate.trained.check_against_trained`, print its report; 0 when it passed (a skip is
    printed as SKIP), else `ValidationFailed` (exit 5) naming the first failed check."""
    from merge_engine.validate.trained import check_against_trained

    report = check_against_trained(args.local_dir, fused_model_url=fused_model_url, adapter_url=adapter_url,
                                   lora_alpha=args.lora_alpha, config_url=args.hf_model_path,
                                   device=getattr(args, "device", None), backend=args.backend)
    print(report.text())
    report.raise_for_failure()
    return 0


def cmd_check_trained(args: argparse.Namespace) -> int:
    if not args.fused_model and not args.adapter:
        raise InvalidOption("give --fused-model and/or --adapter: what to compare with the trained model")
    return _check_trained(args, fused_model_url=args.fused_model, adapter_url=args.adapter)


_CHECK_TRAINED_HELP = ("LoRA checkpoints: after writing, compare the output with the trained model PEFT rebuilds from "
                       "the checkpoint (its LoraConfig; all-linear when the run recorded no targets); exit 5 when it "
                       "is not that model")


def _add_check_trained(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "local_dir", required=True, help="the LoRA training checkpoint URL (PEFT-wrapped model)")
    _flag(parser, "backend", default=None, help="layout of --local_dir; detected when omitted")
    _flag(parser, "fused-model", default=None, help="a Hugging Face folder that should be the trained model")
    _flag(parser, "adapter", default=None, help="a PEFT adapter folder with its base under base/")
    _flag(parser, "lora-alpha", type=float, default=None, help="lora_alpha when the run recorded none")
    _flag(parser, "hf_model_path", default=None, help="folder with the model's config.json instead of huggingface/")
    _flag(parser, "device", default=None, help="torch device of the forward passes (default: cuda when available)")
    parser.set_defaults(run=cmd_check_trained)


def _add_merge(parser: argparse.ArgumentParser) -> None:
    _source_flags(parser)
    _flag(parser, "target_dir", required=True, help="output folder URL")
    _flag(parser, "max-shard-size", default=None, help="largest safetensors file, e.g. 5GB (default), 500MiB")
    _flag(parser, "overwrite", action="store_true", help="replace a target that holds a different model")
    _flag(parser, "lora-alpha", type=float, default=None,
          help="LoRA checkpoints only: lora_alpha when the run recorded none (never guessed)")
    _flag(parser, "base-model", default=None,
          help="a Megatron LoRA step saved without its base (verl + Megatron-Bridge PEFT): the Hugging Face model "
               "the run trained from, to fuse the adapter into")
    _flag(parser, "check-trained", action="store_true", help=_CHECK_TRAINED_HELP)
    _run_flags(parser)
    _flag(parser, "hf_upload_path", default=None, help=argparse.SUPPRESS)
    _flag(parser, "private", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(run=cmd_merge)


def cmd_check(args: argparse.Namespace) -> int:
    from merge_engine.layouts import check_checkpoint
    from merge_engine.release.verify import is_release_folder, raise_for, verify_folder

    if is_release_folder(args.local_dir):  # a release is complete only if it is what was published
        raise_for(verify_folder(args.local_dir, mode="quick"))
    checkpoint = check_checkpoint(args.local_dir, args.backend)
    sizes = ", ".join(f"{k}={v}" for k, v in checkpoint.parallel.items())
    sizes = f"{sizes}; " if sizes else ""  # a layout without parallel sizes (hf) printed a stray "(;"
    total = sum(f.size for f in checkpoint.files)
    print(f"complete {checkpoint.layout} checkpoint at {checkpoint.url} ({sizes}{len(checkpoint.files)} files, "
          f"{total / 1e6:.1f} MB; fingerprint {checkpoint.fingerprint[:12]})")
    return 0


CHECK_EXIT_CODES = """exit codes:
  0  the checkpoint is complete (every file its layout requires, readable and consistent)
  1  the storage or the machine failed: a store unreachable through every retry, no credentials for it,
     no access to a local path (not a verdict on the checkpoint: run it again once that is fixed)
  2  bad input: not a checkpoint, an unsupported layout, a bad option
  3  incomplete: a file is missing or short, or the rank files disagree on the world size,
     or a file changed while it was read (SourceChanged); for a release: no valid _COMPLETE marker
  4  corrupt: a file is there but cannot be read (truncated archive, bad header, unsafe pickle,
     a zip record whose CRC-32 does not match, names sharing one storage that the config does not tie)
  6  a release (a folder with a manifest) differs from its manifest: a file missing, resized or rewritten"""


def _add_check(parser: argparse.ArgumentParser) -> None:
    parser.epilog = CHECK_EXIT_CODES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    _flag(parser, "backend", default=None, help="checkpoint layout; detected when omitted")
    _flag(parser, "local_dir", required=True, help="checkpoint folder URL")
    parser.set_defaults(run=cmd_check)


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: intact; 3: no valid _COMPLETE marker; 6: damaged (each bad file named); 2: nothing to
    verify against, or no checksums to verify with; 1: storage unreachable. See `merge_engine.release.verify`."""
    from merge_engine.release.verify import raise_for, verify_folder

    report = verify_folder(args.url, mode="quick" if args.quick else "full")
    raise_for(report)
    print(report.summary())
    return 0


def _add_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="release (or merged folder) URL")
    _flag(parser, "quick", action="store_true",
          help="on object stores compare the store's recorded versions (one listing, no byte read) instead of "
               "re-hashing; local files are re-hashed anyway")
    parser.set_defaults(run=cmd_verify)


def cmd_test(args: argparse.Namespace) -> int:
    from merge_engine.commands.reference_check import check_against_reference
    from merge_engine.validate.compare import WEIGHT_TOLERANCE

    atol = WEIGHT_TOLERANCE.atol if args.atol is None else args.atol
    rtol = WEIGHT_TOLERANCE.rtol if args.rtol is None else args.rtol
    report = check_against_reference(args.local_dir, args.test_hf_dir, _options(args), atol=atol, rtol=rtol)
    print(report.text())  # plain text: `summary` is the UI's Markdown
    return 0 if report.ok else 5


def _add_test(parser: argparse.ArgumentParser) -> None:
    _source_flags(parser)
    _flag(parser, "test_hf_dir", required=True, help="reference Hugging Face folder to compare against")
    _flag(parser, "atol", type=float, help="absolute tolerance (default: the engine's weight tolerance, verl's 1e-6)")
    _flag(parser, "rtol", type=float, help="relative tolerance (default: the engine's weight tolerance, verl's 1e-6)")
    parser.set_defaults(run=cmd_test)


def _floats(text: str | None, flag: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidOption(f"{flag} takes comma-separated numbers, got {text!r}") from None


def _print_lora_result(result, verb: str) -> None:
    if result.skipped:
        print(f"{result.target_url} already holds this output (fingerprint {result.fingerprint[:12]}); nothing to do")
        return
    for report in result.modules:
        print(f"  {report.module}: rank {report.rank}, relative error {report.relative_error:.3e}")
    if result.modules:
        errors = [r.relative_error for r in result.modules]
        print(f"  {len(errors)} modules: relative error max {max(errors):.3e}, mean {sum(errors) / len(errors):.3e}")
    for note in result.notes:
        print(f"  note: {note}")
    print(f"{verb} -> {result.target_url} ({result.kind}): {result.tensors} tensors, "
          f"{result.tensor_bytes / 1e6:.1f} MB in {result.seconds:.2f} s")


def cmd_extract_lora(args: argparse.Namespace) -> int:
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.commands.extract import extract_lora, extract_lora_svd
    from merge_engine.plan.merge_plan import DEFAULT_MAX_SHARD_SIZE, parse_size

    if (args.local_dir is None) == (args.finetuned is None):
        raise InvalidOption("give either --local_dir (a LoRA training checkpoint) or --finetuned with --base-model "
                            "(SVD of a full fine-tune)")
    if args.finetuned is not None:
        if args.base_model is None:
            raise InvalidOption("--finetuned needs --base-model (the model it was fine-tuned from)")
        if args.lora_alpha is not None or args.adapter_only or args.check_trained:
            raise InvalidOption("--lora-alpha / --adapter-only / --check-trained apply to --local_dir checkpoints")
        targets = tuple(t for t in args.target_modules.split(",") if t) if args.target_modules else None
        options = OutputOptions(backend=args.backend, rank=args.rank, energy=args.energy, target_modules=targets,
                                dtype=args.dtype, device=args.device, overwrite=args.overwrite)
        result = extract_lora_svd(args.base_model, args.finetuned, args.target_dir, options)
        _print_lora_result(result, f"SVD-extracted {args.finetuned} - {args.base_model}")
        return 0
    if args.rank is not None or args.energy is not None or args.target_modules or args.device:
        raise InvalidOption("--rank / --energy / --target-modules / --device apply to --finetuned (SVD extraction)")
    options = OutputOptions(backend=args.backend, lora_alpha=args.lora_alpha, base_model=args.base_model,
                            write_base=not args.adapter_only, hf_model_path=args.hf_model_path, dtype=args.dtype,
                            weights_format=args.weights_format,
                            max_shard_size=parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE),
                            overwrite=args.overwrite, **_run_options(args))
    result = extract_lora(args.local_dir, args.target_dir, options)
    _print_lora_result(result, f"extracted LoRA from {args.local_dir}")
    if args.check_trained:
        return _check_trained(args, adapter_url=result.target_url)
    return 0


def _add_extract_lora(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "local_dir", default=None, help="LoRA training checkpoint URL (PEFT-wrapped model)")
    _flag(parser, "backend", default=None, help="layout of --local_dir / --finetuned (fsdp, hf); detected when omitted")
    _flag(parser, "target_dir", required=True,
          help="output URL: the PEFT adapter folder (the clean base goes to <target>/base/)")
    _flag(parser, "lora-alpha", type=float, default=None,
          help="lora_alpha when the run recorded none (never guessed; must agree with the run's metadata)")
    _flag(parser, "base-model", default=None,
          help="base model URL: checks a LoRA-only checkpoint's adapter; with --finetuned, the SVD's base")
    _flag(parser, "adapter-only", action="store_true", help="do not write the clean base model")
    _flag(parser, "hf_model_path", default=None, help="folder with config.json + tokenizer overriding huggingface/")
    _flag(parser, "finetuned", default=None,
          help="full fine-tune URL (Hugging Face folder or FSDP checkpoint): extract (finetuned - base) by SVD")
    _flag(parser, "rank", type=int, default=None, help="SVD: rank of each module's adapter")
    _flag(parser, "energy", type=float, default=None,
          help="SVD: keep this fraction of each update's squared singular values (capped by --rank)")
    _flag(parser, "target-modules", default=None, help="SVD: modules to factor, e.g. q_proj,v_proj (default: all "
          "linear weights but embeddings and heads)")
    _flag(parser, "device", default=None, help="SVD: torch device (default: cuda when available, else cpu)")
    _flag(parser, "dtype", default=None, type=_dtype,
          help=f"output dtype ({_DTYPE_HELP}; default: as stored; float32 for SVD factors)")
    _flag(parser, "max-shard-size", default=None, help="largest safetensors file of the base, e.g. 5GB")
    _weights_format_flag(parser, "the base/ folder and the adapter's module names: ")
    _flag(parser, "overwrite", action="store_true", help="replace a target that holds something else")
    _flag(parser, "check-trained", action="store_true", help=_CHECK_TRAINED_HELP)
    _run_flags(parser)
    parser.set_defaults(run=cmd_extract_lora)


def cmd_merge_lora(args: argparse.Namespace) -> int:
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.commands.combine import merge_lora
    from merge_engine.plan.merge_plan import DEFAULT_MAX_SHARD_SIZE, parse_size

    adapters = [u for u in args.lora_adapter.split(",") if u]
    options = OutputOptions(method=args.merge_method, weights=_floats(args.adapter_weights, "--adapter-weights"),
                            output=args.output, rank=args.rank, energy=args.energy,
                            lora_alpha=_floats(args.lora_alpha, "--lora-alpha"), dtype=args.dtype,
                            weights_format=args.weights_format,
                            max_shard_size=parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE),
                            device=args.device, overwrite=args.overwrite, **_run_options(args))
    bar = None

    def on_plan(plan) -> None:
        nonlocal bar
        print(f"planned {len(plan.tensors)} tensors, {plan.total_size / 1e6:.1f} MB in {len(plan.shards)} file(s)",
              file=sys.stderr)
        bar = _progress(plan.total_size, "merge-lora")

    try:
        result = merge_lora(args.base_model, adapters, args.target_dir, options,
                            on_bytes=lambda n: bar.update(n) if bar else None, on_plan=on_plan)
    finally:
        if bar is not None:
            bar.close()
    _print_lora_result(result, f"{options.method} of {len(adapters)} adapter(s)")
    return 0


def _add_merge_lora(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "base-model", default=None, help="base model URL (Hugging Face folder); required for --output model")
    _flag(parser, "lora-adapter", required=True, help="PEFT adapter folder URL(s), comma-separated")
    _flag(parser, "target_dir", required=True, help="output URL")
    _flag(parser, "merge-method", default="concat", choices=("concat", "weighted", "average"),
          help="concat: sum of all updates; weighted: with --adapter-weights; average: equal weights")
    _flag(parser, "adapter-weights", default=None, help="weighted: one weight per adapter, comma-separated")
    _flag(parser, "output", default="model", choices=("model", "adapter"),
          help="model: the fused model; adapter: one adapter (exact rank stacking, or SVD with --rank/--energy)")
    _flag(parser, "rank", type=int, default=None, help="adapter output: re-factor each module to this rank by SVD")
    _flag(parser, "energy", type=float, default=None,
          help="adapter output: keep this fraction of each update's squared singular values (capped by --rank)")
    _flag(parser, "lora-alpha", default=None,
          help="one lora_alpha per adapter, comma-separated: replaces a lost (0) alpha in adapter_config.json")
    _flag(parser, "dtype", default=None, type=_dtype, help=f"output dtype ({_DTYPE_HELP}; default: as stored)")
    _flag(parser, "device", default=None, help="SVD device (default: cuda when available, else cpu)")
    _flag(parser, "max-shard-size", default=None, help="largest safetensors file, e.g. 5GB (default)")
    _weights_format_flag(parser, "the fused model in ")
    _flag(parser, "overwrite", action="store_true", help="replace a target that holds something else")
    _run_flags(parser)
    parser.set_defaults(run=cmd_merge_lora)


def cmd_split(args: argparse.Namespace) -> int:
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.commands.split import split_hf_to_megatron

    options = OutputOptions(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, fmt=args.format,
                            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, dtype=args.dtype,
                            custom_mapping=args.custom_mapping, overwrite=args.overwrite, **_run_options(args))
    result = split_hf_to_megatron(args.hf_dir, args.target_dir, options)
    if result.skipped:
        print(f"{result.target_url} already holds this split; nothing to do")
        return 0
    sizes = f"TP={args.tp} PP={args.pp}" + (f" VPP={args.vpp}" if args.vpp else "") + (f" EP={args.ep}" if args.ep > 1
                                                                                      else "")
    total = sum(size for _, size in result.files)
    print(f"split {result.source_url} -> {result.target_url} ({result.fmt}, {sizes}): {result.tensors} Megatron "
          f"tensors, {len(result.files)} files, {total / 1e6:.1f} MB in {result.seconds:.2f} s")
    return 0


def _add_split(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "to", default="megatron", choices=("megatron",), help="target framework (megatron)")
    _flag(parser, "hf-dir", required=True, help="Hugging Face model folder URL")
    _flag(parser, "target_dir", required=True, help="output folder URL")
    _flag(parser, "tp", type=int, default=1, help="tensor-parallel size")
    _flag(parser, "pp", type=int, default=1, help="pipeline-parallel size")
    _flag(parser, "vpp", type=int, default=None, help="virtual pipeline (interleaved) chunks per stage")
    _flag(parser, "ep", type=int, default=1, help="expert-parallel size (MoE)")
    _flag(parser, "format", default="legacy", choices=("legacy", "dist"),
          help="legacy: model/mp_rank_*/model.pt; dist: torch_dist dist_ckpt/")
    _flag(parser, "make-vocab-size-divisible-by", type=int, default=128,
          help="Megatron pads the vocabulary to a multiple of this times TP (default 128)")
    _flag(parser, "dtype", default=None, type=_dtype, help=f"dtype of the shards ({_DTYPE_HELP}; default: as stored)")
    _flag(parser, "custom-mapping", default=None, help="JSON file extending the model family's name table")
    _flag(parser, "overwrite", action="store_true", help="replace a target that holds something else")
    _run_flags(parser)  # each rank file (legacy) or layer's DCP data file (dist) is one job
    parser.set_defaults(run=cmd_split)


def cmd_discover(args: argparse.Namespace) -> int:
    from merge_engine.layouts.discovery import discover

    found = discover(args.run_root)
    hint = f"; tracker file says {found.tracker_hint}" if found.tracker_hint is not None else ""
    print(f"{len(found.steps)} checkpoint(s) under {found.run_root}{hint}")
    for step in found.steps:
        reason = f" ({step.reason})" if step.reason else ""
        print(f"  step {step.step:>6}  {step.role or '(sft)':7s} {step.layout:16s} {step.status}{reason}  {step.url}")
    return 0


def _add_discover(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "run-root", required=True, help="training run folder URL holding global_step_N/ (or iter_N/)")
    parser.set_defaults(run=cmd_discover)


Commands = dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]]  # name -> (help, add arguments)

SUBCOMMANDS: Commands = {
    "discover": ("list the checkpoints of a training run and whether each is complete", _add_discover),
    "merge": ("merge a checkpoint into a Hugging Face folder", _add_merge),
    "test": ("compare a checkpoint with a reference Hugging Face folder (verl's test)", _add_test),
    "check": ("check that a checkpoint is complete (exit 0) or not (non-zero)", _add_check),
    "verify": ("verify a release (or merged folder) against its manifest: sizes, sha256, marker "
               "(exit 0 intact, 6 damaged, 3 unmarked)", _add_verify),
    "extract-lora": ("extract a PEFT adapter (+ clean base) from a LoRA checkpoint, or by SVD from a fine-tune",
                     _add_extract_lora),
    "merge-lora": ("fuse LoRA adapters into a base model, or combine them into one adapter", _add_merge_lora),
    "split": ("write a Hugging Face model as Megatron TP/PP/EP shards (the reverse of merge)", _add_split),
    "check-trained": ("compare a fused model and/or an adapter with the model a LoRA checkpoint trained (PEFT's own "
                      "model of the run, rebuilt from the checkpoint); exit 5 when they differ", _add_check_trained),
}


def build_parser(commands: Commands = SUBCOMMANDS) -> argparse.ArgumentParser:
    """The parser of ``commands`` (name -> (help, add its arguments and ``run``)); by default the engine's."""
    from merge_engine import __version__

    parser = StepmergeParser(
        prog="stepmerge", description="Turn distributed training checkpoints (verl FSDP, Megatron) into exact, "
                                      "validated Hugging Face models and adapters, from any storage URL.")
    parser.add_argument("--version", action="version", version=f"stepmerge {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=StepmergeParser)
    for name, (help_text, add) in commands.items():
        add(subparsers.add_parser(name, help=help_text, description=help_text))
    parser._commands = tuple(commands)
    return parser


def _line_buffered_stdout() -> None:
    """Results (stdout) and progress / errors (stderr) in the order they happened, also when both go
    to one pipe or file (``2>&1 | tee``): stdout is block-buffered there unless told otherwise."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(line_buffering=True)
        except (ValueError, OSError):  # a replaced or closed stream (tests capture it): nothing to do
            pass


def main(argv: Sequence[str] | None = None, commands: Commands = SUBCOMMANDS) -> int:
    """Run one command; a `StepmergeError` is one line on stderr and its exit code. ``commands`` lets a
    program built on the engine add its own (the ``stepmerge`` console entry adds the pipeline's
    ``notify``: `flows.cli`)."""
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    _line_buffered_stdout()
    started = time.perf_counter()
    with interrupts.handling_signals():
        try:
            return args.run(args)
        except StepmergeError as exc:
            sys.stdout.flush()  # what was printed before the error comes before it, even through one pipe
            print(f"stepmerge: error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return exc.exit_code
        except StorageUnavailable as exc:  # the store, not the checkpoint: down through every retry
            sys.stdout.flush()
            print(f"stepmerge: error: StorageUnavailable: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # the machine, not the checkpoint: a full disk, a path that is a file, no access
            where = f" [{exc.filename}]" if exc.filename else ""
            print(f"stepmerge: error: {type(exc).__name__}: {exc.strerror or exc}{where}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as exc:  # SIGINT or SIGTERM: every job has stopped and the target is clean
            signum = exc.signum if isinstance(exc, interrupts.Interrupted) else signal.SIGINT
            print(f"stepmerge: interrupted ({signal.Signals(signum).name}) after "
                  f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
            return 128 + signum


if __name__ == "__main__":
    raise SystemExit(main())
