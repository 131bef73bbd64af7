"""Validation against the TRAINED model: PEFT's own model of the run, rebuilt from the checkpoint and
compared with each output (an error the outputs share, e.g. one wrong per-module LoRA scale, passes the
checks that compare them with each other). The steps and why: docs/validation.md.

`check_against_trained(checkpoint, fused_model_url=, adapter_url=, ...)` -> a `ValidationReport` of
``trained_model`` (rebuilt, or why not), ``trained_vs_fused`` (the fused folder loaded by transformers) and
``trained_vs_adapter`` (the adapter loaded onto its release's ``base/`` the documented way).
- The trained model is built by transformers and PEFT alone, never from stepmerge's resolution: the
  checkpoint's config (``huggingface/config.json`` or ``config_url``), ``peft.get_peft_model`` with r,
  lora_alpha and target modules as the run recorded them (``lora_alpha`` from the caller only where the run
  recorded none, `merge_engine.lora.checkpoint.resolve_alpha`; candidates in order where verl recorded none,
  `trained_model_configs`; the one whose tensor names and shapes are EXACTLY the checkpoint's,
  `fitting_peft_model`), the checkpoint's tensors loaded ``strict=True``. stepmerge passes no scale.
- Logits on `forward.fixed_token_ids` in float32, judged by `adapter.compare_logits` (float32 within
  `LOGIT_TOLERANCE`; bf16/fp16 within their rounding, and the trained change reproduced). A mismatch names
  the largest logit difference and, when memory allows, the tensor that differs most from PEFT's merged
  model with its update's ratio to the trained one (`localise`).
- One model in memory at a time (two while localising). A rebuild over `memory_budget` (parameters x 4 bytes
  x `PEAK_FACTOR`; ``STEPMERGE_TRAINED_CHECK_MAX_BYTES``, default half the machine's memory), or a
  checkpoint that cannot be rebuilt for a reason that says nothing about the output (no base weights,
  another transformers version's names, no LoRA): every check SKIPPED with the reason, never passed.
- A LoRA that fits no PEFT model of the run's r/alpha FAILS ``trained_model``. Bad content never raises
  (failed checks); a ``device`` this machine cannot use is `InvalidDevice`. Cost: docs/scaling.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from merge_engine import storage
from merge_engine.errors import StepmergeError
from merge_engine.formats.hf_metadata import CONFIG_FILE
from merge_engine.layouts import Checkpoint, check_checkpoint, open_checkpoint
from merge_engine.lora.keys import BASE_DIR
from merge_engine.validate.adapter import _folder_dtypes, _peft_logits, coarsest_dtype, compare_logits
from merge_engine.validate.compare import LOGIT_TOLERANCE
from merge_engine.validate.forward import checked_device, logits_of, model_class, release_model
from merge_engine.validate.report import Check, ValidationReport
from merge_engine.validate.staging import local_folder

MAX_BYTES_ENV = "STEPMERGE_TRAINED_CHECK_MAX_BYTES"
# peak RSS / float32 bytes of the values: 3.4 GB for 2.56 GB measured on a Qwen2-0.5B-shaped checkpoint
# (benchmarks/trained_check.py: the state read whole, the interpreter, torch and transformers)
PEAK_FACTOR = 1.5
ALL_LINEAR = "all-linear"
TRAINED, VS_FUSED, VS_ADAPTER = "trained_model", "trained_vs_fused", "trained_vs_adapter"


def memory_budget() -> int:
    """Bytes the rebuilt model may take: ``STEPMERGE_TRAINED_CHECK_MAX_BYTES``, else half the machine's memory."""
    configured = os.environ.get(MAX_BYTES_ENV)
    if configured:
        return int(float(configured))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class NotRebuildable(Exception):
    """The trained model cannot be rebuilt for a reason that says nothing about the outputs (a skip)."""


class NoTrainedConfig(Exception):
    """No PEFT model of the run's settings has the checkpoint's LoRA tensors (a failure)."""


@dataclass(frozen=True)
class TrainedModel:
    """What the rebuild produced: logits with and without the LoRA, the config PEFT used, and sizes."""

    logits: Any
    base_logits: Any
    lora_config: Mapping[str, Any]  # what was passed to LoraConfig (never a pattern stepmerge resolved)
    patterns: Mapping[str, Any]  # rank_pattern / alpha_pattern as PEFT derived them
    candidate: str
    parameters: int
    dtypes: frozenset


# ------------------------------------------------------------------------------------------------
# The run's LoraConfig candidates
# ------------------------------------------------------------------------------------------------


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _v4_names(model_type: str | None) -> dict[str, set[str]]:
    """PEFT's own table of transformers-4 module names per fused v5 tensor (``gate_up_proj`` -> ``{w1, w3}``);
    empty when this PEFT has none for the family."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:
        return {}
    mapping = _MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type or "", ""), {})
    names: dict[str, set[str]] = {}
    for old, new in mapping.items():
        names.setdefault(new, set()).add(old)
    return names


def trained_model_configs(run: Any, r: int, alpha: float, keys: Any, metas: Mapping[str, Any],
                          model_type: str | None, task_type: str | None) -> list[tuple[str, dict[str, Any]]]:
    """(label, LoraConfig keyword arguments) to try, in order (see the module docstring, step 2): PEFT's model
    of the run, chosen apart from `merge_engine.lora.peft_settings.candidate_configs` (the resolution this
    check judges); the fields a recorded config gives are the same (`recorded_settings`)."""
    from merge_engine.lora.fused_experts import find_expert_loras
    from merge_engine.lora.peft_settings import recorded_settings

    common: dict[str, Any] = {"r": r, "lora_alpha": alpha, "task_type": task_type, "lora_dropout": 0.0}
    copies = sorted({_leaf(name.rsplit(".", 1)[0]) for name in keys.trained_copies})
    if copies:
        common["modules_to_save"] = copies
    if run.config:
        recorded = recorded_settings(run.config)
        if recorded.get("target_modules") or recorded.get("target_parameters"):
            return [("the run's recorded adapter config", {**common, **recorded})]
    candidates = [(f"target_modules={ALL_LINEAR!r} (verl's default; the run recorded none)",
                   {**common, "target_modules": ALL_LINEAR})]
    base_shapes = {name: tuple(metas[key].shape) for name, key in keys.base.items()}
    try:
        experts, ordinary = find_expert_loras(keys.factors, base_shapes, metas, None)
    except StepmergeError:
        experts, ordinary = {}, keys.factors
    leaves = sorted({_leaf(m) for m in ordinary})
    fused = sorted({_leaf(p) for p in experts})
    v4 = _v4_names(model_type)
    if fused and all(p in v4 for p in fused):
        old = sorted(set().union(*(v4[p] for p in fused)))
        candidates.append((f"target_modules={leaves + old} (the checkpoint's LoRA modules, experts by their "
                           "transformers-4 names)", {**common, "target_modules": sorted(set(leaves) | set(old))}))
    parameters = sorted({".".join(p.split(".")[-2:]) for p in experts})
    label = f"target_modules={leaves}" + (f", target_parameters={parameters}" if parameters else "")
    candidates.append((f"{label} (the checkpoint's LoRA modules)",
                       {**common, "target_modules": leaves or None, "target_parameters": parameters or None}))
    return candidates


# ------------------------------------------------------------------------------------------------
# Rebuilding the trained model
# ------------------------------------------------------------------------------------------------


def _empty_model(config: Any) -> Any:
    """The config's model class with parameters on the meta device (buffers real), float32."""
    import torch
    from accelerate import init_empty_weights

    cls, via_auto = model_class(config)
    with init_empty_weights(include_buffers=False):
        if via_auto:
            return cls.from_config(config, dtype=torch.float32)
        return cls._from_config(config, dtype=torch.float32)


def _peft_model(config: Any, lora_kwargs: Mapping[str, Any]) -> Any:
    import warnings

    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(_empty_model(config), peft.LoraConfig(**lora_kwargs))


def _shapes(model: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _mismatch(expected: Mapping[str, tuple], found: Mapping[str, tuple]) -> str:
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    shapes = [f"{k}: {list(found[k])} in the checkpoint, {list(expected[k])} in PEFT's model"
              for k in sorted(set(expected) & set(found)) if tuple(expected[k]) != tuple(found[k])]
    parts = ([f"PEFT's model has {len(missing)} tensors the checkpoint lacks ({missing[0]})"] if missing else []) + \
        ([f"the checkpoint has {len(extra)} tensors PEFT's model lacks ({extra[0]})"] if extra else []) + shapes[:2]
    return "; ".join(parts)


def _lora_free(names: Mapping[str, Any]) -> set[str]:
    from merge_engine.lora.keys import BASE, parse_key

    out = set()
    for key in names:
        role = parse_key(key)
        if role.kind == BASE and ".original_module." not in key:
            out.add(role.name)
    return out


def fitting_peft_model(config: Any, candidates: list[tuple[str, dict[str, Any]]],
                       found: Mapping[str, tuple[int, ...]]) -> tuple[Any, str, dict[str, Any]]:
    """The first candidate's empty PEFT model whose names and shapes are exactly ``found``.

    `NotRebuildable` when no candidate's base tensors are the checkpoint's (another naming: not a
    verdict on the LoRA); `NoTrainedConfig` when the base fits but no candidate's LoRA does."""
    tried, base_fits = [], False
    for label, kwargs in candidates:
        try:
            model = _peft_model(config, kwargs)
        except Exception as exc:  # noqa: BLE001 - PEFT refusing a candidate is that candidate's answer
            tried.append(f"{label}: PEFT refuses it ({type(exc).__name__}: {exc})")
            continue
        expected = _shapes(model)
        if expected == dict(found):
            return model, label, kwargs
        base_fits = base_fits or _lora_free(expected) == _lora_free(found)
        tried.append(f"{label}: {_mismatch(expected, found)}")
        del model
    if not base_fits:
        raise NotRebuildable("the checkpoint's base tensors are not the names of this transformers version's "
                             "model for its config; tried " + " | ".join(tried))
    raise NoTrainedConfig("no PEFT model of the run's settings has the checkpoint's LoRA tensors: " + " | ".join(tried))


def _load_config(url: str) -> Any:
    from transformers import AutoConfig

    with local_folder(url, only=[CONFIG_FILE]) as path:
        return AutoConfig.from_pretrained(path)


def _read_all(source: Any, names: list[str]) -> dict[str, Any]:
    return {name: source.read(name) for name in names}


@contextlib.contextmanager
def rebuilt_model(checkpoint: Checkpoint, *, lora_alpha: float | None = None, config_url: str | None = None,
                  max_bytes: int | None = None) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """(PEFT's trained model in float32 on the CPU, its model config, facts for the report); freed on exit.

    Raises `NotRebuildable` (report a skip), `NoTrainedConfig` (report a failure), or the named error of
    bad run metadata (`AdapterError`: alpha unknown or contradicted)."""
    from merge_engine.lora.checkpoint import read_run_metadata, resolve_alpha, split_checkpoint, task_type_of
    from merge_engine.lora.keys import PEFT_PREFIX

    source = open_checkpoint(checkpoint)
    try:
        metas = dict(source.metas())
        if not any(key.startswith(PEFT_PREFIX) for key in metas):
            raise NotRebuildable(f"the checkpoint's tensor names are not a PEFT model's state dict ({checkpoint.layout} "
                                 "layout): this check rebuilds PEFT-wrapped checkpoints (verl FSDP)")
        try:
            keys = split_checkpoint(metas, checkpoint.url)
        except StepmergeError as exc:
            raise NotRebuildable(f"the checkpoint's names are not PEFT's: {exc}") from None
        if not keys.factors:
            raise NotRebuildable("the checkpoint holds no LoRA factors")
        if not keys.base:
            raise NotRebuildable("the checkpoint holds only LoRA factors (no base weights): the trained model "
                                 "cannot be rebuilt from it alone")
        parameters = sum(_numel(m.shape) for m in metas.values())
        needed = int(parameters * 4 * PEAK_FACTOR)
        budget = memory_budget() if max_bytes is None else max_bytes
        if needed > budget:
            raise NotRebuildable(f"the trained model takes about {needed / 1e9:.2f} GB to rebuild in float32 "
                                 f"({parameters} values x 4 bytes x {PEAK_FACTOR:g}), over this worker's budget of {budget / 1e9:.2f} GB ({MAX_BYTES_ENV})")
        config_url = config_url or checkpoint.hf_dir
        if not config_url or not storage.exists(storage.join(config_url, CONFIG_FILE)):
            raise NotRebuildable(f"no {CONFIG_FILE} beside the checkpoint (huggingface/): no model class to build")
        config = _load_config(config_url)
        run = read_run_metadata(checkpoint.url, checkpoint.files)
        alpha, _ = resolve_alpha(run, lora_alpha, checkpoint.url)
        ranks = Counter(int(metas[parts["lora_A"][0]].shape[0]) for parts in keys.factors.values() if "lora_A" in parts)
        r = int(run.r or (run.config or {}).get("r") or ranks.most_common(1)[0][0])
        task = task_type_of(config.to_dict(), run.task_type)
        candidates = trained_model_configs(run, r, alpha, keys, metas, getattr(config, "model_type", None), task)
        found = {k: tuple(m.shape) for k, m in metas.items()}
        model, label, kwargs = fitting_peft_model(config, candidates, found)
        model.load_state_dict(_read_all(source, sorted(metas)), strict=True, assign=True)
    finally:
        source.close()
    try:
        model.float().eval()
        peft_config = model.peft_config["default"]
        facts = {"candidate": label, "kwargs": kwargs, "parameters": parameters,
                 "dtypes": frozenset(m.dtype for m in metas.values()),
                 "patterns": {"rank_pattern": dict(peft_config.rank_pattern or {}),
                              "alpha_pattern": dict(peft_config.alpha_pattern or {})}}
        yield model, config, facts
    finally:
        release_model(model)  # also when `trained_logits` moved it to a GPU
        del model


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def trained_logits(checkpoint: Checkpoint, device: str, **kwargs: Any) -> TrainedModel:
    """The rebuilt model's logits (adapter on, off) and what was built (see `rebuilt_model`)."""
    with rebuilt_model(checkpoint, **kwargs) as (model, config, facts):
        model.to(device)
        logits = logits_of(model, config, device)
        with model.disable_adapter():
            base = logits_of(model, config, device)
    return TrainedModel(logits, base, facts["kwargs"], facts["patterns"], facts["candidate"], facts["parameters"],
                        facts["dtypes"])


# ------------------------------------------------------------------------------------------------
# Localising a mismatch: which tensor of the fused model differs from PEFT's merged model
# ------------------------------------------------------------------------------------------------


def localise(checkpoint: Checkpoint, fused_path: str, *, lora_alpha: float | None, config_url: str | None,
             max_bytes: int) -> str:
    """The fused-model tensor (in-memory name) farthest from PEFT's ``merge_and_unload`` of the trained
    model (relative to its largest value), and its update as a multiple of the trained one (the base
    tensor read from the checkpoint). Holds two models: the merged trained one and the fused one."""
    import torch

    from merge_engine.lora.checkpoint import split_checkpoint
    from merge_engine.validate.forward import loaded_model

    worst, worst_rel, ours, trained = None, 0.0, None, None
    with rebuilt_model(checkpoint, lora_alpha=lora_alpha, config_url=config_url, max_bytes=max_bytes // 2) as (
            model, _, _):
        merged = model.merge_and_unload().state_dict()
        with loaded_model(fused_path, "cpu", dtype=torch.float32) as (fused_model, _):
            fused = fused_model.state_dict()
            for name, value in merged.items():
                theirs = fused.get(name)
                if theirs is None or theirs.shape != value.shape:
                    continue
                rel = float((theirs.float() - value.float()).abs().max()) / max(float(value.abs().max()), 1e-30)
                if rel > worst_rel:
                    worst, worst_rel = name, rel
                    ours, trained = theirs.detach().float().clone(), value.detach().float().clone()
    if worst is None:
        return "no tensor of the fused model differs from PEFT's merged trained model"
    what = ""
    source = open_checkpoint(checkpoint)
    try:
        key = split_checkpoint(source.metas(), checkpoint.url).base.get(worst)
        if key is not None and ours is not None and trained is not None:  # set with worst
            base = source.read(key).float()
            delta = trained - base
            if float(delta.pow(2).sum()) > 0:
                what = f"; its update is {float(((ours - base) * delta).sum() / delta.pow(2).sum()):.2f}x the trained update"
    finally:
        source.close()
    return f"largest weight difference in {worst} ({100 * worst_rel:.3g}% of its largest value{what})"


# ------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------


def _adapter_dtypes(url: str) -> set[Any]:
    from merge_engine.lora.adapter_io import open_safetensors
    from merge_engine.lora.keys import ADAPTER_WEIGHTS

    source = open_safetensors(storage.join(url, ADAPTER_WEIGHTS))
    try:
        return {meta.dtype for meta in source.metas().values()}
    finally:
        source.close()


def _skipped(names: list[str], why: str) -> list[Check]:
    return [Check(name, True, f"SKIPPED: {why}", skipped=True) for name in names]


def _judge(name: str, theirs: Any, trained: TrainedModel, dtype: Any, label: str) -> tuple[Check, float]:
    if theirs.shape != trained.logits.shape:
        return Check(name, False, f"logits {list(theirs.shape)} vs the trained model's {list(trained.logits.shape)}"), 0.0
    verdict = compare_logits(theirs, trained.logits, trained.base_logits, dtype, ours=label, reference="trained")
    diff = (theirs - trained.logits).abs()
    worst = int(diff.argmax())
    vocab = diff.shape[-1]
    largest = (f"largest logit difference {float(diff.max()):.4g} (token position {worst // vocab % diff.shape[-2]}, "
               f"vocabulary id {worst % vocab})")
    return Check(name, verdict.ok, f"{largest}; {verdict.detail}"), float(diff.max())


def check_against_trained(checkpoint: Checkpoint | str, *, fused_model_url: Optional[str] = None,
                          adapter_url: Optional[str] = None, lora_alpha: float | None = None,
                          config_url: str | None = None, device: str | None = None,
                          max_bytes: int | None = None, backend: str | None = None) -> ValidationReport:
    """Compare ``fused_model_url`` and/or ``adapter_url`` with PEFT's trained model of ``checkpoint``
    (a checked `Checkpoint` or its URL; see the module docstring). Never raises for bad content:
    bad run metadata, a LoRA PEFT cannot have trained, or a mismatch are failed checks. A ``device`` this
    machine cannot use is `InvalidDevice`, raised first. The models run there one at a time; logits are
    compared on the CPU."""
    device = checked_device(device)
    if isinstance(checkpoint, str):
        checkpoint = check_checkpoint(checkpoint, backend)
    subject = fused_model_url or adapter_url or checkpoint.url
    compared = ([VS_FUSED] if fused_model_url else []) + ([VS_ADAPTER] if adapter_url else [])
    budget = memory_budget() if max_bytes is None else max_bytes
    started = time.perf_counter()
    try:
        trained = trained_logits(checkpoint, device, lora_alpha=lora_alpha, config_url=config_url, max_bytes=budget)
    except NotRebuildable as exc:
        return ValidationReport(subject, tuple(_skipped([TRAINED] + compared, str(exc))))
    except NoTrainedConfig as exc:
        return ValidationReport(subject, (Check(TRAINED, False, str(exc)),))
    except StepmergeError as exc:
        return ValidationReport(subject, (Check(TRAINED, False, str(exc)),))
    patterns = {k: v for k, v in trained.patterns.items() if v}
    checks = [Check(TRAINED, True, f"PEFT's model of {trained.candidate} (r={trained.lora_config['r']}, "
                                   f"lora_alpha={trained.lora_config['lora_alpha']:g}"
                                   + (f"; PEFT derived {patterns}" if patterns else "")
                                   + f"), {trained.parameters} values loaded strictly from the checkpoint; logits on "
                                   f"{list(trained.logits.shape)} in {time.perf_counter() - started:.1f}s")]
    import torch

    if fused_model_url:
        with local_folder(fused_model_url) as fused_path:
            from merge_engine.validate.forward import model_logits

            try:
                fused, _ = model_logits(fused_path, device, dtype=torch.float32)
            except Exception as exc:  # noqa: BLE001 - a folder that does not load is a failed check
                checks.append(Check(VS_FUSED, False, f"the fused model does not load: {type(exc).__name__}: {exc}"))
            else:
                dtype = coarsest_dtype(set(trained.dtypes) | _folder_dtypes(fused_model_url))
                check, _ = _judge(VS_FUSED, fused, trained, dtype, "fused")
                if not check.ok:
                    if 2 * trained.parameters * 4 * PEAK_FACTOR <= budget:
                        try:
                            where = localise(checkpoint, fused_path, lora_alpha=lora_alpha, config_url=config_url,
                                             max_bytes=budget)
                        except Exception as exc:  # noqa: BLE001 - localising is a help, not the verdict
                            where = f"not localised ({type(exc).__name__}: {exc})"
                    else:
                        where = "not localised: two models do not fit this worker's memory budget"
                    check = Check(check.name, False, f"{check.detail}; {where}")
                checks.append(check)
    if adapter_url:
        base_url = storage.join(adapter_url, BASE_DIR)
        if not storage.list_files(base_url):
            checks += _skipped([VS_ADAPTER], "the adapter release has no base/ to load it onto (the documented "
                                             "load needs the release's base)")
        else:
            with local_folder(adapter_url) as adapter_path:
                try:
                    theirs, _ = _peft_logits(f"{adapter_path}/{BASE_DIR}", adapter_path, device)
                except Exception as exc:  # noqa: BLE001 - an adapter PEFT cannot load is a failed check
                    checks.append(Check(VS_ADAPTER, False, f"PEFT does not load the adapter: {type(exc).__name__}: "
                                                           f"{exc}"))
                else:
                    dtype = coarsest_dtype(set(trained.dtypes) | _adapter_dtypes(adapter_url) | _folder_dtypes(base_url))
                    checks.append(_judge(VS_ADAPTER, theirs, trained, dtype, "PEFT(base+adapter)")[0])
    return ValidationReport(subject, tuple(checks))


__all__ = ["check_against_trained", "rebuilt_model", "trained_logits", "trained_model_configs", "memory_budget",
           "MAX_BYTES_ENV", "TRAINED", "VS_FUSED", "VS_ADAPTER", "LOGIT_TOLERANCE"]
