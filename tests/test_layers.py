"""Dependencies point down, and there are no import cycles.

Every module of ``merge_engine``, ``tasks``, ``flows`` and ``deployments`` is given a layer below
(the most specific prefix wins); its imports are read with `ast` (module-level ones and those inside
functions alike: a lazy import is still a dependency). The test fails when:
- a module has no layer (say where it belongs: add it to `LAYERS`);
- a module imports one of a HIGHER layer (the order is ARCHITECTURE.md's: cli/flows -> jobs ->
  planner -> layouts/architectures -> storage);
- the imports between modules form a cycle (same layer included);
- ``merge_engine`` imports Prefect.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("merge_engine", "tasks", "flows", "deployments")

# layer -> module prefixes (a prefix names a module or a package and everything under it)
LAYERS: dict[int, tuple[str, ...]] = {
    # storage, errors, and the few leaf modules every wing reads (JSON, value spellings)
    0: ("merge_engine", "merge_engine.options", "merge_engine.errors", "merge_engine.storage", "merge_engine.formats.json_text",
        "merge_engine.formats.dcp_file_names", "merge_engine.plan.option_values"),
    # byte formats, and the plan records every planner fills
    1: ("merge_engine.formats", "merge_engine.plan.merge_plan", "merge_engine.plan.output_heads",
        "merge_engine.plan.transformers_conversion", "merge_engine.plan.model_heads", "merge_engine.plan.hub_config"),
    # checkpoint layouts and model families
    2: ("merge_engine.layouts", "merge_engine.architectures"),
    # planners of one kind of source, and the LoRA library they plan from
    3: ("merge_engine.architectures.megatron_to_hf", "merge_engine.plan", "merge_engine.lora"),
    # the planner (picks a plan) and discovery (run root -> steps)
    4: ("merge_engine.plan.planner", "merge_engine.layouts.discovery"),
    # how an output is written: units of work, executors, targets, commits
    5: ("merge_engine.output", "merge_engine.release.checksums"),
    # jobs and the commands built on them; validation; releases
    6: ("merge_engine.output.jobs", "merge_engine.commands", "merge_engine.validate", "merge_engine.release"),
    7: ("merge_engine.cli", "merge_engine.__main__"),
    8: ("tasks",),
    9: ("flows",),
    10: ("deployments",),
}


def layer_of(module: str) -> int | None:
    best, found = -1, None
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), layer
    return found


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


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


def upward_imports(module: str, targets: set[str]) -> list[str]:
    """The imports of ``module`` from a higher layer (a package is its own modules' parent, not above)."""
    own = layer_of(module)
    return sorted(f"{t} (layer {layer_of(t)})" for t in targets
                  if own is not None and layer_of(t) is not None and layer_of(t) > own and not module.startswith(t + "."))


# upward imports still to remove, each with who removes it; the test fails once one is gone (delete it here)
KNOWN_UPWARD: dict[str, list[str]] = {}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_from_a_higher_layer(module):
    assert upward_imports(module, GRAPH[module]) == KNOWN_UPWARD.get(module, []), \
        f"{module} (layer {layer_of(module)}) imports from above"


# cycles still to break, each with who breaks it; the test fails once one is gone (delete it here)
KNOWN_CYCLES: list[list[str]] = []


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
    assert [_rotated(c) for c in cycles] == [_rotated(c) for c in KNOWN_CYCLES]


def _rotated(cycle: list[str]) -> list[str]:
    """A cycle written from its smallest module on (the same cycle found from another start compares equal)."""
    ring = cycle[:-1]
    start = ring.index(min(ring))
    return ring[start:] + ring[:start] + [ring[start]]


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


def test_the_checker_sees_lazy_and_relative_upward_imports(tmp_path):
    """The rules can fail: a layout importing the planner inside a function, or the CLI relatively, is seen."""
    fake = tmp_path / "fake.py"
    fake.write_text("from ..plan import planner\n\ndef f():\n    from merge_engine.cli import main\n    import flows.events\n")
    found = imports_of("merge_engine.layouts.fake", fake)
    assert found == {"merge_engine.plan", "merge_engine.plan.planner", "merge_engine.cli", "flows.events"}
    assert upward_imports("merge_engine.layouts.fake", found) == [
        "flows.events (layer 9)", "merge_engine.cli (layer 7)", "merge_engine.plan (layer 3)",
        "merge_engine.plan.planner (layer 4)"]
