"""No host file, endless stream or special file gets into an output (issue 9, case 2).

Specification (`merge_engine.storage.source_files`):
- A link in the checkpoint (at any depth, e.g. ``huggingface/special_tokens_map.json``) that leaves
  the checkpoint is refused by `check` and `merge` with `UnsafeFile` naming the link, exit code 4,
  and nothing at the target: ``-> /etc/passwd`` (a host file), ``-> /dev/zero`` (an endless
  stream), a link to a host folder.
- A FIFO in the checkpoint is refused at once (never opened: no hang).
- A ``--hf_model_path`` folder follows the same rule for the files copied from it and its config.
- Links that stay inside the folder are followed; a Hugging Face hub cache snapshot (files are
  links into ``../../blobs``) is accepted, and its content is what gets copied.
"""

from __future__ import annotations

import os
import shutil

import pytest

from merge_engine.cli import main

VARIANT = "fsdp2_qwen2"


@pytest.fixture()
def checkpoint(fsdp_runs, tmp_path):
    copy = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, copy)
    return copy


def _merge(source, target, *extra):
    return main(["merge", "--backend", "fsdp", "--local_dir", str(source), "--target_dir", str(target), *extra])


@pytest.mark.parametrize("host_path", ["/etc/passwd", "/dev/zero", "/etc"])
def test_a_link_out_of_the_checkpoint_is_refused(checkpoint, tmp_path, host_path, capsys):
    link = checkpoint / "huggingface" / "special_tokens_map.json"
    link.unlink(missing_ok=True)
    link.symlink_to(host_path)
    target = tmp_path / "merged"
    assert main(["check", "--local_dir", str(checkpoint)]) == 4
    assert _merge(checkpoint, target) == 4
    err = capsys.readouterr().err
    assert "UnsafeFile" in err and str(link) in err and host_path in err
    assert not target.exists()


def test_a_fifo_is_refused_without_opening_it(checkpoint, tmp_path, capsys):
    os.mkfifo(checkpoint / "huggingface" / "added_tokens.json")
    assert _merge(checkpoint, tmp_path / "merged") == 4
    err = capsys.readouterr().err
    assert "UnsafeFile" in err and "FIFO" in err
    assert not (tmp_path / "merged").exists()


def test_hf_model_path_links_are_checked_too(checkpoint, tmp_path, capsys):
    meta = tmp_path / "meta"
    shutil.copytree(checkpoint / "huggingface", meta)
    (meta / "tokenizer_extra.txt").symlink_to("/etc/hostname")
    assert _merge(checkpoint, tmp_path / "merged", "--hf_model_path", str(meta)) == 4
    assert "UnsafeFile" in capsys.readouterr().err
    (meta / "tokenizer_extra.txt").unlink()
    (meta / "config.json").rename(tmp_path / "config.json")
    (meta / "config.json").symlink_to(tmp_path / "config.json")  # outside meta: refused as well
    assert _merge(checkpoint, tmp_path / "merged", "--hf_model_path", str(meta)) == 4
    assert not (tmp_path / "merged").exists()


def test_links_inside_the_folder_and_hub_cache_snapshots_are_followed(checkpoint, tmp_path):
    hf = checkpoint / "huggingface"
    (hf / "notes.md").write_text("inside\n")
    (hf / "special_tokens_note.txt").symlink_to("notes.md")
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(hf):
        if (hf / name).is_file() and not (hf / name).is_symlink():
            blob = repo / "blobs" / f"blob-{name}"
            shutil.copy(hf / name, blob)
            (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    target = tmp_path / "merged"
    assert _merge(checkpoint, target, "--hf_model_path", str(snapshot)) == 0
    assert (target / "notes.md").read_text() == "inside\n"  # copied from a blob, as a file
    assert not (target / "notes.md").is_symlink()
    assert _merge(checkpoint, tmp_path / "merged2") == 0
    assert (tmp_path / "merged2" / "special_tokens_note.txt").read_text() == "inside\n"
    assert not (tmp_path / "merged2" / "special_tokens_note.txt").is_symlink()


@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja", ".gitattributes", "README (copy).md",
                                  "vocab-ü.txt", "トークナイザー.json", "a" * 255])
def test_plain_file_names_may_be_copied(name):
    from merge_engine.storage.source_files import file_name_fault

    assert file_name_fault(name) is None


@pytest.mark.parametrize("name, fault", [
    ("tokenizer\n.json", "U+000A"), ("evil\u202enosj.txt", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
    ("zero\u200bwidth.json", "U+200B"), ("line\u2028sep", "U+2028"), ("nul\x00", "U+0000"),
    ("back\\slash", "U+005C"), ("..", "not a file name"), ("a" * 256, "longer than 255 bytes"),
    ("é" * 128, "longer than 255 bytes"),
])
def test_file_names_that_could_pass_for_others_are_refused(name, fault):
    from merge_engine.storage.source_files import file_name_fault

    assert fault in file_name_fault(name)
