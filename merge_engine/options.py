"""Every user-facing option, declared once: the one place a new option is added.

An `Option` says what a user may set and everything each surface needs to offer it:

- ``name``: the argparse destination, the flow parameter, the settings record's field (unless
  ``settings`` renames it) and the key recorded in fingerprints, provenance and manifests;
- ``kind``: the kind of value (`KINDS`); each surface reads it its own way (argparse ``type``/``action``,
  the form's pydantic type, the settings record's type, the engine's value);
- ``default`` (None: unset; ``REQUIRED``: must be given), ``choices``;
- ``help``: the command line's text, ``commands``: the commands that take it, each with its own text
  where it differs (a `Use`, or its help as a plain string; ``""``: ``help``). Its spellings are
  `Option.spellings`: ``--a_b`` and ``--a-b``, verl's model-merger flags among them;
- ``form``: the Prefect form's description, ``flows``: the flows that take it (the form is flat: one
  field per option, in declaration order);
- ``field``: the engine option (`OutputOptions` field) it sets, if any;
- ``shapes``: the commands and flows whose output it shapes, i.e. whose fingerprint, provenance or
  release manifest records it (``"merge?"``: recorded only when set, so older outputs keep their
  fingerprints);
- ``settings``: the pipeline's settings records carrying it (record -> field name there, ``""``: ``name``).

Data only: no argparse, Prefect, pydantic or torch here. `merge_engine.cli`, `flows.params`,
`tasks.records` and `merge_engine.output.jobs` generate their flags, signatures, records and recorded
options from `OPTIONS` (tests/merge_engine/test_options.py checks each surface against it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as _default
from typing import Any

REQUIRED = "<required>"  # `Option.default` of an option that must be given

# The kinds of value, and what each is on the command line:
KINDS = {
    "text": "a string",
    "url": "a storage URL or a path",
    "int": "an integer",
    "count": "a whole number >= 1 (the form's 0: unset)",
    "step": "a global step number >= 0",
    "float": "a number",
    "alpha": "a LoRA alpha > 0 (the form's 0: unset)",
    "floats": "comma-separated numbers -> a tuple of floats",
    "names": "comma-separated names -> a tuple of strings",
    "bool": "a switch (store_true on the command line)",
    "size": "a size such as 5GB or 500MiB (the engine's value: bytes)",
    "dtype": "a dtype spelling (merge_engine.option_values.DTYPE_SPELLINGS) -> its canonical name",
    "choice": "one of ``choices``",
    "choices": "a list of ``choices``",
    "ray_address": "auto, local, host:port or ray://host:port",
}

# commands and flows (the names `Option.commands`, `Option.flows` and `Option.shapes` use)
COMMANDS = ("discover", "merge", "test", "check", "verify", "extract-lora", "merge-lora", "split", "check-trained",
            "notify")
FLOWS = ("merge_step", "merge_new_steps", "release_adapter")
OUTPUTS = ("merge", "extract-lora", "extract-lora --finetuned", "merge-lora", "split", "merge_step", "release_adapter")
# The pipeline's settings records (`tasks.records.SETTINGS_RECORDS` makes one class per name, this text its
# docstring; a flow's stages get them all at once: `flows.params.FlowParams.settings`)
SETTINGS: dict[str, str] = {
    "merge": ("The merge options a flow exposes (the engine's `OutputOptions` minus target handling). "
              "``lora_alpha`` matters to LoRA checkpoints whose run recorded no alpha: their merged model is the "
              "trained one (every update fused with its alpha), so the merge needs it as much as the adapter."),
    "adapter": ("The adapter-extraction options a flow exposes. ``include_base`` also writes the clean base model "
                "under ``base/`` of the adapter release, so ``PeftModel.from_pretrained(<release>/base, <release>)`` "
                "needs nothing else (and validation can load it); ``base_model`` names the base of a LoRA-only "
                "checkpoint."),
    "validation": "What to validate: the forward pass (GPU when present), and a reference to compare with.",
    "execution": ("Where a merge's shard jobs run; never part of a cache key or a manifest (the bytes are the same). "
                  "``ray_address``: Prefect task runs on that Ray cluster (`tasks.shard_runs`; None: the worker's "
                  "``STEPMERGE_RAY_ADDRESS``, else none); otherwise ``workers`` threads here (None: one per core)."),
}


@dataclass(frozen=True)
class Use:
    """How one command takes an option when it differs from the option's own ("" / None: the option's)."""

    help: str = ""
    required: bool | None = None
    kind: str = ""


@dataclass(frozen=True)
class Option:
    """One user-facing option (see the module docstring for each field)."""

    name: str
    kind: str
    default: Any = None
    help: str = ""
    commands: Mapping[str, Use | str] = _default(default_factory=dict)
    form: str = ""
    flows: tuple[str, ...] = ()
    field: str = ""
    shapes: tuple[str, ...] = ()
    settings: Mapping[str, str] = _default(default_factory=dict)
    choices: tuple[Any, ...] = ()
    hidden: bool = False  # taken on the command line (verl's scripts pass it) but not listed in --help
    positional: bool = False  # a command-line argument, not a flag

    @property
    def required(self) -> bool:
        return self.default == REQUIRED

    @property
    def spellings(self) -> tuple[str, ...]:
        """The command line's spellings: ``--a_b`` and its ``--a-b`` twin (verl mixes both), or the name."""
        if self.positional:
            return (self.name,)
        underscored, dashed = self.name.replace("-", "_"), self.name.replace("_", "-")
        return (f"--{underscored}",) + ((f"--{dashed}",) if dashed != underscored else ())

    def use(self, command: str) -> Use:
        """How ``command`` takes it: help, required, kind (the option's own where the command says nothing)."""
        given = self.commands[command]
        given = Use(help=given) if isinstance(given, str) else given
        return Use(help=given.help or self.help, kind=given.kind or self.kind,
                   required=self.required if given.required is None else given.required)

    def records(self, output: str) -> bool | None:
        """True: ``output`` records this option; None: only when it is set; False: it does not."""
        return True if output in self.shapes else (None if f"{output}?" in self.shapes else False)


DTYPES = "bfloat16/bf16, float16/fp16/half, float32/fp32/float"
RUNS = ("merge", "extract-lora", "merge-lora", "split")  # the commands whose shard jobs run here or on Ray
SOURCE = ("merge", "test")  # verl's source flags: merge and test take the same
WEIGHTS_HELP = ("hub (default): {}the names and per-expert tensors of the model's Hub checkpoint, what save_pretrained "
                "writes and vLLM/SGLang/PEFT read; transformers: the names as stored (transformers v5's in-memory "
                "names: fused experts, model.language_model)")
CHECK_TRAINED_HELP = ("LoRA checkpoints: after writing, compare the output with the trained model PEFT rebuilds from "
                      "the checkpoint (its LoraConfig; all-linear when the run recorded no targets); exit 5 when it "
                      "is not that model")


def _each(commands: tuple[str, ...], use: Use | str = "") -> dict[str, Use | str]:
    return dict.fromkeys(commands, use)


OPTIONS: tuple[Option, ...] = (
    # where the run and its releases are (the flows' first fields)
    Option("step", "step", REQUIRED, "the global step just saved", {"notify": ""},
           "The global step to merge (its folder is global_step_N)", ("merge_step", "release_adapter")),
    Option("run_root", "url", REQUIRED, "training run folder URL holding global_step_N/ (or iter_N/)",
           {"discover": "", "notify": "the run root URL the training job writes global_step_N/ to"},
           "The training run's checkpoint folder: a path, file://, s3://bucket/... or gs://bucket/...", FLOWS),
    Option("role", "choice", "actor", "actor (default), critic, or '' (SFT)", {"notify": ""},
           "actor, critic, or empty for SFT runs (weights in the step folder)", ("merge_step", "release_adapter"),
           choices=("actor", "critic", "")),
    Option("release_root", "url", form="Where releases are published; empty: the run root's releases/ folder",
           flows=FLOWS),
    Option("roles", "choices", ("actor", ""), form="Roles to merge (actor, critic, empty for SFT)",
           flows=("merge_new_steps",), choices=("actor", "critic", "")),
    Option("merge_deployment", "text", "merge-step/gpu", flows=("merge_new_steps",),
           form="Deployment that merges one step, used when this flow runs from a deployment"),
    Option("max_steps", "count", form="Merge at most this many new steps per run (oldest first); 0: every new step",
           flows=("merge_new_steps",)),
    Option("include_base", "bool", True, form="Also release the clean base model under base/",
           flows=("release_adapter",), field="write_base", shapes=("release_adapter",), settings={"adapter": ""}),
    # the checkpoint and how to read it
    Option("backend", "text", None, "checkpoint layout (fsdp, megatron, ...); detected when omitted",
           {**_each(SOURCE), "check": "checkpoint layout; detected when omitted",
            "check-trained": "layout of --local_dir; detected when omitted",
            "extract-lora": "layout of --local_dir / --finetuned (fsdp, hf); detected when omitted"},
           field="backend", shapes=("extract-lora", "extract-lora --finetuned"), settings={"merge": "", "adapter": ""}),
    Option("local_dir", "url", REQUIRED, "checkpoint folder URL (path, file://, s3://, gs://)",
           {**_each(SOURCE), "check": "checkpoint folder URL",
            "check-trained": "the LoRA training checkpoint URL (PEFT-wrapped model)",
            "extract-lora": Use("LoRA training checkpoint URL (PEFT-wrapped model)", required=False)}),
    Option("url", "url", REQUIRED, "release (or merged folder) URL", {"verify": ""}, positional=True),
    Option("hf_dir", "url", REQUIRED, "Hugging Face model folder URL", {"split": ""}),
    Option("finetuned", "url", None, "full fine-tune URL (Hugging Face folder or FSDP checkpoint): extract "
           "(finetuned - base) by SVD", {"extract-lora": ""}),
    Option("lora_adapter", "text", REQUIRED, "PEFT adapter folder URL(s), comma-separated", {"merge-lora": ""}),
    Option("fused_model", "url", None, "a Hugging Face folder that should be the trained model", {"check-trained": ""}),
    Option("adapter", "url", None, "a PEFT adapter folder with its base under base/", {"check-trained": ""}),
    Option("test_hf_dir", "url", REQUIRED, "reference Hugging Face folder to compare against", {"test": ""}),
    Option("target_dir", "url", REQUIRED, "output folder URL",
           {"merge": "", "split": "", "merge-lora": "output URL",
            "extract-lora": "output URL: the PEFT adapter folder (the clean base goes to <target>/base/)"}),
    Option("tie_word_embedding", "bool", None, "verl compatibility: must agree with config.json's tie_word_embeddings",
           _each(SOURCE), field="tie_word_embedding"),
    Option("is_value_model", "bool", False, "verl compatibility: critics are detected anyway", _each(SOURCE)),
    Option("use_cpu_initialization", "bool", False, "verl compatibility: no effect (always CPU)", _each(SOURCE)),
    Option("trust_remote_code", "bool", False, "allow custom model code when validating", _each(SOURCE)),
    Option("to", "choice", "megatron", "target framework (megatron)", {"split": ""}, choices=("megatron",)),
    # what is written
    Option("dtype", "dtype", None, f"output dtype ({DTYPES}); default: as stored",
           {**_each(SOURCE), "extract-lora": f"output dtype ({DTYPES}; default: as stored; float32 for SVD factors)",
            "merge-lora": f"output dtype ({DTYPES}; default: as stored)",
            "split": f"dtype of the shards ({DTYPES}; default: as stored)"},
           "Output dtype: as stored (the checkpoint's own), bfloat16/bf16, float16/fp16/half, float32/fp32/float",
           FLOWS, "dtype", OUTPUTS, {"merge": "", "adapter": ""}),
    Option("max_shard_size", "size", "5GB", "largest safetensors file, e.g. 5GB (default), 500MiB",
           {"merge": "", "extract-lora": "largest safetensors file of the base, e.g. 5GB",
            "merge-lora": "largest safetensors file, e.g. 5GB (default)"},
           "Largest safetensors file, e.g. 5GB or 500MiB", ("merge_step", "merge_new_steps"), "max_shard_size",
           ("merge", "extract-lora", "merge-lora", "merge_step"), {"merge": "", "adapter": ""}),
    Option("hf_model_path", "url", None, "folder with config.json + tokenizer to use instead of the checkpoint's "
           "huggingface/",
           {**_each(SOURCE), "check-trained": "folder with the model's config.json instead of huggingface/",
            "extract-lora": "folder with config.json + tokenizer overriding huggingface/"},
           "Folder with config.json + tokenizer replacing the checkpoint's huggingface/; empty: the checkpoint's own",
           ("merge_step", "merge_new_steps"), "hf_model_path", ("merge", "extract-lora", "merge_step"),
           {"merge": "", "adapter": ""}),
    Option("custom_mapping", "url", None, "Megatron: JSON file extending the model family's name table (see "
           "merge_engine/architectures/custom.py)",
           {**_each(SOURCE), "split": "JSON file extending the model family's name table"},
           field="custom_mapping", shapes=("merge?", "split")),
    Option("weights_format", "choice", "hub", WEIGHTS_HELP.format(""),
           {**_each(SOURCE), "extract-lora": WEIGHTS_HELP.format("the base/ folder and the adapter's module names: "),
            "merge-lora": WEIGHTS_HELP.format("the fused model in ")},
           "Tensor names written: hub (the model's Hub checkpoint: per-expert MoE tensors, what vLLM, SGLang and PEFT "
           "read) or transformers (as the training job stored them)", ("merge_step", "merge_new_steps"),
           "weights_format", ("merge", "extract-lora", "merge-lora", "merge_step"), {"merge": "", "adapter": ""},
           choices=("hub", "transformers")),
    Option("mtp_layers", "choice", None, "Megatron: multi-token-prediction layers (DeepSeek-V3) written as the Hub "
           "checkpoint holds them, or dropped; a checkpoint with MTP layers is refused without this choice",
           _each(SOURCE), field="mtp_layers", shapes=("merge?",), choices=("export", "drop")),
    Option("validate_forward", "bool", True, form="Load the model and run a forward pass (GPU if present)",
           flows=FLOWS, shapes=("merge_step", "release_adapter"), settings={"validation": "forward"}),
    Option("compare_with_model_release", "bool", True, flows=("release_adapter",),
           form="Compare PEFT's logits with the step's released merged model, when it was built from this checkpoint"),
    Option("reference_url", "url", form="A Hugging Face folder to compare values and logits with; empty: none",
           flows=("merge_step", "merge_new_steps"), shapes=("merge_step",), settings={"validation": ""}),
    Option("release_adapter", "bool", True, form="For LoRA checkpoints, also release the PEFT adapter",
           flows=("merge_step", "merge_new_steps")),
    Option("adapter_include_base", "bool", True, form="Put the clean base model in the adapter release (base/)",
           flows=("merge_step", "merge_new_steps"), field="write_base", shapes=("merge_step",),
           settings={"adapter": "include_base"}),
    Option("write_base", "bool", True, field="write_base", shapes=("extract-lora",)),  # the engine's: see above/below
    Option("adapter_only", "bool", False, "do not write the clean base model", {"extract-lora": ""}),  # not write_base
    Option("lora_alpha", "alpha", None, "LoRA checkpoints only: lora_alpha when the run recorded none (never guessed)",
           {"merge": "", "check-trained": "lora_alpha when the run recorded none",
            "extract-lora": "lora_alpha when the run recorded none (never guessed; must agree with the run's metadata)",
            "merge-lora": Use("one lora_alpha per adapter, comma-separated: replaces a lost (0) alpha in "
                              "adapter_config.json", kind="floats")},
           "LoRA alpha when the run did not record it (lora_train_meta.json); 0: as the run recorded it", FLOWS,
           "lora_alpha", ("merge?", "extract-lora", "merge-lora", "merge_step", "release_adapter"),
           {"merge": "", "adapter": ""}),
    Option("base_model", "url", None, "a Megatron LoRA step saved without its base (verl + Megatron-Bridge PEFT): the "
           "Hugging Face model the run trained from, to fuse the adapter into",
           {"merge": "", "extract-lora": "base model URL: checks a LoRA-only checkpoint's adapter; with --finetuned, "
                                         "the SVD's base",
            "merge-lora": "base model URL (Hugging Face folder); required for --output model"},
           "The base model of a LoRA-only checkpoint (a verl Megatron LoRA step saves no base weights: its fused model "
           "is this model plus the adapter; the run's adapter_config.json name is never used alone); empty: none",
           FLOWS, "base_model", ("extract-lora", "merge_step", "release_adapter"), {"merge": "", "adapter": ""}),
    Option("merge_method", "choice", "concat", "concat: sum of all updates; weighted: with --adapter-weights; "
           "average: equal weights", {"merge-lora": ""}, field="method", shapes=("merge-lora",),
           choices=("concat", "weighted", "average")),
    Option("adapter_weights", "floats", None, "weighted: one weight per adapter, comma-separated", {"merge-lora": ""},
           field="weights", shapes=("merge-lora",)),
    Option("output", "choice", "model", "model: the fused model; adapter: one adapter (exact rank stacking, or SVD "
           "with --rank/--energy)", {"merge-lora": ""}, field="output", shapes=("merge-lora",),
           choices=("model", "adapter")),
    Option("rank", "int", None, "SVD: rank of each module's adapter",
           {"extract-lora": "", "merge-lora": "adapter output: re-factor each module to this rank by SVD"},
           field="rank", shapes=("extract-lora --finetuned", "merge-lora")),
    Option("energy", "float", None, "SVD: keep this fraction of each update's squared singular values (capped by "
           "--rank)", {"extract-lora": "", "merge-lora": "adapter output: keep this fraction of each update's squared "
                                                         "singular values (capped by --rank)"},
           field="energy", shapes=("extract-lora --finetuned", "merge-lora")),
    Option("target_modules", "names", None, "SVD: modules to factor, e.g. q_proj,v_proj (default: all linear weights "
           "but embeddings and heads)", {"extract-lora": ""}, field="target_modules",
           shapes=("extract-lora --finetuned",)),
    Option("tp", "int", 1, "tensor-parallel size", {"split": ""}, field="tp", shapes=("split",)),
    Option("pp", "int", 1, "pipeline-parallel size", {"split": ""}, field="pp", shapes=("split",)),
    Option("vpp", "int", None, "virtual pipeline (interleaved) chunks per stage", {"split": ""}, field="vpp",
           shapes=("split",)),
    Option("ep", "int", 1, "expert-parallel size (MoE)", {"split": ""}, field="ep", shapes=("split",)),
    Option("format", "choice", "legacy", "legacy: model/mp_rank_*/model.pt; dist: torch_dist dist_ckpt/",
           {"split": ""}, field="format", shapes=("split",), choices=("legacy", "dist")),
    Option("make_vocab_size_divisible_by", "int", 128, "Megatron pads the vocabulary to a multiple of this times TP "
           "(default 128)", {"split": ""}, field="make_vocab_size_divisible_by", shapes=("split",)),
    # how to run (never recorded: the same bytes whatever is chosen)
    Option("overwrite", "bool", False, "replace a target that holds something else",
           {"merge": "replace a target that holds a different model", "extract-lora": "", "merge-lora": "",
            "split": ""},
           "Replace a release that was built from a different checkpoint", FLOWS, "overwrite"),
    Option("staging_root", "url", form="Local folder for staging merges; empty: $STEPMERGE_STAGING_DIR or the temp dir",
           flows=FLOWS),
    Option("check_trained", "bool", False, CHECK_TRAINED_HELP, {"merge": "", "extract-lora": ""}),
    Option("device", "text", None, "SVD: torch device, cpu, cuda, cuda:N or auto (default auto: cuda when this torch "
           "sees a GPU, else cpu)",
           {"extract-lora": "", "merge-lora": "SVD device: cpu, cuda, cuda:N or auto (default: cuda when available)",
            "check-trained": "torch device of the forward passes: cpu, cuda, cuda:N or auto (default: cuda when "
                             "available)"},
           field="device", settings={"validation": ""}),
    Option("workers", "count", None, "threads writing on this machine, shared out between the output files and their "
           "byte ranges, so a one-file model uses them all (default: one per core)", _each(RUNS),
           "Shard jobs at once in the merge (or extraction) task's process; 0: one per core", FLOWS, "workers",
           settings={"execution": ""}),
    Option("ray_address", "ray_address", None, "run the shard jobs as tasks of this Ray cluster: auto, HOST:PORT or "
           "ray://HOST:PORT (pip install -c constraints.txt '.[ray]' from the checkout); every worker reads and writes "
           "the storage URLs itself", _each(RUNS),
           "Run the shard jobs as task runs on this Ray cluster (auto, host:port, ray://host:port); empty: the "
           "worker's $STEPMERGE_RAY_ADDRESS, else the task's own process", FLOWS, "ray_address",
           settings={"execution": ""}),
    Option("requests_in_flight", "count", None, "ranged GETs in flight per read of an s3:// or gs:// file (default 32, "
           "sized for object storage)", _each(RUNS)),
    # verify and test
    Option("quick", "bool", False, "on object stores compare the store's recorded versions (one listing, no byte "
           "read) instead of re-hashing; local files are re-hashed anyway", {"verify": ""}),
    Option("atol", "float", None, "absolute tolerance (default: the engine's weight tolerance, verl's 1e-6)",
           {"test": ""}),
    Option("rtol", "float", None, "relative tolerance (default: the engine's weight tolerance, verl's 1e-6)",
           {"test": ""}),
    # verl's upload flags: refused with a message (merge), never listed
    Option("hf_upload_path", "text", None, "", {"merge": ""}, hidden=True),
    Option("private", "bool", False, "", {"merge": ""}, hidden=True),
)

BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}


def option(name: str) -> Option:
    """The declaration of ``name`` (KeyError for an undeclared one)."""
    return BY_NAME[name]


def for_command(command: str) -> tuple[Option, ...]:
    """The options ``command`` takes, in declaration order."""
    return tuple(o for o in OPTIONS if command in o.commands)


def for_flow(flow: str) -> tuple[Option, ...]:
    """The parameters of ``flow``: its required ones first, then the rest in declaration order (the form's order)."""
    taken = [o for o in OPTIONS if flow in o.flows]
    return tuple([o for o in taken if o.required] + [o for o in taken if not o.required])


def for_settings(record: str) -> tuple[Option, ...]:
    """The options a settings record carries (several may fill one field: `setting_name`)."""
    return tuple(o for o in OPTIONS if record in o.settings)


def setting_name(option: Option, record: str) -> str:
    return option.settings[record] or option.name


def fields() -> dict[str, Option]:
    """Engine option (`OutputOptions` field) -> its declaration (the option of that name, else the first)."""
    found: dict[str, Option] = {}
    for o in OPTIONS:
        if o.field and (o.field not in found or o.name == o.field):
            found[o.field] = o
    return found


def recorded(output: str) -> tuple[Option, ...]:
    """The options recorded for ``output`` (a command or a flow of `OUTPUTS`), always or when set."""
    return tuple(o for o in OPTIONS if o.records(output) is not False)
