"""Every causal-LM and image-text-to-text family of the installed transformers: merged exactly, loaded by 5.x and 4.57.

    python -m benchmarks.family_sweep [--families qwen2,llava,...] [--json sweep.json] [--resume] [--workdir DIR]
                                      [--no-readers] [--markdown docs/families.md]

Per family of `synthetic_runs.tiny_configs.registry_families` (a tiny config of its class, every size shrunk), once
per value of each switch its config has that real releases of one family set differently (`SWITCHES`): a family whose
config states ``tie_word_embeddings`` (top level or ``text_config``) is swept tied and untied (Qwen2.5-VL-3B ties its
embeddings, the 7B does not), each a row of its own (`variants`: the class's default under the family's name, the
other value under ``<family> [tie_word_embeddings=...]``):
- built: the tiny config, the model with `synthetic_runs.models`' deterministic weights, and its logits on
  `INPUT_IDS` (a family that cannot be built from a config on CPU is listed with the reason, never passed);
- merged: a real FSDP2 checkpoint (world 2, gloo; `synthetic_runs.fsdp`, as verl writes it) merged by
  ``stepmerge merge`` with the default options (Hub format), in this process;
- exact: the merged folder holds exactly the tensors ``save_pretrained`` of the model writes, bit for bit, under
  the same names, but for a sub-model prefix the Hub's checkpoints hold and transformers 5 leaves out (a VLM's
  ``vision_tower.vision_model.*``: counted in ``details.hub_prefix_restored``) and for the layout the Hub holds
  where transformers 5 transposes on load only when the shape asks (Qwen3-VL-MoE's fused experts, the last two
  dims swapped: ``details.hub_layout_transposed``), and for a masked-LM head's ``bias`` written as its decoder's
  (``stepmerge.json``'s ``tensor_translation``, what transformers 4.x reads: ``details.hub_legacy_bias``);
- 5.x: the class ``config.json`` names loads the folder with no missing, unexpected or mismatched key, and
  its logits equal the model's (``torch.equal``), or, where transformers' load itself changes the model (ZAYA's
  ``_init_weights`` resets a router buffer loaded from the file), equal those it reads from ``save_pretrained``'s
  own folder: ``details["5.x"]`` then names the tensors its load rewrites;
- 4.57: the same in transformers 4.57 (`tests.readers_env`, `tests.readers_check`), where 4.57 knows the
  model type (else ``n/a``): clean load, every tensor read back unchanged, logits within `READER_TOLERANCE`
  of their scale (4.57 sums some ops in another order).
Prints the table and the counts, and writes them as JSON (``--json``). `FamilyResult`, `sweep` and
`count` are what the test suite's fixed sample uses.
"""

from __future__ import annotations

import argparse
import functools
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
WRITE_BATCH = 8  # families swept together: one group of FSDP ranks writes them (one by one if that fails)
COLUMNS = ("built", "merged", "exact", "5.x", "4.57")
SWITCHES = ("tie_word_embeddings",)  # what releases of one family set differently: one row per value
_SOFTCAP = ("reader-side: transformers 4.57 runs it with sdpa by default, which leaves out its attention logit "
            "softcapping; with attn_implementation='eager' (what transformers 5 runs) 4.57's logits equal the model's")
_NULL_ROPE = ("the tiny config's rope is the default (no mrope_section / rope scaling), so the Hub form writes "
              "rope_scaling null, which 4.57's rotary embedding reads as a dict (a real config carries one)")
# model type -> (a text the measured 4.57 failure holds, what blocks the family there, as diagnosed): appended to
# the failing column's reason only while the failure still matches; the column itself is always measured
READER_BLOCKERS: dict[str, tuple[str, str]] = {
    "gemma2": ("max_abs_diff", _SOFTCAP + " (|diff| 0.0)"),
    "vaultgemma": ("max_abs_diff", _SOFTCAP + " (|diff| 0.0)"),
    "doge": ("max_abs_diff", "reader-side: transformers 4.57's sdpa path of Doge (its default) gives other logits; "
                             "with attn_implementation='eager' they are within 4e-6 of the model's"),
    "apertus": ("tensors_differ", "reader-side: transformers 4.57's xIELU activation keeps alpha_p, alpha_n, beta and "
                                  "eps in bfloat16 (its constructor's default) whatever dtype the model loads in: "
                                  "the file's values come back rounded"),
    "mamba": ("IncompleteSnapshotError", "the readers environment: 4.57's Mamba imports the main environment's "
                                         "`kernels`, which needs huggingface_hub 1.x (4.57 needs < 1.0)"),
    "falcon_mamba": ("IncompleteSnapshotError", "the readers environment: 4.57's FalconMamba imports the main "
                                                "environment's `kernels`, which needs huggingface_hub 1.x"),
    "qwen3_vl": ("'NoneType' object has no attribute 'get'", _NULL_ROPE),
    "qwen3_vl_moe": ("'NoneType' object has no attribute 'get'", _NULL_ROPE + "; its square experts are in "
                     "transformers 5's layout besides (stepmerge.json says 4.x readers cannot load it)"),
    "mllama": ("'NoneType' object is not subscriptable", _NULL_ROPE),
    "evolla": ("rotary_embeddings.inv_freq", "4.57 holds the protein encoder's rotary inv_freq once per layer, "
                                             "transformers 5 once per encoder: the names differ (a buffer computed "
                                             "from the config: logits equal)"),
    "modernbert-decoder": ("max_abs_diff", "reader-side: transformers 4.57's ModernBERT decoder builds its local "
                                           "rotary embedding from rope_theta (= global_rope_theta) too, so "
                                           "local_rope_theta is ignored (eager and sdpa alike)"),
    "aya_vision": ("max_abs_diff", "a modeling change: transformers 5's Aya Vision multiplies its logits by "
                                   "text_config.logit_scale (Cohere 2's), 4.57's does not (its logits are the model's "
                                   "divided by it, whatever the release holds)"),
    "fuyu": ("size mismatch", "4.57's Fuyu sizes its vision embedding by a top-level hidden_size (default 4096), "
                              "which transformers 5's FuyuConfig keeps only in text_config"),
    "bigbird_pegasus": ("lm_head.weight", "4.57's causal LM ties lm_head to the embedding by the config's "
                                          "tie_word_embeddings, transformers 5's ties nothing: 4.57 drops the stored head"),
}


@dataclass
class FamilyResult:
    """One family's row: each column True / False / None (not reached, or n/a), and why a column failed."""

    family: str
    model_type: str
    class_name: str
    tied: bool | None = None  # the row's tie_word_embeddings (None: the config states none)
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


@dataclass(frozen=True)
class Variant:
    """One row to sweep: a family with its switches set (``tied`` None: the class's default, stated or not)."""

    family: Any  # RegistryFamily
    tied: bool | None = None
    flipped: bool = False  # the value other than the class's default

    @property
    def name(self) -> str:
        return f"{self.family.name} [tie_word_embeddings={str(self.tied).lower()}]" if self.flipped else self.family.name


def variants(families: list) -> list[Variant]:
    """Each family's rows: the class's default (under the family's name), then the other value of every switch its
    tiny config states (`SWITCHES`); a family without a tiny config has its default row only (which says why)."""
    from synthetic_runs.tiny_configs import TinyConfigError, stated_tie, tiny_config

    out = []
    for family in families:
        try:
            default = stated_tie(tiny_config(family))
        except TinyConfigError:
            default = None
        out.append(Variant(family, default))
        if default is not None:
            out.append(Variant(family, not default, flipped=True))
    return out


def sweep(families: list, workdir: Path, readers_python: Path | None, log=print, on_batch=None) -> list[FamilyResult]:
    """Run every column for ``families`` (`Variant`s, or `RegistryFamily`s: their default rows) under ``workdir``,
    `WRITE_BATCH` rows at a time (built, written, merged, read); 4.57 only with ``readers_python``.
    ``on_batch(results)`` after each."""
    families = [f if isinstance(f, Variant) else Variant(f) for f in families]
    results: list[FamilyResult] = []
    for start in range(0, len(families), WRITE_BATCH):
        results += _sweep_batch(families[start:start + WRITE_BATCH], workdir, readers_python, log)
        log(f"{len(results)}/{len(families)} rows swept")
        if on_batch is not None:
            on_batch(results)
    return results


def _sweep_batch(families: list, workdir: Path, readers_python: Path | None, log) -> list[FamilyResult]:
    from synthetic_runs.models import ModelSpec
    from synthetic_runs.tiny_configs import TinyConfigError, stated_tie, tiny_config

    results, models = [], {}
    for variant in families:
        family = variant.family
        result = FamilyResult(variant.name, family.model_type, family.class_name, tied=variant.tied)
        results.append(result)
        try:
            config = tiny_config(family, variant.tied)
        except TinyConfigError as exc:
            result.built, result.reasons["built"] = False, str(exc)
            continue
        result.tied = stated_tie(config)
        models[variant.name] = (result, ModelSpec(hf_config=json.dumps(config, sort_keys=True)))
    check_models(models, workdir, readers_python, log)
    return results


def check_models(models: dict[str, tuple[FamilyResult, Any]], workdir: Path, readers_python: Path | None,
                 log=print) -> None:
    """Every column for each ``name -> (row, synthetic_runs.models.ModelSpec)``, filled into its row: the model and its
    logits built, a real FSDP2 checkpoint (world 2) written, merged, compared, read by 5.x (and 4.57 with
    ``readers_python``); the merged folder kept under ``workdir/<name>/merged``."""
    from synthetic_runs.fsdp import FsdpSpec, StepJob

    jobs, references = {}, {}
    for name, (result, spec) in models.items():
        try:
            result.parameters, logits = _reference(spec)
        except Exception as exc:  # noqa: BLE001 - any failure to build or run the model is this family's reason
            result.built, result.reasons["built"] = False, f"the model does not run: {_why(exc)}"
            continue
        root = workdir / "".join(c if c.isalnum() else "_" for c in name)
        references[result.family] = (root, logits)
        jobs[name] = StepJob(str(root / "global_step_1"), FsdpSpec(model=spec, world_size=2, strategy="fsdp2",
                                                                  save_contents=("model",)),
                             seed=1, reference_dir=str(root / "reference"))
    written = _write(jobs, log)
    for name, job in jobs.items():
        result = models[name][0]
        result.built = written.get(name) is None
        if not result.built:
            result.reasons["built"] = f"the FSDP2 write fails: {written[name]}"
            continue
        root, logits = references[result.family]
        _merge_and_check(result, job, root, logits, log)
        for used in (root / "global_step_1", root / "reference"):  # only the merged folder is read again (4.57)
            shutil.rmtree(used, ignore_errors=True)
        gc.collect()
    results = [result for result, _ in models.values()]
    if readers_python is not None:
        _readers_457(results, references, readers_python, workdir, log)
    for result in results:
        log(f"  {result.family}: " + " ".join(f"{c}={'-' if v is None else v}" for c, v in zip(COLUMNS, result.cells())))


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
    """name -> None (written) or why its write failed: one group of ranks for all, one by one if that fails."""
    from synthetic_runs.fsdp import SyntheticRunError, write_fsdp_steps

    if not jobs:
        return {}
    try:
        write_fsdp_steps(list(jobs.values()), timeout_s=1800)
        return dict.fromkeys(jobs)
    except SyntheticRunError:
        pass
    outcome: dict[str, str | None] = {}
    for name, job in jobs.items():
        try:
            write_fsdp_steps([job], timeout_s=900)
            outcome[name] = None
        except SyntheticRunError as exc:
            tail = [line for line in str(exc).splitlines() if line.strip()][-1:]
            outcome[name] = (tail[0] if tail else str(exc))[:400]
    return outcome


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _restored_prefixes(only_merged: set[str], only_saved: set[str]) -> dict[str, str]:
    """Merged name -> ``save_pretrained``'s name, where the merge wrote a sub-model prefix that transformers 5's
    ``save_pretrained`` leaves out (one more path segment, the rest equal): the Hub's names of that tensor."""
    pairs = {}
    for name in only_merged:
        parts = name.split(".")
        found = [".".join(parts[:i] + parts[i + 1:]) for i in range(len(parts))]
        found = [f for f in dict.fromkeys(found) if f in only_saved]
        if len(found) == 1:
            pairs[name] = found[0]
    return pairs


def _hub_transposed(merged, saved) -> bool:
    """The merged tensor is ``save_pretrained``'s with its last two dims swapped (and of another shape): the
    layout the Hub holds where transformers 5 transposes on load only when the shape asks (`Transpose(check_dims)`)."""
    import torch

    if merged.dim() < 2 or merged.shape == saved.shape:
        return False
    swapped = saved.transpose(-1, -2)
    return merged.shape == swapped.shape and torch.equal(merged, swapped.to(merged.dtype))


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
    provenance = json.loads((target / "stepmerge.json").read_text())
    recorded = provenance.get("transformers_4")
    if recorded is not None:
        result.details["stepmerge.json transformers_4"] = recorded["reason"]
    merged, expected = _tensors(target), _tensors(root / "reference" / "hf")
    pairs = {n: n for n in set(merged) & set(expected)}
    written_as = {r["key"]: r["tensor"] for r in provenance.get("tensor_translation", [])
                  if r.get("tensor") in expected}
    pairs.update(written_as)
    if written_as:  # a masked-LM head's bias written as its decoder's (transformers 4.x holds the two as one)
        result.details["hub_legacy_bias"] = sorted(written_as)
    restored = _restored_prefixes(set(merged) - set(expected), set(expected) - set(merged))
    pairs.update(restored)
    if restored:
        result.details["hub_prefix_restored"] = len(restored)  # e.g. vision_tower.vision_model.* (4.x reads it)
    transposed = sorted(n for n, e in pairs.items() if _hub_transposed(merged[n], expected[e]))
    if transposed:
        result.details["hub_layout_transposed"] = len(transposed)  # Qwen3-VL-MoE's experts: the Hub's (4.x's) layout
    differ = sorted(n for n, e in pairs.items() if n not in transposed and (
        merged[n].shape != expected[e].shape or not torch.equal(merged[n], expected[e].to(merged[n].dtype))))
    result.exact = len(pairs) == len(merged) == len(expected) and not differ
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
        if not info and not equal:
            equal = _as_transformers_reads_its_own(result, cls, model, merged, root, loaded, logits)
        result.loads_5x = not info and equal
        if not result.loads_5x:
            diff = float((loaded - logits).abs().max()) if loaded.shape == logits.shape else "shape"
            result.reasons["5.x"] = f"loading info {info}; logits max |diff| {diff}"
    except Exception as exc:  # noqa: BLE001
        result.loads_5x, result.reasons["5.x"] = False, _why(exc)


def _as_transformers_reads_its_own(result: FamilyResult, cls, model, merged: dict, root: Path, loaded, logits) -> bool:
    """Whether logits that differ from the model's are those transformers 5 gets from ``save_pretrained``'s own
    folder (the merge is exact): then its load, not the release, changes the model; the tensors it rewrites
    while loading (values other than the file's) are named in ``details["5.x"]``."""
    import torch

    own = cls.from_pretrained(str(root / "reference" / "hf"), dtype=torch.float32)
    tokens = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        own_logits = own.eval()(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()
    if own_logits.shape != loaded.shape or not torch.equal(own_logits, loaded):
        return False
    state = model.state_dict()
    rewritten = sorted(n for n, t in merged.items() if n in state and not torch.equal(state[n].to(t.dtype), t))
    diff = float((loaded - logits).abs().max())
    result.details["5.x"] = (f"the logits transformers 5 reads from save_pretrained's own folder, bit for bit; both "
                             f"differ from the model's by {diff:.3g}: transformers rewrites on load "
                             f"{rewritten[:4] or 'no stored tensor'}{' ...' if len(rewritten) > 4 else ''}")
    return True


def _readers_457(results: list[FamilyResult], references: dict, python: Path, workdir: Path, log) -> None:
    import subprocess

    import torch

    known = _known_457(str(python))
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
    if not jobs:
        return
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
            result.reasons["4.57"] = json.dumps(problems, default=str)
            annotate_457(result)


def annotate_457(result: FamilyResult) -> None:
    """The failing 4.57 column's reason: what blocks the family (`READER_BLOCKERS`, while the measured failure still
    holds its signature), then what was measured."""
    reason = result.reasons.get("4.57")
    if reason is None:
        return
    measured = reason.split(_MEASURED, 1)[-1]
    signature, blocker = READER_BLOCKERS.get(result.model_type, (None, None))
    result.reasons["4.57"] = (f"{blocker}{_MEASURED}{measured}" if signature and signature in measured else measured)[:700]


_MEASURED = "; measured: "


@functools.lru_cache(maxsize=2)
def _known_457(python: str) -> frozenset[str]:
    """The model types the readers' transformers (4.57) knows."""
    import subprocess

    return frozenset(json.loads(subprocess.run(
        [python, "-c", "import json; from transformers import CONFIG_MAPPING; print(json.dumps(list(CONFIG_MAPPING.keys())))"],
        capture_output=True, text=True, check=True, timeout=600).stdout))


def count(results: list[FamilyResult]) -> dict[str, int]:
    """How many families reached each column (True), failed it (False), and passed every column."""
    counts = {"families": len(results), "passed": sum(r.passed for r in results)}
    for column, index in zip(COLUMNS, range(len(COLUMNS))):
        cells = [r.cells()[index] for r in results]
        counts[f"{column} yes"] = sum(c is True for c in cells)
        counts[f"{column} no"] = sum(c is False for c in cells)
    counts["4.57 n/a"] = sum(r.merged is True and r.loads_457 is None for r in results)
    flipped = sum(" [tie_word_embeddings=" in r.family for r in results)
    if flipped:
        counts["distinct families"] = len(results) - flipped
        counts["tie variants"] = flipped
    return counts


def table(results: list[FamilyResult]) -> str:
    def mark(cell: Any) -> str:
        return {True: "yes", False: "NO", None: "-"}[cell]

    def tie(cell: Any) -> str:
        return {True: "yes", False: "no", None: "-"}[cell]

    width = max(len(r.family) for r in results) if results else 10
    lines = [f"{'family':<{width}}  " + "  ".join(f"{c:>6}" for c in ("tied",) + COLUMNS)]
    for r in results:
        lines.append(f"{r.family:<{width}}  " + f"{tie(r.tied):>6}  " + "  ".join(f"{mark(c):>6}" for c in r.cells()))
    return "\n".join(lines)


def readme_summary(data: dict[str, Any]) -> str:
    """The sentence README gives of the sweep's JSON (its counts, as `count` made them)."""
    c = data["counts"]
    partial = ", an unfinished run" if data.get("partial") else ""
    rows = (f"{c['families']} rows ({c['distinct families']} families, {c['tie variants']} of them also swept with "
            "the other tie_word_embeddings)" if c.get("tie variants") else f"{c['families']} families")
    return (f"Last sweep ({data['selection'].split(':')[0]}{partial}, transformers {data['transformers']}): {rows}, {c['built yes']} built from a tiny config on CPU, {c['merged yes']} merged, {c['exact yes']} "
            f"bit-exact, {c['5.x yes']} load in 5.x with equal logits; in 4.57 {c['4.57 yes']} load with equal logits, "
            f"{c['4.57 no']} do not (the table says what blocks each) and {c['4.57 n/a']} are model types 4.57 "
            "does not have.")


def markdown(data: dict[str, Any]) -> str:
    """The sweep's JSON (as ``--json`` writes it) as the Markdown table README points to (``docs/families.md``)."""
    def mark(cell: Any) -> str:
        return {True: "yes", False: "**no**", None: "-"}[cell]

    counts = data["counts"]
    lines = ["# Families: merged exactly, loaded by transformers 5 and 4.57",
             "",
             f"Generated by `python -m benchmarks.family_sweep --json docs/family_sweep.json --markdown docs/families.md` "
             f"(transformers {data['transformers']}){'; a PARTIAL run: only the families listed were swept' if data.get('partial') else ''}. "
             "Each family is a tiny config of its class, written as a real FSDP2 checkpoint (world 2) and merged with "
             "the default options; a family whose config states `tie_word_embeddings` has a row per value (tied: "
             "yes / no; its class's default under the family's name); `-`: not reached, or (4.57) a model type "
             "transformers 4.57 does not have.",
             *([f"Families swept: {data['selection']}."] if data.get("selection") else []),
             "",
             readme_summary(data),
             "",
             "Counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
             "",
             "| family | class | tied | built | merged | exact | 5.x | 4.57 | why not |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in data["families"]:
        cells = (row["built"], row["merged"], row["exact"], row["loads_5x"], row["loads_457"])
        why = "; ".join(f"{k}: {v}" for k, v in row["reasons"].items()).replace("|", "/")[:500]
        tied = {True: "yes", False: "no", None: "-"}[row.get("tied")]
        lines.append(f"| {row['model_type']} | {row['class_name']} | {tied} | " + " | ".join(mark(c) for c in cells)
                     + f" | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.family_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated family names or model types (default: all)")
    parser.add_argument("--json", default="family_sweep.json", help="where the table goes as JSON (rewritten after "
                        "every batch of families, so an interrupted sweep keeps what it did)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows --json already holds and sweep only the registry's other families; with "
                             "--families, sweep those again and replace their rows (the rest of the table kept)")
    parser.add_argument("--new-rows", action="store_true",
                        help="with --resume and --families: sweep only those families' rows --json does not hold yet "
                             "(e.g. their other tie_word_embeddings), keeping the rows it holds")
    parser.add_argument("--shard", help="K/N: sweep only every N-th of the selected families, from the K-th (0-based), "
                        "so N processes share the registry; --join puts their tables together")
    parser.add_argument("--join", help="comma-separated JSON files of shards (or earlier runs): their rows, in the "
                        "registry's order, written as one table to --json (and --markdown); no sweep")
    parser.add_argument("--workdir", help="keep the checkpoints and merges here (default: a temporary folder)")
    parser.add_argument("--no-readers", action="store_true", help="skip transformers 4.57")
    parser.add_argument("--markdown", help="also write the table as Markdown here (docs/families.md)")
    parser.add_argument("--render", action="store_true", help="only render --json as --markdown (no sweep)")
    args = parser.parse_args(argv)
    if args.render:
        Path(args.markdown).write_text(markdown(json.loads(Path(args.json).read_text())))
        return 0
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    from synthetic_runs.tiny_configs import registry_families

    transformers.logging.set_verbosity_error()
    registry = registry_families()
    families = registry
    if args.families:
        wanted = set(args.families.split(","))
        families = [f for f in families if f.name in wanted or f.model_type in wanted]
    if args.join:
        rows = {}
        for path in args.join.split(","):
            rows.update({row["family"]: FamilyResult(**row) for row in json.loads(Path(path).read_text())["families"]})
        order = _row_order(registry)
        joined = sorted(rows.values(), key=lambda r: order.get(r.family, len(order)))
        for row in joined:  # the blockers as diagnosed now
            annotate_457(row)
        missing = [v.name for v in variants(families) if v.name not in rows]
        _save(Path(args.json), joined, time.monotonic(), partial=bool(missing), selection=args.families)
        print(json.dumps(count(joined)) + (f"; {len(missing)} families missing: {missing[:8]}" if missing else ""))
        if args.markdown:
            Path(args.markdown).write_text(markdown(json.loads(Path(args.json).read_text())))
        return 0
    rows_of = variants(families)
    if args.shard:
        index, total = (int(x) for x in args.shard.split("/"))
        rows_of = rows_of[index::total]
    families = rows_of
    kept: dict[str, FamilyResult] = {}
    if args.resume and Path(args.json).is_file():
        kept = {row["family"]: FamilyResult(**row) for row in json.loads(Path(args.json).read_text())["families"]}
        default_tie = {v.name: v.tied for v in families if not v.flipped}
        for name, row in kept.items():  # a row of a sweep before the tie variants: its class's default
            if row.tied is None and name in default_tie:
                row.tied = default_tie[name]
        if not args.families or args.new_rows:
            families = [f for f in families if f.name not in kept]
        for family in families:
            kept.pop(family.name, None)
    order = _row_order(registry)
    every_variant = variants(registry) if args.resume else []
    every_row = {v.name for v in every_variant}
    defaults_kept = bool(every_variant) and {v.name for v in every_variant if not v.flipped} <= set(kept)
    whole = args.resume and not args.families or (args.resume and every_row <= set(kept) | {
        f.name for f in families})
    selection = None if whole or not args.families else args.families
    if args.resume and args.new_rows and args.families and not whole:
        kept_rows = "the whole registry at its classes' default tie" if defaults_kept else "the rows kept"
        selection = (f"{kept_rows}, and the other tie_word_embeddings of {len(args.families.split(','))} "
                     f"families: {args.families.replace(',', ', ')}")
    if args.shard:
        selection = f"{args.families or 'the registry'}, shard {args.shard}"

    def table_of(done: list[FamilyResult]) -> list[FamilyResult]:
        return sorted([*kept.values(), *done], key=lambda r: order.get(r.family, len(order)))

    print(f"sweeping {len(families)} families ({len(kept)} rows kept from {args.json})", file=sys.stderr, flush=True)
    readers = None
    if not args.no_readers:
        from tests.readers_env import readers_python

        readers = readers_python()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="family_sweep_") as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        def keep(done: list[FamilyResult]) -> None:
            _save(Path(args.json), table_of(done), started, partial=len(done) < len(families), selection=selection)

        swept = sweep(families, workdir, readers, log=lambda line: print(line, file=sys.stderr, flush=True),
                      on_batch=keep)
    results = table_of(swept)
    counts = count(results)
    print(table(results))
    print(json.dumps(counts))
    for r in results:
        for column, why in r.reasons.items():
            print(f"{r.family} [{column}]: {why}")
    _save(Path(args.json), results, started, partial=False, selection=selection)
    if args.markdown:
        Path(args.markdown).write_text(markdown(json.loads(Path(args.json).read_text())))
    return 0


def _row_order(registry: list) -> dict[str, float]:
    """Row name -> its place: the registry's order, a family's other tie value right after its default row."""
    order: dict[str, float] = {}
    for i, family in enumerate(registry):
        order[family.name] = i
        for tied in (True, False):
            order[f"{family.name} [tie_word_embeddings={str(tied).lower()}]"] = i + 0.5
    return order


def _save(path: Path, results: list[FamilyResult], started: float, partial: bool, selection: str | None) -> None:
    import transformers

    chosen = (selection if "other tie_word_embeddings" in selection else f"the {len(results)} named by --families "
              f"({selection})") if selection else "the whole registry"
    path.write_text(json.dumps({"transformers": transformers.__version__, "partial": partial, "selection": chosen,
                                "counts": count(results),
                                "seconds": round(time.monotonic() - started, 1),
                                "families": [asdict(r) for r in results]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
