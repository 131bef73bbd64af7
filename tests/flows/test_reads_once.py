"""Metadata is read once: a checked checkpoint carries its parsed tensor index (issue 18 point 5).

Counted on the session's SeaweedFS server as the S3 client sends them: every ranged GET the S3 backend
makes (`S3Backend.read_range`: one call is one GET on the wire) is logged as (URL, start, end). A rank
file's pickle (its zip record ``data.pkl``, located in the file written locally) counts as fetched n
times when n times its size of its bytes were fetched. The step is verl's legacy Megatron layout
(``model/mp_rank_0T/model.pt``, TP 2) of the session's ``megatron_runs``, copied to a fresh bucket.

- a first merge_step run (discover, check, merge, validate, publish) fetches each rank file's pickle
  exactly once: the check parses it, the LoRA verdict and the merge's source come from what the check
  carried (main before this: 3 fetches, rank 0's 6: the check parsed it twice);
- a re-run, all cache hits, fetches no byte of any checkpoint file;
- ``stepmerge merge`` from s3:// fetches each pickle once (before: 2, rank 0's 4).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import MergeStepParams, WatchParams
from merge_engine import storage
from merge_engine.cli import main as stepmerge
from merge_engine.release.verify import verify_folder
from tests.pickle_reads import pickle_fetches, pickle_range
from tests.release_checks import assert_release_of_megatron_job

STEP = "qwen2_tp2_pp1_tied_legacy"



@pytest.fixture
def s3_megatron_run(megatron_runs, s3_bucket_url) -> tuple[str, dict[str, tuple[int, int]]]:
    """(run root URL, rank file URL -> its pickle's byte range): the legacy step copied to a fresh bucket."""
    step_dir = Path(megatron_runs[STEP].step_dir)
    run_root = f"{s3_bucket_url}/run"
    ranks = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        url = storage.join(run_root, path.relative_to(step_dir.parent).as_posix())
        storage.copy_file(str(path), url)
        if path.name == "model.pt":
            ranks[url] = pickle_range(path)
    assert len(ranks) == 2  # TP 2
    return run_root, ranks


def fetches(gets: list[tuple[str, int, int]], ranks: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Rank folder -> how many times its rank file's pickle was fetched."""
    return {url.rsplit("/", 2)[-2]: pickle_fetches(gets, url, span) for url, span in ranks.items()}


def test_a_first_pipeline_run_fetches_each_rank_pickle_once_and_a_cache_hit_none(
        prefect, s3_megatron_run, s3_gets, tmp_path, megatron_runs):
    run_root, ranks = s3_megatron_run
    params = MergeStepParams(run_root=run_root, step=1, release_root=str(tmp_path / "releases"),
                             staging_root=str(tmp_path / "staging")).flow_parameters()
    first = merge_step(**params)
    assert first.status == "published" and verify_folder(first.releases[0].url).ok
    assert fetches(s3_gets, ranks) == {"mp_rank_00": 1.0, "mp_rank_01": 1.0}
    assert_release_of_megatron_job(first.releases[0].url, megatron_runs[STEP])  # judged from outside stepmerge

    s3_gets.clear()
    again = merge_step(**params)
    assert again.cached and again.status == "already_published"
    checkpoint = storage.join(run_root, "global_step_1/actor/")
    assert [g for g in s3_gets if g[0].startswith(checkpoint)] == []  # not one byte of the checkpoint


def test_a_cli_merge_fetches_each_rank_pickle_once(s3_megatron_run, s3_gets, tmp_path):
    run_root, ranks = s3_megatron_run
    source = storage.join(run_root, "global_step_1/actor")
    assert stepmerge(["merge", "--backend", "megatron", "--local_dir", source,
                      "--target_dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").exists()
    assert fetches(s3_gets, ranks) == {"mp_rank_00": 1.0, "mp_rank_01": 1.0}


# --- every layout: each metadata file of the step read once per merge_step run ------------------------------
#
# Counted on local copies (every whole read or ranged reader the local backend opens, by URL), one merge_step
# run per layout, from discovery to publish: each file a layout's check reads to know the step (markers, indexes,
# parallel and run configs: `METADATA_FILES`) is read exactly once (main before this: ``fsdp_config.json``
# twice, a dist/LoRA step's ``ckpt_contents.json`` twice and its ``.metadata`` up to three times, absent run
# metadata probed twice), and so is each weight file's header (a safetensors file's JSON: twice, a bridge
# export's three times). A PEFT export, which no check reads, is read by the job of each output that uses it
# (model and adapter: once each). Each output's build computes its fingerprint once and turns the checked record
# into the engine's checkpoint once (main before this: twice each).

METADATA_FILES = (".metadata", "metadata.json", "ckpt_contents.json", "transformer_config.json", "fsdp_config.json",
                  "lora_train_meta.json", "model.safetensors.index.json", "adapter_config.json")
# the PEFT export (no check reads it): read by the job of each output that uses it, once
PER_OUTPUT = {"model/huggingface/adapter/adapter_config.json", "model/huggingface/adapter/adapter_model.safetensors"}


@pytest.fixture
def file_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URL of every local file read from now on, once per whole read or ranged reader opened."""
    from merge_engine.storage.backends.local import LocalBackend

    log: list[str] = []
    read_bytes, open_range = LocalBackend.read_bytes, LocalBackend.open_range

    def logged_read_bytes(self, url):
        log.append(url)
        return read_bytes(self, url)

    def logged_open_range(self, url, size, version=None):
        log.append(url)
        return open_range(self, url, size, version)

    monkeypatch.setattr(LocalBackend, "read_bytes", logged_read_bytes)
    monkeypatch.setattr(LocalBackend, "open_range", logged_open_range)
    return log


@pytest.fixture
def ranged_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every ranged read from now on, as (URL, start, end): the bytes the engine asked for."""
    log: list[tuple[str, int, int]] = []
    original = storage.RangeReader.read_into

    def read_into(self, offset, buffer):
        log.append((self.url, offset, offset + memoryview(buffer).nbytes))
        return original(self, offset, buffer)

    monkeypatch.setattr(storage.RangeReader, "read_into", read_into)
    return log


def header_range(path: Path) -> tuple[int, int] | None:
    """Byte range of a weight file's header: a safetensors file's (length and JSON), a ``torch.save`` file's
    pickle; None for other files."""
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            return 0, 8 + struct.unpack("<Q", f.read(8))[0]
    if path.suffix == ".pt" and zipfile.is_zipfile(path):
        return pickle_range(path)
    return None


def header_reads(log: list[tuple[str, int, int]], step_dir: str) -> dict[str, float]:
    """Path inside the step -> how many times its header was fetched, for each weight file fetched at all."""
    counts = {}
    for path in sorted(p for p in Path(step_dir).rglob("*") if p.is_file()):
        span = header_range(path)
        fetched = pickle_fetches(log, str(path), span) if span else 0
        if fetched:
            counts[path.relative_to(step_dir).as_posix()] = fetched
    return counts


def metadata_reads(log: list[str], step_dir: str) -> dict[str, int]:
    """Path inside the step -> how many times it was read, for its metadata files."""
    counts: dict[str, int] = {}
    for url in log:
        path = url[len(step_dir.rstrip("/")) + 1:] if url.startswith(step_dir.rstrip("/") + "/") else None
        if path is not None and path.rsplit("/", 1)[-1] in METADATA_FILES:
            counts[path] = counts.get(path, 0) + 1
    return counts


def _copied_run(step_dir: Path, tmp_path: Path) -> tuple[str, str]:
    """(run root, step folder) of a copy of the run ``step_dir`` (``.../global_step_1[/actor]``) belongs to."""
    step = step_dir if step_dir.name.startswith("global_step_") else step_dir.parent
    run_root = tmp_path / "run"
    shutil.copytree(step, run_root / step.name)
    return str(run_root), str(run_root / step.name)


EVERY_LAYOUT = {  # case -> (fixture, name, extra merge_step parameters)
    "fsdp1": ("fsdp_runs", "fsdp1_mesh_qwen2", {}),
    "fsdp2_dtensor": ("fsdp_runs", "fsdp2_qwen2", {}),
    "megatron_legacy": ("megatron_runs", STEP, {}),
    "megatron_dist_v1": ("megatron_runs", "llama_tp1_pp1_dist_v1", {}),
    "megatron_dist_v2": ("megatron_runs", "mistral_tp2_pp2_tied_dist_v2", {}),
    "megatron_bridge": ("megatron_runs", "qwen2_tp2_pp2_bridge_v2", {}),
    "megatron_lora": ("lora_steps", "dense_tp2", {"base_model": True}),
    "megatron_lora_dist": ("lora_steps", "dense_tp2_dist", {"lora_alpha": 8.0, "hf_model_path": True}),
    "hf": ("lora_steps", "hf_base", {}),
}


def _step_dir(request, fixture: str, name: str) -> tuple[Path, object]:
    runs = request.getfixturevalue(fixture)
    if fixture == "fsdp_runs":
        return Path(runs[name].latest.checkpoint_dir), runs[name]
    if fixture == "lora_steps" and name == "hf_base":
        return Path(runs["dense_tp2"].base_dir), runs["dense_tp2"]
    return Path(runs[name].step_dir), runs[name]


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times, from now on, a build fingerprint is computed (`merge_fingerprint`, `extract_fingerprint`),
    a checkpoint record becomes the engine's checkpoint (`CheckpointRecord.to_checkpoint`), and the trained-model
    check (which converts it too) runs."""
    import merge_engine.commands.extract as extract
    import merge_engine.commands.merge as merge
    import tasks.validate
    from tasks.records import CheckpointRecord

    counts = {"fingerprint": 0, "to_checkpoint": 0, "trained_check": 0}

    def counted(key, function):
        def call(*args, **kwargs):
            counts[key] += 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(merge, "merge_fingerprint", counted("fingerprint", merge.merge_fingerprint))
    monkeypatch.setattr(extract, "extract_fingerprint", counted("fingerprint", extract.extract_fingerprint))
    monkeypatch.setattr(CheckpointRecord, "to_checkpoint", counted("to_checkpoint", CheckpointRecord.to_checkpoint))
    monkeypatch.setattr(tasks.validate, "check_against_trained",
                        counted("trained_check", tasks.validate.check_against_trained))
    return counts


@pytest.mark.parametrize("case", list(EVERY_LAYOUT))
def test_a_cached_check_of_every_layout_is_checked_again_to_the_same_facts(request, case):
    """A check record as the result store gives it back (no tensor index) is checked again by a build
    (`tasks.checked.checked_checkpoint`): for every layout the files give the very facts the check recorded, and the
    index to open it by; a record is never refused for being a cached one."""
    from merge_engine.layouts import check_checkpoint
    from tasks.checked import checked_checkpoint
    from tasks.records import CheckpointRecord, StepRecord
    from tasks.result_records import RECORD_SERIALIZER

    fixture, name, _ = EVERY_LAYOUT[case]
    step_dir, _ = _step_dir(request, fixture, name)
    folder = step_dir / "actor" if (step_dir / "actor").is_dir() else step_dir  # the role's, as the check sees it
    checked = CheckpointRecord.from_checkpoint(check_checkpoint(str(folder)))
    cached = RECORD_SERIALIZER.loads(RECORD_SERIALIZER.dumps(checked))
    assert checked.index is not None and cached.index is None
    step = StepRecord(run_root=str(folder.parent), step=1, role=folder.name, url=str(folder), status="complete",
                      layout=checked.layout, fingerprint=checked.fingerprint)
    again = checked_checkpoint(cached, step)
    assert CheckpointRecord.from_checkpoint(again) == checked


@pytest.mark.parametrize("case", list(EVERY_LAYOUT))
def test_a_merge_step_run_reads_each_metadata_file_of_every_layout_once(prefect, request, file_reads, ranged_reads,
                                                                        conversions, tmp_path, case):
    fixture, name, extra = EVERY_LAYOUT[case]
    step_dir, run = _step_dir(request, fixture, name)
    if case == "hf":  # a step holding a Hugging Face folder (``global_step_1/``: the SFT trainers' layout)
        shutil.copytree(step_dir, tmp_path / "run" / "global_step_1")
        run_root, folder = str(tmp_path / "run"), str(tmp_path / "run" / "global_step_1")
        extra = {**extra, "role": ""}
    else:
        run_root, folder = _copied_run(step_dir, tmp_path)
    given = {k: (str(run.base_dir) if v is True else v) for k, v in extra.items()}
    params = MergeStepParams(run_root=run_root, step=1, release_root=str(tmp_path / "releases"),
                             staging_root=str(tmp_path / "staging"), **given).flow_parameters()
    file_reads.clear()
    ranged_reads.clear()
    conversions.update(dict.fromkeys(conversions, 0))
    outcome = merge_step(**params)
    assert outcome.status == "published"
    counts = metadata_reads(file_reads, folder)
    headers = header_reads(ranged_reads, folder)  # the weight files' headers: safetensors JSON, torch pickles
    assert counts or headers, "nothing of the step was counted: the test would count nothing"
    outputs = len(outcome.releases)
    assert counts == {path: outputs if path.split("/", 1)[-1] in PER_OUTPUT else 1 for path in counts}
    assert headers == {path: float(outputs) if path.split("/", 1)[-1] in PER_OUTPUT else 1.0 for path in headers}
    # each output's build fingerprints once and converts the checked record once (before: twice and twice); the
    # trained-model check of a LoRA checkpoint converts it once more: each task takes records and turns the one it
    # hands the engine into the engine's checkpoint itself (a conversion reads nothing: fields copied, the carried
    # index shared), so one conversion per run would be a memo outside the records, shared by tasks
    assert conversions["fingerprint"] == outputs
    assert conversions["to_checkpoint"] == outputs + conversions["trained_check"]


@pytest.mark.parametrize("case", ["megatron_lora", "megatron_lora_dist"])
def test_a_run_whose_check_is_cached_but_not_its_outputs_checks_the_step_again_once(prefect, request, file_reads,
                                                                                     ranged_reads, tmp_path, case):
    """A LoRA step released, its two releases then deleted: the next run's check is served from the cache (no
    tensor index), both outputs are built again, and the step's metadata and headers are still read once: the
    first task that needs the checkpoint checks it again, the other build and the trained-model checks take that
    check (`tasks.checked`; main before this: once per build, twice)."""
    fixture, name, extra = EVERY_LAYOUT[case]
    step_dir, run = _step_dir(request, fixture, name)
    run_root, folder = _copied_run(step_dir, tmp_path)
    given = {k: (str(run.base_dir) if v is True else v) for k, v in extra.items()}
    params = MergeStepParams(run_root=run_root, step=1, release_root=str(tmp_path / "releases"),
                             staging_root=str(tmp_path / "staging"), **given).flow_parameters()
    first = merge_step(**params)
    assert first.status == "published" and len(first.releases) == 2  # the model and its adapter
    for release in first.releases:
        shutil.rmtree(release.url)
    file_reads.clear()
    ranged_reads.clear()
    records = {p for p in prefect.results.iterdir() if p.is_file()}
    again = merge_step(**params)
    states = {stage.name: stage.state for stage in again.stages}
    assert states["check"] == "Cached" and states["merge"] == states["extract-adapter"] == "Completed", states
    assert states["model-release"] == states["adapter-release"] == "Completed", states
    # one result record per output: its chain's (`flows.stages.ReleasedOutput`); no stage of it keeps one
    written = sorted(p.name.split("-")[1] for p in set(prefect.results.iterdir()) - records
                     if p.name.startswith("stepmerge-"))
    assert written == ["release", "release"], written
    assert again.status == "published" and len(again.releases) == 2
    counts = metadata_reads(file_reads, folder)
    headers = header_reads(ranged_reads, folder)
    assert counts or headers, "nothing of the step was counted: the test would count nothing"
    assert counts == {path: 2 if path.split("/", 1)[-1] in PER_OUTPUT else 1 for path in counts}
    assert headers == {path: 2.0 if path.split("/", 1)[-1] in PER_OUTPUT else 1.0 for path in headers}


@pytest.mark.parametrize("case", ["megatron_lora", "megatron_lora_dist"])
def test_a_merge_step_run_lists_an_input_folder_once_per_build_and_reads_its_config_once(
        prefect, request, file_reads, tmp_path, monkeypatch, case):
    """The folder a LoRA step's builds read besides the step (``base_model``; ``hf_model_path`` for a step saving no
    config) is listed once per build, by the output chain's cache key (its content is part of the key), whose
    listing the job then reads by (the chain task's ``folders``, `tasks.cache`); its config.json is read once per
    build (before: listed twice per build, by the key and by the job; before issue 27's input folders a step's two
    builds listed it 7 times, or 6, and read its config 3 times)."""
    from merge_engine.storage.backends.local import LocalBackend

    fixture, name, extra = EVERY_LAYOUT[case]
    step_dir, run = _step_dir(request, fixture, name)
    run_root, _ = _copied_run(step_dir, tmp_path)
    folder = str(tmp_path / "input")
    shutil.copytree(run.base_dir, folder)
    given = {k: (folder if v is True else v) for k, v in extra.items()}
    listings: list[str] = []
    list_files = LocalBackend.list_files
    monkeypatch.setattr(LocalBackend, "list_files",
                        lambda self, url, recursive: listings.append(url.rstrip("/")) or list_files(self, url, recursive))
    params = MergeStepParams(run_root=run_root, step=1, release_root=str(tmp_path / "releases"),
                             staging_root=str(tmp_path / "staging"), **given).flow_parameters()
    file_reads.clear()
    outcome = merge_step(**params)
    assert outcome.status == "published" and len(outcome.releases) == 2  # two builds: the model, the adapter
    assert listings.count(folder) == 2
    assert file_reads.count(storage.join(folder, "config.json")) == 2


# --- an adapter extraction: the run's LoRA metadata read once per job ----------------------------------------


def test_an_extract_job_reads_the_runs_lora_metadata_once(file_reads, conversions, fsdp_runs, tmp_path):
    """An adapter extraction (`ExtractJob`: the fingerprint, then prepare and write) reads the run's LoRA
    metadata (``lora_train_meta.json``) once: the fingerprint keys on it and prepare resolves alpha and ranks
    from what the job kept (main before this: twice), like every other metadata file of the checkpoint."""
    from merge_engine.commands.extract import ExtractJob
    from merge_engine.output.jobs import OutputOptions, run_job

    source = str(fsdp_runs["lora_fsdp1_mesh_qwen2"].latest.checkpoint_dir)
    file_reads.clear()
    conversions.update(dict.fromkeys(conversions, 0))
    result = run_job(ExtractJob(source, str(tmp_path / "adapter"), OutputOptions()))
    assert result.kind.startswith("adapter") and (tmp_path / "adapter" / "adapter_config.json").exists()
    counts = metadata_reads(file_reads, source)
    assert "lora_train_meta.json" in counts, "the run's LoRA metadata was not counted: the test would count nothing"
    assert counts == dict.fromkeys(counts, 1)
    assert conversions["fingerprint"] == 1


# --- the watcher: a LoRA step's marker, read by discovery's second look AND by the check --------------------
#
# The watcher lists the run root and reads a complete dist step's ``ckpt_contents.json`` (`Layout.second_look`) to
# know whether it is a LoRA step and what its merge needs (`StepRecord.needs`: a step missing them is not
# submitted). The merge is another flow run (merge_step: a subflow here, a deployment's run on another pool
# there), given flow parameters only; it lists the step again and its check reads the marker again. That second
# read stays: the check is what the merge trusts, and a copy carried from discovery could be matched to the file
# by its listed size and version only, which do not identify content (a local file's version is mtime_ns-inode:
# a rewrite within one tick of the file system's timestamps keeps it), and it would arrive through a flow
# parameter or a result store that whoever can write them may forge.

LORA_STEP = "dense_tp2"


def _watched_lora_run(lora_steps, tmp_path) -> tuple[WatchParams, str]:
    """(watcher parameters with the base model, the copied step's folder) of the LoRA step ``LORA_STEP``."""
    step = lora_steps[LORA_STEP]
    shutil.copytree(step.step_dir.parent.parent, tmp_path / "run")
    params = WatchParams(run_root=str(tmp_path / "run"), release_root=str(tmp_path / "releases"),
                         staging_root=str(tmp_path / "staging"), base_model=str(step.base_dir))
    return params, str(tmp_path / "run" / "global_step_1" / "actor")


def test_a_watcher_run_reads_a_lora_steps_marker_twice_discovery_then_the_check(prefect, lora_steps, file_reads,
                                                                                tmp_path):
    params, folder = _watched_lora_run(lora_steps, tmp_path)
    file_reads.clear()
    (outcome,) = merge_new_steps(**params.flow_parameters()).outcomes
    assert outcome.status == "published"
    counts = metadata_reads(file_reads, folder)
    outputs = len(outcome.releases)
    assert counts.pop("ckpt_contents.json") == 2  # the watcher's second look, the merge's check
    assert counts == {path: outputs if path in PER_OUTPUT else 1 for path in counts}


def test_a_watcher_tick_reads_no_marker_of_a_step_released_from_its_listing(prefect, lora_steps, file_reads, tmp_path):
    """Once a LoRA step's releases are published from its listing, later ticks read its marker no more (the
    second look spares a settled step); rewritten, it is looked at again and reported changed."""
    params, folder = _watched_lora_run(lora_steps, tmp_path)
    (first,) = merge_new_steps(**params.flow_parameters()).outcomes
    assert first.status == "published" and len(first.releases) == 2  # the model and its adapter
    file_reads.clear()
    again = merge_new_steps(**params.flow_parameters())
    assert again.actions == [] and again.published_before == 1
    assert metadata_reads(file_reads, folder) == {}

    (Path(folder) / "extra.txt").write_text("written after the release")
    file_reads.clear()
    changed = merge_new_steps(**params.flow_parameters())
    assert changed.steps_with("changed since release") == [1]
    assert metadata_reads(file_reads, folder) == {"ckpt_contents.json": 1}


def test_a_marker_rewritten_after_the_watchers_discovery_is_caught_by_the_check(prefect, lora_steps, tmp_path,
                                                                                 monkeypatch):
    """The marker rewritten in place between the watcher's discovery and the merge's check, same size, its
    listed version unchanged (mtime restored: a rewrite within one timestamp tick): the check reads what the
    file says now and refuses the step; a copy carried from discovery would have matched the listing and been
    trusted."""
    from merge_engine.layouts import discovery

    params, folder = _watched_lora_run(lora_steps, tmp_path)
    marker = Path(folder) / "ckpt_contents.json"
    size = marker.stat().st_size
    rewritten = json.dumps({"contents": {"model": {"format": "huggingface", "path": "model/huggingface"}}})
    assert len(rewritten) <= size
    looked = discovery.second_looks
    listed: list = []

    def second_looks_then_rewrite(steps, look_at=None):
        out = looked(steps, look_at)
        listed.append(storage.list_files(folder, recursive=False))
        stat = marker.stat()
        with open(marker, "r+b") as f:  # in place: the same inode
            f.write(rewritten.ljust(size).encode())
        os.utime(marker, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        listed.append(storage.list_files(folder, recursive=False))
        return out

    monkeypatch.setattr(discovery, "second_looks", second_looks_then_rewrite)
    with pytest.raises(RuntimeError, match="UnsupportedLayout.*huggingface"):
        merge_new_steps(**params.flow_parameters())
    assert listed[0] == listed[1]  # the listing cannot tell: names, sizes and versions as discovery saw them
    assert not storage.list_files(params.release_root_url, recursive=True)
