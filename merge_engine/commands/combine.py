"""``stepmerge merge-lora``: several adapters fused into a base model, or combined into one adapter, as an
output job (`CombineJob`): the options checked before anything is read, the fingerprint, the provenance
(each adapter's r, lora_alpha and scale, checked against PEFT's). The combination itself is
`merge_engine.lora.combine`'s (exact rank stacking, or SVD re-factoring); the fused model is
`merge_engine.lora.fuse.plan_fused_model`.
"""


from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine.errors import InvalidOption
from merge_engine.plan.hub_format import in_weights_format
from merge_engine.output.jobs import OutputOptions, OutputResult, PreparedJob, run_job
from merge_engine.output.shard_unit import shard_output
from merge_engine.lora.base_name import adapter_base_name
from merge_engine.lora.adapter_io import read_adapter, read_adapter_config, with_base, write_adapter_config
from merge_engine.lora.combine import combination_weights, plan_combined_adapter
from merge_engine.lora.config import number
from merge_engine.lora.fuse import BASE_NAMESPACE, WeightedAdapter, plan_fused_model
from merge_engine.lora.peft_settings import check_adapter_scales
from merge_engine.lora.sources import NamespacedSource
from merge_engine.lora.svd import ModuleReport, check_targets, svd_device
from merge_engine.commands.adapter_target import inputs_fingerprint, module_reports_json
from merge_engine.commands.input_folders import InputFolders
from merge_engine.commands.lora_alpha import lora_alpha_per_adapter
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.formats.tensor_source import TensorMeta, TensorSource

OUTPUTS = ("model", "adapter")


def check_merge_lora_options(base_url: str | None, adapter_urls: Sequence[str], options: OutputOptions
                             ) -> list[float]:
    """Every option checked before anything is read; returns the adapters' weights."""
    if options.output not in OUTPUTS:
        raise InvalidOption(f"unknown output {options.output!r}; choose model or adapter")
    weights = combination_weights(options.method, len(adapter_urls), options.weights)
    if options.output == "model":
        if base_url is None:
            raise InvalidOption("a fused model needs --base-model")
        if options.rank is not None or options.energy is not None:
            raise InvalidOption("--rank / --energy re-factor an adapter: use them with --output adapter")
    elif options.rank is not None or options.energy is not None:
        check_targets(options.rank, options.energy)
    if options.device is not None:
        svd_device(options.device)  # a device this machine cannot use fails before anything is read
    lora_alpha_per_adapter(options, len(adapter_urls))
    return weights


def adapter_settings(inputs: Sequence[WeightedAdapter], base_metas: Mapping[str, TensorMeta] | None,
                     config: Mapping[str, Any] | None, base_url: str | None) -> dict[str, dict[str, dict]]:
    """Per adapter: each module's (and fused expert tensor's) r, lora_alpha and the scale applied, as the
    adapter's config gives them under PEFT's matching; with a base config, checked against PEFT's own layers
    for that config on the base's model (`merge_engine.lora.peft_settings.check_adapter_scales`)."""
    out: dict[str, dict[str, dict]] = {}
    for item in inputs:
        adapter = item.adapter
        if base_metas is not None and adapter.wrapped:
            adapter = with_base(adapter, base_metas, base_url)
        records = {m.module: (m.rank, m.alpha, m.scale) for m in adapter.modules.values()}
        records.update({name: (e.rank, e.alpha, e.scale) for name, e in adapter.experts.items()})
        if config is not None:
            # lora_alpha as read (a lost alpha given with --lora-alpha replaces the file's)
            read = {**read_adapter_config(adapter.url), "lora_alpha": adapter.settings.lora_alpha}
            check_adapter_scales(config, read, {name: scale for name, (_, _, scale) in records.items()}, adapter.url)
        out[adapter.url] = {name: {"r": rank, "lora_alpha": number(alpha) if alpha is not None else None,
                                   "scaling": scale} for name, (rank, alpha, scale) in sorted(records.items())}
    return out


def combine_fingerprint(base_url: str | None, adapter_urls: Sequence[str], options: OutputOptions,
                        inputs: InputFolders | None = None) -> str:
    """The cache key of a merge-lora: every input folder's listing (``inputs``: the job's), the options, the
    engine version."""
    inputs_urls = {f"adapter{i}": url for i, url in enumerate(adapter_urls)}
    if base_url is not None:
        inputs_urls[BASE_NAMESPACE] = base_url
    return inputs_fingerprint(inputs_urls, folders=inputs, **options.output_options("merge-lora"))


@dataclass
class CombineJob:
    """``stepmerge merge-lora``: fuse the adapters into the base (``output="model"``), or combine them
    into one adapter (``output="adapter"``), at ``target_url``. See the module docstring."""

    base_url: str | None
    adapter_urls: Sequence[str]
    target_url: str
    options: OutputOptions
    command = "merge-lora"

    def __post_init__(self) -> None:
        self.source_url = ",".join(self.adapter_urls)
        self.kind: str = self.options.output
        self._weights: list[float] | None = None
        self.inputs = InputFolders()  # the base and the adapters: listed once, read from that listing

    def fingerprint(self) -> str:
        self._weights = check_merge_lora_options(self.base_url, self.adapter_urls, self.options)
        return combine_fingerprint(self.base_url, self.adapter_urls, self.options, self.inputs)

    def prepare(self) -> PreparedJob:
        options, base_url = self.options, self.base_url
        weights = self._weights or check_merge_lora_options(base_url, self.adapter_urls, options)
        sources: dict[str, TensorSource] = {}
        try:
            inputs = []
            alphas = lora_alpha_per_adapter(options, len(self.adapter_urls))
            for i, (url, alpha) in enumerate(zip(self.adapter_urls, alphas)):
                adapter, sources[f"adapter{i}"] = read_adapter(url, lora_alpha=alpha, files=self.inputs.files(url))
                inputs.append(WeightedAdapter(f"adapter{i}", adapter, weights[i]))
            base_metas = config = None
            if base_url is not None:
                config = self.inputs.config(base_url, "base model")
                sources[BASE_NAMESPACE] = self.inputs.open(base_url)
                base_metas = sources[BASE_NAMESPACE].metas()
            source = NamespacedSource(sources)
            dtype = options.torch_dtype
            reports: list[ModuleReport] = []
            if options.output == "model":
                if base_url is None or base_metas is None or config is None:
                    raise InvalidOption("a fused model needs --base-model")
                fused = plan_fused_model(base_metas, config, inputs, max_shard_size=None, base_url=base_url)
                plan = in_weights_format(fused.with_dtype(dtype), config, options.weights_format,
                                         options.max_shard_size)
                output = shard_output(plan, source, then=lambda url: self.inputs.copy_metadata(
                    base_url, url, config, plan.config_updates))
            else:
                plan, adapter_json, reports = plan_combined_adapter(
                    inputs, source, base_metas, base_url, dtype=dtype, rank=options.rank, energy=options.energy,
                    device=options.device)
                adapter_json["base_model_name_or_path"] = adapter_base_name(
                    base_model_id=options.base_model_id, config=config, base_written=False, base_model=base_url)
                output = shard_output(plan, source, then=lambda url: [write_adapter_config(url, adapter_json)])
        except BaseException:
            for opened in sources.values():
                opened.close()
            raise
        provenance = {"command": "merge-lora", "base": base_url, "adapters": list(self.adapter_urls),
                      "weights": weights, "options": options.output_options(self.command),
                      "tensors": len(plan.tensors), "tensor_bytes": plan.total_size,
                      "svd": module_reports_json(reports) or None,
                      "lora": {"adapter_settings": adapter_settings(inputs, base_metas, config, base_url)}}
        if options.output == "model":  # config.json in the Hub's form: the keys added for 4.x readers
            provenance["config_translation"] = [change.to_json() for change in plan.config_changes]
        return PreparedJob([output], provenance, kind=options.output, notes=plan.notes, modules=tuple(reports),
                           sources=list(sources.values()), written_notes=self.inputs.left_out)


def merge_lora(base_url: str | None, adapter_urls: Sequence[str], target_url: str,
               options: OutputOptions = OutputOptions(), *, on_bytes: Callable[[int], None] | None = None,
               on_plan: Callable[[MergePlan], None] | None = None) -> OutputResult:
    """Fuse ``adapter_urls`` into the base at ``base_url`` (``output="model"``), or combine them into
    one adapter (``output="adapter"``), at ``target_url``: a `CombineJob`."""
    return run_job(CombineJob(base_url, adapter_urls, target_url, options), on_bytes=on_bytes, on_plan=on_plan)
