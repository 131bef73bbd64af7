"""Whether ``config.json`` agrees with the tensors of a plan, checked before anything is written.

The merge copies ``config.json`` next to weights it did not derive from it: a config that
contradicts them (``"vocab_size": 10**12`` beside a 1003-row embedding, 40 layers where 2 were
saved) gives a folder that loads with an error, or worse, with freshly initialised tensors. The
command catches that from metadata, asking transformers' own model of the config for every tensor's
shape (`merge_engine.plan.model_shapes`: built on the meta device, kept per config on disk), under its
in-memory names and the Hub's:

- a tensor the model holds under the same name with another shape is a contradiction naming it;
- a tensor of an indexed family the weights hold (``model.layers.N.…``, ``…experts.N.…``) that the config's
  model lacks, or the reverse (layers the config implies and the weights lack), is one too, reported per
  family with the indices on each side (``num_nextn_predict_layers`` multi-token-prediction layers after
  the decoder's are allowed, as DeepSeek's Hub checkpoints hold them);
- every other name (a critic head of another class, an extra buffer, custom code) is left to validation.

Where transformers cannot answer (no class for the config, or a model it cannot build: ``"hidden_size":
10**12`` overflows even a meta tensor), a width field (``vocab_size``, ``hidden_size``,
``intermediate_size``, ``head_dim``) larger than every dimension of every tensor is still a contradiction:
such a width is no tensor's, so the config describes other weights.

Sizes of the wrong type (``"vocab_size": "1003"``, negatives) are refused before transformers is asked, and a
config transformers' config class refuses is refused with its reason. Every contradiction raises
`InvalidConfig` naming the config file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from merge_engine.errors import InvalidConfig

_INTEGER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "num_hidden_layers")
_WIDTH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "head_dim")
_INDEX = re.compile(r"\.([0-9]+)(?=\.|$)")


def check_sizes(config: Mapping[str, Any], config_url: str | None = None) -> None:
    """`InvalidConfig` when a size field of ``config`` (or of a nested config) is not a positive integer."""
    for scope, where in _scopes(config):
        for name in _INTEGER_FIELDS:
            value = scope.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfig(f"{where}{name} is {value!r}, not a positive integer", config_url)


def _scopes(config: Mapping[str, Any]) -> Iterable[tuple[Mapping[str, Any], str]]:
    yield config, ""
    for key, value in config.items():
        if isinstance(value, Mapping) and key.endswith("_config"):
            yield value, f"{key}."


def config_contradictions(config: Mapping[str, Any], shapes: Iterable[tuple[str, tuple[int, ...]]],
                          config_url: str | None = None,
                          expected: Mapping[str, list[tuple[int, ...]]] | None = None) -> list[str]:
    """Each way the tensors ``(name, shape)`` contradict ``config`` (empty: none found). ``expected``:
    the model's shapes when the caller has them (default: `merge_engine.plan.model_shapes.model_shapes`)."""
    check_sizes(config, config_url)
    stored = {name: tuple(shape) for name, shape in shapes}
    if expected is None:
        from merge_engine.plan.model_shapes import model_shapes

        expected = model_shapes(config)
    if not expected:
        return width_contradictions(config, stored)
    problems = []
    for name, shape in stored.items():
        known = expected.get(name)
        if known is not None and shape not in known:
            implied = " or ".join(str(list(s)) for s in known)
            problems.append(f"{name} is {list(shape)} but the config implies {implied}")
    extra_decoder = _mtp_layers(config)
    stored_families = _families(stored)
    expected_families = _families(expected)
    for family in sorted(stored_families.keys() & expected_families.keys()):
        have, want = stored_families[family], expected_families[family]
        surplus = {i for i in have - want if not (family.startswith(("layers.", "model.layers.")) and
                                                  _is_mtp(family, i, extra_decoder))}
        lacking = want - have
        if surplus or lacking:
            problems.append(f"the weights hold {_family_span(family, have)}, the config implies "
                            f"{_family_span(family, want)}{_layer_count(config)}")
    return problems


def width_contradictions(config: Mapping[str, Any], stored: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Each width field of ``config`` (or a nested config) larger than every dimension of the tensors ``stored``
    (name -> shape); none when there are no tensors."""
    widest = max((max(shape, default=0) for shape in stored.values()), default=0)
    if not widest:
        return []
    problems = []
    for scope, where in _scopes(config):
        for name in _WIDTH_FIELDS:
            value = scope.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > widest:
                problems.append(f"{where}{name} is {value} but no tensor has a dimension over {widest}")
    return problems


def _families(names: Iterable[str]) -> dict[str, set[tuple[int, ...]]]:
    """Indexed names by family, the name up to its first index: ``model.layers.3.mlp.up_proj.weight`` is of
    ``model.layers.*``, index (3,). One family spans all its members (a layer's every tensor)."""
    families: dict[str, set[tuple[int, ...]]] = {}
    for name in names:
        match = _INDEX.search(name)
        if match is None:
            continue
        prefix = name[:match.start()]
        families.setdefault(prefix + ".*", set()).add((int(match.group(1)),))
    return families


def _family_span(family: str, indices: set[tuple[int, ...]]) -> str:
    ordered = sorted(i[0] for i in indices)
    if not ordered:
        return f"no {family}"
    span = f"{ordered[0]}..{ordered[-1]}" if ordered == list(range(ordered[0], ordered[-1] + 1)) else \
        ",".join(map(str, ordered))
    return f"{family[:-1]}{{{span}}} ({len(ordered)})"


def _layer_count(config: Mapping[str, Any]) -> str:
    for scope, where in _scopes(config):
        if isinstance(scope.get("num_hidden_layers"), int):
            return f" ({where}num_hidden_layers={scope['num_hidden_layers']})"
    return ""


def _mtp_layers(config: Mapping[str, Any]) -> tuple[int, int]:
    """(first, end) of the decoder-layer indices DeepSeek's multi-token-prediction layers take."""
    count, nextn = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
    if not isinstance(count, int) or isinstance(nextn, bool) or not isinstance(nextn, int) or nextn <= 0:
        return (0, 0)
    return (count, count + nextn)


def _is_mtp(family: str, index: tuple[int, ...], extra: tuple[int, int]) -> bool:
    return family in ("layers.*", "model.layers.*") and extra[0] <= index[0] < extra[1]


def check_config_against_tensors(config: Mapping[str, Any], shapes: Iterable[tuple[str, tuple[int, ...]]],
                                  config_url: str | None = None) -> None:
    """`InvalidConfig` naming ``config_url`` when `config_contradictions` finds any."""
    try:
        problems = config_contradictions(config, shapes, config_url)
    except InvalidConfig as refused:
        if refused.path is None:
            raise InvalidConfig(f"config.json: {refused.message}", config_url) from None
        raise
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InvalidConfig("config.json contradicts the weights: " + "; ".join(problems[:3]) + more, config_url)
