"""Names read from a checkpoint (file names, tensor names, folder names) are matched with ASCII digits only.

Python's ``\\d`` also matches other scripts' digits and ``int()`` reads them: ``iter_٣`` or ``model.layers.٣.x``
would alias step or layer 3. Every module-level pattern of the product uses ``[0-9]`` (or the ASCII flag).
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import merge_engine


def _patterns():
    for info in pkgutil.walk_packages(merge_engine.__path__, "merge_engine."):
        if info.name.endswith(".__main__"):  # runs the command line
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern) and isinstance(value.pattern, str):
                yield f"{info.name}.{name}", value


def test_no_product_pattern_reads_another_scripts_digits():
    unicode_digits = [where for where, pattern in _patterns()
                      if "\\d" in pattern.pattern and not pattern.flags & re.ASCII]
    assert unicode_digits == []


def test_a_rank_file_named_with_arabic_indic_digits_is_no_rank_file():
    from merge_engine.layouts.fsdp import RANK_FILE

    assert RANK_FILE.match("model_world_size_2_rank_0.pt")
    assert not RANK_FILE.match("model_world_size_\u0662_rank_\u0660.pt")
