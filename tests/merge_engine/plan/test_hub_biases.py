"""A masked-LM head with untied embeddings, released in the Hub format, reads the same in transformers 4.57 and 5.

Specification (`merge_engine.plan.hub_biases`):
- BERT's ``cls.predictions`` / RoBERTa's ``lm_head`` (ERNIE, XLM-RoBERTa alike) with ``tie_word_embeddings``
  false: transformers 5 holds ``bias`` and ``decoder.bias`` apart and adds ``decoder.bias``; 4.57 holds one
  parameter under both names and reads ``bias``. The merge of ``save_pretrained``'s folder (the ``hf`` layout)
  writes ``bias`` as the stored ``decoder.bias`` and every other tensor bit for bit, and says so in
  ``stepmerge.json`` (``tensor_translation``) and a note.
- transformers 5 reads the folder cleanly with the model's logits, exactly; transformers 4.57
  (`tests.readers_env`) reads it cleanly, every tensor back unchanged (``decoder.bias`` held as ``bias`` itself,
  saved once: ``tensors_shared``), with the model's logits (exactly, but ERNIE: within the readers' tolerance,
  4.57 sums in another order) (before: BERT and ERNIE read the unused
  ``bias``, logits off by the whole bias).
- Nothing changes where transformers 5 ties the biases itself (tied embeddings), where the head has no such
  tie (GPT-2), or with ``--weights-format transformers`` (the stored values of both names).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from merge_engine.cli import main
from merge_engine.plan.hub_biases import RECORD, legacy_shared_biases
from tests.fixtures_readers import run_readers
from tests.merge_engine.plan.test_hub_format import _load_folder
from tests.merge_engine.plan.test_hub_readers import READER_TOLERANCE
from tests.readers_check import run_jobs

IDS = [[(7919 * i + 13) % 61 + 3 for i in range(12)]]
TINY = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 40}
# case -> (config class, model class, the head's prefix, extra config)
CASES = {
    "bert_lm_head": ("BertConfig", "BertLMHeadModel", "cls.predictions.", {"is_decoder": True}),
    "bert_masked_lm": ("BertConfig", "BertForMaskedLM", "cls.predictions.", {}),
    "ernie_causal_lm": ("ErnieConfig", "ErnieForCausalLM", "cls.predictions.", {"is_decoder": True}),
    "roberta_causal_lm": ("RobertaConfig", "RobertaForCausalLM", "lm_head.", {"is_decoder": True}),
    "xlm_roberta_masked_lm": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", "lm_head.", {}),
}


def _saved(root: Path, case: str, tied: bool) -> tuple[Path, torch.Tensor, dict[str, torch.Tensor]]:
    """``save_pretrained``'s folder of a tiny model of ``case`` with distinct random weights (its two head biases
    differ), its eval logits on `IDS` and its parameters."""
    import transformers

    config_name, model_name, _, extra = CASES[case]
    config = getattr(transformers, config_name)(**TINY, **extra, tie_word_embeddings=tied)
    torch.manual_seed(sorted(CASES).index(case))
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    folder = root / f"{case}-{'tied' if tied else 'untied'}"
    model.save_pretrained(folder)
    tokens = torch.tensor(IDS)
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()
    return folder, logits, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _merge(source: Path, target: Path, *options: str) -> dict:
    assert main(["merge", "--local-dir", str(source), "--target-dir", str(target), *options]) == 0
    return json.loads((target / "stepmerge.json").read_text())


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> dict[str, dict]:
    """case -> the saved folder, the merged one, the model's logits and parameters, and stepmerge.json."""
    root = tmp_path_factory.mktemp("untied_heads")
    out = {}
    for case in CASES:
        folder, logits, state = _saved(root, case, tied=False)
        merged = root / f"{case}-merged"
        out[case] = {"saved": folder, "merged": merged, "logits": logits, "state": state,
                     "provenance": _merge(folder, merged)}
        torch.save(logits, root / f"{case}.logits.pt")
        out[case]["reference"] = str(root / f"{case}.logits.pt")
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_bias_4x_reads_is_the_one_5x_adds(case, untied):
    prefix = CASES[case][2]
    run = untied[case]
    written, saved = _load_folder(str(run["merged"])), _load_folder(str(run["saved"]))
    assert sorted(written) == sorted(saved)
    assert not torch.equal(run["state"][prefix + "bias"], run["state"][prefix + "decoder.bias"])  # the case is real
    assert torch.equal(written[prefix + "bias"], run["state"][prefix + "decoder.bias"])
    assert all(torch.equal(written[name], tensor) for name, tensor in saved.items() if name != prefix + "bias")
    assert [(r["key"], r["tensor"]) for r in run["provenance"][RECORD]] == [(prefix + "bias", prefix + "decoder.bias")]
    from merge_engine.validate import validate_structure

    assert validate_structure(str(run["merged"])).ok


def test_transformers_5_and_4_57_read_the_trained_head(untied, readers_python, tmp_path):
    jobs = {case: {"kind": "model", "folder": str(run["merged"]), "ids": IDS, "reference": run["reference"]}
            for case, run in untied.items()}
    five = dict(zip(jobs, run_jobs(list(jobs.values()))))
    old = dict(zip(jobs, run_readers(readers_python, list(jobs.values()), tmp_path)))
    for case in jobs:
        for result in (five[case], old[case]):
            assert "error" not in result, result.get("traceback", result.get("error"))
            assert not result["loading_info"] and not result["tensors_missing"] and not result["tensors_differ"], \
                (case, result)
        assert five[case]["exact"], (case, five[case]["max_abs_diff"])  # transformers 5: the model's, bit for bit
        # 4.57 sums ERNIE's ops in another order (1.4e-6 measured): the readers' tolerance of test_hub_readers
        assert old[case]["max_abs_diff"] <= READER_TOLERANCE * max(1.0, old[case]["scale"]), (case, old[case])
        assert old[case]["versions"].startswith("transformers 4.57"), old[case]
        # 4.57 holds decoder.bias as bias itself (saved once): the value it holds is the folder's
        assert old[case]["tensors_shared"] == [CASES[case][2] + "decoder.bias"] and not five[case]["tensors_shared"]


def test_nothing_changes_where_5x_ties_them_or_the_stored_form_is_asked(tmp_path):
    folder, _, state = _saved(tmp_path, "bert_masked_lm", tied=True)
    provenance = _merge(folder, tmp_path / "tied")
    assert RECORD not in provenance
    written, saved = _load_folder(str(tmp_path / "tied")), _load_folder(str(folder))
    assert sorted(written) == sorted(saved) and all(torch.equal(written[k], v) for k, v in saved.items())

    folder, _, state = _saved(tmp_path, "bert_masked_lm", tied=False)
    provenance = _merge(folder, tmp_path / "stored", "--weights-format", "transformers")
    assert RECORD not in provenance
    written = _load_folder(str(tmp_path / "stored"))
    assert torch.equal(written["cls.predictions.bias"], state["cls.predictions.bias"])
    assert torch.equal(written["cls.predictions.decoder.bias"], state["cls.predictions.decoder.bias"])


def test_the_pairs_come_from_transformers_ties():
    from transformers import BertConfig, GPT2Config

    bert = {**BertConfig(**TINY).to_dict(), "architectures": ["BertForMaskedLM"]}
    names = ["cls.predictions.bias", "cls.predictions.decoder.bias", "cls.predictions.decoder.weight"]
    assert legacy_shared_biases({**bert, "tie_word_embeddings": False}, names) == {
        "cls.predictions.bias": "cls.predictions.decoder.bias"}
    assert legacy_shared_biases({**bert, "tie_word_embeddings": True}, names) == {}
    assert legacy_shared_biases({**bert, "tie_word_embeddings": False}, names[:1]) == {}  # no decoder bias stored
    gpt2 = {**GPT2Config(n_layer=1, n_embd=16, n_head=2).to_dict(), "architectures": ["GPT2LMHeadModel"],
            "tie_word_embeddings": False}
    assert legacy_shared_biases(gpt2, ["lm_head.weight", "transformer.wte.weight"]) == {}
