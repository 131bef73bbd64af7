"""``adapter_config.json`` of an adapter extracted from a LoRA checkpoint: each written module's rank from its
factors and its alpha as PEFT trained it, the rest from the run, in the plainest patterns PEFT loads with the
trained scaling (checked with PEFT on the trained model's class when its config is given).
"""

from __future__ import annotations

import math

from merge_engine.errors import AdapterError
from merge_engine.lora.checkpoint import CheckpointLora
from merge_engine.lora.config import adapter_config, infer_target_modules, settings_layout, targets
from merge_engine.lora.hub_names import ExportedAdapter
from merge_engine.lora.keys import parse_key
from merge_engine.lora.peft_settings import check_adapter_loads


def extracted_adapter_config(lora: CheckpointLora, exported: ExportedAdapter, task_type: str | None,
                             base_url: str | None, model_config: dict | None = None) -> dict:
    """adapter_config.json of an extracted adapter: each module's rank from the tensors and its alpha as PEFT
    trained it (`adapter_patterns`), the rest from the run; the run's own target_modules when they select
    exactly the adapted modules of the base the adapter is named for (`merge_engine.lora.hub_names`).

    With ``model_config``, the config is checked with PEFT on the trained model's class
    (`check_written_config_loads`): the plainest patterns that PEFT loads with the trained scaling are written
    (the written modules' names only; else also the names PEFT 0.21 matches after its own conversion);
    `AdapterError` when neither loads."""
    layouts = [adapter_patterns(lora, exported, aliases=False), adapter_patterns(lora, exported, aliases=True)]
    for index, layout in enumerate(layouts):
        config = _adapter_json(lora, exported, task_type, base_url, layout)
        if model_config is None:
            return config
        try:
            check_written_config_loads(lora, exported, config, model_config, lora.adapter.url)
            return config
        except AdapterError:
            if index == len(layouts) - 1:
                raise
    raise AssertionError("unreachable")


def _adapter_json(lora: CheckpointLora, exported: ExportedAdapter, task_type: str | None, base_url: str | None,
                  layout: tuple[int, float, dict, dict]) -> dict:
    modules, candidates = exported.ranks, set(exported.base_modules) | set(exported.ranks)
    settings = lora.adapter.settings
    r, alpha, rank_pattern, alpha_pattern = layout
    run_targets = (lora.run.config or {}).get("target_modules")
    if run_targets and {c for c in candidates if targets(run_targets, c)} == set(modules):
        target = run_targets
    else:
        target = infer_target_modules(modules, candidates) if modules else []
    saved = sorted({name.rsplit(".", 2)[-2] for name in exported.trained_copies})
    if lora.run.config and lora.run.config.get("modules_to_save") and exported.trained_copies.keys() == \
            lora.keys.trained_copies.keys():
        saved = list(lora.run.config["modules_to_save"])
    return adapter_config(r=r, lora_alpha=alpha, target_modules=target, rank_pattern=rank_pattern,
                          alpha_pattern=alpha_pattern, use_rslora=settings.use_rslora,
                          fan_in_fan_out=settings.fan_in_fan_out, modules_to_save=saved or None,
                          bias=settings.bias, task_type=task_type, base_model_name_or_path=base_url,
                          lora_dropout=float((lora.run.config or {}).get("lora_dropout") or 0.0),
                          target_parameters=exported.target_parameters)


def adapter_patterns(lora: CheckpointLora, exported: ExportedAdapter, aliases: bool = True
                     ) -> tuple[int, float, dict, dict]:
    """(r, lora_alpha, rank_pattern, alpha_pattern) giving every written module its rank and PEFT's alpha for
    the module it comes from, under the names PEFT 0.17 / transformers 4 reads (the written modules) and, with
    ``aliases``, the names PEFT 0.21 matches on a transformers-5 base after its own conversion (`peft_aliases`)."""
    default_alpha = lora.adapter.settings.lora_alpha
    pairs = {m: (rank, exported.alphas.get(m, default_alpha)) for m, rank in exported.ranks.items()}
    pairs.update({name: (rank, exported.alphas.get(name, default_alpha))
                  for name, (rank, _) in exported.fused_parameters.items()})
    return settings_layout(pairs, peft_aliases(lora, exported) if aliases else None)


def loaded_layers(lora: CheckpointLora, exported: ExportedAdapter) -> dict[str, tuple[str, int, float]]:
    """Trained module (stored name) -> (the name PEFT 0.21 matches patterns against on a transformers-5 base,
    the rank per expert and the alpha PEFT gives it there when it loads the written adapter). PEFT fuses the n
    modules of one expert written from one trained parameter (``w1`` and ``w3``) into one LoRA of rank
    n * rank, so its alpha is the one that keeps the trained scaling. Empty without trained settings."""
    trained = lora.trained
    if trained is None:
        return {}
    experts = {parse_key(e.a).name: e.num_experts for e in lora.adapter.experts.values()}
    per_source: dict[str, list[str]] = {}
    for module, source in exported.sources.items():
        per_source.setdefault(source, []).append(module)
    loaded = {}
    for source, written in per_source.items():
        resolved = trained.modules.get(source)
        if resolved is None:
            continue
        kept = all(module in exported.fused_parameters for module in written)  # PEFT's own fused form
        count, remainder = divmod(len(written), 1 if kept else experts.get(source, 1))
        if remainder or ((kept or source not in experts) and count != 1):
            continue  # rows of a module cut into several: PEFT has no rule to fuse them back
        first = written[0]
        rank = count * (exported.ranks[first] if first in exported.ranks else exported.fused_parameters[first][0])
        alpha = resolved.scaling * (math.sqrt(rank) if lora.adapter.settings.use_rslora else rank)
        loaded[source] = (resolved.peft_key, rank, float(int(alpha)) if float(alpha).is_integer() else float(alpha))
    return loaded


def peft_aliases(lora: CheckpointLora, exported: ExportedAdapter) -> dict[str, tuple[int, float]]:
    """`loaded_layers` by the name PEFT 0.21 matches, for the trained modules written under another name."""
    written = set(exported.ranks) | set(exported.fused_parameters)
    return {key: (rank, alpha) for key, rank, alpha in loaded_layers(lora, exported).values() if key not in written}


def check_written_config_loads(lora: CheckpointLora, exported: ExportedAdapter, adapter_json: dict,
                               model_config: dict, where: str | None) -> None:
    """PEFT builds from ``adapter_json`` on the trained model's class every trained LoRA layer with the rank
    the written factors give it and the trained scaling (`merge_engine.lora.peft_settings.check_adapter_loads`).
    Skipped when some written module has no rule that PEFT fuses back (a module cut into row bands)."""
    loaded = loaded_layers(lora, exported)
    if lora.trained is None or set(loaded) != set(lora.trained.modules):
        return
    expected = {source: (rank, lora.trained.modules[source].scaling) for source, (_, rank, _) in loaded.items()}
    check_adapter_loads(model_config, adapter_json, expected, where)
