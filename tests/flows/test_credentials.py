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
    assert len(stored) >= 3  # check, merge, validate and publish records (a few KB each)
