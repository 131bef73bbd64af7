"""A release's model card: ``README.md``, written by huggingface_hub's `ModelCard` from `ModelCardData`, so the Hub,
a colleague or a registry reads what the release is.

Its YAML block is the Hub's model-card metadata: ``base_model`` (a Hub id, where one is known: the adapter's
``base_model_name_or_path``, the operator's ``base_model_id``, the run config's ``_name_or_path``), ``library_name``
(``transformers`` for a model, ``peft`` for an adapter), ``pipeline_tag`` (``text-generation`` for a causal LM)
and ``tags`` (``stepmerge``, the trainer, ``step-N``, and ``lora`` for an adapter).

Its body gives the run and step, the source (by its portable name) and its layout and fingerprints, the
validation table as the manifest records it, the sha256 of every weight file, and the lines that load it.
The card is one of the release's files, listed in ``manifest.json`` like every other one; so it cannot cite the
manifest's own sha256 (that is in ``_COMPLETE``): it cites each weight file's sha256 instead, the digest the Hub
shows for a file stored with LFS. A staged ``README.md`` (a base model's card copied with its metadata) is not
this release's: the card replaces it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine import storage
from merge_engine.layouts.runs import run_layout_of, step_of_folder
from merge_engine.lora.base_name import hub_id_of
from merge_engine.lora.keys import BASE_DIR
from merge_engine.release.folders import ADAPTER

CARD = "README.md"
LIBRARY = {ADAPTER: "peft"}  # a model: transformers
CAUSAL_LM_TAG = "text-generation"


@dataclass(frozen=True)
class CardFacts:
    """What the card says, each read from the release's own records (`card_facts`)."""

    kind: str
    release_name: str
    step: int | None
    source: str
    trainer: str | None
    layout: str
    fingerprint: str
    checkpoint_fingerprint: str | None
    base_model: str | None
    pipeline_tag: str | None
    base_inside: bool
    validation: Mapping[str, Any] | None
    weights: tuple[tuple[str, int, str], ...]  # (path, size, sha256) of each weight file


def _json(url: str) -> dict[str, Any]:
    try:
        data = json.loads(storage.read_bytes(url))
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pipeline_tag(config: Mapping[str, Any]) -> str | None:
    architectures = config.get("architectures")
    causal = isinstance(architectures, list) and any(str(a).endswith("ForCausalLM") for a in architectures)
    return CAUSAL_LM_TAG if causal else None


def card_facts(folder: str, release_url: str, *, source: str, fingerprint: str, options: Mapping[str, Any],
               validation: Mapping[str, Any] | None, files: Sequence[tuple[str, int, str]]) -> CardFacts:
    """The facts of the release being written at ``folder`` (to be published at ``release_url``): ``source``
    (portable), ``fingerprint``, the manifest's ``options`` and ``validation`` record, and its ``files`` as
    (path, size, sha256)."""
    provenance = _json(storage.join(folder, "stepmerge.json"))
    kind = str(options.get("kind") or "model")
    parts = release_url.rstrip("/").split("/")
    steps = [step_of_folder(part) for part in parts[-1:] + source.split("/")[::-1]]
    step = next((s for s in steps if s is not None), None)
    trainer = next((layout.NAME for part in reversed(source.split("/")) if (layout := run_layout_of(part))), None)
    names = {path for path, _, _ in files}
    base_inside = f"{BASE_DIR}/config.json" in names
    if kind == ADAPTER:
        base_model = hub_id_of(_json(storage.join(folder, "adapter_config.json")).get("base_model_name_or_path"))
        config = _json(storage.join(folder, BASE_DIR, "config.json")) if base_inside else {}
        task = _json(storage.join(folder, "adapter_config.json")).get("task_type")
        pipeline_tag = _pipeline_tag(config) or (CAUSAL_LM_TAG if task == "CAUSAL_LM" else None)
    else:
        config = _json(storage.join(folder, "config.json"))
        base_model = hub_id_of(options.get("base_model_id")) or hub_id_of(config.get("_name_or_path"))
        pipeline_tag = _pipeline_tag(config)
    weights = tuple(f for f in files if f[0].endswith((".safetensors", ".bin", ".pt")))
    return CardFacts(kind=kind, release_name=parts[-2] if len(parts) > 1 else "", step=step, source=source,
                     trainer=trainer, layout=str(provenance.get("layout") or ""), fingerprint=fingerprint,
                     checkpoint_fingerprint=options.get("checkpoint_fingerprint"), base_model=base_model,
                     pipeline_tag=pipeline_tag, base_inside=base_inside, validation=validation, weights=weights)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _validation_table(validation: Mapping[str, Any] | None) -> list[str]:
    if not validation:
        return ["No validation was recorded."]
    checks = validation.get("checks") or []
    verdict = "passed" if validation.get("ok") else "FAILED"
    lines = [f"Validation {verdict} ({len(checks)} checks), as `manifest.json` records it:", "",
             "| check | result | detail |", "| --- | --- | --- |"]
    for check in checks:
        result = "skipped" if check.get("skipped") else ("pass" if check.get("ok") else "FAIL")
        lines.append(f"| `{_cell(check.get('name'))}` | {result} | {_cell(check.get('detail', ''))} |")
    return lines


def _load_lines(facts: CardFacts) -> list[str]:
    """Three lines that load the release from its folder (a Hub copy: the folder ``snapshot_download`` gives; a
    ``subfolder="base"`` read of an adapter repo would be taken for the adapter by transformers)."""
    release = 'release = "."  # this folder; from the Hub: huggingface_hub.snapshot_download(REPO, revision="step-N")'
    if facts.kind != ADAPTER:
        return ["from transformers import AutoModelForCausalLM",
                release,
                "model = AutoModelForCausalLM.from_pretrained(release)"]
    base = 'f"{release}/base"' if facts.base_inside else f'"{facts.base_model or "BASE"}"'
    return ["from peft import PeftModel; from transformers import AutoModelForCausalLM",
            release,
            f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base}), release)"]


def card_text(facts: CardFacts) -> str:
    """The model card (YAML metadata block and Markdown body) of ``facts``, as huggingface_hub writes it."""
    from huggingface_hub import ModelCard, ModelCardData

    tags = ["stepmerge"] + ([facts.trainer] if facts.trainer else []) + (
        [f"step-{facts.step}"] if facts.step is not None else []) + (["lora"] if facts.kind == ADAPTER else [])
    data = ModelCardData(base_model=facts.base_model, library_name=LIBRARY.get(facts.kind, "transformers"),
                         pipeline_tag=facts.pipeline_tag, tags=tags)
    what = "LoRA adapter (PEFT)" if facts.kind == ADAPTER else "merged model"
    step = f"step {facts.step}" if facts.step is not None else "a checkpoint"
    body = [f"# {facts.release_name or 'release'}: {step}, {what}", "",
            f"Built by stepmerge from the {facts.trainer or 'training'} checkpoint `{facts.source}` ({step}"
            + (f", layout `{facts.layout}`" if facts.layout else "") + ").", "",
            f"- release fingerprint: `{facts.fingerprint}`"]
    if facts.checkpoint_fingerprint:
        body.append(f"- checkpoint fingerprint: `{facts.checkpoint_fingerprint}`")
    body.append(f"- base model: `{facts.base_model}`" if facts.base_model else
                "- base model: " + ("the clean base under `base/`" if facts.base_inside else "not named"))
    if facts.kind == ADAPTER and facts.base_inside:
        body.append("- `adapter_config.json` names its base " + (f"`{facts.base_model}` (the Hub)" if facts.base_model
                    else "`base`, the folder beside it: load the base from `base/` as below"))
    body += ["", "## Validation", "", *_validation_table(facts.validation), "", "## Weights", "",
             "`manifest.json` lists every file of the release with its size and sha256 (this card included; "
             "`_COMPLETE` holds the manifest's sha256). The weights:", "",
             "| file | bytes | sha256 |", "| --- | --- | --- |"]
    body += [f"| `{path}` | {size} | `{sha256}` |" for path, size, sha256 in facts.weights]
    body += ["", "## Load it", "", "```python", *_load_lines(facts), "```", ""]
    return str(ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(body)))


def write_card(folder: str, facts: CardFacts) -> tuple[str, int, str]:
    """Write ``README.md`` into ``folder``; returns (path, size, sha256)."""
    import hashlib

    data = card_text(facts).encode()
    storage.write_bytes(storage.join(folder, CARD), data)
    return CARD, len(data), hashlib.sha256(data).hexdigest()
