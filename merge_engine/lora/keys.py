"""PEFT's tensor names, read and written: what each key of a LoRA checkpoint or adapter file is.

Two spellings of the same model exist (checked against peft 0.21):
- a training checkpoint (``PeftModel.state_dict()``, what verl's FSDP rank files hold)::

      base_model.model.<module>.base_layer.weight          the frozen base weight of a LoRA module
      base_model.model.<module>.lora_A.<adapter>.weight    A, (r, in)
      base_model.model.<module>.lora_B.<adapter>.weight    B, (out, r)
      base_model.model.<module>.lora_embedding_A.<adapter> A of an embedding, (r, num_embeddings)
      base_model.model.<module>.modules_to_save.<adapter>.<param>   the trained copy of a module
      base_model.model.<module>.original_module.<param>             its frozen original
      base_model.model.<name>                              every other (frozen) tensor

- LoRA on a parameter (PEFT ``target_parameters``: transformers v5's fused experts) nests a
  ``ParamWrapper`` per parameter: ``<module>.base_layer.base_layer.<param>`` is the frozen tensor
  (`BASE`, named ``<module>.<param>``), ``<module>.base_layer.lora_A.<adapter>.weight`` the inner
  wrapper's factor (module ``<module>.base_layer``); `merge_engine.lora.fused_experts` tells which
  parameter each wrapper adapts.

- an adapter file (``adapter_model.safetensors``, PEFT's ``get_peft_model_state_dict``): the same
  names without the adapter name (``lora_A.weight``, ``lora_embedding_A``), modules to save under
  their plain name (``base_model.model.lm_head.weight``), and, when embeddings were saved,
  ``base_model.model.<module>.base_layer.weight``.

`parse_key` classifies one key of either spelling; anything PEFT writes for a LoRA variant stepmerge
does not fuse (DoRA magnitudes, LoRA biases, trainable tokens) raises `AdapterError` naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from merge_engine.errors import AdapterError

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
BASE_DIR = "base"  # the clean base model beside an adapter: <adapter folder>/base/ (a Hugging Face folder)

BASE = "base"  # a base-model tensor (frozen)
LORA_A = "lora_A"
LORA_B = "lora_B"
TRAINED_COPY = "trained_copy"  # a module-to-save's trained copy: replaces the base tensor

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_LORA_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?$")
_TRAINED_COPY = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<param>.+)$")
_WRAPPERS = re.compile(r"(?:\.base_layer)+\.")  # nested ParamWrappers stack base_layer (fused experts)
_UNSUPPORTED = {
    "lora_magnitude_vector": "DoRA (use_dora) adapters",
    "lora_bias": "LoRA bias (lora_bias=True) adapters",
    "trainable_tokens": "trainable-token adapters",
}


@dataclass(frozen=True)
class KeyRole:
    """What one stored key is.

    ``kind``: `BASE`, `LORA_A`, `LORA_B` or `TRAINED_COPY`. ``name``: for LoRA factors the module
    (``model.layers.0.self_attn.q_proj``), else the Hugging Face tensor name it stands for
    (``model.layers.0.self_attn.q_proj.weight``). ``embedding``: an embedding's LoRA factor.
    ``adapter``: the adapter name in training checkpoints (``default``), None in adapter files.
    """

    kind: str
    name: str
    embedding: bool = False
    adapter: str | None = None


def strip_prefix(key: str) -> str:
    return key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key


def parse_key(key: str, where: str | None = None) -> KeyRole:
    """Classify ``key`` (training-checkpoint or adapter-file spelling); `AdapterError` if unsupported."""
    name = strip_prefix(key)
    for pattern, embedding in ((_LORA, False), (_LORA_EMBEDDING, True)):
        match = pattern.match(name)
        if match:
            kind = LORA_A if match["ab"] == "A" else LORA_B
            return KeyRole(kind, match["module"], embedding, match["adapter"])
    match = _TRAINED_COPY.match(name)
    if match:
        return KeyRole(TRAINED_COPY, f"{match['module']}.{match['param']}", adapter=match["adapter"])
    match = _ORIGINAL.match(name)
    if match:
        return KeyRole(BASE, f"{match['module']}.{match['param']}")
    for part in name.split("."):
        for marker, what in _UNSUPPORTED.items():
            if part.startswith(marker):
                raise AdapterError(f"{key!r}: {what} are not supported (only plain LoRA can be fused exactly)", where)
        if part.startswith("lora_"):
            raise AdapterError(f"{key!r}: unknown LoRA tensor kind {part!r}", where)
    return KeyRole(BASE, _WRAPPERS.sub(".", name))


def adapter_file_key(module: str, factor: str, embedding: bool) -> str:
    """PEFT's name in adapter_model.safetensors for a factor (``lora_A``/``lora_B``) of ``module``."""
    if embedding:
        return f"{PEFT_PREFIX}{module}.lora_embedding_{factor[-1]}"
    return f"{PEFT_PREFIX}{module}.{factor}.weight"


def module_of(tensor_name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    return tensor_name.rsplit(".", 1)[0]
