"""A release judged from OUTSIDE stepmerge: by the weights it was made from, by transformers and by PEFT.

No stepmerge code reads or judges here. Bytes come through the store's own fsspec client (s3fs, gcsfs,
fsspec's memory filesystem; local files opened directly), tensors through the safetensors library,
models through ``transformers`` and ``peft.PeftModel.from_pretrained``. The references are known
from outside too: the weights a synthetic checkpoint was written from (`synthetic_runs`), megatron-core's
own state and logits, PEFT's own model of a LoRA run, or a folder transformers wrote itself.

- `release_tensors(url)`: every tensor of the folder's ``*.safetensors`` files, by name.
- `assert_release_weights_equal(url, reference)`: the same names, dtypes and values, bit for bit.
- `assert_model_logits(url, expected)` / `assert_adapter_logits(url, expected)`: transformers loads the
  release (strictly: no missing or unexpected key) / PEFT loads the adapter onto the release's ``base/``,
  and the logits on `TOKENS` are ``expected`` (a tensor, or a model to run on `TOKENS`).
- `assert_release_of_step(url, run, step)`: both, for a release of a step whose references ``run`` knows
  (`tests.fixtures_pipeline.TemplateRun`).
- `assert_release_of_megatron_job(url, job)`: the same for a Megatron checkpoint of `synthetic_runs.megatron`:
  the reference Hugging Face weights converted from the Megatron state it was written from, and
  megatron-core's own logits on the job's input ids.
- `assert_no_machine_paths(url)`: no text file of the release names a path of the machine that built it (the
  checkout, the temp folder, the home folder, the working folder); `assert_release_of_step` and
  `assert_adapter_logits` check it of every release they judge.
- `flip_one_weight(url)`: the mutation that shows these checks see what stepmerge's own verdict cannot:
  one value of the release's weights changed, with its ``stepmerge.json``, manifest and marker made to agree,
  so that `stepmerge verify` still calls the release intact.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Mapping

import torch

TOKENS = torch.tensor([[1, 5, 9, 42, 7, 30, 2, 11]])
WEIGHT_SUFFIX = ".safetensors"


# ------------------------------------------------------------------------------------------- reading


def _filesystem(url: str):
    """(fsspec filesystem, path in it) for a URL, the client built here from the test's environment."""
    import fsspec

    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=os.environ.get("AWS_ENDPOINT_URL"), skip_instance_cache=True,
                               use_listings_cache=False)
    elif scheme in ("gs", "gcs"):
        from gcsfs.core import GCSFileSystem

        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        fs = GCSFileSystem(skip_instance_cache=True, **({"token": "anon", "endpoint_url": emulator} if emulator else {}))
    elif scheme in ("file", "memory"):
        fs = fsspec.filesystem(scheme)
    else:
        raise ValueError(f"no outside reader for {url}")
    return fs, fs._strip_protocol(url).rstrip("/")


def _files(url: str) -> dict[str, str]:
    """Relative path -> path in the filesystem, for every file under ``url``."""
    fs, root = _filesystem(url)
    return {path[len(root) + 1:]: path for path in fs.find(root)}


def read_file(url: str, name: str) -> bytes:
    fs, root = _filesystem(url)
    return fs.cat_file(f"{root}/{name}")


def release_tensors(url: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's top-level ``*.safetensors`` files (a name held twice is an error)."""
    from safetensors.torch import load

    tensors: dict[str, torch.Tensor] = {}
    names = sorted(n for n in _files(url) if n.endswith(WEIGHT_SUFFIX) and "/" not in n)
    assert names, f"{url}: no safetensors file"
    for name in names:
        part = load(read_file(url, name))
        assert not set(part) & set(tensors), f"{url}: tensors held twice: {sorted(set(part) & set(tensors))[:3]}"
        tensors.update(part)
    return tensors


def download(url: str, dest: str) -> str:
    """A local copy of the folder ``url`` (every file, sub-folders included); returns ``dest``."""
    fs, _ = _filesystem(url)
    for rel, path in _files(url).items():
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(fs.cat_file(path))
    return dest


# ------------------------------------------------------------------------------------------- judging


def assert_release_weights_equal(url: str, reference: Mapping[str, torch.Tensor]) -> None:
    """The release's tensors are ``reference``: the same names, dtypes and values, bit for bit."""
    got = release_tensors(url)
    assert set(got) == set(reference), (f"{url}: names differ: missing {sorted(set(reference) - set(got))[:5]}, "
                                        f"unexpected {sorted(set(got) - set(reference))[:5]}")
    for name, expected in reference.items():
        tensor = got[name]
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, \
            f"{url}: {name} is {tensor.dtype} {list(tensor.shape)}, expected {expected.dtype} {list(expected.shape)}"
        assert torch.equal(tensor, expected), f"{url}: {name} differs from the reference"


def _logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def _expected_logits(expected: torch.Tensor | torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return _logits(expected, tokens) if isinstance(expected, torch.nn.Module) else expected


def _assert_close(url: str, got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    assert got.shape == expected.shape, f"{url}: logits {list(got.shape)}, expected {list(expected.shape)}"
    diff = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert diff <= atol + rtol * scale, f"{url}: logits differ by {diff:g} (scale {scale:g}, rtol {rtol:g}, atol {atol:g})"


def load_model(folder: str) -> torch.nn.Module:
    """transformers' model of a local folder, strictly: no missing, unexpected or mismatched key."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (folder, info)
    return model.eval()


REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def machine_roots() -> tuple[str, ...]:
    """The folders of this machine a release must never name: the checkout, the temp folder (pytest's runs,
    staging), the home folder and the working folder, each as spelled and resolved."""
    roots = {REPO, tempfile.gettempdir(), os.path.expanduser("~"), os.getcwd()}
    roots |= {os.path.realpath(root) for root in roots}
    return tuple(sorted(root.rstrip("/") + "/" for root in roots if root.strip("/")))


def assert_no_machine_paths(url: str, roots: tuple[str, ...] = ()) -> None:
    """No text file of the folder ``url`` (every file but the weights; sub-folders included) names one of
    `machine_roots` or ``roots``."""
    fs, _ = _filesystem(url)
    roots = machine_roots() + tuple(r.rstrip("/") + "/" for r in roots)
    for rel, path in _files(url).items():
        if rel.endswith(WEIGHT_SUFFIX):
            continue
        text = fs.cat_file(path).decode("utf-8", errors="replace")
        named = [root for root in roots if root in text or root.rstrip("/") in text.split('"')]
        assert not named, f"{url}/{rel} names {named[0]!r}, a path of the machine that built it"


def assert_model_logits(url: str, expected: torch.Tensor | torch.nn.Module, rtol: float = 0.0, atol: float = 0.0,
                        tokens: torch.Tensor = TOKENS) -> None:
    """transformers loads the release strictly and gives ``expected`` on ``tokens`` (within ``atol`` + ``rtol``
    of their scale; 0: exactly)."""
    with tempfile.TemporaryDirectory(prefix="outside-model-") as local:
        got = _logits(load_model(download(url, local)), tokens)
    _assert_close(url, got, _expected_logits(expected, tokens), rtol, atol)


def assert_adapter_logits(url: str, expected: torch.Tensor | torch.nn.Module, rtol: float = 1e-5) -> None:
    """``PeftModel.from_pretrained`` loads the adapter release onto its own ``base/`` and gives ``expected``."""
    from peft import PeftModel

    assert_no_machine_paths(url)
    with tempfile.TemporaryDirectory(prefix="outside-adapter-") as local:
        download(url, local)
        model = PeftModel.from_pretrained(load_model(os.path.join(local, "base")), local).eval()
        got = _logits(model)
    _assert_close(url, got, _expected_logits(expected, TOKENS), rtol, 0.0)


def assert_release_of_step(url: str, run, step: int) -> None:
    """The model release of ``step`` holds the step's reference weights bit for bit, and transformers gives
    the logits of the model the step was written from (``run``: `reference_weights`, `trained_model`); a fused
    LoRA model's logits within 1e-5 of their scale (PEFT's unfused forward adds B @ A x in another order)."""
    assert_release_weights_equal(url, run.reference_weights(step))
    assert_no_machine_paths(url)
    trained = run.trained_model(step)
    assert_model_logits(url, trained, rtol=1e-5 if hasattr(trained, "peft_config") else 0.0)


MEGATRON_LOGITS_ATOL = 1e-4  # transformers vs megatron-core's forward (measured: 2.5e-6 untied, 1.6e-5 tied)


def assert_release_of_megatron_job(url: str, job) -> None:
    """A merge of the Megatron checkpoint ``job`` (`synthetic_runs.megatron.StepJob`) holds its reference
    Hugging Face weights bit for bit, and transformers gives megatron-core's logits (`MEGATRON_LOGITS_ATOL`)."""
    from safetensors.torch import load_file

    from synthetic_runs.megatron import REFERENCE_HF_DIR, REFERENCE_INPUT_IDS_FILE, REFERENCE_LOGITS_FILE

    reference = {}
    for path in sorted((job.reference_dir / REFERENCE_HF_DIR).glob("*" + WEIGHT_SUFFIX)):
        reference.update(load_file(str(path)))
    assert_release_weights_equal(url, reference)
    tokens = torch.load(job.reference_dir / REFERENCE_INPUT_IDS_FILE, weights_only=True)
    logits = torch.load(job.reference_dir / REFERENCE_LOGITS_FILE, weights_only=True)
    assert_model_logits(url, logits, atol=MEGATRON_LOGITS_ATOL, tokens=tokens)


# ------------------------------------------------------------------------------------------ mutation


def _flip_in_place(data: bytearray) -> str:
    """Change the first element of the file's first floating-point tensor by +1 in place; its name."""
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_size])
    floats = {"F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2)}
    for name, entry in sorted(header.items()):
        if name == "__metadata__" or entry["dtype"] not in floats:
            continue
        dtype, size = floats[entry["dtype"]]
        start = 8 + header_size + entry["data_offsets"][0]
        value = torch.frombuffer(bytearray(data[start:start + size]), dtype=dtype)
        data[start:start + size] = (value + 1).contiguous().view(torch.uint8).numpy().tobytes()
        return name
    raise AssertionError("no floating-point tensor to flip")


def flip_one_weight(url: str) -> str:
    """Change one weight of the release (or merged folder) ``url`` (same size) and make its records agree:
    ``stepmerge.json``'s sha256, the manifest's size, sha256 and store version of each rewritten file, the
    marker's manifest sha256. `merge_engine.release.verify.verify_folder` then finds the release intact. Returns the
    changed tensor's name. (Written through stepmerge's storage: the store versions are the ones it lists.)"""
    import hashlib

    from merge_engine import storage
    from merge_engine.release.folders import MANIFEST, MARKER

    name = sorted(e.path for e in storage.list_files(url) if e.path.endswith(WEIGHT_SUFFIX) and "/" not in e.path)[0]
    data = bytearray(storage.read_bytes(storage.join(url, name)))
    tensor = _flip_in_place(data)
    storage.write_bytes(storage.join(url, name), bytes(data))
    rewritten = {name: bytes(data)}
    provenance_url = storage.join(url, "stepmerge.json")
    if storage.exists(provenance_url):
        provenance = json.loads(storage.read_bytes(provenance_url))
        if isinstance(provenance.get("sha256"), dict) and name in provenance["sha256"]:
            provenance["sha256"][name] = hashlib.sha256(data).hexdigest()
            text = json.dumps(provenance, indent=2, sort_keys=True).encode()
            storage.write_bytes(provenance_url, text)
            rewritten["stepmerge.json"] = text
    if not storage.exists(storage.join(url, MANIFEST)):
        return tensor  # a merged folder (no release): its stepmerge.json is what verify checks
    manifest = json.loads(storage.read_bytes(storage.join(url, MANIFEST)))
    versions = {e.path: e.version for e in storage.list_files(url)}
    for entry in manifest["files"]:
        if entry["path"] in rewritten:
            entry.update(size=len(rewritten[entry["path"]]), sha256=hashlib.sha256(rewritten[entry["path"]]).hexdigest(),
                         version=versions[entry["path"]] if entry.get("version") else entry.get("version", ""))
    manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
    storage.write_bytes(storage.join(url, MANIFEST), manifest_bytes)
    marker = json.loads(storage.read_bytes(storage.join(url, MARKER)))
    marker["manifest_sha256"] = hashlib.sha256(manifest_bytes).hexdigest()
    storage.write_bytes(storage.join(url, MARKER), json.dumps(marker, sort_keys=True).encode())
    return tensor
