"""The structure of a Hugging Face model folder: config, weights (`weights.scan_weights`), the keys
and shapes its config implies, and no NaN/inf.

`expected_tensors` instantiates the config's model class on the ``meta`` device and keeps what
``save_pretrained`` would write: tied aliases and ``_keys_to_ignore_on_save`` dropped, weight
conversions reverted (transformers' own save-time rules). Tensor bytes are read in chunks of
``chunk_bytes`` through the HF layout's `TensorSource`, never a whole tensor.

The names are those of the format the folder was written in: ``stepmerge.json``'s
``options.weights_format`` (`merge_engine.plan.hub_format`; absent: ``hub``). ``hub``: what
``save_pretrained`` writes. ``transformers`` (the names as stored by the training job): the model's
in-memory names (transformers v5's fused experts, ``model.language_model``) or, for a checkpoint
saved under transformers 4.x, the Hub names; the key set must equal one of the two exactly.
"""

from __future__ import annotations

from typing import Any

from merge_engine import storage
from merge_engine.architectures.mtp import hub_mtp_names
from merge_engine.errors import InvalidOption
from merge_engine.formats.hf_metadata import CONFIG_FILE
from merge_engine.option_values import HUB, TRANSFORMERS, parse_weights_format
from merge_engine.formats.json_file import read_json_object
from merge_engine.output.target import PROVENANCE_FILE, read_provenance
from merge_engine.validate.forward import architecture_of, model_class
from merge_engine.validate.report import Check, ValidationReport
from merge_engine.validate.staging import local_folder
from merge_engine.validate.weights import CHUNK_BYTES, FolderWeights, few, scan_weights, top_level_listing


def expected_tensors(config: Any, trust_remote_code: bool = False,
                     weights_format: str = HUB) -> dict[str, tuple[int, ...]]:
    """Key -> shape of what ``save_pretrained`` writes for a model with this config (meta device).

    Tied aliases (``lm_head.weight`` with ``tie_word_embeddings``) and ``_keys_to_ignore_on_save``
    are dropped and, for ``weights_format="hub"``, transformers' weight conversions reverted, as
    ``save_pretrained`` does, in the Hub's layout (`_in_hub_layout`); ``"transformers"``: the in-memory
    names (no conversion reverted).
    """
    weights_format = parse_weights_format(weights_format)
    import torch

    cls, via_auto = model_class(config)
    with torch.device("meta"):
        if via_auto:
            model = cls.from_config(config, trust_remote_code=trust_remote_code)
        else:
            model = cls._from_config(config)
    state = model.state_dict(keep_vars=True)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    try:  # transformers >= 5: its own save-time rules
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        state = remove_tied_weights_from_state_dict(state, model)
        if weights_format == HUB:
            state = revert_weight_conversion(model, state)
    except ImportError:  # (transformers 4.x converts no names)  # older transformers: a tied alias is the same Parameter under a later key
        seen: set[int] = set()
        for key in list(state):
            if id(state[key]) in seen:
                del state[key]
            else:
                seen.add(id(state[key]))
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    return _in_hub_layout(model, shapes) if weights_format == HUB else shapes


def _in_hub_layout(model: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` with the layout the Hub holds where ``save_pretrained`` keeps the in-memory one (a
    tensor transformers transposes on load only when its shape asks: Qwen3-VL-MoE's fused experts),
    as stepmerge writes them (`merge_engine.plan.transformers_conversion`)."""
    from merge_engine.errors import UnsupportedLayout
    from merge_engine.plan.transformers_conversion import (TensorView, has_conversion_mapping,
                                                            trace_reverse_conversion)

    if not has_conversion_mapping():
        return shapes  # transformers 4.x: the model holds the Hub's names and layout
    memory = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    try:
        views = trace_reverse_conversion(model, memory)
    except UnsupportedLayout:  # a layout stepmerge refuses to write as the Hub's: transformers' shapes
        return shapes
    return {key: view.shape if isinstance(view := views.get(key), TensorView) and not view.is_contiguous() else shape
            for key, shape in shapes.items()}


def load_config(model_url: str, trust_remote_code: bool) -> Any:
    """The folder's ``AutoConfig`` (a remote folder: only config.json and remote code are staged)."""
    from transformers import AutoConfig

    with local_folder(model_url, only=[CONFIG_FILE]) as path:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def recorded_weights_format(model_url: str, listing: Any) -> str:
    """The weights format ``stepmerge.json`` records for the folder (``hub`` when there is none).

    `InvalidOption` naming the file when it records a format this version does not know."""
    if PROVENANCE_FILE not in listing:
        return HUB
    options = (read_provenance(model_url) or {}).get("options")
    recorded = options.get("weights_format") if isinstance(options, dict) else None
    try:
        return parse_weights_format(recorded if recorded is None or isinstance(recorded, str) else repr(recorded))
    except InvalidOption as exc:
        raise InvalidOption(f"{PROVENANCE_FILE}: {exc}", storage.join(model_url, PROVENANCE_FILE)) from None


def _expected_in_format(config: Any, on_disk: dict[str, Any], trust_remote_code: bool,
                        weights_format: str) -> tuple[dict[str, tuple[int, ...]], str]:
    """The expected key -> shape for ``weights_format``, and the words naming those names."""
    hub = expected_tensors(config, trust_remote_code, HUB)
    if weights_format == HUB:
        return hub, "Hub names"
    memory = expected_tensors(config, trust_remote_code, TRANSFORMERS)
    if memory == hub:
        return hub, "stored names (= Hub names)"
    # as stored: the in-memory names (written under transformers v5) or the Hub names (under 4.x)
    difference = {id(names): len(set(names) ^ set(on_disk)) for names in (memory, hub)}
    if difference[id(hub)] < difference[id(memory)]:
        return hub, "stored names (Hub names, as transformers 4.x saves them)"
    return memory, "stored names (transformers' in-memory names)"


def _check_expected(config: Any, weights: FolderWeights, trust_remote_code: bool,
                    weights_format: str) -> list[Check]:
    on_disk = {name: entry.shape for name, entry in weights.entries.items()}
    try:
        expected, naming = _expected_in_format(config, on_disk, trust_remote_code, weights_format)
    except Exception as exc:  # noqa: BLE001 - any failure to build the model is a failed check
        return [Check("expected_keys", False, f"cannot instantiate {architecture_of(config)!r}: {exc}")]
    missing = sorted(set(expected) - set(on_disk))
    # exported multi-token-prediction layers (DeepSeek, GLM): Hub keys transformers builds no module for
    mtp = hub_mtp_names(config, on_disk)
    unexpected = sorted(set(on_disk) - set(expected) - mtp)
    detail = []
    if missing:
        detail.append(f"missing {few(missing)}")
    if unexpected:
        tied = " (tied weights must be absent)" if getattr(config, "tie_word_embeddings", False) else ""
        detail.append(f"unexpected {few(unexpected)}{tied}")
    if detail:
        detail.append(f"compared with the {naming} of weights_format={weights_format}")
    summary = "; ".join(detail) or f"{len(expected)} keys as {architecture_of(config)}, {naming}" + (
        f" + {len(mtp)} keys of exported MTP layers" if mtp else "")
    checks = [Check("expected_keys", not detail, summary)]
    wrong = [f"{k}: {list(on_disk[k])} != expected {list(s)}" for k, s in sorted(expected.items())
             if k in on_disk and tuple(on_disk[k]) != s]
    checks.append(Check("expected_shapes", not wrong, "; ".join(wrong[:5]) or "all shapes match"))
    return checks


def _check_finite(weights: FolderWeights, chunk_bytes: int) -> Check:
    import torch

    bad: list[str] = []
    scanned = 0
    for _, entries in weights.entries_by_file():
        for name, entry in entries.items():
            if not entry.dtype.is_floating_point or entry.end == entry.start:
                continue
            for chunk in weights.source.iter_chunks(name, chunk_bytes):
                if chunk.dtype.itemsize == 1:  # float8: isfinite wants a wider type
                    chunk = chunk.float()
                if not bool(torch.isfinite(chunk).all()):
                    bad.append(name)
                    break
            scanned += entry.end - entry.start
    if bad:
        return Check("finite", False, f"NaN/inf in {few(bad)}")
    return Check("finite", True, f"{scanned} bytes scanned")


def validate_structure(model_url: str, *, trust_remote_code: bool = False, chunk_bytes: int = CHUNK_BYTES,
                       weights_format: str | None = None) -> ValidationReport:
    """Config, index, headers, total_size, expected keys/shapes and NaN/inf of a model folder.

    The expected names are those of ``weights_format`` (None: what the folder's ``stepmerge.json``
    records, ``hub`` without one; a format it records that is unknown fails ``expected_keys``).

    Reads headers and tensor bytes with ranged reads (no staging); stages only ``config.json``
    (and ``*.py`` remote code) of a remote folder to build the model class on the meta device.
    """
    listing = top_level_listing(model_url)
    checks: list[Check] = []
    config = None
    if CONFIG_FILE not in listing:
        checks.append(Check("config", False, f"{CONFIG_FILE} missing"))
    else:
        try:
            raw = read_json_object(storage.join(model_url, CONFIG_FILE)) or {}
            config = load_config(model_url, trust_remote_code)
            checks.append(Check("config", True, f"{architecture_of(config) or '?'} ({raw.get('model_type', '?')})"))
        except Exception as exc:  # noqa: BLE001 - unparsable or unknown config is a failed check
            checks.append(Check("config", False, f"{CONFIG_FILE}: {exc}"))
            config = None
    weight_checks, weights = scan_weights(model_url, listing)
    checks += weight_checks
    if weights is not None:
        with weights:
            if config is not None:
                try:
                    fmt = parse_weights_format(weights_format) if weights_format is not None else \
                        recorded_weights_format(model_url, listing)
                except InvalidOption as exc:
                    checks.append(Check("expected_keys", False, str(exc)))
                else:
                    checks += _check_expected(config, weights, trust_remote_code, fmt)
            checks.append(_check_finite(weights, chunk_bytes))
    return ValidationReport(model_url, tuple(checks))
