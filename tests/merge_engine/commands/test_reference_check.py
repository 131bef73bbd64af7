"""verl's ``test`` runs `merge`'s own preparation (issue 18 point 6): what ``merge`` refuses, ``test`` refuses.

- a checkpoint whose ``config.json`` contradicts its tensors (``intermediate_size`` one more than the MLP's
  rows): ``merge`` exits with `InvalidConfig` naming the config file and writes nothing; ``test`` against
  the true reference exits the same way (it used to plan the merge itself, skip that check, and pass);
- the same checkpoint with its config intact passes ``test`` against that reference.
"""

from __future__ import annotations

import json
import shutil

from merge_engine.cli import main as stepmerge

VARIANT = "fsdp2_qwen2"


def test_test_refuses_what_merge_refuses(fsdp_runs, tmp_path, capsys):
    run = fsdp_runs[VARIANT].latest
    reference = run.reference_hf_dir
    checkpoint = tmp_path / "actor"
    shutil.copytree(run.checkpoint_dir, checkpoint)
    assert stepmerge(["test", "--local_dir", str(checkpoint), "--test_hf_dir", reference]) == 0
    capsys.readouterr()

    config_file = checkpoint / "huggingface" / "config.json"
    config = json.loads(config_file.read_text())
    config["intermediate_size"] += 1
    config_file.write_text(json.dumps(config))

    assert stepmerge(["merge", "--local_dir", str(checkpoint), "--target_dir", str(tmp_path / "out")]) != 0
    merge_error = capsys.readouterr().err
    assert "InvalidConfig" in merge_error and str(config_file) in merge_error
    assert not (tmp_path / "out").exists()

    assert stepmerge(["test", "--local_dir", str(checkpoint), "--test_hf_dir", reference]) != 0
    test_error = capsys.readouterr().err
    assert "InvalidConfig" in test_error and str(config_file) in test_error
