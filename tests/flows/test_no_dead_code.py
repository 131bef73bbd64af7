"""No dead code in the product: every top-level function and class of merge_engine/, tasks/, flows/ and
deployments/ (every module, recursively) is used by the project's code outside its own definition.

A use is read from the code's syntax (`ast`), never from text: a ``Name`` or an ``Attribute`` naming it, an
import of it, or an entry point naming it (``module:name`` / ``path.py:name`` / ``module:Class.method`` in
``deployments/prefect.yaml``, ``pyproject.toml``, the ``Makefile``, the commands the READMEs give an operator,
or a string of that exact form in code: a server's factory, a registry's lazy entry).
A decorator that registers what it decorates (``@register_...``, Prefect's ``@flow``) counts as a use, and
so does a mention in a table (a dict, list or tuple holding the function is a ``Name`` in code). A mention
in a docstring or a comment does not count, nor does a use inside its own body (recursion), nor ``__all__``
alone. The code that may use it: the product, ``benchmarks/`` and ``synthetic_runs/`` (scripts and writers
a user runs); never ``tests/``: code that only tests use belongs in ``tests/``.
Module hooks Python itself calls (a module's ``__getattr__``) are not counted as definitions.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("merge_engine", "tasks", "flows", "deployments")
USERS = (*PRODUCT, "benchmarks", "synthetic_runs")
ENTRY_POINT_FILES = ("deployments/prefect.yaml", "pyproject.toml", "Makefile", "README.md", "deployments/README.md")
ENTRY_POINT = re.compile(r"^[\w.\-/]+(?:\.py)?:([\w.]+)$")  # module:name, path.py:name, module:Class.method
ENTRY_POINT_TOKEN = re.compile(r"[A-Za-z_][\w.\-/]*(?:\.py)?:[A-Za-z_][\w.]*")
REGISTERING = re.compile(r"^(register\w*|flow|task)$")


def _python_files(packages: tuple[str, ...]) -> list[Path]:
    return sorted(p for package in packages for p in (REPO / package).rglob("*.py"))


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in _python_files(USERS)}


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _references(tree: ast.AST) -> Counter[str]:
    """Every name the code under ``tree`` refers to: loads, attributes, imports, entry-point strings."""
    found: Counter[str] = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            found[node.id] += 1
        elif isinstance(node, ast.Attribute):
            found[node.attr] += 1
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = ENTRY_POINT.match(node.value.strip())
            if match:
                found.update(match.group(1).split("."))
    return found


def _definitions(trees: dict[Path, ast.Module]) -> list[tuple[str, ast.AST]]:
    found = []
    for path, tree in trees.items():
        if path.relative_to(REPO).parts[0] not in PRODUCT:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    not (node.name.startswith("__") and node.name.endswith("__")):
                found.append((str(path.relative_to(REPO)), node))
    return found


TREES = _trees()
DEFINITIONS = _definitions(TREES)


def _all_references() -> Counter[str]:
    found: Counter[str] = Counter()
    for tree in TREES.values():
        found.update(_references(tree))
    for name in ENTRY_POINT_FILES:
        for token in ENTRY_POINT_TOKEN.findall((REPO / name).read_text()):
            found.update(token.rsplit(":", 1)[1].split("."))
    return found


REFERENCES = _all_references()


def used(node: ast.AST) -> bool:
    """Referred to outside its own definition, or registered by a decorator."""
    if any(REGISTERING.match(_decorator_name(d)) for d in node.decorator_list):
        return True
    return REFERENCES[node.name] - _references(node)[node.name] > 0


@pytest.mark.parametrize("module,node", DEFINITIONS, ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_definition_is_used(module, node):
    assert used(node), f"{module}: {node.name} is defined but never used by the project's code"


def test_a_docstring_mention_is_no_use():
    """The reader itself: a name only mentioned in a docstring or a comment is not referenced; one called,
    imported, decorated into a registry or put in a table is."""
    tree = ast.parse('''
"""lonely() is only mentioned here."""
from somewhere import imported
def lonely():
    """calls lonely() recursively in words"""
    return lonely()  # and lonely again in a comment
def called(): pass
def tabled(): pass
TABLE = {"x": tabled}
called()
''')
    references = _references(tree)
    lonely = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "lonely")
    assert references["lonely"] - _references(lonely)["lonely"] == 0
    assert references["called"] == 1 and references["tabled"] == 1 and references["imported"] == 1


def test_no_function_is_defined_twice():
    """The same helper written in two modules drifts apart (sizes printed two ways, keys normalised
    differently): a top-level function name lives in one module of the Prefect layer."""
    where: dict[str, list[str]] = {}
    for module, node in DEFINITIONS:
        if module.split("/")[0] in ("flows", "tasks", "deployments"):
            where.setdefault(node.name, []).append(module)
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}
