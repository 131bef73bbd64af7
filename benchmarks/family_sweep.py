"""Every causal-LM and image-text-to-text family of the installed transformers: merged exactly, loaded by 5.x and 4.57.

    python -m benchmarks.family_sweep [--families qwen2,llava,...] [--json sweep.json] [--workdir DIR] [--no-readers]

Per family of `synthetic_runs.tiny_configs.registry_families` (a tiny config of its class, every size shrunk):
- built: the tiny config, the model with `synthetic_runs.models`' deterministic weights, and its logits on
  `INPUT_IDS` (a family that cannot be built from a config on CPU is listed with the reason, never passed);
- merged: a real FSDP2 checkpoint (world 2, gloo; `synthetic_runs.fsdp`, as verl writes it) merged by
  ``stepmerge merge`` with the default options (Hub format), in this process;
- exact: the merged folder holds exactly the tensors ``save_pretrained`` of the model writes, same names,
  bit for bit;
- 5.x: the class ``config.json`` names loads the folder with no missing, unexpected or mismatched key, and
  its logits equal the model's (``torch.equal``);
- 4.57: the same in transformers 4.57 (`tests.readers_env`, `tests.readers_check`), where 4.57 knows the
  model type (else ``n/a``): clean load, every tensor read back unchanged, logits within `READER_TOLERANCE`
  of their scale (4.57 sums some ops in another order).
Prints the table and the counts, and writes them as JSON (``--json``). `FamilyResult`, `sweep` and
`count` are what the test suite's fixed sample uses.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

INPUT_IDS = [[(7919 * i + 13) % 997 + 3 for i in range(12)]]
READER_TOLERANCE = 1e-5  # of the logits' scale (tests/merge_engine/plan/test_hub_readers.py)
WRITE_BATCH = 8  # families written by one group of FSDP ranks (a failing batch is written again one by one)
COLUMNS = ("built", "merged", "exact", "5.x", "4.57")


@dataclass
class FamilyResult:
    """One family's row: each column True / False / None (not reached, or n/a), and why a column failed."""

    family: str
    model_type: str
    class_name: str
    built: bool | None = None
    merged: bool | None = None
    exact: bool | None = None
    loads_5x: bool | None = None
    loads_457: bool | None = None
    parameters: int | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def cells(self) -> tuple[Any, ...]:
        return (self.built, self.merged, self.exact, self.loads_5x, self.loads_457)

    @property
    def passed(self) -> bool:
        return bool(self.built and self.merged and self.exact and self.loads_5x and self.loads_457 is not False)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]


def sweep(families: list, workdir: Path, readers_python: Path | None, log=print) -> list[FamilyResult]:
    """Run every column for ``families`` (`RegistryFamily`) under ``workdir``; 4.57 only with ``readers_python``."""
    import torch

    from synthetic_runs.fsdp import FsdpSpec, StepJob
    from synthetic_runs.models import ModelSpec
    from synthetic_runs.tiny_configs import TinyConfigError, tiny_config

    results, jobs, references = [], {}, {}
    for family in families:
        result = FamilyResult(family.name, family.model_type, family.class_name)
        results.append(result)
        try:
            config = tiny_config(family)
            spec = ModelSpec(hf_config=json.dumps(config, sort_keys=True))
            result.parameters, logits = _reference(spec)
        except TinyConfigError as exc:
            result.built, result.reasons["built"] = False, str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - any failure to build or run the model is this family's reason
            result.built, result.reasons["built"] = False, f"the model does not run: {_why(exc)}"
            continue
        slug = "".join(c if c.isalnum() else "_" for c in family.name)
        root = workdir / slug
        references[family.name] = (root, logits)
        jobs[family.name] = StepJob(str(root / "global_step_1"), FsdpSpec(model=spec, world_size=2, strategy="fsdp2",
                                                                          save_contents=("model",)),
                                    seed=1, reference_dir=str(root / "reference"))
    log(f"{len(jobs)} of {len(families)} families built; writing their FSDP2 checkpoints")
    written = _write(jobs, log)
    by_name = {r.family: r for r in results}
    for name, job in jobs.items():
        result = by_name[name]
        result.built = written.get(name) is None
        if not result.built:
            result.reasons["built"] = f"the FSDP2 write fails: {written[name]}"
            continue
        root, logits = references[name]
        _merge_and_check(result, job, root, logits, log)
        for used in (root / "global_step_1", root / "reference"):  # only the merged folder is read again (4.57)
            shutil.rmtree(used, ignore_errors=True)
        gc.collect()
        log(f"  {name}: " + " ".join(f"{c}={'-' if v is None else v}" for c, v in zip(COLUMNS, result.cells())))
    if readers_python is not None:
        _readers_457(results, references, readers_python, workdir, log)
    return results


def _reference(spec) -> tuple[int, Any]:
    import torch

    from synthetic_runs.models import build_model

    model = build_model(spec, seed=1)
    tokens = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()
    if not torch.isfinite(logits).all():
        raise ValueError("the model's logits are not finite")
    return sum(p.numel() for p in model.parameters()), logits


def _write(jobs: dict, log) -> dict[str, str | None]:
    """name -> None (written) or why its write failed; batches of `WRITE_BATCH`, a failed batch one by one."""
    from synthetic_runs.fsdp import SyntheticRunError, write_fsdp_steps

    outcome: dict[str, str | None] = {}
    names = list(jobs)
    for start in range(0, len(names), WRITE_BATCH):
        batch = names[start:start + WRITE_BATCH]
        try:
            write_fsdp_steps([jobs[n] for n in batch], timeout_s=1800)
            outcome.update(dict.fromkeys(batch))
            continue
        except SyntheticRunError:
            pass
        for name in batch:
            try:
                write_fsdp_steps([jobs[name]], timeout_s=900)
                outcome[name] = None
            except SyntheticRunError as exc:
                tail = [line for line in str(exc).splitlines() if line.strip()][-1:]
                outcome[name] = (tail[0] if tail else str(exc))[:400]
        log(f"  written {min(start + WRITE_BATCH, len(names))}/{len(names)}")
    return outcome


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _merge_and_check(result: FamilyResult, job, root: Path, logits, log) -> None:
    import torch
    import transformers

    from merge_engine.commands.merge import merge_checkpoint
    from merge_engine.output.jobs import OutputOptions

    target = root / "merged"
    try:
        merge_checkpoint(os.path.join(job.step_dir, "actor"), str(target), OutputOptions(overwrite=True))
        result.merged = True
    except Exception as exc:  # noqa: BLE001 - the merge's refusal is the family's reason
        result.merged, result.reasons["merged"] = False, _why(exc)
        log(f"  {result.family}: merge refused: {result.reasons['merged']}")
        return
    merged, expected = _tensors(target), _tensors(root / "reference" / "hf")
    differ = sorted(n for n in set(merged) & set(expected)
                    if merged[n].shape != expected[n].shape or not torch.equal(merged[n], expected[n].to(merged[n].dtype)))
    result.exact = set(merged) == set(expected) and not differ
    if not result.exact:
        result.reasons["exact"] = (f"names only in the merge: {sorted(set(merged) - set(expected))[:4]}, only in "
                                   f"save_pretrained's: {sorted(set(expected) - set(merged))[:4]}, values differ: "
                                   f"{differ[:4]}")
    try:
        config = json.loads((target / "config.json").read_text())
        cls = getattr(transformers, config["architectures"][0])
        model, info = cls.from_pretrained(str(target), dtype=torch.float32, output_loading_info=True)
        info = {k: sorted(map(str, v)) for k, v in info.items() if v}
        tokens = torch.tensor(INPUT_IDS)
        with torch.no_grad():
            loaded = model.eval()(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()
        equal = loaded.shape == logits.shape and torch.equal(loaded, logits)
        result.loads_5x = not info and equal
        if not result.loads_5x:
            diff = float((loaded - logits).abs().max()) if loaded.shape == logits.shape else "shape"
            result.reasons["5.x"] = f"loading info {info}; logits max |diff| {diff}"
    except Exception as exc:  # noqa: BLE001
        result.loads_5x, result.reasons["5.x"] = False, _why(exc)


def _readers_457(results: list[FamilyResult], references: dict, python: Path, workdir: Path, log) -> None:
    import subprocess

    import torch

    known = set(json.loads(subprocess.run(
        [str(python), "-c", "import json, transformers; from transformers import CONFIG_MAPPING; "
                            "print(json.dumps([k for k in CONFIG_MAPPING.keys()]))"],
        capture_output=True, text=True, check=True, timeout=600).stdout))
    jobs, owners = [], []
    for result in results:
        if not result.merged:
            continue
        root, logits = references[result.family]
        config = json.loads((root / "merged" / "config.json").read_text())
        if config.get("model_type") not in known:
            result.details["4.57"] = f"transformers 4.57 has no model type {config.get('model_type')!r}"
            continue
        reference = root / "logits.pt"
        torch.save(logits, reference)
        jobs.append({"kind": "model", "folder": str(root / "merged"), "ids": INPUT_IDS, "reference": str(reference)})
        owners.append(result)
    log(f"reading {len(jobs)} folders in transformers 4.57")
    check = Path(__file__).resolve().parents[1] / "tests" / "readers_check.py"
    jobs_file, results_file = workdir / "readers_jobs.json", workdir / "readers_results.json"
    jobs_file.write_text(json.dumps(jobs))
    subprocess.run([str(python), str(check), str(jobs_file), str(results_file)], capture_output=True, text=True,
                   timeout=7200, cwd=workdir, check=True)
    for result, read in zip(owners, json.loads(results_file.read_text())):
        problems = {k: read[k] for k in ("error", "loading_info", "tensors_missing", "tensors_differ") if read.get(k)}
        close = "max_abs_diff" in read and read["max_abs_diff"] <= READER_TOLERANCE * max(1.0, read["scale"])
        result.loads_457 = not problems and close
        result.details["4.57_max_abs_diff"] = read.get("max_abs_diff")
        if not result.loads_457:
            problems.setdefault("max_abs_diff", read.get("max_abs_diff"))
            result.reasons["4.57"] = json.dumps(problems, default=str)[:400]


def count(results: list[FamilyResult]) -> dict[str, int]:
    """How many families reached each column (True), failed it (False), and passed every column."""
    counts = {"families": len(results), "passed": sum(r.passed for r in results)}
    for column, index in zip(COLUMNS, range(len(COLUMNS))):
        cells = [r.cells()[index] for r in results]
        counts[f"{column} yes"] = sum(c is True for c in cells)
        counts[f"{column} no"] = sum(c is False for c in cells)
    counts["4.57 n/a"] = sum(r.merged is True and r.loads_457 is None for r in results)
    return counts


def table(results: list[FamilyResult]) -> str:
    def mark(cell: Any) -> str:
        return {True: "yes", False: "NO", None: "-"}[cell]

    width = max(len(r.family) for r in results) if results else 10
    lines = [f"{'family':<{width}}  " + "  ".join(f"{c:>6}" for c in COLUMNS)]
    for r in results:
        lines.append(f"{r.family:<{width}}  " + "  ".join(f"{mark(c):>6}" for c in r.cells()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.family_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated family names or model types (default: all)")
    parser.add_argument("--json", default="family_sweep.json", help="where the table goes as JSON")
    parser.add_argument("--workdir", help="keep the checkpoints and merges here (default: a temporary folder)")
    parser.add_argument("--no-readers", action="store_true", help="skip transformers 4.57")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    from synthetic_runs.tiny_configs import registry_families

    transformers.logging.set_verbosity_error()
    families = registry_families()
    if args.families:
        wanted = set(args.families.split(","))
        families = [f for f in families if f.name in wanted or f.model_type in wanted]
    readers = None
    if not args.no_readers:
        from tests.readers_env import readers_python

        readers = readers_python()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="family_sweep_") as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        results = sweep(families, workdir, readers, log=lambda line: print(line, file=sys.stderr, flush=True))
    counts = count(results)
    print(table(results))
    print(json.dumps(counts))
    for r in results:
        for column, why in r.reasons.items():
            print(f"{r.family} [{column}]: {why}")
    Path(args.json).write_text(json.dumps({"transformers": transformers.__version__, "counts": counts,
                                           "seconds": round(time.monotonic() - started, 1),
                                           "families": [asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
