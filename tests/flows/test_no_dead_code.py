"""No dead code in the Prefect layer: every top-level function and class of flows/, tasks/ and
deployments/ is used by the project's code (its own module counts, its definition does not), by
``deployments/prefect.yaml`` (flow entry points) or is exported in ``__all__`` (module hooks such as
``__getattr__``, which Python itself calls, are not counted)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "deployments")
SOURCES = [p for package in ("merge_engine", *PACKAGES) for p in (REPO / package).rglob("*.py")]


def _definitions() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).glob("*.py")):
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                        not (node.name.startswith("__") and node.name.endswith("__")):  # a module's __getattr__: Python calls it
                    found.append((str(path.relative_to(REPO)), node.name))
    return found


def _uses(name: str) -> int:
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    text = "\n".join(p.read_text() for p in SOURCES) + (REPO / "deployments" / "prefect.yaml").read_text()
    definitions = len(re.findall(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", text, re.M))
    return len(pattern.findall(text)) - definitions


@pytest.mark.parametrize("module,name", _definitions(), ids=lambda v: v)
def test_every_definition_is_used(module, name):
    assert _uses(name) > 0, f"{module}: {name} is defined but never used"


def test_no_function_is_defined_twice():
    """The same helper written in two modules drifts apart (sizes printed two ways, keys normalised
    differently): a top-level function name lives in one module of the Prefect layer."""
    where: dict[str, list[str]] = {}
    for module, name in _definitions():
        where.setdefault(name, []).append(module)
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}
