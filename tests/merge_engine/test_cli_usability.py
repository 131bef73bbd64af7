"""The command line as a new user meets it (issue 11, point 11): typos named, no abbreviations,
``--version``, exit codes in ``check --help``, one dtype vocabulary recorded canonically, MB everywhere.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from merge_engine.cli import _progress, build_parser, main
from merge_engine.option_values import DTYPE_SPELLINGS

VARIANT = "fsdp2_qwen2"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "merge_engine", *argv], capture_output=True, text=True, timeout=120)


def test_a_misspelled_flag_is_named_with_its_closest_spelling():
    """argparse alone said "the following arguments are required: --local_dir" and never named the typo."""
    proc = _run("merge", "--local-dri", "/ckpt", "--target_dir", "/out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "stepmerge merge: error: unrecognized flag --local-dri (did you mean --local-dir?)"


def test_flags_are_never_abbreviated(capsys):
    """``--local`` is not silently taken for ``--local_dir`` (a later flag could make it ambiguous)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["check", "--local", "/ckpt"])
    assert exited.value.code == 2
    assert "unrecognized flag --local" in capsys.readouterr().err


def test_version():
    from merge_engine import __version__

    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"stepmerge {__version__}"


def test_check_help_lists_its_exit_codes():
    proc = _run("check", "--help")
    assert proc.returncode == 0
    codes = {line.split()[0] for line in proc.stdout.split("exit codes:", 1)[1].splitlines()
             if re.match(r"^  \d ", line)}  # a code's line (its explanation may go on below it)
    assert codes == {"0", "1", "2", "3", "4", "6"}  # 1: storage or machine; 6: a damaged release (issue 20)


@pytest.mark.parametrize("spelling", sorted(DTYPE_SPELLINGS))
def test_every_dtype_spelling_is_read_as_its_canonical_name(spelling):
    for command in (["merge", "--target_dir", "/out", "--local_dir", "/c"], ["split", "--hf-dir", "/h",
                                                                            "--target_dir", "/out"]):
        args = build_parser().parse_args([*command, "--dtype", spelling.upper()])
        assert args.dtype == DTYPE_SPELLINGS[spelling]


def test_an_unknown_dtype_lists_the_spellings(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["merge", "--local_dir", "/c", "--target_dir", "/o", "--dtype", "fp17"])
    err = capsys.readouterr().err
    assert "unknown dtype 'fp17'" in err and "bf16" in err and "float32" in err


def test_a_merge_records_the_canonical_dtype(fsdp_runs, tmp_path):
    source = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, source)
    assert main(["merge", "--backend", "fsdp", "--local_dir", str(source), "--target_dir", str(tmp_path / "out"),
                 "--dtype", "fp16"]) == 0
    provenance = json.loads((tmp_path / "out" / "stepmerge.json").read_text())
    assert provenance["options"]["dtype"] == "float16"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float16"


def test_progress_counts_decimal_megabytes_like_the_messages():
    """The bar said 1.43MB for 1.5 MB (MiB under an MB label) beside "1.5 MB" in the text."""
    out = io.StringIO()
    bar = _progress(3_000_000, "merge", file=out, disable=False)
    bar.update(1_500_000)
    bar.close()
    assert re.search(r"1\.50MB?/3\.00MB?", out.getvalue()), out.getvalue()  # MiB would read 1.43M/2.86M


def test_discover_of_a_missing_run_root_fails_naming_it(tmp_path):
    proc = _run("discover", "--run-root", str(tmp_path / "exp1n"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"stepmerge: error: RunRootNotFound: no files under this run root: it does not "
                                   f"exist (a typo?) or nothing was written there yet [{tmp_path / 'exp1n'}]")


def test_file_urls_on_the_command_line_follow_rfc_8089(fsdp_runs, tmp_path, capsys):
    """Issue 17 point 6: ``file:/x`` (no authority) reads /x, ``FILE://localhost/x`` writes /x (not
    ``/localhost/x``, not a ValueError traceback); ``file://otherhost/x`` is one line naming the URL,
    exit 2, nothing written anywhere."""
    source = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, source)
    assert main(["merge", "--backend", "fsdp", "--local_dir", f"file:{source}",
                 "--target_dir", f"FILE://localhost{tmp_path}/out"]) == 0
    assert (tmp_path / "out" / "stepmerge.json").is_file() and not os.path.exists(f"/localhost{tmp_path}")
    capsys.readouterr()
    assert main(["merge", "--backend", "fsdp", "--local_dir", str(source), "--target_dir", "file://otherhost/out"]) == 2
    err = capsys.readouterr().err
    assert "otherhost" in err and "Traceback" not in err and not os.path.exists("/otherhost")


# --- issue 20, the low items of the command line -----------------------------------------------------------------


def test_a_step_folder_given_for_its_actor_folder_is_answered_with_did_you_mean(fsdp_runs, tmp_path, capsys):
    step = tmp_path / "global_step_7"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, step / "actor")
    assert main(["check", "--local_dir", str(step)]) == 2
    err = capsys.readouterr().err
    assert f"(did you mean {step}/actor?)" in err
    assert main(["check", "--local_dir", str(tmp_path)]) == 2  # the run root: two levels down
    assert f"(did you mean {step}/actor?)" in capsys.readouterr().err


def test_a_merge_prints_in_order_through_one_pipe_and_never_a_zero_rate(fsdp_runs, tmp_path):
    """stderr (the plan) and stdout (the result) interleaved wrongly through ``2>&1 | tee``; a small merge said
    ``(0 MB/s)``."""
    source = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, source)
    proc = subprocess.run([sys.executable, "-m", "merge_engine", "merge", "--local_dir", str(source), "--target_dir",
                           str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:]
    planned = next(i for i, line in enumerate(lines) if line.startswith("planned "))
    merged = next(i for i, line in enumerate(lines) if line.startswith("merged "))
    assert planned < merged
    assert "(0 MB/s)" not in lines[merged] and re.search(r"\((\d+(\.\d)? MB|\d+ kB)/s\)$", lines[merged])


def test_rates_are_never_printed_as_zero():
    from merge_engine.cli import rate_text

    assert rate_text(2_000, 1.0) == "2 kB/s" and rate_text(3_400_000, 1.0) == "3.4 MB/s"
    assert rate_text(812_000_000, 1.0) == "812 MB/s"


def test_the_test_command_prints_plain_text_not_markdown():
    from merge_engine.validate.report import Check, ValidationReport

    report = ValidationReport("/out", (Check("keys", True), Check("values", False, "x differs"),
                                       Check("trained", True, "too big for this worker", skipped=True)), "/ref")
    text = report.text()
    assert "**" not in text and "`" not in text
    assert text.splitlines() == ["validation FAILED (1/3 checks, 1 skipped) of /out against reference /ref",
                                 "  PASS keys", "  FAIL values: x differs", "  SKIP trained: too big for this worker"]


def test_check_of_a_layout_without_parallel_sizes_prints_no_stray_punctuation(tmp_path, capsys):
    """A Hugging Face folder has no world size: `check` printed "(; 2 files, ...)"."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    code = main(["check", "--local_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "(;" not in out, out
    assert code == 0 and re.search(r"checkpoint at \S+ \(\d+ files, ", out), out
