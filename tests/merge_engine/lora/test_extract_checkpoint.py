"""LoRA training checkpoints (verl FSDP1/FSDP2, PEFT-wrapped before sharding) -> adapter + base,
and a plain `stepmerge merge` of one -> the TRAINED model (LoRA fused), never the base alone.

The trained model is synthetic_runs' reference (`build_reference_model`: the PEFT model the rank
files shard); its logits are the truth. With r=2 over 4 ranks, ranks 2 and 3 hold EMPTY lora_A shards.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.cli import main
from merge_engine.errors import AdapterError, InvalidConfig, InvalidOption
from merge_engine.commands.extract import extract_lora
from merge_engine.output.jobs import OutputOptions
from merge_engine.commands.merge import merge_checkpoint
from tests.merge_engine.lora.conftest import LORA_RUNS, copy_checkpoint, load_causal_lm, logits, peft_logits
from tests.merge_engine.lora.test_fuse import ATOL, RTOL


@pytest.mark.parametrize("name", LORA_RUNS)
def test_extracted_adapter_reproduces_the_trained_model(tmp_path, fsdp_lora_runs, name):
    """PeftModel.from_pretrained(clean base, adapter) gives the trained model's logits; the clean base
    is exactly the base model; r, alpha and target_modules are the run's."""
    run = fsdp_lora_runs[name]
    result = extract_lora(run.checkpoint_dir, str(tmp_path / "out"))
    assert result.kind == "adapter+base"
    trained = logits(run.trained_model())
    torch.testing.assert_close(peft_logits(str(tmp_path / "out" / "base"), str(tmp_path / "out")), trained,
                               atol=ATOL, rtol=RTOL)
    base = load_file(str(tmp_path / "out" / "base" / "model.safetensors"))
    expected = run.base_model().state_dict()
    assert sorted(base) == sorted(expected)
    assert all(torch.equal(base[k], expected[k]) for k in base)
    config = json.load(open(tmp_path / "out" / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"]) == (run.spec.lora.r, run.spec.lora.alpha)
    assert config["target_modules"] == sorted(run.spec.lora.target_modules)
    assert config["base_model_name_or_path"] == "base"  # relative to the adapter: no path of this machine
    adapter_keys = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in adapter_keys)


def test_an_adapter_names_its_base_so_that_the_name_resolves_wherever_it_is_copied(tmp_path, fsdp_lora_runs):
    """The config names ``base`` (the clean base beside it), written once by the job, so the sha256 that
    ``stepmerge.json`` records is the file's; the run's config naming a Hub id (``_name_or_path``) gives that id,
    and the operator's ``base_model_id`` wins over both. No name is a path of this machine, and the name is no
    input of the fingerprint (the bytes of the weights are the same)."""
    import hashlib
    import shutil

    from merge_engine.commands.extract import ExtractJob, extract_fingerprint
    from merge_engine.layouts import check_checkpoint
    from merge_engine.output.jobs import run_job

    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    staged = run_job(ExtractJob(run.checkpoint_dir, str(tmp_path / "staged"), OutputOptions()))
    config = json.load(open(tmp_path / "staged" / "adapter_config.json"))
    assert config["base_model_name_or_path"] == "base" and staged.kind == "adapter+base"
    recorded = json.load(open(tmp_path / "staged" / "stepmerge.json"))
    assert recorded["sha256"]["adapter_config.json"] == hashlib.sha256(
        (tmp_path / "staged" / "adapter_config.json").read_bytes()).hexdigest()
    assert str(tmp_path) not in (tmp_path / "staged" / "stepmerge.json").read_text()
    assert staged.fingerprint == extract_fingerprint(check_checkpoint(run.checkpoint_dir), OutputOptions())

    copy = tmp_path / "run" / "global_step_3" / "actor"
    shutil.copytree(run.checkpoint_dir, copy)
    hf_config = copy / "huggingface" / "config.json"
    hf_config.write_text(json.dumps({**json.loads(hf_config.read_text()), "_name_or_path": "Qwen/Qwen2-0.5B"}))
    run_job(ExtractJob(str(copy), str(tmp_path / "named"), OutputOptions()))
    assert json.load(open(tmp_path / "named" / "adapter_config.json"))["base_model_name_or_path"] == "Qwen/Qwen2-0.5B"
    run_job(ExtractJob(str(copy), str(tmp_path / "given"), OutputOptions(base_model_id="org/base-7b")))
    assert json.load(open(tmp_path / "given" / "adapter_config.json"))["base_model_name_or_path"] == "org/base-7b"
    provenance = json.load(open(tmp_path / "given" / "stepmerge.json"))
    assert provenance["source"] == "global_step_3/actor" and provenance["options"]["base_model_id"] == "org/base-7b"


@pytest.mark.parametrize("name", LORA_RUNS)
def test_plain_merge_writes_the_trained_model(tmp_path, fsdp_lora_runs, name):
    """`stepmerge merge` of a LoRA checkpoint fuses the LoRA: trained logits, not the base's."""
    run = fsdp_lora_runs[name]
    result = merge_checkpoint(run.checkpoint_dir, str(tmp_path / "merged"))
    assert any("LoRA fused" in note for note in result.notes)
    merged = logits(load_causal_lm(str(tmp_path / "merged")))
    torch.testing.assert_close(merged, logits(run.trained_model()), atol=ATOL, rtol=RTOL)
    assert float((merged - logits(run.base_model())).abs().max()) > 0.05
    assert not any("lora" in k or "base_layer" in k for k in load_file(str(tmp_path / "merged" / "model.safetensors")))


def test_plain_merge_in_bf16(tmp_path, fsdp_lora_runs):
    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    merge_checkpoint(run.checkpoint_dir, str(tmp_path / "merged"), OutputOptions(dtype="bfloat16"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}


def test_lora_only_checkpoint_needs_the_base(tmp_path, fsdp_lora_runs, lora_only_checkpoint):
    """Only adapter keys saved: the adapter is extracted and checked against --base-model; a plain
    merge without --base-model says to pass it (it then fuses: test_adapter_step_fuse); nothing is written on
    failure. Without include_base, the adapter alone, naming --base-model by its name."""
    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    base_dir = str(tmp_path / "base")
    run.base_model().save_pretrained(base_dir)
    with pytest.raises(AdapterError, match="--base-model"):
        extract_lora(lora_only_checkpoint.checkpoint_dir, str(tmp_path / "no_base"))
    assert not os.path.exists(tmp_path / "no_base")
    with pytest.raises(AdapterError, match="no base model: pass --base-model"):
        merge_checkpoint(lora_only_checkpoint.checkpoint_dir, str(tmp_path / "merged"))
    assert not os.path.exists(tmp_path / "merged")
    result = extract_lora(lora_only_checkpoint.checkpoint_dir, str(tmp_path / "adapter"),
                          OutputOptions(base_model=base_dir, include_base=False))
    assert result.kind == "adapter" and not os.path.exists(tmp_path / "adapter" / "base")
    assert json.load(open(tmp_path / "adapter" / "adapter_config.json"))["base_model_name_or_path"] == \
        os.path.basename(base_dir)  # --base-model by its name: no path of this machine
    torch.testing.assert_close(peft_logits(base_dir, str(tmp_path / "adapter")), logits(run.trained_model()),
                               atol=ATOL, rtol=RTOL)


def test_a_lora_only_checkpoints_release_carries_the_base_given(tmp_path, fsdp_lora_runs, lora_only_checkpoint):
    """include_base (the default) for a step holding only the adapter: --base-model is written under base/ (its
    tensors bit for bit, in the requested dtype; its config beside them) and the adapter names it ``base``, so
    PEFT loads the release alone with the trained model's logits; --base-model-id still names the base."""
    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    base_dir = str(tmp_path / "given_base")
    run.base_model().save_pretrained(base_dir)
    out = str(tmp_path / "adapter")
    result = extract_lora(lora_only_checkpoint.checkpoint_dir, out, OutputOptions(base_model=base_dir))
    assert result.kind == "adapter+base"
    assert json.load(open(os.path.join(out, "adapter_config.json")))["base_model_name_or_path"] == "base"
    written, given = load_file(os.path.join(out, "base", "model.safetensors")), load_file(
        os.path.join(base_dir, "model.safetensors"))
    assert written.keys() == given.keys() and all(torch.equal(written[k], given[k]) for k in given)
    assert json.load(open(os.path.join(out, "base", "config.json")))["model_type"] == "qwen2"
    torch.testing.assert_close(peft_logits(os.path.join(out, "base"), out), logits(run.trained_model()),
                               atol=ATOL, rtol=RTOL)

    bf16 = str(tmp_path / "bf16")
    extract_lora(lora_only_checkpoint.checkpoint_dir, bf16,
                 OutputOptions(base_model=base_dir, dtype="bfloat16", base_model_id="org/base-7b"))
    assert {t.dtype for t in load_file(os.path.join(bf16, "base", "model.safetensors")).values()} == {torch.bfloat16}
    assert json.load(open(os.path.join(bf16, "adapter_config.json")))["base_model_name_or_path"] == "org/base-7b"


def test_a_base_of_another_model_is_refused_before_anything_is_written(tmp_path, fsdp_lora_runs,
                                                                      lora_only_checkpoint):
    """--base-model whose config is not the step's model (one more layer here) is an InvalidConfig naming both
    config files and the key, for an adapter-only step as for one holding its base; nothing is written."""
    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    base_dir = str(tmp_path / "other_base")
    run.base_model().save_pretrained(base_dir)
    config_path = os.path.join(base_dir, "config.json")
    config = json.load(open(config_path))
    config["num_hidden_layers"] += 1
    json.dump(config, open(config_path, "w"))
    for step in (lora_only_checkpoint.checkpoint_dir, run.checkpoint_dir):
        out = tmp_path / "adapter"
        with pytest.raises(InvalidConfig, match=r"differs from the step's .*config.json on num_hidden_layers") as refused:
            extract_lora(step, str(out), OutputOptions(base_model=base_dir))
        assert refused.value.path == os.path.join(base_dir, "config.json") and not out.exists()


def test_alpha_is_never_guessed(tmp_path, fsdp_lora_runs):
    """No lora_train_meta.json: a named error that says how to give alpha, nothing written; with
    --lora-alpha it works; a flag contradicting the metadata is refused."""
    run = fsdp_lora_runs["lora_fsdp1_mesh_qwen2"]
    bare = copy_checkpoint(run.checkpoint_dir, str(tmp_path / "bare"), drop=("lora_train_meta.json",))
    for attempt in (lambda: extract_lora(bare, str(tmp_path / "out")),
                    lambda: merge_checkpoint(bare, str(tmp_path / "out"))):
        with pytest.raises(AdapterError, match="--lora-alpha"):
            attempt()
        assert not os.path.exists(tmp_path / "out")
    extract_lora(bare, str(tmp_path / "out"), OutputOptions(lora_alpha=run.spec.lora.alpha))
    torch.testing.assert_close(peft_logits(str(tmp_path / "out" / "base"), str(tmp_path / "out")),
                               logits(run.trained_model()), atol=ATOL, rtol=RTOL)
    with pytest.raises(AdapterError, match="contradicts"):
        extract_lora(run.checkpoint_dir, str(tmp_path / "other"), OutputOptions(lora_alpha=run.spec.lora.alpha + 1))
    with pytest.raises(InvalidOption):
        extract_lora(bare, str(tmp_path / "zero"), OutputOptions(lora_alpha=0))


def test_run_metadata_outside_the_listing_is_never_read(tmp_path, fsdp_lora_runs):
    """The run's LoRA metadata is read only where the checked listing holds it: a ``lora_train_meta.json``
    written after the check (so outside the fingerprint) decides nothing, in extract and merge alike."""
    from merge_engine.commands.extract import ExtractJob
    from merge_engine.commands.merge import MergeJob
    from merge_engine.layouts import check_checkpoint
    from merge_engine.output.jobs import run_job

    run = fsdp_lora_runs["lora_fsdp1_mesh_qwen2"]
    bare = copy_checkpoint(run.checkpoint_dir, str(tmp_path / "bare"), drop=("lora_train_meta.json",))
    checked = check_checkpoint(bare)
    assert "lora_train_meta.json" not in {f.path for f in checked.files}
    with open(os.path.join(bare, "lora_train_meta.json"), "w") as handle:
        json.dump({"r": run.spec.lora.r, "lora_alpha": run.spec.lora.alpha, "task_type": "CAUSAL_LM"}, handle)
    for job in (ExtractJob(bare, str(tmp_path / "adapter"), OutputOptions(), checkpoint=checked),
                MergeJob(bare, str(tmp_path / "model"), OutputOptions(), checkpoint=checked)):
        with pytest.raises(AdapterError, match="--lora-alpha"):
            run_job(job)
        assert not os.path.exists(job.target_url)
    # listed (checked again), the same file decides alpha
    assert run_job(ExtractJob(bare, str(tmp_path / "adapter"), OutputOptions())).kind == "adapter+base"


def test_alpha_from_an_adapter_config_saved_with_the_run(tmp_path, fsdp_lora_runs):
    """Older verl saved lora_adapter/adapter_config.json (asdict of the LoraConfig) instead."""
    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    older = copy_checkpoint(run.checkpoint_dir, str(tmp_path / "older"), drop=("lora_train_meta.json",))
    os.makedirs(os.path.join(older, "lora_adapter"))
    saved = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": run.spec.lora.r, "lora_alpha": run.spec.lora.alpha,
             "target_modules": list(run.spec.lora.target_modules), "use_rslora": False, "bias": "none",
             "lora_dropout": 0.05, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False}
    with open(os.path.join(older, "lora_adapter", "adapter_config.json"), "w") as handle:
        json.dump(saved, handle)
    result = extract_lora(older, str(tmp_path / "out"))
    assert any("lora_adapter/adapter_config.json" in note for note in result.notes)
    config = json.load(open(tmp_path / "out" / "adapter_config.json"))
    assert config["lora_alpha"] == run.spec.lora.alpha and config["lora_dropout"] == 0.05
    torch.testing.assert_close(peft_logits(str(tmp_path / "out" / "base"), str(tmp_path / "out")),
                               logits(run.trained_model()), atol=ATOL, rtol=RTOL)


def test_metadata_for_another_rank_is_refused(tmp_path, fsdp_lora_runs):
    run = fsdp_lora_runs["lora_fsdp2_qwen2_r2"]
    wrong = copy_checkpoint(run.checkpoint_dir, str(tmp_path / "wrong"), drop=("lora_train_meta.json",))
    with open(os.path.join(wrong, "lora_train_meta.json"), "w") as handle:
        json.dump({"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}, handle)
    with pytest.raises(AdapterError, match="r=8"):
        extract_lora(wrong, str(tmp_path / "out"))


def test_embedding_lora_and_modules_to_save(tmp_path, single_rank_lora_checkpoint):
    """A trained lm_head copy (modules_to_save) and an embedding LoRA: extracted with PEFT's names
    they give the trained logits; merged, the trained copy replaces the original."""
    checkpoint, trained, base_dir = single_rank_lora_checkpoint
    want = logits(trained)
    extract_lora(checkpoint, str(tmp_path / "out"))
    config = json.load(open(tmp_path / "out" / "adapter_config.json"))
    assert config["modules_to_save"] == ["lm_head"] and config["target_modules"] == ["embed_tokens", "o_proj"]
    keys = set(load_file(str(tmp_path / "out" / "adapter_model.safetensors")))
    assert {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.lora_embedding_A"} <= keys
    torch.testing.assert_close(peft_logits(str(tmp_path / "out" / "base"), str(tmp_path / "out")), want,
                               atol=ATOL, rtol=RTOL)
    base = load_file(str(tmp_path / "out" / "base" / "model.safetensors"))
    original = load_file(os.path.join(base_dir, "model.safetensors"))
    assert all(torch.equal(base[k], original[k]) for k in original)
    merge_checkpoint(checkpoint, str(tmp_path / "merged"))
    torch.testing.assert_close(logits(load_causal_lm(str(tmp_path / "merged"))), want, atol=ATOL, rtol=RTOL)


def test_cli_extract_then_merge_lora(tmp_path, fsdp_lora_runs, capsys):
    """The two commands end to end: extract-lora, then merge-lora of the result == plain merge."""
    run = fsdp_lora_runs["lora_fsdp1_mesh_qwen2"]
    out = str(tmp_path / "out")
    assert main(["extract-lora", "--backend", "fsdp", "--local_dir", run.checkpoint_dir, "--target-dir", out]) == 0
    assert main(["merge-lora", "--base-model", os.path.join(out, "base"), "--lora-adapter", out,
                 "--target-dir", str(tmp_path / "fused")]) == 0
    assert main(["merge", "--backend", "fsdp", "--local_dir", run.checkpoint_dir,
                 "--target_dir", str(tmp_path / "merged")]) == 0
    fused, merged = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("fused", "merged"))
    assert sorted(fused) == sorted(merged) and all(torch.equal(fused[k], merged[k]) for k in fused)
    bare = copy_checkpoint(run.checkpoint_dir, str(tmp_path / "bare"), drop=("lora_train_meta.json",))
    capsys.readouterr()
    assert main(["extract-lora", "--local_dir", bare, "--target-dir", str(tmp_path / "x")]) == 2
    assert "AdapterError" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
