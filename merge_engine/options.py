"""The engine's options, written as typed records: one frozen dataclass per command, every field in the source.

- A command's record (`MergeArgs`, `ExtractLoraArgs`, ...) lists its flags as typed fields,
  each with its `Flag` (``flag(...)``: help, spellings, parser, choices) in the field's metadata. Groups that
  several commands share are written once as base records (`SourceArgs`: merge and test, verl's source flags;
  `RunArgs`: the commands whose shard jobs run here or on Ray). `merge_engine.cli` derives each command's
  parser from its record (`dataclasses.fields`) and reads the parsed flags back into it.
- A value is made canonical where it is given: a flag's parser (`Flag.parse`) turns the text into the value type
  the engine takes (a `Dtype`, a size in bytes, a tuple of names); nothing below reads a spelling again.
- The engine's options record (`merge_engine.output.jobs.OutputOptions`) marks each field an output records in
  its fingerprint and provenance (`setting`, `recorded_by`); `recorded_fields` reads the markers. A command's
  field sets the `OutputOptions` field of its name (`Flag.sets` where the names differ).
- `flag_name`: the spelling of a field's flag, for messages that name it.

Data only: no argparse, pydantic or torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as _default
from typing import Any, Literal

from merge_engine.option_values import (
    DEFAULT_MAX_SHARD_SIZE, DEFAULT_SHARD_SIZE, DEFAULT_WEIGHTS_FORMAT, WEIGHTS_FORMATS, Dtype, WeightsFormat,
    float_list, name_list, parse_dtype, parse_size, whole_number,
)

# the outputs whose fingerprint and provenance record options (`OutputJob.command`)
OUTPUTS = ("merge", "extract-lora", "extract-lora --finetuned", "merge-lora", "split")

FLAG, RECORDED = "flag", "recorded"  # the metadata keys of the markers


@dataclass(frozen=True)
class Recorded:
    """Which outputs record an `OutputOptions` field: ``always``, or ``when_set`` only (so that the fingerprints
    of outputs made without it stay as they were); ``key``: the name it is recorded under ("": the field's)."""

    always: tuple[str, ...] = ()
    when_set: tuple[str, ...] = ()
    key: str = ""


def recorded_by(*always: str, when_set: tuple[str, ...] = (), key: str = "") -> Recorded:
    """The marker of a field recorded by the outputs ``always`` (and by ``when_set`` only when it is set)."""
    return Recorded(always=always, when_set=when_set, key=key)


def setting(default: Any, recorded: Recorded | None = None) -> Any:
    """A field of the engine's options record with its default and, when outputs record it, its marker."""
    return _default(default=default, metadata={RECORDED: recorded} if recorded is not None else {})


def recorded_fields(record: type, output: str) -> dict[str, tuple[str, bool]]:
    """The fields of ``record`` (a dataclass) that ``output`` records: field name -> (the key it is recorded
    under, True when always recorded, False when only when set), in the record's order."""
    found: dict[str, tuple[str, bool]] = {}
    for item in dataclasses.fields(record):
        marker: Recorded | None = item.metadata.get(RECORDED)
        if marker is not None and (output in marker.always or output in marker.when_set):
            found[item.name] = (marker.key or item.name, output in marker.always)
    return found


@dataclass(frozen=True)
class Flag:
    """How a command's field is given on the command line (the marker `flag` puts in the field's metadata).

    ``names``: the stems of its spellings (default: the field's name); each is spelt ``--a_b`` and ``--a-b``
    (verl mixes both). ``hidden_names``: further stems taken but not listed in ``--help``. ``parse``: the text
    -> the field's value (argparse ``type``; None: the text as given), `InvalidOption` for a bad one; a bool
    field is a switch (store_true, or store_false when it defaults to True). ``sets``: the `OutputOptions`
    field it sets where the names differ ("": the field of its name, if there is one).
    """

    help: str
    parse: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] = ()
    required: bool = False
    positional: bool = False
    names: tuple[str, ...] = ()
    hidden_names: tuple[str, ...] = ()
    sets: str = ""

    def spellings(self, name: str, hidden: bool = False) -> tuple[str, ...]:
        """The command line's spellings of the field ``name`` (its hidden ones with ``hidden``)."""
        if self.positional:
            return (name,)
        stems = self.hidden_names if hidden else (self.names or (name,))
        found: list[str] = []
        for stem in stems:
            underscored, dashed = stem.replace("-", "_"), stem.replace("_", "-")
            found += [f"--{underscored}"] + ([f"--{dashed}"] if dashed != underscored else [])
        return tuple(found)


def flag(help: str, default: Any = None, *, parse: Callable[[str], Any] | None = None,
         choices: tuple[Any, ...] = (), required: bool = False, positional: bool = False,
         names: tuple[str, ...] = (), hidden_names: tuple[str, ...] = (), sets: str = "") -> Any:
    """A command record's field with its `Flag`; ``required`` (or ``positional``) fields have no default."""
    marker = Flag(help=help, parse=parse, choices=choices, required=required, positional=positional, names=names,
                  hidden_names=hidden_names, sets=sets)
    if required or positional:
        return _default(metadata={FLAG: marker})
    return _default(default=default, metadata={FLAG: marker})


def flag_of(record: type, name: str) -> Flag:
    """The `Flag` of field ``name`` of ``record`` (KeyError for a field without one)."""
    for item in dataclasses.fields(record):
        if item.name == name:
            return item.metadata[FLAG]
    raise KeyError(name)


def flag_name(record: type, name: str) -> str:
    """How messages name field ``name``'s flag: its dashed spelling (``--base-model``)."""
    return flag_of(record, name).spellings(name)[-1]


DTYPE_WORDS = "bfloat16/bf16, float16/fp16/half, float32/fp32/float"
WEIGHTS_HELP = ("hub (default): {}the names and per-expert tensors of the model's Hub checkpoint, what save_pretrained "
                "writes and vLLM/SGLang/PEFT read; transformers: the names as stored (transformers v5's in-memory "
                "names: fused experts, model.language_model)")
CHECK_TRAINED_HELP = ("LoRA checkpoints: after writing, compare the output with the trained model PEFT rebuilds from "
                      "the checkpoint (its LoraConfig; all-linear when the run recorded no targets); exit 5 when it "
                      "is not that model")
CUSTOM_MAPPING_HELP = "JSON file extending the model family's name table"


@dataclass(frozen=True, kw_only=True)
class RunArgs:
    """Where the shard jobs of a command that writes run: threads here, or tasks of a Ray cluster."""

    overwrite: bool = flag("replace a target that holds something else (another model, other files)", False)
    workers: int | None = flag("threads writing on this machine, shared out between the output files and their "
                               "byte ranges, so a one-file model uses them all (default: one per core)",
                               parse=whole_number)
    ray_address: str | None = flag("run the shard jobs as tasks of this Ray cluster: auto, HOST:PORT or "
                                   "ray://HOST:PORT (pip install -c constraints.txt '.[ray]' from the checkout); every "
                                   "worker reads and writes the storage URLs itself")
    requests_in_flight: int | None = flag("ranged GETs in flight per read of an s3:// or gs:// file (default 32, "
                                          "sized for object storage)", parse=whole_number)


@dataclass(frozen=True, kw_only=True)
class SourceArgs:
    """verl's model-merger source flags, which merge and test share."""

    local_dir: str = flag("checkpoint folder URL (path, file://, s3://, gs://)", required=True)
    backend: str | None = flag("checkpoint layout (fsdp, megatron, ...); detected when omitted")
    tie_word_embedding: bool | None = flag("verl compatibility: must agree with config.json's tie_word_embeddings")
    is_value_model: bool = flag("verl compatibility: critics are detected anyway", False)
    use_cpu_initialization: bool = flag("verl compatibility: no effect (always CPU)", False)
    trust_remote_code: bool = flag("allow custom model code when validating", False)
    dtype: Dtype | None = flag(f"output dtype ({DTYPE_WORDS}); default: as stored", parse=parse_dtype)
    hf_model_path: str | None = flag("folder with config.json + tokenizer to use instead of the checkpoint's "
                                     "huggingface/")
    custom_mapping: str | None = flag(f"Megatron: {CUSTOM_MAPPING_HELP} (see merge_engine/architectures/custom.py)")
    weights_format: WeightsFormat = flag(WEIGHTS_HELP.format(""), DEFAULT_WEIGHTS_FORMAT, choices=WEIGHTS_FORMATS)
    mtp_layers: Literal["export", "drop"] | None = flag(
        "Megatron: multi-token-prediction layers (DeepSeek-V3) written as the Hub checkpoint holds them, or dropped; "
        "a checkpoint with MTP layers is refused without this choice", choices=("export", "drop"))


@dataclass(frozen=True, kw_only=True)
class DiscoverArgs:
    run_root: str = flag("training run folder URL holding global_step_N/ (or iter_N/)", required=True)


@dataclass(frozen=True, kw_only=True)
class MergeArgs(SourceArgs, RunArgs):
    target_dir: str = flag("output folder URL", required=True)
    max_shard_size: int = flag(f"largest safetensors file, e.g. {DEFAULT_SHARD_SIZE} (default), 500MiB",
                               DEFAULT_MAX_SHARD_SIZE, parse=parse_size)
    lora_alpha: float | None = flag("LoRA checkpoints only: lora_alpha when the run recorded none (never guessed)",
                                    parse=float)
    base_model: str | None = flag("a Megatron LoRA step saved without its base (verl + Megatron-Bridge PEFT): the "
                                  "Hugging Face model the run trained from, to fuse the adapter into")
    check_trained: bool = flag(CHECK_TRAINED_HELP, False)
    hf_upload_path: str | None = flag("after the merge, push the merged folder to this Hugging Face Hub repo "
                                      "(verl's flag)")
    private: bool = flag("create the Hub repo, private, when it does not exist (never a public one)", False)


@dataclass(frozen=True, kw_only=True)
class TestArgs(SourceArgs):
    __test__ = False  # not a pytest class

    test_hf_dir: str = flag("reference Hugging Face folder to compare against", required=True)
    atol: float | None = flag("absolute tolerance (default: the engine's weight tolerance, verl's 1e-6)", parse=float)
    rtol: float | None = flag("relative tolerance (default: the engine's weight tolerance, verl's 1e-6)", parse=float)


@dataclass(frozen=True, kw_only=True)
class CheckArgs:
    local_dir: str = flag("checkpoint folder URL", required=True)
    backend: str | None = flag("checkpoint layout; detected when omitted")


@dataclass(frozen=True, kw_only=True)
class VerifyArgs:
    url: str = flag("release (or merged folder) URL", positional=True)
    quick: bool = flag("on object stores compare the store's recorded versions (one listing, no byte read) instead "
                       "of re-hashing; local files are re-hashed anyway", False)


@dataclass(frozen=True, kw_only=True)
class PushArgs:
    url: str = flag("release (or merged folder) URL", positional=True)
    repo: str = flag("the Hugging Face Hub repo id (namespace/name)", required=True)
    revision: str | None = flag("the Hub branch to push to, e.g. step-300 (default: main); created from main when "
                                "missing")
    private: bool = flag("create the Hub repo, private, when it does not exist (never a public one)", False)


@dataclass(frozen=True, kw_only=True)
class RegisterArgs:
    url: str = flag("release URL (an object store's: MLflow takes it as the version's source)", positional=True)
    name: str = flag("the registered model's name in MLflow's Model Registry (created when missing)", required=True)
    tracking_uri: str | None = flag("the MLflow tracking server, e.g. http://mlflow:5000 (default: "
                                    "MLFLOW_TRACKING_URI)")
    run_root: str | None = flag("the run root the version's tag names (default: the folder above releases/)")
    step: int | None = flag("the step the version's tag names (default: from the release folder's name)",
                            parse=int)


@dataclass(frozen=True, kw_only=True)
class ExtractLoraArgs(RunArgs):
    local_dir: str | None = flag("LoRA training checkpoint URL (PEFT-wrapped model)")
    finetuned: str | None = flag("full fine-tune URL (Hugging Face folder or FSDP checkpoint): extract "
                                 "(finetuned - base) by SVD")
    target_dir: str = flag("output URL: the PEFT adapter folder (the clean base goes to <target>/base/)",
                           required=True)
    backend: str | None = flag("layout of --local_dir / --finetuned (fsdp, hf); detected when omitted")
    dtype: Dtype | None = flag(f"output dtype ({DTYPE_WORDS}; default: as stored; float32 for SVD factors)",
                               parse=parse_dtype)
    max_shard_size: int = flag(f"largest safetensors file of the base, e.g. {DEFAULT_SHARD_SIZE}",
                               DEFAULT_MAX_SHARD_SIZE, parse=parse_size)
    hf_model_path: str | None = flag("folder with config.json + tokenizer overriding huggingface/")
    weights_format: WeightsFormat = flag(WEIGHTS_HELP.format("the base/ folder and the adapter's module names: "),
                                         DEFAULT_WEIGHTS_FORMAT, choices=WEIGHTS_FORMATS)
    include_base: bool = flag("do not write the clean base model under base/ (the adapter alone)", True,
                              names=("no_include_base",), hidden_names=("adapter_only",))
    lora_alpha: float | None = flag("lora_alpha when the run recorded none (never guessed; must agree with the run's "
                                    "metadata)", parse=float)
    base_model: str | None = flag("base model URL: checks a LoRA-only checkpoint's adapter; with --finetuned, the "
                                  "SVD's base")
    base_model_id: str | None = flag(
        "the base model's Hugging Face Hub id (namespace/name), named in adapter_config.json's base_model_name_or_path "
        "and the model card (default: the run config's _name_or_path when it is a Hub id, else base, the clean base "
        "beside the adapter)")
    rank: int | None = flag("SVD: rank of each module's adapter", parse=int)
    energy: float | None = flag("SVD: keep this fraction of each update's squared singular values (capped by --rank)",
                                parse=float)
    target_modules: tuple[str, ...] | None = flag("SVD: modules to factor, e.g. q_proj,v_proj (default: all linear "
                                                  "weights but embeddings and heads)", parse=name_list)
    check_trained: bool = flag(CHECK_TRAINED_HELP, False)
    device: str | None = flag("SVD: torch device, cpu, cuda, cuda:N or auto (default auto: cuda when this torch sees a "
                              "GPU, else cpu)")


@dataclass(frozen=True, kw_only=True)
class MergeLoraArgs(RunArgs):
    lora_adapter: tuple[str, ...] = flag("PEFT adapter folder URL(s), comma-separated", required=True, parse=name_list)
    target_dir: str = flag("output URL", required=True)
    dtype: Dtype | None = flag(f"output dtype ({DTYPE_WORDS}; default: as stored)", parse=parse_dtype)
    max_shard_size: int = flag(f"largest safetensors file, e.g. {DEFAULT_SHARD_SIZE} (default)",
                               DEFAULT_MAX_SHARD_SIZE, parse=parse_size)
    weights_format: WeightsFormat = flag(WEIGHTS_HELP.format("the fused model in "), DEFAULT_WEIGHTS_FORMAT,
                                         choices=WEIGHTS_FORMATS)
    lora_alpha: tuple[float, ...] | None = flag("one lora_alpha per adapter, comma-separated: replaces a lost (0) "
                                                "alpha in adapter_config.json", parse=float_list)
    base_model: str | None = flag("base model URL (Hugging Face folder); required for --output model")
    base_model_id: str | None = flag(
        "the base model's Hugging Face Hub id (namespace/name), named in adapter_config.json's base_model_name_or_path "
        "and the model card (default: the run config's _name_or_path when it is a Hub id, else base, the clean base "
        "beside the adapter)")
    merge_method: Literal["concat", "weighted", "average"] = flag(
        "concat: sum of all updates; weighted: with --adapter-weights; average: equal weights", "concat",
        choices=("concat", "weighted", "average"), sets="method")
    adapter_weights: tuple[float, ...] | None = flag("weighted: one weight per adapter, comma-separated",
                                                     parse=float_list, sets="weights")
    output: Literal["model", "adapter"] = flag("model: the fused model; adapter: one adapter (exact rank stacking, or "
                                               "SVD with --rank/--energy)", "model", choices=("model", "adapter"))
    rank: int | None = flag("adapter output: re-factor each module to this rank by SVD", parse=int)
    energy: float | None = flag("adapter output: keep this fraction of each update's squared singular values (capped "
                                "by --rank)", parse=float)
    device: str | None = flag("SVD device: cpu, cuda, cuda:N or auto (default: cuda when available)")


@dataclass(frozen=True, kw_only=True)
class SplitArgs(RunArgs):
    hf_dir: str = flag("Hugging Face model folder URL", required=True)
    target_dir: str = flag("output folder URL", required=True)
    to: Literal["megatron"] = flag("target framework (megatron)", "megatron", choices=("megatron",))
    dtype: Dtype | None = flag(f"dtype of the shards ({DTYPE_WORDS}; default: as stored)", parse=parse_dtype)
    custom_mapping: str | None = flag(CUSTOM_MAPPING_HELP)
    tp: int = flag("tensor-parallel size", 1, parse=int)
    pp: int = flag("pipeline-parallel size", 1, parse=int)
    vpp: int | None = flag("virtual pipeline (interleaved) chunks per stage", parse=int)
    ep: int = flag("expert-parallel size (MoE)", 1, parse=int)
    format: Literal["legacy", "dist"] = flag("legacy: model/mp_rank_*/model.pt; dist: torch_dist dist_ckpt/",
                                             "legacy", choices=("legacy", "dist"))
    make_vocab_size_divisible_by: int = flag("Megatron pads the vocabulary to a multiple of this times TP "
                                             "(default 128)", 128, parse=int)


@dataclass(frozen=True, kw_only=True)
class CheckTrainedArgs:
    local_dir: str = flag("the LoRA training checkpoint URL (PEFT-wrapped model)", required=True)
    backend: str | None = flag("layout of --local_dir; detected when omitted")
    fused_model: str | None = flag("a Hugging Face folder that should be the trained model")
    adapter: str | None = flag("a PEFT adapter folder with its base under base/")
    hf_model_path: str | None = flag("folder with the model's config.json instead of huggingface/")
    lora_alpha: float | None = flag("lora_alpha when the run recorded none", parse=float)
    device: str | None = flag("torch device of the forward passes: cpu, cuda, cuda:N or auto (default: cuda when "
                              "available)")
