"""The model card every release carries (README.md), read back with huggingface_hub's own parser.

The card is written by `merge_engine.release.publish` from the release's own records: the Hub's metadata block
(base_model where a Hub id is known, library_name, pipeline_tag, tags), the run and step, the validation table
as the manifest records it, each weight file's sha256, and the lines that load it. It is listed in the manifest
like every other file.
"""

from __future__ import annotations

import hashlib
import json

from huggingface_hub import ModelCard

from merge_engine import storage
from merge_engine.release.card import CARD
from merge_engine.release.manifest import read_manifest
from merge_engine.release.publish import publish
from merge_engine.release.verify import verify_folder
from merge_engine.validate import Check, ValidationReport

WEIGHTS = bytes(range(256)) * 8
REPORT = ValidationReport("/tmp/staging/x", (Check("finite", True, "27 tensors"),
                                             Check("forward", True, "logits | finite"), Check("peft_logits", True,
                                                                                              "", skipped=True)))


def _stage(tmp_path, files: dict[str, bytes], layout: str = "fsdp") -> str:
    """A staging folder holding ``files`` and the writer's record of them (stepmerge.json: sizes, sha256, layout)."""
    staging = tmp_path / "staging"
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    record = {"layout": layout, "files": {rel: len(data) for rel, data in files.items()},
              "sha256": {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}}
    (staging / "stepmerge.json").write_text(json.dumps(record))
    return str(staging)


def test_a_model_release_has_a_card_the_hub_parses(tmp_path):
    config = {"architectures": ["Qwen2ForCausalLM"], "_name_or_path": "Qwen/Qwen2.5-0.5B"}
    staging = _stage(tmp_path, {"model.safetensors": WEIGHTS, "config.json": json.dumps(config).encode()})
    release = str(tmp_path / "run" / "releases" / "actor" / "global_step_7")
    publish(staging, release, source=str(tmp_path / "run" / "global_step_7" / "actor"), fingerprint="fp-7",
            options={"kind": "model", "checkpoint_fingerprint": "ck-7"}, validation=REPORT, engine_version="0")

    card = ModelCard.load(storage.join(release, CARD))
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B" and card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and card.data.tags == ["stepmerge", "verl", "step-7"]
    assert "`global_step_7/actor`" in card.text and "layout `fsdp`" in card.text and "`ck-7`" in card.text
    assert "| `forward` | pass | logits \\| finite |" in card.text and "| `peft_logits` | skipped |" in card.text
    assert f"| `model.safetensors` | {len(WEIGHTS)} | `{hashlib.sha256(WEIGHTS).hexdigest()}` |" in card.text
    assert "AutoModelForCausalLM.from_pretrained(release)" in card.text
    assert str(tmp_path) not in card.content and "/tmp/" not in card.content
    manifest = read_manifest(release)  # listed like every file, and verified with them
    listed = {f.path: f.sha256 for f in manifest.files}
    assert listed[CARD] == hashlib.sha256(storage.read_bytes(storage.join(release, CARD))).hexdigest()
    assert verify_folder(release).ok


def test_an_adapter_card_names_peft_and_says_how_to_load_it_with_its_base(tmp_path):
    """No Hub id known: no base_model in the metadata; the adapter's base is ``base/`` beside it."""
    staging = _stage(tmp_path, {
        "adapter_model.safetensors": WEIGHTS,
        "adapter_config.json": json.dumps({"base_model_name_or_path": "base", "task_type": "CAUSAL_LM"}).encode(),
        "base/config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(),
        "base/model.safetensors": WEIGHTS})
    release = str(tmp_path / "releases" / "actor-adapter" / "iter_0000040")
    publish(staging, release, source="s3://bucket/run/iter_0000040", fingerprint="fp", options={"kind": "adapter"},
            validation=REPORT, engine_version="0")
    card = ModelCard.load(storage.join(release, CARD))
    assert card.data.base_model is None and card.data.library_name == "peft"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.tags == ["stepmerge", "megatron_lm", "step-40", "lora"]
    assert "`s3://bucket/run/iter_0000040`" in card.text
    assert 'AutoModelForCausalLM.from_pretrained(f"{release}/base"), release)' in card.text
    assert "| `base/model.safetensors` |" in card.text and "| `adapter_model.safetensors` |" in card.text
