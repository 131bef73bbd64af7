"""Benchmark: fuse a LoRA adapter into a ~2 GB base -- stepmerge `merge-lora` vs PEFT `merge_and_unload`.

    .venv/bin/python benchmarks/lora_fuse.py [--rounds 3] [--rank 16] [--workdir .bench/lora_fuse]

Builds once (reused from the work dir): a Qwen2-0.5B-shaped base (config only, random float32
weights written straight to safetensors shards, ~1.98 GB; tied embeddings) and a rank-``--rank``
adapter on every linear layer, in PEFT's file format (PEFT loads it in the PEFT runs).
Each round runs both, each in a fresh subprocess, alternating which goes first; each writes the
fused float32 model to its own folder. Printed per run: wall time of the child (imports included),
its own time after imports, "durable" = wall + the ``sync`` that puts its output on disk (stepmerge
fsyncs its files, save_pretrained does not), and its peak RSS (ru_maxrss from wait4; this parent
never imports torch, so nothing of it is counted); then the medians and ratios, and the largest
difference between the two fused models.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARD_BYTES = 500 * 1000**2


def build_base(directory: str) -> None:
    """Random float32 weights of the Qwen2-0.5B shape, shard by shard (never the whole model)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], **QWEN2_05B)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in transformers.Qwen2ForCausalLM(config).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the embedding
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    generator = torch.Generator().manual_seed(0)
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 4 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(groups):
        filename = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in names:
            shape = shapes[name]
            if name.endswith("norm.weight"):
                shard[name] = torch.ones(shape)
            else:
                shard[name] = torch.randn(shape, generator=generator) * (0.02 if len(shape) == 2 else 0.01)
            weight_map[name] = filename
        save_file(shard, os.path.join(tmp, filename), metadata={"format": "pt"})
        del shard
    total = sum(4 * torch.Size(s).numel() for s in shapes.values())
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
    config.save_pretrained(tmp)
    os.replace(tmp, directory)


def build_adapter(directory: str, base: str, rank: int) -> None:
    """A rank-``rank`` LoRA on every linear layer, in PEFT's adapter format."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, REPO)
    from merge_engine.lora.config import adapter_config

    hidden, inter, layers = QWEN2_05B["hidden_size"], QWEN2_05B["intermediate_size"], QWEN2_05B["num_hidden_layers"]
    kv = hidden // QWEN2_05B["num_attention_heads"] * QWEN2_05B["num_key_value_heads"]
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in dims.items():
            owner = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = adapter_config(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), task_type="CAUSAL_LM",
                            base_model_name_or_path=base)
    with open(os.path.join(tmp, "adapter_config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    os.replace(tmp, directory)


# ------------------------------------------------------------------------------------------------
# children: one fuse each, reporting their time after imports
# ------------------------------------------------------------------------------------------------


def child_stepmerge(base: str, adapter: str, out: str) -> float:
    sys.path.insert(0, REPO)
    from merge_engine.commands.combine import merge_lora
    from merge_engine.output.jobs import OutputOptions

    started = time.perf_counter()
    merge_lora(base, [adapter], out, OutputOptions(overwrite=True))
    return time.perf_counter() - started


def child_peft(base: str, adapter: str, out: str) -> float:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.save_pretrained(out)
    return time.perf_counter() - started


def run_child(tool: str, base: str, adapter: str, out: str) -> dict:
    """One timed run. Untimed before it: the old output removed and everything synced, so no run pays
    for the previous one's writeback. Timed after it: ``sync`` -- the cost of making the output
    durable (stepmerge fsyncs its files itself; save_pretrained leaves them in the page cache)."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", tool, "--base", base,
                                    "--adapter", adapter, "--out", out], stdout=out_file, stderr=err_file,
                                   env=env, cwd=REPO)
        _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage (ru_maxrss: its peak RSS)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = out_file.read(), err_file.read()
    if process.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{stderr.decode()[-4000:]}")
    synced = time.perf_counter()
    os.sync()
    sync = time.perf_counter() - synced
    work = json.loads(stdout.decode().strip().splitlines()[-1])["work_s"]
    return {"tool": tool, "wall_s": wall, "work_s": work, "durable_s": wall + sync,
            "peak_rss_gb": usage.ru_maxrss / 1024**2}


def run_helper(*args: str) -> dict:
    """Run a torch-using step (build, compare) in a subprocess: this parent never imports torch, so its
    memory does not leak into the children's ru_maxrss (Linux counts the pre-exec image of a child)."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, cwd=REPO,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1"))
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:2])} failed:\n{done.stderr.decode()[-4000:]}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def max_difference(ours: str, theirs: str) -> tuple[int, float]:
    """(tensors compared, largest |difference|), one tensor at a time."""
    from safetensors import safe_open

    def files(folder: str) -> dict[str, str]:
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            return {k: os.path.join(folder, v) for k, v in json.load(open(index))["weight_map"].items()}
        path = os.path.join(folder, "model.safetensors")
        with safe_open(path, "pt") as handle:
            return {k: path for k in handle.keys()}

    a, b = files(ours), files(theirs)
    if set(a) != set(b):
        raise SystemExit(f"the fused models hold different tensors: {sorted(set(a) ^ set(b))[:5]}")
    worst = 0.0
    for name in a:
        with safe_open(a[name], "pt") as x, safe_open(b[name], "pt") as y:
            worst = max(worst, float((x.get_tensor(name) - y.get_tensor(name)).abs().max()))
    return len(a), worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench", "lora_fuse"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--child", choices=("stepmerge", "peft", "build-base", "build-adapter", "compare"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child in ("stepmerge", "peft"):
        work = (child_stepmerge if args.child == "stepmerge" else child_peft)(args.base, args.adapter, args.out)
        print(json.dumps({"work_s": work}))
        return
    if args.child == "build-base":
        build_base(args.base)
        print(json.dumps({}))
        return
    if args.child == "build-adapter":
        build_adapter(args.adapter, args.base, args.rank)
        print(json.dumps({}))
        return
    if args.child == "compare":
        count, worst = max_difference(args.base, args.out)
        print(json.dumps({"count": count, "worst": worst}))
        return

    base = os.path.join(args.workdir, "base_qwen2_0.5b_fp32")
    adapter = os.path.join(args.workdir, f"adapter_r{args.rank}")
    if not os.path.exists(base):
        started = time.perf_counter()
        run_helper("--child", "build-base", "--base", base)
        print(f"built the base in {time.perf_counter() - started:.1f} s: {base}")
    if not os.path.exists(adapter):
        run_helper("--child", "build-adapter", "--base", base, "--adapter", adapter, "--rank", str(args.rank))
        print(f"built the adapter: {adapter}")
    base_gb = sum(e.stat().st_size for e in os.scandir(base) if e.name.endswith(".safetensors")) / 1e9
    adapter_mb = os.path.getsize(os.path.join(adapter, "adapter_model.safetensors")) / 1e6
    print(f"base {base_gb:.2f} GB (float32), adapter r={args.rank} on {len(TARGETS)} modules x "
          f"{QWEN2_05B['num_hidden_layers']} layers ({adapter_mb:.1f} MB); {os.cpu_count()} CPUs")
    outs = {tool: os.path.join(args.workdir, f"fused_{tool}") for tool in ("stepmerge", "peft")}
    runs: dict[str, list[dict]] = {"stepmerge": [], "peft": []}
    for round_ in range(args.rounds):
        order = ("stepmerge", "peft") if round_ % 2 == 0 else ("peft", "stepmerge")
        for tool in order:
            result = run_child(tool, base, adapter, outs[tool])
            runs[tool].append(result)
            print(f"round {round_ + 1} {tool:9s}: wall {result['wall_s']:6.2f} s (work {result['work_s']:6.2f} s, "
                  f"durable {result['durable_s']:6.2f} s), peak RSS {result['peak_rss_gb']:.2f} GB", flush=True)
    keys = ("wall_s", "work_s", "durable_s", "peak_rss_gb")
    med = {tool: {k: statistics.median(r[k] for r in results) for k in keys} for tool, results in runs.items()}
    for tool in ("stepmerge", "peft"):
        m = med[tool]
        print(f"median {tool:9s}: wall {m['wall_s']:.2f} s, work {m['work_s']:.2f} s, durable {m['durable_s']:.2f} s, "
              f"peak RSS {m['peak_rss_gb']:.2f} GB")
    ratio = {k: med["peft"][k] / med["stepmerge"][k] for k in keys}
    print(f"ratios peft / stepmerge: wall {ratio['wall_s']:.2f}x, work {ratio['work_s']:.2f}x, "
          f"durable {ratio['durable_s']:.2f}x, peak RSS {ratio['peak_rss_gb']:.2f}x")
    compared = run_helper("--child", "compare", "--base", outs["stepmerge"], "--out", outs["peft"])
    count, worst = compared["count"], compared["worst"]
    print(f"fused models agree: {count} tensors, max |stepmerge - peft| = {worst:.3g}")


if __name__ == "__main__":
    main()
