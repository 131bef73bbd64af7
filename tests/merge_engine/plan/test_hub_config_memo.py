"""`hub_config`'s answer kept per config: the next merge of a run's config asks transformers nothing.

Specification:
- the memo gives back exactly what `hub_config` computes (changes, updates, the note), for a config with
  changes (Qwen3-MoE, Qwen2-VL) and for one transformers cannot read (kept as "unread");
- a second ask, in a fresh interpreter, answers from the memo without importing transformers;
- another config, another transformers version or other rules' code is another key;
- an entry that does not parse is recomputed and rewritten; ``STEPMERGE_CACHE_DIR=`` writes nothing;
  an unwritable folder only costs the computation;
- a refusal (`InvalidConfig`) is never kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from merge_engine.errors import InvalidConfig
from merge_engine.plan import hub_config as rules
from merge_engine.plan import hub_config_memo as memo
from synthetic_runs.models import ModelSpec, build_config

REPO = Path(__file__).resolve().parents[3]


def _v5_config(family: str, **spec) -> dict:
    return build_config(ModelSpec(family=family, **spec)).to_diff_dict()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "hub_config"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_vl"])
def test_the_memo_answers_what_hub_config_computes(cache, family):
    config = _v5_config(family)
    computed = rules.hub_config(config)
    assert computed.changes  # a config with something to add
    first, second = memo.hub_config_memo(config), memo.hub_config_memo(config)
    assert first == computed and second == computed and second.describe() == computed.describe()
    [entry] = cache.glob("*.json")
    assert entry.name == memo.memo_key(config) + ".json"


def test_a_config_transformers_cannot_read_is_kept_as_unread(cache):
    config = {"model_type": "no_such_model_type", "hidden_size": 8}
    assert memo.hub_config_memo(config) == rules.hub_config(config) == memo.hub_config_memo(config)
    assert memo.hub_config_memo(config).unread


def test_a_second_ask_in_a_fresh_interpreter_imports_no_transformers(cache):
    config = _v5_config("qwen3_moe")
    expected = memo.hub_config_memo(config)
    code = ("import json, sys; from merge_engine.plan.hub_config_memo import hub_config_memo; "
            "a = hub_config_memo(json.loads(sys.argv[1])); "
            "print(json.dumps({'transformers': 'transformers' in sys.modules, 'updates': a.updates, "
            "'changes': [c.to_json() for c in a.changes]}))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(config)], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert answer["transformers"] is False
    assert answer["updates"] == expected.updates
    assert answer["changes"] == [c.to_json() for c in expected.changes]


def test_the_key_is_the_config_the_transformers_version_and_the_rules_code(cache, monkeypatch, tmp_path):
    config = _v5_config("qwen3_moe")
    key = memo.memo_key(config)
    assert memo.memo_key({**config, "num_local_experts": 8}) != key
    assert memo.memo_key(dict(reversed(list(config.items())))) == key  # the order of keys is not the config

    real_version = metadata.version
    monkeypatch.setattr(memo.metadata, "version", lambda name: "9.9.9" if name == "transformers" else real_version(name))
    assert memo.memo_key(config) != key
    monkeypatch.setattr(memo.metadata, "version", real_version)

    edited = tmp_path / "hub_config.py"
    edited.write_bytes(Path(rules.__file__).read_bytes() + b"\n# another rule\n")
    monkeypatch.setattr(memo.rules, "__file__", str(edited))
    assert memo.memo_key(config) != key


def test_an_entry_that_does_not_parse_is_recomputed_and_rewritten(cache):
    config = _v5_config("qwen3_moe")
    computed = memo.hub_config_memo(config)
    entry = cache / (memo.memo_key(config) + ".json")
    for broken in ("{not json", json.dumps({"format": 1, "changes": [{"key": "x"}], "updates": {}, "unread": None}),
                   json.dumps({"format": 99, "changes": [], "updates": {}, "unread": None})):
        entry.write_text(broken)
        assert memo.hub_config_memo(config) == computed
        assert json.loads(entry.read_text())["changes"] == [c.to_json() for c in computed.changes]


def test_an_empty_cache_dir_setting_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(memo.CACHE_ENV, "")
    monkeypatch.chdir(tmp_path)
    config = _v5_config("qwen3_moe")
    assert memo.cache_dir() is None
    assert memo.hub_config_memo(config) == rules.hub_config(config)
    assert not list(tmp_path.rglob("*.json"))


def test_an_unwritable_folder_only_costs_the_computation(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(memo.CACHE_ENV, str(blocker))
    config = _v5_config("qwen3_moe")
    assert memo.hub_config_memo(config) == rules.hub_config(config)


def test_a_refusal_is_never_kept(cache, monkeypatch):
    config = _v5_config("qwen3_moe")

    def refuse(_config):
        raise InvalidConfig("the Hub form would change what transformers 5 reads")

    monkeypatch.setattr(memo.rules, "hub_config", refuse)
    with pytest.raises(InvalidConfig):
        memo.hub_config_memo(config)
    assert not cache.exists() or not list(cache.glob("*.json"))


# --- a cache entry is read like a stored result -------------------------------------------------------------


def _planted(config: dict, edit) -> dict:
    """The entry the memo keeps for ``config``, as the memo itself writes it, then changed by ``edit``."""
    answer = rules.hub_config(config)
    entry = {"format": memo.ENTRY_FORMAT, "key": memo.memo_key(config), "updates": answer.updates,
             "unread": answer.unread, "changes": [c.to_json() for c in answer.changes]}
    edit(entry)
    return entry


def _auto_map(entry: dict) -> None:
    entry["updates"]["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    entry["changes"].append({"key": "auto_map", "value": entry["updates"]["auto_map"], "from": "x"})


def _hidden_size(entry: dict) -> None:
    entry["updates"]["hidden_size"] = 12
    entry["changes"].append({"key": "hidden_size", "value": 12, "from": "x"})


def _updates_only(entry: dict) -> None:
    entry["updates"]["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}  # no change names it


def _dotted_value(entry: dict) -> None:
    entry["changes"][0]["value"] = "modeling_evil.EvilModel"
    entry["updates"][entry["changes"][0]["key"]] = "modeling_evil.EvilModel"


def _other_key(entry: dict) -> None:
    entry.update(_planted(_v5_config("qwen2"), lambda other: None))  # another config's entry, copied over


@pytest.mark.parametrize("edit", [_auto_map, _hidden_size, _updates_only, _dotted_value, _other_key],
                         ids=["auto_map", "hidden_size", "updates_only", "dotted_value", "other_key"])
def test_a_planted_entry_adding_code_or_changing_a_value_is_not_used(cache, edit):
    """An entry at the config's very key that adds ``auto_map`` (remote code), changes ``hidden_size``, carries an
    update no change names, writes a class reference, or is another config's entry: ignored, computed again
    and rewritten (before: its updates were laid over the published config)."""
    config = _v5_config("qwen3_moe")
    computed = rules.hub_config(config)
    cache.mkdir(parents=True)
    entry = cache / (memo.memo_key(config) + ".json")
    entry.write_text(json.dumps(_planted(config, edit)))
    answer = memo.hub_config_memo(config)
    assert answer == computed and "auto_map" not in answer.updates and "hidden_size" not in answer.updates
    assert json.loads(entry.read_text())["updates"] == computed.updates  # rewritten as computed


def test_an_entry_another_user_may_write_or_a_link_is_not_used(cache, tmp_path):
    """The answer a translation may give is taken only from a file this user alone may write."""
    config = _v5_config("qwen3_moe")
    computed = memo.hub_config_memo(config)
    entry = cache / (memo.memo_key(config) + ".json")
    assert memo.trusted_entry(entry)
    entry.chmod(0o666)
    assert not memo.trusted_entry(entry)
    entry.chmod(0o600)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(entry.read_text())
    entry.unlink()
    entry.symlink_to(elsewhere)
    assert not memo.trusted_entry(entry) and memo.hub_config_memo(config) == computed


def test_a_planted_entry_puts_no_remote_code_into_a_merged_release(fsdp_runs, tmp_path, monkeypatch):
    """End to end: ``stepmerge merge`` once (the memo keeps its answer), the kept entry edited to add ``auto_map``
    and another ``hidden_size``, then a second merge of the same checkpoint: its ``config.json`` holds neither
    (before: both were published)."""
    import shutil

    from merge_engine.cli import main as stepmerge

    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path / "cache"))
    checkpoint = tmp_path / "actor"
    shutil.copytree(fsdp_runs["fsdp2_qwen2"].latest.checkpoint_dir, checkpoint)
    assert stepmerge(["merge", "--local_dir", str(checkpoint), "--target_dir", str(tmp_path / "first")]) == 0
    first = json.loads((tmp_path / "first" / "config.json").read_text())
    [entry] = (tmp_path / "cache" / "hub_config").glob("*.json")
    kept = json.loads(entry.read_text())
    kept["updates"].update(auto_map={"AutoModelForCausalLM": "modeling_evil.EvilModel"},
                           hidden_size=first["hidden_size"] * 2)
    kept["changes"] += [{"key": "auto_map", "value": kept["updates"]["auto_map"], "from": "x"},
                        {"key": "hidden_size", "value": first["hidden_size"] * 2, "from": "x"}]
    entry.write_text(json.dumps(kept))

    assert stepmerge(["merge", "--local_dir", str(checkpoint), "--target_dir", str(tmp_path / "second")]) == 0
    second = json.loads((tmp_path / "second" / "config.json").read_text())
    assert "auto_map" not in second and second["hidden_size"] == first["hidden_size"]
    assert second == first


@pytest.mark.parametrize("forge", ["tie_of_another_shape", "tie_to_no_tensor", "other_key", "negative_dim"])
def test_a_planted_model_shapes_entry_is_not_used(tmp_path, monkeypatch, forge):
    """The model_shapes memo is read the same way: an entry at the config's key whose tie joins tensors of other
    shapes or a name the model does not hold (a tie drops a weight from the output), whose key is another
    config's, or whose shapes are not dimensions, is ignored and computed again."""
    from merge_engine.plan import model_shapes

    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path / "cache"))
    config = {**_v5_config("qwen2"), "tie_word_embeddings": False}
    shapes, ties = model_shapes.model_shapes(config), model_shapes.model_ties(config)
    [entry] = (tmp_path / "cache" / "model_shapes").glob("*.json")
    kept = json.loads(entry.read_text())
    kept["ties"] = {"tie_of_another_shape": [{"lm_head.weight": "model.norm.weight"}],
                    "tie_to_no_tensor": [{"lm_head.weight": "model.no_such.weight"}]}.get(forge, kept["ties"])
    if forge == "other_key":
        kept["ties"] = [{"lm_head.weight": "model.embed_tokens.weight"}]
        kept["key"] = "0" * 64
    if forge == "negative_dim":
        kept["shapes"]["lm_head.weight"] = [[-1, 8]]
    entry.write_text(json.dumps(kept))
    assert model_shapes.model_ties(config) == ties and model_shapes.model_shapes(config) == shapes
