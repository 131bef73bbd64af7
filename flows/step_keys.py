"""The key of one merge: ``{run_root}:{role}:{step}`` — built here and nowhere else.

Every route that starts or names a merge of a step uses `step_key`: the watcher's idempotency key
(`flows.submission`), `MergeStepParams.key`, `StepOutcome.key`, the webhook's idempotency key
(`deployments.webhook`) and the event's resource id (`flows.events`). The run root is normalised
first (`normalized_run_root`: no trailing slash, ``file://`` dropped, one scheme spelling), so
``s3://b/run`` and ``s3://b/run/``, ``file:///data/run`` and ``/data/run`` are one step.
Later runs of the same step are keyed ``<step key>:after:<previous run id>`` (`resubmission_key`;
the rule is in `flows.submission` and deployments/README.md).
No heavy imports: the webhook receiver imports this module.
"""

from typing import Union


def normalized_run_root(run_root: str) -> str:
    """One spelling per run root: ``file:///x``, ``file://localhost/x``, ``file:/x``, ``FILE:///x`` -> ``/x``
    (RFC 8089, `merge_engine.storage.urls.file_url_path`; not otherwise normalised), ``gcs://b/x`` -> ``gs://b/x`` (the scheme
    registry's canonical spelling, `merge_engine.storage.schemes`), no trailing slashes (a lone ``/``
    stays). A scheme the registry does not serve, or a local URL it cannot read (``file://otherhost/x``),
    is left as it is (the URL checks refuse it)."""
    from merge_engine.errors import UnsupportedScheme
    from merge_engine.storage.schemes import backend_for_scheme
    from merge_engine.storage.urls import file_url_path, scheme_of

    scheme = scheme_of(run_root)
    if scheme is not None:
        try:
            backend = backend_for_scheme(scheme)
            if backend.local:
                run_root = file_url_path(run_root) or run_root
            elif "://" in run_root:
                run_root = f"{backend.canonical_scheme}://{run_root.split('://', 1)[1]}"
        except UnsupportedScheme:
            pass
    stripped = run_root.rstrip("/")
    return stripped or run_root[:1]


def step_key(run_root: str, role: str, step: Union[int, str]) -> str:
    """``{run_root}:{role}:{step}`` with the run root normalised and the step as an integer."""
    return f"{normalized_run_root(run_root)}:{role or ''}:{int(step)}"


def resubmission_key(key: str, previous_run_id: object) -> str:
    """The key of the run that follows the finished run ``previous_run_id`` of the step keyed ``key``."""
    return f"{key}:after:{previous_run_id}"
