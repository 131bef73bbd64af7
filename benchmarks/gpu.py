"""Benchmark: SVD extraction and the validation forward, GPU against CPU, new factoring against the old.

    python -m benchmarks.gpu [--layers 8 --hidden 2048 --intermediate 5632 --rank 8] [--work DIR]
                             [--baseline-src DIR] [--budget-s 300] [--json FILE]

Builds once (kept in the work dir, rebuilt when the sizes change): a Qwen2 of ``--layers`` layers,
hidden ``--hidden``, intermediate ``--intermediate`` (16 heads, float32, tied embeddings of ``--vocab``),
random weights, saved by transformers' ``save_pretrained`` as ``base/``; and ``tuned/`` = base + on
every linear weight an update of rank 16 with decaying strengths + small noise (a full fine-tune's
update: low rank, not exactly). Then, in this process, on each device present (cpu; cuda when torch
sees one), each timed once:
- ``extract-lora --finetuned tuned --base-model base --rank R`` through the engine's job
  (`SvdExtractJob`: reads, factoring, writing the adapter), by the full SVD of every module (the method
  before the randomized one: ``svd_method="full"``) and by the default (randomized, checked) method;
  the largest difference of the modules' relative errors between the two is printed (goal: <= 1e-3;
  ``--no-full-cpu`` leaves the full SVD on the CPU out);
- the validation forward (`forward_check` of ``tuned``: load + 16 tokens), and the largest logit
  difference between the devices.
With ``--baseline-src DIR`` (a checkout of the code before, e.g. ``git archive <commit> | tar -x -C DIR``)
the same extraction also runs as the CLI in subprocesses, the old tree's against this one's, on the CPU
(their relative errors, read from each output's ``stepmerge.json``, are compared too).
Figures are ratios of runs measured in this invocation; a run that was not measured (no GPU, the
``--budget-s`` spent: the full SVD on the CPU runs last) is left out, never guessed.

It runs in a bare CUDA image: prefect, pydantic, s3fs and gcsfs are made unimportable here before anything
else is imported (``--allow-all-imports`` lifts that), so what it imports is what such a worker has.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

# deepspeed: the test extra installs it (ZeRO fixtures), a CUDA worker image does not; accelerate imports it when present
ABSENT_ON_GPU_WORKERS = ("prefect", "pydantic", "pydantic_core", "s3fs", "gcsfs", "deepspeed")
TRUE_RANK = 16  # rank of each module's update in the fine-tune
NOISE = 1e-3  # noise added to each update, relative to its size


def make_unimportable(names: tuple[str, ...]) -> None:
    """``import name`` raises ImportError and ``importlib.util.find_spec(name)`` is None, as where it is absent."""
    for name in names:
        loaded = [m for m in sys.modules if m == name or m.startswith(name + ".")]
        if loaded:
            raise SystemExit(f"{name} was imported before it could be blocked: {loaded[:3]}")
        sys.modules[name] = None  # type: ignore[assignment]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--work", default=os.path.join(REPO, ".bench", "gpu"))
    parser.add_argument("--baseline-src", help="a tree of the code before: its CLI is timed against this one's")
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip the runs left once this many seconds "
                                                                    "are spent (0: no limit)")
    parser.add_argument("--no-full-cpu", action="store_true", help="leave out the full SVD on the CPU in this process "
                        "(with --baseline-src the old tree's CLI run is the before)")
    parser.add_argument("--cli-only", action="store_true", help="with --baseline-src: only the two CLI runs")
    parser.add_argument("--json", help="write the figures here as JSON")
    parser.add_argument("--allow-all-imports", action="store_true")
    return parser.parse_args(argv)


def build_models(args: argparse.Namespace) -> tuple[str, str]:
    """(base folder, tuned folder), built once per set of sizes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
             "vocab": args.vocab, "true_rank": TRUE_RANK, "noise": NOISE}
    base, tuned, marker = (os.path.join(args.work, name) for name in ("base", "tuned", "sizes.json"))
    if os.path.exists(marker) and json.load(open(marker)) == sizes:
        print(f"models: reused from {args.work}")
        return base, tuned
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    started = time.perf_counter()
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, vocab_size=args.vocab, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(base)
    generator = torch.Generator().manual_seed(1)
    strengths = 0.8 ** torch.arange(TRUE_RANK, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() != 2 or "embed" in name or "lm_head" in name:
                continue
            m, n = weight.shape
            left = torch.randn(m, TRUE_RANK, generator=generator) * strengths
            update = 0.02 * left @ torch.randn(TRUE_RANK, n, generator=generator) / n ** 0.5
            weight += update + NOISE * float(update.abs().mean()) * torch.randn(m, n, generator=generator)
    model.save_pretrained(tuned)
    del model
    with open(marker, "w") as handle:
        json.dump(sizes, handle)
    print(f"models: built in {time.perf_counter() - started:.1f} s at {args.work}")
    return base, tuned


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.perf_counter()

    def allows(self, what: str) -> bool:
        spent = time.perf_counter() - self.started
        if self.seconds and spent > self.seconds:
            print(f"  {what}: not run (budget of {self.seconds:.0f} s spent: {spent:.0f} s)")
            return False
        return True


def extract(base: str, tuned: str, target: str, rank: int, device: str, method: str) -> tuple[float, dict]:
    """(wall seconds, module -> relative error) of one SVD extraction through the engine's job."""
    from merge_engine.commands.extract import SvdExtractJob
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.output.jobs import run_job

    shutil.rmtree(target, ignore_errors=True)
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    started = time.perf_counter()
    result = run_job(SvdExtractJob(base, tuned, target, OutputOptions(rank=rank, device=device), svd_method=method))
    seconds = time.perf_counter() - started
    methods = json.load(open(os.path.join(target, "stepmerge.json"))).get("svd_methods", {})
    print(f"  extract-lora --finetuned on {device:4s} {method:4s}: {seconds:7.2f} s  ({len(result.modules)} modules, "
          f"methods {methods})", flush=True)
    return seconds, {r.module: r.relative_error for r in result.modules}


def forward(tuned: str, device: str) -> tuple[float, object]:
    """(wall seconds of the validation forward, the logits) on ``device``."""
    from merge_engine.validate.forward import forward_check, model_logits

    started = time.perf_counter()
    report = forward_check(tuned, device=device)
    seconds = time.perf_counter() - started
    if not report.ok:
        raise SystemExit(f"the validation forward failed on {device}:\n{report.text()}")
    logits, loaded = model_logits(tuned, device)
    print(f"  validation forward on {device:4s}: {seconds:7.2f} s  ({loaded})", flush=True)
    return seconds, logits


CHILD_CPU: list[float] = []  # CPU seconds of each child run so far (rusage of children is cumulative)


def cli_extract(src: str, base: str, tuned: str, target: str, rank: int) -> tuple[float, float]:
    """(wall, CPU) seconds of ``python -m merge_engine extract-lora --finetuned ... --device cpu`` from the tree
    ``src`` (CPU: the child's user + system time, which a loaded machine inflates less than the wall time)."""
    shutil.rmtree(target, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": src}
    command = [sys.executable, "-m", "merge_engine", "extract-lora", "--base-model", base, "--finetuned", tuned,
               "--rank", str(rank), "--target-dir", target, "--device", "cpu"]
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate()
    seconds = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime - sum(CHILD_CPU)
    CHILD_CPU.append(cpu)
    if proc.returncode != 0:
        raise SystemExit(f"extract-lora from {src} failed:\n{stderr[-3000:]}")
    print(f"  CLI extract-lora --finetuned --device cpu from {src}: {seconds:.2f} s wall, {cpu:.1f} s CPU "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    return seconds, cpu


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.allow_all_imports:
        make_unimportable(ABSENT_ON_GPU_WORKERS)
    import torch
    import transformers

    budget = Budget(args.budget_s)
    devices = ["cuda"] if torch.cuda.is_available() else []
    devices.append("cpu")
    gpu = torch.cuda.get_device_name(0) if devices[0] == "cuda" else "none"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; GPU: {gpu}; CPU threads: "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
    print(f"model: Qwen2, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, float32; "
          f"rank {args.rank}")
    base, tuned = build_models(args)
    out = os.path.join(args.work, "out")
    seconds: dict[str, float] = {}
    errors: dict[str, dict] = {}
    if args.cli_only:
        devices = []
    print("SVD extraction (the engine's job, in this process):")
    for device in devices:
        if budget.allows(f"new/{device}"):
            seconds[f"svd_new_{device}"], errors[f"new_{device}"] = extract(
                base, tuned, os.path.join(out, f"new_{device}"), args.rank, device, "auto")
    print("validation forward:")
    logits = {}
    for device in devices:
        if budget.allows(f"forward/{device}"):
            seconds[f"forward_{device}"], logits[device] = forward(tuned, device)
    for device in devices:  # the old way last: the full SVD on the CPU is by far the longest run
        if device == "cpu" and args.no_full_cpu:
            continue
        if budget.allows(f"full/{device}"):
            seconds[f"svd_full_{device}"], errors[f"full_{device}"] = extract(
                base, tuned, os.path.join(out, f"full_{device}"), args.rank, device, "full")
    if args.baseline_src and budget.allows("CLI before/after"):
        print("the CLI, old tree against this one (cpu):")
        seconds["cli_before_cpu"], seconds["cli_before_cpu_time"] = cli_extract(
            os.path.abspath(args.baseline_src), base, tuned, os.path.join(out, "cli_before"), args.rank)
        seconds["cli_after_cpu"], seconds["cli_after_cpu_time"] = cli_extract(
            REPO, base, tuned, os.path.join(out, "cli_after"), args.rank)
        for run in ("before", "after"):  # each module's relative error, as the command recorded it
            recorded = json.load(open(os.path.join(out, f"cli_{run}", "stepmerge.json")))["svd"]
            errors[f"cli_{run}"] = {m: r["relative_error"] for m, r in recorded.items()}
    figures = report(seconds, errors, logits)
    blocked = sorted(n for n in ABSENT_ON_GPU_WORKERS if sys.modules.get(n) is not None)
    print(f"imported: none of {', '.join(ABSENT_ON_GPU_WORKERS)}" if not blocked else f"imported: {blocked}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"seconds": seconds, "figures": figures, "gpu": gpu, "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "sizes": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                                 "rank": args.rank}}, handle, indent=2)
    gap = figures.get("max |relative error new - full|")
    return 1 if gap is not None and gap > 1e-3 else 0


def report(seconds: dict[str, float], errors: dict[str, dict], logits: dict) -> dict[str, float]:
    """The figures (ratios of runs measured here), printed; only those whose runs were measured."""
    figures: dict[str, float] = {}

    def ratio(name: str, numerator: str, denominator: str) -> None:
        if numerator in seconds and denominator in seconds:
            figures[name] = seconds[numerator] / seconds[denominator]

    ratio("SVD full CPU / new CPU (speed-up on this CPU)", "svd_full_cpu", "svd_new_cpu")
    ratio("SVD CLI before / after, CPU, wall (speed-up of the command)", "cli_before_cpu", "cli_after_cpu")
    ratio("SVD CLI before / after, CPU seconds", "cli_before_cpu_time", "cli_after_cpu_time")
    ratio("SVD full GPU / new GPU", "svd_full_cuda", "svd_new_cuda")
    ratio("SVD new CPU / new GPU (the GPU's gain)", "svd_new_cpu", "svd_new_cuda")
    ratio("SVD full CPU (before) / new GPU (goal >= 10)", "svd_full_cpu", "svd_new_cuda")
    ratio("forward CPU / GPU", "forward_cpu", "forward_cuda")
    pairs = [(new, new.replace("new", "full")) for new in errors if new.startswith("new_")] + [("cli_after", "cli_before")]
    gaps = [abs(errors[new][m] - errors[old][m]) for new, old in pairs if new in errors and old in errors
            for m in errors[new]]
    if gaps:
        figures["max |relative error new - full|"] = max(gaps)
    if errors:
        any_new = next((e for k, e in errors.items() if k.startswith("new_")), None)
        if any_new:
            figures["max relative error (new)"] = max(any_new.values())
    if len(logits) == 2:
        figures["max |logits GPU - CPU|"] = float((logits["cuda"] - logits["cpu"]).abs().max())
    print("figures:")
    for name, value in figures.items():
        print(f"  {name:55s} {value:10.4g}")
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
