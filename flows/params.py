"""Flow parameters: flat, typed, the required ones first, checked by the Prefect server before a run exists.

Every flow takes plain keyword parameters (``merge_step(step=40, run_root="s3://b/run")``), so the
UI's form lists ``step`` and ``run_root`` first, each with its description and default, and
``prefect deployment run 'merge-step/gpu' --param step=10`` works (the deployment supplies the run
root). The types below carry JSON Schema constraints that the SERVER enforces when a run is created
from a deployment (``enforce_parameter_schema``): a bad value is refused with HTTP 409 before
anything is scheduled, never sent to a worker:

- `StorageUrl`: a scheme from the storage scheme registry (`merge_engine.storage.schemes.url_schemes`), a
  bucket for object stores, no ``..`` component (plain or percent-encoded), no backslash or control
  character (`url_pattern`); in the flow, `flows.url_checks.checked_url` checks the same again and
  `flows.step_keys.normalized_run_root` gives one spelling (no trailing slash, ``file:///x`` -> ``/x``),
  so one run root has one key per step whatever route named it;
- `ShardSize`: ``5GB``, ``500MiB``, ... (`merge_engine.option_values.SIZE_PATTERN`);
- `DtypeName`: the spellings the command line accepts too (`merge_engine.option_values.DTYPE_SPELLINGS`),
  recorded as the canonical name (``fp16`` -> ``float16``);
- a choice (``weights_format``, ``role``): one of the declared choices, the command line's too;
- `StepNumber` (>= 0), positive ``lora_alpha``, ``workers``, ``max_steps`` (`Count`; 0: unset).

Which parameters a flow takes, their defaults, texts and order are declared once, in `merge_engine.options`
(each kind of value names its form type there, one of the types below: `form_type`): `parameters_of` makes a
flow's model (`MergeStepParams`, `WatchParams`, `AdapterParams`, each a `RunLocation`), and `takes` gives the flow function the same fields as its signature,
which Prefect builds the form and the deployment's schema from. The settings records the stages get
(`FlowParams.settings`) and the options a release records (`FlowParams.recorded_options`) come from the
same declarations.

No ``from __future__ import annotations`` here or in any flow module: Prefect builds the parameter
schema from real annotations, and string annotations break pydantic parameters in deployment runs.
No torch import either: the listings-only watcher imports this module.
"""

import importlib
import inspect
import re
from typing import Annotated, Any, Callable, ClassVar, Dict, List, Literal, Optional, Sequence

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema, create_model,
)

from flows.step_keys import normalized_run_root, step_key
from flows.url_checks import checked_url
from merge_engine.errors import one_line
from merge_engine.option_values import DTYPE_SPELLINGS, SIZE_PATTERN, canonical_dtype
from merge_engine.options import KINDS, Option, for_flow, for_settings, recorded, setting_name
from merge_engine.storage.schemes import backend_for_scheme, url_schemes

MAX_URL_LENGTH = 1024


def url_pattern(schemes: Sequence[str]) -> str:
    """The JSON Schema pattern of a safe storage URL with one of ``schemes`` (or a local path).

    The server checks it before creating a run; `checked_url` is the same rule in Python. An object
    store's URL must name a bucket; a local scheme's (``file://``) a path.
    """
    remote = "|".join(re.escape(s) for s in schemes if not backend_for_scheme(s).local)
    local = "|".join(re.escape(s) for s in schemes if backend_for_scheme(s).local)
    clean = r"(?!.*[\x00-\x1f\x7f\\])"  # no control character, no backslash
    no_climb = r"(?!(.*/)?(\.|%2[eE]){2}(/|%2[fF]|$))"  # no ".." component, plain or percent-encoded
    return rf"^{clean}{no_climb}(({remote})://[^/]+(/.*)?|({local})://.+|(?!.*://).+)$"


URL_PATTERN = url_pattern(url_schemes())  # the storage scheme registry's list, when the flows are defined


def url_in_words(schemes: Sequence[str]) -> str:
    """What `url_pattern` admits, in words (the form's and the server's refusal): one example per
    store (its canonical scheme) and a path."""
    stores = [backend_for_scheme(s) for s in schemes]
    examples = list(dict.fromkeys(f"{b.canonical_scheme}://bucket/runs/exp1" for b in stores if not b.local))
    return (f"a storage URL such as {', '.join(examples)} or a path such as /data/runs/exp1, "
            f"with no .. folder, backslash or control character, at most {MAX_URL_LENGTH} characters")


URL_WORDS = url_in_words(url_schemes())
SIZE_WORDS = "a size such as 5GB, 500MiB, 1.5 GB or 1024 (bytes)"
RAY_ADDRESS_PATTERN = r"^(auto|local|(ray://)?[A-Za-z0-9.\-]+:[0-9]{1,5})$"
RAY_ADDRESS_WORDS = "auto, local, host:port or ray://host:port"


def _url(value: str) -> str:
    return normalized_run_root(checked_url(value))


def _dtype(value: Optional[str]) -> Optional[str]:
    return None if value in (None, AS_STORED) else canonical_dtype(value)


def refused_in_words(pattern: str, expected: str, blank: Optional[str] = None,
                     max_length: int = MAX_URL_LENGTH) -> Dict[str, Any]:
    """A JSON Schema admitting a string of at most ``max_length`` characters matching ``pattern`` (or
    equal to ``blank``), whose refusal
    is ``expected`` in words: "'<expected>' was expected", never the regular expression.

    The check sits in ``allOf: [{if: not the pattern, then: const <expected>}]``: the server's
    validator (jsonschema) reports the failed ``const`` as "'<expected>' was expected", with the
    field's name ("Validation failed for field 'run_root'"), for the API, ``prefect deployment run
    --param`` and the form's toast alike; and the UI, which keeps ``allOf`` (not ``pattern`` or
    ``if``) when it asks the server to check its form, shows the same words under the field.
    (A value spelled exactly like ``expected`` passes this schema; the flow's own check refuses it.)
    """
    admitted: Dict[str, Any] = {"pattern": pattern, "maxLength": max_length}
    if blank is not None:
        admitted = {"anyOf": [{"const": blank}, admitted]}
    return {"type": "string", "allOf": [{"if": {"not": admitted}, "then": {"const": expected}}]}


def _matching(pattern: str, expected: str) -> Any:
    """A pydantic check of ``pattern`` that says ``expected`` and the value it got (no regex)."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(f"must be {expected}; got '{one_line(value)}'")
        return value

    return AfterValidator(check)


class Blank:
    """The form's blank of an optional type (`unset_as`): what it shows for "unset", read back as None."""

    def __init__(self, value: Any) -> None:
        self.value = value


def unset_as(inner: Any, blank: Any, schema: Dict[str, Any]) -> Any:
    """An optional value the form shows as a plain control (no "str | None" toggle): ``blank`` (the
    empty text, 0, "as stored") stands for "not set" and is read as None; None is written back as
    ``blank`` in JSON (what a deployment run, the watcher or a trigger sends), so the server's
    schema, which has no null, admits it. The type carries its blank (`blank_of`)."""

    def to_none(value: Any) -> Any:
        if value is None or value == blank or (isinstance(value, str) and blank == "" and not value.strip()):
            return None
        return value

    return Annotated[Optional[inner], BeforeValidator(to_none),
                     PlainSerializer(lambda value: blank if value is None else value, when_used="json"),
                     WithJsonSchema(schema), Blank(blank)]


def blank_of(form: Any) -> Any:
    """The blank an optional form type shows for "unset" (`unset_as`)."""
    (blank,) = [m.value for m in getattr(form, "__metadata__", ()) if isinstance(m, Blank)]
    return blank


class SomeOf:
    """``SomeOf[choices]``: a list of some of ``choices`` (``OneOf[choices]``: one of them)."""

    def __class_getitem__(cls, choices: tuple) -> Any:
        return List[Literal[choices]]  # type: ignore[valid-type]


# The form types the kinds of value name (`merge_engine.options.KINDS`: ``Kind.form`` / ``Kind.form_unset``).
AS_STORED = "as stored"
DtypeSpelling = Literal[tuple(DTYPE_SPELLINGS)]  # type: ignore[valid-type]
# The patterns go to the JSON schema only, behind words (`refused_in_words`; the server's validator reads
# lookarounds, pydantic's regex engine does not): in Python, `checked_url` applies the same rule, in words.
_URL_SCHEMA = refused_in_words(URL_PATTERN, URL_WORDS)
StorageUrl = Annotated[str, Field(max_length=MAX_URL_LENGTH), AfterValidator(_url), WithJsonSchema(_URL_SCHEMA)]
OptionalUrl = unset_as(StorageUrl, "", refused_in_words(URL_PATTERN, f"empty, or {URL_WORDS}", blank=""))
StepNumber = Annotated[int, Field(ge=0)]
ShardSize = Annotated[str, _matching(SIZE_PATTERN, SIZE_WORDS), WithJsonSchema(refused_in_words(SIZE_PATTERN, SIZE_WORDS))]
DtypeName = Annotated[unset_as(DtypeSpelling, AS_STORED, {"type": "string", "enum": [AS_STORED, *DTYPE_SPELLINGS]}),
                      AfterValidator(_dtype)]
LoraAlpha = unset_as(Annotated[float, Field(gt=0)], 0, {"type": "number", "minimum": 0})
Count = unset_as(Annotated[int, Field(ge=1)], 0, {"type": "integer", "minimum": 0})
Text = str
OptionalText = unset_as(Annotated[str, Field(max_length=MAX_URL_LENGTH)], "", {"type": "string", "maxLength": MAX_URL_LENGTH})
RayAddress = unset_as(Annotated[str, Field(max_length=MAX_URL_LENGTH), _matching(RAY_ADDRESS_PATTERN, RAY_ADDRESS_WORDS)],
                      "", refused_in_words(RAY_ADDRESS_PATTERN, f"empty, or {RAY_ADDRESS_WORDS}", blank=""))
Switch = bool
OneOf = Literal


def form_type(option: Option) -> Any:
    """The pydantic type of ``option`` in a flow's signature and parameter model: the one its kind names
    (`Kind.form_unset` when it may be unset, else `Kind.form`), given the option's choices where it has some."""
    kind = KINDS[option.kind]
    module, _, name = (kind.form_unset if option.default is None and kind.form_unset else kind.form).partition(":")
    form = getattr(importlib.import_module(module), name)
    return form[option.choices] if option.choices else form


def pydantic_field(option: Option) -> Any:
    """``option``'s default as the form shows it (the blank of an unset one; ``...``: required), with its text."""
    if option.required:
        default: Any = ...
    elif option.default is None:
        default = blank_of(form_type(option))
    else:
        default = list(option.default) if isinstance(option.default, tuple) else option.default
    return Field(default, description=option.form)


class FlowParams(BaseModel):
    """Base of the flows' parameter models: unknown names refused; ``flow`` names the flow (`merge_engine.options`)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
    flow: ClassVar[str]

    def flow_parameters(self) -> Dict[str, Any]:
        """The flow's keyword arguments (JSON-ready): what a deployment run, a trigger or a test passes."""
        return self.model_dump(mode="json")

    def recorded_options(self) -> dict:
        """The options that decide a release's content: recorded in its manifest (`Option.shapes`)."""
        return self.model_dump(include={option.name for option in recorded(self.flow)})

    def settings(self) -> Dict[str, Any]:
        """Every settings record (`tasks.records.SETTINGS_RECORDS`, record name -> record) from this flow's
        parameters: the stages take the ones they read; a record's fields the flow does not take keep their
        defaults. (The execution record, where the shard jobs run, is never recorded in a manifest.)"""
        from tasks.records import SETTINGS_RECORDS

        return {name: self._settings_record(record) for name, record in SETTINGS_RECORDS.items()}

    def _settings_record(self, record: Any) -> Any:
        values = {}
        for option in for_settings(record.record):
            if option.name in type(self).model_fields:
                value = getattr(self, option.name)
                values[setting_name(option, record.record)] = KINDS[option.kind].engine_value(value)
        return record(**values)


class RunLocation(FlowParams):
    """Where a training run is (``run_root``), where its releases go and where merges are staged."""

    @property
    def release_root_url(self) -> str:
        from merge_engine.release.folders import default_release_root

        return self.release_root or default_release_root(self.run_root)


def parameters_of(flow: str) -> Any:
    """A parameter model with one field per option ``flow`` takes (`merge_engine.options.for_flow`), in order."""
    fields = {option.name: (form_type(option), pydantic_field(option)) for option in for_flow(flow)}
    return create_model(f"{flow}_parameters", __base__=RunLocation, __module__=__name__, **fields)


class MergeStepParams(parameters_of("merge_step")):
    """Merge, validate and publish one step of a run (and its LoRA adapter, if it has one)."""

    flow = "merge_step"

    @property
    def key(self) -> str:
        return step_key(self.run_root, self.role, self.step)


class WatchParams(parameters_of("merge_new_steps")):
    """Merge every complete step of a run that is not published yet (scheduled)."""

    flow = "merge_new_steps"

    def step_params(self, step: Any) -> MergeStepParams:
        """The parameters of the merge of ``step`` (a `tasks.records.StepRecord`): this watcher's options."""
        passed = set(type(self).model_fields) & set(MergeStepParams.model_fields) - {"run_root"}
        return MergeStepParams(**{**self.model_dump(include=passed), "release_root": self.release_root_url},
                               run_root=self.run_root, step=step.step, role=step.role)


class AdapterParams(parameters_of("release_adapter")):
    """Extract and publish the LoRA adapter of one step."""

    flow = "release_adapter"


def takes(model: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a ``def f(**parameters)`` flow function ``model``'s fields as its signature, the one Prefect builds the
    form and the deployment's schema from (and binds a run's parameters to): flat, each with its type, default
    and description, in the model's order."""

    def give(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=pydantic_field(option),
                               annotation=form_type(option)) for option in for_flow(model.flow)],
            return_annotation=inspect.signature(fn).return_annotation)
        return fn

    return give
