"""The regular expressions of an adapter config, held to a subset that matches in bounded time
(`merge_engine.lora.user_patterns`).

Specification: every pattern PEFT, verl and their users write (plain names, ``all-linear``, alternations of
projections, a negative look-ahead excluding a vision tower, PEFT's own ``(.*\\.)?`` wrapper) is matched as
before; a pattern with nested repeats (``(.*.*)*y``, ``(a|a)*b``), a back-reference, too many unbounded
repeats, too many characters or invalid syntax is an `AdapterError` naming the field, the pattern cut to one
bounded line and the adapter, raised within seconds (it would hang a merge otherwise), with nothing written;
in a merged adapter's config, in a training run's recorded adapter config, and on the command line alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal

import pytest

from merge_engine.cli import main
from merge_engine.commands.combine import merge_lora
from merge_engine.errors import AdapterError
from merge_engine.lora.checkpoint import read_run_metadata
from merge_engine.lora.config import pattern_key, targets
from merge_engine.lora.user_patterns import SHOWN_CHARS, pattern_fault
from merge_engine.storage import FileEntry
from tests.merge_engine.lora.test_bad_input import assert_nothing_written, edited_adapter

HOSTILE = "(.*.*)*y"
MODULES = [f"model.layers.{i}.{part}" for i in (0, 1, 11) for part in (
    "self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "visual.blocks.0.attn.q_proj")]


@contextlib.contextmanager
def deadline(seconds: int):
    """TimeoutError if the block runs longer than ``seconds`` (`re` checks signals while it backtracks)."""
    def expire(_signum, _frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("pattern", [
    "q_proj", "all-linear", "model.layers.0.self_attn.q_proj", r".*\.(q_proj|v_proj)",
    r"^(?!.*visual).*(q_proj|v_proj)", r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj", r"model\.layers\.1\d*\..*",
    r"(.*\.)?q_proj", r".*[^.]+\.mlp\..*_proj", r"layers\.[0-9]{1,3}\.mlp",
])
def test_the_patterns_peft_users_write_are_matched_as_peft_does(pattern):
    assert pattern_fault(pattern) is None
    assert [m for m in MODULES if targets(pattern, m)] == [m for m in MODULES if re.fullmatch(pattern, m)]
    assert [m for m in MODULES if pattern_key([pattern], m)] == \
        [m for m in MODULES if re.match(rf"(.*\.)?({pattern})$", m)]


@pytest.mark.parametrize("pattern, fault", [
    (HOSTILE, "nested repeats"), ("(a|a)*b", "nested repeats"), (r"(\w+\.)+y", "nested repeats"),
    ("((.*)?)*y", "nested repeats"), (r"(\w+)\.\1", "back-reference"), (r"(a)?(?(1)b|c)", "back-reference"),
    (".*.*.*.*y", "more than 3 unbounded"), ("q" * 5000, "longer than"), ("(q_proj", "not a valid"),
])
def test_patterns_that_backtrack_without_bound_are_refused(pattern, fault):
    assert fault in pattern_fault(pattern)


@pytest.mark.parametrize("field, value", [
    ("target_modules", HOSTILE), ("exclude_modules", HOSTILE), ("rank_pattern", {HOSTILE: 4}),
    ("alpha_pattern", {HOSTILE: 8}), ("modules_to_save", [HOSTILE]),
])
def test_a_hostile_adapter_pattern_is_refused_within_seconds(tmp_path, tiny_base, peft_adapters, field, value):
    """Before, ``(.*.*)*y`` in any of these fields hung merge-lora (exponential backtracking per module)."""
    bad = edited_adapter(peft_adapters["qv"], tmp_path / "hostile", config={field: value})
    with deadline(30), pytest.raises(AdapterError, match=re.escape(field)) as refused:
        merge_lora(tiny_base, [bad], str(tmp_path / "out"))
    assert refused.value.path == bad and HOSTILE in refused.value.message
    assert_nothing_written(tmp_path / "out")


def test_a_hostile_pattern_in_a_run_config_is_refused(tmp_path):
    """A training run's own adapter config (handed to PEFT to resolve each module's rank) is checked too."""
    (tmp_path / "lora_adapter").mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
              "rank_pattern": {HOSTILE: 4}}
    (tmp_path / "lora_adapter" / "adapter_config.json").write_text(json.dumps(config))
    listing = [FileEntry("lora_adapter/adapter_config.json", 1, "")]
    with deadline(30), pytest.raises(AdapterError, match="rank_pattern") as refused:
        read_run_metadata(str(tmp_path), listing)
    assert refused.value.path.endswith("lora_adapter/adapter_config.json")


def test_the_cli_names_a_long_pattern_on_one_bounded_line(tmp_path, tiny_base, peft_adapters, capsys):
    long = "(" + "x" * 100_000 + "+)+y"
    bad = edited_adapter(peft_adapters["qv"], tmp_path / "long", config={"target_modules": long})
    with deadline(30):
        code = main(["merge-lora", "--base-model", tiny_base, "--lora-adapter", bad,
                     "--target-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "AdapterError" in err[0] and bad in err[0]
    assert len(err[0]) < 2 * SHOWN_CHARS + 400 + len(bad)
    assert_nothing_written(tmp_path / "out")
    assert os.path.isdir(bad)
