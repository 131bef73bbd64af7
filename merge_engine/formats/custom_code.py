"""Which Python files of a model folder are the model's own custom code.

transformers loads a model's custom code (``trust_remote_code``) from the ``auto_map`` of its ``config.json`` and
of its tokenizer / processor configs (`AUTO_MAP_FILES`): each entry is ``"module.Class"`` (the folder's
``module.py``), ``"repo--module.Class"`` (another repository's: no file here) or, for a tokenizer, a list of those
or nulls; a named module brings the modules it imports relatively (``from .module import``, ``import .module``).
`custom_code_files` gives exactly those files; any other ``.py`` in a checkpoint folder is a trainer's or a user's
script, not the model's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

AUTO_MAP_FILES = ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                  "video_preprocessor_config.json")  # besides config.json: the configs transformers reads auto_map of
RELATIVE_IMPORTS = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
                    re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE))  # transformers' get_relative_imports


def auto_map_modules(config: Mapping[str, Any]) -> set[str]:
    """The module file names (``module.py``) a config's ``auto_map`` names in this folder; ``repo--`` entries and
    anything not of the form ``module.Class`` name none."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, Mapping):
        return set()
    modules = set()
    for value in auto_map.values():
        for reference in value if isinstance(value, list) else [value]:
            if not isinstance(reference, str) or "--" in reference or reference.count(".") != 1:
                continue
            module = reference.split(".")[0]
            if module and "/" not in module and "\\" not in module:
                modules.add(f"{module}.py")
    return modules


def relative_imports(source: str) -> set[str]:
    """The module files (``module.py``) a Python source imports relatively from its own folder."""
    names = {name for pattern in RELATIVE_IMPORTS for name in pattern.findall(source)}
    return {f"{name}.py" for name in names if name.isidentifier()}


def custom_code_files(config: Mapping[str, Any], present: set[str],
                      read_json: Callable[[str], Mapping[str, Any] | None],
                      read_text: Callable[[str], str]) -> set[str]:
    """The ``.py`` files among ``present`` (a folder's top-level names) that the model's custom code is: named by
    the ``auto_map`` of ``config`` or of a present `AUTO_MAP_FILES` config (``read_json``: that file parsed, None
    when it is not a JSON object), and the present modules those import relatively (``read_text``: a file's
    source), transitively. Nothing is imported or run."""
    named = auto_map_modules(config)
    for name in AUTO_MAP_FILES:
        if name in present:
            parsed = read_json(name)
            if parsed is not None:
                named |= auto_map_modules(parsed)
    found: set[str] = set()
    pending = sorted(named & present)
    while pending:
        module = pending.pop()
        if module in found:
            continue
        found.add(module)
        pending.extend(sorted((relative_imports(read_text(module)) & present) - found))
    return found


__all__ = ["AUTO_MAP_FILES", "auto_map_modules", "custom_code_files", "relative_imports"]
