"""Checks of a Hugging Face model folder (any storage URL) -> a `ValidationReport`.

Contract:
- `validate_structure`: config parses; the safetensors index (or a single ``model.safetensors``)
  names only safe, existing, flat file names, agrees with the shard headers and its ``total_size``;
  the keys and shapes the config implies (its model class instantiated on the ``meta`` device, saved
  the way ``save_pretrained`` would save it: tied weights and ignored keys dropped, weight
  conversions reverted) are exactly the keys and shapes on disk; no NaN/inf in any tensor.
- `compare_to_reference`: verl's ``test`` semantics: same keys, shapes, dtypes, and values within
  ``|model - ref| <= atol + rtol * |ref|`` (NaN never equal); the first failing key is named.
- `forward_check`: ``from_pretrained`` with the config's architecture, a forward pass on fixed
  token ids (GPU when present), finite logits; with a reference, the logits compared.
- `validate_model`: all of the above in one report.
Memory: tensors are read from their byte ranges (`storage.RangeReader`, local or remote) in chunks of
`CHUNK_BYTES`, never a whole model or even a whole tensor. A failed check is a result, not an
exception: only `ValidationReport.raise_for_failure` raises (`ValidationFailed`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.errors import ValidationFailed

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 16 * 1024 * 1024  # bytes of one tensor read at a time
FORWARD_SEQ_LEN = 16


# --------------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class Check:
    """One named check: passed or not, and what a person needs to know (the failing key, the size)."""

    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class ValidationReport:
    """The checks run on one model folder; `ok` when every check passed (and at least one ran)."""

    model_url: str
    checks: tuple[Check, ...] = ()
    reference_url: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def check(self, name: str) -> Check | None:
        """The check called `name`, or None if it did not run."""
        return next((c for c in self.checks if c.name == name), None)

    def extended(self, other: ValidationReport) -> ValidationReport:
        """This report followed by the checks of `other` (same model)."""
        return ValidationReport(self.model_url, self.checks + other.checks, self.reference_url or other.reference_url)

    def summary(self) -> str:
        """Markdown: a verdict line, then one bullet per check."""
        passed = sum(c.ok for c in self.checks)
        verdict = "PASSED" if self.ok else "FAILED"
        lines = [f"**Validation {verdict}** ({passed}/{len(self.checks)} checks) of `{self.model_url}`"]
        if self.reference_url:
            lines.append(f"against reference `{self.reference_url}`")
        lines.append("")
        for c in self.checks:
            lines.append(f"- {'PASS' if c.ok else '**FAIL**'} `{c.name}`" + (f": {c.detail}" if c.detail else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ok, urls and every check."""
        return {
            "ok": self.ok,
            "model_url": self.model_url,
            "reference_url": self.reference_url,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationReport:
        checks = tuple(Check(c["name"], bool(c["ok"]), c.get("detail", "")) for c in data.get("checks", ()))
        return cls(data["model_url"], checks, data.get("reference_url"))

    def raise_for_failure(self) -> None:
        """Raise `ValidationFailed` naming the first failed check; nothing when the report is ok."""
        if not self.ok:
            first = self.failures[0] if self.failures else Check("checks", False, "no check ran")
            raise ValidationFailed(f"validation failed: {first.name}: {first.detail}", self.model_url)


# --------------------------------------------------------------------------------------------------
# safetensors headers and byte ranges (no safetensors/torch import needed to read a header)

@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: dtype (safetensors spelling), shape, absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SafetensorsHeader:
    url: str
    size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


class HeaderError(ValueError):
    """A safetensors file whose header is unreadable or contradicts the file."""


def read_safetensors_header(url: str, size: int | None = None) -> SafetensorsHeader:
    """Parse and check a safetensors header (`merge_engine.safetensors_file.read_header`: dtypes,
    ranges that match dtype and shape, no overlap, nothing missing or left over at the end).

    Raises `HeaderError` with the parser's reason.
    """
    from merge_engine.errors import StepmergeError
    from merge_engine.safetensors_file import CODES, read_header

    try:
        with storage.RangeReader(url, size) as reader:
            header = read_header(reader)
            file_size = reader.size
    except StepmergeError as exc:
        raise HeaderError(exc.message) from exc
    tensors = {name: TensorInfo(CODES[e.dtype], e.shape, e.start, e.end) for name, e in header.entries.items()}
    return SafetensorsHeader(url, file_size, tensors, dict(header.metadata))


def _torch_dtype(st_dtype: str) -> torch.dtype:
    from merge_engine.safetensors_file import DTYPES

    return DTYPES[st_dtype]


def iter_tensor_chunks(reader: storage.RangeReader, info: TensorInfo, chunk_bytes: int = CHUNK_BYTES
                       ) -> Iterator[torch.Tensor]:
    """The tensor's elements, flat, `chunk_bytes` at a time. Each chunk is only valid until the next."""
    import torch

    dtype = _torch_dtype(info.dtype)
    itemsize = dtype.itemsize
    step = max(itemsize, chunk_bytes // itemsize * itemsize)
    buffer = bytearray(min(step, info.nbytes) or itemsize)
    offset = info.start
    while offset < info.end:
        n = min(step, info.end - offset)
        view = memoryview(buffer)[:n]
        reader.read_into(offset, view)
        yield torch.frombuffer(view, dtype=dtype)
        offset += n


# --------------------------------------------------------------------------------------------------
# Structure


def unsafe_file_name(name: Any) -> str | None:
    """Why `name` may not appear in a safetensors index (None when it is a plain file name)."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if "/" in name or "\\" in name:
        return ".. or a sub-folder" if ".." in name.replace("\\", "/").split("/") else "sub-folder"
    if name in (".", ".."):
        return "path traversal"
    if "\0" in name:
        return "NUL byte"
    if not name.endswith(".safetensors"):
        return "not a .safetensors file"
    return None


@dataclass(frozen=True)
class _Weights:
    """What the weight files of a folder say: tensor -> file, headers per file."""

    weight_map: dict[str, str]
    headers: dict[str, SafetensorsHeader]

    def tensor(self, name: str) -> tuple[SafetensorsHeader, TensorInfo]:
        header = self.headers[self.weight_map[name]]
        return header, header.tensors[name]


def _few(items: Sequence[Any], n: int = 5) -> str:
    """The first `n` items and how many more: keeps a check's detail one readable line."""
    return f"{list(items[:n])}" + (f" (+{len(items) - n} more)" if len(items) > n else "")


def _read_json(url: str) -> Any:
    return json.loads(storage.read_text(url))


def _scan_weights(model_url: str, listing: Mapping[str, storage.FileEntry]) -> tuple[list[Check], _Weights | None]:
    """Index, headers, index <-> headers, total_size. Returns the checks and the weights (None: unusable)."""
    checks: list[Check] = []
    index: dict[str, Any] | None = None
    if INDEX_FILE in listing:
        try:
            index = _read_json(storage.join(model_url, INDEX_FILE))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError("weight_map is empty or not an object")
        except (ValueError, KeyError, TypeError) as exc:
            return [Check("weights_index", False, f"{INDEX_FILE} unusable: {exc}")], None
        problems = []
        files = sorted(set(map(str, weight_map.values())))
        for name in sorted(set(weight_map.values()), key=str):
            why = unsafe_file_name(name)
            if why:
                problems.append(f"{name!r}: {why}")
            elif name not in listing:
                problems.append(f"{name!r}: missing")
        if problems:
            return [Check("weights_index", False, "; ".join(problems))], None
        checks.append(Check("weights_index", True, f"{len(weight_map)} tensors in {len(files)} files"))
    elif SINGLE_FILE in listing:
        weight_map, files = {}, [SINGLE_FILE]
        checks.append(Check("weights_index", True, f"single {SINGLE_FILE}"))
    else:
        return [Check("weights_index", False, f"neither {INDEX_FILE} nor {SINGLE_FILE} found")], None

    headers: dict[str, SafetensorsHeader] = {}
    bad = []
    for name in files:
        try:
            headers[name] = read_safetensors_header(storage.join(model_url, name), listing[name].size)
        except (HeaderError, OSError) as exc:
            bad.append(f"{name}: {exc}")
    if bad:
        return checks + [Check("shard_headers", False, "; ".join(bad))], None
    checks.append(Check("shard_headers", True, f"{len(files)} files intact"))

    if index is None:
        weight_map = {t: SINGLE_FILE for t in headers[SINGLE_FILE].tensors}
    else:
        problems = []
        for tensor, file in sorted(weight_map.items()):
            if tensor not in headers[file].tensors:
                problems.append(f"{tensor} not in {file}")
        for file, header in sorted(headers.items()):
            for tensor in sorted(header.tensors):
                if weight_map.get(tensor) != file:
                    problems.append(f"{tensor} in {file} but the index says {weight_map.get(tensor)}")
        if problems:
            more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
            checks.append(Check("index_matches_shards", False, "; ".join(problems[:5]) + more))
            return checks, None
        checks.append(Check("index_matches_shards", True))
        total = sum(i.nbytes for h in headers.values() for i in h.tensors.values())
        declared = (index.get("metadata") or {}).get("total_size")
        if declared is None:
            checks.append(Check("total_size", False, "index metadata has no total_size"))
        else:
            same = int(declared) == total
            checks.append(Check("total_size", same, f"{declared} declared, {total} bytes of tensors"))
    return checks, _Weights(dict(weight_map), headers)


@contextlib.contextmanager
def _local_folder(url: str, only: Sequence[str] | None = None) -> Iterator[str]:
    """A local path holding the folder's files (`only`: just those names); remote ones are staged."""
    if storage.is_local(url):
        yield storage.local_path(url)
        return
    with tempfile.TemporaryDirectory(prefix="stepmerge-validate-") as tmp:
        entries = storage.list_files(url)
        if only is not None:
            entries = [e for e in entries if e.path in only or (e.path.endswith(".py") and "/" not in e.path)]
        storage.stage_in(url, entries, tmp)
        yield tmp


def _architecture(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else ""


def _auto_class(architecture: str):
    """The ``AutoModelFor*`` class for an architecture name (by its suffix)."""
    import transformers

    for suffix, auto in (
        ("ForCausalLM", "AutoModelForCausalLM"),
        ("ForTokenClassification", "AutoModelForTokenClassification"),
        ("ForSequenceClassification", "AutoModelForSequenceClassification"),
        ("ForConditionalGeneration", "AutoModelForImageTextToText"),
        ("ForMaskedLM", "AutoModelForMaskedLM"),
    ):
        if architecture.endswith(suffix):
            return getattr(transformers, auto)
    return transformers.AutoModel


def _model_class(config: Any):
    """(class, via_auto): the config's own architecture class when transformers has it, else Auto."""
    import transformers

    cls = getattr(transformers, _architecture(config), None)
    if cls is not None and isinstance(cls, type) and hasattr(cls, "_from_config"):
        return cls, False
    return _auto_class(_architecture(config)), True


def expected_tensors(config: Any, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """Key -> shape of what ``save_pretrained`` writes for a model with this config (meta device).

    Tied aliases (``lm_head.weight`` with ``tie_word_embeddings``) and ``_keys_to_ignore_on_save``
    are dropped and transformers' weight conversions reverted, as ``save_pretrained`` does.
    """
    import torch

    cls, via_auto = _model_class(config)
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

        state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    except ImportError:  # older transformers: a tied alias is the same Parameter under a later key
        seen: set[int] = set()
        for key in list(state):
            if id(state[key]) in seen:
                del state[key]
            else:
                seen.add(id(state[key]))
    return {key: tuple(tensor.shape) for key, tensor in state.items()}


def _load_config(model_url: str, trust_remote_code: bool):
    from transformers import AutoConfig

    with _local_folder(model_url, only=[CONFIG_FILE]) as path:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def _check_expected(config: Any, weights: _Weights, trust_remote_code: bool) -> list[Check]:
    try:
        expected = expected_tensors(config, trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure to build the model is a failed check
        return [Check("expected_keys", False, f"cannot instantiate {_architecture(config)!r}: {exc}")]
    on_disk = {name: weights.tensor(name)[1].shape for name in weights.weight_map}
    missing = sorted(set(expected) - set(on_disk))
    unexpected = sorted(set(on_disk) - set(expected))
    detail = []
    if missing:
        detail.append(f"missing {_few(missing)}")
    if unexpected:
        tied = " (tied weights must be absent)" if getattr(config, "tie_word_embeddings", False) else ""
        detail.append(f"unexpected {_few(unexpected)}{tied}")
    summary = "; ".join(detail) or f"{len(expected)} keys as {_architecture(config)}"
    checks = [Check("expected_keys", not detail, summary)]
    wrong = [f"{k}: {list(on_disk[k])} != expected {list(s)}" for k, s in sorted(expected.items())
             if k in on_disk and tuple(on_disk[k]) != s]
    checks.append(Check("expected_shapes", not wrong, "; ".join(wrong[:5]) or "all shapes match"))
    return checks


def _check_finite(weights: _Weights, chunk_bytes: int) -> Check:
    import torch

    bad: list[str] = []
    scanned = 0
    for file, header in sorted(weights.headers.items()):
        with storage.RangeReader(header.url, header.size) as reader:
            for name, info in sorted(header.tensors.items(), key=lambda kv: kv[1].start):
                if not info.dtype.startswith(("F", "BF")) or info.numel == 0:
                    continue
                for chunk in iter_tensor_chunks(reader, info, chunk_bytes):
                    if chunk.dtype.itemsize == 1:  # float8: isfinite wants a wider type
                        chunk = chunk.float()
                    if not bool(torch.isfinite(chunk).all()):
                        bad.append(name)
                        break
                scanned += info.nbytes
    if bad:
        return Check("finite", False, f"NaN/inf in {_few(bad)}")
    return Check("finite", True, f"{scanned} bytes scanned")


def validate_structure(model_url: str, *, trust_remote_code: bool = False,
                       chunk_bytes: int = CHUNK_BYTES) -> ValidationReport:
    """Config, index, headers, total_size, expected keys/shapes and NaN/inf of a model folder.

    Reads headers and tensor bytes with ranged reads (no staging); stages only ``config.json``
    (and ``*.py`` remote code) of a remote folder to build the model class on the meta device.
    """
    listing = {e.path: e for e in storage.list_files(model_url) if "/" not in e.path}
    checks: list[Check] = []
    config = None
    if CONFIG_FILE not in listing:
        checks.append(Check("config", False, f"{CONFIG_FILE} missing"))
    else:
        try:
            raw = _read_json(storage.join(model_url, CONFIG_FILE))
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            config = _load_config(model_url, trust_remote_code)
            checks.append(Check("config", True, f"{_architecture(config) or '?'} ({raw.get('model_type', '?')})"))
        except Exception as exc:  # noqa: BLE001 - unparsable or unknown config is a failed check
            checks.append(Check("config", False, f"{CONFIG_FILE}: {exc}"))
            config = None
    weight_checks, weights = _scan_weights(model_url, listing)
    checks += weight_checks
    if weights is not None:
        if config is not None:
            checks += _check_expected(config, weights, trust_remote_code)
        checks.append(_check_finite(weights, chunk_bytes))
    return ValidationReport(model_url, tuple(checks))


# --------------------------------------------------------------------------------------------------
# Reference comparison


def _weights_or_failure(url: str, label: str) -> tuple[_Weights | None, list[Check]]:
    listing = {e.path: e for e in storage.list_files(url) if "/" not in e.path}
    checks, weights = _scan_weights(url, listing)
    if weights is None:
        failed = next(c for c in checks if not c.ok)
        return None, [Check(f"{label}_weights", False, f"{failed.name}: {failed.detail}")]
    return weights, []


def _compare_tensor(model: tuple[storage.RangeReader, TensorInfo], ref: tuple[storage.RangeReader, TensorInfo],
                    atol: float, rtol: float, chunk_bytes: int) -> tuple[float, str | None]:
    """(max |model - ref|, None) or (max diff so far, why the tensor fails)."""
    import torch

    (m_reader, m_info), (r_reader, r_info) = model, ref
    floating = m_info.dtype.startswith(("F", "BF"))
    max_diff = 0.0
    done = 0
    for m_chunk, r_chunk in zip(iter_tensor_chunks(m_reader, m_info, chunk_bytes),
                                iter_tensor_chunks(r_reader, r_info, chunk_bytes)):
        if floating:
            a, b = m_chunk.double(), r_chunk.double()
            diff = (a - b).abs()
            close = (a == b) | (diff <= atol + rtol * b.abs())
            finite_diff = diff[torch.isfinite(diff)]
            if finite_diff.numel():
                max_diff = max(max_diff, float(finite_diff.max()))
        else:
            close = m_chunk == r_chunk
        if not bool(close.all()):
            bad = (~close).nonzero()[0].item()
            count = int((~close).sum())
            return max_diff, (f"element {done + bad}: {m_chunk[bad].item()!r} vs reference {r_chunk[bad].item()!r}"
                              f" ({count} elements of this chunk outside atol={atol}, rtol={rtol})")
        done += m_chunk.numel()
    return max_diff, None


def compare_to_reference(model_url: str, reference_url: str, atol: float = 1e-6, rtol: float = 1e-5, *,
                         chunk_bytes: int = CHUNK_BYTES) -> ValidationReport:
    """verl ``test`` semantics, tensor by tensor in sorted key order; stops at the first value failure."""
    model, checks = _weights_or_failure(model_url, "model")
    ref, ref_checks = _weights_or_failure(reference_url, "reference")
    checks += ref_checks
    if model is None or ref is None:
        return ValidationReport(model_url, tuple(checks), reference_url)
    mine, theirs = set(model.weight_map), set(ref.weight_map)
    missing, extra = sorted(theirs - mine), sorted(mine - theirs)
    detail = "; ".join(filter(None, [f"missing {_few(missing)}" if missing else "",
                                     f"unexpected {_few(extra)}" if extra else ""]))
    checks.append(Check("reference_keys", not detail, detail or f"{len(theirs)} keys"))
    common = sorted(mine & theirs)
    shape_bad = [k for k in common if model.tensor(k)[1].shape != ref.tensor(k)[1].shape]
    checks.append(Check("reference_shapes", not shape_bad, "; ".join(
        f"{k}: {list(model.tensor(k)[1].shape)} vs {list(ref.tensor(k)[1].shape)}" for k in shape_bad[:5])))
    dtype_bad = [k for k in common if k not in shape_bad and model.tensor(k)[1].dtype != ref.tensor(k)[1].dtype]
    checks.append(Check("reference_dtypes", not dtype_bad, "; ".join(
        f"{k}: {model.tensor(k)[1].dtype} vs {ref.tensor(k)[1].dtype}" for k in dtype_bad[:5])))

    comparable = [k for k in common if k not in shape_bad and k not in dtype_bad]
    readers: dict[str, storage.RangeReader] = {}

    def reader(header: SafetensorsHeader) -> storage.RangeReader:
        if header.url not in readers:
            readers[header.url] = storage.RangeReader(header.url, header.size)
        return readers[header.url]

    max_diff, worst, failure = 0.0, "", None
    try:
        for key in comparable:
            (mh, mi), (rh, ri) = model.tensor(key), ref.tensor(key)
            diff, why = _compare_tensor((reader(mh), mi), (reader(rh), ri), atol, rtol, chunk_bytes)
            if diff >= max_diff:
                max_diff, worst = diff, key
            if why:
                failure = f"first mismatch in {key}: {why}"
                break
    finally:
        for r in readers.values():
            r.close()
    if failure:
        checks.append(Check("reference_values", False, failure))
    else:
        checks.append(Check("reference_values", True,
                            f"{len(comparable)} tensors within atol={atol}, rtol={rtol}; max |diff| {max_diff:.3g}"
                            + (f" ({worst})" if worst and max_diff else "")))
    return ValidationReport(model_url, tuple(checks), reference_url)


# --------------------------------------------------------------------------------------------------
# Loading and a forward pass


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def fixed_token_ids(vocab_size: int, length: int = FORWARD_SEQ_LEN) -> list[int]:
    """Deterministic token ids spread over the vocabulary (the same for model and reference)."""
    return [(7919 * i + 13) % vocab_size for i in range(length)]


def _logits(local_path: str, device: str, trust_remote_code: bool) -> tuple[Any, str]:
    """(logits on CPU as float32, what was loaded). The model is freed before returning."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(local_path, trust_remote_code=trust_remote_code)
    auto = _auto_class(_architecture(config))
    model = auto.from_pretrained(local_path, dtype="auto", trust_remote_code=trust_remote_code)
    try:
        model.to(device).eval()
        vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
        ids = torch.tensor([fixed_token_ids(vocab)], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loaded = f"{type(model).__name__} ({next(model.parameters()).dtype}) on {device}"
        return logits.float().cpu(), loaded
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def forward_check(model_url: str, reference_url: str | None = None, device: str | None = None, *,
                  atol: float = 1e-4, rtol: float = 1e-4, trust_remote_code: bool = False) -> ValidationReport:
    """``from_pretrained`` + a forward pass on fixed token ids: finite logits; with a reference,
    ``allclose(logits, reference_logits, atol, rtol)`` and the max abs diff. Remote folders are staged.
    One model is in memory at a time."""
    import torch

    device = device or default_device()
    checks: list[Check] = []
    with _local_folder(model_url) as path:
        started = time.perf_counter()
        try:
            logits, loaded = _logits(path, device, trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - a model that does not load is a failed check
            return ValidationReport(model_url, (Check("load", False, f"{type(exc).__name__}: {exc}"),), reference_url)
        checks.append(Check("load", True, f"{loaded} in {time.perf_counter() - started:.1f}s"))
        finite = bool(torch.isfinite(logits).all())
        checks.append(Check("forward", finite, f"logits {list(logits.shape)}" + ("" if finite else " contain NaN/inf")))
    if reference_url is not None:
        with _local_folder(reference_url) as ref_path:
            try:
                ref_logits, _ = _logits(ref_path, device, trust_remote_code)
            except Exception as exc:  # noqa: BLE001
                checks.append(Check("reference_logits", False, f"reference does not load: {exc}"))
                return ValidationReport(model_url, tuple(checks), reference_url)
        if ref_logits.shape != logits.shape:
            checks.append(Check("reference_logits", False, f"shape {list(logits.shape)} vs {list(ref_logits.shape)}"))
        else:
            max_diff = float((logits - ref_logits).abs().max())
            close = bool(torch.allclose(logits, ref_logits, atol=atol, rtol=rtol))
            checks.append(Check("reference_logits", close, f"max |diff| {max_diff:.3g} (atol={atol}, rtol={rtol})"))
    return ValidationReport(model_url, tuple(checks), reference_url)


# --------------------------------------------------------------------------------------------------
# Everything


def validate_model(model_url: str, reference_url: str | None = None, *, forward: bool = True,
                   atol: float = 1e-6, rtol: float = 1e-5, logits_atol: float = 1e-4, logits_rtol: float = 1e-4,
                   device: str | None = None, trust_remote_code: bool = False,
                   chunk_bytes: int = CHUNK_BYTES) -> ValidationReport:
    """Structure, then (with a reference) values, then (with `forward`) load + forward + logits.

    A remote folder is staged once into a temp dir when a forward pass needs it, and every check
    then reads the staged copy; the report names the original URLs.
    """
    with contextlib.ExitStack() as stack:
        model_path, reference_path = model_url, reference_url
        if forward and not storage.is_local(model_url):
            model_path = stack.enter_context(_local_folder(model_url))
        if forward and reference_url is not None and not storage.is_local(reference_url):
            reference_path = stack.enter_context(_local_folder(reference_url))
        report = validate_structure(model_path, trust_remote_code=trust_remote_code, chunk_bytes=chunk_bytes)
        if reference_path is not None:
            report = report.extended(compare_to_reference(model_path, reference_path, atol, rtol,
                                                          chunk_bytes=chunk_bytes))
        if forward:
            report = report.extended(forward_check(model_path, reference_path, device, atol=logits_atol,
                                                   rtol=logits_rtol, trust_remote_code=trust_remote_code))
    return ValidationReport(model_url, report.checks, reference_url)


__all__ = [
    "Check", "ValidationReport", "validate_structure", "compare_to_reference", "forward_check", "validate_model",
    "expected_tensors", "read_safetensors_header", "SafetensorsHeader", "TensorInfo", "HeaderError",
    "unsafe_file_name", "iter_tensor_chunks", "fixed_token_ids", "default_device",
]
