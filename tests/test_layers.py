"""Dependencies point down, wing by wing, and there are no import cycles.

`merge_engine.WINGS` is the one written order of the wings, bottom to top: each entry is a module prefix (a
folder of the engine, one of its top-level modules, or a package above it: ``tasks``, ``flows``,
``deployments``), and a module's layer is the position of the one wing it is or lies under. There is no
other rule and no exception per module. Imports are read with `ast` (module-level ones and those inside
functions alike: a lazy import is still a dependency). The test fails when:
- a module lies in no wing, or a wing names no module (say where it belongs: edit `WINGS`);
- a module imports one of a HIGHER wing;
- the imports between modules form a cycle (same wing included);
- the package ``merge_engine`` itself (below every wing) imports any of them but `merge_engine.api`, the API it
  exports (whose functions import what they call when they run);
- ``merge_engine`` imports Prefect;
- the README's layout section does not list the engine's wings in that order (top to bottom, as it draws them).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from merge_engine import WINGS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("merge_engine", "tasks", "flows", "deployments")
ENGINE = "merge_engine"  # the package itself: below every wing
API = "merge_engine.api"  # the one module the package itself imports: the API it exports


def layer_of(module: str) -> int | None:
    """The position in `WINGS` of the wing ``module`` is or lies under (-1: the package itself; None: none)."""
    if module == ENGINE:
        return -1
    found = [i for i, wing in enumerate(WINGS) if module == wing or module.startswith(wing + ".")]
    return found[0] if found else None


def module_files() -> dict[str, pathlib.Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


MODULES = module_files()


def imports_of(module: str, path: pathlib.Path) -> set[str]:
    """The project modules ``module`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in MODULES and name != module:
                found.add(name)
    return found


GRAPH = {module: imports_of(module, path) for module, path in MODULES.items()}


def test_the_wings_are_one_order_of_distinct_prefixes():
    """No wing is listed twice or lies inside another (a module has exactly one wing), and each holds a module."""
    assert len(set(WINGS)) == len(WINGS)
    assert [(a, b) for a in WINGS for b in WINGS if b.startswith(a + ".")] == []
    assert [wing for wing in WINGS if not any(m == wing or m.startswith(wing + ".") for m in MODULES)] == []


def test_every_module_has_a_wing():
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_the_package_itself_imports_only_its_api():
    assert GRAPH[ENGINE] == {API}


def upward_imports(module: str, targets: set[str]) -> list[str]:
    """The imports of ``module`` from a higher wing, each as ``target (wing)``."""
    own = layer_of(module)
    return sorted(f"{t} ({WINGS[layer_of(t)]})" for t in targets
                  if own is not None and layer_of(t) is not None and layer_of(t) > own)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_from_a_higher_wing(module):
    exported = {API} if module == ENGINE else set()
    assert upward_imports(module, GRAPH[module] - exported) == [], \
        f"{module} (wing {WINGS[layer_of(module)] if layer_of(module) is not None else None}) imports from above"


def test_no_import_cycles():
    # a package's __init__ importing its own modules, and each module importing the package, is how
    # Python packages are built, not a cycle between modules: edges to a module's own ancestors are skipped
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in GRAPH.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_engine_never_imports_prefect():
    offenders = []
    for module, path in MODULES.items():
        if not module.startswith("merge_engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] == "prefect"]
    assert offenders == []


def readme_wings() -> list[str]:
    """The engine's wings as README's layout section draws them, top to bottom: the names indented under
    ``merge_engine/`` (``storage/``, ``cli``, ...), in the order they appear."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("merge_engine/"))
    names = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        match = re.match(r"^  (\w+)/?\s", line)
        if match:
            names.append(f"merge_engine.{match.group(1)}")
    return names


def test_the_readme_draws_the_wings_in_their_order():
    engine_wings = [w for w in WINGS if w.startswith(ENGINE + ".") and w != "merge_engine.__main__"]
    assert readme_wings() == engine_wings[::-1]


def test_the_checker_sees_lazy_and_relative_upward_imports(tmp_path):
    """The rules can fail: a layout importing the planner inside a function, or the CLI relatively, is seen."""
    fake = tmp_path / "fake.py"
    fake.write_text("from ..plan import hf_plan\n\ndef f():\n    from merge_engine.cli import main\n    import flows.events\n")
    found = imports_of("merge_engine.formats.fake", fake)
    assert found == {"merge_engine.plan", "merge_engine.plan.hf_plan", "merge_engine.cli", "flows.events"}
    assert upward_imports("merge_engine.formats.fake", found) == [
        "flows.events (flows)", "merge_engine.cli (merge_engine.cli)", "merge_engine.plan (merge_engine.plan)",
        "merge_engine.plan.hf_plan (merge_engine.plan)"]
