"""``stepmerge``, the console command: the engine's commands (`merge_engine.cli`) plus the pipeline's ``notify``.

``notify`` tells the Prefect server a checkpoint was saved (`flows.events`); it belongs to the
pipeline, and the engine imports nothing above it, so the engine's own command line
(``python -m merge_engine``) offers every command but this one, and this program adds it.
``python -m flows.cli`` is the same program as ``stepmerge``. Prefect is imported only when
``notify`` runs, or when a command names an ``s3://`` / ``gs://`` URL and a Prefect API is
configured: then the storage credentials come from the saved blocks, as in every flow
(`flows.credentials.command_credentials`); otherwise from the environment. Without either, the
command fails in one line naming what to set (the engine's `CredentialsMissing`, exit 1).
"""

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

from merge_engine import cli as engine_cli
from merge_engine.errors import InvalidOption
from merge_engine.options import flag

NOTIFY_HELP = "tell the Prefect server a checkpoint was saved (event stepmerge.checkpoint.saved)"


@dataclass(frozen=True, kw_only=True)
class NotifyArgs:
    """``notify``'s flags."""

    step: int = flag("the global step just saved", required=True, parse=int)
    run_root: str = flag("the run root URL the training job writes global_step_N/ to", required=True)
    role: Literal["actor", "critic", ""] = flag("actor (default), critic, or '' (SFT)", "actor",
                                                choices=("actor", "critic", ""))


def cmd_notify(parsed: argparse.Namespace) -> int:
    """Send ``stepmerge.checkpoint.saved`` to the Prefect server.

    Exit 0 only when the server accepted the event; 1 when it could not be reached or refused it
    (`flows.events.EventNotDelivered`: retry later); 2 for bad input or no server configured.
    """
    args = engine_cli.read_options(parsed, NotifyArgs)
    if args.step < 0:
        raise InvalidOption(f"--step must be >= 0, got {args.step}")
    from flows.events import CHECKPOINT_SAVED, emit_checkpoint_saved, notified_run_root

    run_root = notified_run_root(args.run_root)
    event_id = emit_checkpoint_saved(run_root, args.step, args.role)
    print(f"emitted {CHECKPOINT_SAVED} for {run_root} step {args.step} (role {args.role or 'sft'}); event {event_id}")
    return 0


def add_notify(parser: argparse.ArgumentParser) -> None:
    engine_cli.add_options(parser, NotifyArgs)
    parser.set_defaults(run=cmd_notify)


def _warn(line: str) -> None:
    print(line, file=sys.stderr)


def run_with_credentials(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)`` with the storage credentials every flow uses (`flows.credentials.command_credentials`)."""
    from flows.credentials import command_credentials

    with command_credentials(vars(args).values(), warn=_warn):
        return run(args)


def with_credentials(add: Callable[[argparse.ArgumentParser], None]) -> Callable[[argparse.ArgumentParser], None]:
    """An engine command's parser setup whose ``run`` resolves credentials first."""

    def add_command(parser: argparse.ArgumentParser) -> None:
        add(parser)
        run = parser.get_default("run")
        parser.set_defaults(run=lambda args: run_with_credentials(run, args))

    return add_command


COMMANDS: engine_cli.Commands = {
    **{name: (help_text, with_credentials(add)) for name, (help_text, add) in engine_cli.SUBCOMMANDS.items()},
    "notify": (NOTIFY_HELP, add_notify),
}


def run_command(argv: Optional[Sequence[str]] = None) -> int:
    """Run one `stepmerge` command (engine or pipeline); its exit code."""
    return engine_cli.main(argv, COMMANDS)


if __name__ == "__main__":
    raise SystemExit(run_command())
