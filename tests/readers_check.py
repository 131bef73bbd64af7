"""What a reader makes of a folder stepmerge wrote: run in the readers' environment (`tests.readers_env`:
transformers 4.57, peft 0.17) as a script, or imported in the main one (transformers 5, peft 0.21).

Imports only torch, safetensors, transformers and peft (never stepmerge: the reader is the judge).

``python tests/readers_check.py JOBS.json RESULTS.json``: JOBS is a list of jobs, RESULTS gets one
result per job, in order (a failure is a result, never a crash of the whole run):
- ``{"kind": "model", "folder", "ids", "reference", "save_logits"?}``: the class named in ``config.json`` loads the
  folder (``output_loading_info``); the model saved back by this transformers must hold every tensor
  of the folder under the same name with the same values (the load lost and changed nothing), or, listed in
  ``tensors_transposed``, its transpose on dims 1, 2 (a reader that saves in its in-memory layout); logits
  on ``ids`` (float32) compared with the logits saved at ``reference`` (a ``torch.save`` file), and
  saved at ``save_logits`` when given (the reference of a run in the other environment).
- ``{"kind": "adapter", "base", "adapter", "ids", "reference"}``: ``PeftModel.from_pretrained`` on the
  base (its config's class), logits compared alike.
A tensor of the folder the saved-back model lacks because the reader holds it as one parameter with a saved one
(transformers 4.x's masked-LM head: ``decoder.bias`` is ``bias``) counts as read when that parameter equals it
(``tensors_shared``), else it is missing.
Result: ``{"versions", "loading_info" (non-empty lists only), "tensors_missing", "tensors_shared", "tensors_differ",
"tensors_transposed", "max_abs_diff", "exact", "scale", "error"}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any

import torch


def _versions() -> str:
    import transformers

    try:
        import peft

        return f"transformers {transformers.__version__}, peft {peft.__version__}"
    except ImportError:
        return f"transformers {transformers.__version__}"


def _model_class(folder: str):
    import transformers

    with open(os.path.join(folder, "config.json")) as handle:
        architecture = json.load(handle)["architectures"][0]
    return getattr(transformers, architecture)


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _logits(model: torch.nn.Module, ids: list[list[int]]) -> torch.Tensor:
    tokens = torch.tensor(ids)
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()


def _compare(result: dict[str, Any], logits: torch.Tensor, job: dict[str, Any]) -> None:
    if job.get("save_logits"):
        torch.save(logits, job["save_logits"])
    reference_path = job["reference"]
    reference = torch.load(reference_path, weights_only=True).float()
    if logits.shape != reference.shape:
        result["error"] = f"logits shape {tuple(logits.shape)}, reference {tuple(reference.shape)}"
        return
    result["max_abs_diff"] = float((logits - reference).abs().max())
    result["scale"] = float(reference.abs().max())
    result["exact"] = bool(torch.equal(logits, reference))


def check_model(job: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"versions": _versions()}
    folder = job["folder"]
    model, info = _model_class(folder).from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    result["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items() if v}
    written = _tensors(folder)
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        back = _tensors(saved)
    held = model.state_dict()
    saved_ptrs = {held[name].data_ptr() for name in back if name in held}
    # a name the reader holds as one parameter with a saved one (4.x's masked-LM head bias): saved once, read alike
    shared = {name for name in set(written) - set(back) if name in held and held[name].data_ptr() in saved_ptrs
              and _equal(held[name], written[name])}
    result["tensors_shared"] = sorted(shared)
    result["tensors_missing"] = sorted(set(written) - set(back) - shared)
    same = {name for name in set(written) & set(back) if _equal(back[name], written[name])}
    # saved back in the reader's own layout (transformers 5 keeps Qwen3-VL-MoE's experts as it holds them)
    transposed = {name for name in set(written) & set(back) - same
                  if back[name].dim() == 3 and _equal(back[name].transpose(1, 2), written[name])}
    result["tensors_transposed"] = sorted(transposed)
    result["tensors_differ"] = sorted(set(written) & set(back) - same - transposed)
    _compare(result, _logits(model.eval(), job["ids"]), job)
    return result


def _equal(back: torch.Tensor, written: torch.Tensor) -> bool:
    return back.shape == written.shape and torch.equal(back.to(written.dtype), written)


def check_adapter(job: dict[str, Any]) -> dict[str, Any]:
    from peft import PeftModel

    result: dict[str, Any] = {"versions": _versions()}
    base = _model_class(job["base"]).from_pretrained(job["base"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, job["adapter"]).eval()
    _compare(result, _logits(model, job["ids"]), job)
    return result


CHECKS = {"model": check_model, "adapter": check_adapter}


def run_jobs(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for job in jobs:
        try:
            results.append(CHECKS[job["kind"]](job))
        except Exception as exc:  # noqa: BLE001 - a reader's failure is the result
            results.append({"versions": _versions(), "error": f"{type(exc).__name__}: {exc}"[:2000],
                            "traceback": traceback.format_exc()[-3000:]})
    return results


def main(argv: list[str]) -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    with open(argv[1]) as handle:
        jobs = json.load(handle)
    with open(argv[2], "w") as handle:
        json.dump(run_jobs(jobs), handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
