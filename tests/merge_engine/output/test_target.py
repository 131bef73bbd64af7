"""The target's records (``stepmerge.json``, the partial marker) read as untrusted input: a record that
is nested past Python's parser, not an object, or not UTF-8 is no record — never a crash, never "same"."""

from __future__ import annotations

import json

import pytest

from merge_engine import storage
from merge_engine.errors import TargetExists
from merge_engine.output.target import PARTIAL_FILE, PROVENANCE_FILE, read_provenance, target_state

HOSTILE = [b"[" * 100_000, b'["fingerprint", "fp-1"]', b"\xff\xfe", b"{"]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_hostile_provenance_is_no_provenance(tmp_path, hostile):
    target = str(tmp_path / "out")
    storage.write_bytes(storage.join(target, "model.safetensors"), b"x" * 8)
    storage.write_bytes(storage.join(target, PROVENANCE_FILE), hostile)
    assert read_provenance(target) is None
    with pytest.raises(TargetExists):
        target_state(target, "fp-1", overwrite=False, sources=[str(tmp_path / "src")])
    assert target_state(target, "fp-1", overwrite=True, sources=[str(tmp_path / "src")]) == "other"


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_hostile_partial_marker_is_not_our_debris(tmp_path, hostile):
    target = str(tmp_path / "out")
    storage.write_bytes(storage.join(target, PARTIAL_FILE), hostile)
    with pytest.raises(TargetExists):
        target_state(target, "fp-1", overwrite=False, sources=[str(tmp_path / "src")])


def test_our_own_records_are_read(tmp_path):
    """The counter-check: the same code finds a real record (so the cases above fail for the right reason)."""
    target = str(tmp_path / "out")
    storage.write_bytes(storage.join(target, "model.safetensors"), b"x" * 8)
    storage.write_bytes(storage.join(target, PROVENANCE_FILE),
                        json.dumps({"fingerprint": "fp-1", "files": {"model.safetensors": 8}}).encode())
    assert target_state(target, "fp-1", overwrite=False, sources=[str(tmp_path / "src")]) == "same"
    storage.remove(storage.join(target, PROVENANCE_FILE))
    storage.write_bytes(storage.join(target, PARTIAL_FILE), json.dumps({"fingerprint": "fp-1"}).encode())
    assert target_state(target, "fp-1", overwrite=False, sources=[str(tmp_path / "src")]) == "damaged"
