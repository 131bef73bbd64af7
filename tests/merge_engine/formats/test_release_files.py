"""Which files of a model folder a release carries (`merge_engine.formats.hf_metadata.copy_metadata`).

- the model's own files are carried: tokenizer files, chat templates, generation / processor configs, and the custom
  code its ``auto_map`` names (config.json's, tokenizer_config.json's, preprocessor_config.json's), with the modules
  those import relatively;
- a ``.py`` nothing names is a script beside the checkpoint: not carried, one line told to the caller (the job's
  note); so is a module named by a ``repo--module.Class`` entry (another repository's code);
- a trainer's bookkeeping (`merge_engine.formats.trainer_files.TRAINER_FILES`) is never carried, one line each
  naming the trainer, weight-like names (``training_args.bin``, ``rng_state_0.pth``) included; none is a warning.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from merge_engine.formats.custom_code import auto_map_modules, relative_imports
from merge_engine.formats.hf_metadata import copy_metadata
from merge_engine.formats.trainer_files import TRAINER_FILES, trainer_file

CONFIG = {"model_type": "custom_lm", "architectures": ["CustomForCausalLM"],
          "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                       "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
                       "AutoModel": "other/repo--modeling_elsewhere.ElsewhereModel"}}
MODELS = {  # the model's own files: every one carried
    "tokenizer.json": "{}", "tokenizer.model": "spm", "vocab.json": "{}", "merges.txt": "", "added_tokens.json": "{}",
    "special_tokens_map.json": "{}", "chat_template.jinja": "{{ messages }}", "generation_config.json": "{}",
    "tokenizer_config.json": json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}}),
    "preprocessor_config.json": json.dumps({"auto_map": {"AutoImageProcessor": "image_custom.CustomImageProcessor"}}),
    "configuration_custom.py": "from transformers import PretrainedConfig\n",
    "modeling_custom.py": "from .configuration_custom import CustomConfig\nfrom .rotary_custom import rope\n",
    "rotary_custom.py": "import torch\n",  # named by no auto_map: imported relatively by modeling_custom.py
    "tokenization_custom.py": "", "image_custom.py": "",
}
SCRIPTS = {"train.py": "import os\n", "modeling_elsewhere.py": "", "helpers.py": ""}  # nothing local names them
TRAINERS = {"trainer_state.json": "{}", "training_args.bin": "x", "rng_state_0.pth": "x", "scheduler.pt": "x",
            "optimizer.pt": "x", "random_states_0.pkl": "x", "latest": "global_step1", "zero_to_fp32.py": "x",
            "latest_checkpointed_iteration.txt": "1", "optimizer.bin": "x"}


@pytest.fixture()
def folder(tmp_path):
    source = tmp_path / "checkpoint-1"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(CONFIG))
    for name, text in {**MODELS, **SCRIPTS, **TRAINERS}.items():
        (source / name).write_text(text)
    return source


def test_the_model_files_and_its_custom_code_are_carried_nothing_else(folder, tmp_path, caplog):
    target = tmp_path / "release"
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="merge_engine.formats.hf_metadata"):
        written = copy_metadata(str(folder), str(target), CONFIG, on_left_out=lines.append)
    assert set(os.listdir(target)) == set(MODELS) | {"config.json"}
    assert {name for name, _ in written} == set(MODELS) | {"config.json"}
    for name in MODELS:
        assert (target / name).read_text() == MODELS[name]
    assert not caplog.records  # told to the caller, not logged
    assert len(lines) == len(SCRIPTS) + len(TRAINERS)  # one line per file not carried
    for name in TRAINERS:
        (line,) = [line for line in lines if line.startswith(f"not copied: {name!r}")]
        assert trainer_file(name).trainer in line
    for name in SCRIPTS:
        (line,) = [line for line in lines if line.startswith(f"not copied: {name!r}")]
        assert "auto_map" in line


def test_without_a_caller_to_tell_each_file_left_out_is_logged_at_info(folder, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="merge_engine.formats.hf_metadata"):
        copy_metadata(str(folder), str(tmp_path / "release"), CONFIG)
    lines = [r.getMessage() for r in caplog.records if r.name == "merge_engine.formats.hf_metadata"]
    assert len(lines) == len(SCRIPTS) + len(TRAINERS)
    assert {r.levelno for r in caplog.records} == {logging.INFO}


def test_a_py_is_carried_only_when_auto_map_names_it(folder, tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "auto_map"}
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "preprocessor_config.json").write_text("not json")  # names nothing, copied as it is
    copy_metadata(str(folder), str(tmp_path / "release"), config)
    carried = set(os.listdir(tmp_path / "release"))
    assert not {n for n in carried if n.endswith(".py")}
    assert {"tokenizer_config.json", "preprocessor_config.json", "tokenizer.json"} <= carried


def test_auto_map_entries_name_local_modules_only():
    assert auto_map_modules(CONFIG) == {"configuration_custom.py", "modeling_custom.py"}
    assert auto_map_modules({"auto_map": {"AutoTokenizer": ["a.B", None, "r/x--c.D"], "X": "../evil.E",
                                          "Y": "a.b.C", "Z": 3}}) == {"a.py"}
    assert auto_map_modules({"auto_map": ["m.C"]}) == set()
    assert relative_imports("from .a import x\n  import .b\nfrom ..c import y\nfrom d import z\n") == {"a.py", "b.py"}


def test_every_row_names_a_trainer_and_matches_its_own_pattern():
    assert len({row.pattern for row in TRAINER_FILES}) == len(TRAINER_FILES)
    assert all(row.trainer and row.what for row in TRAINER_FILES)
    for legit in ("tokenizer.json", "config.json", "generation_config.json", "model.safetensors",
                  "pytorch_model.bin", "chat_template.jinja", "preprocessor_config.json", "adapter_model.bin"):
        assert trainer_file(legit) is None, legit
