"""What the stage tasks and flows keep in Prefect's result storage: JSON of an exact table of records, never a pickle.

Prefect writes each persisted result as a record naming its serializer, and reads it back with whatever
serializer the RECORD names (pickle by default, and any importable ``picklelib``; its JSON serializer imports
the class a record names). Whoever can write to the result store could then choose the code a worker runs.
Here:
- `RecordSerializer` (type ``stepmerge-records``) writes ``{"format", "type", "data"}``: ``type`` is a name of
  `RESULT_TYPES` (the records the tasks return, those flows add with `register_result_type`, None, plain
  strings and numbers, errors), ``data`` plain JSON. Reading
  looks the name up in that table and builds the record with its own constructor (pydantic validation of
  its declared fields); no name read from the bytes is imported or called. An unknown type, a field of the
  wrong kind or a record over `MAX_RESULT_BYTES` is `UnsafeRecord`.
- `checked_record(data, path)` is the guard a result storage block applies to every record it reads
  (`tasks.results`): a record that does not name this serializer is `UnsafeRecord` naming ``path`` before
  Prefect sees it, so no forged record reaches Prefect's pickle.
A failed run's error is kept as its class name, message and path: read back, a name of `merge_engine.errors`
is that error again, any other is `RemoteError` with the name in its message.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Final, Literal

from prefect.serializers import Serializer
from pydantic import Field, TypeAdapter, ValidationError

from merge_engine import errors
from merge_engine.errors import StepmergeError, UnsafeRecord
from merge_engine.storage.json_text import parse_json

SERIALIZER_TYPE: Final = "stepmerge-records"
RESULT_FORMAT = 1
logger = logging.getLogger(__name__)
MAX_RESULT_BYTES = 64 << 20  # a record is URLs, counts and listings


class RemoteError(Exception):
    """An error a task or flow raised elsewhere whose class is not one of `merge_engine.errors`."""


# the named errors a stored failure may come back as: every error class of merge_engine.errors, by its name
ERRORS: dict[str, type[Exception]] = {
    name: value for name, value in vars(errors).items()
    if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__}


def _checkpoint_record() -> tuple[type, Callable[[Any], Any], Callable[[Any], Any]]:
    """A check's record WITHOUT its tensor index, either way: an index read back from the store could map a
    tensor's name to another tensor's bytes (valid files, shapes and views: right-looking, wrong weights), and
    nothing in the record can prove it was not forged. A record read back has no index (any stored one is
    dropped); whoever opens its checkpoint reads the headers (`merge_engine.layouts.Layout.open`)."""
    from tasks.records import CheckpointRecord

    def load(data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("a checkpoint record is not a JSON object")
        return CheckpointRecord.model_validate({k: v for k, v in data.items() if k != "index"}, strict=False)

    return CheckpointRecord, lambda record: record.model_dump(mode="json"), load


def _adapted(cls_of: Callable[[], type]) -> Callable[[], tuple[type, Callable[[Any], Any], Callable[[Any], Any]]]:
    """A record class (frozen dataclass or pydantic model) dumped and validated by pydantic from its fields."""
    def entry() -> tuple[type, Callable[[Any], Any], Callable[[Any], Any]]:
        cls = cls_of()
        adapter: TypeAdapter[Any] = TypeAdapter(cls)
        return cls, lambda value: adapter.dump_python(value, mode="json"), adapter.validate_python
    return entry


def _built_output() -> type:
    from merge_engine.release.built import BuiltOutput
    return BuiltOutput


def _validation_report() -> type:
    from merge_engine.validate.report import ValidationReport
    return ValidationReport


def _release() -> type:
    from merge_engine.release.publish import Release
    return Release


# name -> (class, dump, load), built on first use (the classes' modules import the engine)
RESULT_TYPES: dict[str, Callable[[], tuple[type, Callable[[Any], Any], Callable[[Any], Any]]]] = {
    "CheckpointRecord": _checkpoint_record,
    "BuiltOutput": _adapted(_built_output),
    "ValidationReport": _adapted(_validation_report),
    "Release": _adapted(_release),
}
SCALARS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}  # plain values, as they are
_TABLE: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = {}


def register_result_type(cls: type) -> type:
    """Add the pydantic model or frozen dataclass ``cls`` to `RESULT_TYPES` under its class name (a flow's own
    result, from the module that defines it: tasks import no flow); returns ``cls`` (a class decorator)."""
    RESULT_TYPES[cls.__name__] = _adapted(lambda: cls)
    return cls


def _entry(name: str) -> tuple[type, Callable[[Any], Any], Callable[[Any], Any]]:
    if name not in _TABLE:
        _TABLE[name] = RESULT_TYPES[name]()
    return _TABLE[name]


def encode(value: Any) -> dict[str, Any]:
    """``value`` as a result document; `TypeError` for a type the table does not hold."""
    if value is None:
        return {"format": RESULT_FORMAT, "type": "None", "data": None}
    if type(value) in SCALARS.values():
        return {"format": RESULT_FORMAT, "type": type(value).__name__, "data": value}
    if isinstance(value, BaseException):
        data = {"class": type(value).__name__, "message": getattr(value, "message", str(value)),
                "path": getattr(value, "path", None)}
        return {"format": RESULT_FORMAT, "type": "error", "data": data}
    for name in RESULT_TYPES:
        cls, dump, _ = _entry(name)
        if type(value) is cls:
            return {"format": RESULT_FORMAT, "type": name, "data": dump(value)}
    raise TypeError(f"{type(value).__qualname__} is not a result record stepmerge stores (tasks.result_records)")


def decode(document: Any, where: str | None) -> Any:
    """The record a result document holds, built by its class's own constructor; `UnsafeRecord` naming
    ``where`` for anything else."""
    if not isinstance(document, dict) or set(document) != {"format", "type", "data"} \
            or document["format"] != RESULT_FORMAT or not isinstance(document["type"], str):
        raise UnsafeRecord("a stored result is not a stepmerge result document", where)
    name, data = document["type"], document["data"]
    if name == "None" and data is None:
        return None
    if name in SCALARS and type(data) is SCALARS[name]:
        return data
    if name == "error":
        return _error(data, where)
    if name not in RESULT_TYPES:
        raise UnsafeRecord(f"a stored result names the type {name[:100]!r}, which is not one stepmerge stores", where)
    try:
        return _entry(name)[2](data)
    except (ValidationError, ValueError, TypeError) as exc:
        raise UnsafeRecord(f"a stored {name} is malformed ({str(exc)[:300]})", where) from None


def _error(data: Any, where: str | None) -> Exception:
    if not isinstance(data, dict) or set(data) != {"class", "message", "path"} or not isinstance(data["class"], str) \
            or not isinstance(data["message"], str) \
            or not isinstance(data.get("path"), (str, type(None))):
        raise UnsafeRecord("a stored error is malformed", where)
    cls = ERRORS.get(data["class"])
    if cls is not None and issubclass(cls, (StepmergeError, errors.StorageUnavailable)):
        return cls(data["message"], data["path"])
    return RemoteError(f"{data['class'][:100]}: {data['message']}")


class RecordSerializer(Serializer):
    """Prefect's serializer for stepmerge's results: JSON of the exact table `RESULT_TYPES` (module docstring)."""

    type: Literal["stepmerge-records"] = Field(default=SERIALIZER_TYPE, frozen=True)

    def dumps(self, obj: Any) -> bytes:
        return json.dumps(encode(obj), separators=(",", ":")).encode()

    def loads(self, blob: bytes) -> Any:
        if len(blob) > MAX_RESULT_BYTES:
            raise UnsafeRecord(f"a stored result of {len(blob)} bytes is over {MAX_RESULT_BYTES}", None)
        return decode(parse_json(blob, None, error=UnsafeRecord), None)


RECORD_SERIALIZER = RecordSerializer()


def checked_record(data: bytes, path: str) -> bytes:
    """``data`` (a result record Prefect wrote: metadata naming its serializer, and the result) when it names
    `RecordSerializer`, else `UnsafeRecord` naming ``path``; the result itself is decoded by the serializer."""
    if len(data) > 2 * MAX_RESULT_BYTES:
        raise UnsafeRecord(f"a result record of {len(data)} bytes is over the bound", path)
    record = parse_json(data, path, error=UnsafeRecord)
    metadata = record.get("metadata") if isinstance(record, dict) else None
    serializer = metadata.get("serializer") if isinstance(metadata, dict) else None
    kind = serializer.get("type") if isinstance(serializer, dict) else None
    if kind != SERIALIZER_TYPE or not isinstance(serializer, dict) or set(serializer) != {"type"}:
        error = UnsafeRecord(f"a result record names the serializer {str(kind)[:100]!r}: only {SERIALIZER_TYPE!r} "
                             "records are read (a pickle from a result store could run any code)", path)
        logger.warning("%s", error)  # Prefect's existence check swallows it: the operator still hears of it
        raise error
    return data
