"""DeepSpeed ZeRO checkpoints written by DeepSpeed itself, on CPU over gloo, from known weights.

Contract:
- `write_zero_run(root, spec, steps, seed, reference_root)` spawns ``spec.world_size`` ranks (gloo on 127.0.0.1,
  the store's port picked by the OS), each runs ``deepspeed.initialize`` on the model of ``spec.model`` with the
  weights of ``seed + step`` (DeepSpeed picks its CPU accelerator by itself), takes one step at learning rate 0
  (``spec.optimizer``: DeepSpeed's AdamW with ``torch_adam``, or torch's plain SGD as the client optimizer; the fp32
  master weights stay exactly the weights built) and saves with
  ``engine.save_checkpoint``, as the trainer of ``spec.trainer`` lays it out:
      hf_trainer: root/checkpoint-N/{config.json, tokenizer, generation_config.json, latest, zero_to_fp32.py,
                  global_stepN/*_model_states.pt, *_optim_states.pt, trainer_state.json}, and at stages 1/2 the
                  model in its training dtype (``model.safetensors``), as HF Trainer / TRL save it;
      deepspeed:  root/latest, root/zero_to_fp32.py, root/global_stepN/ (OpenRLHF, a bare engine).
- ``spec.lora``: the model is PEFT-wrapped first (``peft.get_peft_model``, the LoRA factors filled with known non-zero
  values; the base frozen, as PEFT leaves it). A bare engine saves the frozen base in its model states file
  (``engine.save_checkpoint``); HF Trainer saves a PEFT model as its ``_save_checkpoint`` does:
  ``save_checkpoint(..., exclude_frozen_parameters=True)`` (the adapter's fp32 masters only) and, before it,
  ``save_model``'s ``PeftModel.save_pretrained`` (``adapter_config.json``, ``adapter_model.safetensors``) and the
  tokenizer; no ``config.json``.
- ``spec.dtype`` is the training precision: ``bfloat16`` (DeepSpeed's bf16 section: ``bf16_*_optim_states.pt``;
  the weights are built in bf16, so their fp32 masters are exact) or ``float32``.
- reference_root/checkpoint-N/ (or global_stepN/) receives ``state_dict.safetensors``: the fp32 weights the
  masters must equal. `ZeroRun.reference_weights` / `ZeroRun.trained_model` give them back. reference_root/hf/
  holds the model's config and tokenizer (`ZeroRun.hf_config_dir`: what a bare engine's run is merged with).
- Failures raise `SyntheticRunError` with the failing rank's log; no process is left running.

`python -m synthetic_runs.deepspeed JOB.json RANK WORLD PORT` is one rank (the parent runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from collections.abc import Sequence

import torch

from synthetic_runs.fsdp import REFERENCE_STATE_DICT, LoraSpec, SyntheticRunError, _apply_lora, _fill_lora_
from synthetic_runs.models import ModelSpec, build_model, torch_dtype, write_hf_metadata
from synthetic_runs.tokenizer import save_tokenizer

TRAINERS = ("hf_trainer", "deepspeed")
DTYPES = ("bfloat16", "float32")
OPTIMIZERS = ("AdamW", "SGD")
BUCKET_ELEMENTS = 50_000_000  # ZeRO's reduce / all-gather buckets (DeepSpeed's default 5e8 is 1 GB of bf16 a rank)


@dataclass(frozen=True)
class ZeroSpec:
    """One DeepSpeed run: the model, the data-parallel ranks, the ZeRO stage, the precision, the trainer's layout."""

    model: ModelSpec = ModelSpec()
    world_size: int = 2
    stage: int = 2
    dtype: str = "bfloat16"
    trainer: str = "hf_trainer"
    lora: LoraSpec | None = None
    # "AdamW": DeepSpeed's own (optim files hold its two moments); "SGD": torch's plain SGD without momentum given
    # as the client optimizer, whose state is only the fp32 master partitions (a large model written in less RAM)
    optimizer: str = "AdamW"

    def __post_init__(self) -> None:
        if (self.stage not in (1, 2, 3) or self.dtype not in DTYPES or self.trainer not in TRAINERS
                or self.optimizer not in OPTIMIZERS):
            raise ValueError(f"stage 1-3, dtype in {DTYPES}, trainer in {TRAINERS}, optimizer in {OPTIMIZERS}: "
                             f"got {self}")
        if self.lora is not None and self.trainer == "hf_trainer" and self.stage == 3:
            raise ValueError("HF Trainer's PEFT save at stage 3 gathers 16-bit weights: not written here")

    def step_folder(self, step: int) -> str:
        """The step's folder under the run root (the folder a merge is given)."""
        return f"checkpoint-{step}" if self.trainer == "hf_trainer" else f"global_step{step}"

    def ds_config(self) -> dict:
        zero = {"stage": self.stage, "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero}
        if self.optimizer == "AdamW":
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.01, "torch_adam": True}}
        else:
            config["zero_allow_untested_optimizer"] = True  # a client optimizer under ZeRO
        if self.dtype == "bfloat16":
            config["bf16"] = {"enabled": True}
        return config


@dataclass(frozen=True)
class ZeroRun:
    """A written run: its root, spec, seed, steps and where the references are."""

    root: str
    spec: ZeroSpec
    seed: int
    steps: tuple[int, ...]
    reference_root: str

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, self.spec.step_folder(step))

    def tag_dir(self, step: int) -> str:
        tag = f"global_step{step}"
        return os.path.join(self.step_dir(step), tag) if self.spec.trainer == "hf_trainer" else self.step_dir(step)

    @property
    def hf_config_dir(self) -> str:
        """The model's config and tokenizer, no weights."""
        return os.path.join(self.reference_root, "hf")

    def reference_weights(self, step: int) -> dict[str, torch.Tensor]:
        """The fp32 weights of ``step`` (what its masters hold), by Hugging Face name."""
        from safetensors.torch import load_file

        return load_file(os.path.join(self.reference_root, self.spec.step_folder(step), REFERENCE_STATE_DICT))

    def trained_model(self, step: int) -> torch.nn.Module:
        """The fp32 model whose weights are ``reference_weights(step)`` (a PEFT model for a LoRA run)."""
        return _known_model(self.spec, self.seed + step)

    def base_model(self, step: int) -> torch.nn.Module:
        """The fp32 model the LoRA run of ``step`` was trained from (no LoRA)."""
        return _known_model(ZeroSpec(self.spec.model, self.spec.world_size, self.spec.stage, self.spec.dtype,
                                     self.spec.trainer), self.seed + step)


def _known_model(spec: ZeroSpec, seed: int) -> torch.nn.Module:
    """The model of (spec, seed) in fp32, its weights exactly representable in the training precision (the
    weights built in that dtype; the rest, rotary frequencies included, built in fp32); PEFT-wrapped for a LoRA
    run, its factors known values rounded to that precision too."""
    model = build_model(spec.model, seed, torch.float32)
    if spec.dtype != "float32":
        rounded = build_model(spec.model, seed, torch_dtype(spec.dtype)).state_dict()
        model.load_state_dict({name: value.float() for name, value in rounded.items()})
    if spec.lora is None:
        return model
    model = _apply_lora(model, spec.lora)
    _fill_lora_(model, seed)
    if spec.dtype != "float32":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_" in name:
                    param.copy_(param.to(torch_dtype(spec.dtype)).float())
    return model


def write_zero_run(root: str | os.PathLike[str], spec: ZeroSpec, steps: Sequence[int] = (1,), seed: int = 0,
                   reference_root: str | os.PathLike[str] | None = None, timeout_s: float = 900.0) -> ZeroRun:
    """Write the run (see the module docstring) and its references; the `ZeroRun`."""
    from safetensors.torch import save_file

    root = os.path.abspath(os.fspath(root))
    reference_root = os.path.abspath(os.fspath(reference_root or os.path.join(root + "_references")))
    run = ZeroRun(root, spec, seed, tuple(steps), reference_root)
    for step in run.steps:
        folder = os.path.join(reference_root, spec.step_folder(step))
        os.makedirs(folder, exist_ok=True)
        state = {k: v.contiguous() for k, v in _known_model(spec, seed + step).state_dict().items()}
        save_file(state, os.path.join(folder, REFERENCE_STATE_DICT))
        del state  # the ranks below build their own copies
    write_hf_metadata(run.hf_config_dir, spec.model, "float32")
    with tempfile.TemporaryDirectory(prefix="synthetic_zero_") as scratch:
        _spawn(run, scratch, timeout_s)
    return run


def extensions_dir(python: str) -> str:
    """Where the ranks of ``python`` (an interpreter by its real path) build DeepSpeed's JIT ops: a folder of that
    interpreter's own under torch's default build root. DeepSpeed rebuilds its CPU shm op whenever the site-packages
    path in the build record differs, so two checkouts of one project (each with its venv) sharing torch's default
    folder rebuild it in turn, each build ~150 s of two compilers on a loaded 2-core machine."""
    import hashlib

    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256(os.path.dirname(python).encode()).hexdigest()[:12]
    return os.path.join(get_default_build_root(), f"py{sys.version_info[0]}{sys.version_info[1]}_{digest}")


def _spawn(run: ZeroRun, scratch: str, timeout_s: float) -> None:
    import torch.distributed as dist

    world = run.spec.world_size
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    job_path = os.path.join(scratch, "job.json")
    with open(job_path, "w") as handle:
        json.dump({"root": run.root, "spec": asdict(run.spec), "seed": run.seed, "steps": list(run.steps)}, handle)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # the interpreter by its real folder: DeepSpeed's JIT-built ops record the site-packages path they were built
    # from, and one venv reached through two links (worktrees) would rebuild them, one writer at a time
    python = os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir(python))
    processes, logs = [], []
    try:
        for rank in range(world):
            logs.append(os.path.join(scratch, f"rank_{rank}.log"))
            with open(logs[-1], "w") as log:
                command = [python, "-m", "synthetic_runs.deepspeed", job_path, str(rank), str(world),
                           str(store.port)]
                processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in processes]
            failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
            late = time.monotonic() > deadline
            if failed or late:
                rank = failed[0] if failed else 0
                with open(logs[rank], errors="replace") as handle:
                    tail = handle.read()[-6000:]
                what = f"exited with code {codes[rank]}" if failed else "timed out"
                raise SyntheticRunError(f"DeepSpeed rank {rank}/{world} {what} writing {run.root}\n{tail}")
            if all(code == 0 for code in codes):
                return
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        remove_shm_buffers(store.port)
        PORTS_USED.append(store.port)


SHM_FOLDER = "/dev/shm"
PORTS_USED: list[int] = []  # the master ports of the groups this process spawned (their buffers removed)


def remove_shm_buffers(port: int) -> list[str]:
    """Remove the shared-memory all-reduce buffers DeepSpeed's CPU accelerator leaves in ``/dev/shm`` for the group
    whose master port is ``port`` (``deepspeed_allreduce_buffer_<n>_127.0.0.1_<port>_<rank>``, 69 MB a rank, never
    removed by DeepSpeed): a machine writing fixtures all day would otherwise fill its RAM. Returns the names removed."""
    suffix = f"_127.0.0.1_{port}_"
    removed = []
    try:
        names = os.listdir(SHM_FOLDER)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith("deepspeed_allreduce_buffer_") and suffix in name:
            try:
                os.unlink(os.path.join(SHM_FOLDER, name))
                removed.append(name)
            except FileNotFoundError:
                continue
    return removed


def _rank_main(job_path: str, rank: int, world: int, port: int) -> None:
    """One rank: join the group through the parent's store, then train one step and save, for every step."""
    import torch.distributed as dist

    with open(job_path) as handle:
        job = json.load(handle)
    data = dict(job["spec"])
    data["model"] = ModelSpec(**data["model"])
    if data.get("lora") is not None:
        lora = dict(data["lora"])
        lora["target_modules"] = lora["target_modules"] if isinstance(lora["target_modules"], str) else \
            tuple(lora["target_modules"])
        lora["target_parameters"] = tuple(lora.get("target_parameters", ()))
        data["lora"] = LoraSpec(**lora)
    spec = ZeroSpec(**data)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for step in job["steps"]:
            _train_and_save(spec, job["root"], job["seed"] + step, step, rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_and_save(spec: ZeroSpec, root: str, seed: int, step: int, rank: int) -> None:
    import deepspeed
    import torch.distributed as dist

    # without LoRA, built in the training dtype: the parameters DeepSpeed would cast `_known_model`'s to, no fp32 copy
    model = (_known_model(spec, seed) if spec.lora is not None else
             build_model(spec.model, seed, torch_dtype(spec.dtype))).train()
    client = torch.optim.SGD(model.parameters(), lr=0.0) if spec.optimizer == "SGD" else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           optimizer=client, config=spec.ds_config())
    tokens = (torch.arange(8) * 7 + rank) % spec.model.vocab_size
    loss = engine(input_ids=tokens.unsqueeze(0), labels=tokens.unsqueeze(0)).loss
    engine.backward(loss)
    engine.step()
    step_dir = os.path.join(root, spec.step_folder(step))
    save_dir = step_dir if spec.trainer == "hf_trainer" else root
    if spec.trainer == "hf_trainer" and rank == 0:  # HF Trainer saves the model first, then DeepSpeed's state
        os.makedirs(step_dir, exist_ok=True)
        if spec.stage < 3:
            engine.module.save_pretrained(step_dir)  # a PEFT model: its adapter files
        if spec.lora is None:
            write_hf_metadata(step_dir, spec.model, spec.dtype)
        else:
            save_tokenizer(step_dir, spec.model.text_vocab_size)
    dist.barrier()
    # HF Trainer's _save_optimizer_and_scheduler: a PEFT model's frozen base is not saved
    exclude = spec.trainer == "hf_trainer" and spec.lora is not None
    engine.save_checkpoint(save_dir, tag=f"global_step{step}", exclude_frozen_parameters=exclude)
    if spec.trainer == "hf_trainer" and rank == 0:
        with open(os.path.join(step_dir, "trainer_state.json"), "w") as handle:
            json.dump({"global_step": step}, handle)


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
