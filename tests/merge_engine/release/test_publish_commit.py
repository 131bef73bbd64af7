"""A publisher killed mid-publish leaves nothing readers could load, and blocks nobody (issue 9, case 6).

Specification (`merge_engine.release.publish`, `merge_engine.output.local_commit`, `merge_engine.output.process_identity`):
- local: while a release is being published, the release path does not exist; it appears whole,
  marker included (an observer never sees the folder without ``_COMPLETE``);
- a publisher SIGKILLed after copying a file leaves, locally, no folder at the release path, and
  on S3 (SeaweedFS) files without a marker, which readers do not trust;
- publishing again over a damaged release of the same fingerprint (one flipped byte, same size)
  publishes it again instead of answering "already published" (case 3, in the engine);
- its claim names its process: the next publish on this host recognises the publisher as dead and
  proceeds at once (it used to wait the claim TTL, ten minutes); a claim from another host or PID
  namespace with a fresh heartbeat still blocks (decided by heartbeat age only).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import merge_engine.release.publish as publish_module
from merge_engine import storage
from merge_engine.output import process_identity
from merge_engine.release.publish import ReleaseBusy, claims_url, publish
from merge_engine.release.folders import MARKER
from merge_engine.release.manifest import is_released, read_manifest
from merge_engine.release.verify import verify_folder
from tests.clock import ManualClock, until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = {"config.json": b'{"model_type": "x"}', "model-00001-of-00002.safetensors": b"a" * 4096,
         "model-00002-of-00002.safetensors": b"b" * 4096}

KILLED_PUBLISHER = """
import sys, threading
import merge_engine.release.publish as p
real = p._copy_with_sha256
def slow(src, dst, size):
    digest = real(src, dst, size)
    print("copied", flush=True)
    threading.Event().wait()  # until killed
    return digest
p._copy_with_sha256 = slow
p.publish(sys.argv[1], sys.argv[2], source="src", fingerprint="fp-dead", options={}, validation=None,
          engine_version="0", max_workers=1, remove_staging=False)
"""


def _stage(tmp_path, name: str = "staging") -> str:
    folder = tmp_path / name
    folder.mkdir()
    for rel, data in FILES.items():
        (folder / rel).write_bytes(data)
    return str(folder)


def _publish(staging: str, release: str, **kwargs):
    return publish(staging, release, source="src", fingerprint=kwargs.pop("fingerprint", "fp-1"), options={},
                   validation=None, engine_version="0", **kwargs)


def test_a_local_release_appears_whole(tmp_path, monkeypatch):
    release = str(tmp_path / "releases" / "actor" / "global_step_1")
    seen_without_marker = []
    looks = [0]
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            if os.path.isdir(release) and not os.path.exists(os.path.join(release, MARKER)):
                seen_without_marker.append(sorted(os.listdir(release)) if os.path.isdir(release) else None)
            looks[0] += 1

    real = publish_module._copy_with_sha256

    def observed_copy(src, dst, size):  # the observer looks at the release path while each file is copied
        seen = looks[0]
        until(lambda: looks[0] >= seen + 2, "the observer looked")
        return real(src, dst, size)

    monkeypatch.setattr(publish_module, "_copy_with_sha256", observed_copy)
    observer = threading.Thread(target=observe)
    observer.start()
    try:
        _publish(_stage(tmp_path), release, max_workers=1)
        _publish(_stage(tmp_path, "staging2"), release, fingerprint="fp-2", overwrite=True, max_workers=1)
    finally:
        stop.set()
        observer.join()
    assert [x for x in seen_without_marker if x] == []
    assert read_manifest(release).fingerprint == "fp-2" and verify_folder(release).ok
    assert sorted(os.listdir(os.path.dirname(release))) == ["global_step_1"]  # no temp, no claims folder


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_killed_publisher_leaves_nothing_trusted_and_blocks_nobody(tmp_path, where, request):
    root = str(tmp_path / "out") if where == "local" else request.getfixturevalue("s3_bucket_url")
    release = storage.join(root, "releases", "actor", "global_step_1")
    publisher = subprocess.Popen([sys.executable, "-c", KILLED_PUBLISHER, _stage(tmp_path), release],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    try:
        assert publisher.stdout.readline().strip() == "copied"
    finally:
        publisher.send_signal(signal.SIGKILL)
        publisher.wait()
    assert not is_released(release)
    if where == "local":
        assert not os.path.exists(storage.local_path(release))  # nothing from_pretrained could load
    assert [e.path for e in storage.list_files(claims_url(release))]  # its claim is still there

    clock = ManualClock(sleeps=False)  # a wait for the dead publisher's claim fails the test
    result = _publish(_stage(tmp_path, "staging2"), release, wait_s=600, clock=clock)
    assert not result.already_published and clock.slept == []
    assert verify_folder(release).ok and read_manifest(release).fingerprint == "fp-1"
    assert storage.list_files(claims_url(release)) == []


@pytest.mark.parametrize("other", [{"host": "another-host"}, {"pid_ns": "pid:[1]"}])
def test_a_fresh_claim_from_elsewhere_still_blocks(tmp_path, other):
    release = str(tmp_path / "releases" / "actor" / "global_step_1")
    dead = subprocess.Popen(["true"])
    dead.wait()
    claim = {"attempt": "elsewhere", "fingerprint": "fp-9", "heartbeat": time.time(),
             **process_identity.current(), "pid": dead.pid, **other}
    storage.write_bytes(storage.join(claims_url(release), "elsewhere.json"), json.dumps(claim).encode())
    with pytest.raises(ReleaseBusy):
        _publish(_stage(tmp_path), release, wait_s=0, clock=ManualClock(sleeps=False))
    assert not os.path.exists(release)


@pytest.mark.parametrize("heartbeat", ["3600 s ahead", "1e999"])
def test_a_claim_from_the_far_future_does_not_block_for_ever(tmp_path, heartbeat):
    """Issue 17 point 10: a claim whose heartbeat lies more than a TTL ahead of this clock (a skewed or
    forged clock) or is ``1e999`` (JSON for infinity) used to be fresh for ever: every publish of the
    release waited ``wait_s`` and failed. It is stale: the publish proceeds at once and deletes it."""
    release = str(tmp_path / "releases" / "actor" / "global_step_1")
    claim = {"attempt": "skewed", "fingerprint": "fp-9", **process_identity.current(), "host": "another-host",
             "heartbeat": time.time() + 3600}
    text = json.dumps(claim)
    if heartbeat == "1e999":
        text = text.replace(repr(claim["heartbeat"]), "1e999")
    storage.write_bytes(storage.join(claims_url(release), "skewed.json"), text.encode())
    clock = ManualClock(sleeps=False)  # waiting for the claim fails the test
    result = _publish(_stage(tmp_path), release, wait_s=600, clock=clock)
    assert not result.already_published and clock.slept == []
    assert verify_folder(release).ok and storage.list_files(claims_url(release)) == []


def test_a_claim_a_little_ahead_still_blocks(tmp_path):
    """Clamped, not ignored: a heartbeat a minute ahead (within the TTL) is a live writer whose clock runs
    ahead; it counts as written now and blocks."""
    release = str(tmp_path / "releases" / "actor" / "global_step_1")
    claim = {"attempt": "ahead", "fingerprint": "fp-9", **process_identity.current(), "host": "another-host",
             "heartbeat": time.time() + 60}
    storage.write_bytes(storage.join(claims_url(release), "ahead.json"), json.dumps(claim).encode())
    with pytest.raises(ReleaseBusy):
        _publish(_stage(tmp_path), release, wait_s=0, clock=ManualClock(sleeps=False))
    assert not os.path.exists(release)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_damaged_release_of_the_same_input_is_published_again(tmp_path, where, request):
    root = str(tmp_path / "out") if where == "local" else request.getfixturevalue("s3_bucket_url")
    release = storage.join(root, "releases", "actor", "global_step_1")
    first = _publish(_stage(tmp_path), release)
    assert _publish(_stage(tmp_path, "again"), release).already_published  # intact: nothing copied
    shard = storage.join(release, "model-00001-of-00002.safetensors")
    data = bytearray(storage.read_bytes(shard))
    data[100] ^= 0x01
    if where == "local":
        before = os.stat(storage.local_path(shard))
        with open(storage.local_path(shard), "r+b") as f:
            f.write(bytes(data))
        os.utime(storage.local_path(shard), ns=(before.st_atime_ns, before.st_mtime_ns))
    else:
        storage.write_bytes(shard, bytes(data))
    assert not verify_folder(release).ok
    again = _publish(_stage(tmp_path, "third"), release)
    assert not again.already_published and again.attempt != first.attempt
    assert verify_folder(release).ok
