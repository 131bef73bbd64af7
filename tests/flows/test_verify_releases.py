"""A damaged release is caught (issue 9, case 3): `stepmerge verify`, `check`, merge_step, verify-releases.

Specification, on a real SeaweedFS server and local disk, with a real Prefect API:
- one flipped byte in a published release (same size; on local disk even the same mtime):
  `stepmerge verify` exits 6 naming the file; `stepmerge check` on the release exits 6 too;
- merge_step no longer calls it "already published": it rebuilds it, and the new release verifies and
  holds the step's own weights again (judged from outside stepmerge, `tests.release_checks`), as the
  first one did before the flip;
- on S3 the quick check reads no byte: the object's ETag recorded at publish time differs;
- the `verify-releases` flow sweeps a release root: an intact release passes, a damaged one is
  named, its marker removed (readers stop trusting it) and the run fails.
"""

from __future__ import annotations

import os

import pytest

from flows.merge_step import merge_step
from flows.verify_releases import verify_releases
from merge_engine import storage
from merge_engine.cli import main as stepmerge
from merge_engine.release.folders import MARKER
from merge_engine.release.manifest import is_released, read_manifest
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import copy_steps
from tests.release_checks import assert_release_of_step

WEIGHTS = "model.safetensors"


def _params(run_root: str, tmp_path, step: int) -> dict:
    """merge_step's (flat) parameters for one step."""
    return {"run_root": run_root, "step": step, "staging_root": str(tmp_path / "staging")}


def _flip_one_byte(url: str) -> None:
    """Flip one byte in the middle of a file: same size; a local file keeps its mtime too."""
    if storage.is_local(url):
        path = storage.local_path(url)
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(before.st_size // 2)
            byte = f.read(1)
            f.seek(before.st_size // 2)
            f.write(bytes([byte[0] ^ 0x01]))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        return
    data = bytearray(storage.read_bytes(url))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(url, bytes(data))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_flipped_byte_is_caught_and_the_release_rebuilt(prefect, template_run, tmp_path, where, request, capsys):
    root = str(tmp_path / "run") if where == "local" else f"{request.getfixturevalue('s3_bucket_url')}/run"
    copy_steps(template_run, root, [1])
    release = merge_step(**_params(root, tmp_path, 1)).releases[0].url
    assert stepmerge(["verify", release]) == 0
    assert_release_of_step(release, template_run, 1)
    attempt = read_manifest(release).attempt

    _flip_one_byte(storage.join(release, WEIGHTS))
    assert stepmerge(["verify", release]) == 6
    err = capsys.readouterr().err
    assert "ReleaseDamaged" in err and WEIGHTS in err
    quick = verify_folder(release, mode="quick")
    assert not quick.ok and (quick.bytes_hashed == 0) == (where == "s3")  # S3: the store's version, no read
    assert quick.method == ("store versions" if where == "s3" else "sha256")
    assert stepmerge(["check", "--local_dir", release]) == 6

    again = merge_step(**_params(root, tmp_path, 1))
    assert again.status == "published"  # not "already_published": the damage was seen and rebuilt
    assert read_manifest(release).attempt != attempt
    assert stepmerge(["verify", release]) == 0
    assert_release_of_step(release, template_run, 1)


def test_verify_releases_flow_names_and_unmarks_damaged_releases(prefect, template_run, tmp_path):
    root = str(tmp_path / "run")
    copy_steps(template_run, root, [1, 2])
    good, bad = (merge_step(**_params(root, tmp_path, step)).releases[0].url for step in (1, 2))
    assert verify_releases(f"{root}/releases").damaged == []
    for release, step in ((good, 1), (bad, 2)):
        assert_release_of_step(release, template_run, step)

    _flip_one_byte(storage.join(bad, "config.json"))
    state = verify_releases(f"{root}/releases", return_state=True)
    assert state.is_failed()
    message = str(state.message) + str(state.result(raise_on_failure=False))
    assert bad in message and "config.json" in message and good not in message
    assert not is_released(bad) and storage.exists(storage.join(bad, WEIGHTS))  # unmarked, files kept
    assert is_released(good) and storage.exists(storage.join(good, MARKER))


def test_verify_without_anything_to_verify_against(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("x")
    assert stepmerge(["verify", str(tmp_path)]) == 2
    assert "InvalidConfig" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text("{}")
    assert stepmerge(["verify", str(tmp_path)]) == 3  # a manifest without a valid marker: not a release
