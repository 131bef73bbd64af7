"""`python -m benchmarks.output_identity`: every output file of the command line's cases as (path, size, sha256).

Specification (on the smallest case, ``merge/hf_bf16``: the tiny Qwen2 folder re-written as bfloat16):
- a run records the case's command, exit code, stdout and every file it wrote; the temp dir's path is masked
  (``<WORK>``) and ``stepmerge.json`` is kept as JSON without only its volatile keys (`VOLATILE_KEYS`);
- ``--compare BASE --with NEW`` exits 0 on identical records and 1 on any difference, naming the case, the file
  and what differs: one flipped byte of a weights file, one changed non-volatile key of ``stepmerge.json``;
- a change of a volatile key alone (the source listing's fingerprint) is no difference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.output_identity import VOLATILE_KEYS, WORK_MARK, record_tree, run_all, select_cases

ROOT = Path(__file__).resolve().parents[2]
CASE = "merge/hf_bf16"


def compare(base: Path, new: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.output_identity", "--compare", str(base), "--with",
                           str(new)], cwd=ROOT, capture_output=True, text=True, timeout=60)


def rerecorded(record: dict, work: Path, out: Path, path: Path) -> Path:
    """``record`` with the case's files recorded again from disk, saved at ``path``."""
    again = json.loads(json.dumps(record))
    again["cases"][CASE]["files"] = record_tree(out, {str(work): WORK_MARK})
    path.write_text(json.dumps(again))
    return path


def test_compare_names_a_flipped_byte_and_a_changed_key_but_not_a_volatile_one(tmp_path):
    work = tmp_path / "work"
    record = run_all(select_cases(CASE), keep=work)
    case = record["cases"][CASE]
    assert case["exit_code"] == 0
    assert case["command"][:2] == ["merge_engine", "merge"] and f"{WORK_MARK}/in/hf/base" in case["command"]
    assert {"model.safetensors", "config.json", "stepmerge.json"} <= set(case["files"])
    provenance = case["files"]["stepmerge.json"]
    # the output names no path of the machine that wrote it: its source by its name, nothing to mask but the volatile
    assert provenance["normalized"] == ["volatile_keys"]
    assert provenance["json"]["source"] == "base" and "fingerprint" not in provenance["json"]
    assert provenance["json"]["options"]["dtype"] == "bfloat16"
    assert any(line.startswith("merged hf checkpoint") and "<T> s" in line for line in case["stdout"])
    base = tmp_path / "base.json"
    base.write_text(json.dumps(record))
    out = work / "out" / CASE.replace("/", "__")

    same = compare(base, rerecorded(record, work, out, tmp_path / "same.json"))
    assert same.returncode == 0, same.stdout

    # a volatile key changed: no difference
    assert ("stepmerge.json", "fingerprint") in VOLATILE_KEYS
    text = (out / "stepmerge.json").read_text()
    document = json.loads(text)
    (out / "stepmerge.json").write_text(text.replace(document["fingerprint"], "0" * 64))
    volatile = compare(base, rerecorded(record, work, out, tmp_path / "volatile.json"))
    assert volatile.returncode == 0, volatile.stdout

    # one flipped byte of the weights, one changed key of the provenance: both named
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (out / "stepmerge.json").write_text(text.replace('"tensors": 27', '"tensors": 28'))
    changed = compare(base, rerecorded(record, work, out, tmp_path / "changed.json"))
    assert changed.returncode == 1
    lines = changed.stdout.splitlines()
    assert any(line.startswith(f"[{CASE}] model.safetensors: sha256 ") for line in lines), changed.stdout
    assert f"[{CASE}] stepmerge.json: .tensors: 27 -> 28" in lines, changed.stdout
    assert lines[-1] == f"2 difference(s) against {base}"
