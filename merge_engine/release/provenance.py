"""`ReleaseProvenance`: where a release came from, the typed record its manifest keeps (the ``options`` of
``manifest.json``): kind, the step listing and checkpoint it was built from, whether that checkpoint holds
LoRA factors, and the options chosen."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

_PROVENANCE_KEYS = ("kind", "source_listing", "checkpoint_fingerprint", "checkpoint_lora")
_LORA_ALPHA, _HF_MODEL_PATH = "lora_alpha", "hf_model_path"


@dataclass(frozen=True)
class ReleaseProvenance:
    """Where a release came from, as its manifest records it (the ``options`` of ``manifest.json``).

    ``kind``: MODEL or ADAPTER. ``source_listing``: the fingerprint of the step folder's listing
    the release was built from (a watcher compares it with today's to tell a rewritten step).
    ``checkpoint_fingerprint``: the checked checkpoint's fingerprint. ``checkpoint_lora``: the
    checkpoint holds LoRA factors (so the step has an adapter release too). ``settings``: the
    options chosen (dtype, max_shard_size, hf_model_path, lora_alpha, ...), recorded as given.
    In the manifest all of these are one flat mapping (`to_manifest_options`); a field a manifest
    lacks (written before it was recorded) reads as None.
    """

    kind: Optional[str] = None
    source_listing: Optional[str] = None
    checkpoint_fingerprint: Optional[str] = None
    checkpoint_lora: Optional[bool] = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def lora_alpha(self) -> Optional[float]:
        return self.settings.get(_LORA_ALPHA)

    @property
    def hf_model_path(self) -> Optional[str]:
        return self.settings.get(_HF_MODEL_PATH)

    def is_trained_model_of(self, checkpoint_fingerprint: str, lora_alpha: Optional[float]) -> bool:
        """Is this the model release of exactly this checkpoint, fused with ``lora_alpha`` and the
        checkpoint's own config (so an adapter of the checkpoint must reproduce its logits)?"""
        return (self.checkpoint_fingerprint == checkpoint_fingerprint and self.lora_alpha == lora_alpha
                and self.hf_model_path is None)

    def to_manifest_options(self) -> dict[str, Any]:
        clashing = sorted(set(self.settings) & set(_PROVENANCE_KEYS))
        if clashing:
            raise ValueError(f"settings must not use the provenance keys {clashing}")
        return {**self.settings, "kind": self.kind, "source_listing": self.source_listing,
                "checkpoint_fingerprint": self.checkpoint_fingerprint, "checkpoint_lora": self.checkpoint_lora}

    @classmethod
    def from_manifest_options(cls, options: Any) -> ReleaseProvenance:
        options = options if isinstance(options, Mapping) else {}
        lora = options.get("checkpoint_lora")
        text = {key: options.get(key) if isinstance(options.get(key), str) else None
                for key in ("kind", "source_listing", "checkpoint_fingerprint")}
        return cls(**text, checkpoint_lora=lora if isinstance(lora, bool) else None,
                   settings={k: v for k, v in options.items() if k not in _PROVENANCE_KEYS})
