"""The webhook receiver (deployments/webhook.py) against the real deployment merge-step/gpu.

Unauthenticated, wrongly signed, stale and malformed calls are refused (401 / 422 / 413) and
create nothing; a valid call answers 202 with the flow run id; the same webhook delivered twice
gives the same flow run (idempotency key ``{run_root}:{role}:{step}``), however the run root is
spelled (a trailing slash). Where releases go is the deployment's business, not the sender's: a
``release_root`` in the body is refused. HMAC timestamps are integer Unix seconds (``nan``,
``inf`` and fractions are refused, signed or not).
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from fastapi.testclient import TestClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from deployments.webhook import (
    CHECKPOINT_SAVED_PATH,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookNotConfigured,
    WebhookSettings,
    create_app,
    sign,
)

TOKEN = "test-token-0123456789"
SECRET = "test-hmac-secret"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(deployed, prefect_api):
    settings = WebhookSettings(token=TOKEN, hmac_secret=SECRET, prefect_api_url=prefect_api.url,
                               allowed_run_roots=("s3://hooks-bucket/", "gs://hooks-bucket/"))
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _runs(deployed) -> list:
    with get_client(sync_client=True) as prefect:
        return prefect.read_flow_runs(deployment_filter=DeploymentFilter(
            id=DeploymentFilterId(any_=[deployed["merge-step/gpu"].id])))


def _post(client, payload, headers=BEARER, raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(payload).encode()
    return client.post(CHECKPOINT_SAVED_PATH, content=body, headers={"Content-Type": "application/json", **headers})


def test_a_valid_call_creates_one_run_per_step_even_if_delivered_twice(client, deployed):
    payload = {"run_root": "s3://hooks-bucket/run", "step": 30}
    first = _post(client, payload)
    assert first.status_code == 202, first.text
    again = _post(client, payload)  # the sender's retry, a queue's redelivery
    assert again.status_code == 202 and again.json()["flow_run_id"] == first.json()["flow_run_id"]
    assert first.json()["idempotency_key"] == "s3://hooks-bucket/run:actor:30"
    other = _post(client, {**payload, "step": 31})
    assert other.json()["flow_run_id"] != first.json()["flow_run_id"]

    runs = {str(r.id): r for r in _runs(deployed)}
    run = runs[first.json()["flow_run_id"]]
    assert run.parameters == {"run_root": "s3://hooks-bucket/run", "step": 30, "role": "actor"}
    assert run.idempotency_key == "s3://hooks-bucket/run:actor:30"
    assert sum(1 for r in runs.values() if r.parameters.get("step") == 30
               and r.parameters["run_root"] == "s3://hooks-bucket/run") == 1


def test_hmac_signed_calls_are_accepted_and_bad_or_stale_signatures_refused(client):
    body = json.dumps({"run_root": "gs://hooks-bucket/run", "step": 4, "role": "critic"}).encode()
    now = str(int(time.time()))
    good = {TIMESTAMP_HEADER: now, SIGNATURE_HEADER: sign(SECRET, now, body)}
    assert _post(client, None, good, raw=body).status_code == 202
    tampered = body.replace(b'"step": 4', b'"step": 5')
    assert _post(client, None, good, raw=tampered).status_code == 401
    wrong_key = {TIMESTAMP_HEADER: now, SIGNATURE_HEADER: sign("another-secret", now, body)}
    assert _post(client, None, wrong_key, raw=body).status_code == 401
    old = str(int(time.time()) - 3600)
    stale = {TIMESTAMP_HEADER: old, SIGNATURE_HEADER: sign(SECRET, old, body)}
    refused = _post(client, None, stale, raw=body)
    assert refused.status_code == 401
    detail = refused.json()["detail"]  # says what to fix, not "missing or invalid credentials"
    assert re.match(r"stale signature: X-Stepmerge-Timestamp is 36\d\d s behind this server's clock", detail)
    assert "check the sender's clock" in detail
    assert _post(client, None, wrong_key, raw=body).json()["detail"] == "missing or invalid credentials"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"Authorization": f"Basic {TOKEN}"}],
                         ids=["none", "wrong-token", "no-scheme", "basic"])
def test_unauthenticated_calls_are_refused_and_create_nothing(client, deployed, headers):
    before = len(_runs(deployed))
    response = _post(client, {"run_root": "s3://hooks-bucket/run", "step": 99}, headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert len(_runs(deployed)) == before


MALFORMED = {
    "negative step": {"run_root": "s3://hooks-bucket/run", "step": -1},
    "step as a decimal string": {"run_root": "s3://hooks-bucket/run", "step": "3.0"},
    "step as padded text": {"run_root": "s3://hooks-bucket/run", "step": " 3"},
    "step as a negative string": {"run_root": "s3://hooks-bucket/run", "step": "-3"},
    "fractional step": {"run_root": "s3://hooks-bucket/run", "step": 1.5},
    "boolean step": {"run_root": "s3://hooks-bucket/run", "step": True},
    "missing step": {"run_root": "s3://hooks-bucket/run"},
    "missing run_root": {"step": 3},
    "local path": {"run_root": "/etc/passwd", "step": 3},
    "file scheme": {"run_root": "file:///data/run", "step": 3},
    "http scheme": {"run_root": "http://hooks-bucket/run", "step": 3},
    "path traversal": {"run_root": "s3://hooks-bucket/run/../../other-bucket", "step": 3},
    "encoded traversal": {"run_root": "s3://hooks-bucket/run/%2e%2e/x", "step": 3},
    "traversal in release_root": {"run_root": "s3://hooks-bucket/run", "step": 3, "release_root": "s3://hooks-bucket/../x"},
    "any release_root": {"run_root": "s3://hooks-bucket/run", "step": 3, "release_root": "s3://hooks-bucket/releases"},
    "release_root elsewhere": {"run_root": "s3://hooks-bucket/run", "step": 3, "release_root": "s3://someone-else/x"},
    "not an allowed run root": {"run_root": "s3://someone-else/run", "step": 3},
    "control character": {"run_root": "s3://hooks-bucket/run\n", "step": 3},
    "unknown role": {"run_root": "s3://hooks-bucket/run", "step": 3, "role": "admin"},
    "unknown field": {"run_root": "s3://hooks-bucket/run", "step": 3, "command": "rm -rf /"},
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_payloads_are_refused(client, deployed, name):
    before = len(_runs(deployed))
    response = _post(client, MALFORMED[name])
    assert response.status_code == 422, response.text
    assert len(_runs(deployed)) == before


def test_not_json_or_too_large_bodies_are_refused(client):
    assert _post(client, None, raw=b"step=3&run_root=s3://hooks-bucket/run").status_code == 422
    assert _post(client, None, raw=b'["s3://hooks-bucket/run", 3]').status_code == 422
    assert _post(client, None, raw=b"x" * (65 * 1024)).status_code == 413


def test_the_receiver_refuses_to_start_without_authentication(prefect_api):
    with pytest.raises(WebhookNotConfigured, match="STEPMERGE_WEBHOOK_TOKEN"):
        create_app(WebhookSettings(prefect_api_url=prefect_api.url))
    assert TestClient(create_app(WebhookSettings(token=TOKEN, prefect_api_url=prefect_api.url))).get(
        "/healthz").json()["ok"] is True


def test_a_trailing_slash_is_the_same_step_and_the_same_run(client, deployed):
    plain = _post(client, {"run_root": "s3://hooks-bucket/slash-run", "step": 40})
    slashed = _post(client, {"run_root": "s3://hooks-bucket/slash-run/", "step": 40})
    assert plain.status_code == slashed.status_code == 202, slashed.text
    assert slashed.json()["flow_run_id"] == plain.json()["flow_run_id"]
    assert slashed.json()["idempotency_key"] == "s3://hooks-bucket/slash-run:actor:40"
    runs = [r for r in _runs(deployed) if r.parameters.get("step") == 40]
    assert len(runs) == 1 and runs[0].parameters["run_root"] == "s3://hooks-bucket/slash-run"


@pytest.mark.parametrize("timestamp", ["nan", "NaN", "inf", "-inf", "infinity", "fraction", "1e9", "+now"])
def test_hmac_timestamps_must_be_integer_unix_seconds(client, timestamp):
    """Each of these is correctly signed with the secret; the timestamp itself is what is refused."""
    now = int(time.time())
    timestamp = {"fraction": f"{now}.25", "+now": f"+{now}"}.get(timestamp, timestamp)
    body = json.dumps({"run_root": "s3://hooks-bucket/run", "step": 50}).encode()
    headers = {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: sign(SECRET, timestamp, body)}
    assert _post(client, None, headers, raw=body).status_code == 401


def test_redelivery_after_the_run_finished(client, deployed, monkeypatch):
    """A completed run answers a redelivered call (no second merge); a failed one is followed, after
    the watcher's pause, by one new run keyed after it (the webhook does not block the step forever)."""
    from prefect.states import Completed, Failed

    import flows.submission

    def finish(run_id: str, state) -> None:
        with get_client(sync_client=True) as prefect:
            prefect.set_flow_run_state(run_id, state, force=True)

    done = _post(client, {"run_root": "s3://hooks-bucket/run", "step": 60}).json()
    finish(done["flow_run_id"], Completed())
    assert _post(client, {"run_root": "s3://hooks-bucket/run", "step": 60}).json()["flow_run_id"] == done["flow_run_id"]

    failed = _post(client, {"run_root": "s3://hooks-bucket/run", "step": 61}).json()
    finish(failed["flow_run_id"], Failed(message="S3 outage"))
    waiting = _post(client, {"run_root": "s3://hooks-bucket/run", "step": 61}).json()
    assert waiting["flow_run_id"] == failed["flow_run_id"] and waiting["action"] == "waiting"
    monkeypatch.setattr(flows.submission, "RESUBMIT_BASE_DELAY_S", 0.0)
    again = _post(client, {"run_root": "s3://hooks-bucket/run", "step": 61}).json()
    assert again["flow_run_id"] != failed["flow_run_id"]
    assert again["idempotency_key"] == f"s3://hooks-bucket/run:actor:61:after:{failed['flow_run_id']}"


def test_uvicorn_without_a_credential_stops_with_one_line(prefect_api):
    """The documented command, started without STEPMERGE_WEBHOOK_TOKEN: one line, no traceback."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPMERGE_WEBHOOK_")}
    env.update(PREFECT_API_URL=prefect_api.url)
    done = subprocess.run([sys.executable, "-m", "uvicorn", "--factory", "deployments.webhook:create_app",
                           "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "stepmerge webhook: set STEPMERGE_WEBHOOK_TOKEN or STEPMERGE_WEBHOOK_HMAC_SECRET: the receiver does not "
        "accept unauthenticated requests")


def test_a_step_sent_as_a_string_of_digits_is_that_step(client, deployed):
    response = _post(client, {"run_root": "s3://hooks-bucket/run", "step": "35"})
    assert response.status_code == 202, response.text
    assert response.json()["idempotency_key"] == "s3://hooks-bucket/run:actor:35"
    assert _post(client, {"run_root": "s3://hooks-bucket/run", "step": 35}).json()["flow_run_id"] == \
        response.json()["flow_run_id"]


def test_a_run_root_is_one_step_however_it_is_spelled(client, deployed):
    """``gcs://`` and ``gs://`` (the registry's canonical spelling), a trailing slash: one key, one run;
    a shared-disk ``file:///shared/run`` and the watcher's ``/shared/run`` are one key too (through the
    webhook only where the deployment opted in: the next test)."""
    canonical = _post(client, {"run_root": "gs://hooks-bucket/spelled", "step": 71})
    other = _post(client, {"run_root": "gcs://hooks-bucket/spelled/", "step": 71})
    assert canonical.status_code == other.status_code == 202, other.text
    assert other.json()["idempotency_key"] == "gs://hooks-bucket/spelled:actor:71"
    assert other.json()["flow_run_id"] == canonical.json()["flow_run_id"]
    from flows.params import MergeStepParams
    from flows.step_keys import step_key

    assert step_key("file:///shared/run/", "actor", 70) == step_key("/shared/run", "actor", 70) == "/shared/run:actor:70"
    assert MergeStepParams(run_root="file:///shared/run", step=70).key == "/shared/run:actor:70"


def test_a_shared_disk_run_root_is_accepted_once_opted_in_in_either_spelling(deployed, prefect_api):
    """``STEPMERGE_WEBHOOK_SHARED_DISK_ROOTS`` says the workers mount that disk at the same path: a run root
    under it is accepted as ``file:///x`` or ``/x`` — one key, one run, the watcher's spelling — and any other
    local path is still refused (the default receiver refuses them all: ``MALFORMED``)."""
    settings = WebhookSettings(token=TOKEN, prefect_api_url=prefect_api.url, shared_disk_roots=("file:///shared/",))
    assert settings.shared_disk_roots == ("/shared",)
    with TestClient(create_app(settings)) as shared:
        as_url = _post(shared, {"run_root": "file:///shared/run/", "step": 72})
        as_path = _post(shared, {"run_root": "/shared/run", "step": 72})
        assert as_url.status_code == as_path.status_code == 202, as_url.text
        assert as_url.json()["flow_run_id"] == as_path.json()["flow_run_id"]
        assert as_path.json()["idempotency_key"] == "/shared/run:actor:72"
        for outside in ("/etc/passwd", "/shared2/run", "file:///sharedx", "/shared/run/../../etc", "file://host/run"):
            assert _post(shared, {"run_root": outside, "step": 72}).status_code == 422, outside
    (run,) = [r for r in _runs(deployed) if str(r.id) == as_path.json()["flow_run_id"]]
    assert run.parameters["run_root"] == "/shared/run"
    for bad in ("/", "file:///", "relative/run", "s3://bucket/run", "/data/../etc"):
        with pytest.raises(ValueError):
            WebhookSettings(token=TOKEN, shared_disk_roots=(bad,))


def test_shared_disk_run_roots_are_resolved_before_the_root_check_and_the_key(deployed, prefect_api, tmp_path):
    """Issue 17 point 9: links under a shared-disk root that point to ``/etc`` or ``/`` used to be accepted;
    ``root/./exp1`` and ``root//exp1`` each got their own idempotency key (duplicate runs of one checkpoint).
    Run roots are resolved (realpath) first: the links are outside (422), the spellings are one key, one run."""
    root = tmp_path / "shared"
    (root / "exp1").mkdir(parents=True)
    (root / "etc").symlink_to("/etc")
    (root / "top").symlink_to("/")
    (root / "alias").symlink_to(root / "exp1")
    settings = WebhookSettings(token=TOKEN, prefect_api_url=prefect_api.url, shared_disk_roots=(str(root),))
    with TestClient(create_app(settings)) as shared:
        for outside in (f"{root}/etc", f"{root}/top", f"{root}/top/etc", f"file://{root}/etc"):
            assert _post(shared, {"run_root": outside, "step": 73}).status_code == 422, outside
        answers = [_post(shared, {"run_root": spelling, "step": 73}) for spelling in
                   (f"{root}/exp1", f"{root}/./exp1", f"{root}//exp1", f"file://localhost{root}/exp1", f"{root}/alias")]
    assert all(a.status_code == 202 for a in answers), [a.text for a in answers]
    assert {a.json()["idempotency_key"] for a in answers} == {f"{root}/exp1:actor:73"}
    assert len({a.json()["flow_run_id"] for a in answers}) == 1


def test_a_shared_disk_root_that_is_slash_in_any_spelling_is_refused(tmp_path):
    (tmp_path / "slash").symlink_to("/")
    for bad in ("/.", "//", "/./", "file:///.", str(tmp_path / "slash"), "file://otherhost/data"):
        with pytest.raises(ValueError):
            WebhookSettings(token=TOKEN, shared_disk_roots=(bad,))


@pytest.mark.parametrize("variable, value", [("STEPMERGE_WEBHOOK_SHARED_DISK_ROOTS", "/."),
                                             ("STEPMERGE_WEBHOOK_SCHEMES", "ftp"),
                                             # a credential that is empty, blank or short is guessed, not kept
                                             ("STEPMERGE_WEBHOOK_TOKEN", ""), ("STEPMERGE_WEBHOOK_TOKEN", " " * 20),
                                             ("STEPMERGE_WEBHOOK_TOKEN", "secret"),
                                             ("STEPMERGE_WEBHOOK_HMAC_SECRET", "0123456789abcde")])
def test_a_bad_setting_stops_the_start_with_one_line(prefect_api, monkeypatch, variable, value):
    """Issue 17 point 9: a bad ``STEPMERGE_WEBHOOK_*`` value was a pydantic traceback at start; it is one
    line naming the variable (`WebhookNotConfigured`, what ``uvicorn --factory`` prints and exits on)."""
    for name in list(os.environ):
        if name.startswith("STEPMERGE_WEBHOOK_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STEPMERGE_WEBHOOK_TOKEN", TOKEN)
    monkeypatch.setenv("PREFECT_API_URL", prefect_api.url)
    monkeypatch.setenv(variable, value)
    with pytest.raises(WebhookNotConfigured) as info:
        create_app()
    assert info.value.code.startswith(f"stepmerge webhook: {variable}: ") and "\n" not in info.value.code


def test_each_refusal_is_logged_with_its_reason_and_health_answers(client, caplog):
    """Issue 20: the receiver's log said only "401" (uvicorn's access line); now one line says why."""
    import logging

    caplog.set_level(logging.WARNING, logger="stepmerge.webhook")
    assert _post(client, {"run_root": "s3://hooks-bucket/run", "step": 3}, headers={}).status_code == 401
    assert _post(client, {"run_root": "s3://hooks-bucket/run", "step": -3}).status_code == 422
    assert _post(client, None, raw=b"x" * (65 * 1024)).status_code == 413
    lines = [r.getMessage() for r in caplog.records if r.name == "stepmerge.webhook"]
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"refused {CHECKPOINT_SAVED_PATH} from ") and ": 401 " in lines[0]
    assert ": 422 " in lines[1] and "step" in lines[1] and ": 413 body too large" in lines[2]
    assert TOKEN not in " ".join(lines)
    assert client.get("/health").json() == {"ok": True, "deployment": "merge-step/gpu"}
