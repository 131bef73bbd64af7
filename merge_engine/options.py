"""Every user-facing option, declared once: the one place a new option is added.

An `Option` says what a user may set and everything each surface needs to offer it:

- ``name``: the argparse destination, the flow parameter, the settings record's field (unless
  ``settings`` renames it) and the key recorded in fingerprints, provenance and manifests;
- ``kind``: the kind of value, a row of `KINDS`: its engine type, command-line parser, conversion to the
  engine's value and form type, declared once for every option of that kind;
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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as _default
from typing import Any

from merge_engine.option_values import (
    DEFAULT_SHARD_SIZE, DEFAULT_WEIGHTS_FORMAT, WEIGHTS_FORMATS, canonical_dtype, float_list, name_list, parse_size,
    whole_number,
)

REQUIRED = "<required>"  # `Option.default` of an option that must be given


@dataclass(frozen=True)
class Kind:
    """A kind of value, and what every surface makes of one: a row of `KINDS`, the one place a kind is declared.

    - ``engine``: the engine's type (an `OutputOptions` field, a settings record's field);
    - ``parse``: the command line's text -> the flag's value (argparse ``type``; None: the text as given),
      `InvalidOption` for a bad one; a ``switch`` is a flag with no value (store_true);
    - ``to_engine``: a flag's or a form's value -> the engine's (sizes in bytes, comma lists as tuples; None:
      as it is), `InvalidOption` for a bad one;
    - ``form``: the Prefect form's type of an option that is required or has a default, ``form_unset`` of one
      that may be unset (the type shows a blank, read back as None), each ``module:name`` (the engine imports
      no pydantic: the types live in `flows.params`); "": no flow takes an option of this kind.
    """

    name: str
    words: str
    engine: Any
    parse: Callable[[str], Any] | None = None
    to_engine: Callable[[Any], Any] | None = None
    switch: bool = False
    form: str = ""
    form_unset: str = ""

    def engine_value(self, value: Any) -> Any:
        """``value`` (a flag's, a form's or a declared default) as the engine holds it; None stays None."""
        return value if value is None or self.to_engine is None else self.to_engine(value)


KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind(name="text", words="a string", engine=str | None,
         form="flows.params:Text", form_unset="flows.params:OptionalText"),
    Kind(name="url", words="a storage URL or a path", engine=str | None,
         form="flows.params:StorageUrl", form_unset="flows.params:OptionalUrl"),
    Kind(name="int", words="an integer", engine=int | None, parse=int),
    Kind(name="count", words="a whole number >= 1 (the form's 0: unset)", engine=int | None,
         parse=whole_number, form_unset="flows.params:Count"),
    Kind(name="step", words="a global step number >= 0", engine=int,
         parse=int, form="flows.params:StepNumber"),
    Kind(name="float", words="a number", engine=float | None, parse=float),
    # merge-lora takes one alpha per adapter (its `Use.kind` is "floats"): the engine's field holds either
    Kind(name="alpha", words="a LoRA alpha > 0 (the form's 0: unset)", engine=float | tuple[float, ...] | None,
         parse=float, form_unset="flows.params:LoraAlpha"),
    Kind(name="floats", words="comma-separated numbers -> a tuple of floats", engine=tuple[float, ...] | None,
         to_engine=float_list),
    Kind(name="names", words="comma-separated names -> a tuple of strings", engine=tuple[str, ...] | None,
         to_engine=name_list),
    Kind(name="bool", words="a switch (store_true on the command line)", engine=bool | None,
         switch=True, form="flows.params:Switch"),
    Kind(name="size", words="a size such as 5GB or 500MiB (the engine's value: bytes)", engine=int,
         to_engine=parse_size, form="flows.params:ShardSize"),
    Kind(name="dtype", words="a dtype spelling (`DTYPE_SPELLINGS`) -> its canonical name", engine=str | None,
         parse=canonical_dtype, form_unset="flows.params:DtypeName"),
    Kind(name="choice", words="one of ``choices``", engine=str | None,
         form="flows.params:OneOf"),
    Kind(name="choices", words="a list of ``choices``", engine=tuple[str, ...] | None,
         form="flows.params:SomeOf"),
    Kind(name="ray_address", words="auto, local, host:port or ray://host:port", engine=str | None,
         form_unset="flows.params:RayAddress"),
)}

# commands and flows (the names `Option.commands`, `Option.flows` and `Option.shapes` use)
COMMANDS = ("discover", "merge", "test", "check", "verify", "push", "extract-lora", "merge-lora", "split",
            "check-trained", "notify")
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
    Option(name="step", kind="step", default=REQUIRED, help="the global step just saved", commands={"notify": ""},
           form="The global step to merge (its folder is global_step_N)", flows=("merge_step", "release_adapter")),
    Option(name="run_root", kind="url", default=REQUIRED,
           help="training run folder URL holding global_step_N/ (or iter_N/)",
           commands={"discover": "", "notify": "the run root URL the training job writes global_step_N/ to"},
           form="The training run's checkpoint folder: a path, file://, s3://bucket/... or gs://bucket/...",
           flows=FLOWS),
    Option(name="role", kind="choice", default="actor", help="actor (default), critic, or '' (SFT)",
           commands={"notify": ""}, form="actor, critic, or empty for SFT runs (weights in the step folder)",
           flows=("merge_step", "release_adapter"), choices=("actor", "critic", "")),
    Option(name="release_root", kind="url", form="Where releases are published; empty: the run root's releases/ folder",
           flows=FLOWS),
    Option(name="roles", kind="choices", default=("actor", ""), form="Roles to merge (actor, critic, empty for SFT)",
           flows=("merge_new_steps",), choices=("actor", "critic", "")),
    Option(name="merge_deployment", kind="text", default="merge-step/gpu", flows=("merge_new_steps",),
           form="Deployment that merges one step, used when this flow runs from a deployment"),
    Option(name="max_steps", kind="count",
           form="Merge at most this many new steps per run (oldest first); 0: every new step",
           flows=("merge_new_steps",)),
    Option(name="include_base", kind="bool", default=True, form="Also release the clean base model under base/",
           flows=("release_adapter",), field="write_base", shapes=("release_adapter",), settings={"adapter": ""}),
    # the checkpoint and how to read it
    Option(name="backend", kind="text", default=None,
           help="checkpoint layout (fsdp, megatron, ...); detected when omitted",
           commands={**_each(SOURCE), "check": "checkpoint layout; detected when omitted",
                     "check-trained": "layout of --local_dir; detected when omitted",
                     "extract-lora": "layout of --local_dir / --finetuned (fsdp, hf); detected when omitted"},
           field="backend", shapes=("extract-lora", "extract-lora --finetuned"), settings={"merge": "", "adapter": ""}),
    Option(name="local_dir", kind="url", default=REQUIRED, help="checkpoint folder URL (path, file://, s3://, gs://)",
           commands={**_each(SOURCE), "check": "checkpoint folder URL",
                     "check-trained": "the LoRA training checkpoint URL (PEFT-wrapped model)",
                     "extract-lora": Use("LoRA training checkpoint URL (PEFT-wrapped model)", required=False)}),
    Option(name="url", kind="url", default=REQUIRED, help="release (or merged folder) URL",
           commands={"verify": "", "push": ""}, positional=True),
    Option(name="repo", kind="text", default=REQUIRED, help="the Hugging Face Hub repo id (namespace/name)",
           commands={"push": ""}),
    Option(name="revision", kind="text", default=None,
           help="the Hub branch to push to, e.g. step-300 (default: main); created from main when missing",
           commands={"push": ""}),
    Option(name="hf_dir", kind="url", default=REQUIRED, help="Hugging Face model folder URL", commands={"split": ""}),
    Option(name="finetuned", kind="url", default=None,
           help="full fine-tune URL (Hugging Face folder or FSDP checkpoint): extract "
                "(finetuned - base) by SVD", commands={"extract-lora": ""}),
    Option(name="lora_adapter", kind="text", default=REQUIRED, help="PEFT adapter folder URL(s), comma-separated",
           commands={"merge-lora": ""}),
    Option(name="fused_model", kind="url", default=None, help="a Hugging Face folder that should be the trained model",
           commands={"check-trained": ""}),
    Option(name="adapter", kind="url", default=None, help="a PEFT adapter folder with its base under base/",
           commands={"check-trained": ""}),
    Option(name="test_hf_dir", kind="url", default=REQUIRED, help="reference Hugging Face folder to compare against",
           commands={"test": ""}),
    Option(name="target_dir", kind="url", default=REQUIRED, help="output folder URL",
           commands={"merge": "", "split": "", "merge-lora": "output URL",
                     "extract-lora": "output URL: the PEFT adapter folder (the clean base goes to <target>/base/)"}),
    Option(name="tie_word_embedding", kind="bool", default=None,
           help="verl compatibility: must agree with config.json's tie_word_embeddings", commands=_each(SOURCE),
           field="tie_word_embedding"),
    Option(name="is_value_model", kind="bool", default=False, help="verl compatibility: critics are detected anyway",
           commands=_each(SOURCE)),
    Option(name="use_cpu_initialization", kind="bool", default=False, help="verl compatibility: no effect (always CPU)",
           commands=_each(SOURCE)),
    Option(name="trust_remote_code", kind="bool", default=False, help="allow custom model code when validating",
           commands=_each(SOURCE)),
    Option(name="to", kind="choice", default="megatron", help="target framework (megatron)", commands={"split": ""},
           choices=("megatron",)),
    # what is written
    Option(name="dtype", kind="dtype", default=None, help=f"output dtype ({DTYPES}); default: as stored",
           commands={**_each(SOURCE),
                     "extract-lora": f"output dtype ({DTYPES}; default: as stored; float32 for SVD factors)",
                     "merge-lora": f"output dtype ({DTYPES}; default: as stored)",
                     "split": f"dtype of the shards ({DTYPES}; default: as stored)"},
           form="Output dtype: as stored (the checkpoint's own), bfloat16/bf16, float16/fp16/half, float32/fp32/float",
           flows=FLOWS, field="dtype", shapes=OUTPUTS, settings={"merge": "", "adapter": ""}),
    Option(name="max_shard_size", kind="size", default=DEFAULT_SHARD_SIZE,
           help="largest safetensors file, e.g. 5GB (default), 500MiB",
           commands={"merge": "", "extract-lora": "largest safetensors file of the base, e.g. 5GB",
                     "merge-lora": "largest safetensors file, e.g. 5GB (default)"},
           form="Largest safetensors file, e.g. 5GB or 500MiB", flows=("merge_step", "merge_new_steps"),
           field="max_shard_size", shapes=("merge", "extract-lora", "merge-lora", "merge_step"),
           settings={"merge": "", "adapter": ""}),
    Option(name="hf_model_path", kind="url", default=None,
           help="folder with config.json + tokenizer to use instead of the checkpoint's "
                "huggingface/",
           commands={**_each(SOURCE), "check-trained": "folder with the model's config.json instead of huggingface/",
                     "extract-lora": "folder with config.json + tokenizer overriding huggingface/"},
           form="Folder with config.json + tokenizer replacing the checkpoint's huggingface/; empty: the checkpoint's "
                "own",
           flows=("merge_step", "merge_new_steps"), field="hf_model_path",
           shapes=("merge", "extract-lora", "merge_step"), settings={"merge": "", "adapter": ""}),
    Option(name="custom_mapping", kind="url", default=None,
           help="Megatron: JSON file extending the model family's name table (see "
                "merge_engine/architectures/custom.py)",
           commands={**_each(SOURCE), "split": "JSON file extending the model family's name table"},
           field="custom_mapping", shapes=("merge?", "split")),
    Option(name="weights_format", kind="choice", default=DEFAULT_WEIGHTS_FORMAT, help=WEIGHTS_HELP.format(""),
           commands={**_each(SOURCE),
                     "extract-lora": WEIGHTS_HELP.format("the base/ folder and the adapter's module names: "),
                     "merge-lora": WEIGHTS_HELP.format("the fused model in ")},
           form="Tensor names written: hub (the model's Hub checkpoint: per-expert MoE tensors, what vLLM, SGLang and "
                "PEFT read) or transformers (as the training job stored them)", flows=("merge_step", "merge_new_steps"),
           field="weights_format", shapes=("merge", "extract-lora", "merge-lora", "merge_step"),
           settings={"merge": "", "adapter": ""}, choices=WEIGHTS_FORMATS),
    Option(name="mtp_layers", kind="choice", default=None,
           help="Megatron: multi-token-prediction layers (DeepSeek-V3) written as the Hub "
                "checkpoint holds them, or dropped; a checkpoint with MTP layers is refused without this choice",
           commands=_each(SOURCE), field="mtp_layers", shapes=("merge?",), choices=("export", "drop")),
    Option(name="validate_forward", kind="bool", default=True,
           form="Load the model and run a forward pass (GPU if present)", flows=FLOWS,
           shapes=("merge_step", "release_adapter"), settings={"validation": "forward"}),
    Option(name="compare_with_model_release", kind="bool", default=True, flows=("release_adapter",),
           form="Compare PEFT's logits with the step's released merged model, when it was built from this checkpoint"),
    Option(name="reference_url", kind="url",
           form="A Hugging Face folder to compare values and logits with; empty: none",
           flows=("merge_step", "merge_new_steps"), shapes=("merge_step",), settings={"validation": ""}),
    Option(name="release_adapter", kind="bool", default=True,
           form="For LoRA checkpoints, also release the PEFT adapter", flows=("merge_step", "merge_new_steps")),
    Option(name="adapter_include_base", kind="bool", default=True,
           form="Put the clean base model in the adapter release (base/)", flows=("merge_step", "merge_new_steps"),
           field="write_base", shapes=("merge_step",), settings={"adapter": "include_base"}),
    # the engine's: see above (include_base, adapter_include_base) and below (adapter_only)
    Option(name="write_base", kind="bool", default=True, field="write_base", shapes=("extract-lora",)),
    Option(name="adapter_only", kind="bool", default=False, help="do not write the clean base model",
           commands={"extract-lora": ""}),
    Option(name="lora_alpha", kind="alpha", default=None,
           help="LoRA checkpoints only: lora_alpha when the run recorded none (never guessed)",
           commands={"merge": "", "check-trained": "lora_alpha when the run recorded none",
                     "extract-lora": "lora_alpha when the run recorded none (never guessed; must agree with the run's "
                                     "metadata)",
                     "merge-lora": Use("one lora_alpha per adapter, comma-separated: replaces a lost (0) alpha in "
                                       "adapter_config.json", kind="floats")},
           form="LoRA alpha when the run did not record it (lora_train_meta.json); 0: as the run recorded it",
           flows=FLOWS, field="lora_alpha",
           shapes=("merge?", "extract-lora", "merge-lora", "merge_step", "release_adapter"),
           settings={"merge": "", "adapter": ""}),
    Option(name="base_model", kind="url", default=None,
           help="a Megatron LoRA step saved without its base (verl + Megatron-Bridge PEFT): the "
                "Hugging Face model the run trained from, to fuse the adapter into",
           commands={"merge": "",
                     "extract-lora": "base model URL: checks a LoRA-only checkpoint's adapter; with --finetuned, the "
                                     "SVD's base",
                     "merge-lora": "base model URL (Hugging Face folder); required for --output model"},
           form="The base model of a LoRA-only checkpoint (a verl Megatron LoRA step saves no base weights: its fused "
                "model is this model plus the adapter; the run's adapter_config.json name is never used alone); empty: "
                "none",
           flows=FLOWS, field="base_model", shapes=("extract-lora", "merge_step", "release_adapter"),
           settings={"merge": "", "adapter": ""}),
    Option(name="base_model_id", kind="text", default=None,
           help="the base model's Hugging Face Hub id (namespace/name), named in adapter_config.json's "
                "base_model_name_or_path and the model card (default: the run config's _name_or_path when it is a "
                "Hub id, else base, the clean base beside the adapter)",
           commands={"extract-lora": "", "merge-lora": ""},
           form="The base model's Hub id (namespace/name) the adapter names; empty: the run config's _name_or_path "
                "when it is a Hub id, else base/ inside the release",
           flows=FLOWS, field="base_model_id",
           shapes=("extract-lora?", "merge-lora?", "merge_step?", "release_adapter?"),
           settings={"adapter": ""}),
    Option(name="merge_method", kind="choice", default="concat",
           help="concat: sum of all updates; weighted: with --adapter-weights; "
                "average: equal weights", commands={"merge-lora": ""}, field="method", shapes=("merge-lora",),
           choices=("concat", "weighted", "average")),
    Option(name="adapter_weights", kind="floats", default=None,
           help="weighted: one weight per adapter, comma-separated", commands={"merge-lora": ""}, field="weights",
           shapes=("merge-lora",)),
    Option(name="output", kind="choice", default="model",
           help="model: the fused model; adapter: one adapter (exact rank stacking, or SVD "
                "with --rank/--energy)", commands={"merge-lora": ""}, field="output", shapes=("merge-lora",),
           choices=("model", "adapter")),
    Option(name="rank", kind="int", default=None, help="SVD: rank of each module's adapter",
           commands={"extract-lora": "", "merge-lora": "adapter output: re-factor each module to this rank by SVD"},
           field="rank", shapes=("extract-lora --finetuned", "merge-lora")),
    Option(name="energy", kind="float", default=None,
           help="SVD: keep this fraction of each update's squared singular values (capped by "
                "--rank)",
           commands={"extract-lora": "", "merge-lora": "adapter output: keep this fraction of each update's squared "
                                                       "singular values (capped by --rank)"}, field="energy",
           shapes=("extract-lora --finetuned", "merge-lora")),
    Option(name="target_modules", kind="names", default=None,
           help="SVD: modules to factor, e.g. q_proj,v_proj (default: all linear weights "
                "but embeddings and heads)", commands={"extract-lora": ""}, field="target_modules",
           shapes=("extract-lora --finetuned",)),
    Option(name="tp", kind="int", default=1, help="tensor-parallel size", commands={"split": ""}, field="tp",
           shapes=("split",)),
    Option(name="pp", kind="int", default=1, help="pipeline-parallel size", commands={"split": ""}, field="pp",
           shapes=("split",)),
    Option(name="vpp", kind="int", default=None, help="virtual pipeline (interleaved) chunks per stage",
           commands={"split": ""}, field="vpp", shapes=("split",)),
    Option(name="ep", kind="int", default=1, help="expert-parallel size (MoE)", commands={"split": ""}, field="ep",
           shapes=("split",)),
    Option(name="format", kind="choice", default="legacy",
           help="legacy: model/mp_rank_*/model.pt; dist: torch_dist dist_ckpt/", commands={"split": ""}, field="format",
           shapes=("split",), choices=("legacy", "dist")),
    Option(name="make_vocab_size_divisible_by", kind="int", default=128,
           help="Megatron pads the vocabulary to a multiple of this times TP "
                "(default 128)", commands={"split": ""}, field="make_vocab_size_divisible_by", shapes=("split",)),
    # how to run (never recorded: the same bytes whatever is chosen)
    Option(name="overwrite", kind="bool", default=False, help="replace a target that holds something else",
           commands={"merge": "replace a target that holds a different model", "extract-lora": "", "merge-lora": "",
                     "split": ""}, form="Replace a release that was built from a different checkpoint", flows=FLOWS,
           field="overwrite"),
    Option(name="staging_root", kind="url",
           form="Local folder for staging merges; empty: $STEPMERGE_STAGING_DIR or the temp dir", flows=FLOWS),
    Option(name="check_trained", kind="bool", default=False, help=CHECK_TRAINED_HELP,
           commands={"merge": "", "extract-lora": ""}),
    Option(name="device", kind="text", default=None,
           help="SVD: torch device, cpu, cuda, cuda:N or auto (default auto: cuda when this torch "
                "sees a GPU, else cpu)",
           commands={"extract-lora": "",
                     "merge-lora": "SVD device: cpu, cuda, cuda:N or auto (default: cuda when available)",
                     "check-trained": "torch device of the forward passes: cpu, cuda, cuda:N or auto (default: cuda "
                                      "when available)"}, field="device", settings={"validation": ""}),
    Option(name="workers", kind="count", default=None,
           help="threads writing on this machine, shared out between the output files and their "
                "byte ranges, so a one-file model uses them all (default: one per core)", commands=_each(RUNS),
           form="Shard jobs at once in the merge (or extraction) task's process; 0: one per core", flows=FLOWS,
           field="workers", settings={"execution": ""}),
    Option(name="ray_address", kind="ray_address", default=None,
           help="run the shard jobs as tasks of this Ray cluster: auto, HOST:PORT or "
                "ray://HOST:PORT (pip install -c constraints.txt '.[ray]' from the checkout); every worker reads and "
                "writes the storage URLs itself", commands=_each(RUNS),
           form="Run the shard jobs as task runs on this Ray cluster (auto, host:port, ray://host:port); empty: the "
                "worker's $STEPMERGE_RAY_ADDRESS, else the task's own process", flows=FLOWS, field="ray_address",
           settings={"execution": ""}),
    Option(name="requests_in_flight", kind="count", default=None,
           help="ranged GETs in flight per read of an s3:// or gs:// file (default 32, "
                "sized for object storage)", commands=_each(RUNS)),
    # verify and test
    Option(name="quick", kind="bool", default=False,
           help="on object stores compare the store's recorded versions (one listing, no byte "
                "read) instead of re-hashing; local files are re-hashed anyway", commands={"verify": ""}),
    Option(name="atol", kind="float", default=None,
           help="absolute tolerance (default: the engine's weight tolerance, verl's 1e-6)", commands={"test": ""}),
    Option(name="rtol", kind="float", default=None,
           help="relative tolerance (default: the engine's weight tolerance, verl's 1e-6)", commands={"test": ""}),
    # verl's upload flags (token: HF_TOKEN; Hub: HF_ENDPOINT, default huggingface.co)
    Option(name="hf_upload_path", kind="text", default=None,
           help="after the merge, push the merged folder to this Hugging Face Hub repo (verl's flag)",
           commands={"merge": ""}),
    Option(name="private", kind="bool", default=False,
           help="create the Hub repo, private, when it does not exist (never a public one)",
           commands={"merge": "", "push": ""}),
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
