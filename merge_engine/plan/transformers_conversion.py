"""transformers' own weight-name conversion, read from the installed transformers, never re-typed.

- `meta_model(config)`: the config's model class on the ``meta`` device (no weights), cached by
  config content; None when transformers has no class for it (unknown or remote-code model type).
- `conversion_known(config)`: whether transformers converts names for this config at all (cheap:
  no model is built).
- `trace_reverse_conversion(model, shapes)`: ``save_pretrained``'s reversal of the load-time
  conversion (``revert_weight_conversion``'s transforms, in its order), run on meta tensors of
  ``shapes`` whose ``contiguous()`` keeps the view: each output name -> the `TensorView` of the one
  source tensor it is. An output computed from several sources (a concatenation) or a copy (an
  interleave) is refused with `UnsupportedLayout`, unless ``computed=True``: it is then a `ComputedTensor`
  (its sources, shape and the reverse converter that makes it), and `compute_reverse` makes it from the
  real source tensors with transformers' own ops (Kimi-K2.5's vision ``wqkv``: q, k, v permuted back for
  rope and concatenated), so the Hub tensor is what ``save_pretrained`` would write.
- A sub-model's prefix the Hub's checkpoints hold and transformers 5 drops in memory (a VLM's vision tower,
  ``vision_tower.vision_model.*``; a scoped ``PrefixChange``) is written back, as 4.x readers need it;
  ``save_pretrained`` of transformers 5 leaves it out (`_hub_prefix`).
- The Hub layout of a tensor that transformers transposes on load only when its shape asks for it
  (``Transpose(check_dims=True)``, e.g. Qwen3-VL-MoE's fused experts): ``save_pretrained`` keeps the
  in-memory layout, the Hub's checkpoints (and transformers 4.x) hold the transposed one. The trace
  writes the transposed one (a strided view) when the stored tensor has the in-memory
  shape, keeps a tensor that already has the Hub shape. A square one (both dims equal) transformers 5 does
  not transpose on load at all, so no folder loads the same in 4.x and 5.x: it is written in transformers 5's
  layout (what ``save_pretrained`` writes), read as stored when the config's ``transformers_version`` is 5+,
  transposed from the Hub's when it is 4.x, and refused (`UnsupportedLayout`) when the config does not say;
  `square_hub_transposes` lists such tensors (their folder's ``stepmerge.json`` says 4.x readers cannot load it).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import math
import pathlib
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from merge_engine.formats.stored_tensor import is_row_major
from merge_engine.errors import UnsupportedLayout


@dataclass(frozen=True)
class TensorView:
    """An output tensor that is a strided view of one source tensor, in elements of the source's
    row-major flattening: ``torch.as_strided(source.reshape(-1), shape, stride, offset)``."""

    source: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_whole(self, source_shape: tuple[int, ...]) -> bool:
        return self.offset == 0 and self.shape == tuple(source_shape) and self.is_contiguous()

    def is_contiguous(self) -> bool:
        return is_row_major(self.shape, self.stride)

    def runs(self) -> Iterator[tuple[int, int]]:
        """(start, count) element runs of the source whose concatenation is the view, coalesced."""
        if self.numel == 0:
            return
        if self.is_contiguous():
            yield self.offset, self.numel
            return
        inner = 1  # the trailing dims that are contiguous form one run
        split = len(self.shape)
        while split > 0 and (self.shape[split - 1] == 1 or self.stride[split - 1] == inner):
            inner *= self.shape[split - 1]
            split -= 1
        outer_shape, outer_stride = self.shape[:split], self.stride[:split]
        pending: list[int] | None = None
        for index in range(math.prod(outer_shape)):
            start, rest = self.offset, index
            for size, stride in zip(reversed(outer_shape), reversed(outer_stride)):
                rest, i = divmod(rest, size)
                start += i * stride
            if pending is not None and pending[0] + pending[1] == start:
                pending[1] += inner
            else:
                if pending is not None:
                    yield pending[0], pending[1]
                pending = [start, inner]
        if pending is not None:
            yield pending[0], pending[1]

    def min_run(self) -> int:
        inner = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size == 1 or stride == inner:
                inner *= size
            else:
                break
        return inner


@dataclass(frozen=True)
class ComputedTensor:
    """An output tensor that transformers' reverse conversion computes from ``sources`` (stored names, in the
    order the converter takes them): ``group`` is the converter's first target (its key in the trace) and
    ``pattern`` the source pattern that selects it."""

    sources: tuple[str, ...]
    shape: tuple[int, ...]
    group: str
    pattern: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Traced(torch.Tensor):
    """A meta tensor for tracing transformers' reverse conversion: ``contiguous()`` keeps the view
    (so a slice stays a view of its source), every other op runs as on any meta tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def _config_object(config: Mapping[str, Any]):
    from transformers import AutoConfig

    data = json.loads(json.dumps(dict(config)))
    model_type = data.pop("model_type", None)
    if not model_type:
        return None
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError):  # a model type this transformers does not know (remote code)
        return None


def conversion_known(config: Mapping[str, Any]) -> bool:
    """Cheap test, before building any model: does transformers convert names for this config?
    Answered without importing ``transformers.conversion_mapping`` (0.6-0.9 s of imports) when the
    table's source lists none of the config's model types and classes (`conversion_table_keys`)."""
    if not has_conversion_mapping():
        return False  # transformers 4.x: the Hub's names are the model's own, nothing to convert
    keys = list(config.get("architectures") or [])
    scopes = [config] + [v for v in config.values() if isinstance(v, Mapping) and "model_type" in v]
    keys += [s.get("model_type") for s in scopes if s.get("model_type")]
    nested = [kind for s in scopes[1:] if isinstance(kind := s.get("model_type"), str)]
    if nested:  # a sub-model's own class may have a conversion (a VLM's SiglipVisionModel tower): its name too
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        keys += [MODEL_MAPPING_NAMES.get(t) for t in nested]
    listed = None if CONVERSION_MODULE in sys.modules else conversion_table_keys()
    if listed is not None and not listed.intersection(k for k in keys if isinstance(k, str)):
        return False
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return any(get_checkpoint_conversion_mapping(k) for k in keys)


CONVERSION_MODULE = "transformers.conversion_mapping"
_TABLE_FUNCTION = "_build_checkpoint_conversion_mapping"
_ALIASES = "_MODEL_TO_CONVERSION_PATTERN"


def _transformers_file(name: str) -> pathlib.Path | None:
    """``name`` inside the installed transformers package (found without importing it), None without one."""
    spec = importlib.util.find_spec("transformers")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return pathlib.Path(roots[0], name) if roots else None


@functools.lru_cache(maxsize=1)
def has_conversion_mapping() -> bool:
    """Whether the installed transformers converts weight names at load time at all (5.x has
    ``transformers.conversion_mapping``; 4.x has none: its models hold the Hub's names). Nothing imported."""
    if CONVERSION_MODULE in sys.modules:
        return True
    path = _transformers_file("conversion_mapping.py")
    return path is not None and (path.is_file() or path.with_suffix("").is_dir())


@functools.lru_cache(maxsize=1)
def conversion_table_keys() -> frozenset[str] | None:
    """Every model type and class name transformers' checkpoint conversion table may hold an entry for,
    read with `ast` from the installed ``transformers/conversion_mapping.py`` (nothing imported, nothing
    re-typed): the string keys of the dict ``_build_checkpoint_conversion_mapping`` starts from, the
    ``mapping["..."] = ...`` it adds, and the aliases of ``_MODEL_TO_CONVERSION_PATTERN``. A superset of
    the real keys. None (the caller imports the module and asks it) when the source does anything this
    reader does not follow: a computed key, ``mapping`` passed on, rebound or mutated by a method."""
    try:
        path = _transformers_file("conversion_mapping.py")
        source = path.read_text(encoding="utf-8") if path is not None else None
        return _table_keys(ast.parse(source)) if source is not None else None
    except (OSError, SyntaxError, ValueError, ImportError):
        return None


def _str_keys(node: ast.AST | None) -> set[str] | None:
    if not isinstance(node, ast.Dict) or not all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                 for k in node.keys):
        return None
    return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _table_keys(module: ast.Module) -> frozenset[str] | None:
    aliases = build = None
    for statement in module.body:
        if isinstance(statement, ast.Assign) and [ast.unparse(t) for t in statement.targets] == [_ALIASES]:
            aliases = _str_keys(statement.value)
        elif isinstance(statement, ast.FunctionDef) and statement.name == _TABLE_FUNCTION:
            build = statement
    if aliases is None or build is None or not build.body:
        return None
    first = build.body[0]
    if not (isinstance(first, ast.Assign) and [ast.unparse(t) for t in first.targets] == ["mapping"]):
        return None
    keys = _str_keys(first.value)
    if keys is None:
        return None
    alias_loops = set()  # the one computed key allowed: ``for model_type, base in _MODEL_TO_...items(): mapping[model_type] = ...``
    for node in ast.walk(build):
        if isinstance(node, ast.For) and ast.unparse(node.iter) == f"{_ALIASES}.items()" and \
                isinstance(node.target, ast.Tuple) and isinstance(node.target.elts[0], ast.Name):
            alias_loops.add(node.target.elts[0].id)
    parents = {child: node for node in ast.walk(build) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(build):
        if not (isinstance(node, ast.Name) and node.id == "mapping") or node is first.targets[0]:
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node:
            if not isinstance(parent.ctx, ast.Store):
                continue  # read (or deleted: the set stays a superset)
            if isinstance(parent.slice, ast.Constant) and isinstance(parent.slice.value, str):
                keys.add(parent.slice.value)
            elif not (isinstance(parent.slice, ast.Name) and parent.slice.id in alias_loops):
                return None
        elif isinstance(parent, ast.Compare) and node in parent.comparators:
            continue  # ``key in mapping``
        elif isinstance(parent, ast.Return):
            continue
        else:
            return None  # rebound, passed to a call, or a method called on it: not followed
    return frozenset(keys | aliases)


@functools.lru_cache(maxsize=8)
def _meta_model(config_json: str):
    return fresh_meta_model(json.loads(config_json))


def fresh_meta_model(config: Mapping[str, Any]):
    """A new model of ``config``'s class on the ``meta`` device, not cached (for callers that change it,
    e.g. PEFT wrapping it: `merge_engine.lora.peft_settings`); None when transformers has no class for it."""
    import transformers

    cfg = _config_object(config)
    if cfg is None:
        return None
    architectures = config.get("architectures") or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        if isinstance(cls, type) and hasattr(cls, "_from_config"):
            return cls._from_config(cfg)
        return transformers.AutoModelForCausalLM.from_config(cfg)


def meta_model(config: Mapping[str, Any]):
    """The config's model class on the ``meta`` device (no weights), or None when transformers has no
    class for it. Cached by config content."""
    return _meta_model(json.dumps(dict(config), sort_keys=True, default=str))


@functools.lru_cache(maxsize=1)
def _hub_transpose_class():
    from transformers.core_model_loading import Transpose

    class HubTranspose(Transpose):
        """The save-time reverse of a load-time ``Transpose(check_dims=True)``, as the Hub holds the tensor
        (see the module docstring): transposed when the tensor has the in-memory shape, kept when it has
        the transposed one; when both shapes are the same, transformers 5's layout by the config's
        ``transformers_version`` (`UnsupportedLayout` when it names none)."""

        def convert(self, input_dict: dict[str, Any], source_patterns: list[str],  # type: ignore[override]
                    target_patterns: list[str], **kwargs: Any) -> dict[str, Any]:  # transformers' own names
            target = self.get_target_pattern(input_dict, source_patterns, target_patterns)
            tensor = next(iter(input_dict.values()))
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            name = kwargs["full_layer_name"]
            memory = tuple(kwargs["model"].get_parameter(name).shape)
            transposed = tuple(torch.empty(memory, device="meta").transpose(self.dim0, self.dim1).shape)
            if memory == transposed:  # square: the shape cannot say which layout is stored
                major = stored_by_major(kwargs["config"])
                if major is None:
                    raise UnsupportedLayout(f"{name}: square {memory}, and config.json names no transformers_version "
                                            "to tell whether the trainer stored it in transformers 5's layout or "
                                            "the Hub's (4.x); write one there")
                if major >= 5:
                    return {target: tensor}  # transformers 5's layout, as save_pretrained writes it and 5.x reads it
                return {target: torch.transpose(tensor, self.dim0, self.dim1).contiguous()}  # 4.x's: made 5.x's
            if tuple(tensor.shape) == transposed:
                return {target: tensor}  # already the Hub's layout
            return {target: torch.transpose(tensor, self.dim0, self.dim1).contiguous()}

    return HubTranspose


def stored_by_major(config: Any) -> int | None:
    """The major version of the transformers that wrote ``config`` (its ``transformers_version``), None if unsaid."""
    version = config.get("transformers_version") if isinstance(config, Mapping) else \
        getattr(config, "transformers_version", None)
    head = str(version).split(".", 1)[0] if version else ""
    return int(head) if head.isdigit() else None


def square_hub_transposes(model, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The names among ``shapes`` that a ``Transpose(check_dims=True)`` of ``model``'s conversion matches while
    square in its two dims: written in transformers 5's layout, which 4.x readers take as the Hub's (transposed)."""
    _, converters, _ = _reverse_transforms(model)
    square = []
    for name, shape in shapes.items():
        for converter in converters:
            if converter.rename_source_key(name)[1] is None:
                continue
            for op in converter.operations:
                if isinstance(op, _hub_transpose_class()) and len(shape) > max(op.dim0, op.dim1) and \
                        shape[op.dim0] == shape[op.dim1]:
                    square.append(name)
            break
    return square


def _hub_layout_ops(converter):
    """``converter`` with each ``Transpose(check_dims=True)`` made the Hub's transpose (module docstring)."""
    from transformers.core_model_loading import Transpose

    if not any(isinstance(op, Transpose) and op.check_dims for op in converter.operations):
        return converter
    converter.operations = [_hub_transpose_class()(op.dim0, op.dim1, check_dims=True) if isinstance(op, Transpose) and op.check_dims else op
                            for op in converter.operations]
    return converter


def _reverse_transforms(model, conversions=None):
    """transformers' save-time reversal of its load-time conversion for ``model`` (or of the given
    load-time ``conversions``): (renamings, converters, pattern -> converter), exactly as
    ``revert_weight_conversion`` builds them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers import core_model_loading
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    prefix_change = getattr(core_model_loading, "PrefixChange", ())  # absent in 5.5.3
    conversions = [c for c in conversions if not isinstance(c, prefix_change) or _hub_prefix(c)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    converters = [_hub_layout_ops(r) for r in reverse if isinstance(r, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}


def _hub_prefix(change) -> bool:
    """A sub-model's load-time ``PrefixChange`` that removes a prefix its Hub checkpoints hold (a VLM's vision
    tower: ``vision_tower.vision_model.*``, which transformers 4.x reads) is reversed for the Hub names;
    ``save_pretrained`` drops every ``PrefixChange`` (it cannot tell whether the loaded checkpoint had the
    prefix), and a root-level one (a text model read from a VLM checkpoint) stays dropped."""
    return bool(getattr(change, "prefix_to_remove", None)) and bool(getattr(change, "scope_prefix", None))


def apply_renamings(name: str, renamings) -> str:
    """``name`` after every renaming in turn, as transformers' save does (its own ``apply_renamings``
    is absent in 5.17 and older; each transform's ``rename_source_key`` is there from 5.5.3)."""
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name


def apply_converters(name: str, converters) -> tuple[str, str | None]:
    """``name`` after the first converter that matches it, and that converter's source pattern (None: none
    matched), as transformers' own ``apply_converters`` answers."""
    for converter in converters:
        renamed, pattern = converter.rename_source_key(name)
        if pattern is not None:
            return renamed, pattern
    return name, None


def trace_reverse_conversion(model, shapes: Mapping[str, tuple[int, ...]], conversions=None,
                             computed: bool = False) -> dict[str, TensorView | ComputedTensor]:
    """Run transformers' save-time conversion of ``model`` on meta tensors of ``shapes`` and return,
    for every output name, the view of the source tensor it is. An output that is not a view of a single
    source (its values have to be computed): a `ComputedTensor` with ``computed=True``, else `UnsupportedLayout`."""
    from copy import deepcopy

    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

    renamings, converters, by_pattern = _reverse_transforms(model, conversions)
    bases = {name: torch.empty(tuple(shape), device="meta").as_subclass(_Traced) for name, shape in shapes.items()}
    owner = {bases[name].untyped_storage()._cdata: name for name in bases}
    if len(owner) != len(bases):
        raise RuntimeError("meta tensors share storage: cannot trace the conversion")
    groups: dict[str, Any] = {}
    members: dict[str, list[tuple[str, str]]] = {}
    for name in sorted(shapes, key=dot_natural_key):
        renamed, pattern = apply_converters(name, converters)
        if pattern is not None:
            group = groups.setdefault(renamed, deepcopy(by_pattern[pattern]))
        else:
            renamed = apply_renamings(name, renamings)
            group = groups.setdefault(renamed, WeightRenaming(name, renamed))
            pattern = name
        group.add_tensor(renamed, name, pattern, bases[name])
        members.setdefault(renamed, []).append((name, pattern))
    views: dict[str, TensorView | ComputedTensor] = {}
    for first, group in groups.items():
        for out_name, value in group.convert(first, model=model, config=model.config).items():
            value = value[0] if isinstance(value, list) else value
            if isinstance(group, WeightConverter):
                out_name = apply_renamings(out_name, renamings)
            source = owner.get(value.untyped_storage()._cdata)
            if source is None and computed and isinstance(group, WeightConverter):
                if out_name in views:
                    raise UnsupportedLayout(f"{out_name}: two stored tensors map to the same Hub name")
                views[out_name] = ComputedTensor(tuple(n for n, _ in members[first]), tuple(value.shape), first,
                                                 members[first][0][1])
                continue
            if source is None:
                raise UnsupportedLayout(f"{out_name}: transformers computes this Hub tensor from several stored "
                                        f"ones ({group.source_patterns}); pass --weights-format transformers "
                                        "to write the stored names")
            if out_name in views:
                raise UnsupportedLayout(f"{out_name}: two stored tensors map to the same Hub name")
            views[out_name] = TensorView(source, value.storage_offset(), tuple(value.shape), tuple(value.stride()))
    return views


def compute_reverse(model, computed: ComputedTensor, tensors: Mapping[str, torch.Tensor], out_name: str,
                    conversions=None) -> torch.Tensor:
    """The Hub tensor ``out_name`` made from the real ``tensors`` (stored name -> tensor, every one of
    ``computed.sources``) by transformers' own reverse converter, as ``save_pretrained`` makes it."""
    from copy import deepcopy

    renamings, converters, by_pattern = _reverse_transforms(model, conversions)
    group = deepcopy(by_pattern[computed.pattern])
    for name in computed.sources:
        renamed, pattern = apply_converters(name, converters)
        group.add_tensor(renamed, name, pattern, tensors[name])
    with torch.no_grad():
        for name, value in group.convert(computed.group, model=model, config=model.config).items():
            if apply_renamings(name, renamings) == out_name:
                value = value[0] if isinstance(value, list) else value
                if tuple(value.shape) != computed.shape:
                    raise UnsupportedLayout(f"{out_name}: computed {tuple(value.shape)}, traced {computed.shape}")
                return value.contiguous()
    raise UnsupportedLayout(f"{out_name}: transformers' reverse conversion did not make it")
