"""Hugging Face model -> Megatron shards (the reverse of a merge): ``stepmerge split --to megatron``.

The same family tables drive both directions: `MegatronViewOfHf` gives the canonical Megatron
tensors (QKV merged per query group, gate/up fused, vocabulary padded with zero rows to a
multiple of ``make_vocab_size_divisible_by * tp``), then the layout of ``--format`` writes them
(`merge_engine.layouts.contract.Writer`):

- ``legacy`` (verl's older layout; `merge_engine.layouts.megatron_legacy` reads and writes it):
  ``model/mp_rank_TT[_PPP][_EEE]/model.pt`` = a list of local-spec state dicts, one per VPP chunk,
  local layer and expert numbers, each rank's TP piece (`merge_engine.architectures.parallel.split_tp`); linear modules carry a
  ``None`` ``_extra_state`` as megatron-core's own ``state_dict()`` has; config and tokenizer in
  ``hf_config_and_tokenizer/``.
- ``dist`` (torch_dist, verl v1's layout; `merge_engine.layouts.megatron_dist` reads and writes it):
  ``dist_ckpt/`` with global keys, layers stacked on dim 0, one chunk per layer (megatron-core
  reshards it to any TP/PP on load); config and tokenizer in ``huggingface/``.

Both write ``transformer_config.json``: the TransformerConfig / GPTModel values the Megatron model
must be built with to match (sizes, head counts, norm epsilon, RoPE theta, padded vocabulary,
parallel sizes), and ``stepmerge.json`` (provenance) last. The target gets everything or nothing
(`merge_engine.output.target`).

Each file is one work unit (`LayoutFileUnit` over a `merge_engine.layouts.contract.FileJob`: a rank file,
or one layer's DCP data file), run by the executor like a merge's shards: ``--workers N`` at once here, or as Ray tasks,
byte-identical whatever runs them; each job hashes what it writes (`OutputResult.checksums`). Memory per
job: one rank file's tensors, i.e. one TP rank's share of a pipeline stage (legacy: a rank file is one
``torch.save``), one tensor (dist).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from merge_engine import engine_identity, storage
from merge_engine.architectures import model_dims, table_for_config
from merge_engine.architectures.hf_to_megatron import MegatronViewOfHf
from merge_engine.architectures.megatron_names import is_mla
from merge_engine.architectures.parallel import TPKind, tp_kind
from merge_engine.architectures.transforms import padded_vocab_size
from merge_engine.errors import InvalidOption
from merge_engine.formats.hf_metadata import copy_metadata, read_config
from merge_engine.output.jobs import OutputOptions, OutputResult, PreparedJob, run_job
from merge_engine.layouts import Checkpoint, check_checkpoint, layout_named, open_checkpoint
from merge_engine.output.work_unit import PlannedOutput
from merge_engine.layouts.contract import FileJob, ParallelSizes, Writer
from merge_engine.storage.written import FileRecord


# --format -> the layout that writes it
FORMATS = {"legacy": "megatron_legacy", "dist": "megatron_dist"}
TRANSFORMER_CONFIG = "transformer_config.json"


def writable_layout(fmt: str) -> Writer:
    """How the layout of ``--format fmt`` is written."""
    writer = layout_named(FORMATS[fmt]).writer
    assert writer is not None, f"{FORMATS[fmt]} has no writer"  # FORMATS names writable layouts only
    return writer


def _check_options(options: OutputOptions, view: MegatronViewOfHf) -> None:
    dims = view.dims
    vpp = options.vpp or 1
    problems = []
    if options.format not in FORMATS:
        problems.append(f"--format must be one of {tuple(FORMATS)}")
    if view.megatron_prefix and options.format != "dist":
        problems.append(f"a model whose Megatron checkpoint keeps its language model under {view.megatron_prefix!r} "
                        "(Megatron-Bridge's vision-language models) is written as --format dist only")
    if min(options.tp, options.pp, options.ep) < 1:
        problems.append("--tp, --pp and --ep must be >= 1")
    if options.vpp is not None and (options.vpp < 2 or options.pp < 2):
        problems.append("--vpp needs --vpp >= 2 and --pp >= 2")
    if dims.num_layers % (options.pp * vpp):
        problems.append(f"{dims.num_layers} layers do not split into pp x vpp = {options.pp * vpp} equal chunks")
    if dims.num_heads % options.tp:
        problems.append(f"{dims.num_heads} attention heads do not split over TP={options.tp}")
    if options.ep > 1 and (not dims.num_experts or dims.num_experts % options.ep):
        problems.append(f"{dims.num_experts} experts do not split over EP={options.ep}")
    for name, meta in view.metas().items():
        kind = tp_kind(name, view.gated(name))
        dim = {TPKind.ROW: 1, TPKind.COLUMN: 0, TPKind.GATED_COLUMN: 0}.get(kind)
        parts = options.tp * (2 if kind is TPKind.GATED_COLUMN else 1)
        if dim is not None and options.tp > 1 and meta.shape[dim] % parts:
            problems.append(f"{name} {meta.shape} does not split over TP={options.tp}")
            break
    if problems:
        raise InvalidOption("; ".join(problems))


def _rope_theta(config: Mapping[str, Any]) -> float | None:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    value = config.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else None)
    return float(value) if value is not None else None


def _rotary_percent(config: Mapping[str, Any]) -> float:
    """Share of each head's dims RoPE rotates (``partial_rotary_factor``: GLM-4.5 0.5)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    value = config.get("partial_rotary_factor") or (params.get("partial_rotary_factor") if isinstance(params, dict)
                                                    else None)
    return float(value) if value is not None else 1.0


def transformer_config(config: Mapping[str, Any], view: MegatronViewOfHf, options: OutputOptions) -> dict[str, Any]:
    """The Megatron TransformerConfig / GPTModel values the shards must be loaded with (a
    vision-language model's: those of its language model, ``text_config``)."""
    config = config.get("text_config") or config
    dims = view.dims
    metas = view.metas()
    names = list(metas)
    fc2 = next((m for n, m in metas.items() if n.endswith("mlp.linear_fc2.weight")), None)
    expert_fc2 = next((m for n, m in metas.items() if ".local_experts." in n and n.endswith("linear_fc2.weight")), None)
    shared_fc2 = next((m for n, m in metas.items() if "shared_experts.linear_fc2" in n), None)
    out: dict[str, Any] = {
        "num_layers": dims.num_layers,
        "hidden_size": dims.hidden_size,
        "ffn_hidden_size": int(config.get("intermediate_size") or (fc2.shape[1] if fc2 else 0)),
        "num_attention_heads": dims.num_heads,
        "num_query_groups": dims.num_kv_heads,
        "kv_channels": dims.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.get("rms_norm_eps") or config.get("layer_norm_eps") or 1e-5),
        "gated_linear_unit": any(view.gated(n) for n in names if "linear_fc1" in n),
        "add_bias_linear": False,
        "add_qkv_bias": any(n.endswith("linear_qkv.bias") for n in names),
        "qk_layernorm": any(n.endswith("q_layernorm.weight") for n in names),
        "tensor_model_parallel_size": options.tp,
        "pipeline_model_parallel_size": options.pp,
        "virtual_pipeline_model_parallel_size": options.vpp,
        "expert_model_parallel_size": options.ep,
        # GPTModel arguments
        "vocab_size": dims.vocab_size,
        "padded_vocab_size": dims.padded_vocab_size,
        "make_vocab_size_divisible_by": options.make_vocab_size_divisible_by,
        "share_embeddings_and_output_weights": dims.tied,
        "position_embedding_type": "rope",
        "rotary_base": _rope_theta(config),
        "rotary_percent": _rotary_percent(config),
        "max_sequence_length": config.get("max_position_embeddings"),
    }
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("mrope_section"):  # Qwen2.5-VL's multimodal RoPE
        out.update(position_embedding_type="mrope", mrope_section=list(rope["mrope_section"]))
    if is_mla(names):
        out.update(multi_latent_attention=True, q_lora_rank=config.get("q_lora_rank"),
                   kv_lora_rank=config.get("kv_lora_rank"), qk_head_dim=config.get("qk_nope_head_dim"),
                   qk_pos_emb_head_dim=config.get("qk_rope_head_dim"), v_head_dim=config.get("v_head_dim"),
                   kv_channels=config.get("v_head_dim"), qk_layernorm=True)
    if any(n.endswith("mlp.router.expert_bias") for n in names):
        out.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_topk_scaling_factor=config.get("routed_scaling_factor"))
    if dims.num_experts:
        out.update(num_moe_experts=dims.num_experts, moe_ffn_hidden_size=expert_fc2.shape[1] if expert_fc2 else None,
                   moe_router_topk=config.get("num_experts_per_tok"),
                   moe_shared_expert_intermediate_size=shared_fc2.shape[1] if shared_fc2 else None,
                   # megatron-core's list form: 1 MoE layer, 0 dense layer
                   moe_layer_freq=[int(i in dims.moe_layers) for i in range(dims.num_layers)])
    return out


def split_fingerprint(checkpoint: Checkpoint, options: OutputOptions) -> str:
    """The cache key of a split: the Hugging Face folder's listing, the options, the engine version."""
    return storage.fingerprint(checkpoint.files, **options.output_options("split"), **engine_identity(), kind="split")


@dataclass(frozen=True, eq=False)
class LayoutFileUnit:
    """One file a layout's `Writer` writes whole (a rank file, a DCP data file), a work unit
    (`WorkUnit`): its size is known once written (planned as -1), and it uses one thread."""

    writer: Writer
    view: MegatronViewOfHf
    job: FileJob
    sizes: ParallelSizes
    dtype: torch.dtype | None

    @property
    def planned(self) -> tuple[str, int, tuple[str, ...]]:
        return self.job.file, -1, self.job.tensors

    def run(self, folder_url: str, cancel: threading.Event | None = None, *, chunk_bytes: int, threads: int = 1,
            on_bytes: Callable[[int], None] | None = None) -> FileRecord:
        record = self.writer.write_file(self.view, self.job, folder_url, self.sizes, self.dtype, cancel)
        if on_bytes is not None:
            on_bytes(record.size)
        return record


@dataclass
class SplitJob:
    """``stepmerge split --to megatron``: the Hugging Face model at ``source_url`` as Megatron shards at
    ``target_url``, written by the layout of ``options.format``. Its files are not safetensors shards: the
    job's one output holds a `LayoutFileUnit` per rank file (``legacy``) or DCP data file (``dist``),
    which the executor runs like a merge's shards (``--workers``, ``--ray-address``: same bytes)."""

    source_url: str
    target_url: str
    options: OutputOptions
    command = "split"
    kind = "megatron"

    def __post_init__(self) -> None:
        self._checked: tuple[Checkpoint, dict[str, Any]] | None = None

    def _check(self) -> tuple[Checkpoint, dict[str, Any]]:
        if self._checked is None:
            checkpoint = check_checkpoint(self.source_url, "hf")
            self._checked = checkpoint, read_config(self.source_url, what="Hugging Face model")
        return self._checked

    def fingerprint(self) -> str:
        return split_fingerprint(self._check()[0], self.options)

    def prepare(self) -> PreparedJob:
        checkpoint, config = self._check()
        options, hf_url = self.options, self.source_url
        dtype = options.torch_dtype
        table = table_for_config(config, options.custom_mapping)
        scope = config.get("text_config") or config
        dims = model_dims(config, table, padded_vocab_size=padded_vocab_size(
            int(scope["vocab_size"]), options.tp, options.make_vocab_size_divisible_by))
        view = MegatronViewOfHf(open_checkpoint(checkpoint), table, config, dims)
        try:
            _check_options(options, view)
            view.check_tied_copies(options.chunk_bytes)
            megatron_config = transformer_config(config, view, options)
        except BaseException:
            view.close()
            raise
        sizes = ParallelSizes(tp=options.tp, pp=options.pp, vpp=options.vpp, ep=options.ep)
        writer = writable_layout(options.format)

        left_out: list[str] = []

        def write_config(url: str) -> list[tuple[str, int]]:
            files = [(f"{writer.config_dir}/{n}", s) for n, s in copy_metadata(
                hf_url, storage.join(url, writer.config_dir), config, on_left_out=left_out.append)]
            data = (json.dumps(megatron_config, indent=2, sort_keys=True) + "\n").encode()
            storage.write_bytes(storage.join(url, TRANSFORMER_CONFIG), data)
            return files + [(TRANSFORMER_CONFIG, len(data))]

        units = [LayoutFileUnit(writer, view, file_job, sizes, dtype) for file_job in writer.file_jobs(view, sizes)]
        rank_files = PlannedOutput(units, finish=writer.finish, then=write_config)
        provenance = {"source": hf_url, "kind": "megatron split", "options": options.output_options(self.command),
                      "tensors": len(view.metas())}
        return PreparedJob([rank_files], provenance, kind=self.kind, layout=FORMATS[options.format],
                           tensors=len(view.metas()), tensor_bytes=0, sources=[view], written_notes=left_out)


def split_hf_to_megatron(hf_url: str, target_url: str, options: OutputOptions = OutputOptions()) -> OutputResult:
    """Write the Hugging Face model at ``hf_url`` as Megatron shards at ``target_url`` (a `SplitJob`; see
    the module docstring).

    Errors: `InvalidOption` (sizes that do not split), `MappingError` (a tensor the table does not
    know, or one the config implies missing), `UnknownArchitecture`, `TargetExists`; nothing is
    left at the target on any error.
    """
    return run_job(SplitJob(hf_url, target_url, options))
