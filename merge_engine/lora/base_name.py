"""The base model an adapter names (``base_model_name_or_path`` of its ``adapter_config.json``), chosen so that
the name resolves wherever the adapter is copied: never a path of the machine that wrote it.

`adapter_base_name` picks, in this order:
1. the Hub id the operator gives (``--base-model-id``);
2. the Hub id the run's own model config names (``_name_or_path`` of verl's ``huggingface/config.json``, when
   it is a Hub id ``namespace/name`` and not a path: `hub_id_of`);
3. ``base`` (`merge_engine.lora.keys.BASE_DIR`) when the clean base is written beside the adapter: a name
   relative to the release (``PeftModel.from_pretrained(<release>/base, <release>)``; the model card says so);
4. the base model given (``--base-model``) by its portable name (`merge_engine.layouts.runs.portable_url`).
None when there is none of these.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from merge_engine.layouts.runs import portable_url
from merge_engine.lora.keys import BASE_DIR
from merge_engine.storage.urls import is_machine_path

# the Hub's repo id rules (huggingface_hub.utils.validate_repo_id), with the namespace required: a bare name is
# as likely a relative folder as a model of the Hub
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,94}/[A-Za-z0-9][A-Za-z0-9_.-]{0,94}")


def hub_id_of(name: Any) -> str | None:
    """``name`` when it is a Hub model id (``namespace/name``: no path of this machine, no scheme, no ``--`` or
    ``..``, not ending in ``.git``), else None."""
    if not isinstance(name, str) or not _HUB_ID.fullmatch(name) or is_machine_path(name):
        return None
    if "--" in name or ".." in name or name.endswith((".git", "-", ".")) or len(name) > 96:
        return None
    return name


def adapter_base_name(*, base_model_id: str | None, config: Mapping[str, Any] | None, base_written: bool,
                      base_model: str | None) -> str | None:
    """``base_model_name_or_path`` for an adapter (see the module docstring for the order)."""
    if base_model_id:
        return base_model_id
    from_run = hub_id_of((config or {}).get("_name_or_path"))
    if from_run is not None:
        return from_run
    if base_written:
        return BASE_DIR
    return portable_url(base_model) if base_model else None
