"""LoRA on fused expert tensors: PEFT's ``target_parameters`` (``ParamWrapper``) on transformers v5 MoE.

transformers v5 holds an MoE layer's experts as 3-D parameters, ``(experts, out, in)``:
``mlp.experts.gate_up_proj`` (gate rows, then up rows) and ``mlp.experts.down_proj``. PEFT 0.21
adapts them with one ``ParamWrapper`` per parameter; two wrapped parameters of one module nest, so
a training checkpoint holds (checked against peft 0.21.2 and transformers 5.24)::

    <m>.base_layer.base_layer.gate_up_proj       the frozen fused parameter (E, 2I, H)
    <m>.base_layer.lora_A.default.weight         A of the inner wrapper, (E*r, in)
    <m>.base_layer.lora_B.default.weight         B of the inner wrapper, (out, E*r)
    <m>.lora_A.default.weight / lora_B           the outer wrapper (down_proj here)

The keys do not say which parameter a wrapper adapts (that is the order of ``target_parameters``,
which verl does not record): `find_expert_loras` matches each wrapper's factor shapes against the
module's 3-D parameters and refuses an ambiguous or a missing match. PEFT's layout
(``ParamWrapper.get_delta_weight``): A's rows are expert-major, ``A.reshape(E, r, in)``; B's
columns are rank-major, ``B.reshape(out, r, E)``; so expert e's update is

    delta_e = scale * B[:, e::E] @ A[e*r:(e+1)*r]        (out, in), scale = alpha / r

`merge_engine.lora.hub_names` cuts them and writes them as one adapter module per
Hub expert tensor (``experts.N.gate_proj``), with ranged reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from merge_engine.errors import AdapterError
from merge_engine.lora.config import LoraSettings
from merge_engine.lora.keys import LORA_A, LORA_B
from merge_engine.formats.tensor_source import TensorMeta

WRAPPER_SUFFIX = ".base_layer"


@dataclass(frozen=True)
class ExpertLora:
    """LoRA on one fused expert parameter ``parameter`` of shape (experts, out, in).

    ``a`` (experts * rank, in) and ``b`` (out, experts * rank) name the factors in the source;
    ``rank`` is the rank of each expert's update; ``scale`` PEFT's scaling of the wrapper.
    """

    parameter: str
    a: str
    b: str
    num_experts: int
    rank: int
    in_features: int
    out_features: int
    scale: float
    alpha: float | None = None  # PEFT's lora_alpha of the wrapper

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.out_features, self.in_features)


def wrapper_owner(module: str) -> str:
    """``model.layers.0.mlp.experts.base_layer`` -> ``model.layers.0.mlp.experts`` (nested wrappers)."""
    while module.endswith(WRAPPER_SUFFIX):
        module = module[: -len(WRAPPER_SUFFIX)]
    return module


def transposed_expert_modules(config: Mapping[str, Any] | None) -> frozenset[str]:
    """Modules of ``config``'s model (in-memory names) whose experts are stored (experts, in, out)
    (transformers' ``is_transposed``: gpt-oss, Aria), read from the model built on the meta device."""
    if not config:
        return frozenset()
    from merge_engine.plan.transformers_conversion import meta_model

    try:
        model = meta_model(config)
    except Exception:  # noqa: BLE001 - an unbuildable config declares nothing
        return frozenset()
    if model is None:
        return frozenset()
    return frozenset(name for name, module in model.named_modules() if getattr(module, "is_transposed", False))


def find_expert_loras(factors: Mapping[str, Mapping[str, tuple[str, bool]]],
                      base_shapes: Mapping[str, tuple[int, ...]], factor_metas: Mapping[str, TensorMeta],
                      where: str | None, transposed: frozenset[str] = frozenset()
                      ) -> tuple[dict[str, ExpertLora], dict[str, Mapping[str, tuple[str, bool]]]]:
    """Split ``factors`` (wrapper module -> {"lora_A": (key, embedding), ...}) into LoRAs on 3-D
    parameters (by parameter name; ``scale`` 1 until `with_scales`) and the ordinary module LoRAs
    (returned as they came).

    A wrapper is a parameter LoRA when its module has no ``.weight`` in ``base_shapes`` but owns
    3-D parameters; its factors must fit exactly one of them, else `AdapterError`. Experts stored
    (experts, in, out) (``transposed``: `transposed_expert_modules`) are refused: a square tensor
    would fit either way round.
    """
    experts: dict[str, ExpertLora] = {}
    ordinary: dict[str, Mapping[str, tuple[str, bool]]] = {}
    for module, parts in factors.items():
        owner = wrapper_owner(module)
        if owner == module and f"{module}.weight" in base_shapes:
            ordinary[module] = parts
            continue
        fused = {name: tuple(shape) for name, shape in base_shapes.items()
                 if name.startswith(f"{owner}.") and "." not in name[len(owner) + 1:] and len(shape) == 3}
        if not fused:
            if owner != module:
                raise AdapterError(f"{module} holds LoRA factors of a wrapped parameter, but {owner} has no 3-D "
                                   "parameter in the checkpoint", where)
            ordinary[module] = parts
            continue
        if owner in transposed:
            raise AdapterError(f"{module}: LoRA on experts stored (experts, in, out) ({owner}) is not supported", where)
        if LORA_A not in parts or LORA_B not in parts:
            raise AdapterError(f"{module} has {sorted(parts)} but not both lora_A and lora_B", where)
        a, b = parts[LORA_A][0], parts[LORA_B][0]
        a_shape, b_shape = tuple(factor_metas[a].shape), tuple(factor_metas[b].shape)
        matches = [name for name, (n, out, inp) in fused.items()
                   if len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] == b_shape[1] and a_shape[0] % n == 0
                   and a_shape[0] // n > 0 and a_shape[1] == inp and b_shape[0] == out]
        if len(matches) != 1:
            what = "fits none" if not matches else f"fits several ({', '.join(sorted(matches))})"
            raise AdapterError(f"{module}: lora_A {a_shape} and lora_B {b_shape} on a fused expert parameter "
                               f"{what} of {owner}'s 3-D parameters {sorted(fused.items())} (stored as "
                               "(experts, out, in): PEFT's layout for these is (experts*r, in) and (out, experts*r))",
                               where)
        parameter = matches[0]
        if parameter in experts:
            raise AdapterError(f"two LoRA wrappers of {owner} fit {parameter}: cannot tell which adapts what", where)
        n, out, inp = fused[parameter]
        rank = a_shape[0] // n
        experts[parameter] = ExpertLora(parameter, a, b, n, rank, inp, out, 1.0)
    return experts, ordinary


def with_scales(experts: Mapping[str, ExpertLora], settings: LoraSettings) -> dict[str, ExpertLora]:
    """``experts`` with PEFT's scaling of each (alpha / r, rank and alpha patterns matched on the parameter)."""
    return {name: dataclasses.replace(lora, scale=settings.scale_of(name, lora.rank), alpha=settings.alpha_of(name))
            for name, lora in experts.items()}


def check_experts_fit(experts: Mapping[str, ExpertLora], base_metas: Mapping[str, TensorMeta],
                      adapter_url: str, base_url: str | None) -> None:
    """Each fused parameter exists in the base with the LoRA's (experts, out, in); else `AdapterError`."""
    for lora in experts.values():
        meta = base_metas.get(lora.parameter)
        if meta is None:
            raise AdapterError(f"the LoRA adapts {lora.parameter}, which the base model {base_url} does not have "
                               "(a base with per-expert tensors?)", adapter_url)
        if tuple(meta.shape) != lora.weight_shape:
            raise AdapterError(f"{lora.parameter}: the LoRA updates a {lora.weight_shape} tensor but the base's is "
                               f"{tuple(meta.shape)}", adapter_url)


