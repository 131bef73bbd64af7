"""The non-weight files of a Hugging Face model folder: config, generation config, tokenizer.

`read_config` parses ``config.json`` (a `InvalidConfig` naming the file if it cannot);
`tie_word_embeddings` reads its tie flag (the model class default when the key is absent;
`stated_tie_word_embeddings`: only what the file states);
`copy_metadata` copies the metadata files of a folder (tokenizer files, chat templates,
generation config, processor configs, the custom code ``auto_map`` names) to a target, writing ``config.json`` with
the merge's updates; only regular files inside the folder, of bounded size, are copied
(`merge_engine.storage.source_files`: anything else raises `UnsafeFile`).
Never copied from here: weight files (the writer produces those), a DCP save's own files, the trainers' bookkeeping
(`merge_engine.formats.trainer_files`) and any ``.py`` the model's custom code does not name
(`merge_engine.formats.custom_code`: a script beside a checkpoint is a trainer's, not the model's). Each of
those, and a file whose name is refused, is told to the caller in one line (``not copied: <file>, <why>``): a note
of the job, not a fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from merge_engine import storage
from merge_engine.errors import InvalidConfig, UnsafeFile
from merge_engine.formats.custom_code import custom_code_files
from merge_engine.formats.dcp_file_names import DATA_SUFFIX, METADATA_FILE
from merge_engine.formats.trainer_files import trainer_file
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
                  files: Sequence[FileEntry] | None = None, *,
                  on_left_out: Callable[[str], None] | None = None) -> list[tuple[str, int]]:
    """Copy metadata files (top level of ``hf_dir``; ``files``: that level as already listed) and write the updated
    config (without a ``_name_or_path`` that is a path of a machine: a Hub id is kept); returns (name, size).

    Not copied: weights, DCP files, a trainer's bookkeeping (`trainer_files.TRAINER_FILES`: its line names the
    trainer), a ``.py`` that the model's ``auto_map`` does not name (`custom_code.custom_code_files`), a file whose
    name `file_name_fault` refuses. Each of the last three is told in one line, ``not copied: <file>, <why>`` (the
    name cut to one bounded line), to ``on_left_out`` (the job's notes); without it, logged at INFO.

    Raises:
        UnsafeFile: a file to copy (or a config read to find the custom code) is a link out, a device, larger
            than the bound, or changed while copied.
    """
    left_out = on_left_out if on_left_out is not None else logger.info
    entries = []
    for entry in storage.list_files(hf_dir, recursive=False) if files is None else files:
        row = trainer_file(entry.path)
        if row is not None:  # before the weights: training_args.bin, optimizer.pt... are named, not taken for weights
            left_out(f"not copied: {shown_name(entry.path)}, {row.trainer}'s bookkeeping: {row.what}")
        elif entry.path not in (CONFIG_FILE, MODEL_CARD) and not is_weight_file(entry.path) \
                and not is_dcp_file(entry.path):
            entries.append(entry)
    sizes = {e.path: e.size for e in entries}
    code = _custom_code(hf_dir, config, sizes) if any(n.endswith(".py") for n in sizes) else set()
    written = []
    for entry in entries:
        if entry.path.endswith(".py") and entry.path not in code:
            left_out(f"not copied: {shown_name(entry.path)}, Python code the model's auto_map does not name (a script "
                     "beside the checkpoint, not the model's custom code)")
            continue
        fault = file_name_fault(entry.path)
        if fault is not None:
            left_out(f"not copied: the file name {shown_name(entry.path)} {fault}")
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


def _custom_code(hf_dir: str, config: Mapping[str, Any], sizes: Mapping[str, int]) -> set[str]:
    """The ``.py`` files of ``hf_dir`` (listed with ``sizes``) that the model's custom code is
    (`custom_code.custom_code_files`), each file it reads bounded and kept inside the folder first."""

    def read(name: str) -> bytes:
        url = storage.join(hf_dir, name)
        check_metadata_file(url, hf_dir, sizes[name])
        return storage.read_bytes(url)

    def read_json(name: str) -> Mapping[str, Any] | None:
        try:
            parsed = parse_json(read(name), storage.join(hf_dir, name), error=InvalidConfig)
        except InvalidConfig:  # not JSON: it names no module (and is copied as it is)
            return None
        return parsed if isinstance(parsed, dict) else None

    return custom_code_files(config, set(sizes), read_json, lambda name: read(name).decode("utf-8", "replace"))
