"""Pushing a release to the Hugging Face Hub with huggingface_hub's own client, against a local Hub
(`tests.hub_server`: the endpoints the client calls, on loopback).

- a release lands on its revision (a branch ``step-N``) with every manifest file, the card and the manifest, and no
  ``_COMPLETE``; large files through LFS, verified with the Hub's own metadata; a moving ``latest`` follows;
- pushed again: no commit, nothing uploaded; a republished release replaces the revision's files (stale ones gone);
- refusals are one named line each, and nothing is committed: no token, a read-only token, a missing repo without
  ``private`` (with it: created private), the Hub out of reach;
- the CLI: ``stepmerge push RELEASE --repo REPO --revision step-N``.
"""

from __future__ import annotations

import json

import pytest

from merge_engine import storage
from merge_engine.cli import main
from merge_engine.errors import HubPushRefused, HubPushUnverified, ReleaseIncomplete
from merge_engine.release.hub import push_folder
from merge_engine.release.publish import publish
from merge_engine.validate import Check, ValidationReport
from tests.hub_server import READ_TOKEN, WRITE_TOKEN, hub  # noqa: F401 - the fixture

WEIGHTS = bytes(range(256)) * 64  # binary: stored with LFS
REPORT = ValidationReport("x", (Check("finite", True, "ok"),))


def release_of(tmp_path, step: int, weights: bytes = WEIGHTS, extra: dict | None = None) -> str:
    staging = tmp_path / f"staging-{step}"
    files = {"model.safetensors": weights, "config.json": b'{"architectures": ["Qwen2ForCausalLM"]}', **(extra or {})}
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    release = str(tmp_path / "run" / "releases" / "actor" / f"global_step_{step}")
    publish(str(staging), release, source=f"s3://b/run/global_step_{step}/actor", fingerprint=f"fp-{step}-{hash((weights, tuple(extra or ())))}",
            options={"kind": "model"}, validation=REPORT, engine_version="0", overwrite=True)
    return release


def test_a_release_lands_on_its_revision_verified_and_latest_follows(hub, tmp_path):
    hub.create_repo("tester/run")
    release = release_of(tmp_path, 3)
    pushed = push_folder(release, "tester/run", revision="step-3", token=WRITE_TOKEN, moving_refs=("latest",),
                         endpoint=hub.url)
    assert pushed.committed and hub.commits == 1 and pushed.moved_refs == ("latest",)
    held = hub.files("tester/run", "step-3")
    local = {e.path: storage.read_bytes(storage.join(release, e.path)) for e in storage.list_files(release)}
    assert set(held) - {".gitattributes"} == set(local) - {"_COMPLETE"}  # the card and manifest, no marker
    assert all(held[path] == data for path, data in local.items() if path != "_COMPLETE")
    assert hub.repos["tester/run"].branches["latest"] == pushed.commit == hub.repos["tester/run"].branches["step-3"]
    assert hub.lfs_uploads == 1  # the weights through LFS; small files in the commit

    again = push_folder(release, "tester/run", revision="step-3", token=WRITE_TOKEN, endpoint=hub.url)
    assert not again.committed and hub.commits == 1 and hub.lfs_uploads == 1 and again.commit == pushed.commit

    # the step published again with other bytes and one file fewer: the revision holds exactly the new release
    release = release_of(tmp_path, 3, weights=WEIGHTS[::-1])
    replaced = push_folder(release, "tester/run", revision="step-3", token=WRITE_TOKEN, endpoint=hub.url)
    assert replaced.committed and hub.files("tester/run", "step-3")["model.safetensors"] == WEIGHTS[::-1]


def test_a_stale_file_on_the_revision_is_deleted_in_the_push(hub, tmp_path):
    hub.create_repo("tester/run")
    push_folder(release_of(tmp_path, 1, extra={"tokenizer.json": b"{}"}), "tester/run", revision="step-1",
                token=WRITE_TOKEN, endpoint=hub.url)
    push_folder(release_of(tmp_path, 1), "tester/run", revision="step-1", token=WRITE_TOKEN, endpoint=hub.url)
    assert "tokenizer.json" not in hub.files("tester/run", "step-1")


@pytest.mark.parametrize("case", ["no token", "read-only token", "bad token", "no repo", "hub down"])
def test_each_refusal_is_one_named_line_and_nothing_is_committed(hub, tmp_path, case):
    release = release_of(tmp_path, 2)
    if case != "no repo":
        hub.create_repo("tester/run")
    token = {"no token": None, "read-only token": READ_TOKEN, "bad token": "hf_nobody"}.get(case, WRITE_TOKEN)
    endpoint = "http://127.0.0.1:9" if case == "hub down" else hub.url
    expected = {"no token": "no Hugging Face token", "read-only token": "no write access to tester/run",
                "bad token": "refused the token", "no repo": "does not exist on the Hub",
                "hub down": "cannot reach the Hub"}[case]
    with pytest.raises(HubPushRefused, match=expected) as err:
        push_folder(release, "tester/run", revision="step-2", token=token, endpoint=endpoint)
    assert "\n" not in str(err.value) and hub.commits == 0 and not hub.lfs


def test_a_missing_repo_is_created_private_when_asked(hub, tmp_path):
    pushed = push_folder(release_of(tmp_path, 2), "tester/new", revision="step-2", private=True, token=WRITE_TOKEN,
                         endpoint=hub.url)
    assert pushed.committed and hub.repos["tester/new"].private


def test_a_folder_that_is_no_release_is_not_pushed(hub, tmp_path):
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "model.safetensors").write_bytes(WEIGHTS)
    with pytest.raises(ReleaseIncomplete):
        push_folder(str(tmp_path / "loose"), "tester/run", token=WRITE_TOKEN, endpoint=hub.url)


def test_stepmerge_push(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    hub.create_repo("tester/run")
    release = release_of(tmp_path, 4)
    assert main(["push", release, "--repo", "tester/run", "--revision", "step-4"]) == 0
    assert "tester/run@step-4: pushed" in capsys.readouterr().out
    assert json.loads(hub.files("tester/run", "step-4")["manifest.json"])["source"]["url"].endswith("global_step_4/actor")
    assert main(["push", release, "--repo", "tester/missing"]) == 2
    assert "HubPushRefused" in capsys.readouterr().err


def test_a_push_the_hub_did_not_store_as_sent_is_not_done(hub, tmp_path):
    """The Hub's own metadata (the LFS sha256 of the stored weights) disagrees with the manifest: the push fails
    naming the file, and the moving ref is not moved onto it."""
    hub.create_repo("tester/run")
    hub.corrupt_lfs = True
    with pytest.raises(HubPushUnverified, match="model.safetensors: the Hub's LFS sha256"):
        push_folder(release_of(tmp_path, 5), "tester/run", revision="step-5", token=WRITE_TOKEN,
                    moving_refs=("latest",), endpoint=hub.url)
    assert "latest" not in hub.repos["tester/run"].branches


def test_verls_hf_upload_path_pushes_the_merged_folder(hub, tmp_path, monkeypatch, capsys):
    """``stepmerge merge ... --hf_upload_path REPO --private`` (verl's flags): the merged folder's files, as its
    stepmerge.json lists them, land on the repo's main, created private; without a token, one line, exit 2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "hf")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    args = ["merge", "--local_dir", str(tmp_path / "hf"), "--target_dir", str(tmp_path / "out"),
            "--hf_upload_path", "tester/merged"]
    assert main(args) == 2 and "HubPushRefused: no Hugging Face token" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    assert main(args) == 2 and "does not exist on the Hub" in capsys.readouterr().err  # never a public repo unasked
    assert main(args + ["--private"]) == 0
    held = hub.files("tester/merged")
    recorded = json.loads((tmp_path / "out" / "stepmerge.json").read_text())
    assert set(held) - {".gitattributes"} == set(recorded["files"]) | {"stepmerge.json"}
    assert held["model.safetensors"] == (tmp_path / "out" / "model.safetensors").read_bytes()
    assert hub.repos["tester/merged"].private and "tester/merged@main: pushed" in capsys.readouterr().out
