"""Multi-token-prediction (MTP) layers (DeepSeek-V3; GLM-4.5 has them too): exported in the Hub
checkpoint's layout or dropped, as the user chose (``--mtp-layers export|drop``), never silently.

Megatron (megatron-core ``mtp_num_layers``) keeps MTP layer ``i`` as
``mtp.layers.{i}.{enorm,hnorm,eh_proj,final_layernorm}.weight`` plus a whole decoder layer
``mtp.layers.{i}.transformer_layer.<layer names>``, and shares the model's embedding and output
layer. DeepSeek's Hub checkpoint holds it as one more decoder layer ``model.layers.{L + i}``
(``L = num_hidden_layers``) with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and its
own copies of the embedding (``embed_tokens``) and of the output layer (``shared_head.head``);
``num_nextn_predict_layers`` in config.json counts them.

`mtp_view` turns a canonical Megatron listing into what the family table binds: the MTP
transformer layers renamed to decoder layers ``L + i`` (the table then maps them like any layer),
the MTP-only tensors and the two copies as extra outputs, and the renames to read through.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from merge_engine.architectures.mappings import ModelDims
from merge_engine.architectures.megatron_names import layer_name
from merge_engine.errors import MappingError
from merge_engine.formats.tensor_source import TensorMeta

MTP_OPTIONS = ("export", "drop")
MTP_LAYER = re.compile(r"^mtp\.layers\.([0-9]+)\.(.+)$")
TRANSFORMER_LAYER = "transformer_layer."
CONFIG_KEY = "num_nextn_predict_layers"
# MTP-only tensors, Megatron name after ``mtp.layers.{i}.`` -> Hub name after ``model.layers.{L + i}.``
OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "final_layernorm.weight": "shared_head.norm.weight"}
# the Hub layer's own copies of tensors Megatron shares with the model: Hub name -> Megatron tensor
COPIES = {"embed_tokens.weight": "embedding.word_embeddings.weight", "shared_head.head.weight": "output_layer.weight"}
# per-rank files with PP > 1: the last stage's own embedding copy (its MTP layers embed tokens), which
# the legacy reader names so; the MTP layer's embed_tokens is then written from it
MTP_EMBEDDING = "mtp.embedding.word_embeddings.weight"


@dataclass(frozen=True)
class MtpView:
    """A canonical listing with its MTP layers resolved (see the module docstring)."""

    metas: dict[str, TensorMeta]  # what the table binds
    reads: dict[str, str] = field(default_factory=dict)  # renamed name -> the source's name
    own: tuple[tuple[str, str], ...] = ()  # (Hub name, source name): copied as they are
    copies: tuple[tuple[str, str], ...] = ()  # (Hub name, source vocabulary tensor): its first vocab_size rows
    dims: ModelDims | None = None  # the dims with the exported layers counted (None: unchanged)
    config_updates: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def mtp_view(metas: Mapping[str, TensorMeta], dims: ModelDims, option: str | None) -> MtpView:
    """Resolve the MTP tensors of ``metas`` by ``option`` (None: there must be none).

    Raises `MappingError` when MTP tensors are present and no option says what to do with them, or
    when an MTP layer lacks a tensor every MTP layer has.
    """
    mtp = [n for n in metas if MTP_LAYER.match(n) or n == MTP_EMBEDDING]
    if not mtp:
        return MtpView(dict(metas))
    layers = sorted({int(m.group(1)) for n in mtp if (m := MTP_LAYER.match(n))})
    if option not in MTP_OPTIONS:
        raise MappingError(f"the checkpoint has {len(layers)} multi-token-prediction (MTP) layer(s) ({len(mtp)} "
                           f"tensors, e.g. {mtp[0]!r}); say what to do with them: --mtp-layers export (written as the "
                           f"Hub checkpoint holds them, model.layers.{dims.num_layers}+) or --mtp-layers drop")
    kept = {n: m for n, m in metas.items() if n not in set(mtp)}
    if option == "drop":
        return MtpView(kept, config_updates={CONFIG_KEY: 0},
                       notes=(f"{len(layers)} MTP layer(s) dropped ({len(mtp)} tensors), as --mtp-layers drop asks",))
    if layers != list(range(len(layers))):
        raise MappingError(f"MTP layers {layers} are not numbered 0..{len(layers) - 1}")
    reads: dict[str, str] = {}
    own, copies = [], []
    for i in layers:
        hub_layer = dims.num_layers + i
        prefix = f"mtp.layers.{i}."
        for name in (n for n in mtp if n.startswith(prefix)):
            rest = name[len(prefix):]
            if rest.startswith(TRANSFORMER_LAYER):
                renamed = layer_name(hub_layer, rest[len(TRANSFORMER_LAYER):])
                kept[renamed] = replace(metas[name], name=renamed)
                reads[renamed] = name
            elif rest in OWN:
                own.append((f"model.layers.{hub_layer}.{OWN[rest]}", name))
            else:
                raise MappingError(f"{name!r}: not a tensor of an MTP layer (known: {sorted(OWN)} and "
                                   f"{TRANSFORMER_LAYER}*)")
        missing = [r for r in OWN if prefix + r not in metas]
        if missing:
            raise MappingError(f"MTP layer {i} lacks {prefix + missing[0]!r}")
        head = COPIES["shared_head.head.weight"] if COPIES["shared_head.head.weight"] in metas and not dims.tied \
            else COPIES["embed_tokens.weight"]
        embedding = MTP_EMBEDDING if MTP_EMBEDDING in metas else COPIES["embed_tokens.weight"]
        copies += [(f"model.layers.{hub_layer}.embed_tokens.weight", embedding),
                   (f"model.layers.{hub_layer}.shared_head.head.weight", head)]
    # an MTP layer is built like the model's last layer (megatron-core's MTP spec): MoE if that one is
    last_is_moe = (dims.num_layers - 1) in dims.moe_layers
    exported = range(dims.num_layers, dims.num_layers + len(layers))
    wider = replace(dims, num_layers=dims.num_layers + len(layers),
                    moe_layers=dims.moe_layers | (frozenset(exported) if last_is_moe else frozenset()))
    return MtpView(kept, reads, tuple(own), tuple(copies), wider, {CONFIG_KEY: len(layers)},
                   (f"{len(layers)} MTP layer(s) exported as model.layers.{dims.num_layers}.. with their own "
                    "embed_tokens / shared_head.head copies, as --mtp-layers export asks",))


HUB_LAYER = re.compile(r"^model\.layers\.([0-9]+)\.")


def hub_mtp_names(config: object, names: Iterable[str]) -> set[str]:
    """The names among ``names`` that belong to exported MTP layers of ``config`` (a transformers config
    or a dict): ``model.layers.{L .. L+k-1}.*`` with ``L = num_hidden_layers`` and ``k`` its
    ``num_nextn_predict_layers`` (or ``num_mtp_layers``). transformers builds no such layer (it skips
    them on load), so a check of a merged folder against the model's own keys must allow these."""
    def get(key: str) -> object:
        return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

    layers, count = get("num_hidden_layers"), get(CONFIG_KEY) or get("num_mtp_layers")
    if not isinstance(layers, int) or not isinstance(count, int) or count <= 0:
        return set()
    return {n for n in names if (m := HUB_LAYER.match(n)) and layers <= int(m.group(1)) < layers + count}
