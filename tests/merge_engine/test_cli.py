"""The command line: verl's flags, exit codes, one-line errors, and nothing written on bad input.

Specification (issue 2, points 6 and 8): each damaged checkpoint gives a named error that
names the file at fault, a non-zero exit code, and no target folder at all.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from merge_engine.cli import main

VARIANT = "fsdp2_qwen2"


@pytest.fixture()
def checkpoint(fsdp_runs, tmp_path):
    """A private copy of a good 4-rank checkpoint, free to damage."""
    copy = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, copy)
    return copy


def _rank(checkpoint, rank=2):
    return checkpoint / f"model_world_size_4_rank_{rank}.pt"


def _merge(checkpoint, target, *extra):
    return main(["merge", "--backend", "fsdp", "--local_dir", str(checkpoint), "--target_dir", str(target), *extra])


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _truncate(checkpoint):
    data = _rank(checkpoint).read_bytes()
    _rank(checkpoint).write_bytes(data[: len(data) * 2 // 3])
    return _rank(checkpoint), "CorruptShard"


def _missing(checkpoint):
    _rank(checkpoint, 3).unlink()
    return _rank(checkpoint, 3), "IncompleteCheckpoint"


def _zero_bytes(checkpoint):
    _rank(checkpoint).write_bytes(b"")
    return _rank(checkpoint), "IncompleteCheckpoint"


def _world_size_contradiction(checkpoint):
    (checkpoint / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 8}))
    return checkpoint / "fsdp_config.json", "WorldSizeMismatch"


def _mixed_world_sizes(checkpoint):
    shutil.copy(_rank(checkpoint, 0), checkpoint / "model_world_size_2_rank_0.pt")
    return checkpoint, "WorldSizeMismatch"


def _code_in_pickle(checkpoint):
    marker = checkpoint.parent / "pwned"
    with zipfile.ZipFile(_rank(checkpoint), "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": _Exploit(marker)}, protocol=2))
        z.writestr("archive/version", "3\n")
    return _rank(checkpoint), "UnsafePickle"


def _broken_config(checkpoint):
    (checkpoint / "huggingface" / "config.json").write_text("{ not json")
    return checkpoint / "huggingface" / "config.json", "InvalidConfig"


def _config_lies_about_tying(checkpoint):
    path = checkpoint / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config["tie_word_embeddings"] = True
    path.write_text(json.dumps(config))
    return checkpoint, "InvalidConfig"


def _zero_stride_tensor(checkpoint):
    """Issue 9 case 5: a 4-byte storage viewed as 4000 x 4000 (strides 0) on every rank: the output
    size would be decided by the pickle, not by the bytes on disk."""
    import torch
    import torch.distributed.tensor  # noqa: F401 - DTensor classes for torch.load of our own fixture

    for rank in range(4):
        state = torch.load(_rank(checkpoint, rank), weights_only=True)
        state["model.extra_zeros"] = torch.zeros(1).expand(4000, 4000)
        torch.save(state, _rank(checkpoint, rank))
    return _rank(checkpoint, 0), "CorruptShard"


def _short_storage_record(checkpoint):
    """Issue 9 case 12: a storage record shorter than the pickle says (zip rewritten, directory valid)."""
    path = _rank(checkpoint)
    original = path.with_suffix(".orig")
    path.rename(original)
    with zipfile.ZipFile(original) as src, zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as dst:
        records = [i for i in src.infolist() if "/data/" in i.filename and i.file_size > 8]
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info.filename, data[:-8] if info.filename == records[-1].filename else data)
    original.unlink()
    return path, "CorruptShard"


def _fsdp_version_not_a_number(checkpoint):
    """Issue 9 case 11: ``"FSDP_version": "two"`` was a ValueError traceback."""
    (checkpoint / "fsdp_config.json").write_text(json.dumps({"FSDP_version": "two", "world_size": 4}))
    return checkpoint / "fsdp_config.json", "CorruptShard"


def _fsdp_config_a_list(checkpoint):
    (checkpoint / "fsdp_config.json").write_text("[2, 4]")
    return checkpoint / "fsdp_config.json", "CorruptShard"


def _deeply_nested_config(checkpoint):
    """Issue 9 case 11: a config.json nested 100 000 deep was a RecursionError traceback."""
    path = checkpoint / "huggingface" / "config.json"
    path.write_text('{"model_type": "qwen2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return path, "InvalidConfig"


def _config_contradicts_weights(checkpoint):
    """Issue 9 case 13: a config.json saying vocab 10^12 beside a 1003-row embedding was merged with exit 0."""
    path = checkpoint / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config["vocab_size"] = 10**12
    path.write_text(json.dumps(config))
    return path, "InvalidConfig"


def _config_hidden_size_absurd(checkpoint):
    """A config.json saying hidden_size 10^12 over 64-wide tensors was merged with exit 0 (transformers cannot
    build that model even on the meta device, so no shape was compared)."""
    path = checkpoint / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config["hidden_size"] = 10**12
    path.write_text(json.dumps(config))
    return path, "InvalidConfig"


def _config_claims_more_layers(checkpoint):
    path = checkpoint / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config["num_hidden_layers"] += 3
    path.write_text(json.dumps(config))
    return path, "InvalidConfig"


def _pickle_of(name, value):
    """Issue 17 point 13: a rank file whose pickle is not a state dict was a TypeError / AttributeError."""

    def damage(checkpoint):
        torch.save(value, _rank(checkpoint))
        return _rank(checkpoint), "CorruptShard"

    damage.__name__ = name
    return damage


_pickle_is_a_list = _pickle_of("pickle_is_a_list", [torch.ones(3), torch.zeros(2)])
_pickle_is_a_tensor = _pickle_of("pickle_is_a_tensor", torch.ones(3))
_pickle_is_an_int = _pickle_of("pickle_is_an_int", 7)
_pickle_has_int_keys = _pickle_of("pickle_has_int_keys", {1: torch.ones(3), 2: torch.zeros(2)})
NOT_A_STATE_DICT = [_pickle_is_a_list, _pickle_is_a_tensor, _pickle_is_an_int, _pickle_has_int_keys]

DAMAGE = [_truncate, _missing, _zero_bytes, _world_size_contradiction, _mixed_world_sizes, _code_in_pickle,
          _broken_config, _config_lies_about_tying, _zero_stride_tensor, _short_storage_record,
          _fsdp_version_not_a_number, _fsdp_config_a_list, _deeply_nested_config, _config_contradicts_weights,
          _config_claims_more_layers, _config_hidden_size_absurd, *NOT_A_STATE_DICT]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_bad_input_named_error_nonzero_exit_nothing_written(damage, checkpoint, tmp_path, capsys):
    at_fault, kind = damage(checkpoint)
    target = tmp_path / "target"
    code = _merge(checkpoint, target)
    err = capsys.readouterr().err
    assert code != 0
    assert f"error: {kind}" in err
    assert str(at_fault) in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if "stepmerge" in p.name]  # no temp folder left behind
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("damage", [_zero_stride_tensor, _short_storage_record, _fsdp_version_not_a_number,
                                    *NOT_A_STATE_DICT], ids=lambda f: f.__name__.strip("_"))
def test_check_refuses_what_merge_refuses(damage, checkpoint, capsys):
    """Issue 9 case 12: ``check`` is the pipeline's gate, so it reads every record's bounds and every
    view as ``merge`` does: it never calls complete a checkpoint that ``merge`` then rejects."""
    at_fault, kind = damage(checkpoint)
    code = main(["check", "--local_dir", str(checkpoint)])
    err = capsys.readouterr().err
    assert code == 4
    assert f"error: {kind}" in err and str(at_fault) in err


def test_check_exit_codes(checkpoint, capsys):
    assert main(["check", "--local_dir", str(checkpoint)]) == 0
    assert "complete fsdp checkpoint" in capsys.readouterr().out
    _rank(checkpoint, 1).unlink()
    assert main(["check", "--local-dir", str(checkpoint)]) == 3


def test_existing_target_refused_unless_overwrite(fsdp_runs, checkpoint, tmp_path, capsys):
    target = tmp_path / "target"
    assert _merge(checkpoint, target) == 0
    other = fsdp_runs["fsdp2_llama_buffer_mqa"].latest.checkpoint_dir
    assert _merge(other, target) != 0
    assert "TargetExists" in capsys.readouterr().err
    assert _merge(other, target, "--overwrite") == 0


def test_verl_flag_spellings_and_test_command(fsdp_runs, checkpoint, tmp_path, capsys):
    target = tmp_path / "merged"
    code = main(["merge", "--backend", "fsdp", "--local-dir", str(checkpoint), "--target-dir", str(target),
                 "--use_cpu_initialization", "--trust-remote-code"])
    assert code == 0 and (target / "model.safetensors").exists()
    reference = fsdp_runs[VARIANT].latest.reference_hf_dir
    assert main(["test", "--backend", "fsdp", "--local_dir", str(checkpoint), "--test_hf_dir", reference]) == 0
    assert "\nvalidation passed (" in capsys.readouterr().out
    other = tmp_path / "perturbed"  # the reference with one value moved by 1e-4
    shutil.copytree(reference, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"][3] += 1e-4
    save_file(weights, str(other / "model.safetensors"))
    assert main(["test", "--local_dir", str(checkpoint), "--test_hf_dir", str(other)]) == 5
    assert "first mismatch in model.norm.weight" in capsys.readouterr().out
    weights["model.norm.weight"][3] = float("nan")  # NaN is never "within tolerance"
    save_file(weights, str(other / "model.safetensors"))
    assert main(["test", "--local_dir", str(checkpoint), "--test_hf_dir", str(other)]) == 5
    assert "first mismatch in model.norm.weight" in capsys.readouterr().out


def test_tie_flag_must_agree_with_config(checkpoint, tmp_path, capsys):
    assert _merge(checkpoint, tmp_path / "t", "--tie-word-embedding") != 0
    assert "InvalidOption" in capsys.readouterr().err


def test_console_entry_point_exit_code(checkpoint, tmp_path):
    """The real process: `python -m merge_engine` exits non-zero with one line on stderr."""
    _missing(checkpoint)
    proc = subprocess.run([sys.executable, "-m", "merge_engine", "merge", "--local_dir", str(checkpoint),
                           "--target_dir", str(tmp_path / "t")], capture_output=True, text=True)
    assert proc.returncode == 3
    assert proc.stderr.strip().startswith("stepmerge: error: IncompleteCheckpoint")
    assert "Traceback" not in proc.stderr


def test_discover_lists_steps_with_status(fsdp_runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(fsdp_runs[VARIANT].root, run)
    (run / "global_step_1" / "actor" / "model_world_size_4_rank_3.pt").unlink()
    shutil.copytree(fsdp_runs[VARIANT].root + "/global_step_1", run / "global_step_2")
    assert main(["discover", "--run-root", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 checkpoint(s)")
    assert "incomplete" in next(line for line in lines if "step      1" in line)
    assert " complete " in next(line for line in lines if "step      2" in line)


def test_an_os_error_is_one_line_too(checkpoint, tmp_path, capsys):
    """A target path under a regular file: the OS refuses; the user gets one line, not a traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert _merge(checkpoint, blocker / "out") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(("stepmerge: error: FileExistsError",
                                                                "stepmerge: error: NotADirectoryError"))
    assert str(blocker) in errors[0]


def _persistent_faults():
    from tests.fault_proxy import Fault, http_response

    forever = 10**6
    return {
        "refused": Fault.refuse(connections=forever),
        "reset": Fault.reset(after_bytes=0, connections=forever),
        "disconnect before a response": Fault.respond(b"", connections=forever),
        "503 unavailable": Fault.respond(http_response(503, "Service Unavailable", b"<Error><Code>SlowDown</Code>"
                                                       b"</Error>", "application/xml"), connections=forever),
    }


@pytest.mark.parametrize("fault", list(_persistent_faults()))
def test_persistent_storage_faults_are_one_named_line(fault, s3_bucket_url, s3_fault_proxy, monkeypatch, capsys):
    """Issue 9 case 11: an object store that stays down past every retry used to let raw aiohttp /
    botocore exceptions escape ``main`` as tracebacks. Now: one line naming `StorageUnavailable` and
    the URL, exit 1 (the machine's fault, not the input's); the error stays transient, so a pipeline
    task retries it."""
    from merge_engine import storage
    from merge_engine.errors import StorageUnavailable

    import s3fs

    monkeypatch.setattr(storage.tuning, "TRANSIENT_ATTEMPTS", 2)
    monkeypatch.setattr(storage.tuning, "BACKOFF_BASE_S", 0.01)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # the libraries' own retries off: the test stays short
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"{s3_bucket_url}/actor"
    storage.write_bytes(f"{url}/model_world_size_1_rank_0.pt", os.urandom(300_000))
    storage.clear_filesystems()
    s3_fault_proxy.set_fault(_persistent_faults()[fault])
    code = main(["check", "--local_dir", url])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "stepmerge: error: StorageUnavailable" in err and s3_bucket_url in err
    assert len(err.strip().splitlines()) == 1, err
    assert storage.is_transient(StorageUnavailable("x", url))


def test_hostile_metadata_file_names_are_never_copied(checkpoint, tmp_path, capsys):
    """Extra files of ``huggingface/`` are copied beside the merged weights; a name holding a newline or the
    right-to-left override (U+202E, which shows ``evil\\u202ejson.exe`` as ``evilexe.json``) was copied into the
    output too. Now each is skipped with one bounded note line (the merge's notes); the plain ones are still
    copied."""
    hostile = ["notes\nconfig.json", "evil\u202enosj.exe", "x" * 200 + "\u202e" + "y" * 50]
    for name in [*hostile, "chat_template.jinja"]:
        (checkpoint / "huggingface" / name).write_text("{}")
    target = tmp_path / "target"
    assert _merge(checkpoint, target) == 0
    written = set(os.listdir(target))
    assert "chat_template.jinja" in written and not written & set(hostile)
    assert all(name.isprintable() for name in written)
    err = capsys.readouterr().err
    assert "\u202e" not in err
    notes = [line for line in err.splitlines() if line.startswith("  note: not copied: the file name ")]
    assert len(notes) == len(hostile)
    assert all(len(note) < 200 for note in notes)
    assert "'notes\\nconfig.json'" in err  # the newline shown escaped, in the one line
