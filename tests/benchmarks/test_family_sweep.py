"""`benchmarks.family_sweep` on a fixed sample of the registry: what the whole sweep checks, in the suite.

Specification (each family built from its tiny config, written as a real FSDP2 checkpoint of world 2 over
gloo, merged with the default options, in one sweep per session):
- every sampled family is built, merged, bit-exact against ``save_pretrained`` of the model (same names, but
  the vision tower's ``vision_model.`` prefix the Hub holds and transformers 5 leaves out: Gemma 3, LLaVA),
  and loads in transformers 5 with no missing / unexpected / mismatched key and the model's logits exactly:
  Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text; q_proj carries the attention gate: no false `InvalidConfig`),
  Kimi-K2.5 (its vision ``wqkv`` computed as transformers' own reverse conversion computes it), Gemma 3 and
  LLaVA (vision-language), Mixtral (MoE), OLMo-3;
- in transformers 4.57 (`tests.readers_env`), every sampled family 4.57 knows loads cleanly with the logits
  within the readers' tolerance, except those in `KNOWN_457_GAPS`, which fail as said there (a gap closed
  turns its test red: take it out of the list); a family 4.57 does not know is ``n/a`` (None), never passed,
  and its ``stepmerge.json`` says that 4.x readers cannot load it (`merge_engine.plan.legacy_readers`);
- a family whose config states ``tie_word_embeddings`` is swept once per value (`variants`: the class's default
  under the family's name, the other value as a row of its own), and the other value merges as the default does
  (Mixtral tied: the tied head not written, checked against the embedding, the model's logits exactly);
- the table counts what it shows, a column saying each row's tie.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.family_sweep import FamilyResult, count, sweep, table, variants

SAMPLE = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_k25", "gemma3", "llava", "mixtral", "olmo3")
NEW_IN_5 = {"qwen3_5_text", "qwen3_5_moe_text", "kimi_k25"}  # model types transformers 4.57 does not have
# family -> what 4.57 makes of the folder today
KNOWN_457_GAPS: dict[str, str] = {}  # OLMo-3's per-layer-type rope is written as 4.57's rope_theta (hub_config)
FLIPPED = ("mixtral",)  # families also swept with the other tie_word_embeddings than their class's default


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, readers_python) -> dict[str, FamilyResult]:
    from synthetic_runs.tiny_configs import registry_families

    families = [f for f in registry_families() if f.model_type in SAMPLE]
    assert sorted(f.model_type for f in families) == sorted(SAMPLE)
    rows = [v for v in variants(families) if not v.flipped or v.family.model_type in FLIPPED]
    results = sweep(rows, tmp_path_factory.mktemp("family_sweep"), Path(readers_python), log=lambda _: None)
    return {r.model_type if " [" not in r.family else r.family: r for r in results}


def test_a_family_with_a_tie_switch_is_a_row_per_value():
    from synthetic_runs.tiny_configs import registry_families, stated_tie, tiny_config

    families = [f for f in registry_families() if f.model_type in ("mixtral", "gemma3", "qwen3_vl")]
    rows = variants(families)
    assert [(v.name, v.tied) for v in rows] == [
        ("gemma3", True), ("gemma3 [tie_word_embeddings=false]", False),
        ("mixtral", False), ("mixtral [tie_word_embeddings=true]", True),
        ("qwen3_vl (Qwen3VLForConditionalGeneration)", False),
        ("qwen3_vl (Qwen3VLForConditionalGeneration) [tie_word_embeddings=true]", True)]
    for v in rows:  # the value is the config's, top level and text_config alike
        config = tiny_config(v.family, v.tied)
        assert stated_tie(config) is v.tied and config.get("text_config", {}).get("tie_word_embeddings", v.tied) is v.tied


def test_the_other_tie_merges_as_the_default_does(sampled):
    result = sampled["mixtral [tie_word_embeddings=true]"]
    assert result.tied is True and result.built and result.merged and result.exact and result.loads_5x, result.reasons
    assert result.loads_457 is True, result.reasons


@pytest.mark.parametrize("model_type", SAMPLE)
def test_each_family_merges_exactly_and_loads_in_transformers_5(sampled, model_type):
    result = sampled[model_type]
    assert result.built and result.merged, result.reasons
    assert result.exact, result.reasons
    assert result.loads_5x, result.reasons


@pytest.mark.parametrize("model_type", SAMPLE)
def test_transformers_4_57_reads_what_it_knows(sampled, model_type):
    result = sampled[model_type]
    if model_type in NEW_IN_5:
        assert result.loads_457 is None and "has no model type" in result.details["4.57"], result
        assert "4.x readers cannot load this folder" in result.details["stepmerge.json transformers_4"], result
        return
    assert "stepmerge.json transformers_4" not in result.details, result
    if model_type in KNOWN_457_GAPS:
        assert result.loads_457 is False and KNOWN_457_GAPS[model_type] in result.reasons["4.57"], result
    else:
        assert result.loads_457 is True, result.reasons


def test_the_counts_are_the_table(sampled):
    results = list(sampled.values())
    counts = count(results)
    assert counts["families"] == len(SAMPLE) + len(FLIPPED) and counts["tie variants"] == len(FLIPPED)
    assert counts["exact yes"] == sum(r.exact is True for r in results)
    assert counts["4.57 n/a"] == len(NEW_IN_5)
    assert counts["passed"] == len(SAMPLE) + len(FLIPPED) - len(KNOWN_457_GAPS)
    lines = table(results).splitlines()
    assert len(lines) == len(results) + 1
    assert lines[0].split()[1:] == ["tied", "built", "merged", "exact", "5.x", "4.57"]


@pytest.mark.parametrize("model_type", ["gemma3", "llava"])
def test_a_vlm_vision_tower_is_written_under_the_hub_names_4_57_reads(sampled, model_type):
    """transformers 5's save_pretrained drops the vision tower's ``vision_model.`` prefix; the Hub holds it."""
    result = sampled[model_type]
    assert result.details.get("hub_prefix_restored", 0) > 0 and result.loads_457 is True, result


def test_the_readme_family_list_is_the_sweeps_result():
    """README's family list is docs/families.md, rendered from the sweep's JSON (docs/family_sweep.json), not typed."""
    import json

    from benchmarks.family_sweep import markdown, readme_summary

    docs = Path(__file__).resolve().parents[2] / "docs"
    data = json.loads((docs / "family_sweep.json").read_text())
    assert (docs / "families.md").read_text() == markdown(data)
    assert data["counts"] == count([FamilyResult(**{k: v for k, v in row.items()}) for row in data["families"]])
    readme = (docs.parent / "README.md").read_text()
    assert "docs/families.md" in readme
    assert readme_summary(data) in " ".join(readme.split()), "README's sweep sentence is not the sweep's counts"
