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
- The cache folder is another party's to write as far as the release is concerned: an entry is read like a
  stored result. It must name its own key (an entry copied from another config's file is not used), be a
  regular file (not a link) of this user's that only this user may write, in such a folder
  (`trusted_entry`), and be an answer the translation could give for THIS config (`admissible`): it only ADDS
  keys, at the top level or in one of the config's sub-configs, named as identifiers; the one value it may
  change is a sub-config's ``tie_word_embeddings`` (a boolean: rule 3); values are JSON numbers, booleans,
  null, short plain words (a rope type), lists of those, or such mappings (a rope dict); never ``auto_map`` or
  another code-reference key (`CODE_KEYS`), never a dotted or path-like string (a class or module
  reference); and ``updates`` is exactly the changes laid over the config. Anything else is ignored,
  recomputed and written again; an answer the check would refuse is not kept.
- Where: ``$STEPMERGE_CACHE_DIR/hub_config/`` (default ``$XDG_CACHE_HOME/stepmerge``, else
  ``~/.cache/stepmerge``); ``STEPMERGE_CACHE_DIR=`` (empty) turns it off. One small file (a few KB) per
  distinct config and transformers version, written to a temporary name and renamed in place; a folder
  that cannot be written (read-only home) only costs the computation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from merge_engine.plan import hub_config as rules
from merge_engine.plan.hub_config import TIE_FLAG, ConfigChange, HubConfig

CACHE_ENV = "STEPMERGE_CACHE_DIR"
ENTRY_FORMAT = 2
# keys that make transformers load or name code: never written from a cached answer
CODE_KEYS = frozenset({"auto_map", "custom_pipelines", "trust_remote_code", "architectures", "model_type",
                       "transformers_version"})
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_WORD = re.compile(r"^[A-Za-z0-9_-]{0,64}$")  # a rope type ("default", "yarn", "llama3"): no dot, no slash


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
    key = memo_key(config)
    entry = folder / f"{key}.json" if folder is not None else None
    if entry is not None:
        kept = _read(entry, key, config)
        if kept is not None:
            return kept
    answer = rules.hub_config(config)
    if entry is not None:
        _write(entry, key, config, answer)
    return answer


def trusted_entry(entry: Path) -> bool:
    """Is ``entry`` a regular file (not a link) owned by this user, in a folder owned by this user, neither of
    them writable by the group or others? (A memo another user can write is not this user's answer.)"""
    try:
        for path, kind in ((entry, stat.S_ISREG), (entry.parent, stat.S_ISDIR)):
            info = os.lstat(path)
            if not kind(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
    except OSError:
        return False
    return True


def _plain_value(value: Any, depth: int = 0) -> bool:
    """A value the translation writes: a number, boolean, null, plain word, or a list / mapping of those."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return bool(_WORD.match(value))
    if depth < 3 and isinstance(value, list):
        return len(value) <= 64 and all(_plain_value(item, depth + 1) for item in value)
    if depth < 3 and isinstance(value, dict):
        return len(value) <= 64 and all(isinstance(k, str) and _NAME.match(k) and k not in CODE_KEYS
                                        and _plain_value(v, depth + 1) for k, v in value.items())
    return False


def admissible(config: Mapping[str, Any], answer: HubConfig) -> bool:
    """Could the translation give ``answer`` for ``config``? (The rule: module docstring.)"""
    if answer.unread is not None:
        return not answer.changes and not answer.updates
    result = json.loads(json.dumps(dict(config), default=str))
    for change in answer.changes:
        parts = change.key.split(".")
        if len(parts) > 2 or not all(_NAME.match(part) and part not in CODE_KEYS for part in parts):
            return False
        if not _plain_value(change.value) or not isinstance(change.source, str):
            return False
        scope = result
        if len(parts) == 2:
            scope = result.get(parts[0])
            if not isinstance(scope, dict):
                return False  # a sub-config the config holds, nothing else
        if parts[-1] in scope and not (len(parts) == 2 and parts[-1] == TIE_FLAG and isinstance(change.value, bool)):
            return False  # a value the config has is never changed (but a sub-config's tie flag: rule 3)
        scope[parts[-1]] = change.value
    tops = {change.key.split(".")[0] for change in answer.changes}
    return answer.updates == {top: result[top] for top in tops}


def _to_json(key: str, answer: HubConfig) -> dict[str, Any]:
    return {"format": ENTRY_FORMAT, "key": key, "updates": answer.updates, "unread": answer.unread,
            "changes": [change.to_json() for change in answer.changes]}


def _from_json(data: Any, key: str, config: Mapping[str, Any]) -> HubConfig | None:
    if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT or data.get("key") != key:
        return None
    try:
        changes = tuple(ConfigChange(c["key"], c["value"], c["from"]) for c in data["changes"])
        updates, unread = data["updates"], data["unread"]
    except (KeyError, TypeError):
        return None
    if not isinstance(updates, dict) or not (unread is None or isinstance(unread, str)):
        return None
    answer = HubConfig(updates, changes, unread)
    return answer if all(isinstance(c.key, str) for c in changes) and admissible(config, answer) else None


def _read(entry: Path, key: str, config: Mapping[str, Any]) -> HubConfig | None:
    if not trusted_entry(entry):
        return None
    try:
        return _from_json(json.loads(entry.read_text()), key, config)
    except (OSError, ValueError, RecursionError):
        return None


def _write(entry: Path, key: str, config: Mapping[str, Any], answer: HubConfig) -> None:
    text = json.dumps(_to_json(key, answer), sort_keys=True)
    if _from_json(json.loads(text), key, config) != answer:
        return  # a value JSON would not give back as it is (a tuple, a NaN), or one the check refuses: not kept
    write_entry(entry, text)
