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
