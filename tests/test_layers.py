"""Dependencies point down, wing by wing, and there are no import cycles.

`merge_engine.WINGS` is the one written order of the wings, bottom to top: each entry is a module prefix (a
folder of the engine, one of its top-level modules, or a package above it: ``synthetic_runs``, ``tasks``,
``flows``, ``deployments``), and a module's layer is the position of the one wing it is or lies under. There is no
other rule and no exception per module. Imports are read with `ast` (module-level ones and those inside
functions alike: a lazy import is still a dependency), and so are string references: a string constant that
names a project module (``"merge_engine.commands.megatron_lora"``, ``"merge_engine.output.executors.local"``) or
a name in one (``"flows.params:MergeStepParams"``) is a dependency on that module, as an import would be. A module
importing names from its own package (``from merge_engine.architectures import find_table`` inside
``architectures/custom.py``) depends on the package's ``__init__``: when that imports it back, it is a cycle like
any other. The test fails when:
- a module lies in no wing, or a wing names no module (say where it belongs: edit `WINGS`);
- a module imports one of a HIGHER wing;
- the imports between modules form a cycle (same wing included);
- the package ``merge_engine`` itself (below every wing) imports any of them but `merge_engine.api`, the API it
  exports (whose functions import what they call when they run);
- ``merge_engine`` imports Prefect;
- the product (every package above) imports anything of ``tests``, or names it in a string;
- the README's layout section does not list the engine's wings in that order (top to bottom, as it draws them).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from merge_engine import WINGS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("merge_engine", "synthetic_runs", "tasks", "flows", "deployments")  # the product
TESTS = "tests"
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


# a string constant that names a module (dotted) or a name in one (``module:name``)
REFERENCE = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Za-z_]\w*(?=:))(?::[A-Za-z_][\w.]*)?$")


def module_named(name: str, modules: set[str] | dict[str, pathlib.Path]) -> str | None:
    """The longest of ``modules`` that ``name`` is or lies under (``a.b.NAME`` -> ``a.b``); None: none."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def string_references(tree: ast.AST) -> set[str]:
    """The modules that string constants of ``tree`` refer to: ``"a.b:name"`` / ``"a:name"`` (``a.b`` / ``a``),
    and ``"a.b.c"`` naming a module below a package's top (``a.b`` or under it: ``"tasks.json"`` names none), where
    ``a`` is a project package or ``tests``. A logger's name (``logging.getLogger("merge_engine.storage")``) is a
    name in the logging tree, not a reference."""
    loggers = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
               and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "getLogger"
               for arg in node.args}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in loggers:
            match = REFERENCE.match(node.value)
            if not match or match.group(1).split(".")[0] not in (*PACKAGES, TESTS):
                continue
            named = match.group(1)
            if named.split(".")[0] == TESTS:
                found.add(named)
            elif ":" in node.value or "." in (module_named(named, MODULES) or ""):
                found.add(named)
    return found


def imported_names(module: str, path: pathlib.Path) -> set[str]:
    """Every name ``module`` imports or names in a string, as written (relative imports resolved): ``import a.b``
    gives ``a.b``; ``from a import b, c`` gives ``a.b`` for each ``b`` that is a module of the project and ``a``
    itself when some name is not (it comes from ``a``'s namespace)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set(string_references(tree)) if module != ENGINE else set()  # its strings are `WINGS`: the order itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


def imports_of(module: str, path: pathlib.Path) -> set[str]:
    """The project modules ``module`` imports or names in a string (see `imported_names`)."""
    found = {module_named(name, MODULES) for name in imported_names(module, path)}
    return {name for name in found if name is not None and name != module}


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
    # a module's imports of its own package count: ``from pkg import sub`` is an edge to ``pkg.sub`` only, but
    # ``from pkg import name`` is one to ``pkg`` (its ``__init__``), which must then not import the module back.
    # One exception, the package itself: its __init__ defines the engine's identity (``__version__``,
    # ``engine_identity``) before it imports the API it exports (`merge_engine.api`), and every wing reads those
    graph = {m: {t for t in targets if t != ENGINE} for m, targets in GRAPH.items()}
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


def test_the_product_imports_nothing_from_tests():
    offenders = sorted(f"{module}: {name}" for module, path in MODULES.items()
                       for name in imported_names(module, path) if name.split(".")[0] == TESTS)
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
    assert found == {"merge_engine.plan.hf_plan", "merge_engine.cli", "flows.events"}
    assert upward_imports("merge_engine.formats.fake", found) == [
        "flows.events (flows)", "merge_engine.cli (merge_engine.cli)", "merge_engine.plan.hf_plan (merge_engine.plan)"]


def test_the_checker_sees_string_references(tmp_path):
    """A layout naming a command module by string, or the engine naming a flow's type as ``module:name``, is an
    upward dependency like an import; a dotted string naming no project module (a file name) is none."""
    fake = tmp_path / "fake.py"
    fake.write_text('JOBS = "merge_engine.commands.megatron_lora"\nTYPE = "flows.params:MergeStepParams"\n'
                    'FILE = "tasks.json"\nLOG = "merge_engine.layouts.fsdp.NAME"\n')
    found = imports_of("merge_engine.layouts.fake", fake)
    assert found == {"merge_engine.commands.megatron_lora", "flows.params", "merge_engine.layouts.fsdp"}
    assert upward_imports("merge_engine.layouts.fake", found) == [
        "flows.params (flows)", "merge_engine.commands.megatron_lora (merge_engine.commands)"]


def test_the_checker_sees_a_module_import_its_own_package(tmp_path):
    """``from merge_engine.architectures import find_table`` in a module of that package is an edge to the package
    (its ``__init__``); ``from merge_engine.architectures import custom`` is one to the module only."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from merge_engine.architectures import find_table\n"
                    "    from merge_engine.architectures import custom\n    from . import mappings\n")
    assert imports_of("merge_engine.architectures.fake", fake) == {
        "merge_engine.architectures", "merge_engine.architectures.custom", "merge_engine.architectures.mappings"}


def test_the_checker_sees_the_product_import_tests(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text('def s3():\n    from tests.servers import SeaweedS3Server\n\n'
                    'HELPER = "tests.fixtures_storage:upload_step"\n')
    assert {n for n in imported_names("flows.fake", fake) if n.split(".")[0] == TESTS} == {
        "tests.servers", "tests.fixtures_storage"}


def test_synthetic_runs_is_a_wing_of_the_product():
    assert "synthetic_runs.fsdp" in MODULES and layer_of("synthetic_runs.fsdp") is not None
