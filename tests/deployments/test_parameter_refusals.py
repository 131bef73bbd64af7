"""Every parameter of every deployment of deployments/prefect.yaml, given a bad value through the real
Prefect API, is refused in words that name it (issue 20, "the form as a user reads it"):

- the API (and so ``prefect deployment run --param``, and the form's toast) answers "Validation failed
  for field 'run_root'. Failure reason: 'a storage URL such as ...' was expected", never a regular
  expression or pydantic's "String should match pattern";
- the form's own check (what the UI sends to ``/api/ui/schemas/validate``: the schema as its model
  keeps it, without ``pattern``, ``minimum`` or ``maxLength``) shows the same words under the field.

A parameter added to a flow without a bad value here fails `test_every_parameter_is_covered`.
"""

from __future__ import annotations

import re

import httpx
import pytest
from prefect.client.orchestration import get_client

from flows.params import HUB_TEMPLATE_WORDS, RAY_ADDRESS_WORDS, SIZE_WORDS, URL_WORDS

DEPLOYMENTS = ["merge-step/gpu", "merge-new-steps/watch", "release-adapter/gpu", "verify-releases/sweep"]
URL = f"{URL_WORDS!r} was expected"
OPTIONAL_URL = f"{'empty, or ' + URL_WORDS!r} was expected"
NOT_BOOLEAN = "'yes' is not of type 'boolean'"
HUB_TEMPLATE = f"{HUB_TEMPLATE_WORDS!r} was expected"
# name -> (a bad value, the server's reason in words)
BAD = {
    "step": (-1, "-1 is less than the minimum of 0"),
    "run_root": ("ftp://host/run", URL),
    "role": ("ref", "'ref' is not one of ['actor', 'critic', 'policy', '']"),
    "release_root": ("s3://bucket/run/../other", OPTIONAL_URL),
    "dtype": ("fp17", "'fp17' is not one of ['as stored', 'bfloat16', "),
    "max_shard_size": ("lots", f"{SIZE_WORDS!r} was expected"),
    "hf_model_path": ("http://evil/model", OPTIONAL_URL),
    "weights_format": ("gguf", "'gguf' is not one of ['hub', 'transformers']"),
    "validate_forward": ("yes", NOT_BOOLEAN),
    "reference_url": ("s3://", OPTIONAL_URL),
    "release_adapter": ("yes", NOT_BOOLEAN),
    "lora_alpha": (-16, "-16 is less than the minimum of 0"),
    "base_model": ("C:\\models\\base", OPTIONAL_URL),
    "base_model_id": (5, "5 is not of type 'string'"),
    "overwrite": ("yes", NOT_BOOLEAN),
    "staging_root": ("/scratch/%2e%2e/etc", OPTIONAL_URL),
    "workers": (-2, "-2 is less than the minimum of 0"),
    "ray_address": ("head node", f"{'empty, or ' + RAY_ADDRESS_WORDS!r} was expected"),
    "roles": (["ref"], "'ref' is not one of ['actor', 'critic', 'policy', '']"),
    "merge_deployment": (5, "5 is not of type 'string'"),
    "max_steps": (-1, "-1 is less than the minimum of 0"),
    "include_base": ("yes", NOT_BOOLEAN),
    "compare_with_model_release": ("yes", NOT_BOOLEAN),
    "mode": ("thorough", "'thorough' is not one of ['full', 'quick']"),
    "unmark_damaged": ("yes", NOT_BOOLEAN),
    "hub_repo": ("no-namespace", "'empty, or a Hub repo id namespace/name' was expected"),
    "hub_revision": ("step {step}", HUB_TEMPLATE),
    "hub_moving_ref": ("two words", "'empty, or a branch name such as latest' was expected"),
    "hub_private": ("yes", NOT_BOOLEAN),
    "hub_token_secret": (5, "5 is not of type 'string'"),
    "mlflow_model": (5, "5 is not of type 'string'"),
    "mlflow_tracking_uri": (5, "5 is not of type 'string'"),
}
REQUIRED_HERE = {("verify-releases/sweep", "release_root"): ("s3://bucket/run/../other", URL)}  # not optional there
FIELD = {"roles": "roles[0]"}  # an item of a list is named with its index
REGEX = re.compile(r"\^|\(\?|\[\^|\\\\|\$'|\{[0-9]|should match pattern")


@pytest.fixture(scope="module")
def schemas(deployed) -> dict:
    return {name: deployed[name].parameter_openapi_schema for name in DEPLOYMENTS}


def test_every_parameter_is_covered(schemas):
    for deployment, schema in schemas.items():
        assert set(schema["properties"]) <= set(BAD), (deployment, set(schema["properties"]) - set(BAD))


def test_a_bad_value_is_refused_in_words_naming_the_field(deployed, schemas):
    """One flow run request per parameter per deployment (about 60), each refused with HTTP 409."""
    with get_client(sync_client=True) as client:
        for deployment, schema in schemas.items():
            for name in schema["properties"]:
                bad, reason = REQUIRED_HERE.get((deployment, name), BAD[name])
                parameters = {**({"step": 1} if "step" in schema["properties"] else {}), name: bad}
                with pytest.raises(httpx.HTTPStatusError) as refused:
                    client.create_flow_run_from_deployment(deployed[deployment].id, parameters=parameters)
                detail = refused.value.response.json()["detail"]
                assert refused.value.response.status_code == 409, (deployment, name, detail)
                prefix = f"Error creating flow run: Validation failed for field {FIELD.get(name, name)!r}. "
                assert detail.startswith(prefix + "Failure reason: " + reason), (deployment, name, detail)
                assert not REGEX.search(detail), (deployment, name, detail)


UI_KEYS = {"position", "block_type_slug", "$ref", "anyOf", "allOf", "example", "default", "const", "description",
           "enum", "format", "items", "prefixItems", "properties", "required", "title", "type", "maxItems",
           "minItems"}  # what Prefect 3.9's UI keeps of a property (its SchemaProperty mapper) when it validates


def test_the_forms_own_check_shows_the_words_under_the_field(prefect_api, schemas):
    """What the run form asks the server while the user types (``POST /api/ui/schemas/validate``)."""
    schema = schemas["merge-step/gpu"]
    as_the_ui_sends = {**schema, "properties": {name: {k: v for k, v in prop.items() if k in UI_KEYS}
                                                for name, prop in schema["properties"].items()}}
    values = {"step": 1, "run_root": "s3://bucket/run/../other", "max_shard_size": "lots", "ray_address": "head node",
              "release_root": "ftp://x/y", "dtype": "fp17"}
    answer = httpx.post(f"{prefect_api.url}/ui/schemas/validate", json={"schema": as_the_ui_sends, "values": values},
                        timeout=30).json()
    under = {e["property"]: e["errors"] for e in answer["errors"]}
    assert under == {"run_root": [URL], "max_shard_size": [f"{SIZE_WORDS!r} was expected"],
                     "ray_address": [BAD["ray_address"][1]], "release_root": [OPTIONAL_URL],
                     "dtype": [under["dtype"][0]]}
    assert under["dtype"][0].startswith(BAD["dtype"][1])


def test_prefect_deployment_run_param_prints_the_words(deployed):
    """``prefect deployment run 'merge-step/gpu' --param run_root=ftp://host/run``: exit 1, the words."""
    from prefect.testing.cli import invoke_and_assert

    result = invoke_and_assert(["deployment", "run", "merge-step/gpu", "--param", "step=3", "--param",
                                "run_root=ftp://host/run"], expected_code=1, echo=False)
    said = " ".join(result.stdout.split())  # the console wraps long lines
    assert f"Validation failed for field 'run_root'. Failure reason: {URL}" in said, said
    assert not REGEX.search(said), said
