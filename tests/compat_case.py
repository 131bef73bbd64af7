"""One row of the compatibility matrix, run INSIDE the environment it tests (`tests.compat_matrix`).

``python tests/compat_case.py WORKDIR MEGATRON_DIR RESULTS.json``

In this interpreter (its transformers and peft, the main environment's torch): writes verl FSDP1, FSDP2 and
LoRA (FSDP2, q/v, r 4) checkpoints with real gloo ranks (`synthetic_runs.fsdp`), then runs stepmerge's own
command line (`merge_engine.cli.main`, the code of ``python -m merge_engine``) on them and on the Megatron
checkpoints of MEGATRON_DIR (legacy ``mp_rank_*`` TP 2 and ``dist_ckpt`` TP 2, written by the dev venv: megatron-core
is installed there only). Each cell of the row passes only when:
- ``check``: every checkpoint is complete (exit 0);
- ``merge``: exit 0; the written tensors are the reference weights, the same names, bit for bit; this
  transformers loads the folder (``from_pretrained``) and its logits equal the reference model's exactly
  (FSDP: the model the rank files shard, built here; Megatron: megatron-core's own logits within 1e-4, and
  saved beside the folder: `tests.compat_matrix` holds them equal to the newest environment's, and the
  folder's files, ``stepmerge.json`` aside, byte-identical to the newest environment's);
- ``extract-lora``: exit 0; the adapter's factors and the clean base are the trained ones bit for bit; this
  peft's ``PeftModel.from_pretrained`` on the base gives the trained PEFT model's logits;
- ``merge-lora``: exit 0; fusing the extracted adapter into its base writes exactly what ``merge`` of the LoRA
  checkpoint writes, and its logits are the trained model's (within PEFT's unfused-vs-fused 5e-5);
- ``check-trained``: stepmerge's own comparison of the fused model and the adapter with PEFT's model of the run
  passes (exit 0);
- ``extract-lora SVD``: ``--finetuned`` (the fused model) minus its base at rank 4 on q/v: PEFT on the base gives
  the fused model's logits (within 5e-5).
RESULTS gets ``{"versions", "cells": {cell: {"ok", "detail", "seconds"}}}``; a failure is a result, never a crash.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

TOKENS = torch.tensor([[(7919 * i + 13) % 1003 for i in range(12)]])
ADAPTER_ATOL, ADAPTER_RTOL = 5e-5, 1e-5  # PEFT's unfused forward vs the fused model (tests/merge_engine/lora/test_fuse.py)
MEGATRON_ATOL = 1e-4  # transformers vs megatron-core's own forward (tests/merge_engine/layouts/test_megatron_merge.py)
MEGATRON_CASES = ("legacy", "dist")
LOGITS_SUFFIX = ".logits.pt"


class CellFailed(AssertionError):
    """A cell's check did not hold; the message says which and why."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CellFailed(message)


def _cli(*argv: str) -> None:
    from merge_engine.cli import main

    code = main(list(argv))
    _require(code == 0, f"stepmerge {' '.join(argv[:1])} exited {code}")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    _require(sorted(got) == sorted(expected), f"{what}: names differ: only written {sorted(set(got) - set(expected))[:3]}, "
                                              f"only expected {sorted(set(expected) - set(got))[:3]}")
    differ = [k for k in got if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    _require(not differ, f"{what}: {len(differ)} tensors differ from the reference (first {differ[0] if differ else ''})")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=TOKENS).logits.float()


def _load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    _require(not problems, f"{folder.name}: loading info {problems}")
    return model


def write_fsdp(workdir: Path) -> dict[str, object]:
    """The FSDP1, FSDP2 and LoRA steps, written by this environment's torch.distributed (one gloo group)."""
    from synthetic_runs.fsdp import FsdpSpec, LoraSpec, StepJob, write_fsdp_steps

    specs = {"fsdp1": FsdpSpec(world_size=2, strategy="fsdp1_mesh"), "fsdp2": FsdpSpec(world_size=2, strategy="fsdp2"),
             "lora": FsdpSpec(world_size=2, strategy="fsdp2", lora=LoraSpec(r=4, alpha=8))}
    jobs = [StepJob(str(workdir / name / "global_step_1"), spec, 0, str(workdir / name / "reference"))
            for name, spec in specs.items()]
    return dict(zip(specs, write_fsdp_steps(jobs)))


def merge_fsdp(step, out: Path) -> None:
    from synthetic_runs.fsdp import build_reference_model

    _cli("merge", "--backend", "fsdp", "--local_dir", step.checkpoint_dir, "--target_dir", str(out))
    _same_tensors(_tensors(out), _tensors(Path(step.reference_hf_dir)), "merged tensors")
    got, expected = _logits(_load(out)), _logits(build_reference_model(step.spec, step.seed))
    _require(torch.equal(got, expected), f"logits differ from the trained model's by {(got - expected).abs().max():.3g}")


def validate(step, merged: Path) -> None:
    """The product's own validation (structure, Hub names, reference values, load, forward) of a merge passes here."""
    from merge_engine.validate.model import validate_model

    report = validate_model(str(merged), step.reference_hf_dir)
    _require(report.ok, report.text())


def merge_megatron(megatron_dir: Path, fmt: str, out: Path) -> None:
    from synthetic_runs.megatron import REFERENCE_HF_DIR, REFERENCE_INPUT_IDS_FILE, REFERENCE_LOGITS_FILE

    reference = megatron_dir / f"ref_{fmt}"
    _cli("merge", "--backend", "megatron", "--local_dir", str(megatron_dir / fmt / "global_step_1" / "actor"),
         "--target_dir", str(out))
    _same_tensors(_tensors(out), _tensors(reference / REFERENCE_HF_DIR), "merged tensors")
    ids = torch.load(reference / REFERENCE_INPUT_IDS_FILE)
    with torch.no_grad():
        got = _load(out).eval()(input_ids=ids).logits.float()
    torch.save(got, out.with_name(out.name + LOGITS_SUFFIX))  # the driver: equal to the newest environment's
    megatron = torch.load(reference / REFERENCE_LOGITS_FILE).float()
    worst = float((got - megatron).abs().max())
    _require(worst <= MEGATRON_ATOL, f"logits differ from megatron-core's by {worst:.3g}")


def extract_lora(step, out: Path) -> None:
    from peft import PeftModel

    from synthetic_runs.fsdp import build_reference_model
    from synthetic_runs.models import build_model, torch_dtype

    _cli("extract-lora", "--backend", "fsdp", "--local_dir", step.checkpoint_dir, "--target-dir", str(out))
    trained = _tensors(Path(step.reference_dir))
    factors = {k.replace(".default.", "."): v for k, v in trained.items() if ".lora_" in k}
    _same_tensors(_tensors(out), factors, "adapter factors")
    base = build_model(step.spec.model, step.seed, torch_dtype(step.spec.dtype))
    _same_tensors(_tensors(out / "base"), {k: v.contiguous() for k, v in base.state_dict().items()}, "base/")
    config = json.loads((out / "adapter_config.json").read_text())
    _require((config["r"], config["lora_alpha"]) == (step.spec.lora.r, step.spec.lora.alpha),
             f"adapter_config r/alpha {config['r']}/{config['lora_alpha']}")
    model = PeftModel.from_pretrained(_load(out / "base"), str(out))
    got, expected = _logits(model), _logits(build_reference_model(step.spec, step.seed))
    _require(torch.equal(got, expected), f"PEFT's logits differ from the trained model's by "
                                         f"{(got - expected).abs().max():.3g}")


def merge_lora(step, adapter: Path, out: Path, merged: Path) -> None:
    from synthetic_runs.fsdp import build_reference_model

    _cli("merge-lora", "--base-model", str(adapter / "base"), "--lora-adapter", str(adapter), "--target-dir", str(out))
    _cli("merge", "--backend", "fsdp", "--local_dir", step.checkpoint_dir, "--target_dir", str(merged))
    _same_tensors(_tensors(out), _tensors(merged), "fused vs merge of the LoRA checkpoint")
    got, expected = _logits(_load(out)), _logits(build_reference_model(step.spec, step.seed))
    torch.testing.assert_close(got, expected, atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)


def check_trained(step, adapter: Path, fused: Path) -> None:
    """stepmerge's own check of both outputs against PEFT's model of the run, rebuilt here from the checkpoint."""
    _cli("check-trained", "--local_dir", step.checkpoint_dir, "--fused-model", str(fused), "--adapter", str(adapter),
         "--device", "cpu")


def extract_svd(adapter: Path, fused: Path, out: Path) -> None:
    """SVD of (fused - base) at the run's rank on its modules: PEFT on the base gives the fused model's logits."""
    from peft import PeftModel

    _cli("extract-lora", "--base-model", str(adapter / "base"), "--finetuned", str(fused), "--rank", "4",
         "--target-modules", "q_proj,v_proj", "--device", "cpu", "--target-dir", str(out))
    got, expected = _logits(PeftModel.from_pretrained(_load(adapter / "base"), str(out))), _logits(_load(fused))
    torch.testing.assert_close(got, expected, atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)


def check_all(steps: dict[str, object], megatron_dir: Path) -> None:
    for step in steps.values():
        _cli("check", "--local_dir", step.checkpoint_dir)
    for fmt in MEGATRON_CASES:
        _cli("check", "--local_dir", str(megatron_dir / fmt / "global_step_1" / "actor"))


def run_row(workdir: Path, megatron_dir: Path) -> dict[str, object]:
    import peft
    import transformers

    cells: dict[str, dict[str, object]] = {}

    def cell(name: str, work) -> None:
        started = time.perf_counter()
        try:
            work()
            cells[name] = {"ok": True, "detail": "", "seconds": round(time.perf_counter() - started, 1)}
        except Exception as exc:  # noqa: BLE001 - every cell reports, none stops the row
            detail = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, (CellFailed, AssertionError)):
                detail += "\n" + traceback.format_exc()[-1500:]
            cells[name] = {"ok": False, "detail": detail, "seconds": round(time.perf_counter() - started, 1)}

    started = time.perf_counter()
    steps: dict[str, object] = {}
    cell("write FSDP", lambda: steps.update(write_fsdp(workdir / "checkpoints")))
    out = workdir / "out"
    if steps:
        cell("check", lambda: check_all(steps, megatron_dir))
        cell("merge FSDP1", lambda: merge_fsdp(steps["fsdp1"], out / "fsdp1"))
        cell("merge FSDP2", lambda: merge_fsdp(steps["fsdp2"], out / "fsdp2"))
        cell("validate", lambda: validate(steps["fsdp2"], out / "fsdp2"))
    for fmt in MEGATRON_CASES:
        cell(f"merge Megatron {fmt}", lambda fmt=fmt: merge_megatron(megatron_dir, fmt, out / f"megatron_{fmt}"))
    if steps:
        cell("extract-lora", lambda: extract_lora(steps["lora"], out / "adapter"))
        cell("merge-lora", lambda: merge_lora(steps["lora"], out / "adapter", out / "fused", out / "lora_merged"))
        cell("check-trained", lambda: check_trained(steps["lora"], out / "adapter", out / "fused"))
        cell("extract-lora SVD", lambda: extract_svd(out / "adapter", out / "fused", out / "svd_adapter"))
    return {"versions": {"transformers": transformers.__version__, "peft": peft.__version__,
                         "torch": torch.__version__},
            "cells": cells, "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str]) -> int:
    workdir, megatron_dir, results = Path(argv[0]), Path(argv[1]), Path(argv[2])
    os.environ["STEPMERGE_CACHE_DIR"] = str(workdir / "cache")  # this row's own memo of Hub configs
    try:
        row = run_row(workdir, megatron_dir)
    except Exception as exc:  # noqa: BLE001 - the row itself could not run: say why
        row = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    results.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
