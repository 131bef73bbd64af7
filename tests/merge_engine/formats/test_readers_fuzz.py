"""Fuzzing the readers (issue 9): malformed inputs give a named error or a correct result, never a
traceback, a crash, a hang or unbounded memory.

Inputs: seeded mutations of real small files — a ``torch.save`` archive (views with offsets,
a transposed view, nested containers), a safetensors file, a DCP folder (``.metadata`` and data
file, written by `DcpWriter`) and a JSON config — by truncation, byte flips, huge little-endian
integers written over binary fields (zip sizes and offsets, pickle integers, the safetensors
header length), huge or negative numbers in text headers, slices duplicated or cut out, and deep
nesting (JSON brackets, pickled tuples and lists). Mutations are applied both to the raw file and
inside its structure (the pickle re-zipped with a valid CRC, the safetensors header re-framed), so
the parsers past the first checksum are reached too.

Issue 17 adds three kinds whose outcome is fixed, not just "named": rank files whose pickle is not a
state dict (a list, a bare tensor, an int, a dict keyed by numbers or tuples, nested lists), read
through the FSDP layout's check and open, must be `CorruptShard`; single bit flips inside tensor
records (CRC-32 left as written) must be `CorruptShard` (the record's CRC); an archive rewritten in
place, between its listing and its reads, with a same-size valid archive of other tensor bytes must
be `SourceChanged`.

Every input is read to the end in one worker process (tensors streamed in small ranges), with
`PER_INPUT_CPU_SECONDS` of CPU time per input (SIGPROF: a reader that spins; CPU time, so a busy machine
cannot fail it), `PER_INPUT_HANG_S` of wall time (SIGALRM: one that blocks, e.g. a deadlock), the
worker's data segment capped at its start size + `MEMORY_HEADROOM_BYTES` (an unbounded allocation fails
there instead of taking the machine), and its peak RSS reported. The outcome of each input must be ``ok`` (then the values must equal what
torch / safetensors / json themselves read from the same bytes, when they read it) or a
`StepmergeError`; a worker that dies (a segfault) fails the test naming the input. Same seed, same
inputs: the files written here are byte-reproducible.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

SEED = 20261130
PER_INPUT_CPU_SECONDS = 10
PER_INPUT_HANG_S = 120  # bounds a hang only, never a measurement
MEMORY_HEADROOM_BYTES = 1 << 30
RSS_GROWTH_LIMIT_MB = 400
COUNTS = {"torch_raw": 70, "torch_pickle": 80, "safetensors_raw": 50, "safetensors_header": 60,
          "dcp_metadata": 70, "dcp_data": 30, "json": 60, "rank_pickle": 12, "crc_flip": 24, "replaced": 6}
# kinds whose every input must end in this named error (issue 17)
EXPECTED = {"rank": "named CorruptShard", "crc": "named CorruptShard", "replaced": "named SourceChanged"}
HUGE = [2**31 - 1, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]


# --- seed files ------------------------------------------------------------------------------------


def seed_files(folder: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    from tests.merge_engine.formats.dcp_writer import DcpWriter

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(SEED)
    base = torch.arange(40, dtype=torch.float32)
    state = {"a": torch.randn(4, 3, generator=generator), "b": torch.arange(5, dtype=torch.int64),
             "v": base[2:8].view(2, 3), "w": base[10:30].view(4, 5), "t": torch.randn(3, 4, generator=generator).t(),
             "h": torch.randn(6, generator=generator).to(torch.bfloat16), "meta": {"step": 7, "names": ["x", 2.5]}}
    torch.save(state, folder / "state.pt")
    save_file({"a": torch.randn(4, 3, generator=generator), "b": torch.arange(5, dtype=torch.int32),
               "c": torch.randn(2, 2, generator=generator).half()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    writer = DcpWriter(str(folder / "dcp"))
    full = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    writer.add_chunk("decoder.w", (4, 6), (0, 0), full[:2])
    writer.add_chunk("decoder.w", (4, 6), (2, 0), full[2:, :3])
    writer.add_chunk("decoder.w", (4, 6), (2, 3), full[2:, 3:])
    writer.add_chunk("decoder.b", (3,), (0,), torch.ones(3, dtype=torch.bfloat16))
    writer.add_object("extra", b"opaque bytes")
    writer.close()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "vocab_size": 1003, "hidden_size": 64, "rope_scaling": {"type": "yarn", "factor": 4.0},
         "architectures": ["Qwen2ForCausalLM"], "layer_types": ["full_attention"] * 4, "tie_word_embeddings": False}))
    return {"torch": folder / "state.pt", "safetensors": folder / "model.safetensors", "dcp": folder / "dcp",
            "json": folder / "config.json"}


# --- mutations -------------------------------------------------------------------------------------


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[:rng.randrange(len(data))]


def flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def huge_integer(data: bytes, rng: random.Random) -> bytes:
    width = rng.choice([4, 8])
    value = rng.choice(HUGE) & ((1 << (8 * width)) - 1)
    at = rng.randrange(max(1, len(data) - width))
    return data[:at] + value.to_bytes(width, "little") + data[at + width:]


def huge_decimal(data: bytes, rng: random.Random) -> bytes:
    numbers = list(re.finditer(rb"\d+", data))
    if not numbers:
        return flip(data, rng)
    match = rng.choice(numbers)
    value = str(rng.choice(HUGE + [-1, -(2**40), 10**30])).encode()
    return data[:match.start()] + value + data[match.end():]


def splice(data: bytes, rng: random.Random) -> bytes:
    a, b = sorted(rng.randrange(len(data)) for _ in range(2))
    return data[:a] + data[a:b] * 2 + data[b:] if rng.random() < 0.5 else data[:a] + data[b:]


def nest_json(data: bytes, rng: random.Random) -> bytes:
    depth = rng.choice([50, 5_000, 100_000, 400_000])
    values = list(re.finditer(rb"(?<=: )(\d+|\"[^\"]*\"|true|false)", data))
    match = rng.choice(values) if values else None
    deep = b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a": ' * depth + b"1" + b"}" * depth
    return data[:match.start()] + deep + data[match.end():] if match else deep


def nest_pickle(data: bytes, rng: random.Random) -> bytes:
    depth = rng.choice([100, 20_000, 60_000])
    if rng.random() < 0.5:  # a dict key that is a tuple nested `depth` deep
        return b"\x80\x02}" + b")" + b"\x85" * depth + b"K\x01s."
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


RAW = [truncate, flip, huge_integer, splice]
TEXT = [truncate, flip, huge_decimal, splice]


def _rezip_pickle(archive: bytes, pickle_bytes: bytes) -> bytes:
    """The archive with its data.pkl replaced (records kept, CRC valid)."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = pickle_bytes if info.filename.endswith("data.pkl") else source.read(info.filename)
            target.writestr(info.filename, data)
    return out.getvalue()


def not_a_state_dict(rng: random.Random) -> object:
    import torch

    tensor = torch.arange(rng.randint(1, 6), dtype=torch.float32)
    return rng.choice([
        [tensor, tensor * 2],
        tensor,
        rng.choice([0, 7, -1, 2**40]),
        {1: tensor, 2: tensor},
        {("a", 1): tensor},
        {"ok": tensor, 3: tensor},
        [[tensor]],
        None,
        "model.layers.0.weight",
    ])


def _rank_folder(path: Path, data: bytes) -> None:
    path.mkdir(parents=True)
    (path / "model_world_size_1_rank_0.pt").write_bytes(data)
    (path / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))


def _reframe(header: bytes, rest: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + rest


def generate_inputs(seeds: dict[str, Path], folder: Path) -> list[dict]:
    """Write every mutated input under ``folder``; returns the manifest (id, kind, path, how)."""
    rng = random.Random(SEED)
    inputs = []
    folder.mkdir(parents=True, exist_ok=True)

    def add(kind: str, how: str, data: bytes, name: str) -> None:
        index = len(inputs)
        path = folder / f"{index:04d}-{name}"
        if kind == "rank":
            _rank_folder(path, data)
        elif kind == "replaced":  # the original, and beside it what replaces it while it is read
            path.write_bytes(archive)
            Path(str(path) + ".next").write_bytes(data)
        elif kind == "dcp":
            path.mkdir(parents=True)
            for item in seeds["dcp"].iterdir():
                (path / item.name).write_bytes(data if item.name == how.split(":")[0] else item.read_bytes())
        else:
            path.write_bytes(data)
        inputs.append({"id": index, "kind": kind, "path": str(path), "how": how})

    archive = seeds["torch"].read_bytes()
    pickle_bytes = zipfile.ZipFile(seeds["torch"]).read("state/data.pkl")
    for i in range(COUNTS["torch_raw"]):
        mutate = RAW[i % len(RAW)]
        add("torch", mutate.__name__, mutate(archive, rng), "state.pt")
    for i in range(COUNTS["torch_pickle"]):
        mutate = [truncate, flip, huge_integer, splice, nest_pickle][i % 5]
        add("torch", f"pickle-{mutate.__name__}", _rezip_pickle(archive, mutate(pickle_bytes, rng)), "state.pt")

    import torch

    from tests.merge_engine.formats.zip_records import data_records, flip_bit, rewrite_records

    for i in range(COUNTS["rank_pickle"]):
        buffer = io.BytesIO()
        value = not_a_state_dict(rng)
        torch.save(value, buffer)
        add("rank", f"not-a-state-dict:{type(value).__name__}", buffer.getvalue(), "actor")
    records = data_records(archive)
    for i in range(COUNTS["crc_flip"]):
        record = records[i % len(records)]
        add("crc", f"crc-flip:{record}", flip_bit(archive, record, rng.randrange(1 << 20)), "state.pt")
    for i in range(COUNTS["replaced"]):
        seed = rng.randrange(1, 255)
        add("replaced", f"replaced:{seed}", rewrite_records(archive, lambda b, s=seed: bytes(x ^ s for x in b)),
            "state.pt")

    tensors = seeds["safetensors"].read_bytes()
    (length,) = struct.unpack("<Q", tensors[:8])
    header, rest = tensors[8:8 + length], tensors[8 + length:]
    for i in range(COUNTS["safetensors_raw"]):
        mutate = RAW[i % len(RAW)]
        add("safetensors", mutate.__name__, mutate(tensors, rng), "model.safetensors")
    for i in range(COUNTS["safetensors_header"]):
        mutate = [truncate, flip, huge_decimal, splice, nest_json][i % 5]
        add("safetensors", f"header-{mutate.__name__}", _reframe(mutate(header, rng), rest), "model.safetensors")

    metadata = (seeds["dcp"] / ".metadata").read_bytes()
    data_file = next(p for p in seeds["dcp"].iterdir() if p.name.endswith(".distcp"))
    for i in range(COUNTS["dcp_metadata"]):
        mutate = [truncate, flip, huge_integer, splice, nest_pickle][i % 5]
        add("dcp", f".metadata:{mutate.__name__}", mutate(metadata, rng), "dcp")
    for i in range(COUNTS["dcp_data"]):
        mutate = RAW[i % len(RAW)]
        add("dcp", f"{data_file.name}:{mutate.__name__}", mutate(data_file.read_bytes(), rng), "dcp")

    config = seeds["json"].read_bytes()
    for i in range(COUNTS["json"]):
        mutate = [truncate, flip, huge_decimal, splice, nest_json][i % 5]
        add("json", mutate.__name__, mutate(config, rng), "config.json")
    return inputs


# --- the worker: reads every input, one line per outcome ----------------------------------------------


def _read_all(stored, piece: int = 1 << 12):
    import torch

    parts = [stored.read_flat(start, min(piece, stored.numel - start)) for start in range(0, stored.numel, piece)]
    return torch.cat(parts).reshape(stored.shape) if parts else torch.empty(stored.shape, dtype=stored.dtype)


def read_torch(path: str) -> str:
    import torch

    from merge_engine.formats.stored_tensor import StoredTensor
    from merge_engine.formats.torch_archive import TorchArchive

    archive = TorchArchive(path)
    try:
        tree = archive.load()
        ours = {k: _read_all(v) for k, v in tree.items() if isinstance(v, StoredTensor)} \
            if isinstance(tree, dict) else {}
        for view in archive._views:  # every tensor anywhere in the tree
            _read_all(view)
        archive.verify_reads()  # the CRC-32 of every record read from (its unread bytes read now)
    finally:
        archive.close()
    try:
        theirs = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - torch refusing what we read is reported, not a failure
        return "ok (torch.load refuses it)"
    for key, value in ours.items():
        if not same_bytes(value, theirs[key]):
            raise AssertionError(f"{key}: values differ from torch.load's")
    return "ok"


def same_bytes(a, b) -> bool:
    """Bitwise equality (a flipped byte may make a NaN, which ``torch.equal`` never calls equal)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def read_safetensors(path: str) -> str:
    from safetensors import safe_open

    from merge_engine.formats.safetensors_file import SafetensorsFile

    handle = SafetensorsFile(path)
    try:
        ours = {name: _read_all(tensor) for name, tensor in handle.tensors().items()}
    finally:
        handle.close()
    try:
        with safe_open(path, "pt") as theirs:
            for name, value in ours.items():
                if not same_bytes(value, theirs.get_tensor(name)):
                    raise AssertionError(f"{name}: values differ from safetensors'")
    except AssertionError:
        raise
    except Exception:  # noqa: BLE001
        return "ok (safetensors refuses it)"
    return "ok"


def read_dcp(path: str) -> str:
    from merge_engine import storage
    from merge_engine.formats.torch_dcp import DcpFiles, DcpTensor
    from merge_engine.formats.dcp_index import read_index
    from tests.merge_engine.formats.dcp_writer import read_object

    index = read_index(path)
    files = DcpFiles(path, {e.path: e.size for e in storage.list_files(path)})
    try:
        for key, info in index.tensors.items():
            for _ in DcpTensor(key, info, files).iter_chunks(1 << 10):
                pass
        for location in index.objects.values():
            read_object(path, location)
    finally:
        files.close()
    return "ok"


def read_json(path: str) -> str:
    from merge_engine.formats.hf_metadata import read_config
    from merge_engine.formats.json_file import read_json_object

    ours = read_json_object(path)
    read_config(str(Path(path).parent)) if Path(path).name == "config.json" else None
    try:
        theirs = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (ValueError, RecursionError):
        return "ok (json refuses it)"
    if ours != theirs:
        raise AssertionError("differs from json.loads")
    return "ok"


def read_rank_folder(path: str) -> str:
    """An FSDP folder of one rank file, through the layout as ``check`` and ``merge`` read it."""
    from merge_engine.layouts import check_checkpoint, open_checkpoint

    source = open_checkpoint(check_checkpoint(path, "fsdp"))
    try:
        for name in source.metas():
            for _ in source.iter_chunks(name, 1 << 10):
                pass
    finally:
        source.close()
    return "ok"


def read_replaced(path: str) -> str:
    """The archive listed and opened (pinned to its listing), then rewritten in place with the
    same-size archive saved beside it, then read: the bytes of the listed version or nothing."""
    from merge_engine import storage
    from merge_engine.formats.torch_archive import TorchArchive

    folder, name = os.path.split(path)
    entry = next(e for e in storage.list_files(folder, recursive=False) if e.path == name)
    replacement = Path(path + ".next").read_bytes()
    archive = TorchArchive(path, storage.RangeReader.listed(path, entry))
    try:
        archive.load()
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.write(replacement)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # a later write: a later mtime
        for view in archive._views:
            _read_all(view)
    finally:
        archive.close()
    return "ok"


READERS = {"torch": read_torch, "crc": read_torch, "rank": read_rank_folder, "replaced": read_replaced, "safetensors": read_safetensors, "dcp": read_dcp, "json": read_json}


def _data_segment_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(manifest_path: str) -> None:
    import resource
    import signal
    import warnings

    import torch  # noqa: F401 - imported before the memory cap and the clock

    from merge_engine.errors import StepmergeError

    warnings.simplefilter("ignore")
    limit = _data_segment_bytes() + MEMORY_HEADROOM_BYTES
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))

    def spinning(signum, frame):
        raise TimeoutError(f"more than {PER_INPUT_CPU_SECONDS} s of CPU time")

    def hanging(signum, frame):
        raise TimeoutError(f"not done after {PER_INPUT_HANG_S} s")

    signal.signal(signal.SIGPROF, spinning)
    signal.signal(signal.SIGALRM, hanging)
    for item in json.loads(Path(manifest_path).read_text()):
        print(json.dumps({"start": item["id"]}), flush=True)
        started = time.process_time()
        signal.setitimer(signal.ITIMER_PROF, PER_INPUT_CPU_SECONDS)
        signal.alarm(PER_INPUT_HANG_S)
        try:
            outcome = READERS[item["kind"]](item["path"])
        except StepmergeError as exc:
            outcome = f"named {type(exc).__name__}" + ("" if exc.path else " WITHOUT PATH")
        except BaseException as exc:  # noqa: BLE001 - exactly what the fuzz test looks for
            outcome = f"TRACEBACK {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.alarm(0)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"id": item["id"], "outcome": outcome, "cpu_seconds": time.process_time() - started,
                          "peak_mb": peak_mb}), flush=True)


# --- the test ----------------------------------------------------------------------------------------


def test_readers_survive_malformed_inputs(tmp_path):
    """Every generated input: a named error (with a path) or a correct result; no crash, hang or blow-up."""
    started = time.perf_counter()
    inputs = generate_inputs(seed_files(tmp_path / "seeds"), tmp_path / "inputs")
    assert len(inputs) == sum(COUNTS.values())
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(inputs))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, __file__, str(manifest)], capture_output=True, text=True, env=env,
                         timeout=PER_INPUT_HANG_S * 20)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    results = {line["id"]: line for line in lines if "outcome" in line}
    started_ids = [line["start"] for line in lines if "start" in line]
    if run.returncode != 0:
        last = inputs[started_ids[-1]] if started_ids else None
        raise AssertionError(f"worker died (exit {run.returncode}) on {last}: {run.stderr[-2000:]}")
    bad = [(inputs[i]["how"], inputs[i]["path"], r["outcome"]) for i, r in results.items()
           if not (r["outcome"].startswith("ok") or r["outcome"].startswith("named ")) or "WITHOUT PATH" in r["outcome"]]
    assert not bad, f"{len(bad)} inputs escaped as tracebacks: {bad[:10]}"
    wrong = [(inputs[i]["how"], inputs[i]["path"], r["outcome"]) for i, r in results.items()
             if inputs[i]["kind"] in EXPECTED and r["outcome"] != EXPECTED[inputs[i]["kind"]]]
    assert not wrong, f"{len(wrong)} issue-17 inputs did not end in their named error: {wrong[:10]}"
    assert len(results) == len(inputs)
    slowest = max(results.values(), key=lambda r: r["cpu_seconds"])
    assert slowest["cpu_seconds"] < PER_INPUT_CPU_SECONDS
    peak = max(r["peak_mb"] for r in results.values())
    baseline = results[0]["peak_mb"]
    assert peak - baseline < RSS_GROWTH_LIMIT_MB, f"peak RSS grew {peak - baseline:.0f} MB"
    outcomes: dict[str, int] = {}
    for r in results.values():
        key = r["outcome"].split(":")[0]
        outcomes[key] = outcomes.get(key, 0) + 1
    print(f"fuzz: {len(inputs)} inputs in {time.perf_counter() - started:.1f} s; slowest "
          f"{slowest['cpu_seconds']:.2f} CPU s ({inputs[slowest['id']]['how']}); peak RSS {peak:.0f} MB "
          f"(+{peak - baseline:.0f}); outcomes {dict(sorted(outcomes.items()))}")
    assert outcomes.get("ok", 0) > 0 and sum(v for k, v in outcomes.items() if k.startswith("named")) > 0


if __name__ == "__main__":
    worker(sys.argv[1])
