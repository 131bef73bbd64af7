"""The regular expressions an adapter config hands to PEFT, checked before anything matches them.

PEFT (and `merge_engine.lora.config`, which follows it) runs several fields of ``adapter_config.json`` as
Python regular expressions against every module name of the base: ``target_modules`` and
``exclude_modules`` as strings (``re.fullmatch``), the keys of ``rank_pattern`` / ``alpha_pattern`` inside
``(.*\\.)?(<key>)$``, ``modules_to_save`` entries and ``layers_pattern`` inside similar wrappers. Python's
matcher backtracks, so a pattern such as ``(.*.*)*y`` takes exponential time on a module name: one small
file would hang a merge. Those fields are therefore held to a subset whose matching time is polynomial
and small on module names, which is every pattern PEFT, verl and their users write:

- at most `MAX_PATTERN_CHARS` characters, and a valid Python regular expression;
- a repetition of more than one item (``*``, ``+``, ``{2,}``) repeats a single character matcher
  (``.*``, ``\\d+``, ``[^.]+``), never a group, an alternation or another repetition;
- at most `MAX_OPEN_REPEATS` unbounded repetitions in all (``(.*\\.)?`` of PEFT's wrapper adds one);
- no back-reference and no conditional group (``\\1``, ``(?(1)...)``).

A plain module name (``q_proj``, ``model.layers.0.self_attn.q_proj``), a list of names, ``all-linear``,
``.*\\.(q_proj|v_proj)`` and ``^(?!.*visual).*(q_proj|v_proj)`` all pass. Anything else is an
`AdapterError` naming the field, the pattern (cut to one bounded line) and the adapter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from merge_engine.errors import AdapterError

MAX_PATTERN_CHARS = 2048
MAX_OPEN_REPEATS = 3
SHOWN_CHARS = 80

try:  # the parser behind `re` (Python 3.11+); `sre_parse` before
    from re import _constants as _sre, _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parse

_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)}
_ONE_CHARACTER = {_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.CATEGORY}
_REFERENCES = {_sre.GROUPREF, _sre.GROUPREF_EXISTS}
# string-valued fields PEFT runs as a regex; fields whose list entries it also runs as regexes
_STRING_FIELDS = ("target_modules", "exclude_modules", "layers_pattern")
_LIST_FIELDS = ("modules_to_save", "layers_pattern")
_KEY_FIELDS = ("rank_pattern", "alpha_pattern")


def shown(pattern: str) -> str:
    """``pattern`` as one bounded line: its repr, cut to `SHOWN_CHARS` characters with the full length."""
    text = repr(pattern)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(pattern)} characters)"


def pattern_fault(pattern: str) -> str | None:
    """Why ``pattern`` is outside the matched subset (module docstring); None when it is inside."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"longer than {MAX_PATTERN_CHARS} characters"
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return f"not a valid regular expression ({str(exc)[:SHOWN_CHARS]})"
    open_repeats = 0
    stack: list[Any] = [parsed]
    while stack:
        for op, value in stack.pop():
            if op in _REFERENCES:
                return "a back-reference or conditional group"
            if op in _REPEATS:
                low, high, body = value
                if high > 1 and not (len(body) == 1 and body[0][0] in _ONE_CHARACTER):
                    return "a repetition of a group, an alternation or another repetition (nested repeats)"
                open_repeats += high == _sre.MAXREPEAT
                stack.append(body)
            elif op == _sre.SUBPATTERN:
                stack.append(value[-1])
            elif op == _sre.BRANCH:
                stack.extend(value[1])
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                stack.append(value[1])
            elif op == getattr(_sre, "ATOMIC_GROUP", None):
                stack.append(value)
    if open_repeats > MAX_OPEN_REPEATS:
        return f"more than {MAX_OPEN_REPEATS} unbounded repetitions"
    return None


def check_pattern(field: str, pattern: Any, where: str | None) -> None:
    """`AdapterError` naming ``field``, the pattern and ``where`` when ``pattern`` is not a string inside
    the matched subset (module docstring)."""
    if not isinstance(pattern, str):
        raise AdapterError(f"{field}: {shown(str(pattern))} is not a string", where)
    fault = pattern_fault(pattern)
    if fault is not None:
        raise AdapterError(f"{field} {shown(pattern)} is refused: {fault}; stepmerge matches plain module names "
                           "and regular expressions without nested repeats or back-references", where)


def check_config_patterns(config: Mapping[str, Any], where: str | None) -> None:
    """Check every field of an adapter config that PEFT runs as a regular expression (module docstring);
    `AdapterError` naming ``where`` at the first one refused."""
    for field in _STRING_FIELDS:
        if isinstance(config.get(field), str):
            check_pattern(field, config[field], where)
    for field in _LIST_FIELDS:
        value = config.get(field)
        if isinstance(value, Iterable) and not isinstance(value, (str, Mapping)):
            for entry in value:
                check_pattern(field, entry, where)
    for field in _KEY_FIELDS:
        value = config.get(field)
        if isinstance(value, Mapping):
            for key in value:
                check_pattern(field, key, where)
