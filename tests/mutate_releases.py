"""Opt-in pytest plugin: run the pipeline tests against releases with ONE flipped weight; they must FAIL.

    python -m pytest -p tests.mutate_releases tests/flows/test_merge_step_s3.py ...

Before an outside check of `tests.release_checks` first looks at a release, `flip_one_weight` changes one
value of its weights and makes its ``stepmerge.json``, manifest and marker agree; the plugin asserts that
stepmerge's own `verify_folder` still calls the release intact, then lets the outside check run. Every test
that judges a release from outside must then fail with that check's AssertionError ("... differs from the
reference", "logits differ"): a test that still passes judges its release by stepmerge's verdict alone.
Never listed in ``tests/conftest.py``: the normal suite runs without it.
"""

from __future__ import annotations

import functools

import tests.release_checks as release_checks

CHECKS = ("assert_release_weights_equal", "assert_model_logits", "assert_adapter_logits")
_flipped: set[str] = set()


def _flip_first(check):
    @functools.wraps(check)
    def flipped_then_checked(url, *args, **kwargs):
        if url not in _flipped:
            from merge_engine.release.verify import verify_folder

            _flipped.add(url)
            tensor = release_checks.flip_one_weight(url)
            assert verify_folder(url).ok and verify_folder(url, mode="quick").ok, \
                f"{url}: stepmerge's verify should still pass after {tensor} was flipped"
        return check(url, *args, **kwargs)

    return flipped_then_checked


def pytest_configure(config) -> None:
    """Before any test module imports the checks by name."""
    for name in CHECKS:
        setattr(release_checks, name, _flip_first(getattr(release_checks, name)))
