"""What a flow run and its task runs are called and tagged, so the Prefect UI tells runs apart.

- Flow run names (`step_run_name`, `watch_run_name`, `adapter_run_name`, Prefect's ``flow_run_name``
  callables, from the run's own parameters): ``exp1 actor step 40`` (the run root's last folder,
  role, step), ``watch exp1``, ``exp1 actor step 40 adapter``, ``verify exp1/releases`` (the sweep).
- Tags (`run_tags`, added to the flow run when it starts, whatever created it: the UI, the watcher,
  the trigger, the webhook): ``run:<run root>``, ``role:<role or sft>``, ``step:<N>``. Filter the
  UI's runs by ``run:s3://bucket/exp1`` to see one training run's merges.
- A run that published nothing because its step is not complete yet (a watcher merges it later)
  ends in a Completed state NAMED ``NotReady`` and is tagged ``not-ready`` (`ended`): the run list
  tells it from a published step at a glance (its state badge), and ``not-ready`` filters it (the
  UI's tag filter; the API's state-name filter takes ``NotReady``).
- Task run names (`step_label`, given to `flows.stages.StageTimer`): ``merge-model step 40 actor``.
"""

from typing import Any, List, Optional, Union

from flows.step_keys import normalized_run_root


def short_run_name(run_root: str) -> str:
    """The run root's last folder name (``s3://bucket/exp1/`` -> ``exp1``); the bucket for a bucket root."""
    trimmed = normalized_run_root(str(run_root))
    return trimmed.rsplit("/", 1)[-1] or trimmed


def role_name(role: Optional[str]) -> str:
    return role or "sft"


def step_label(step: Union[int, str], role: Optional[str]) -> str:
    """``step 40 actor``: what task run names carry after the task's name."""
    return f"step {step} {role_name(role)}"


def run_tags(run_root: str, role: Optional[str] = None, step: Optional[int] = None) -> List[str]:
    """``run:<run root>`` (+ ``role:<role>``, ``step:<N>`` when given)."""
    tags = [f"run:{normalized_run_root(str(run_root))}"]
    if role is not None:
        tags.append(f"role:{role_name(role)}")
    if step is not None:
        tags.append(f"step:{int(step)}")
    return tags


def _parameters() -> dict:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters or {}
    return parameters if isinstance(parameters, dict) else {}


def step_run_name() -> str:
    """``merge-step``'s run name: ``exp1 actor step 40``."""
    p = _parameters()
    return f"{short_run_name(p.get('run_root', '?'))} {role_name(p.get('role', 'actor'))} step {p.get('step', '?')}"


def adapter_run_name() -> str:
    """``release-adapter``'s run name: ``exp1 actor step 40 adapter``."""
    return f"{step_run_name()} adapter"


def watch_run_name() -> str:
    """``merge-new-steps``'s run name: ``watch exp1``."""
    return f"watch {short_run_name(_parameters().get('run_root', '?'))}"


def verify_run_name() -> str:
    """``verify-releases``' run name: ``verify exp1/releases`` (the release root's last two folders)."""
    root = normalized_run_root(str(_parameters().get("release_root", "?")))
    return "verify " + "/".join(part for part in root.split("://", 1)[-1].rsplit("/", 2)[-2:] if part)


NOT_READY_STATE = "NotReady"
NOT_READY_TAG = "not-ready"


def ended(outcome: Any) -> Any:
    """What a step flow returns: ``outcome`` itself, or for a step not ready yet (``status ==
    "not_ready"``) a Completed state named `NOT_READY_STATE` carrying it (its result) and the tag
    `NOT_READY_TAG` added to the run."""
    if getattr(outcome, "status", None) != "not_ready":
        return outcome
    from prefect.states import Completed

    label_flow_run_with([NOT_READY_TAG])
    return Completed(name=NOT_READY_STATE, message=f"not ready yet: {outcome.reason}", data=outcome)


def label_flow_run(run_root: str, role: Optional[str] = None, step: Optional[int] = None) -> List[str]:
    """Add `run_tags` to the current flow run (keeping its own tags); returns the tags added."""
    return label_flow_run_with(run_tags(run_root, role, step))


def label_flow_run_with(tags: List[str]) -> List[str]:
    """Add ``tags`` to the current flow run (keeping its own tags); returns them."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return tags
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run.id).tags or []
        if not set(tags) <= set(current):
            client.update_flow_run(flow_run.id, tags=list(dict.fromkeys([*current, *tags])))
    return tags
