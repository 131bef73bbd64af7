"""Benchmark: stepmerge against each trainer's own consolidator, side by side in one run, on the same inputs.

    python -m benchmarks.trainer_peers                  # the 2.5 GB benchmark model
    python -m benchmarks.trainer_peers --size 236m      # 0.95 GB of fp32 weights for every peer
    python -m benchmarks.trainer_peers --size tiny      # the suite's tiny Qwen2 (seconds)
    python -m benchmarks.trainer_peers --peers dcp_hf,zero --repeats 3

Pairs (each input written once by the trainer's own library, cached under ./.bench/peers/<size>/):
- ``accelerate``: Accelerate's FSDP2 ``SHARDED_STATE_DICT`` save (``checkpoint-1/pytorch_model_fsdp_0/``, written
  by Accelerate's ``save_fsdp_model`` over gloo ranks (`DCP_WORLD`), `synthetic_runs.fsdp`) ->
  ``accelerate merge-weights`` against ``stepmerge merge --hf_model_path`` (HF Trainer saves no config with that
  state dict type);
- ``dcp_hf``: torch's ``HuggingFaceStorageWriter(save_distributed=True)`` rank files (2 output files) ->
  torch's ``consolidate_safetensors_files`` (the writer's ``fqn_to_index_mapping``, read back from the rank
  files' headers; ``num_threads`` = this machine's cores) against ``stepmerge merge``;
- ``zero``: DeepSpeed ZeRO-2 bf16 (2 ranks on DeepSpeed's CPU accelerator, one step of plain SGD as the client
  optimizer, a bare engine's ``global_step1/``, `synthetic_runs.deepspeed`) -> DeepSpeed's own ``zero_to_fp32.py``
  (the copy DeepSpeed saved beside the tag, ``--safe_serialization``) against ``stepmerge merge --hf_model_path``.
  SGD without momentum keeps no state beyond the fp32 master partitions, so the 2.5 GB model is written with
  7.1 GB at most in any one process (with AdamW's two moments the ranks held ~25 GB); the optim files hold what
  any optimizer's hold, the fp32 partitions the tools read.

Each tool runs in a child process of its own from a warm page cache (the input's files read once before each
run), alternating within a repeat; wall time, peak RSS (ru_maxrss from wait4) and CPU seconds are recorded
(`benchmarks.harness.measure`); stepmerge runs as a run's first step (no memo of the config's Hub form: it asks
transformers for the model's ties) and as its next step (the memo one unmeasured merge wrote: what a watcher
merging a run's steps pays). After the first repeat both of stepmerge's outputs are compared with the peer's tensor
for tensor (names, dtypes, shapes, values bit for bit: every tool keeps the stored fp32), in a child, one tensor at
a time. The table gives medians, stepmerge / peer ratios against the goal (<= 0.5 wall and RSS), the time to read
the input once (``cat``, warm), the floor (`floor`: ``import torch``, and the input's value bytes read, written and
hashed once) and the load average at the start and the end.
This parent never imports torch (a forked child's ru_maxrss starts from its parent's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import BENCH, Run, measure, median

GOAL = 0.5
PEERS = ("accelerate", "dcp_hf", "zero")
TOOLS = ("stepmerge", "stepmerge_next", "peer")  # measured in this order within each repeat
TOOL_LABELS = {"stepmerge": "stepmerge merge (a run's first step)", "stepmerge_next": "stepmerge merge (its next step)"}
QWEN2_05B = dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, tie_word_embeddings=False)
# ModelSpec fields ({}: the suite's tiny Qwen2). 236m: the 0.5b shape with a 32000-word vocabulary and 12 layers,
# 0.95 GB of fp32 weights (what this 24 GB machine, shared, can write with every trainer's library)
SIZES = {"tiny": {}, "236m": {**QWEN2_05B, "vocab_size": 32000, "num_layers": 12}, "0.5b": QWEN2_05B}
DCP_WORLD = 2  # ranks writing each input (each holds its shard plus one full tensor while filling it)
STEP_FOLDERS = {"accelerate": "checkpoint-1", "dcp_hf": "step-1"}


@dataclass(frozen=True)
class Pair:
    """One peer's input and the two commands measured on it (``{out}`` stands for the output folder)."""

    peer: str
    label: str  # the peer tool, as the table names it
    input_dir: Path  # the folder whose files are read (warmed before each run)
    stepmerge: list[str]
    tool: list[str]
    data_glob: str = "*"  # the input files the output's values come from (what `floor` copies)


def root(size: str) -> Path:
    return BENCH / "peers" / size


def hf_dir(size: str) -> Path:
    """The DCP model's config and tokenizer (no weights): what a SHARDED_STATE_DICT step is merged with."""
    return root(size) / "hf"


def write_input(peer: str, size: str) -> None:
    """Write ``peer``'s input with the trainer's own library (run in a child: see the module docstring)."""
    from synthetic_runs.models import ModelSpec, write_hf_metadata

    folder = root(size) / peer
    shutil.rmtree(folder, ignore_errors=True)
    if peer == "zero":
        from synthetic_runs.deepspeed import ZeroSpec, write_zero_run

        spec = ZeroSpec(model=ModelSpec(**SIZES[size]), world_size=DCP_WORLD, stage=2, dtype="bfloat16",
                        trainer="deepspeed", optimizer="SGD")
        write_zero_run(folder / "run", spec, steps=(1,), reference_root=folder / "reference", timeout_s=3000)
    else:
        from synthetic_runs.fsdp import FsdpSpec, StepJob, write_fsdp_steps

        spec = FsdpSpec(model=ModelSpec(**SIZES[size]), world_size=DCP_WORLD, role="", writer=peer,
                        save_contents=("model",))  # no optimizer state: the ranks hold their shards only
        write_fsdp_steps([StepJob(str(folder / "run" / STEP_FOLDERS[peer]), spec, seed=0)], timeout_s=3000)
        write_hf_metadata(hf_dir(size), spec.model, "float32")
    (folder / "written").write_text("ok\n")


def ensure_input(peer: str, size: str) -> Path:
    """``peer``'s input folder under .bench/peers/<size>/ (written once in a child, reused after)."""
    folder = root(size) / peer
    if not (folder / "written").exists():
        print(f"writing the {peer} input of the {size} model to {folder} (once) ...", flush=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.trainer_peers", "--write", peer, "--size", size],
                       check=True)
        print(f"  written in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def pairs(size: str, peers: list[str]) -> list[Pair]:
    """The commands of each peer's pair; its input is written first if it is not cached."""
    merge = [sys.executable, "-m", "merge_engine", "merge"]
    found = []
    for peer in peers:
        folder = ensure_input(peer, size)
        if peer == "accelerate":
            model = folder / "run" / STEP_FOLDERS[peer] / "pytorch_model_fsdp_0"
            found.append(Pair(peer, "accelerate merge-weights", model,
                              [*merge, "--local_dir", str(model), "--target_dir", "{out}",
                               "--hf_model_path", str(hf_dir(size))],
                              [str(Path(sys.executable).with_name("accelerate")), "merge-weights", str(model),
                               "{out}"], "*.distcp"))
        elif peer == "dcp_hf":
            step = folder / "run" / STEP_FOLDERS[peer]
            found.append(Pair(peer, "torch consolidate_safetensors_files", step,
                              [*merge, "--local_dir", str(step), "--target_dir", "{out}"],
                              [sys.executable, "-m", "benchmarks.trainer_peers", "--consolidate", str(step),
                               "{out}"], "*.safetensors"))
        else:
            run, tag = folder / "run", "global_step1"
            script = run / "zero_to_fp32.py"
            tool = [sys.executable, str(script)] if script.exists() else [sys.executable, "-m",
                                                                          "deepspeed.utils.zero_to_fp32"]
            found.append(Pair(peer, "DeepSpeed zero_to_fp32.py", run / tag,
                              [*merge, "--local_dir", str(run / tag), "--target_dir", "{out}",
                               "--hf_model_path", str(folder / "reference" / "hf")],
                              [*tool, str(run), "{out}", "--tag", tag, "--safe_serialization"],
                              "*_optim_states.pt"))
    return found


def consolidate(step: Path, out: Path) -> None:
    """torch's consolidation of HuggingFaceStorageWriter rank files, with the writer's own file mapping (each
    tensor's output file, from ``model-0000K-of-0000M`` in the names of the rank files holding it)."""
    import re

    from safetensors import safe_open
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    mapping: dict[str, int] = {}
    for path in sorted(step.glob("shard-*-model-*.safetensors")):
        index = int(re.search(r"-model-(\d+)-of-", path.name).group(1))
        with safe_open(str(path), "pt") as handle:
            mapping.update(dict.fromkeys(handle.keys(), index))
    consolidate_safetensors_files(str(step), str(out), fqn_to_index_mapping=mapping, num_threads=os.cpu_count())


def compare(a: Path, b: Path) -> str:
    """'' when both folders' safetensors files hold the same tensors (names, dtypes, shapes, bytes), else what
    differs; one tensor of each at a time."""
    import torch
    from safetensors import safe_open

    def names(folder: Path) -> dict[str, Path]:
        found = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                found.update(dict.fromkeys(handle.keys(), path))
        return found

    left, right = names(a), names(b)
    if set(left) != set(right):
        return f"names differ: only in {a.name}: {sorted(set(left) - set(right))[:5]}, " \
               f"only in {b.name}: {sorted(set(right) - set(left))[:5]}"
    for name in sorted(left):
        with safe_open(str(left[name]), "pt") as x, safe_open(str(right[name]), "pt") as y:
            u, v = x.get_tensor(name), y.get_tensor(name)
        if u.dtype != v.dtype or u.shape != v.shape or not torch.equal(u, v):
            return f"{name}: {u.dtype} {tuple(u.shape)} against {v.dtype} {tuple(v.shape)}, or other values"
    return ""


def same_outputs(a: Path, b: Path) -> str:
    """`compare` in a child process (the parent stays small)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.trainer_peers", "--compare", str(a), str(b)],
                          capture_output=True, text=True)
    if proc.returncode != 0 and not proc.stdout.strip():
        return f"comparison failed: {proc.stderr[-2000:]}"
    return proc.stdout.strip()


def input_files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*") if p.is_file())


def read_once(folder: Path) -> float:
    """Seconds to read the input's files once from the page cache (``cat``: the floor of any tool)."""
    started = time.perf_counter()
    subprocess.run(["cat", *input_files(folder)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def bench_pair(pair: Pair, repeats: int, out: Path, envs: dict[str, dict[str, str]]
               ) -> tuple[dict[str, list[Run]], str]:
    """Medians' runs of each tool (alternating, warm cache; stepmerge as a run's first step and as its next) and
    the comparison's verdict ('' = identical: both of stepmerge's outputs against the peer's)."""
    runs: dict[str, list[Run]] = {who: [] for who in TOOLS}
    verdict = ""
    warm = out / pair.peer / "memo"  # one unmeasured merge writes the memo the next steps read
    measure("memo", [str(warm) if part == "{out}" else part for part in pair.stepmerge], envs["stepmerge_next"])
    shutil.rmtree(warm, ignore_errors=True)
    for repeat in range(repeats):
        for who in TOOLS:
            command = pair.tool if who == "peer" else pair.stepmerge
            target = out / pair.peer / who
            shutil.rmtree(target, ignore_errors=True)
            if who == "peer":
                target.mkdir(parents=True)
            read_once(pair.input_dir)
            run = measure(who, [str(target) if part == "{out}" else part for part in command], envs[who])
            runs[who].append(run)
            print(f"  {pair.peer:10s} {who:14s} wall {run.wall_s:6.2f} s   peak RSS {run.peak_rss_mb:6.0f} MB   "
                  f"CPU {run.cpu_s:6.2f} s", flush=True)
        if repeat == 0:
            verdict = "; ".join(v for v in (same_outputs(out / pair.peer / who, out / pair.peer / "peer")
                                            for who in TOOLS if who != "peer") if v)
            print(f"  {pair.peer:10s} outputs identical tensor for tensor: {'yes' if not verdict else verdict}",
                  flush=True)
    shutil.rmtree(out / pair.peer, ignore_errors=True)
    return runs, verdict


def floor(pair: Pair, out: Path) -> dict[str, float]:
    """What no tool can go under here, measured once each, warm: ``import torch`` (every tool's start), and the
    input's value bytes read, copied, written with direct I/O and sha256-hashed in a second thread
    (`benchmarks.data_path_floor` ``loop --copy``: what stepmerge must do per byte, in the tightest loop)."""
    files = sorted(str(p) for p in pair.input_dir.rglob(pair.data_glob) if p.is_file())
    start = measure("import torch", [sys.executable, "-c", "import torch"])
    target = out / "floor.bin"
    out.mkdir(parents=True, exist_ok=True)
    read_once(pair.input_dir)
    copy = measure("copy", [sys.executable, "-m", "benchmarks.data_path_floor", "loop", "--copy", str(target), *files])
    target.unlink(missing_ok=True)
    return {"import_torch_s": start.wall_s, "copy_hash_s": copy.wall_s, "copy_hash_cpu_s": copy.cpu_s,
            "copy_gb": sum(os.path.getsize(f) for f in files) / 1e9}


def input_gb(folder: Path) -> float:
    return sum(os.path.getsize(p) for p in input_files(folder)) / 1e9


def table(rows: list[dict]) -> str:
    """The side-by-side table (one line per tool, the ratios on stepmerge's lines)."""
    lines = [f"  {'input':12s} {'tool':38s} {'wall s':>7s} {'peak RSS MB':>11s} {'CPU s':>6s} "
             f"{'wall ratio':>10s} {'RSS ratio':>9s}  goal <= {GOAL} met"]
    for row in rows:
        theirs = row["runs"]["peer"]
        for who in ("stepmerge", "stepmerge_next"):
            ours = row["runs"].get(who)
            if ours is None:
                continue
            wall, rss = ours["wall_s"] / theirs["wall_s"], ours["peak_rss_mb"] / theirs["peak_rss_mb"]
            met = "yes" if wall <= GOAL and rss <= GOAL and not row["verdict"] else "NO"
            lines.append(f"  {row['peer']:12s} {TOOL_LABELS[who]:38s} {ours['wall_s']:7.2f} "
                         f"{ours['peak_rss_mb']:11.0f} {ours['cpu_s']:6.2f} {wall:10.2f} {rss:9.2f}  {met}")
        lines.append(f"  {row['peer']:12s} {row['label']:38s} {theirs['wall_s']:7.2f} {theirs['peak_rss_mb']:11.0f} "
                     f"{theirs['cpu_s']:6.2f}")
        lines.append(f"  {'':12s} input {row['input_gb']:.2f} GB, read once (cat, warm) {row['read_once_s']:.2f} s; "
                     f"outputs identical: {'yes' if not row['verdict'] else 'NO: ' + row['verdict']}")
        if row.get("floor"):
            f = row["floor"]
            lines.append(f"  {'':12s} floor: import torch {f['import_torch_s']:.2f} s; {f['copy_gb']:.2f} GB read + "
                         f"written + sha256 once {f['copy_hash_s']:.2f} s (CPU {f['copy_hash_cpu_s']:.2f} s)")
    return "\n".join(lines)


def run_benchmark(size: str, peers: list[str], repeats: int) -> list[dict]:
    """Measure every pair of ``peers`` on the ``size`` inputs; the table's rows (printed with the load average)."""
    import compileall

    BENCH.mkdir(exist_ok=True)
    compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "merge_engine"), quiet=1)  # as pip does
    found = pairs(size, peers)
    start_load = os.getloadavg()
    # a run's first step: no memo of the config's Hub form (`merge_engine.plan.hub_config_memo`), so stepmerge
    # asks transformers, as the peers' first run would import what they import; its next step: the memo the first
    # step wrote (a watcher merging a run's steps), in a cache folder of this run's own
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    out = BENCH / "out" / "peers"
    memo = BENCH / "out" / "peers_memo"
    shutil.rmtree(memo, ignore_errors=True)
    envs = {"stepmerge": {**env, "STEPMERGE_CACHE_DIR": ""}, "stepmerge_next": {**env, "STEPMERGE_CACHE_DIR": str(memo)},
            "peer": env}
    rows = []
    for pair in found:
        runs, verdict = bench_pair(pair, repeats, out, envs)
        rows.append({"peer": pair.peer, "label": pair.label, "verdict": verdict, "input_gb": input_gb(pair.input_dir),
                     "read_once_s": read_once(pair.input_dir), "floor": floor(pair, out / "floor"),
                     "runs": {who: {f: median(measured, f) for f in ("wall_s", "peak_rss_mb", "cpu_s")}
                              for who, measured in runs.items()}})
    end_load = os.getloadavg()
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(memo, ignore_errors=True)
    print(f"\n== stepmerge / each trainer's own consolidator ({size} model, {os.cpu_count()} cores, medians of "
          f"{repeats}; load average {' '.join(f'{x:.2f}' for x in start_load)} at the start, "
          f"{' '.join(f'{x:.2f}' for x in end_load)} at the end)")
    print(table(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {PEERS}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--write", metavar="PEER", help=argparse.SUPPRESS)
    parser.add_argument("--consolidate", nargs=2, metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--compare", nargs=2, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        return write_input(args.write, args.size)
    if args.consolidate:
        return consolidate(Path(args.consolidate[0]), Path(args.consolidate[1]))
    if args.compare:
        verdict = compare(Path(args.compare[0]), Path(args.compare[1]))
        print(verdict)
        raise SystemExit(1 if verdict else 0)
    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - set(PEERS):
        parser.error(f"--peers: choose from {PEERS}")
    rows = run_benchmark(args.size, peers, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if any(row["verdict"] for row in rows):
        raise SystemExit("an output differs from its peer's: the figures above measure a wrong merge")


if __name__ == "__main__":
    main()
