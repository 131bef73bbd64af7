"""The LoRA of a PEFT-wrapped training checkpoint, resolved from its keys and the run's metadata.

A checkpoint of a PEFT-wrapped model (verl FSDP rank files: ``base_layer``, ``lora_A.default``,
``lora_B.default``, ``modules_to_save`` keys) is split by role (`split_checkpoint`); ``lora_alpha``
is never guessed: it comes from the run (``lora_train_meta.json``, an ``adapter_config.json`` saved
with the run, older verl's ``lora_adapter/adapter_config.json``) or the caller (``--lora-alpha``);
two sources that disagree, or none, raise `AdapterError`.

`plan_trained_model` is what a plain ``stepmerge merge`` of such a checkpoint writes (the planner
asks `is_lora_checkpoint`): the TRAINED model, every LoRA fused into its base weight and every
trained copy in place of its original. `merge_engine.commands.extract` writes the adapter itself.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine import storage
from merge_engine.errors import AdapterError, CorruptShard, InvalidOption
from merge_engine.formats.json_file import read_json_object
from merge_engine.layouts import Checkpoint
from merge_engine.layouts.contract import RUN_LORA_FILES, holds_lora
from merge_engine.lora.adapter_io import Adapter, lora_modules
from merge_engine.lora.config import LoraSettings, checked_alpha, checked_rank
from merge_engine.lora.fuse import WeightedAdapter, plan_fused_model
from merge_engine.lora.fused_experts import find_expert_loras, transposed_expert_modules, with_scales
from merge_engine.lora.keys import LORA_A, LORA_B, TRAINED_COPY, parse_key
from merge_engine.lora.peft_settings import StoredFactors, TrainedSettings, resolve_trained_settings
from merge_engine.lora.sources import RenamedSource
from merge_engine.lora.user_patterns import check_config_patterns
from merge_engine.storage import FileEntry
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.plan.output_heads import check_dropped_head
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorMeta, TensorSource

LORA_TRAIN_META, _ADAPTER_CONFIG = RUN_LORA_FILES
RUN_ADAPTER_CONFIGS = (_ADAPTER_CONFIG, "lora_adapter/" + _ADAPTER_CONFIG)
TASK_TYPES = {"ForCausalLM": "CAUSAL_LM", "ForTokenClassification": "TOKEN_CLS",
              "ForSequenceClassification": "SEQ_CLS", "ForQuestionAnswering": "QUESTION_ANS"}


# ------------------------------------------------------------------------------------------------
# What a PEFT-wrapped checkpoint holds
# ------------------------------------------------------------------------------------------------


def is_lora_checkpoint(metas: Mapping[str, TensorMeta]) -> bool:
    """Do these tensors hold LoRA factors (`merge_engine.layouts.contract.holds_lora`, which a check records
    as `Checkpoint.lora`)?"""
    return holds_lora(metas)


@dataclass(frozen=True)
class LoraCheckpointKeys:
    """A PEFT-wrapped state dict split by role (Hugging Face name -> checkpoint key)."""

    base: Mapping[str, str]
    factors: Mapping[str, Mapping[str, tuple[str, bool]]]  # module -> {"lora_A": (key, embedding), ...}
    trained_copies: Mapping[str, str]
    adapter_name: str | None


def split_checkpoint(metas: Mapping[str, TensorMeta], where: str | None) -> LoraCheckpointKeys:
    base: dict[str, str] = {}
    factors: dict[str, dict[str, tuple[str, bool]]] = {}
    copies: dict[str, str] = {}
    adapters = set()
    for key in metas:
        role = parse_key(key, where)
        if role.adapter is not None:
            adapters.add(role.adapter)
        if role.kind in (LORA_A, LORA_B):
            factors.setdefault(role.name, {})[role.kind] = (key, role.embedding)
            continue
        table = copies if role.kind == TRAINED_COPY else base
        if role.name in table:
            raise CorruptShard(f"{key!r} and {table[role.name]!r} both stand for {role.name}", where)
        table[role.name] = key
    if len(adapters) > 1:
        raise AdapterError(f"the checkpoint holds several adapters ({', '.join(sorted(adapters))}); "
                           "extract them one at a time is not supported", where)
    return LoraCheckpointKeys(base, factors, copies, adapters.pop() if adapters else None)


# ------------------------------------------------------------------------------------------------
# lora_alpha and the other settings, from the run (never guessed)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunLoraMetadata:
    """What the run recorded about its LoRA: alpha (None: unknown), r, task type, its adapter config."""

    lora_alpha: float | None
    r: int | None
    task_type: str | None
    config: Mapping[str, Any] | None
    alpha_from: str | None


def _read_json(url: str) -> dict | None:
    return read_json_object(url, error=AdapterError)


def read_run_metadata(checkpoint_url: str, files: Sequence[FileEntry]) -> RunLoraMetadata:
    """The run's LoRA metadata (``lora_train_meta.json``, else an adapter config). ``files``: the checkpoint's
    listing (paths relative to it): only the files it holds are read, so the fingerprint covers them."""
    listed = {f.path for f in files}

    def read(name: str) -> dict | None:
        return _read_json(storage.join(checkpoint_url, name)) if name in listed else None

    meta_url = storage.join(checkpoint_url, LORA_TRAIN_META)
    meta = read(LORA_TRAIN_META) or {}
    config_url, config = None, None
    for name in RUN_ADAPTER_CONFIGS:
        config = read(name)
        if config is not None:
            config_url = storage.join(checkpoint_url, name)
            break
    if config is not None:
        check_config_patterns(config, config_url)
    alphas = [(checked_alpha(d["lora_alpha"], "lora_alpha", url), url)
              for d, url in ((meta, meta_url), (config or {}, config_url)) if d.get("lora_alpha")]
    if len({a for a, _ in alphas}) > 1:
        raise AdapterError(f"{alphas[0][1]} says lora_alpha={alphas[0][0]:g} but {alphas[1][1]} says "
                           f"{alphas[1][0]:g}", checkpoint_url)
    r = next((checked_rank(d["r"], "r", url) for d, url in ((meta, meta_url), (config or {}, config_url))
              if d.get("r")), None)
    return RunLoraMetadata(alphas[0][0] if alphas else None, r,
                           meta.get("task_type") or (config or {}).get("task_type"), config,
                           alphas[0][1] if alphas else None)


def resolve_alpha(run: RunLoraMetadata, flag: float | None, where: str | None) -> tuple[float, str]:
    """(lora_alpha, where it came from); `AdapterError` when unknown or contradicted."""
    if flag is not None:
        if flag <= 0:
            raise InvalidOption(f"--lora-alpha must be positive, got {flag:g}")
        if run.lora_alpha is not None and run.lora_alpha != flag:
            raise AdapterError(f"--lora-alpha {flag:g} contradicts {run.alpha_from} (lora_alpha="
                               f"{run.lora_alpha:g})", where)
        return flag, run.alpha_from or "--lora-alpha"
    if run.lora_alpha is None:
        raise AdapterError(f"lora_alpha is unknown: the checkpoint has no {LORA_TRAIN_META} and no adapter_config.json "
                           "(or lora_adapter/adapter_config.json) with a non-zero lora_alpha; stepmerge never "
                           "guesses it: pass --lora-alpha", where)
    return run.lora_alpha, run.alpha_from or "the checkpoint"


def checkpoint_settings(run: RunLoraMetadata, alpha: float, ranks: Mapping[str, int], where: str | None
                        ) -> tuple[LoraSettings, bool]:
    """The run's settings with ``alpha``; and whether the run's config fixes each module's rank."""
    config = dict(run.config or {})
    config["lora_alpha"] = alpha
    # LoRA on fused expert tensors is read from the checkpoint itself (`merge_engine.lora.fused_experts`)
    config.pop("target_parameters", None)
    config["r"] = run.r or config.get("r") or max(ranks.values())
    settings = LoraSettings.from_config(config, where)
    exact = bool(config.get("rank_pattern"))
    if not exact and settings.r not in set(ranks.values()):
        raise AdapterError(f"the run says r={settings.r} but the LoRA factors have ranks "
                           f"{sorted(set(ranks.values()))}: wrong metadata for this checkpoint?", where)
    return settings, exact


def task_type_of(config: Mapping[str, Any], run_task: str | None = None) -> str | None:
    if run_task:
        return str(run_task)
    for architecture in config.get("architectures") or ():
        for suffix, task in TASK_TYPES.items():
            if architecture.endswith(suffix):
                return task
    return None


@dataclass(frozen=True)
class CheckpointLora:
    """The LoRA of a checkpoint, resolved: an `Adapter` over the checkpoint's own keys."""

    keys: LoraCheckpointKeys
    adapter: Adapter
    run: RunLoraMetadata
    alpha_from: str
    trained: TrainedSettings | None = None  # each module's (r, alpha, scaling) as PEFT trained it


def resolve_checkpoint_lora(url: str, files: Sequence[FileEntry], metas: Mapping[str, TensorMeta],
                            lora_alpha: float | None, model_config: Mapping[str, Any] | None = None,
                            run: RunLoraMetadata | None = None) -> CheckpointLora:
    """The checkpoint's LoRA. ``files``: the checkpoint's listing; the run's metadata is read only where it
    lists it (what the fingerprint covers), unless the caller read it so already (``run``: `read_run_metadata`
    of the same listing, kept by a job whose fingerprint read it). ``model_config`` (the model's config.json)
    decides ``fan_in_fan_out`` when the run did not record it: PEFT sets it for LoRA on Conv1D layers (GPT-2),
    whatever the LoRA config said, so the model's layer types are the truth (`merge_engine.plan.model_heads`)."""
    keys = split_checkpoint(metas, url)
    if not keys.factors:
        raise AdapterError("no LoRA tensors in this checkpoint: nothing to extract", url)
    run = read_run_metadata(url, files) if run is None else run
    alpha, alpha_from = resolve_alpha(run, lora_alpha, url)
    experts, factors = find_expert_loras(keys.factors, base_shapes(keys, metas, model_config), metas, url,
                                         transposed_expert_modules(model_config))
    ranks = {module: (metas[parts[LORA_A][0]].shape[0] if LORA_A in parts else metas[parts[LORA_B][0]].shape[-1])
             for module, parts in factors.items()}
    ranks.update({name: lora.rank for name, lora in experts.items()})
    settings, exact = checkpoint_settings(run, alpha, ranks, url)
    parameters = {parse_key(lora.a, url).name: name for name, lora in experts.items()}
    trained = trained_settings(model_config, settings, run, keys.factors, metas, parameters, url)
    if trained is not None:
        settings, exact = with_trained_patterns(settings, trained, parameters), True
    settings = _with_fan_in_fan_out(settings, set(factors), model_config, url)
    modules = lora_modules(factors, metas, settings, url, config_ranks=exact)
    scaled = with_scales(experts, settings)
    if trained is not None:
        _check_scales(trained, modules, {module: scaled[name] for module, name in parameters.items()}, url)
    adapter = Adapter(url, settings, modules, dict(keys.trained_copies), dict(metas), scaled)
    return CheckpointLora(keys, adapter, run, alpha_from, trained)


def trained_settings(model_config: Mapping[str, Any] | None, settings: LoraSettings, run: RunLoraMetadata,
                     factors: Mapping[str, Mapping[str, tuple[str, bool]]], metas: Mapping[str, TensorMeta],
                     parameters: Mapping[str, str], where: str | None) -> TrainedSettings | None:
    """Every stored module's (r, lora_alpha, scaling) as PEFT trained it (`merge_engine.lora.peft_settings`).

    None only when transformers has no class for the config (remote code): then PEFT cannot be asked, and
    the run's plain ``r`` / ``lora_alpha`` (and recorded patterns) apply, which is what PEFT does for the
    plain modules of a model it does not convert; a LoRA on fused expert parameters is refused there."""
    if not model_config or not _buildable(model_config):
        if parameters:
            raise AdapterError("LoRA on fused expert parameters of a model transformers cannot build: PEFT's rank "
                               "and alpha for them cannot be resolved", where)
        return None
    return resolve_trained_settings(model_config, settings.r, settings.lora_alpha, dict(run.config or {}),
                                    StoredFactors.from_metas(factors, metas, parameters), where)


def _buildable(model_config: Mapping[str, Any]) -> bool:
    from merge_engine.plan.transformers_conversion import meta_model

    try:
        return meta_model(model_config) is not None
    except Exception:  # noqa: BLE001 - a config transformers cannot build
        return False


def with_trained_patterns(settings: LoraSettings, trained: TrainedSettings, parameters: Mapping[str, str]
                          ) -> LoraSettings:
    """``settings`` whose rank and alpha patterns give every module PEFT's own (r, lora_alpha): one exact
    (escaped) full name per module that differs from the global r / lora_alpha; fused expert wrappers by
    the parameter they adapt (``model.layers.0.mlp.experts.gate_up_proj``)."""
    ranks, alphas = {}, {}
    for module, resolved in sorted(trained.modules.items()):
        name = re.escape(parameters.get(module, module))
        if resolved.r != settings.r:
            ranks[name] = resolved.r
        if resolved.lora_alpha != settings.lora_alpha:
            alphas[name] = resolved.lora_alpha
    return dataclasses.replace(settings, rank_pattern=ranks, alpha_pattern=alphas)


def _check_scales(trained: TrainedSettings, modules: Mapping[str, Any], experts: Mapping[str, Any],
                  where: str | None) -> None:
    """Every module's scale is PEFT's ``scaling`` (a self-check of `with_trained_patterns`)."""
    for module, resolved in trained.modules.items():
        lora = modules.get(module) or experts.get(module)
        if lora is None or not math.isclose(lora.scale, resolved.scaling, rel_tol=1e-9):
            raise AdapterError(f"{module}: scale {getattr(lora, 'scale', None)} is not PEFT's {resolved.scaling}",
                               where)


def base_shapes(keys: LoraCheckpointKeys, metas: Mapping[str, TensorMeta],
                model_config: Mapping[str, Any] | None) -> dict[str, tuple[int, ...]]:
    """The base model's tensor shapes under their stored names: the checkpoint's own base tensors, or
    (a LoRA-only checkpoint) the config's model as transformers holds it in memory, when known."""
    if keys.base:
        return {name: tuple(metas[key].shape) for name, key in keys.base.items()}
    if model_config:
        from merge_engine.plan.hub_format import in_memory_shapes

        return in_memory_shapes(model_config) or {}
    return {}


def _with_fan_in_fan_out(settings: LoraSettings, modules: set[str], model_config: Mapping[str, Any] | None,
                         where: str | None) -> LoraSettings:
    if settings.fan_in_fan_out or not model_config:
        return settings
    from merge_engine.plan.model_heads import conv1d_modules

    conv1d = conv1d_modules(model_config)
    if not conv1d:
        return settings
    on_conv1d = {m for m in modules if m in conv1d}
    if not on_conv1d:
        return settings
    if on_conv1d != modules:
        raise AdapterError(f"LoRA on Conv1D layers ({sorted(on_conv1d)[0]}) and on Linear layers "
                           f"({sorted(modules - on_conv1d)[0]}): one PEFT adapter cannot hold both", where)
    return dataclasses.replace(settings, fan_in_fan_out=True)


# ------------------------------------------------------------------------------------------------
# Plain merge of a LoRA checkpoint: the trained model
# ------------------------------------------------------------------------------------------------


def plan_trained_model(checkpoint: Checkpoint, source: TensorSource, config: Mapping[str, Any], *,
                       max_shard_size: int | None, tie_flag: bool | None = None,
                       lora_alpha: float | None = None, config_url: str | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> MergePlan:
    """The trained model's plan: LoRA fused (W + scale * B @ A), trained copies in place.

    Source names are the checkpoint's own keys. Reads only when the config ties embeddings and
    both copies are stored: the dropped lm_head must equal the embedding (`check_dropped_head`).
    """
    lora = resolve_checkpoint_lora(checkpoint.url, checkpoint.files, source.metas(), lora_alpha, config)
    if not lora.keys.base:
        raise AdapterError("this checkpoint holds only LoRA adapter weights, no base model: pass --base-model BASE "
                           "(the Hugging Face model the run trained from) to fuse the adapter into it, or release the "
                           "adapter alone with extract-lora --base-model BASE", checkpoint.url)
    base = RenamedSource(source, lora.keys.base)
    plan = plan_fused_model(base.metas(), config, [WeightedAdapter(None, lora.adapter)],
                            max_shard_size=max_shard_size, base_url=config_url or checkpoint.hf_dir,
                            base_names=lora.keys.base, tie_flag=tie_flag)
    check_dropped_head(base, plan, chunk_bytes, config)
    note = (f"LoRA fused into the base (lora_alpha={lora.adapter.settings.lora_alpha:g} from {lora.alpha_from}; "
            + (f"each module's rank and alpha as PEFT resolved {lora.trained.source}; " if lora.trained else "")
            + f"{len(lora.adapter.modules)} modules, {len(lora.keys.trained_copies)} trained copies)")
    return MergePlan(plan.tensors, plan.shards, plan.config_updates, plan.notes + (note,),
                     records=lora_records(lora))


def lora_records(lora: CheckpointLora) -> dict[str, Any]:
    """What ``stepmerge.json`` records of a checkpoint's LoRA: where lora_alpha came from, and every module's
    (r, lora_alpha, scaling) as PEFT trained it, with the settings PEFT was given."""
    record: dict[str, Any] = {"lora_alpha": lora.adapter.settings.lora_alpha, "lora_alpha_from": lora.alpha_from}
    if lora.trained is not None:
        record["peft_settings"] = lora.trained.to_json()
    else:
        record["peft_settings"] = {"source": "the run's r / lora_alpha: transformers cannot build this model, so "
                                             "PEFT was not asked"}
    return {"lora": record}
