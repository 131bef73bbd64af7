"""No dead code in the product: every top-level function, class and module-level name of merge_engine/, tasks/,
flows/ and deployments/ (every module, recursively), and every public method of their classes, is used by the
project's code outside its own definition.

A use is read from the code's syntax (`ast`), never from text: a ``Name`` or an ``Attribute`` naming it, an
import of it, a ``getattr``/``hasattr`` of it by a constant name (an optional hook), or an entry point naming it (``module:name`` / ``path.py:name`` / ``module:Class.method`` in
``deployments/prefect.yaml``, ``pyproject.toml``, the ``Makefile``, the commands the READMEs give an operator,
or a string of that exact form in code: a server's factory, a registry's lazy entry).
A decorator that registers what it decorates (``@register_...``, Prefect's ``@flow``) counts as a use, and
so does a mention in a table (a dict, list or tuple holding the function is a ``Name`` in code). A mention
in a docstring or a comment does not count, nor does a use inside its own body (recursion), nor ``__all__``
alone. The code that may use it: the product, ``benchmarks/`` and ``synthetic_runs/`` (scripts and writers
a user runs); never ``tests/``: code that only tests use belongs in ``tests/``.
Module hooks Python itself calls (a module's ``__getattr__``) are not counted as definitions, nor are a
method that overrides one of a library base class (``parse_known_args`` of an ``argparse.ArgumentParser``,
``find_class`` of a ``pickle.Unpickler``: the library calls it) or the methods of a class whose library base
cannot be imported here. A method is matched by name, so a method only tests call fails unless some product
code calls a method of that name: the check is sound (it never fails on used code) but not complete.
"""

from __future__ import annotations

import ast
import importlib
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
# what the product declares for a check to enforce (its contract, not its code), each with the check reading it
CONTRACTS = {"WINGS": "tests/test_layers.py: the engine's wings in their written order"}


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
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            found[node.args[1].value] += 1
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


class Assigned(ast.AST):
    """A module-level assignment as one definition: used when one of its names is (``A, B = ...``)."""

    _fields = ()

    def __init__(self, node: ast.Assign | ast.AnnAssign) -> None:
        super().__init__()
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        self.names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        self.name, self.node, self.decorator_list = ", ".join(self.names), node, []


def _assignments(trees: dict[Path, ast.Module]) -> list[tuple[str, Assigned]]:
    found = []
    for path, tree in trees.items():
        if path.relative_to(REPO).parts[0] in PRODUCT:
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    assigned = Assigned(node)
                    if assigned.names and not any(n.startswith("__") for n in assigned.names):
                        found.append((str(path.relative_to(REPO)), assigned))
    return found


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted path it was imported as (``from a import B`` -> ``a.B``)."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            names.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                          for a in node.names})
    return names


def _library_class(dotted: str) -> type | None:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - not importable here: a base whose methods are unknown
        return None


def _methods(trees: dict[Path, ast.Module]) -> list[tuple[str, ast.AST]]:
    """(module:class, method) of every public method of a product class that overrides no library base's."""
    classes = {node.name: (tree, node) for path, tree in trees.items() if path.relative_to(REPO).parts[0] in PRODUCT
               for node in tree.body if isinstance(node, ast.ClassDef)}

    def library_names(tree: ast.Module, cls: ast.ClassDef, seen: frozenset = frozenset()) -> set[str] | None:
        """The attribute names the class inherits from library bases (None: unknown, a base not readable)."""
        names: set[str] = set()
        imported = _imported_names(tree)
        for base in cls.bases:
            text = ast.unparse(base)
            if text in ("object", "Protocol", "Generic") or text.startswith(("Generic[", "Protocol[")):
                continue
            if text in classes and text not in seen and text not in imported:
                inherited = library_names(*classes[text], seen | {text})
            else:
                head, _, rest = text.partition(".")
                library = _library_class(imported.get(head, "builtins." + head) + ("." + rest if rest else ""))
                inherited = None if library is None else set(dir(library))
            if inherited is None:
                return None
            names |= inherited
        return names

    found = []
    for path, tree in trees.items():
        if path.relative_to(REPO).parts[0] not in PRODUCT:
            continue
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            inherited = library_names(tree, cls)
            if inherited is None:
                continue
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_") \
                        and node.name not in inherited:
                    found.append((f"{path.relative_to(REPO)}:{cls.name}", node))
    return found


TREES = _trees()
DEFINITIONS = _definitions(TREES)
ASSIGNMENTS = _assignments(TREES)
METHODS = _methods(TREES)


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
    if isinstance(node, Assigned):
        return bool(set(node.names) & set(CONTRACTS)) or any(REFERENCES[name] - _references(node.node)[name] > 0 for name in node.names)
    return REFERENCES[node.name] - _references(node)[node.name] > 0


@pytest.mark.parametrize("module,node", DEFINITIONS + ASSIGNMENTS, ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_definition_is_used(module, node):
    assert used(node), f"{module}: {node.name} is defined but never used by the project's code"


@pytest.mark.parametrize("where,node", METHODS, ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_public_method_is_used(where, node):
    """A method only tests call belongs in tests/ (a helper there), not in the product."""
    assert used(node), f"{where}.{node.name} is defined but never called by the project's code (tests aside)"


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


def test_a_method_only_tests_call_is_found():
    """The method reader: a public method is listed unless it overrides a library base's (argparse calls
    ``parse_known_args``) or is private; a hook looked up by ``getattr`` is a use, a method no code calls is none."""
    tree = ast.parse('''
import argparse
class Parser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None): pass
    def only_tests_call_this(self): pass
class Source:
    def hook(self): pass
    def _private(self): pass
getattr(Source(), "hook", None)
''')
    found = [node.name for _, node in _methods({REPO / "merge_engine" / "fake.py": tree})]
    assert found == ["only_tests_call_this", "hook"]
    assert _references(tree)["hook"] == 1 and _references(tree)["only_tests_call_this"] == 0


def test_no_function_is_defined_twice():
    """The same helper written in two modules drifts apart (sizes printed two ways, keys normalised
    differently): a top-level function name lives in one module of the Prefect layer."""
    where: dict[str, list[str]] = {}
    for module, node in DEFINITIONS:
        if module.split("/")[0] in ("flows", "tasks", "deployments"):
            where.setdefault(node.name, []).append(module)
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}
