"""Storage credentials from Prefect blocks (prefect-aws, prefect-gcp): the default for deployments.

A Prefect user keeps credentials in blocks, saved once on the server, instead of in every worker's
environment. Each flow run (`storage_credentials`, entered by every flow for its whole body) loads:

- ``STEPMERGE_S3_BLOCK`` (default ``aws-credentials/stepmerge``): an ``aws-credentials/<name>``
  (`prefect_aws.AwsCredentials`), ``minio-credentials/<name>`` or ``s3-bucket/<name>``
  (`prefect_aws.S3Bucket`, whose ``credentials`` are used) block;
- ``STEPMERGE_GCS_BLOCK`` (default ``gcp-credentials/stepmerge``): a ``gcp-credentials/<name>``
  (`prefect_gcp.GcpCredentials`) or ``gcs-bucket/<name>`` (`prefect_gcp.GcsBucket`) block;

and hands them to the engine's storage (`merge_engine.storage`, which reads the standard variables)
for the duration of the run: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_PROFILE``, ``AWS_DEFAULT_REGION`` and the endpoint (``aws_client_parameters.endpoint_url``:
``AWS_ENDPOINT_URL`` / ``STEPMERGE_S3_ENDPOINT``); ``GOOGLE_APPLICATION_CREDENTIALS`` (the block's
service account file, or its service account info written to a private temp file, removed after)
and ``GOOGLE_CLOUD_PROJECT``. What a block sets wins over the worker's environment during the run;
everything is put back afterwards. With no block under the default names, the environment is used
as it is (the variables keep working as before). A block named explicitly but missing, or of
another type, fails the run at once with `BlockNotUsable`. When neither a block nor the environment
holds credentials for a store the run reads, the engine's `CredentialsMissing` (one line, before any
request) is raised again with both ways out named: the variables and the block.

The ``stepmerge`` command line (`flows.cli`) resolves credentials the same way (`command_credentials`):
the blocks when a Prefect API is configured (``PREFECT_API_URL`` in the environment or the active
profile of ``~/.prefect/profiles.toml``) and the command names an object-store URL; else the
environment. A server that cannot be reached is named in one line on stderr and the environment used.

The engine never imports Prefect: this module turns blocks into what it already reads.
"""

import contextlib
import json
import os
import tempfile
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from merge_engine.errors import CredentialsMissing, StepmergeError

DEFAULT_S3_BLOCK = "aws-credentials/stepmerge"
DEFAULT_GCS_BLOCK = "gcp-credentials/stepmerge"
S3_BLOCK_TYPES = ("aws-credentials", "minio-credentials", "s3-bucket")
GCS_BLOCK_TYPES = ("gcp-credentials", "gcs-bucket")


class BlockNotUsable(StepmergeError):
    """A credentials block named in STEPMERGE_S3_BLOCK / STEPMERGE_GCS_BLOCK is missing or of another type."""


def _secret(value: Any) -> Optional[str]:
    if value is None:
        return None
    getter = getattr(value, "get_secret_value", None)
    return str(getter() if getter else value)


def _load(slug: str, types: Tuple[str, ...], explicit: bool) -> Any:
    """The block ``<type>/<name>``, or None when a default name has no block; `BlockNotUsable` otherwise."""
    from prefect.blocks.core import Block

    block_type = slug.split("/", 1)[0]
    if "/" not in slug or block_type not in types:
        raise BlockNotUsable(f"{slug!r} is not a block of type {', '.join(types)} (write <type>/<name>)")
    try:
        return Block.load(slug)
    except (ValueError, KeyError) as exc:  # Prefect: "Unable to find block document named ..." / unknown type
        if explicit:
            raise BlockNotUsable(f"cannot load block {slug!r}: {exc}") from None
        return None


def s3_variables(block: Any) -> Dict[str, str]:
    """The variables the engine reads for S3, from an AwsCredentials / MinIOCredentials / S3Bucket block."""
    credentials = getattr(block, "credentials", None) if hasattr(block, "bucket_name") else block
    if credentials is None:
        return {}
    found = {
        "AWS_ACCESS_KEY_ID": getattr(credentials, "aws_access_key_id", None)
        or getattr(credentials, "minio_root_user", None),
        "AWS_SECRET_ACCESS_KEY": _secret(getattr(credentials, "aws_secret_access_key", None)
                                         or getattr(credentials, "minio_root_password", None)),
        "AWS_SESSION_TOKEN": _secret(getattr(credentials, "aws_session_token", None)),
        "AWS_PROFILE": getattr(credentials, "profile_name", None),
        "AWS_DEFAULT_REGION": getattr(credentials, "region_name", None),
    }
    client = getattr(credentials, "aws_client_parameters", None)
    endpoint = getattr(client, "endpoint_url", None) if client is not None else None
    if endpoint:
        found.update(AWS_ENDPOINT_URL=str(endpoint), STEPMERGE_S3_ENDPOINT=str(endpoint))
    return {k: str(v) for k, v in found.items() if v}


def gcs_variables(block: Any, scratch: str) -> Dict[str, str]:
    """The variables the engine reads for GCS, from a GcpCredentials / GcsBucket block (service account
    info is written to a 0600 file under ``scratch``)."""
    credentials = getattr(block, "gcp_credentials", None) if hasattr(block, "bucket") else block
    if credentials is None:
        return {}
    found: Dict[str, str] = {}
    if getattr(credentials, "service_account_file", None):
        found["GOOGLE_APPLICATION_CREDENTIALS"] = str(credentials.service_account_file)
    info = getattr(credentials, "service_account_info", None)
    if info:
        values = info.get_secret_value() if hasattr(info, "get_secret_value") else info
        path = os.path.join(scratch, "gcp-service-account.json")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
            json.dump(dict(values), handle)
        found["GOOGLE_APPLICATION_CREDENTIALS"] = path
    if getattr(credentials, "project", None):
        found["GOOGLE_CLOUD_PROJECT"] = str(credentials.project)
    return found


@contextlib.contextmanager
def applied_variables(variables: Dict[str, str]) -> Iterator[None]:
    """``variables`` in ``os.environ`` for the block; the previous values (or their absence) after."""
    previous = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def block_hint(store: str) -> str:
    """The block that would hold ``store``'s credentials (``s3`` / ``gs``), in words."""
    if store == "s3":
        slug, kind, variable = os.environ.get("STEPMERGE_S3_BLOCK") or DEFAULT_S3_BLOCK, "AwsCredentials", "S3"
    else:
        slug, kind, variable = os.environ.get("STEPMERGE_GCS_BLOCK") or DEFAULT_GCS_BLOCK, "GcpCredentials", "GCS"
    return (f"or save the Prefect block {slug} ({kind}) on the server of PREFECT_API_URL "
            f"(STEPMERGE_{variable}_BLOCK names another)")


@contextlib.contextmanager
def hinted_credentials_error() -> Iterator[None]:
    """`CredentialsMissing` raised in the block names the Prefect block too (one line still)."""
    try:
        yield
    except CredentialsMissing as exc:
        if exc.store and "Prefect block" not in exc.message:
            raise CredentialsMissing(f"{exc.message}, {block_hint(exc.store)}", exc.path, exc.store) from None
        raise


@contextlib.contextmanager
def storage_credentials() -> Iterator[Dict[str, str]]:
    """Apply the credentials blocks (see the module docstring) while a flow runs; yields what was set
    (names only in logs: the values are secrets)."""
    s3_slug = os.environ.get("STEPMERGE_S3_BLOCK", "").strip()
    gcs_slug = os.environ.get("STEPMERGE_GCS_BLOCK", "").strip()
    with tempfile.TemporaryDirectory(prefix="stepmerge-credentials-") as scratch:
        variables: Dict[str, str] = {}
        s3_block = _load(s3_slug or DEFAULT_S3_BLOCK, S3_BLOCK_TYPES, explicit=bool(s3_slug))
        if s3_block is not None:
            variables.update(s3_variables(s3_block))
        gcs_block = _load(gcs_slug or DEFAULT_GCS_BLOCK, GCS_BLOCK_TYPES, explicit=bool(gcs_slug))
        if gcs_block is not None:
            variables.update(gcs_variables(gcs_block, scratch))
        with applied_variables(variables), hinted_credentials_error():
            yield variables


def prefect_api_url() -> Optional[str]:
    """The Prefect API this process would use: ``PREFECT_API_URL``, else the active profile's (read from
    the profiles file without importing Prefect, so commands that need no server start as fast)."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if url:
        return url
    import tomllib

    home = os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect"))
    path = os.path.expanduser(os.environ.get("PREFECT_PROFILES_PATH", os.path.join(home, "profiles.toml")))
    try:
        with open(path, "rb") as handle:
            profiles = tomllib.load(handle)
    except (OSError, ValueError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    found = (profiles.get("profiles") or {}).get(active, {}).get("PREFECT_API_URL")
    return str(found).strip() or None if found else None


def names_remote_url(argv: Any) -> bool:
    """Whether a command's arguments name an object-store URL (the blocks are worth loading)."""
    from merge_engine.storage.schemes import remote_schemes

    prefixes = tuple(f"{scheme}://" for scheme in remote_schemes())
    return any(prefix in str(token).lower() for token in argv for prefix in prefixes)


@contextlib.contextmanager
def command_credentials(argv: Any, warn: Optional[Callable[[str], None]] = None) -> Iterator[Dict[str, str]]:
    """The credentials of one ``stepmerge`` command (see the module docstring); yields what a block set.

    ``warn``: called with one line when the configured server cannot be reached (the environment is
    used then). `BlockNotUsable` (a block named explicitly but missing) is raised as in a flow."""
    with contextlib.ExitStack() as stack:
        applied: Dict[str, str] = {}
        api = prefect_api_url()
        if api and names_remote_url(argv):
            try:
                applied = stack.enter_context(storage_credentials())
            except BlockNotUsable:
                raise
            except Exception as exc:  # noqa: BLE001 - the server is down or refuses us: say so, use the environment
                if warn is not None:
                    first = (str(exc).strip().splitlines() or [""])[0][:200]
                    warn(f"stepmerge: note: credential blocks not read from {api} ({type(exc).__name__}: {first}); "
                         "using the environment")
        stack.enter_context(hinted_credentials_error())
        yield applied
