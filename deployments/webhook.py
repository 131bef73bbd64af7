"""An HTTP receiver for training jobs that can only POST a webhook (Prefect OSS has no webhooks).

    uvicorn --factory deployments.webhook:create_app --host 127.0.0.1 --port 8088

``POST /hooks/checkpoint-saved`` with JSON ``{"run_root": "s3://bucket/run", "step": 120, "role": "actor"}``
gets or creates the run of the merge deployment (``merge-step/gpu`` unless ``STEPMERGE_WEBHOOK_DEPLOYMENT``)
for that step and answers 202 with ``{"flow_run_id", "idempotency_key", ...}``. ``GET /health`` (and
``/healthz``) answers ``{"ok": true, ...}`` without credentials.

Invariants: the run is keyed ``{run_root}:{role}:{step}`` (`flows.step_keys.step_key`, over the run root's
one spelling: ``s3://b/run/`` and ``s3://b/run`` are one key), so a webhook delivered twice gives the same
run, never a second merge; after a FAILED run a later call follows the watcher's rules (`flows.submission`).
The body names the checkpoint only; where releases go is the deployment's business. Credentials (bearer
``STEPMERGE_WEBHOOK_TOKEN``, or HMAC-SHA256 with ``STEPMERGE_WEBHOOK_HMAC_SECRET``: `sign`) are checked from
the headers BEFORE the body is read, and no body is held beyond `MAX_BODY_BYTES` nor read for longer than
`BODY_DEADLINE_S` (408); at most `MAX_UNVERIFIED_READS` bodies whose HMAC signature is not checked yet are read at
once (503 beyond). A token or secret shorter than `MIN_SECRET_CHARS` (or blank) stops the start.

Errors: 401 a missing, wrong or stale credential; 408 a body not whole in time; 413 a body over
`MAX_BODY_BYTES`; 422 a body that is not the `CheckpointSaved` object, or a run root outside the allow-lists
(`checked_payload`: schemes, run roots, shared-disk roots after `resolved_local_run_root`); 503 when the Prefect
API or the deployment cannot be reached, or too many unverified bodies are being read. Each refusal is one line on the ``stepmerge.webhook`` logger. Started without a credential or
``PREFECT_API_URL``, or with a bad ``STEPMERGE_WEBHOOK_*`` value: `WebhookNotConfigured`, one line naming the
variable, no traceback. Every setting, the HMAC headers, the accepted run roots and TLS (required: tokens
and signatures must not cross a network in clear): deployments/README.md, "6. From the training job".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import time
from typing import Literal, Optional

import anyio
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictInt, ValidationError, field_validator

from flows.step_keys import normalized_run_root, step_key
from flows.url_checks import checked_url
from merge_engine.errors import StepmergeError
from merge_engine.storage.json_text import parse_json
from merge_engine.storage.schemes import remote_schemes
from merge_engine.storage.urls import scheme_of

CHECKPOINT_SAVED_PATH = "/hooks/checkpoint-saved"
SIGNATURE_HEADER = "X-Stepmerge-Signature"
TIMESTAMP_HEADER = "X-Stepmerge-Timestamp"
MAX_BODY_BYTES = 64 * 1024
BODY_DEADLINE_S = 10.0  # a body not received whole by then is a 408 (a sender on a slow link sends 64 KiB in time)
MAX_UNVERIFIED_READS = 32  # signature-headed bodies read at once before the signature is checked; more: 503
MIN_SECRET_CHARS = 16  # a token or HMAC secret shorter than this is refused at start
MAX_STEP = 10**12  # far beyond any training run; a bigger number is a forged or broken sender
_UNIX_SECONDS = re.compile(r"[0-9]{1,12}")
_STEP_DIGITS = re.compile(r"[0-9]{1,12}")


class WebhookNotConfigured(SystemExit):
    """The receiver cannot start (no credential, no Prefect server): one line on stderr, exit status 2.

    A `SystemExit`, so ``uvicorn --factory`` stops with the message instead of a traceback.
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"stepmerge webhook: {message}")
        self.message = message
        self.code = f"stepmerge webhook: {message}"


class WebhookSettings(BaseModel):
    """How the receiver authenticates, what it accepts, and which deployment it starts."""

    model_config = ConfigDict(frozen=True)

    deployment: str = "merge-step/gpu"
    token: Optional[SecretStr] = None
    hmac_secret: Optional[SecretStr] = None
    allowed_schemes: tuple[str, ...] = Field(default_factory=lambda: remote_schemes(canonical_only=True))
    allowed_run_roots: tuple[str, ...] = ()
    shared_disk_roots: tuple[str, ...] = ()  # opt-in: local run roots under these (workers mount them alike)
    max_skew_s: float = 300.0
    prefect_api_url: Optional[str] = None

    @classmethod
    def from_env(cls) -> WebhookSettings:
        """The settings the ``STEPMERGE_WEBHOOK_*`` variables give; a bad value is `WebhookNotConfigured`
        naming the variable (one line at start, never a pydantic traceback)."""
        def listed(name: str, default: str = "") -> tuple[str, ...]:
            return tuple(p.strip() for p in os.environ.get(name, default).split(",") if p.strip())

        try:
            return cls(deployment=os.environ.get("STEPMERGE_WEBHOOK_DEPLOYMENT", "merge-step/gpu"),
                       token=os.environ.get("STEPMERGE_WEBHOOK_TOKEN"),  # set but empty: refused, not "unset"
                       hmac_secret=os.environ.get("STEPMERGE_WEBHOOK_HMAC_SECRET"),
                       allowed_schemes=listed("STEPMERGE_WEBHOOK_SCHEMES",
                                              ",".join(remote_schemes(canonical_only=True))),
                       allowed_run_roots=listed("STEPMERGE_WEBHOOK_RUN_ROOTS"),
                       shared_disk_roots=listed("STEPMERGE_WEBHOOK_SHARED_DISK_ROOTS"))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = str(first["loc"][0]) if first.get("loc") else ""
            message = str(first.get("msg", exc)).removeprefix("Value error, ")
            raise WebhookNotConfigured(f"{_SETTING_VARIABLES.get(field, field)}: {message}") from None

    @field_validator("token", "hmac_secret")
    @classmethod
    def _strong_secret(cls, value: Optional[SecretStr]) -> Optional[SecretStr]:
        """A credential, when given, is at least `MIN_SECRET_CHARS` characters with no space around it: an
        empty, blank or short one would be guessed (or is a mistake in the variable)."""
        if value is not None:
            secret = value.get_secret_value()
            if len(secret) < MIN_SECRET_CHARS or secret.strip() != secret:
                raise ValueError(f"must be at least {MIN_SECRET_CHARS} characters without surrounding spaces "
                                 f"(given: {len(secret)} characters); e.g. $(openssl rand -hex 32)")
        return value

    @field_validator("allowed_schemes")
    @classmethod
    def _served_object_stores(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unserved = [scheme for scheme in value if scheme not in remote_schemes()]
        if unserved:
            raise ValueError(f"schemes {unserved} are not object stores served by stepmerge "
                             f"(served: {', '.join(remote_schemes())})")
        return value

    @field_validator("allowed_run_roots")
    @classmethod
    def _allowed_in_one_spelling(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(normalized_run_root(root) for root in value)

    @field_validator("shared_disk_roots")
    @classmethod
    def _absolute_folders(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Absolute folders, resolved (`resolved_local_run_root`: ``/.``, ``//`` and a link to ``/`` are ``/``,
        refused like it), so that run roots, resolved too, are compared with them in one spelling."""
        roots = []
        for root in value:
            folder = normalized_run_root(root)  # file:///x -> /x
            if "://" in folder or not folder.startswith("/") or folder == "/":
                raise ValueError(f"shared disk root {root!r} must be an absolute folder (/x or file:///x), not /")
            resolved = resolved_local_run_root(checked_url(folder))
            if resolved == "/":
                raise ValueError(f"shared disk root {root!r} is / (resolved): it must be a folder below /")
            roots.append(resolved)
        return tuple(roots)


_SETTING_VARIABLES = {"deployment": "STEPMERGE_WEBHOOK_DEPLOYMENT", "token": "STEPMERGE_WEBHOOK_TOKEN",
                      "hmac_secret": "STEPMERGE_WEBHOOK_HMAC_SECRET", "allowed_schemes": "STEPMERGE_WEBHOOK_SCHEMES",
                      "allowed_run_roots": "STEPMERGE_WEBHOOK_RUN_ROOTS",
                      "shared_disk_roots": "STEPMERGE_WEBHOOK_SHARED_DISK_ROOTS"}


def resolved_local_run_root(path: str) -> str:
    """The real path of an absolute local run root (``os.path.realpath``: symbolic links followed,
    ``.`` and repeated slashes gone), as this host sees the shared disk. Resolved BEFORE the shared-disk
    root check, so a link under a root that points out of it (to ``/etc``, to ``/``) is outside, and
    before the idempotency key, so ``root/./exp1``, ``root//exp1`` and ``root/exp1`` are one key."""
    return os.path.realpath(path)


def under(run_root: str, roots: tuple[str, ...]) -> bool:
    """``run_root`` is one of ``roots`` or inside one (whole path components: ``/data/runs2`` is not
    under ``/data/runs``); all in one spelling."""
    return any(run_root == root or run_root.startswith(root.rstrip("/") + "/") for root in roots)


class CheckpointSaved(BaseModel):
    """The webhook's body: which checkpoint was saved."""

    model_config = ConfigDict(extra="forbid")

    run_root: str = Field(..., max_length=1024)
    step: StrictInt = Field(..., ge=0, le=MAX_STEP)
    role: Literal["actor", "critic", ""] = "actor"

    @field_validator("run_root")
    @classmethod
    def _one_spelling(cls, value: str) -> str:
        return normalized_run_root(value)

    @field_validator("step", mode="before")
    @classmethod
    def _digits(cls, value: object) -> object:
        """A step sent as a string of digits (``"120"``, what a shell's ``$STEP`` gives) is that number;
        anything else a string holds (``"1.5"``, ``" 3"``, ``"-1"``) is refused like before."""
        if isinstance(value, str) and _STEP_DIGITS.fullmatch(value):
            return int(value)
        return value

    @property
    def key(self) -> str:
        return step_key(self.run_root, self.role, self.step)


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The ``X-Stepmerge-Signature`` value for ``body`` sent at ``timestamp`` (for senders and tests)."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def bearer_ok(settings: WebhookSettings, headers) -> bool:
    """The request carries the bearer token (decided from the headers alone)."""
    authorization = headers.get("authorization", "")
    if settings.token is not None and authorization.lower().startswith("bearer "):
        given = authorization[7:].strip().encode()
        return hmac.compare_digest(given, settings.token.get_secret_value().encode())
    return False


def signature_may_hold(settings: WebhookSettings, headers, now: Optional[float] = None) -> bool:
    """HMAC is configured and the request carries a signature and a fresh integer timestamp: only then
    is its body worth reading to check the signature."""
    signature, timestamp = headers.get(SIGNATURE_HEADER.lower()), headers.get(TIMESTAMP_HEADER.lower())
    if settings.hmac_secret is None or not signature or not timestamp:
        return False
    if not _UNIX_SECONDS.fullmatch(timestamp):  # digits only: no nan/inf, no fractions, no signs
        return False
    return abs((time.time() if now is None else now) - int(timestamp)) <= settings.max_skew_s


def authenticated(settings: WebhookSettings, headers, body: bytes, now: Optional[float] = None) -> bool:
    """True when the request carries the bearer token or a fresh, valid HMAC signature."""
    if bearer_ok(settings, headers):
        return True
    if not signature_may_hold(settings, headers, now):
        return False
    expected = sign(settings.hmac_secret.get_secret_value(), headers[TIMESTAMP_HEADER.lower()], body)
    return hmac.compare_digest(headers[SIGNATURE_HEADER.lower()].encode(), expected.encode())


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, deadline_s: float = BODY_DEADLINE_S) -> bytes:
    """The body, streamed, never more than ``limit`` bytes held: a declared or actual size over it is
    a 413 at once (the rest is never read); a body not whole within ``deadline_s`` is a 408; a sender that
    hangs up first is a 400 (logged as one line like any refusal, never a traceback)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HTTPException(413 if declared.isdigit() else 400, "body too large" if declared.isdigit()
                            else "bad Content-Length")
    body = bytearray()
    try:
        with anyio.fail_after(deadline_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise HTTPException(413, "body too large")
    except TimeoutError:
        raise HTTPException(408, f"body not received within {deadline_s:g} s", headers={"Connection": "close"}) \
            from None
    except ClientDisconnect:
        raise HTTPException(400, "the sender closed the connection before its body was read") from None
    return bytes(body)


def refusal_reason(settings: WebhookSettings, headers, now: Optional[float] = None) -> str:
    """Why `authenticated` refused a request, in words a sender can act on (the 401's detail)."""
    signature, timestamp = headers.get(SIGNATURE_HEADER.lower()), headers.get(TIMESTAMP_HEADER.lower())
    if settings.hmac_secret is not None and signature and timestamp and _UNIX_SECONDS.fullmatch(timestamp):
        skew = (time.time() if now is None else now) - int(timestamp)
        if abs(skew) > settings.max_skew_s:
            return (f"stale signature: {TIMESTAMP_HEADER} is {abs(skew):.0f} s {'behind' if skew > 0 else 'ahead of'} "
                    f"this server's clock (at most {settings.max_skew_s:.0f} s allowed): sign each request with the "
                    "current time, and check the sender's clock")
    if settings.hmac_secret is not None and signature and timestamp and not _UNIX_SECONDS.fullmatch(timestamp):
        return f"{TIMESTAMP_HEADER} must be integer Unix seconds"
    return "missing or invalid credentials"


def checked_payload(settings: WebhookSettings, body: bytes) -> CheckpointSaved:
    """Parse and check the body; ValueError / ValidationError name what is wrong."""
    try:
        data = parse_json(body, None)  # the one guarded parser: bounded depth, a named error
    except StepmergeError as exc:
        raise ValueError(f"body is not acceptable JSON: {exc.message}") from None
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    payload = CheckpointSaved.model_validate(data)  # file:///x arrives as /x
    local = scheme_of(payload.run_root) is None
    checked_url(payload.run_root, schemes=settings.allowed_schemes, allow_local_paths=bool(settings.shared_disk_roots))
    if local:
        if not payload.run_root.startswith("/"):
            raise ValueError("run_root is a relative local path: a shared disk run root is an absolute folder")
        payload = payload.model_copy(update={"run_root": resolved_local_run_root(payload.run_root)})
        if not under(payload.run_root, settings.shared_disk_roots):
            raise ValueError("run_root is a local path outside the shared disk roots "
                             "(STEPMERGE_WEBHOOK_SHARED_DISK_ROOTS), once its links are followed")
    if not local and settings.allowed_run_roots and not under(payload.run_root, settings.allowed_run_roots):
        raise ValueError("run_root is not under an allowed run root")
    return payload


def flow_parameters(payload: CheckpointSaved) -> dict:
    """The merge deployment's (flat) parameters for this checkpoint."""
    return {"run_root": payload.run_root, "step": payload.step, "role": payload.role}


refusals = logging.getLogger("stepmerge.webhook")  # uvicorn's access log says 401; this line says why


def create_app(settings: Optional[WebhookSettings] = None) -> FastAPI:
    """The receiver (see the module docstring). Settings default to `WebhookSettings.from_env`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    settings = settings or WebhookSettings.from_env()
    if settings.token is None and settings.hmac_secret is None:
        raise WebhookNotConfigured("set STEPMERGE_WEBHOOK_TOKEN or STEPMERGE_WEBHOOK_HMAC_SECRET: the receiver does "
                                   "not accept unauthenticated requests")
    api_url = settings.prefect_api_url or PREFECT_API_URL.value()
    if not api_url:
        raise WebhookNotConfigured("set PREFECT_API_URL: the receiver creates runs on a Prefect server")
    app = FastAPI(title="stepmerge webhook", version="1")
    deployment_ids: dict[str, object] = {}
    unverified_reads = [0]  # bodies being read before their signature is checked (one event loop: no lock)

    def create_run(payload: CheckpointSaved) -> dict:
        """The step's run (`flows.submission.submit_chain`, as the webhook: a completed run is the answer)."""
        from prefect.client.orchestration import get_client

        from flows.submission import submit_chain

        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            with get_client(sync_client=True) as client:
                if settings.deployment not in deployment_ids:
                    deployment_ids[settings.deployment] = client.read_deployment_by_name(settings.deployment).id

                def create(key: str):
                    return client.create_flow_run_from_deployment(
                        deployment_ids[settings.deployment], parameters=flow_parameters(payload), idempotency_key=key)

                run = submit_chain(create, payload.key, listing=None, rebuild_completed=False)
        return {"flow_run_id": run.flow_run_id, "flow_run_name": run.flow_run_name,
                "idempotency_key": run.idempotency_key, "deployment": settings.deployment, "state": run.state,
                "action": run.action}

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> dict:
        """Liveness for a load balancer or a probe (no credentials needed, nothing is read)."""
        return {"ok": True, "deployment": settings.deployment}

    def refused(request: Request, status: int, reason: str) -> None:
        """One log line per refusal, with the reason the sender gets (never a credential)."""
        client = request.client.host if request.client else "?"
        refusals.warning("refused %s from %s: %d %s", request.url.path, client, status, reason)

    @app.post(CHECKPOINT_SAVED_PATH, status_code=202)
    async def checkpoint_saved(request: Request):
        # credentials first, from the headers: an unauthenticated body is never read, and no body is
        # ever held beyond MAX_BODY_BYTES (a 600 MB chunked POST costs nothing)
        reason = refusal_reason(settings, request.headers)  # a stale signature says so
        unauthorized = HTTPException(401, reason, headers={"WWW-Authenticate": "Bearer"})
        if not bearer_ok(settings, request.headers) and not signature_may_hold(settings, request.headers):
            refused(request, 401, reason)
            raise unauthorized
        verified = bearer_ok(settings, request.headers)
        if not verified and unverified_reads[0] >= MAX_UNVERIFIED_READS:
            refused(request, 503, "too many unverified bodies in flight")
            raise HTTPException(503, "too many unverified requests in flight: send it again later",
                                headers={"Retry-After": "5", "Connection": "close"})
        unverified_reads[0] += not verified
        try:
            body = await read_body(request)
        except HTTPException as exc:
            refused(request, exc.status_code, str(exc.detail))
            raise
        finally:
            unverified_reads[0] -= not verified
        if not authenticated(settings, request.headers, body):
            refused(request, 401, reason)
            raise unauthorized
        try:
            payload = checked_payload(settings, body)
        except ValidationError as exc:
            detail = json.loads(exc.json(include_url=False, include_input=False))
            refused(request, 422, "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in detail))
            return JSONResponse({"detail": detail}, status_code=422)
        except ValueError as exc:
            refused(request, 422, str(exc))
            return JSONResponse({"detail": str(exc)}, status_code=422)
        try:
            return await anyio.to_thread.run_sync(create_run, payload)
        except Exception as exc:  # noqa: BLE001 - the sender should retry later; say why
            deployment_ids.clear()
            reason = f"could not create the flow run: {type(exc).__name__}: {exc}"
            refused(request, 503, reason)
            raise HTTPException(503, reason) from None

    return app
