"""``stepmerge``, the console command: the engine's commands (`merge_engine.cli`) plus the pipeline's ``notify``.

``notify`` tells the Prefect server a checkpoint was saved (`flows.events`); it belongs to the
pipeline, and the engine imports nothing above it, so the engine's own command line
(``python -m merge_engine``) offers every command but this one, and this program adds it.
``python -m flows.cli`` is the same program as ``stepmerge``. Prefect is imported only when
``notify`` runs: the engine's commands start as fast as before.
"""

import argparse
from typing import Optional, Sequence

from merge_engine import cli as engine_cli
from merge_engine.errors import InvalidOption

NOTIFY_HELP = "tell the Prefect server a checkpoint was saved (event stepmerge.checkpoint.saved)"


def cmd_notify(args: argparse.Namespace) -> int:
    """Send ``stepmerge.checkpoint.saved`` to the Prefect server.

    Exit 0 only when the server accepted the event; 1 when it could not be reached or refused it
    (`flows.events.EventNotDelivered`: retry later); 2 for bad input or no server configured.
    """
    if args.step < 0:
        raise InvalidOption(f"--step must be >= 0, got {args.step}")
    from flows.events import CHECKPOINT_SAVED, emit_checkpoint_saved, notified_run_root

    run_root = notified_run_root(args.run_root)
    event_id = emit_checkpoint_saved(run_root, args.step, args.role)
    print(f"emitted {CHECKPOINT_SAVED} for {run_root} step {args.step} (role {args.role or 'sft'}); event {event_id}")
    return 0


def add_notify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run_root", "--run-root", dest="run_root", required=True,
                        help="the run root URL the training job writes global_step_N/ to")
    parser.add_argument("--step", type=int, required=True, help="the global step just saved")
    parser.add_argument("--role", default="actor", choices=("actor", "critic", ""),
                        help="actor (default), critic, or '' (SFT)")
    parser.set_defaults(run=cmd_notify)


COMMANDS: engine_cli.Commands = {**engine_cli.SUBCOMMANDS, "notify": (NOTIFY_HELP, add_notify)}


def run_command(argv: Optional[Sequence[str]] = None) -> int:
    """Run one `stepmerge` command (engine or pipeline); its exit code."""
    return engine_cli.main(argv, COMMANDS)


if __name__ == "__main__":
    raise SystemExit(run_command())
