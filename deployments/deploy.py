"""``make deploy`` / ``python -m deployments.deploy``: deploy prefect.yaml, and run the watcher at once.

    python -m deployments.deploy                                    # every deployment of prefect.yaml
    python -m deployments.deploy --watcher exp2 --run-root s3://bucket/exp2   # one more watcher

The first form checks the environment the deployments are made of (``STEPMERGE_HOME``: the checkout
workers run from; ``STEPMERGE_RUN_ROOT``: the run the watcher watches), runs ``prefect deploy --all``
on deployments/prefect.yaml (whose build step makes the same check, for a bare ``prefect deploy``),
then creates the first run of ``merge-new-steps/watch`` NOW: an interval schedule's first run is one
interval after the deploy, and a new deployment should show its first report in seconds, not in 10
minutes.

The second form deploys another watcher, ``merge-new-steps/<name>``, for another run root: the same
entrypoint, pool (``cpu``), schedule (600 s) and pull step as ``watch``, through the documented
command ``prefect deploy flows/merge_new_steps.py:merge_new_steps --name <name> --pool cpu --interval
600 --param run_root=<URL> --prefect-file deployments/prefect.yaml`` (a deployment name that is not
in prefect.yaml needs its entrypoint), then runs it once, now.

Both forms then close each deployment's parameter schema (`close_parameter_schemas`): Prefect builds
it from the flow's signature without ``additionalProperties: false`` (and ``prefect deploy`` has no
way to add it), so the server would create a run for ``--param stpe=10`` and the run would fail when
it starts. Closed, the server refuses an unknown name (HTTP 409) before any run exists, as it refuses
a bad value. A bare ``prefect deploy`` leaves the schema open: an unknown name then fails the run
when it starts, before any task (Prefect binds the parameters to the flow's signature).

Errors are one line on stderr: exit 2 for a missing or bad setting, 1 when ``prefect deploy`` failed
(its last lines are shown).
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

WATCH_FLOW = "merge-new-steps"
WATCH_ENTRYPOINT = "flows/merge_new_steps.py:merge_new_steps"
PREFECT_FILE = "deployments/prefect.yaml"
WATCH_INTERVAL_S = 600


class DeployError(Exception):
    """What stops a deploy, in one line; ``exit_code`` 2 (settings) or 1 (``prefect deploy`` failed)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def checked_environment(run_root: Optional[str]) -> Path:
    """The checkout ``STEPMERGE_HOME`` names, after checking it and the run root; `DeployError` otherwise."""
    home = os.environ.get("STEPMERGE_HOME", "").strip()
    if not home:
        raise DeployError("set STEPMERGE_HOME to the repository checkout the workers run from "
                          "(export STEPMERGE_HOME=$PWD)")
    if not (Path(home) / "flows" / "merge_step.py").is_file():
        raise DeployError(f"STEPMERGE_HOME={home} is not a stepmerge checkout (no flows/merge_step.py there)")
    if not run_root:
        raise DeployError("set STEPMERGE_RUN_ROOT to the run root the watcher watches (e.g. s3://my-bucket/my-run)")
    from flows.url_checks import checked_url

    try:
        checked_url(run_root)
    except ValueError as exc:
        raise DeployError(f"run root {run_root!r}: {exc}") from None
    return Path(home)


def prefect_deploy(home: Path, arguments: Sequence[str], run_root: str) -> None:
    """``prefect --no-prompt deploy <arguments> --prefect-file deployments/prefect.yaml`` from ``home``."""
    env = dict(os.environ, STEPMERGE_RUN_ROOT=run_root)
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", *arguments, "--prefect-file", PREFECT_FILE]
    print("$ prefect --no-prompt deploy " + " ".join([*arguments, "--prefect-file", PREFECT_FILE]), flush=True)
    done = subprocess.run(command, cwd=home, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        raise DeployError("prefect deploy failed: " + " | ".join(lines[-3:]), exit_code=1)


def prefect_yaml_deployments(home: Path) -> List[Tuple[str, str]]:
    """(entrypoint, deployment name) of every deployment of prefect.yaml (names repeat across flows)."""
    import yaml

    spec = yaml.safe_load((home / PREFECT_FILE).read_text())
    return [(d["entrypoint"], d["name"]) for d in spec.get("deployments") or []]


def close_parameter_schemas(entrypoints_and_names: Sequence[Tuple[str, str]]) -> List[str]:
    """Set ``additionalProperties: false`` in the parameter schema of each deployment given by
    (entrypoint, name) (see the module docstring); the ``flow/deployment`` names closed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    wanted = set(entrypoints_and_names)
    closed = []
    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=sorted({name for _, name in wanted}))))
        for deployment in found:
            if (deployment.entrypoint, deployment.name) not in wanted:
                continue
            schema = dict(deployment.parameter_openapi_schema or {}, additionalProperties=False)
            client.update_deployment(deployment.id, DeploymentUpdate(parameter_openapi_schema=schema))
            closed.append(f"{client.read_flow(deployment.flow_id).name}/{deployment.name}")
    missing = len(wanted) - len(closed)
    if missing:
        raise DeployError(f"{missing} deployment(s) not found after prefect deploy: {sorted(wanted)}", exit_code=1)
    return sorted(closed)


def first_watcher_run(name: str) -> str:
    """Create a run of ``merge-new-steps/<name>`` now; its flow run id."""
    from prefect.deployments import run_deployment

    run = run_deployment(f"{WATCH_FLOW}/{name}", timeout=0)
    return str(run.id)


def deploy(watcher: Optional[str] = None, run_root: Optional[str] = None) -> List[str]:
    """Deploy (see the module docstring); the lines printed."""
    run_root = run_root or os.environ.get("STEPMERGE_RUN_ROOT", "").strip()
    home = checked_environment(run_root)
    if watcher is None:
        prefect_deploy(home, ["--all"], run_root)
        name, deployed = "watch", prefect_yaml_deployments(home)
    else:
        prefect_deploy(home, [WATCH_ENTRYPOINT, "--name", watcher, "--pool", "cpu",
                              "--interval", str(WATCH_INTERVAL_S), "--param", f"run_root={run_root}"], run_root)
        name, deployed = watcher, [(WATCH_ENTRYPOINT, watcher)]
    closed = close_parameter_schemas(deployed)
    run_id = first_watcher_run(name)
    return [f"parameter schemas closed (the server now refuses a misspelled parameter name) for: {', '.join(closed)}",
            f"deployed; {WATCH_FLOW}/{name} watches {run_root} every {WATCH_INTERVAL_S} s, first run now "
            f"(flow run {run_id})"]


def deploy_command(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.deploy", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--watcher", help="deploy one more watcher, merge-new-steps/<WATCHER>, for --run-root")
    parser.add_argument("--run-root", help="the run root to watch (default: $STEPMERGE_RUN_ROOT)")
    args = parser.parse_args(argv)
    if args.watcher is not None and not args.run_root:
        parser.error("--watcher needs --run-root")
    try:
        for line in deploy(args.watcher, args.run_root):
            print(line)
    except DeployError as exc:
        print(f"stepmerge deploy: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(deploy_command())
