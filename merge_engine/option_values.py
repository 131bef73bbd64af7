"""The spellings of option values users type, shared by the command line and the flows' forms.

One list per kind of value, so `stepmerge merge --dtype fp16` and the Prefect form's ``dtype:
fp16`` accept the same words and record the same canonical name (``float16``):

- `Dtype`: the value type of an output dtype, one of `DTYPES` (``bfloat16``, ``float16``, ``float32``): what
  the engine takes. `DTYPE_SPELLINGS`: every accepted spelling -> its `Dtype`; `parse_dtype` reads a
  spelling (the command line's parser, the form's type: the one place a spelling is read) or raises `InvalidOption`.
- `DEFAULT_SHARD_SIZE` / `DEFAULT_MAX_SHARD_SIZE`: the output shard size when none is given (text, bytes).
- `WeightsFormat` / `WEIGHTS_FORMATS`: the names a merged folder's tensors are written under (``--weights-format``,
  the flows' ``weights_format``): ``hub`` (default; `merge_engine.plan.hub_format`) or ``transformers``
  (as stored); `parse_weights_format` checks one.
- `SIZE_PATTERN`: a size such as ``5GB``, ``500MiB``, ``1.5 GB`` or ``1024`` (bytes), as a regular
  expression the Prefect server checks before it creates a run (JSON Schema ``pattern``), and
  `parse_size`, which reads exactly what the pattern admits;
- `whole_number`, `float_list`, `name_list`: the command line's counts and comma lists.
No torch import here: the listings-only watcher and the webhook import the forms.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from merge_engine.errors import InvalidOption, one_line

Dtype = Literal["bfloat16", "float16", "float32"]  # an output dtype, as the engine takes it
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
DTYPE_SPELLINGS: dict[str, Dtype] = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}

WeightsFormat = Literal["hub", "transformers"]  # the names a merged folder's tensors are written under
HUB: WeightsFormat = "hub"
TRANSFORMERS: WeightsFormat = "transformers"
WEIGHTS_FORMATS: tuple[WeightsFormat, ...] = get_args(WeightsFormat)
DEFAULT_WEIGHTS_FORMAT: WeightsFormat = HUB

SIZE_UNITS: dict[str, int] = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
                              "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}
# JSON Schema patterns have no flags: the unit's letters are spelled out in both cases.
SIZE_PATTERN = r"^ *[0-9]+(\.[0-9]+)? *([kKmMgGtT]([iI])?)?[bB]? *$"
_SIZE = re.compile(SIZE_PATTERN)


def parse_dtype(text: str) -> Dtype:
    """``"fp16"`` -> ``"float16"``: any spelling of `DTYPE_SPELLINGS`, in any case, to its `Dtype`. The one reader
    of a dtype spelling: the command line's ``--dtype`` parser and the flows' form type both call it.

    Raises:
        InvalidOption: ``text`` is no spelling of a dtype.
    """
    try:
        return DTYPE_SPELLINGS[str(text).strip().lower()]
    except KeyError:
        raise InvalidOption(f"unknown dtype '{one_line(text)}'; choose one of {', '.join(DTYPE_SPELLINGS)}") from None


def parse_weights_format(name: str | None) -> WeightsFormat:
    """``"Hub"`` -> ``"hub"``; None -> the default (``hub``); `InvalidOption` for any other name."""
    value = (name or DEFAULT_WEIGHTS_FORMAT).lower()
    for known in WEIGHTS_FORMATS:
        if value == known:
            return known
    raise InvalidOption(f"unknown weights format '{one_line(name)}'; choose one of {', '.join(WEIGHTS_FORMATS)}")


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``1024`` -> 1024; `InvalidOption` otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    elif isinstance(text, str) and _SIZE.match(text):
        value = text.strip().upper().replace(" ", "")
        number = value.rstrip("KMGTIB")
        unit = value[len(number):]
        if unit and not unit.endswith("B"):
            unit += "B"  # "5G" reads as 5GB, "5Gi" as 5GiB
        size = int(float(number) * SIZE_UNITS[unit])
    else:
        raise InvalidOption(f"cannot read size '{one_line(text)}' (e.g. 5GB, 500MiB)")
    if size <= 0:
        raise InvalidOption(f"size must be positive: '{one_line(text)}'")
    return size


DEFAULT_SHARD_SIZE = "5GB"  # save_pretrained's historical default, as the option declares it
DEFAULT_MAX_SHARD_SIZE = parse_size(DEFAULT_SHARD_SIZE)


def whole_number(text: str) -> int:
    """``"3"`` -> 3; `InvalidOption` for anything but a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidOption(f"expected a whole number of at least 1, got '{one_line(text)}'")
    return value


def float_list(text: str) -> tuple[float, ...]:
    """``"0.5,0.2"`` -> (0.5, 0.2); `InvalidOption` when one is not a number."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidOption(f"takes comma-separated numbers, got '{one_line(text)}'") from None


def name_list(text: str) -> tuple[str, ...] | None:
    """``"q_proj,v_proj"`` -> ("q_proj", "v_proj"); no name: None."""
    return tuple(t for t in text.split(",") if t) or None
