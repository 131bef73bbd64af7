"""``python -m merge_engine``: the engine's command line (``stepmerge`` is it plus the pipeline's ``notify``).

Each command's flags are derived from its options record (`merge_engine.options`: `add_options`) and read
back into it (`read_options`); the command builds the engine's one options record
(`merge_engine.output.jobs.OutputOptions`) from it and runs its job. Accepts verl's model-merger spellings
(``merge --backend fsdp --local_dir X --target_dir Y``, ``test --test_hf_dir Z``, ``--tie-word-embedding``,
``--trust-remote-code``, ...) with dashes or underscores, plus stepmerge's own commands. Every
`StepmergeError` becomes one line on stderr (``stepmerge: error: <Kind>: message [path]``) and its exit code;
nothing is printed as a traceback.
SIGINT and SIGTERM stop a command cleanly (`merge_engine.output.interrupts`: the shard jobs stop, their
uploads are aborted, the target is cleaned up), then ``stepmerge: interrupted (SIGINT) after N s`` is
the last thing it does; exit code 130 / 143.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from merge_engine.output import interrupts
from merge_engine import options as declared
from merge_engine.errors import InvalidOption, StepmergeError, StorageUnavailable

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from merge_engine.output.jobs import OutputOptions

Args = TypeVar("Args", bound="DataclassInstance")  # a command's options record (`merge_engine.options`)

class StepmergeParser(argparse.ArgumentParser):
    """argparse without prefix abbreviations, and an unknown flag named with its closest spelling.

    argparse alone reports ``--local-dri X`` as "the following arguments are required: --local_dir"
    (the typo is silently taken for a stray value); here it is "unrecognized flag --local-dri (did you
    mean --local-dir?)", before the required flags are counted.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._commands: tuple[str, ...] | None = None  # the top parser's: the command names (`build_parser`)

    def parse_known_args(self, args=None, namespace=None):
        for token in sys.argv[1:] if args is None else args:
            if token == "--":
                break
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and flag != "--" and flag not in self._option_string_actions:
                known = [o for o in self._option_string_actions if o.startswith("--")]
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                self.error(f"unrecognized flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
            if not token.startswith("-") and self._commands is not None:
                break  # the command's name (known or not): the rest belongs to its parser
        return super().parse_known_args(args, namespace)


def _argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """argparse ``type=`` of a flag's parser: an `InvalidOption` turned into argparse's one-line refusal."""

    def read(text: str) -> object:
        try:
            return parse(text)
        except InvalidOption as exc:
            raise argparse.ArgumentTypeError(exc.message) from None

    read.__name__ = parse.__name__  # argparse names it in "invalid <name> value"
    return read


def _listed(record: type) -> list[dataclasses.Field]:
    """``record``'s fields in ``--help``'s order: the positional and required ones, then the command's own, then
    the run flags it shares (`merge_engine.options.RunArgs`)."""
    run = {f.name for f in dataclasses.fields(declared.RunArgs)}

    def place(item: dataclasses.Field) -> tuple[bool, bool]:
        marker: declared.Flag = item.metadata[declared.FLAG]
        return not (marker.required or marker.positional), item.name in run

    return sorted(dataclasses.fields(record), key=place)


def add_options(parser: argparse.ArgumentParser, record: type) -> None:
    """Add the flags of ``record`` (a command's options record, `merge_engine.options`): each field's spellings,
    help, parser, default and choices from its `Flag`; a bool field is a switch; a field's hidden spellings
    are taken but not listed in ``--help``."""
    hints = typing.get_type_hints(record)
    for item in _listed(record):
        marker: declared.Flag = item.metadata[declared.FLAG]
        kwargs: dict = {"help": marker.help}
        if hints[item.name] in (bool, bool | None):
            kwargs["action"] = "store_false" if item.default is True else "store_true"
        elif marker.parse is not None:
            kwargs["type"] = _argument_type(marker.parse)
        if marker.choices:
            kwargs["choices"] = marker.choices
        if marker.positional:
            parser.add_argument(item.name, **kwargs)
            continue
        if marker.required:
            kwargs["required"] = True
        else:
            kwargs["default"] = item.default
        parser.add_argument(*marker.spellings(item.name), dest=item.name, **kwargs)
        if marker.hidden_names:
            parser.add_argument(*marker.spellings(item.name, hidden=True), dest=item.name,
                                **{**kwargs, "help": argparse.SUPPRESS})


def read_options(args: argparse.Namespace, record: type[Args]) -> Args:
    """The command's options record from its parsed flags."""
    return record(**{f.name: getattr(args, f.name) for f in dataclasses.fields(record)})


def _options(given: DataclassInstance, **settings: Any) -> OutputOptions:
    """The engine's options record (`OutputOptions`) from a command's record (each field sets the engine option of
    its name, or its `Flag.sets`) and ``settings``; ``--requests-in-flight`` is set for this process and (through
    its environment) for the Ray workers it starts."""
    from merge_engine.output.jobs import OutputOptions

    in_flight = getattr(given, "requests_in_flight", None)
    if in_flight is not None:
        from merge_engine.storage import tuning

        tuning.REQUESTS_IN_FLIGHT = in_flight
        os.environ["STEPMERGE_REQUESTS_IN_FLIGHT"] = str(in_flight)
    engine = {f.name for f in dataclasses.fields(OutputOptions)}
    values = {}
    for item in dataclasses.fields(given):
        name = item.metadata[declared.FLAG].sets or item.name
        if name in engine and name not in settings:
            values[name] = getattr(given, item.name)
    return OutputOptions(**values, **settings)


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


def _ray_started(args: declared.MergeArgs):
    """With ``--ray-address``: the checkpoint checked (torch-free, so a bad one fails before any cluster is
    asked), then the Ray executor, made before the command's modules (torch) are imported, so that the
    cluster's connection and its workers' start overlap those imports (`RayExecutor.at`). (None, None) else."""
    if not getattr(args, "ray_address", None):
        return None, None
    from merge_engine.layouts import check_checkpoint
    from merge_engine.output.executors import executor_address, executor_at

    checkpoint = check_checkpoint(args.local_dir, args.backend)
    same = checkpoint.url.rstrip("/") == args.local_dir.rstrip("/")  # else the merge finds its own (a LoRA step)
    return (checkpoint if same else None), executor_at(executor_address(None, args.ray_address))


def cmd_merge(parsed: argparse.Namespace) -> int:
    args = read_options(parsed, declared.MergeArgs)
    checkpoint, executor = _ray_started(args)
    from merge_engine.commands.merge import merge_checkpoint

    bar = None
    printed: list[str] = []  # the plan's notes, shown before the bar; the job's others after it

    def on_plan(plan) -> None:
        nonlocal bar
        print(f"planned {len(plan.tensors)} tensors, {plan.total_size / 1e6:.1f} MB in {len(plan.shards)} file(s)",
              file=sys.stderr)
        for note in plan.notes:
            print(f"  note: {note}", file=sys.stderr)
        printed.extend(plan.notes)
        bar = _progress(plan.total_size, "merge")

    try:
        result = merge_checkpoint(args.local_dir, args.target_dir, _options(args),
                                  on_bytes=lambda n: bar.update(n) if bar else None, on_plan=on_plan,
                                  checkpoint=checkpoint, executor=executor)
    finally:
        if bar is not None:
            bar.close()
    if result.skipped:
        print(f"{result.target_url} already holds this merge (fingerprint {result.fingerprint[:12]}); nothing to do")
    else:
        for note in result.notes:  # the metadata files left out among them
            if note not in printed:
                print(f"  note: {note}", file=sys.stderr)
        print(f"merged {result.layout} checkpoint {result.source_url} -> {result.target_url}: {result.tensors} "
              f"tensors, {result.tensor_bytes / 1e6:.1f} MB in {result.seconds:.2f} s "
              f"({rate_text(result.tensor_bytes, result.seconds)})")
    code = _check_trained(args, fused_model_url=result.target_url) if args.check_trained else 0
    if code == 0 and args.hf_upload_path:  # verl's upload, after the merge (and its check) succeeded
        _push(result.target_url, args.hf_upload_path, None, args.private)
    return code


def _check_trained(args: declared.MergeArgs | declared.ExtractLoraArgs | declared.CheckTrainedArgs, *,
                   fused_model_url: str | None = None, adapter_url: str | None = None) -> int:
    """Run `merge_engine.validate.trained.check_against_trained`, print its report; 0 when it passed (a skip is
    printed as SKIP), else `ValidationFailed` (exit 5) naming the first failed check."""
    from merge_engine.validate.trained import check_against_trained

    assert args.local_dir is not None  # extract-lora checks a --local_dir checkpoint only
    report = check_against_trained(args.local_dir, fused_model_url=fused_model_url, adapter_url=adapter_url,
                                   lora_alpha=args.lora_alpha, config_url=args.hf_model_path,
                                   device=getattr(args, "device", None), backend=args.backend)
    print(report.text())
    report.raise_for_failure()
    return 0


def cmd_check_trained(parsed: argparse.Namespace) -> int:
    args = read_options(parsed, declared.CheckTrainedArgs)
    if not args.fused_model and not args.adapter:
        raise InvalidOption("give --fused-model and/or --adapter: what to compare with the trained model")
    return _check_trained(args, fused_model_url=args.fused_model, adapter_url=args.adapter)


def _add_check_trained(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.CheckTrainedArgs)
    parser.set_defaults(run=cmd_check_trained)


def _add_merge(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.MergeArgs)
    parser.set_defaults(run=cmd_merge)


def cmd_check(parsed: argparse.Namespace) -> int:
    args = read_options(parsed, declared.CheckArgs)
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
    add_options(parser, declared.CheckArgs)
    parser.set_defaults(run=cmd_check)


def cmd_verify(parsed: argparse.Namespace) -> int:
    """Exit 0: intact; 3: no valid _COMPLETE marker; 6: damaged (each bad file named); 2: nothing to
    verify against, or no checksums to verify with; 1: storage unreachable. See `merge_engine.release.verify`."""
    from merge_engine.release.verify import raise_for, verify_folder

    args = read_options(parsed, declared.VerifyArgs)
    report = verify_folder(args.url, mode="quick" if args.quick else "full")
    raise_for(report)
    print(report.summary())
    return 0


def _add_verify(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.VerifyArgs)
    parser.set_defaults(run=cmd_verify)


def _push(url: str, repo: str, revision: str | None, private: bool) -> None:
    """Push ``url`` to the Hub (`merge_engine.release.hub.push_folder`; ``HF_ENDPOINT``: another Hub) and say so."""
    from merge_engine.release.hub import push_folder

    pushed = push_folder(url, repo, revision=revision, private=private, endpoint=os.environ.get("HF_ENDPOINT") or None)
    print(pushed.summary())


def cmd_push(parsed: argparse.Namespace) -> int:
    """Exit 0: pushed and verified (or already there); 2: refused (one line: token, access, repo, network) or
    nothing to push; 3: a release without a valid marker; 6: the Hub's files differ from the manifest."""
    args = read_options(parsed, declared.PushArgs)
    _push(args.url, args.repo, args.revision, args.private)
    return 0


def _add_push(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.PushArgs)
    parser.set_defaults(run=cmd_push)


def cmd_register(parsed: argparse.Namespace) -> int:
    """Exit 0: a model version of the release (new, or the one already registered); 2: refused (one line: no MLflow
    client, a local release, the server out of reach or refusing, no tracking URI); 3: not a published release."""
    from merge_engine.release.registry import register_release

    args = read_options(parsed, declared.RegisterArgs)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise InvalidOption("--tracking-uri: no MLflow tracking server given (nor MLFLOW_TRACKING_URI)")
    print(register_release(args.url, uri, args.name, run_root=args.run_root, step=args.step).summary())
    return 0


def _add_register(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.RegisterArgs)
    parser.set_defaults(run=cmd_register)


def cmd_test(parsed: argparse.Namespace) -> int:
    from merge_engine.commands.reference_check import check_against_reference
    from merge_engine.validate.compare import WEIGHT_TOLERANCE

    args = read_options(parsed, declared.TestArgs)
    atol = WEIGHT_TOLERANCE.atol if args.atol is None else args.atol
    rtol = WEIGHT_TOLERANCE.rtol if args.rtol is None else args.rtol
    report = check_against_reference(args.local_dir, args.test_hf_dir, _options(args), atol=atol, rtol=rtol)
    print(report.text())  # plain text: `summary` is the UI's Markdown
    return 0 if report.ok else 5


def _add_test(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.TestArgs)
    parser.set_defaults(run=cmd_test)


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


def cmd_extract_lora(parsed: argparse.Namespace) -> int:
    from merge_engine.commands.extract import extract_lora, extract_lora_svd

    args = read_options(parsed, declared.ExtractLoraArgs)
    only = declared.flag_name(declared.ExtractLoraArgs, "include_base")

    if (args.local_dir is None) == (args.finetuned is None):
        raise InvalidOption("give either --local_dir (a LoRA training checkpoint) or --finetuned with --base-model "
                            "(SVD of a full fine-tune)")
    if args.finetuned is not None:
        if args.base_model is None:
            raise InvalidOption("--finetuned needs --base-model (the model it was fine-tuned from)")
        if args.lora_alpha is not None or not args.include_base or args.check_trained:
            raise InvalidOption(f"--lora-alpha / {only} / --check-trained apply to --local_dir checkpoints")
        result = extract_lora_svd(args.base_model, args.finetuned, args.target_dir, _options(args))
        _print_lora_result(result, f"SVD-extracted {args.finetuned} - {args.base_model}")
        return 0
    if args.rank is not None or args.energy is not None or args.target_modules or args.device:
        raise InvalidOption("--rank / --energy / --target-modules / --device apply to --finetuned (SVD extraction)")
    assert args.local_dir is not None  # one of the two is given: checked above
    result = extract_lora(args.local_dir, args.target_dir, _options(args))
    _print_lora_result(result, f"extracted LoRA from {args.local_dir}")
    if args.check_trained:
        return _check_trained(args, adapter_url=result.target_url)
    return 0


def _add_extract_lora(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.ExtractLoraArgs)
    parser.set_defaults(run=cmd_extract_lora)


def cmd_merge_lora(parsed: argparse.Namespace) -> int:
    from merge_engine.commands.combine import merge_lora

    args = read_options(parsed, declared.MergeLoraArgs)
    adapters = list(args.lora_adapter or ())
    options = _options(args)
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
    add_options(parser, declared.MergeLoraArgs)
    parser.set_defaults(run=cmd_merge_lora)


def cmd_split(parsed: argparse.Namespace) -> int:
    from merge_engine.commands.split import split_hf_to_megatron

    args = read_options(parsed, declared.SplitArgs)
    result = split_hf_to_megatron(args.hf_dir, args.target_dir, _options(args))
    if result.skipped:
        print(f"{result.target_url} already holds this split; nothing to do")
        return 0
    sizes = f"TP={args.tp} PP={args.pp}" + (f" VPP={args.vpp}" if args.vpp else "") + (f" EP={args.ep}" if args.ep > 1
                                                                                      else "")
    total = sum(size for _, size in result.files)
    for note in result.notes:
        print(f"  note: {note}")
    print(f"split {result.source_url} -> {result.target_url} ({result.fmt}, {sizes}): {result.tensors} Megatron "
          f"tensors, {len(result.files)} files, {total / 1e6:.1f} MB in {result.seconds:.2f} s")
    return 0


def _add_split(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.SplitArgs)
    parser.set_defaults(run=cmd_split)


def cmd_discover(parsed: argparse.Namespace) -> int:
    from merge_engine.layouts.discovery import discover

    args = read_options(parsed, declared.DiscoverArgs)
    found = discover(args.run_root)
    hint = f"; tracker file says {found.tracker_hint}" if found.tracker_hint is not None else ""
    print(f"{len(found.steps)} checkpoint(s) under {found.run_root}{hint}")
    for step in found.steps:
        reason = f" ({step.reason})" if step.reason else ""
        print(f"  step {step.step:>6}  {step.role or '(sft)':7s} {step.layout:16s} {step.status}{reason}  {step.url}")
    return 0


def _add_discover(parser: argparse.ArgumentParser) -> None:
    add_options(parser, declared.DiscoverArgs)
    parser.set_defaults(run=cmd_discover)


Commands = dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]]  # name -> (help, add arguments)

SUBCOMMANDS: Commands = {
    "discover": ("list the checkpoints of a training run and whether each is complete", _add_discover),
    "merge": ("merge a checkpoint into a Hugging Face folder", _add_merge),
    "test": ("compare a checkpoint with a reference Hugging Face folder (verl's test)", _add_test),
    "check": ("check that a checkpoint is complete (exit 0) or not (non-zero)", _add_check),
    "verify": ("verify a release (or merged folder) against its manifest: sizes, sha256, marker "
               "(exit 0 intact, 6 damaged, 3 unmarked)", _add_verify),
    "push": ("push a release (or merged folder) to the Hugging Face Hub, one revision per step, verified against "
             "its manifest", _add_push),
    "register": ("register a published release as a model version in MLflow's Model Registry, by reference (its "
                 "URL is the version's source; tags: run root, step, fingerprint, manifest sha256)", _add_register),
    "extract-lora": ("extract a PEFT adapter (+ clean base) from a LoRA checkpoint, or by SVD from a fine-tune",
                     _add_extract_lora),
    "merge-lora": ("fuse LoRA adapters into a base model, or combine them into one adapter", _add_merge_lora),
    "split": ("write a Hugging Face model as Megatron TP/PP/EP shards (the reverse of merge)", _add_split),
    "check-trained": ("compare a fused model and/or an adapter with the model a LoRA checkpoint trained (PEFT's own "
                      "model of the run, rebuilt from the checkpoint); exit 5 when they differ", _add_check_trained),
}


# the commands that read models with transformers / peft: refused at start unless the installed pair is a tested
# one (`merge_engine.versions`, read from package metadata); check, discover and verify need neither
NEEDS_TRANSFORMERS = frozenset({"merge", "test", "extract-lora", "merge-lora", "split", "check-trained"})


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
    ``notify``)."""
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    _line_buffered_stdout()
    started = time.perf_counter()
    with interrupts.handling_signals():
        try:
            if args.command in NEEDS_TRANSFORMERS:
                from merge_engine.versions import require_tested_versions

                require_tested_versions()
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
