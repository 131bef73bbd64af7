"""The non-weight files of a Hugging Face model folder: config, generation config, tokenizer.

`read_config` parses ``config.json`` (a `InvalidConfig` naming the file if it cannot);
`tie_word_embeddings` reads its tie flag (the model class default when the key is absent;
`stated_tie_word_embeddings`: only what the file states);
`copy_metadata` copies every metadata file of a folder (tokenizer files, chat templates,
generation config, custom code...) to a target, writing ``config.json`` with the merge's updates;
only regular files inside the folder, of bounded size, are copied (`merge_engine.storage.source_files`:
anything else raises `UnsafeFile`).
Weight files are never copied from here: the writer produces those.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from merge_engine import storage
from merge_engine.errors import InvalidConfig, UnsafeFile
from merge_engine.formats.dcp_file_names import DATA_SUFFIX, METADATA_FILE
from merge_engine.storage import FileEntry
from merge_engine.storage.json_text import parse_json
from merge_engine.storage.source_files import check_metadata_file, file_name_fault
from merge_engine.storage.urls import is_machine_path

logger = logging.getLogger(__name__)
SHOWN_NAME_CHARS = 80

CONFIG_FILE = "config.json"
MODEL_CARD = "README.md"  # the source model's card: not the output's (a release writes its own)
SINGLE_FILE = "model.safetensors"  # the weights of an unsharded model
INDEX_FILE = "model.safetensors.index.json"  # tensor -> shard file of a sharded model
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")
WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(WEIGHT_INDEXES)


def is_dcp_file(name: str) -> bool:
    """torch DCP's index (``.metadata``) or a rank's data file (``*.distcp``): the checkpoint itself, never metadata
    to copy, when a DCP save has its config beside it in one folder."""
    return name == METADATA_FILE or name.endswith(DATA_SUFFIX)


def read_config(hf_dir: str | None, *, what: str = "checkpoint") -> dict[str, Any]:
    """``config.json`` of ``hf_dir`` as a dict; `InvalidConfig` if missing, unparsable or not an object."""
    if hf_dir is None:
        raise InvalidConfig(f"the {what} has no huggingface/ folder with config.json; pass --hf-model-path")
    url = storage.join(hf_dir, CONFIG_FILE)
    try:
        if storage.is_local(url):  # a link out of the folder or a device is never read (source_files)
            check_metadata_file(url, hf_dir, storage.size(url))
        data = storage.read_bytes(url)
    except FileNotFoundError:
        raise InvalidConfig("config.json missing", url) from None
    config = parse_json(data, url, error=InvalidConfig)
    if not isinstance(config, dict) or not config.get("model_type") and not config.get("architectures"):
        raise InvalidConfig("config.json names neither model_type nor architectures", url)
    return config


def stated_tie_word_embeddings(config: Mapping[str, Any]) -> bool | None:
    """The tie flag config.json states (top level, else ``text_config``); None where it states none."""
    for scope in (config, config.get("text_config") or {}):
        if isinstance(scope, Mapping) and "tie_word_embeddings" in scope:
            return bool(scope["tie_word_embeddings"])
    return None


def tie_word_embeddings(config: Mapping[str, Any]) -> bool:
    """The config's tie flag, with the model class default when the key is absent; `InvalidConfig` when the
    class has no such attribute either (`merge_engine.plan.output_heads.embeddings_tied` asks the model first)."""
    stated = stated_tie_word_embeddings(config)
    if stated is not None:
        return stated
    from transformers import AutoConfig  # slow import: only when the config leaves it implicit

    try:
        return bool(AutoConfig.for_model(**dict(config)).tie_word_embeddings)
    except Exception as exc:
        raise InvalidConfig(f"cannot tell whether embeddings are tied ({exc})") from exc


def shown_name(name: str) -> str:
    """``name`` as one bounded, plain-ASCII line (control, format and non-ASCII characters escaped)."""
    text = ascii(name)
    return text if len(text) <= SHOWN_NAME_CHARS else f"{text[:SHOWN_NAME_CHARS]}... ({len(name)} characters)"


def copy_metadata(hf_dir: str, target_url: str, config: Mapping[str, Any],
                  updates: Mapping[str, Any] | None = None,
                  files: Sequence[FileEntry] | None = None) -> list[tuple[str, int]]:
    """Copy metadata files (top level of ``hf_dir``, weights and DCP files not; ``files``: that level as already
    listed) and write the updated config (without a ``_name_or_path`` that is a path of a machine: a Hub id is
    kept); returns (name, size). A file whose name `file_name_fault` refuses is not copied (one warning naming it,
    cut to one bounded line)."""
    written = []
    for entry in storage.list_files(hf_dir, recursive=False) if files is None else files:
        if entry.path in (CONFIG_FILE, MODEL_CARD) or is_weight_file(entry.path) or is_dcp_file(entry.path):
            continue
        fault = file_name_fault(entry.path)
        if fault is not None:
            logger.warning("not copied: the file name %s %s", shown_name(entry.path), fault)
            continue
        source, dest = storage.join(hf_dir, entry.path), storage.join(target_url, entry.path)
        check_metadata_file(source, hf_dir, entry.size)  # no link out, no device, bounded (source_files)
        storage.copy_file(source, dest)
        if storage.size(dest) != entry.size:
            raise UnsafeFile(f"changed while being copied: listed {entry.size} bytes", source)
        written.append((entry.path, entry.size))
    merged = dict(config)
    merged.update(updates or {})
    if "torch_dtype" in merged and "dtype" in (updates or {}):
        merged["torch_dtype"] = merged["dtype"]
    if isinstance(merged.get("_name_or_path"), str) and is_machine_path(merged["_name_or_path"]):
        del merged["_name_or_path"]  # the trainer's folder: no name that resolves where the output is copied
    data = (json.dumps(merged, indent=2, sort_keys=True) + "\n").encode()
    storage.write_bytes(storage.join(target_url, CONFIG_FILE), data)
    written.append((CONFIG_FILE, len(data)))
    return written
