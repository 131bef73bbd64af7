"""Which family table serves a config: `find_table`, by ``model_type`` then by ``architectures`` (no torch, no I/O).

Below the package's `__init__` (which re-exports it) and `custom` (a custom mapping's base table), so that neither
imports the other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the mappings import torch; this module does not
    from merge_engine.architectures.mappings import FamilyTable

__all__ = ["find_table"]


def find_table(config: Mapping[str, Any], tables: Mapping[str, FamilyTable]) -> FamilyTable | None:
    """The table serving ``config``: by ``model_type``, else by the first of ``architectures``."""
    model_type = config.get("model_type")
    for table in tables.values():
        if model_type in table.model_types:
            return table
    for architecture in config.get("architectures") or ():
        for table in tables.values():
            if architecture in table.architectures:
                return table
    return None
