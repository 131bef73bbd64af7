"""Publishing: staging -> release with manifest and marker; idempotent, crash-safe, one winner.

Staging folders hold small files with known bytes (publishing never looks inside them), written
through `merge_engine.storage` under the `root_url` fixture so each test runs on every backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest

from merge_engine.release import publish as publish_module
from merge_engine import storage
from merge_engine.errors import ChecksumMismatch, InvalidOption, TargetExists, ValidationFailed
from merge_engine.release.publish import ReleaseBusy, publish
from merge_engine.release.card import CARD
from merge_engine.release.folders import CLAIMS, MANIFEST, MARKER
from merge_engine.release.manifest import is_released, read_manifest
from merge_engine.validate import Check, ValidationReport
from merge_engine.release.verify import verify_folder
from tests.clock import HANG_S, ManualClock, until

FILES = {
    "config.json": b'{"architectures": ["Qwen2ForCausalLM"]}',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 40,
    "model-00002-of-00002.safetensors": b"\x01" * 3000,
    "model.safetensors.index.json": b'{"metadata": {"total_size": 13240}, "weight_map": {}}',
    "tokenizer/empty.txt": b"",
}
GOOD = ValidationReport("staging", (Check("finite", True, "ok"), Check("forward", True, "logits ok")))
BAD = ValidationReport("staging", (Check("finite", True), Check("expected_keys", False, "missing ['x']")))


def stage(root: str, name: str = "staging", files: dict[str, bytes] = FILES) -> str:
    url = storage.join(root, name)
    for rel, data in files.items():
        storage.write_bytes(storage.join(url, *rel.split("/")), data)
    return url


def stage_merged(root: str, name: str = "staging", files: dict[str, bytes] = FILES) -> str:
    """``files`` staged as a merge writes them: with a ``stepmerge.json`` recording each one's size and sha256."""
    url = stage(root, name, files)
    record = {"fingerprint": "fp-1", "files": {rel: len(data) for rel, data in files.items()},
              "sha256": {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}}
    storage.write_bytes(storage.join(url, "stepmerge.json"), json.dumps(record).encode())
    return url


def do_publish(staging: str, release: str, fingerprint: str = "fp-1", **kw):
    kw.setdefault("validation", GOOD)
    return publish(staging, release, source="s3://run/global_step_7/actor", fingerprint=fingerprint,
                   options={"dtype": "bfloat16", "max_shard_size": "5GB"}, engine_version="0.1.0", **kw)


def paths(url: str) -> set[str]:
    return {e.path for e in storage.list_files(url)}


class TestPublish:
    def test_copies_every_file_then_manifest_then_marker(self, root_url):
        release_url = storage.join(root_url, "releases", "step_7")
        release = do_publish(stage(root_url), release_url)

        card = storage.read_bytes(storage.join(release_url, CARD))  # the model card, listed like every file
        assert not release.already_published and release.files == len(FILES) + 1
        assert release.total_bytes == sum(map(len, FILES.values())) + len(card)
        assert paths(release_url) == set(FILES) | {CARD, MANIFEST, MARKER}
        for rel, data in FILES.items():
            assert storage.read_bytes(storage.join(release_url, *rel.split("/"))) == data
        manifest = read_manifest(release_url)
        expected = {p: hashlib.sha256(d).hexdigest() for p, d in {**FILES, CARD: card}.items()}
        assert {f.path: f.sha256 for f in manifest.files} == expected
        assert (manifest.source, manifest.fingerprint, manifest.engine_version) == (
            "s3://run/global_step_7/actor", "fp-1", "0.1.0")
        assert manifest.options == {"dtype": "bfloat16", "max_shard_size": "5GB"}
        assert manifest.validation["ok"] and "**Validation PASSED**" in manifest.validation["summary"]
        assert manifest.created.endswith("+00:00")
        marker = json.loads(storage.read_bytes(storage.join(release_url, MARKER)))
        manifest_bytes = storage.read_bytes(storage.join(release_url, MANIFEST))
        assert marker["manifest_sha256"] == hashlib.sha256(manifest_bytes).hexdigest()
        assert is_released(release_url) and verify_folder(release_url).ok
        assert paths(storage.join(root_url, "staging")) == set()  # staging consumed

    def test_marker_is_written_last(self, root_url, monkeypatch):
        """Every data file and the manifest exist before the marker is written."""
        order = []
        real = storage.write_bytes
        monkeypatch.setattr(storage, "write_bytes", lambda url, data: order.append(url) or real(url, data))
        release_url = storage.join(root_url, "rel")
        staging = stage(root_url)
        order.clear()
        real_copy = publish_module._copy_with_sha256
        monkeypatch.setattr(publish_module, "_copy_with_sha256",
                            lambda src, dst, size: order.append(dst) or real_copy(src, dst, size))
        do_publish(staging, release_url, max_workers=1)
        data_writes = [u for u in order if not u.startswith(publish_module.claims_url(release_url))]
        # local releases are written beside the release and swapped in whole; remote ones in place
        assert [u.rsplit("/", 1)[-1] for u in data_writes[-2:]] == [MANIFEST, MARKER]
        assert len(data_writes) == len(FILES) + 3  # the files, the card, the manifest, the marker

    def test_republishing_the_same_fingerprint_copies_nothing(self, root_url, monkeypatch):
        release_url = storage.join(root_url, "rel")
        first = do_publish(stage(root_url), release_url)
        monkeypatch.setattr(publish_module, "_copy_with_sha256", lambda *a: pytest.fail("copied again"))
        again = do_publish(stage(root_url, "staging2"), release_url)
        assert again.already_published and again.attempt == first.attempt and again.created == first.created
        assert paths(storage.join(root_url, "staging2")) == set()

    def test_another_fingerprint_needs_overwrite(self, root_url):
        release_url = storage.join(root_url, "rel")
        do_publish(stage(root_url), release_url)
        with pytest.raises(TargetExists) as err:
            do_publish(stage(root_url), release_url, fingerprint="fp-2")
        assert err.value.path == release_url and read_manifest(release_url).fingerprint == "fp-1"
        assert paths(storage.join(root_url, "staging")) == set(FILES)  # kept: a retry with overwrite needs it

        replaced = do_publish(stage(root_url, "other", {"config.json": b"{}", "model.safetensors": b"abc"}),
                              release_url, fingerprint="fp-2", overwrite=True)
        assert not replaced.already_published
        assert paths(release_url) == {"config.json", "model.safetensors", CARD, MANIFEST, MARKER}  # old files gone
        assert read_manifest(release_url).fingerprint == "fp-2" and verify_folder(release_url).ok

    def test_folder_without_marker_is_junk_and_is_redone(self, root_url):
        """A crash mid-publish leaves files but no marker: readers ignore it, the next publish clears it."""
        release_url = storage.join(root_url, "rel")
        stage(root_url, "rel", {"model-00001-of-00002.safetensors": b"half", "leftover.bin": b"junk",
                                MANIFEST: b'{"format": "stepmerge.release/1"'})
        assert not is_released(release_url)
        release = do_publish(stage(root_url), release_url)
        assert not release.already_published
        assert paths(release_url) == set(FILES) | {CARD, MANIFEST, MARKER}
        assert verify_folder(release_url).ok

    def test_marker_not_matching_the_manifest_is_not_trusted(self, root_url):
        release_url = storage.join(root_url, "rel")
        do_publish(stage(root_url), release_url)
        manifest = json.loads(storage.read_bytes(storage.join(release_url, MANIFEST)))
        manifest["attempt"] = "someone-else"
        storage.write_bytes(storage.join(release_url, MANIFEST), json.dumps(manifest).encode())
        assert not is_released(release_url)

    def test_failed_validation_publishes_nothing_and_removes_staging(self, root_url):
        release_url = storage.join(root_url, "rel")
        staging = stage(root_url)
        with pytest.raises(ValidationFailed, match="expected_keys") as err:
            do_publish(staging, release_url, validation=BAD)
        assert err.value.path == staging
        assert paths(staging) == set() and paths(release_url) == set()

    def test_deleted_release_is_not_released(self, root_url):
        release_url = storage.join(root_url, "rel")
        do_publish(stage(root_url), release_url)
        storage.remove(release_url, recursive=True)
        assert not is_released(release_url)
        assert not do_publish(stage(root_url), release_url).already_published

    def test_bad_staging(self, root_url):
        with pytest.raises(InvalidOption, match="empty"):
            do_publish(storage.join(root_url, "nothing"), storage.join(root_url, "rel"))
        with pytest.raises(InvalidOption, match="reserved"):
            do_publish(stage(root_url, files={MARKER: b"x"}), storage.join(root_url, "rel"))
        with pytest.raises(InvalidOption, match="contain"):
            do_publish(stage(root_url, "out"), storage.join(root_url, "out", "release"))
        assert paths(storage.join(root_url, "out")) == set(FILES)  # untouched

    def test_keep_staging_on_request(self, root_url):
        staging = stage(root_url)
        do_publish(staging, storage.join(root_url, "rel"), remove_staging=False)
        assert paths(staging) == set(FILES)


class TestWritersChecksums:
    """The shard jobs' sha256 (computed while the merge wrote each shard) are what a copy must match."""

    SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json")

    def _writers(self) -> dict[str, str]:
        return {name: hashlib.sha256(FILES[name]).hexdigest() for name in self.SHARDS}

    def test_the_manifest_holds_the_writers_checksums_confirmed_by_the_copy(self, root_url):
        release_url = storage.join(root_url, "rel")
        do_publish(stage_merged(root_url), release_url, checksums=self._writers())
        manifest = {f.path: f.sha256 for f in read_manifest(release_url).files}
        assert {name: manifest[name] for name in self.SHARDS} == self._writers()
        assert verify_folder(release_url).ok

    def test_staged_bytes_other_than_the_merge_wrote_publish_nothing(self, root_url):
        release_url = storage.join(root_url, "rel")
        staging = stage_merged(root_url)
        changed = bytearray(FILES["model-00002-of-00002.safetensors"])
        changed[1234] ^= 1  # one bit flipped in staging after the shard job hashed it
        storage.write_bytes(storage.join(staging, "model-00002-of-00002.safetensors"), bytes(changed))
        with pytest.raises(ChecksumMismatch, match="model-00002-of-00002.safetensors"):
            do_publish(staging, release_url, checksums=self._writers())
        assert not is_released(release_url) and paths(release_url) == set()
        assert paths(staging) == set()  # staging dropped: the next run merges again

    def test_a_shard_the_merge_wrote_but_staging_lost_publishes_nothing(self, root_url):
        release_url = storage.join(root_url, "rel")
        staging = stage_merged(root_url)
        storage.remove(storage.join(staging, "model-00001-of-00002.safetensors"))
        with pytest.raises(ChecksumMismatch, match="model-00001-of-00002"):
            do_publish(staging, release_url, checksums=self._writers())
        assert not is_released(release_url) and paths(release_url) == set()


class TestVerifyFolder:
    def test_detects_changed_missing_and_extra_files(self, root_url):
        release_url = storage.join(root_url, "rel")
        do_publish(stage(root_url), release_url)
        shard = storage.join(release_url, "model-00002-of-00002.safetensors")
        storage.write_bytes(shard, b"\x02" * 3000)  # same size, other bytes
        storage.remove(storage.join(release_url, "config.json"))
        storage.write_bytes(storage.join(release_url, "stray.safetensors"), b"x")
        report = verify_folder(release_url)
        assert set(report.problems) == {"model-00002-of-00002.safetensors: sha256 differs from the manifest",
                                        "config.json: missing", "stray.safetensors: not in the manifest"}

    def test_a_release_without_its_marker_fails(self, root_url):
        release_url = storage.join(root_url, "rel")
        do_publish(stage(root_url), release_url)
        storage.remove(storage.join(release_url, MARKER))
        assert not verify_folder(release_url).ok


class TestConcurrency:
    def test_concurrent_publishers_publish_once(self, root_url):
        """Four publishers of the same release start together: exactly one copies, all agree."""
        release_url = storage.join(root_url, "rel")
        stagings = [stage(root_url, f"staging{i}") for i in range(4)]
        start = threading.Barrier(len(stagings))
        results, errors = [], []

        def run(staging):
            start.wait()
            try:
                results.append(do_publish(staging, release_url, wait_s=30))
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in stagings]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        winners = [r for r in results if not r.already_published]
        assert len(results) == 4 and len(winners) == 1
        assert {r.attempt for r in results} == {winners[0].attempt} == {read_manifest(release_url).attempt}
        assert verify_folder(release_url).ok
        assert paths(publish_module.claims_url(release_url)) == set()

    def test_live_claim_of_another_publisher_blocks(self, root_url, monkeypatch):
        """While another attempt holds a fresh claim we write nothing and give up after wait_s."""
        release_url = storage.join(root_url, "rel")
        publish_module._write_claim(release_url, "other-attempt", "fp-1")
        with pytest.raises(ReleaseBusy):
            do_publish(stage(root_url), release_url, wait_s=0.3)
        assert paths(publish_module.claims_url(release_url)) == {"other-attempt.json"}
        assert paths(release_url) <= {f"{CLAIMS}/other-attempt.json"}  # nothing but the claim was written

    def test_waiting_publisher_returns_the_winners_release(self, root_url):
        """The holder finishes while we wait (backed off, on our clock): we see its marker and copy nothing."""
        release_url = storage.join(root_url, "rel")
        publish_module._write_claim(release_url, "holder", "fp-1")
        clock = ManualClock()
        finished = []

        def holder_finishes():
            clock.until_waiting(1)  # we found its claim and back off
            publish_module._remove_claim(release_url, "holder")
            finished.append(do_publish(stage(root_url, "holder-staging"), release_url))
            clock.advance(60)  # our back-off ends

        thread = threading.Thread(target=holder_finishes)
        thread.start()
        waited = do_publish(stage(root_url), release_url, wait_s=600, clock=clock)
        thread.join(HANG_S)
        assert waited.already_published and not finished[0].already_published and clock.slept
        assert read_manifest(release_url).attempt == waited.attempt == finished[0].attempt
        assert verify_folder(release_url).ok

    def test_stale_claim_of_a_crashed_publisher_is_ignored(self, root_url):
        release_url = storage.join(root_url, "rel")
        stale = storage.join(publish_module.claims_url(release_url), "crashed.json")
        storage.write_bytes(stale, json.dumps({"attempt": "crashed", "heartbeat": time.time() - 3600}).encode())
        storage.write_bytes(storage.join(publish_module.claims_url(release_url), "debris.json"), b"{not json")
        assert not do_publish(stage(root_url), release_url, wait_s=1).already_published
        assert paths(publish_module.claims_url(release_url)) == set()
        assert verify_folder(release_url).ok


def test_a_local_release_keeps_no_claims_folder(tmp_path):
    """The claims folder is bookkeeping: a finished local release holds only the model, card, manifest and marker."""
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"x" * 10)
    release = tmp_path / "release"
    publish(str(staging), str(release), source="s", fingerprint="f", options={}, validation=None,
            engine_version="0")
    assert sorted(p.name for p in release.iterdir()) == ["README.md", "_COMPLETE", "manifest.json", "model.safetensors"]


class TestClaimHeartbeat:
    """A claim stays live for as long as its publisher copies, however long one file takes."""

    @staticmethod
    def _slow_copy(monkeypatch, staging, hold, during=None):
        """Copies out of ``staging`` start with ``during()`` and last until ``hold()`` returns."""
        real = publish_module._copy_with_sha256

        def slow(src, dst, size):
            if src.startswith(staging + "/"):
                if during is not None:
                    during()
                hold()  # one big shard over a slow link: longer than the claim TTL
            return real(src, dst, size)

        monkeypatch.setattr(publish_module, "_copy_with_sha256", slow)

    def test_a_file_copy_longer_than_the_ttl_keeps_the_claim_live(self, root_url, monkeypatch):
        """While one copy runs for several TTLs (on the publisher's clock), its heartbeat refreshes the
        claim every quarter TTL: another publisher still sees it live, backs off (`ReleaseBusy`) and writes
        nothing; ours completes."""
        release_url = storage.join(root_url, "rel")
        ttl, clock = publish_module.CLAIM_TTL_S, ManualClock()
        staging = stage(root_url, "a")
        copying, go = threading.Event(), threading.Event()
        self._slow_copy(monkeypatch, staging, hold=lambda: go.wait(HANG_S), during=copying.set)
        result, errors = [], []

        def first():
            try:
                result.append(do_publish(staging, release_url, clock=clock))
            except Exception as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        thread = threading.Thread(target=first)
        thread.start()
        try:
            assert copying.wait(HANG_S)
            for _ in range(12):  # three TTLs, one heartbeat at a time
                clock.until_waiting(1)  # the heartbeat waits for its next beat
                clock.advance(ttl / 4)
            clock.until_waiting(1)
            live = publish_module._live_claims(release_url, ttl, clock)
            with pytest.raises(ReleaseBusy):
                do_publish(stage(root_url, "b"), release_url, fingerprint="fp-2", wait_s=0, overwrite=True,
                           clock=clock)
        finally:
            go.set()
            thread.join(HANG_S)
        assert not errors and len(live) == 1
        assert result[0].attempt == live[0] == read_manifest(release_url).attempt
        assert read_manifest(release_url).fingerprint == "fp-1" and verify_folder(release_url).ok

    def test_a_publisher_whose_claim_was_taken_writes_no_manifest(self, root_url, monkeypatch):
        """If our claim disappears while we copy (we stalled past the TTL and another publisher
        cleared it), our heartbeat does not bring it back and we stop: `ClaimLost` (a `ReleaseBusy`),
        no manifest, no marker, staging kept."""
        from merge_engine.release.publish import ClaimLost

        release_url = storage.join(root_url, "rel")
        ttl, clock = publish_module.CLAIM_TTL_S, ManualClock()
        once = threading.Lock()

        def taken():
            if not once.acquire(blocking=False):
                return  # the copies run in parallel: take the claim once
            for entry in storage.list_files(publish_module.claims_url(release_url)):
                storage.remove(storage.join(publish_module.claims_url(release_url), entry.path))
            publish_module._write_claim(release_url, "intruder", "fp-2")
            clock.until_waiting(1)
            clock.advance(ttl / 4)  # the heartbeat's next beat finds our claim gone
            until(lambda: not _heartbeats(), "the heartbeat stopped")

        staging = stage(root_url)
        self._slow_copy(monkeypatch, staging, hold=lambda: None, during=taken)
        with pytest.raises(ClaimLost, match="claim"):
            do_publish(staging, release_url, clock=clock)
        assert isinstance(ClaimLost("x"), ReleaseBusy)
        assert not {MANIFEST, MARKER} & paths(release_url)
        assert paths(publish_module.claims_url(release_url)) == {"intruder.json"}  # never resurrected ours
        assert paths(staging) == set(FILES)

    def test_a_claim_left_stale_for_a_ttl_is_treated_as_lost(self, root_url, monkeypatch):
        """Refreshes failing for longer than the TTL (storage down, or this process stalled): others
        may have judged the claim dead and taken over, so we write no manifest (`ClaimLost`)."""
        from merge_engine.release.publish import ClaimLost

        release_url = storage.join(root_url, "rel")
        ttl, clock = publish_module.CLAIM_TTL_S, ManualClock()
        once = threading.Lock()

        def storage_fails(*_):
            raise OSError("storage unreachable")

        def stall():
            if not once.acquire(blocking=False):
                return  # the copies run in parallel: stall once
            monkeypatch.setattr(publish_module, "_write_claim", storage_fails)
            for _ in range(5):  # four failed refreshes in a TTL, then past it: the heartbeat gives the claim up
                clock.until_waiting(1)
                clock.advance(ttl / 4)
            until(lambda: not _heartbeats(), "the heartbeat stopped")

        staging = stage(root_url)
        self._slow_copy(monkeypatch, staging, hold=stall)
        with pytest.raises(ClaimLost, match="stale"):
            do_publish(staging, release_url, clock=clock)
        assert not {MANIFEST, MARKER} & paths(release_url)


def _heartbeats() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("publish-heartbeat-")]


class TestStagedBytesBoundToTheMerge:
    """Staged bytes are published only as the merge wrote them: the copy must hash to what the staging folder's
    ``stepmerge.json`` records, which must agree with the shard jobs' sums; staging holds regular files only."""

    SHARDS = TestWritersChecksums.SHARDS

    def test_a_weight_changed_with_its_sums_rewritten_to_match_publishes_nothing(self, root_url):
        """The kept sums are on the staging disk too: a weight changed and the sums re-computed from the new bytes
        still disagree with ``stepmerge.json`` (before: published, the manifest recording the new bytes)."""
        release_url = storage.join(root_url, "rel")
        staging = stage_merged(root_url)
        changed = bytearray(FILES["model-00002-of-00002.safetensors"])
        changed[7] ^= 1
        storage.write_bytes(storage.join(staging, "model-00002-of-00002.safetensors"), bytes(changed))
        resummed = {name: hashlib.sha256(FILES[name]).hexdigest() for name in self.SHARDS}
        resummed["model-00002-of-00002.safetensors"] = hashlib.sha256(bytes(changed)).hexdigest()
        with pytest.raises(ChecksumMismatch, match="model-00002-of-00002.safetensors"):
            do_publish(staging, release_url, checksums=resummed)
        assert not is_released(release_url) and paths(release_url) == set()
        assert paths(staging) == set()  # staging dropped: the next run merges again

    @pytest.mark.parametrize("change", ["config_bytes", "unrecorded_file", "no_record"])
    def test_a_staged_file_the_merge_did_not_write_publishes_nothing(self, root_url, change):
        """Files the sums do not name (configs, tokenizer) are bound by ``stepmerge.json`` too (before: copied as
        found); a staging folder of a merge without its ``stepmerge.json`` publishes nothing."""
        release_url = storage.join(root_url, "rel")
        staging = stage_merged(root_url)
        if change == "config_bytes":
            storage.write_bytes(storage.join(staging, "config.json"), b'{"architectures": ["Qwen2ForCausalLX"]}')
        elif change == "unrecorded_file":
            storage.write_bytes(storage.join(staging, "modeling_evil.py"), b"import os\n")
        else:
            storage.remove(storage.join(staging, "stepmerge.json"))
        with pytest.raises(ChecksumMismatch):
            do_publish(staging, release_url, checksums=TestWritersChecksums()._writers())
        assert not is_released(release_url) and paths(release_url) == set()

    def test_a_staged_file_replaced_by_a_link_to_a_host_file_is_refused(self, tmp_path):
        """A staged file replaced by a link to a host file of the same size (before: the host file's bytes were
        published, nothing hashing them) is `UnsafeFile` naming it; nothing is published."""
        from merge_engine.errors import UnsafeFile

        files = {**FILES, "tokenizer.json": b'{"version": "1.0", "model": {}}'}
        staging = stage_merged(str(tmp_path), files=files)
        host = tmp_path / "host-secret"
        host.write_bytes(b"S" * len(files["tokenizer.json"]))
        os.remove(os.path.join(staging, "tokenizer.json"))
        os.symlink(host, os.path.join(staging, "tokenizer.json"))
        release_url = str(tmp_path / "rel")
        with pytest.raises(UnsafeFile) as error:
            do_publish(staging, release_url, checksums=TestWritersChecksums()._writers())
        assert error.value.path.endswith("tokenizer.json")
        assert not os.path.exists(release_url) and host.read_bytes() == b"S" * len(files["tokenizer.json"])

    def test_verify_compares_the_manifest_with_the_releases_own_stepmerge_json(self, tmp_path):
        """A published weight rewritten with the manifest and marker rewritten to match: `verify` finds the
        manifest disagreeing with the release's ``stepmerge.json`` (before: intact)."""
        from merge_engine.release.manifest import sha256_hex

        release_url = str(tmp_path / "rel")
        do_publish(stage_merged(str(tmp_path)), release_url, checksums=TestWritersChecksums()._writers())
        assert verify_folder(release_url).ok
        shard = os.path.join(release_url, "model-00002-of-00002.safetensors")
        with open(shard, "r+b") as handle:
            handle.write(b"\x02")
        manifest = json.loads(storage.read_bytes(storage.join(release_url, MANIFEST)))
        for entry in manifest["files"]:
            if entry["path"] == "model-00002-of-00002.safetensors":
                entry["sha256"] = hashlib.sha256(open(shard, "rb").read()).hexdigest()
        manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
        storage.write_bytes(storage.join(release_url, MANIFEST), manifest_bytes)
        marker = json.loads(storage.read_bytes(storage.join(release_url, MARKER)))
        marker["manifest_sha256"] = sha256_hex(manifest_bytes)
        storage.write_bytes(storage.join(release_url, MARKER), json.dumps(marker, sort_keys=True).encode())
        report = verify_folder(release_url)
        assert not report.ok and [p.split(":")[0] for p in report.problems] == ["model-00002-of-00002.safetensors"]
