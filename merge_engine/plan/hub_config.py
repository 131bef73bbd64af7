"""The ``config.json`` of a Hub folder: the stored config plus the keys transformers 4.x readers need.

transformers 5 writes rope settings, expert counts and a nested text config's tie flag in a spelling 4.x
readers misread (another model, silently); the Hub holds the 4.x spelling. Why, and each rule's
derivation in full: docs/hub_format.md.

Contract:
- `hub_config(config)` -> `HubConfig`: the 4.x keys ADDED beside what ``config`` holds, each a
  `ConfigChange` (dotted key, value, the transformers code it was derived from); ``updates`` holds
  the changed top-level keys (a nested config whole), to lay over ``config``. Nothing is removed, so
  a 5.x reader sees its own keys.
- Read-alike: transformers 5 must read the result exactly as it read ``config`` (both built, every value
  of the first ``to_dict()`` equal in the second), else `InvalidConfig` (``--weights-format
  transformers`` writes the stored config).
- Every rule is read from transformers' own classes, per config and sub-config, never from a list of
  families: (1) ``attribute_map`` aliases the class also declares as fields; (2) the legacy rope keys,
  learnt by probing the class's ``convert_rope_params_to_dict`` (`rope_spelling`), ``rope_scaling``
  written ``null`` for the default rope; (3) the top-level ``tie_word_embeddings`` copied into a
  nested text config (the one rule stated here, not in a transformers class).
- Under a transformers 4.x, rule 2 comes from the 4.x class itself (`legacy_rope_spelling`), and each
  change's ``source`` names that version.
- A config transformers cannot build (a model type it does not know, remote code) is returned as it
  is, with no change; ``unread`` says why (and the plan's note).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from merge_engine.errors import InvalidConfig

TIE_FLAG = "tie_word_embeddings"
ROPE_PARAMETERS = "rope_parameters"
ROPE_METHOD = "convert_rope_params_to_dict"


@dataclass(frozen=True)
class ConfigChange:
    """One key written for 4.x readers: ``key`` dotted (``text_config.rope_scaling``), its value, and
    the transformers code that says so (``source``)."""

    key: str
    value: Any
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "from": self.source}


@dataclass(frozen=True)
class HubConfig:
    """The translation of one config: ``updates`` (top-level key -> value) laid over the config give
    the Hub form; ``changes`` says what each added or changed key is."""

    updates: dict[str, Any] = field(default_factory=dict)
    changes: tuple[ConfigChange, ...] = ()
    unread: str | None = None  # why transformers could not build the config (then nothing is added)

    def describe(self) -> str:
        if self.unread:
            return f"config.json: written as stored ({self.unread})"
        if not self.changes:
            return "config.json: already in the Hub form (nothing to add for transformers 4.x readers)"
        return "config.json: keys added for transformers 4.x readers: " + ", ".join(c.key for c in self.changes)


def _installed_version() -> str:
    import transformers

    return transformers.__version__


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep, JSON-clean copy (transformers' config classes mutate the dicts they are given)."""
    return json.loads(json.dumps(dict(config), default=str))


def _build(config: Mapping[str, Any]):
    """``config`` as transformers 5's config object; a str saying why when transformers cannot build it
    (no model type, a type it does not know: remote code, a value its class refuses)."""
    import transformers
    from transformers import AutoConfig

    data = _plain(config)
    model_type = data.pop("model_type", None)
    if not model_type:
        return "no model_type"
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # noqa: BLE001 - any refusal: the stored config is kept, and the note says why
        return f"transformers {transformers.__version__} cannot build a {model_type!r} config: {exc}"[:300]


def _fields(cls: type[Any]) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters)


def _alias_changes(cfg: Any, scope: dict[str, Any], prefix: str) -> Iterator[ConfigChange]:
    cls = type(cfg)
    fields = _fields(cls)
    for alias, target in getattr(cls, "attribute_map", {}).items():
        if alias in fields and target in scope and scope.get(alias) != scope[target]:
            yield ConfigChange(prefix + alias, scope[target],
                               f"{cls.__name__}.attribute_map: the field {alias!r} is saved as {target!r}")


def _code_strings(code: Any) -> Iterator[str]:
    for const in code.co_consts:
        if isinstance(const, str) and const.isidentifier():
            yield const
        elif inspect.iscode(const):
            yield from _code_strings(const)


def _rope_candidates(cls: type) -> list[str]:
    """Keys the class's rope standardisation may read: the string constants of every
    ``convert_rope_params_to_dict`` in its MRO (an override names its family's legacy keys)."""
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        method = klass.__dict__.get(ROPE_METHOD)
        if method is not None:
            names.update(dict.fromkeys(_code_strings(method.__code__)))
    names.pop(ROPE_PARAMETERS, None)
    return list(names)


_PROBE = "__stepmerge_probe__"


def _probe_rope(cfg: Any, key: str, value: Any) -> dict[str, Any] | None:
    """``rope_parameters`` after the class's standardisation saw only ``key=value``; None if it failed."""
    return _standardised(cfg, {key: value})


def _standardised(cfg: Any, legacy: Mapping[str, Any]) -> dict[str, Any] | None:
    """``rope_parameters`` after the class's standardisation saw only the ``legacy`` keys; None if it failed."""
    probe = copy.deepcopy(cfg)
    try:
        object.__setattr__(probe, ROPE_PARAMETERS, None)
        for name in ("rope_theta", "partial_rotary_factor"):  # the 5.x object keeps no legacy attributes,
            if name in vars(probe):                          # but a remote class might
                object.__delattr__(probe, name)
        getattr(probe, ROPE_METHOD)(**copy.deepcopy(dict(legacy)))
    except Exception:  # noqa: BLE001 - a key the method cannot take is not one of its legacy keys
        return None
    result = getattr(probe, ROPE_PARAMETERS, None)
    return result if isinstance(result, dict) else None


@dataclass(frozen=True)
class RopeSpelling:
    """How a config class reads pre-5 rope settings: legacy key -> ``rope_parameters`` entry, and the
    key whose dict becomes ``rope_parameters`` (``rope_scaling``)."""

    keys: dict[str, str]
    carrier: str | None


def rope_spelling(cfg: Any) -> RopeSpelling:
    """Found by running the class's own ``convert_rope_params_to_dict`` (see the module docstring)."""
    keys: dict[str, str] = {}
    carrier = None
    logger = logging.getLogger("transformers.modeling_rope_utils")
    previous = logger.level
    logger.setLevel(logging.ERROR)  # a probe with one key makes the standardisation warn
    try:
        for i, name in enumerate(_rope_candidates(type(cfg))):
            marker = 7919.0 + i / 64  # distinct from any default
            found = _probe_rope(cfg, name, marker)
            hits = [k for k, v in (found or {}).items() if isinstance(v, float) and v == marker]
            if len(hits) == 1:
                keys[name] = hits[0]
                continue
            found = _probe_rope(cfg, name, {"rope_type": "default", _PROBE: marker})
            if found is not None and found.get(_PROBE) == marker:
                carrier = name
    finally:
        logger.setLevel(previous)
    return RopeSpelling(keys, carrier)


def _is_default_rope(rest: Mapping[str, Any], default_type: str) -> bool:
    return set(rest) <= {"rope_type"} and rest.get("rope_type", default_type) == default_type


def _nested_rope_keys(cfg: Any, params: Mapping[str, Any]) -> list[str]:
    """The keys ``rope_parameters`` is nested under (one dict per layer type), [] for a flat dict: the config's
    own ``nested_rope_parameter_keys`` where this transformers has it (5.18+), else its rule applied here
    (an entry named as one of the config's rope labels or layer types is a nested one)."""
    method = getattr(cfg, "nested_rope_parameter_keys", None)
    if callable(method):
        return list(method(params))
    labels = getattr(cfg, "_rope_type_labels", None) or getattr(cfg, "layer_types", None) or ()
    return [key for key in params if key in labels]


def legacy_rope_spelling(cfg: Any, params: Mapping[str, Any]) -> RopeSpelling:
    """How a transformers 4.x config class (no ``convert_rope_params_to_dict``) reads the rope settings: each
    ``rope_parameters`` entry its constructor takes under the same name (``rope_theta``,
    ``partial_rotary_factor``), and ``rope_scaling`` for the rest when it takes one."""
    fields = _fields(type(cfg))
    keys = {entry: entry for entry in params if entry != "rope_type" and entry in fields}
    return RopeSpelling(keys, "rope_scaling" if "rope_scaling" in fields else None)


def _rope_changes(cfg: Any, scope: dict[str, Any], prefix: str) -> Iterator[ConfigChange]:
    params = scope.get(ROPE_PARAMETERS)
    if not isinstance(params, dict) or not params:
        return
    nested = _nested_rope_keys(cfg, params)
    if nested:
        if hasattr(cfg, ROPE_METHOD):
            yield from _nested_rope_changes(cfg, scope, prefix, params, nested)
        return
    if hasattr(cfg, ROPE_METHOD):
        spelling = rope_spelling(cfg)
        source = f"{type(cfg).__name__}.{ROPE_METHOD}"
    else:  # the installed transformers is a 4.x: its own class says which keys it reads
        spelling = legacy_rope_spelling(cfg, params)
        source = f"transformers {_installed_version()} {type(cfg).__name__}.__init__ (no {ROPE_METHOD})"
        scope = {}  # its in-memory values are its own defaults, not the stored ones: compared with the stored config
    used = set()
    for legacy, entry in spelling.keys.items():
        if entry in params:
            used.add(entry)
            if scope.get(legacy, _PROBE) != params[entry]:
                yield ConfigChange(prefix + legacy, params[entry], f"{source}: {legacy} -> rope_parameters[{entry!r}]")
    if spelling.carrier is not None:
        rest = {k: v for k, v in params.items() if k not in used}
        value = None if _is_default_rope(rest, getattr(cfg, "default_rope_type", "default")) else rest
        if scope.get(spelling.carrier, _PROBE) != value:
            yield ConfigChange(prefix + spelling.carrier, value,
                               f"{source}: {spelling.carrier} -> rope_parameters (the rest of it)")


def _nested_rope_changes(cfg: Any, scope: dict[str, Any], prefix: str, params: Mapping[str, Any],
                         nested: list[str]) -> Iterator[ConfigChange]:
    """Rope parameters per layer type: the legacy keys from which the class's own standardisation makes exactly
    ``params`` again (OLMo-3: one ``rope_theta`` for both layer types, ``rope_scaling`` for full attention),
    learnt by probing it as `rope_spelling` does; none when no set of them gives ``params`` back."""
    legacy: dict[str, Any] = {}
    fed: dict[str, set[str]] = {}  # layer type -> its entries a scalar legacy key sets
    carrier = None
    logger = logging.getLogger("transformers.modeling_rope_utils")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        for i, name in enumerate(_rope_candidates(type(cfg))):
            marker = 7919.0 + i / 64
            found = _probe_rope(cfg, name, marker) or {}
            hits = [(kind, entry) for kind in nested if isinstance(found.get(kind), dict)
                    for entry, value in found[kind].items() if isinstance(value, float) and value == marker]
            if hits:
                values = [params.get(kind, {}).get(entry, _PROBE) for kind, entry in hits]
                if all(v is not _PROBE and v == values[0] for v in values):
                    legacy[name] = values[0]
                    for kind, entry in hits:
                        fed.setdefault(kind, set()).add(entry)
                continue
            found = _probe_rope(cfg, name, {"rope_type": "default", _PROBE: marker}) or {}
            carried = [kind for kind in nested if isinstance(found.get(kind), dict) and found[kind].get(_PROBE) == marker]
            if len(carried) == 1:
                carrier = (name, carried[0])
        if carrier is not None:
            name, kind = carrier
            rest = {k: v for k, v in params.get(kind, {}).items() if k not in fed.get(kind, set())}
            legacy[name] = None if _is_default_rope(rest, getattr(cfg, "default_rope_type", "default")) else rest
        back = _standardised(cfg, legacy) if legacy else None
    finally:
        logger.setLevel(previous)
    if back is None or json.dumps(back, sort_keys=True) != json.dumps(dict(params), sort_keys=True):
        return  # no 4.x spelling gives this per-layer-type rope back
    source = f"{type(cfg).__name__}.{ROPE_METHOD} (per layer type; read back equal)"
    for key, value in legacy.items():
        if scope.get(key, _PROBE) != value:
            yield ConfigChange(prefix + key, value, f"{source}: {key}")


def _text_config_key(cfg: Any) -> str | None:
    """The sub-config key of the decoder's text config, or None when the config is its own."""
    try:
        text = cfg.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - ambiguous text configs: no rule applies
        return None
    if text is cfg:
        return None
    return next((key for key in getattr(type(cfg), "sub_configs", {}) if getattr(cfg, key, None) is text), None)


def _scope_changes(cfg: Any, scope: dict[str, Any], prefix: str) -> list[ConfigChange]:
    return list(_alias_changes(cfg, scope, prefix)) + list(_rope_changes(cfg, scope, prefix))


def _apply(config: dict[str, Any], change: ConfigChange) -> None:
    *path, last = change.key.split(".")
    scope = config
    for part in path:
        scope = scope[part]
    scope[last] = copy.deepcopy(change.value)


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _check_read_alike(before: Any, config: dict[str, Any], mirrored: set[str]) -> None:
    """`InvalidConfig` unless transformers 5 reads ``config`` as it read the original (``before``)."""
    after = _build(config)
    if isinstance(after, str):
        raise InvalidConfig("transformers 5 cannot read the Hub form of config.json; "
                            "pass --weights-format transformers")
    old, new = dict(_flatten(before.to_dict())), dict(_flatten(after.to_dict()))
    for key, value in old.items():
        if key == "transformers_version" or key in mirrored:
            continue
        if key not in new or not _same(new[key], value):
            raise InvalidConfig(f"the Hub form of config.json would change what transformers 5 reads: {key} "
                                f"{value!r} -> {new.get(key)!r}; pass --weights-format transformers")


def hub_config(config: Mapping[str, Any]) -> HubConfig:
    """``config`` in the Hub form: see the module docstring."""
    cfg = _build(config)
    if isinstance(cfg, str):
        return HubConfig(unread=cfg)
    stored = _plain(config)
    memory = cfg.to_dict()  # what transformers 5 holds: every value is read from here
    changes = _scope_changes(cfg, {**memory, **{k: v for k, v in stored.items() if k not in memory}}, "")
    mirrored: set[str] = set()
    for key in getattr(type(cfg), "sub_configs", {}):
        sub, sub_memory = getattr(cfg, key, None), memory.get(key)
        if sub is None or not isinstance(sub_memory, dict) or not isinstance(stored.get(key), dict):
            continue
        changes += _scope_changes(sub, {**sub_memory, **{k: v for k, v in stored[key].items() if k not in sub_memory}},
                                  key + ".")
    text_key = _text_config_key(cfg)
    if text_key is not None and isinstance(stored.get(text_key), dict) and TIE_FLAG in memory:
        if stored[text_key].get(TIE_FLAG) != memory[TIE_FLAG]:
            changes.append(ConfigChange(f"{text_key}.{TIE_FLAG}", memory[TIE_FLAG],
                                        f"{type(cfg).__name__}.get_text_config(decoder=True): transformers 4.x "
                                        "ties the embeddings by the text config's flag"))
            mirrored.add(f"{text_key}.{TIE_FLAG}")
    # a change whose stored value is already the one written is no change
    changes = [c for c in changes if _lookup(stored, c.key) != c.value]
    if not changes:
        return HubConfig()
    result = copy.deepcopy(stored)
    for change in changes:
        _apply(result, change)
    if not hasattr(cfg, ROPE_METHOD):  # a 4.x reads the added keys (that is their point): the rest must be read alike
        mirrored |= {change.key for change in changes}
    _check_read_alike(cfg, result, mirrored)
    top = {change.key.split(".")[0] for change in changes}
    return HubConfig({key: result[key] for key in sorted(top)}, tuple(changes))


_MISSING = object()


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    scope: Any = config
    for part in dotted.split("."):
        if not isinstance(scope, Mapping) or part not in scope:
            return _MISSING
        scope = scope[part]
    return scope
