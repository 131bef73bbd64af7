"""What `hub_config` answered for a config, kept on disk: the next merge of the same run asks transformers nothing.

`merge_engine.plan.hub_config` reads its rules from transformers' config classes, and building one
(``AutoConfig``) imports transformers and scans every model folder: more than the rest of a small
merge (docs/scaling.md, "Figures behind the engine's choices"). Its answer depends only on the config, the installed
transformers and the rules' code, and every step of a training run has the same config, so the answer is
kept under a key made of exactly those three.

Contract:
- `hub_config_memo(config)` returns what `hub_config(config)` returns, equal field for field; the first call
  per key computes it (and raises what it raises: a refusal is never kept), later calls read it
  without importing transformers.
- The key is the sha256 of: the config as canonical JSON (sorted keys), the installed transformers'
  version (read from its distribution's metadata, not by importing it), and the bytes of
  ``hub_config.py``. Any of them changed is another entry, never a stale answer.
- An answer is kept only when it survives a JSON round trip unchanged (what is read back is what was
  computed); an entry that does not parse as one is recomputed and rewritten.
- Where: ``$STEPMERGE_CACHE_DIR/hub_config/`` (default ``$XDG_CACHE_HOME/stepmerge``, else
  ``~/.cache/stepmerge``); ``STEPMERGE_CACHE_DIR=`` (empty) turns it off. One small file (a few KB) per
  distinct config and transformers version, written to a temporary name and renamed in place; a folder
  that cannot be written (read-only home) only costs the computation.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from merge_engine.plan import hub_config as rules
from merge_engine.plan.hub_config import ConfigChange, HubConfig

CACHE_ENV = "STEPMERGE_CACHE_DIR"
ENTRY_FORMAT = 1


def cache_root() -> Path | None:
    """stepmerge's cache folder (every memo's parent), or None when ``STEPMERGE_CACHE_DIR`` is set empty."""
    given = os.environ.get(CACHE_ENV)
    if given is not None:
        return Path(given) if given else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stepmerge"


def cache_dir() -> Path | None:
    """The memo's folder, or None when ``STEPMERGE_CACHE_DIR`` is set empty."""
    root = cache_root()
    return root / "hub_config" if root is not None else None


def transformers_version() -> str:
    """The installed transformers' version, read from its distribution's metadata (nothing imported)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"


def write_entry(entry: Path, text: str) -> None:
    """``text`` written to ``entry`` through a temporary name renamed in place; an unwritable folder is
    ignored (a memo is an optimisation: it costs only the computation)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(temp, entry)
        except BaseException:
            os.unlink(temp)
            raise
    except OSError:
        pass


def memo_key(config: Mapping[str, Any]) -> str:
    """sha256 of the config (canonical JSON), the installed transformers' version and the rules' code."""
    version = transformers_version()
    digest = hashlib.sha256()
    digest.update(json.dumps(dict(config), sort_keys=True, default=str).encode())  # as hub_config reads it
    digest.update(b"\0transformers " + version.encode())
    digest.update(b"\0" + Path(rules.__file__).read_bytes())
    return digest.hexdigest()


def hub_config_memo(config: Mapping[str, Any]) -> HubConfig:
    """`hub_config(config)`, from the memo when it holds this key (see the module docstring)."""
    folder = cache_dir()
    entry = folder / f"{memo_key(config)}.json" if folder is not None else None
    if entry is not None:
        kept = _read(entry)
        if kept is not None:
            return kept
    answer = rules.hub_config(config)
    if entry is not None:
        _write(entry, answer)
    return answer


def _to_json(answer: HubConfig) -> dict[str, Any]:
    return {"format": ENTRY_FORMAT, "updates": answer.updates, "unread": answer.unread,
            "changes": [change.to_json() for change in answer.changes]}


def _from_json(data: Any) -> HubConfig | None:
    if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT:
        return None
    try:
        changes = tuple(ConfigChange(c["key"], c["value"], c["from"]) for c in data["changes"])
        updates, unread = data["updates"], data["unread"]
    except (KeyError, TypeError):
        return None
    if not isinstance(updates, dict) or not (unread is None or isinstance(unread, str)):
        return None
    return HubConfig(updates, changes, unread)


def _read(entry: Path) -> HubConfig | None:
    try:
        return _from_json(json.loads(entry.read_text()))
    except (OSError, ValueError):
        return None


def _write(entry: Path, answer: HubConfig) -> None:
    text = json.dumps(_to_json(answer), sort_keys=True)
    if _from_json(json.loads(text)) != answer:
        return  # a value JSON would not give back as it is (a tuple, a NaN): not kept
    write_entry(entry, text)
