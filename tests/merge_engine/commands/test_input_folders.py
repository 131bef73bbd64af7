"""A job's input folders (``--base-model``, ``--hf_model_path``) are listed once per job, their config.json read
once, and read by that listing (`merge_engine.commands.input_folders`).

- a fused merge of an adapter-only Megatron LoRA step onto its base, and that step's adapter release with the base
  under ``base/``, each list the base folder once and read its config.json once (main before this: the merge
  listed it twice; the adapter release listed it three times and read its config twice); so do ``merge-lora``
  (the base and each adapter; before: 3 and 2 listings) and an SVD extraction (the base and the fine-tune; before:
  2 and 2);
- a base rewritten between the job's fingerprint and its reads fails the job (`SourceChanged`) instead of being
  released under the fingerprint of the files it replaced (main before this: published, from the new base); so
  does an adapter of ``merge-lora``;
- a folder's top-level digest is what a listing of that level alone gives, on a local disk and on S3: the
  fingerprints of releases built before are unchanged.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from safetensors.torch import load_file, save_file

from merge_engine import storage
from merge_engine.commands.combine import CombineJob
from merge_engine.commands.extract import ExtractJob, SvdExtractJob
from merge_engine.commands.input_folders import InputFolders
from merge_engine.commands.merge import MergeJob
from merge_engine.errors import SourceChanged
from merge_engine.output.jobs import OutputOptions, run_job
from merge_engine.storage.backends.local import LocalBackend


@pytest.fixture
def base_reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """From now on: ("list", URL) per listing and ("read", URL) per whole-file read, of local files."""
    counts: Counter = Counter()
    list_files, read_bytes = LocalBackend.list_files, LocalBackend.read_bytes

    def listed(self, url, recursive):
        counts["list", url.rstrip("/")] += 1
        return list_files(self, url, recursive)

    def read(self, url):
        counts["read", url] += 1
        return read_bytes(self, url)

    monkeypatch.setattr(LocalBackend, "list_files", listed)
    monkeypatch.setattr(LocalBackend, "read_bytes", read)
    return counts


@pytest.mark.parametrize("job", ["merge", "extract"])
def test_a_job_lists_its_base_once_and_reads_its_config_once(lora_steps, base_reads, tmp_path, job):
    step = lora_steps["dense_tp2"]  # adapter only: the merge fuses into --base-model, the release copies it
    base = str(tmp_path / "base")
    shutil.copytree(step.base_dir, base)
    options = OutputOptions(base_model=base, include_base=True)
    kind = MergeJob if job == "merge" else ExtractJob
    result = run_job(kind(str(step.step_dir), str(tmp_path / "out"), options))
    assert result.tensors > 0
    assert base_reads["list", base] == 1
    assert base_reads["read", storage.join(base, "config.json")] == 1


def test_merge_lora_and_an_svd_extraction_list_each_input_once(lora_steps, base_reads, tmp_path):
    step = lora_steps["dense_tp2"]
    base, tuned = str(tmp_path / "base"), tmp_path / "tuned"
    shutil.copytree(step.base_dir, base)
    shutil.copytree(step.base_dir, tuned)
    (weights,) = sorted(tuned.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name] + 0.01  # a fine-tune of one module
    save_file(tensors, str(weights), metadata={"format": "pt"})
    adapter = str(tmp_path / "adapter")
    shutil.copytree(step.step_dir / "model" / "huggingface" / "adapter", adapter)  # the run's PEFT export
    base_reads.clear()
    run_job(CombineJob(base, [adapter], str(tmp_path / "fused"), OutputOptions()))
    assert (base_reads["list", base], base_reads["list", adapter]) == (1, 1)
    assert base_reads["read", storage.join(base, "config.json")] == 1
    base_reads.clear()
    run_job(SvdExtractJob(base, str(tuned), str(tmp_path / "svd"), OutputOptions(rank=2)))
    assert (base_reads["list", base], base_reads["list", str(tuned)]) == (1, 1)


def test_a_base_rewritten_after_the_fingerprint_fails_the_job(lora_steps, tmp_path):
    step = lora_steps["dense_tp2"]
    base = tmp_path / "base"
    shutil.copytree(step.base_dir, base)
    job = MergeJob(str(step.step_dir), str(tmp_path / "out"), OutputOptions(base_model=str(base)))
    job.fingerprint()
    (weights,) = sorted(base.glob("*.safetensors"))
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1  # the same size, other values: another model under the same names
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(SourceChanged):
        run_job(job)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_an_adapter_rewritten_after_the_fingerprint_fails_merge_lora(lora_steps, tmp_path):
    """``merge-lora`` reads each adapter's weights pinned to the listing its fingerprint took, as it reads the base
    (main before this: the adapter's new factors were fused and released under the old fingerprint)."""
    step = lora_steps["dense_tp2"]
    adapter = tmp_path / "adapter"
    shutil.copytree(step.step_dir / "model" / "huggingface" / "adapter", adapter)  # the run's PEFT export
    job = CombineJob(str(step.base_dir), [str(adapter)], str(tmp_path / "fused"), OutputOptions())
    job.fingerprint()
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in sorted(tensors) if "lora_B" in n)
    tensors[name] = tensors[name] + 1  # the same size, other factors
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(SourceChanged) as error:
        run_job(job)
    assert error.value.path == str(weights)
    assert not (tmp_path / "fused").exists() or not any((tmp_path / "fused").glob("*.safetensors"))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_folders_top_level_digest_is_its_listing_of_that_level(lora_steps, tmp_path, request, where):
    folder = str(lora_steps["dense_tp2"].step_dir)  # files at the top and in sub-folders
    if where == "s3":
        url = f"{request.getfixturevalue('s3_bucket_url')}/folder"
        for entry in storage.list_files(folder):
            storage.copy_file(storage.join(folder, entry.path), storage.join(url, entry.path))
        folder = url
    assert any("/" in e.path for e in storage.list_files(folder))
    assert InputFolders().digest(folder) == storage.fingerprint(storage.list_files(folder, recursive=False))
    assert InputFolders().digest(folder, recursive=True) == storage.fingerprint(storage.list_files(folder))
