"""The compatibility matrix: stepmerge itself run in each tested transformers / peft environment (``make compat``).

Contract:
- `ENVIRONMENTS`: one row per environment: a label, the pins installed over the main environment (`tests.readers_env`'s
  builder: cached per machine, keyed by the pins; torch and everything else shared with the main environment,
  ``pip --no-deps`` from the registry, so no second torch is ever pulled), or None for the main (dev) environment.
  Each row of `merge_engine.versions.TESTED` has an environment at its ends (4.57.x: its last release, 4.57.6).
- ``python -m tests.compat_matrix [--workdir DIR] [--only LABEL,...] [--jobs N]``: writes the Megatron checkpoints
  once with the main environment (megatron-core is installed there only), runs `tests.compat_case` in each
  environment, N at a time (its own FSDP checkpoints written there by gloo ranks; check, merge FSDP1 / FSDP2 /
  Megatron legacy / dist, extract-lora, merge-lora, check-trained, extract-lora SVD), then holds each environment's
  Megatron merges to the newest's: every file but ``stepmerge.json`` byte-identical, logits equal. Then an
  environment holding an untested pair (`UNTESTED_PAIR`) must refuse a merge at start in one line (exit 1).
  Prints the matrix and the time each part took; exit 0 only when every cell passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASE_SCRIPT = Path(__file__).with_name("compat_case.py")
ROW_TIMEOUT_S = 1200  # one environment's row on a loaded 2-core machine
NEWEST = "newest"


@dataclass(frozen=True)
class Environment:
    label: str
    pins: tuple[str, ...] | None  # None: the main environment itself
    why: str


ENVIRONMENTS: tuple[Environment, ...] = (
    Environment("4.57", ("transformers==4.57.6", "peft==0.17.1", "tokenizers==0.22.2", "huggingface_hub==0.36.2"),
                "the lowest supported pair (transformers 4.x; also the readers' environment)"),
    Environment("4.57-pip", ("transformers==4.57.6", "peft==0.21.2", "tokenizers==0.22.2", "huggingface_hub==0.36.2"),
                "what `pip install` of the checkout resolves beside transformers 4.57 with peft not pinned (a verl 4.x "
                "environment): peft 0.21.2, hub 0.36.2, tokenizers 0.22.2 (pip install --dry-run --report)"),
    Environment("5.5.3", ("transformers==5.5.3", "peft==0.18.1", "tokenizers==0.22.2", "huggingface_hub==1.33.0",
                          "kernels==0.12.3"), "the lowest of verl 0.9.1's range"),
    Environment("5.10", ("transformers==5.10.4", "peft==0.19.1", "tokenizers==0.22.2", "huggingface_hub==1.33.0",
                         "kernels==0.12.3"), "verl 0.9.1's pin (>=5.5.3,<5.11)"),
    Environment("5.17", ("transformers==5.17.0", "peft==0.21.0", "huggingface_hub==1.33.0"),
                "the CUDA GPU workers' image"),
    Environment(NEWEST, None, "the main (dev) environment"),
)
# transformers 4.57 with peft 0.19: each is tested, the pair is not (peft 0.17 does not import under transformers 5)
UNTESTED_PAIR = ("compat-untested-4.57-peft0.19", ("transformers==4.57.6", "peft==0.19.1", "tokenizers==0.22.2",
                                                    "huggingface_hub==0.36.2"))
CELLS = ("check", "merge FSDP1", "merge FSDP2", "validate", "merge Megatron legacy", "merge Megatron dist",
         "extract-lora", "merge-lora", "check-trained", "extract-lora SVD")
MEGATRON_OUTPUTS = ("megatron_legacy", "megatron_dist")


def python_of(env: Environment) -> Path:
    from tests.readers_env import PINS, pinned_python

    if env.pins is None:
        return Path(sys.executable)
    return pinned_python("readers" if env.pins == PINS else f"compat-{env.label}", env.pins)


def write_megatron(root: Path) -> float:
    """TP 2 legacy ``mp_rank_*`` and TP 2 ``dist_ckpt`` (verl v2) Qwen2 steps with their references."""
    code = ("import sys; from pathlib import Path; from synthetic_runs.megatron import MegatronSpec, StepJob, "
            "write_megatron_steps; r = Path(sys.argv[1]); write_megatron_steps(["
            "StepJob(r / 'legacy/global_step_1', MegatronSpec(family='qwen2', tp=2, fmt='legacy'), 0, r / 'ref_legacy'), "
            "StepJob(r / 'dist/global_step_1', MegatronSpec(family='qwen2', tp=2, fmt='dist_v2'), 0, r / 'ref_dist')])")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(root)], cwd=REPO, check=True, env=_env(), timeout=ROW_TIMEOUT_S)
    return time.perf_counter() - started


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def run_row(env: Environment, workdir: Path, megatron: Path) -> dict:
    folder = workdir / env.label
    folder.mkdir(parents=True, exist_ok=True)
    results = folder / "results.json"
    done = subprocess.run([str(python_of(env)), str(CASE_SCRIPT), str(folder), str(megatron), str(results)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    (folder / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not results.exists():
        return {"error": f"the row's process failed ({done.returncode}):\n{done.stderr[-3000:]}"}
    return json.loads(results.read_text())


def same_as_newest(workdir: Path, label: str) -> list[str]:
    """Where ``label``'s Megatron merges differ from the newest environment's (files but stepmerge.json; logits)."""
    import torch

    problems = []
    for output in MEGATRON_OUTPUTS:
        mine, newest = workdir / label / "out" / output, workdir / NEWEST / "out" / output
        if not mine.is_dir() or not newest.is_dir():
            continue  # the merge itself failed: its cell says so
        names = sorted(p.name for p in mine.iterdir() if p.name != "stepmerge.json")
        if names != sorted(p.name for p in newest.iterdir() if p.name != "stepmerge.json"):
            problems.append(f"{output}: other files than the newest's")
        problems += [f"{output}/{name}: other bytes than the newest's" for name in names
                     if (mine / name).read_bytes() != (newest / name).read_bytes()]
        logits = [torch.load(folder.with_name(output + ".logits.pt")) for folder in (mine, newest)]
        if not torch.equal(*logits):
            problems.append(f"{output}: logits differ from the newest's by {(logits[0] - logits[1]).abs().max():.3g}")
    return problems


def refuses_untested(workdir: Path, megatron: Path) -> str | None:
    """None when the untested pair's environment refuses a merge in one line (exit 1), else what it did."""
    from tests.readers_env import pinned_python

    python = pinned_python(*UNTESTED_PAIR)
    target = workdir / "untested-out"
    done = subprocess.run([str(python), "-m", "merge_engine", "merge", "--local_dir",
                           str(megatron / "legacy" / "global_step_1" / "actor"), "--target_dir", str(target)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    lines = done.stderr.strip().splitlines()
    if done.returncode == 1 and len(lines) == 1 and "UnsupportedVersions" in lines[0] and not target.exists():
        print(f"untested pair refused at start: {lines[0]}")
        return None
    return f"exit {done.returncode}, stderr: {done.stderr[-1500:]}"


def print_matrix(rows: dict[str, dict], envs: list[Environment]) -> bool:
    header = f"{'environment':34s}" + "".join(f" {c:>{len(c)}s}" for c in CELLS) + "  same bytes  time"
    print(header)
    all_ok = True
    for env in envs:
        row = rows[env.label]
        if "error" in row:
            print(f"{env.label:34s} ROW FAILED: {row['error']}")
            all_ok = False
            continue
        versions = row["versions"]
        name = f"{env.label}: t {versions['transformers']} / peft {versions['peft']}"
        cells = row["cells"]
        marks = []
        for cell in CELLS:
            result = cells.get(cell)
            ok = bool(result and result["ok"])
            all_ok &= ok
            marks.append(f" {('ok' if ok else 'FAIL'):>{len(cell)}s}")
        same = row.get("same_as_newest", [])
        all_ok &= not same and cells.get("write FSDP", {}).get("ok", False)
        print(f"{name:34s}" + "".join(marks) + f"  {'ok' if not same else 'FAIL':>10s}  {row['seconds']:.0f} s")
    for env in envs:
        row = rows[env.label]
        for cell, result in row.get("cells", {}).items():
            if not result["ok"]:
                print(f"  {env.label} / {cell}: {result['detail']}")
        for problem in row.get("same_as_newest", []):
            print(f"  {env.label} / same bytes: {problem}")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compat_matrix", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="keep everything here (default: a temporary folder, removed)")
    parser.add_argument("--only", help="comma-separated environment labels (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="environments run at a time (default 2: one per core)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    envs = [e for e in ENVIRONMENTS if not args.only or e.label in args.only.split(",")]
    if NEWEST not in {e.label for e in envs}:
        envs.append(next(e for e in ENVIRONMENTS if e.label == NEWEST))  # the reference of "same bytes"
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="stepmerge-compat-"))
    try:
        from tests.readers_env import pinned_python

        for env in envs:
            print(f"environment {env.label} ({env.why}): {python_of(env)}", flush=True)
        print(f"untested pair's environment: {pinned_python(*UNTESTED_PAIR)}")
        print(f"environments ready at {time.perf_counter() - started:.0f} s", flush=True)
        megatron = workdir / "megatron"
        print(f"Megatron checkpoints written by the main environment in {write_megatron(megatron):.0f} s", flush=True)
        rows = {}
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each row is its own process
            running = {pool.submit(run_row, env, workdir, megatron): env for env in envs}
            for done in as_completed(running):
                env = running[done]
                rows[env.label] = done.result()
                print(f"row {env.label}: {rows[env.label].get('seconds', '-')} s", flush=True)
        for env in envs:
            if env.label != NEWEST and "error" not in rows[env.label]:
                rows[env.label]["same_as_newest"] = same_as_newest(workdir, env.label)
        ok = print_matrix(rows, envs)
        refused = refuses_untested(workdir, megatron)
        if refused is not None:
            print(f"the untested pair was NOT refused at start: {refused}")
            ok = False
        print(f"compatibility matrix: {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.0f} s "
              f"(workdir {workdir})")
        return 0 if ok else 1
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
