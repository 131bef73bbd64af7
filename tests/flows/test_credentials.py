"""Storage credentials and result storage from Prefect blocks (issue 11, point 9), on real SeaweedFS.

- an ``AwsCredentials`` block (prefect-aws; keys + the endpoint in ``aws_client_parameters``) lets a
  flow read an ``s3://`` run root with NO credential in the worker's environment; an ``S3Bucket``
  block's credentials too; the environment is as it was once the run ends;
- without a block (the default name has none) the environment variables are used as before;
- a block named explicitly but missing fails the run, naming it;
- a ``GcpCredentials`` block's service account info reaches gcsfs as a private file, removed after;
- ``STEPMERGE_RESULT_STORAGE=s3-bucket/<name>``: Prefect keeps the stage results in that block.
"""

from __future__ import annotations

import os
import stat
import uuid

import pytest

from flows.credentials import DEFAULT_S3_BLOCK, gcs_variables, storage_credentials
from flows.merge_step import merge_step
from merge_engine import storage
from tests.fixtures_pipeline import copy_steps

SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "STEPMERGE_S3_ENDPOINT")


def _aws_block(server, name: str) -> str:
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    AwsCredentials(aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
                   region_name=server.region,
                   aws_client_parameters=AwsClientParameters(endpoint_url=server.endpoint_url)).save(name, overwrite=True)
    return f"aws-credentials/{name}"


def _without_credentials_in_the_environment(monkeypatch) -> None:
    for key in SECRETS:
        monkeypatch.delenv(key, raising=False)
    storage.clear_filesystems()


@pytest.mark.parametrize("kind", ["aws-credentials", "s3-bucket"])
def test_a_credentials_block_is_enough_to_read_an_s3_run(prefect, template_run, s3_env, s3_bucket_url, tmp_path,
                                                         monkeypatch, kind):
    copy_steps(template_run, f"{s3_bucket_url}/run", [1])
    name = f"stepmerge-test-{uuid.uuid4().hex[:8]}"
    slug = _aws_block(s3_env, name)
    if kind == "s3-bucket":
        from prefect_aws import AwsCredentials, S3Bucket

        S3Bucket(bucket_name=s3_bucket_url.split("://", 1)[1], credentials=AwsCredentials.load(name)).save(
            name, overwrite=True)
        slug = f"s3-bucket/{name}"
    _without_credentials_in_the_environment(monkeypatch)
    monkeypatch.setenv("STEPMERGE_S3_BLOCK", slug)
    state = merge_step(run_root=f"{s3_bucket_url}/run", step=40, return_state=True)
    # the listing worked (it names the step that IS there): the block's keys and endpoint were used
    assert state.is_failed() and "StepNotFound" in state.message and "steps there: 1 (actor)" in state.message
    assert not any(key in os.environ for key in SECRETS)  # put back as they were


def test_without_a_block_the_environment_is_used_as_before(prefect, template_run, s3_env, s3_bucket_url):
    copy_steps(template_run, f"{s3_bucket_url}/run", [1])
    with storage_credentials() as applied:  # no block under the default name
        assert applied == {}
    state = merge_step(run_root=f"{s3_bucket_url}/run", step=40, return_state=True)
    assert "steps there: 1 (actor)" in state.message


def test_without_block_or_variables_the_bucket_cannot_be_read(prefect, template_run, s3_env, s3_bucket_url,
                                                              monkeypatch):
    copy_steps(template_run, f"{s3_bucket_url}/run", [1])
    _without_credentials_in_the_environment(monkeypatch)
    monkeypatch.setenv("STEPMERGE_TASK_RETRIES", "0")
    state = merge_step(run_root=f"{s3_bucket_url}/run", step=40, return_state=True)
    assert state.is_failed() and "steps there" not in state.message  # the control: no credential, no listing


def test_an_explicit_block_that_is_missing_fails_the_run_naming_it(prefect, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPMERGE_S3_BLOCK", "aws-credentials/no-such-block")
    state = merge_step(run_root=str(tmp_path / "run"), step=1, return_state=True)
    assert state.is_failed() and "BlockNotUsable" in state.message and "no-such-block" in state.message
    monkeypatch.setenv("STEPMERGE_S3_BLOCK", "secret/not-credentials")
    assert "BlockNotUsable" in merge_step(run_root=str(tmp_path / "run"), step=1, return_state=True).message
    assert DEFAULT_S3_BLOCK == "aws-credentials/stepmerge"


def test_gcp_service_account_info_becomes_a_private_file_for_the_run(tmp_path):
    from prefect_gcp import GcpCredentials, GcsBucket

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    info = {"type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": key,
            "client_email": "x@p.iam.gserviceaccount.com", "client_id": "1",
            "token_uri": "https://oauth2.googleapis.com/token"}
    found = gcs_variables(GcsBucket(bucket="b", gcp_credentials=GcpCredentials(service_account_info=info,
                                                                                project="p")), str(tmp_path))
    path = found["GOOGLE_APPLICATION_CREDENTIALS"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    import json

    assert json.loads(open(path).read()) == info and found["GOOGLE_CLOUD_PROJECT"] == "p"


def test_result_storage_on_an_s3_bucket_block(prefect, template_run, s3_env, s3_bucket_url, tmp_path, monkeypatch):
    from prefect_aws import AwsCredentials, S3Bucket

    name = f"stepmerge-results-{uuid.uuid4().hex[:8]}"
    _aws_block(s3_env, name)
    bucket = s3_bucket_url.split("://", 1)[1]
    S3Bucket(bucket_name=bucket, bucket_folder="prefect-results",
             credentials=AwsCredentials.load(name)).save(name, overwrite=True)
    monkeypatch.setenv("STEPMERGE_RESULT_STORAGE", f"s3-bucket/{name}")
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    outcome = merge_step(run_root=run_root, step=1, staging_root=str(tmp_path / "staging"))
    assert outcome.status == "published"
    stored = storage.list_files(f"{s3_bucket_url}/prefect-results")
    # the step's check and the model's one record (a few KB each): no stage of its chain keeps one
    assert sorted(e.path.split("-")[1] for e in stored) == ["check", "release"], stored


# --- issue 20, point 1: one credential path for every flow and every command -------------------------------------


def _flow_run(state):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id)


def _artifacts_of(state) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    return [a for a in found if a.type == "markdown"]  # not Prefect's result records


def test_the_sweep_reads_s3_with_the_credentials_block_and_is_named_tagged_and_summarised(
        prefect, s3_env, s3_bucket_url, monkeypatch):
    """The daily verify-releases sweep uses the block like every other flow (it failed every day with a raw
    NoCredentialsError), has a run name, tags and a summary artifact."""
    from flows.verify_releases import verify_releases

    storage.write_bytes(f"{s3_bucket_url}/run/releases/README", b"not a release")  # the root exists
    name = f"stepmerge-test-{uuid.uuid4().hex[:8]}"
    slug = _aws_block(s3_env, name)
    _without_credentials_in_the_environment(monkeypatch)
    monkeypatch.setenv("STEPMERGE_S3_BLOCK", slug)
    state = verify_releases(release_root=f"{s3_bucket_url}/run/releases", return_state=True)
    assert state.is_completed(), state.message
    run = _flow_run(state)
    assert run.name == "verify run/releases"
    assert {f"releases:{s3_bucket_url}/run/releases", "sweep"} <= set(run.tags)
    (artifact,) = _artifacts_of(state)
    assert "Releases under" in artifact.data and artifact.key.startswith("verify-releases-")


def test_the_sweep_without_any_credentials_fails_in_one_line_naming_what_to_set(prefect, s3_env, s3_bucket_url,
                                                                                monkeypatch):
    from flows.verify_releases import verify_releases

    _without_credentials_in_the_environment(monkeypatch)
    state = verify_releases(release_root=f"{s3_bucket_url}/run/releases", return_state=True)
    assert state.is_failed()
    assert "CredentialsMissing" in state.message or "no S3 credentials" in state.message
    for words in ("AWS_ACCESS_KEY_ID", "aws-credentials/stepmerge"):
        assert words in state.message
    (artifact,) = _artifacts_of(state)  # the failure is summarised too
    assert "no S3 credentials" in artifact.data


def test_the_command_line_uses_the_saved_block_when_a_prefect_api_is_configured(prefect, template_run, s3_env,
                                                                                 s3_bucket_url, monkeypatch, capsys):
    """`stepmerge discover` (and every engine command) resolves credentials like the flows: the block."""
    from flows.cli import run_command

    copy_steps(template_run, f"{s3_bucket_url}/run", [1])
    slug = _aws_block(s3_env, f"stepmerge-test-{uuid.uuid4().hex[:8]}")
    _without_credentials_in_the_environment(monkeypatch)
    monkeypatch.setenv("STEPMERGE_S3_BLOCK", slug)
    monkeypatch.setenv("PREFECT_API_URL", prefect.url)
    assert run_command(["discover", "--run-root", f"{s3_bucket_url}/run"]) == 0
    assert "1 checkpoint(s)" in capsys.readouterr().out
    assert not any(key in os.environ for key in SECRETS)  # put back as they were
    # the control: the same command with no API configured finds no credential and says what to set
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_PROFILES_PATH", os.devnull)
    assert run_command(["discover", "--run-root", f"{s3_bucket_url}/run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no S3 credentials" in err[0] and "AWS_ACCESS_KEY_ID" in err[0], err


COMMANDS_ON = {  # every engine command that reads a URL, as a user types it
    "discover": lambda url, out: ["discover", "--run-root", url],
    "check": lambda url, out: ["check", "--local_dir", url],
    "verify": lambda url, out: ["verify", url],
    "merge": lambda url, out: ["merge", "--local_dir", url, "--target_dir", out],
}


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run"])
def test_every_command_without_credentials_fails_fast_in_one_line(tmp_path, url):
    """No botocore traceback (60 lines) and no gcsfs retries (216 lines over 2.5 minutes): one line, exit 1,
    for discover, check, verify and merge, refused before any connection or name lookup is tried (one fresh
    process runs the four, recording each one's network attempts: no attempt, no retry to wait for)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import contextlib, io, json, socket, sys\n"
        "from flows.cli import run_command\n"
        "tried = []\n"
        "real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo\n"
        "def connect(self, address):\n"
        "    tried.append(repr(address)); return real_connect(self, address)\n"
        "def lookup(host, *args, **kwargs):\n"
        "    tried.append(repr(host)); return real_lookup(host, *args, **kwargs)\n"
        "socket.socket.connect, socket.getaddrinfo = connect, lookup\n"
        "found = {}\n"
        "for name, argv in json.loads(sys.argv[1]).items():\n"
        "    err = io.StringIO(); del tried[:]\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        code = run_command(argv)\n"
        "    found[name] = [code, err.getvalue(), list(tried)]\n"
        "print(json.dumps(found))\n")
    commands = {name: argv(url, str(tmp_path / "out")) for name, argv in COMMANDS_ON.items()}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "GOOGLE_", "STORAGE_EMULATOR", "PREFECT_API", "STEPMERGE_S3", "CLOUDSDK"))}
    env.update(PREFECT_PROFILES_PATH=os.devnull, HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true",
               NO_GCE_CHECK="true", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-3000:]  # nothing logged around them
    for name, (code, err, tried) in json.loads(done.stdout).items():
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1, (name, err[-3000:])
        assert "StorageUnavailable: no " in lines[0] and url in lines[0], (name, lines)
        assert ("AWS_ACCESS_KEY_ID" if url.startswith("s3") else "GOOGLE_APPLICATION_CREDENTIALS") in lines[0]
        assert tried == [], (name, tried)
