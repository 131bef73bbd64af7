"""The streaming safetensors writer.

Specification:
- every planned tensor is written with exactly the source values (cast only to the planned dtype);
- shards respect max_shard_size (a single larger tensor sits alone), the index maps every tensor
  and its total_size is the sum of tensor bytes; a single shard is model.safetensors, no index;
- the safetensors library and transformers read the files;
- memory: a tensor streamed in small chunks produces the same bytes as one big chunk;
- a source that produces the wrong number of bytes is an error, not a silently short file.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from merge_engine.errors import CorruptShard
from merge_engine.layouts import check_checkpoint, open_checkpoint
from merge_engine.plan.merge_plan import INDEX_FILE, MergePlan, PlannedTensor, assign_shards
from tests.merge_engine.output.plan_writer import write_plan

TENSORS = {
    "a.weight": torch.randn(33, 17, generator=torch.Generator().manual_seed(1)),
    "b.weight": torch.randn(1003, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
    "c.bias": torch.arange(5, dtype=torch.int64),
    "d.scalar": torch.tensor(2.5, dtype=torch.float16),
}


@pytest.fixture()
def source(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    save_file(TENSORS, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    src = open_checkpoint(check_checkpoint(str(folder)))
    yield src
    src.close()


def _plan(dtype=None, max_shard=10**9):
    tensors = [PlannedTensor(n, tuple(t.shape), dtype or t.dtype, n) for n, t in TENSORS.items()]
    return MergePlan(tuple(tensors), assign_shards(tensors, max_shard))


def _read_all(folder):
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_single_shard_exact(tmp_path, source):
    written = write_plan(_plan(), source, str(tmp_path / "out"), chunk_bytes=100)
    assert [name for name, _ in written.files] == ["model.safetensors"]
    got = _read_all(tmp_path / "out")
    assert set(got) == set(TENSORS)
    for name, value in TENSORS.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_sharded_with_index_and_cast(tmp_path, source):
    plan = _plan(dtype=torch.float32, max_shard=3000)
    written = write_plan(plan, source, str(tmp_path / "out"), chunk_bytes=64)
    assert len(plan.shards) > 1
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in TENSORS.values())
    assert set(index["weight_map"]) == set(TENSORS)
    got = _read_all(tmp_path / "out")
    for name, value in TENSORS.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], value.to(torch.float32)), name
    for shard in plan.shards:
        assert shard.size <= 3000 or len(shard.tensors) == 1
    assert {f for f, _ in written.files} == {s.filename for s in plan.shards} | {INDEX_FILE}


def test_chunk_size_does_not_change_bytes(tmp_path, source):
    write_plan(_plan(), source, str(tmp_path / "small"), chunk_bytes=7)
    write_plan(_plan(), source, str(tmp_path / "large"), chunk_bytes=1 << 30)
    assert (tmp_path / "small" / "model.safetensors").read_bytes() == \
        (tmp_path / "large" / "model.safetensors").read_bytes()


def test_shard_assignment_greedy_in_order():
    tensors = [PlannedTensor(f"t{i}", (n,), torch.uint8, f"t{i}") for i, n in enumerate([4, 4, 10, 1, 1])]
    shards = assign_shards(tensors, 8)
    assert [s.tensors for s in shards] == [("t0", "t1"), ("t2",), ("t3", "t4")]
    assert [s.filename for s in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


class _WrongSize:
    inputs = ("a.weight",)

    def chunks(self, source, max_bytes):
        yield torch.zeros(3)


def test_builder_producing_wrong_size_is_an_error(tmp_path, source):
    tensors = (PlannedTensor("a.weight", (33, 17), torch.float32, "a.weight", build=_WrongSize()),
               PlannedTensor("c.bias", (5,), torch.int64, "c.bias"))
    plan = MergePlan(tensors, assign_shards(tensors, 10**9))
    with pytest.raises(CorruptShard):
        write_plan(plan, source, str(tmp_path / "out"))


def test_a_failed_write_raises_at_once_and_stops_the_reader(tmp_path, source):
    """A write error mid-plan (here: shard 2's name is taken by a folder) propagates; no reader thread is left."""
    import threading

    plan = _plan(max_shard=3000)
    assert len(plan.shards) >= 3
    out = tmp_path / "out"
    (out / plan.shards[1].filename).mkdir(parents=True)
    done = threading.Event()
    errors = []

    def run():
        try:
            write_plan(plan, source, str(out), chunk_bytes=16)
        except OSError as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(20), "write_plan hung after a write error"
    assert errors and plan.shards[1].filename in str(errors[0])
    assert not [t for t in threading.enumerate() if t.name == "stepmerge-reader"]
