"""The Hub revision of a step: a template with ``{step}`` and ``{role}`` only, filled into a branch name git accepts;
an adapter's revision and moving refs end in ``-adapter``; a refused template or ref is one named line."""

from __future__ import annotations

import pytest

from merge_engine.errors import InvalidOption
from merge_engine.release.hub_refs import checked_ref, moving_refs_for, revision_for, template_problem


@pytest.mark.parametrize("template, step, role, adapter, expected", [
    ("step-{step}", 3, "actor", False, "step-3"),
    ("step-{step}", 3, "actor", True, "step-3-adapter"),
    ("{role}/iter_{step:07d}", 40, "critic", False, "critic/iter_0000040"),
    ("{role}-{step}", 2, "", False, "sft-2"),
])
def test_a_template_fills_into_a_branch_name(template, step, role, adapter, expected):
    assert revision_for(template, step, role, adapter) == expected


@pytest.mark.parametrize("template, words", [
    ("step-{run}", "only the placeholders {step} and {role} may be used, not {run}"),
    ("step-{0}", "not {0}"),
    ("step-{step", "it is not a template"),
    ("step {step}", "only letters, digits"),
    ("step-{step}.lock", "end with .lock"),
    ("../{step}", "no leading, trailing or doubled / and no .."),
    ("a//{step}", "doubled /"),
    ("step-{step:x<}", None),  # a spec that fills: fine
])
def test_a_refused_template_says_why(template, words):
    problem = template_problem(template)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem
        with pytest.raises(InvalidOption, match="revision template"):
            revision_for(template, 1, "actor")


def test_refs_are_checked_and_an_adapter_gets_its_own():
    assert moving_refs_for(["latest"]) == ("latest",)
    assert moving_refs_for(["latest"], adapter=True) == ("latest-adapter",)
    for bad in ("", "HEAD", "a" * 40, "la test", ".hidden", "x/"):
        with pytest.raises(InvalidOption, match="Hub ref"):
            checked_ref(bad)
