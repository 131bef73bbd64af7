"""A work unit handed to a worker (Ray, Prefect task runs) sets only storage settings in it (issue 26).

Specification: `apply_storage_env` sets the keys of `storage_env_keys` (endpoints, credentials, timeouts) and
refuses any other key with `UnsafeRecord` naming the job's source, before setting anything: a forged unit
cannot make the worker load other code (``LD_PRELOAD``, ``PYTHONPATH``, ``PATH``) or read another config.
"""

from __future__ import annotations

import os

import pytest

from merge_engine.errors import UnsafeRecord
from merge_engine.output.executors.remote import apply_storage_env, storage_env_keys


@pytest.mark.parametrize("key", ["LD_PRELOAD", "PYTHONPATH", "PATH", "PYTHONSTARTUP", "BROWSER", "HOME"])
def test_a_unit_setting_a_key_outside_the_storage_settings_is_refused(key, monkeypatch):
    storage_key = sorted(storage_env_keys())[0]
    monkeypatch.delenv(storage_key, raising=False)
    before = dict(os.environ)
    with pytest.raises(UnsafeRecord) as error:
        apply_storage_env(((storage_key, "x"), (key, "/tmp/evil")), "s3://b/run/global_step_1/actor")
    assert error.value.path == "s3://b/run/global_step_1/actor"
    assert dict(os.environ) == before  # nothing set, not even the storage key


def test_storage_settings_are_applied_and_restored(monkeypatch):
    key = "STEPMERGE_REQUESTS_IN_FLIGHT"
    assert key in storage_env_keys()
    monkeypatch.delenv(key, raising=False)
    apply_storage_env(((key, "7"),))
    assert os.environ[key] == "7"
    apply_storage_env(())
    assert key not in os.environ
