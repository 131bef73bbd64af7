"""DeepSpeed ZeRO checkpoints saved by DeepSpeed itself (the session's ``zero_runs``: ZeRO-1 and ZeRO-2 in bf16
inside HF Trainer's ``checkpoint-1/``, ZeRO-3 in fp32 as a bare engine's ``global_step1/``, 2 ranks over gloo).

- the merge is the fp32 master weights the run was built from, bit for bit, and transformers gives the model's
  own logits from it; ZeRO-2's bf16 ``model.safetensors`` beside HF Trainer's tag folder is not what is read;
- the listing tells a step still being written (a rank's optim file missing or empty) from a complete one, and
  the check finds a missing last rank from the world size DeepSpeed records;
- what cannot be read is refused by name (the layout's, in one line): tensor/pipeline parallel ranks, an optim file
  without a ZeRO stage, frozen parameters at stage 3; a truncated file is `CorruptShard`; DeepSpeed's pickles read
  with the allow-list only;
- discovery names what a step saved without a config needs: ``hf_model_path`` (a bare engine), ``base_model`` (HF
  Trainer's adapter-only save of a PEFT model).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from merge_engine.cli import main
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout
from merge_engine.layouts import check_checkpoint, deepspeed_zero, listing_verdicts
from merge_engine.layouts.discovery import discover, steps_from_listing
from merge_engine.storage import FileEntry, list_files
from tests.release_checks import assert_release_of_step

RUNS = ("zero1_bf16", "zero2_bf16", "zero3_fp32")


def _merge_args(run, target) -> list[str]:
    args = ["merge", "--local_dir", run.step_dir(1), "--target_dir", str(target)]
    if run.spec.trainer == "deepspeed":  # a bare engine saves no config: the model's own is given
        args += ["--hf_model_path", run.hf_config_dir]
    return args


@pytest.mark.parametrize("name", RUNS)
def test_merge_is_the_fp32_masters_bit_for_bit_with_the_models_logits(zero_runs, tmp_path, name, capsys):
    run = zero_runs[name]
    target = tmp_path / "out"
    assert main(_merge_args(run, target)) == 0
    assert "deepspeed_zero" in capsys.readouterr().out
    assert_release_of_step(str(target), run, 1)  # names, dtypes (fp32) and values; transformers' logits, exactly


HF_TRAINERS_FILES = {"latest": "DeepSpeed", "zero_to_fp32.py": "DeepSpeed", "zero_to_torch.py": "DeepSpeed",
                     "trainer_state.json": "HF Trainer"}  # what DeepSpeed and HF Trainer leave in checkpoint-N/


@pytest.mark.parametrize("name", ["zero1_bf16", "zero2_bf16"])
def test_a_release_of_hf_trainers_step_carries_the_models_files_and_none_of_the_trainers(zero_runs, tmp_path, name,
                                                                                         capsys, caplog):
    """HF Trainer's ``checkpoint-N/`` is the folder of the model's config and of the trainers' bookkeeping:
    DeepSpeed's ``latest`` and the ``zero_to_fp32.py`` / ``zero_to_torch.py`` it drops there (Python code), HF
    Trainer's ``trainer_state.json``. The release carries the tokenizer, chat template and generation config, and
    none of those; each left out is a note of the merge (which file, whose), printed as the merge's other notes
    are, not a warning."""
    run = zero_runs[name]
    step = set(os.listdir(run.step_dir(1)))
    models = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
    assert set(HF_TRAINERS_FILES) | models <= step  # what DeepSpeed and HF Trainer wrote there
    target = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        assert main(_merge_args(run, target)) == 0
    assert set(os.listdir(target)) == models | {"config.json", "model.safetensors", "stepmerge.json"}
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  note: not copied: ")]
    for file, trainer in HF_TRAINERS_FILES.items():
        (note,) = [n for n in notes if n.startswith(f"  note: not copied: {file!r}, ")]
        assert trainer in note
    assert len(notes) == len(HF_TRAINERS_FILES)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "not copied" in r.getMessage()]


def test_the_trainers_files_left_out_are_the_merges_notes_not_warnings(zero_runs, tmp_path, caplog):
    """`merge_checkpoint`'s result (what the flows record of a release) holds one note per file of HF Trainer's
    step folder it left out, naming it and whose it is; nothing is logged at WARNING for them."""
    run = zero_runs["zero2_bf16"]
    with caplog.at_level(logging.INFO):
        result = merge_checkpoint(run.step_dir(1), str(tmp_path / "out"))
    left_out = [note for note in result.notes if note.startswith("not copied: ")]
    assert len(left_out) == len(HF_TRAINERS_FILES), result.notes
    for file, trainer in HF_TRAINERS_FILES.items():
        (note,) = [n for n in left_out if n.startswith(f"not copied: {file!r}, ")]
        assert f"{trainer}'s bookkeeping" in note
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if any(file in m for file in HF_TRAINERS_FILES)], warned


@pytest.mark.parametrize("name", RUNS)
def test_check_reports_stage_and_ranks(zero_runs, name):
    run = zero_runs[name]
    checkpoint = check_checkpoint(run.step_dir(1))
    assert checkpoint.layout == deepspeed_zero.NAME
    assert checkpoint.parallel == {"world_size": 2, "zero_stage": run.spec.stage}
    assert (checkpoint.hf_dir is not None) == (run.spec.trainer == "hf_trainer")


def test_hf_trainers_checkpoint_folder_is_discovered_as_deepspeed_not_as_its_bf16_copy(zero_runs):
    run = zero_runs["zero2_bf16"]
    assert os.path.exists(os.path.join(run.step_dir(1), "model.safetensors"))  # HF Trainer's bf16 save beside
    entries = list_files(run.root, recursive=True)
    (step,) = steps_from_listing(run.root, entries)
    assert (step.step, step.role, step.status, step.layout) == (1, "", "complete", deepspeed_zero.NAME)
    assert step.url.endswith("/checkpoint-1")
    (bare,) = steps_from_listing(zero_runs["zero3_fp32"].root, list_files(zero_runs["zero3_fp32"].root, recursive=True))
    assert (bare.step, bare.status, bare.layout) == (1, "complete", deepspeed_zero.NAME)
    assert bare.url.endswith("/global_step1")
    # a bare engine saves no config: discovery says which merge parameter the step needs; HF Trainer's needs none
    assert [s.needs for s in discover(zero_runs["zero3_fp32"].root).steps] == [("hf_model_path",)]
    assert [s.needs for s in discover(run.root).steps] == [()]


def _copy(run, tmp_path):
    target = tmp_path / "step"
    shutil.copytree(run.step_dir(1), target)
    return target


def _tag(run, folder):
    return folder / "global_step1" if run.spec.trainer == "hf_trainer" else folder


@pytest.mark.parametrize("name", RUNS)
def test_a_rank_still_writing_is_incomplete_never_complete(zero_runs, tmp_path, name):
    run = zero_runs[name]
    folder = _copy(run, tmp_path)
    optim = sorted(_tag(run, folder).glob("*rank_1_mp_rank_00_optim_states.pt"))[0]
    optim.write_bytes(b"")  # rank 1 has opened its file, nothing written yet
    (verdict,) = [v for n, v in listing_verdicts(list_files(str(folder), recursive=True)) if n == deepspeed_zero.NAME]
    assert verdict.status == "incomplete" and "empty" in verdict.reason
    optim.unlink()  # not even opened: ranks 0..0 look whole by name; the check reads the 2 ranks DeepSpeed records
    with pytest.raises(IncompleteCheckpoint, match=r"optim files? of ranks? \[?1"):
        check_checkpoint(str(folder))
    assert main(["check", "--local_dir", str(folder)]) == 3


def test_a_missing_middle_rank_is_incomplete_from_the_listing():
    files = [FileEntry("zero_pp_rank_0_mp_rank_00_model_states.pt", 10, "v"),
             FileEntry("zero_pp_rank_2_mp_rank_00_model_states.pt", 10, "v"),
             FileEntry("zero_pp_rank_0_mp_rank_00_optim_states.pt", 10, "v"),
             FileEntry("zero_pp_rank_1_mp_rank_00_optim_states.pt", 10, "v"),
             FileEntry("zero_pp_rank_2_mp_rank_00_optim_states.pt", 10, "v")]
    verdict = deepspeed_zero.listing_verdict(files)
    assert verdict.status == "incomplete" and "model files of ranks [1]" in verdict.reason
    assert deepspeed_zero.listing_verdict(files + [FileEntry("zero_pp_rank_1_mp_rank_00_model_states.pt", 9, "v")]
                                          ).complete


def test_what_a_step_saved_without_a_config_needs_is_named_by_what_it_holds():
    """A bare engine's step holds the whole model: its merge needs a config (``hf_model_path``). HF Trainer's save of
    a PEFT model (PEFT's adapter files beside the tag, no config.json) holds the adapter only: it needs the base the
    run trained from (``base_model``), whose config serves too; naming hf_model_path would send the user the wrong
    way."""
    tag = [FileEntry("global_step1/mp_rank_00_model_states.pt", 10, "v"),
           FileEntry("global_step1/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", 10, "v"),
           FileEntry("global_step1/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 10, "v")]
    bare = deepspeed_zero.second_look("/run/checkpoint-1", tag)
    assert bare is not None and bare.needs == ("hf_model_path",)
    peft = deepspeed_zero.second_look("/run/checkpoint-1", tag + [FileEntry("adapter_config.json", 5, "v"),
                                                                  FileEntry("adapter_model.safetensors", 9, "v")])
    assert peft is not None and peft.verdict.complete and peft.needs == ("base_model",)
    assert "--base-model" in peft.verdict.reason and "hf_model_path" not in peft.verdict.reason
    assert deepspeed_zero.second_look("/run/checkpoint-1", tag + [FileEntry("config.json", 5, "v")]) is None


def test_tensor_or_pipeline_parallel_zero_is_refused_by_name(zero_runs, tmp_path):
    run = zero_runs["zero2_bf16"]
    folder = _copy(run, tmp_path)
    tag = folder / "global_step1"
    shutil.copyfile(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    (verdict,) = [v for n, v in listing_verdicts(list_files(str(folder), recursive=True)) if n == deepspeed_zero.NAME]
    assert verdict.status == "invalid" and "mp_rank_01" in verdict.reason
    with pytest.raises(UnsupportedLayout, match="^deepspeed_zero: .*tensor, pipeline or expert parallelism"):
        check_checkpoint(str(folder))


def test_a_truncated_optim_file_is_corrupt(zero_runs, tmp_path):
    run = zero_runs["zero3_fp32"]
    folder = _copy(run, tmp_path)
    optim = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:-100])
    with pytest.raises(CorruptShard) as caught:
        check_checkpoint(str(folder))
    assert caught.value.path.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt")


def _rewrite_optim(path, change) -> None:
    """Rewrite an optim file with ``change`` applied to its optimizer state (torch.save of plain data only)."""
    tree = torch.load(path, weights_only=True)  # DeepSpeed's records: allow-listed for this read only
    change(tree["optimizer_state_dict"])
    torch.save(tree, path)


@pytest.fixture
def deepspeed_globals():
    from importlib import import_module

    classes = [getattr(import_module(module), name) for module, name in (
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"))]
    with torch.serialization.safe_globals(classes):
        yield


def test_an_optim_file_without_a_zero_stage_is_refused_by_name(zero_runs, tmp_path, deepspeed_globals):
    run = zero_runs["zero3_fp32"]
    folder = _copy(run, tmp_path)
    _rewrite_optim(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda state: state.pop("zero_stage"))
    with pytest.raises(UnsupportedLayout, match="^deepspeed_zero: .*without a ZeRO stage"):
        check_checkpoint(str(folder))


def test_frozen_parameters_are_refused_by_name(zero_runs, tmp_path, deepspeed_globals):
    run = zero_runs["zero3_fp32"]
    folder = _copy(run, tmp_path)
    model_file = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    tree = torch.load(model_file, weights_only=True)
    tree["frozen_param_shapes"] = {"model.embed_tokens.weight": torch.Size([3, 4])}
    torch.save(tree, model_file)
    with pytest.raises(UnsupportedLayout, match="^deepspeed_zero: .*frozen parameter"):
        check_checkpoint(str(folder))


def test_parameters_not_covering_the_partitions_are_corrupt(zero_runs, tmp_path, deepspeed_globals):
    run = zero_runs["zero3_fp32"]
    folder = _copy(run, tmp_path)
    for rank in (0, 1):
        _rewrite_optim(folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                       lambda state: state.update(fp32_flat_groups=[g[:-8] for g in state["fp32_flat_groups"]]))
    with pytest.raises(CorruptShard, match="fp32 elements"):
        check_checkpoint(str(folder))


def test_another_class_in_a_deepspeed_pickle_is_refused(zero_runs, tmp_path, deepspeed_globals):
    run = zero_runs["zero3_fp32"]
    folder = _copy(run, tmp_path)
    _rewrite_optim(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                   lambda state: state.update(loss_scaler=torch.nn.Identity()))
    with pytest.raises(CorruptShard, match="not on the allow-list"):
        check_checkpoint(str(folder))
