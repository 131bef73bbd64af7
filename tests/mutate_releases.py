"""pytest plugin: the pipeline tests run against releases with ONE flipped weight; each must catch it.

    python -m pytest -p tests.mutate_releases tests/flows tests/deployments/test_operator.py ...   (`make mutate`)

Before an outside check of `tests.release_checks` first looks at a release, `flip_one_weight` changes one
value of its weights and makes its ``stepmerge.json``, manifest and marker agree; the plugin asserts that
stepmerge's own `verify_folder` still calls the release intact, then lets the outside check run. A test that
judges a release from outside must then fail with that check's AssertionError ("... differs from the
reference", "logits differ"); a test that still passes judges its release by stepmerge's verdict alone.

With the plugin, the outcome of each test is what the mutation says about it:
- only the tests that can call a check are run: a test whose source names a check, or a function or fixture
  of its module (or of `tests.release_checks`) that does, transitively; the others are deselected;
- a test whose check caught the flip (it failed with a check's AssertionError) PASSES;
- a test that called a check and still passed FAILS ("... judges its release by stepmerge's verdict alone");
- a test that failed otherwise fails as it is (the flip broke something else: the plugin's or the test's
  fault, never a pass); a selected test that called no check keeps its own outcome.
Never listed in ``tests/conftest.py``: the normal suite runs without it; CI runs it after ``make test``.
"""

from __future__ import annotations

import functools
import inspect
import re
from types import ModuleType

import pytest

import tests.release_checks as release_checks

CHECKS = ("assert_release_weights_equal", "assert_model_logits", "assert_adapter_logits")
_flipped: set[str] = set()
_judged: list[str] = []  # the releases the running test's checks looked at
_caught: list[str] = []  # the ones whose check failed


def _flip_first(check):
    @functools.wraps(check)
    def flipped_then_checked(url, *args, **kwargs):
        if url not in _flipped:
            from merge_engine.release.verify import verify_folder

            _flipped.add(url)
            tensor = release_checks.flip_one_weight(url)
            assert verify_folder(url).ok and verify_folder(url, mode="quick").ok, \
                f"{url}: stepmerge's verify should still pass after {tensor} was flipped"
        _judged.append(url)
        try:
            return check(url, *args, **kwargs)
        except AssertionError:
            _caught.append(url)
            raise

    return flipped_then_checked


def pytest_configure(config) -> None:
    """Before any test module imports the checks by name."""
    for name in CHECKS:
        setattr(release_checks, name, _flip_first(getattr(release_checks, name)))


def _names(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def _function(obj):
    """The plain function of ``obj`` (a fixture's own function), or None."""
    obj = getattr(obj, "_fixture_function", obj)
    try:
        obj = inspect.unwrap(obj)
    except ValueError:
        return None
    return obj if inspect.isfunction(obj) else None


def _source(obj) -> str:
    function = _function(obj)
    try:
        return inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return ""


def _judging(module: ModuleType, known: set[str]) -> set[str]:
    """``known`` with every function or fixture of ``module`` whose source names one of them, to a fixed point."""
    functions = {name: _names(_source(obj)) for name, obj in vars(module).items() if _function(obj) is not None}
    found = set(known)
    while True:
        more = {name for name, used in functions.items() if name not in found and used & found}
        if not more:
            return found
        found |= more


def pytest_collection_modifyitems(config, items) -> None:
    base = _judging(release_checks, set(CHECKS))
    per_module: dict[str, set[str]] = {}
    keep, drop = [], []
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            drop.append(item)
            continue
        if module.__name__ not in per_module:
            per_module[module.__name__] = _judging(module, base)
        function = getattr(item, "function", None)
        used = _names(_source(function)) | set(getattr(item, "fixturenames", ()))
        (keep if used & per_module[module.__name__] else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    _judged.clear()
    _caught.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not _judged:
        return
    if report.failed and _caught and call.excinfo is not None and call.excinfo.errisinstance(AssertionError):
        report.outcome = "passed"
        report.longrepr = None
        report.sections.append(("mutate_releases", f"the flipped weight was caught in {_caught[0]}"))
    elif report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: every release it judged ({sorted(set(_judged))}) had one weight flipped, "
                           "and it passed: it judges its release by stepmerge's verdict alone")
