"""Combining adapters: concat / weighted / average are exact weighted sums of the updates.

References: an explicit dense computation in float64 (this file), PEFT with several adapters active
at once (its forward adds every active adapter's update: the definition of concat), and PEFT's own
``add_weighted_adapter`` with ``cat`` (exact) and ``svd``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.errors import AdapterError
from merge_engine.commands.combine import merge_lora
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.lora.conftest import load_causal_lm, logits, peft_logits
from tests.merge_engine.lora.test_fuse import ATOL, RTOL, weights

PREFIX = "base_model.model."


def adapter_updates(adapter_dir: str) -> dict[str, torch.Tensor]:
    """module weight name -> scale * B @ A in float64, for plain adapters (no patterns, no rsLoRA)."""
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert not config["rank_pattern"] and not config["alpha_pattern"] and not config["use_rslora"]
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    updates = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key[len(PREFIX):-len(".lora_A.weight")]
            b = tensors[key.replace("lora_A", "lora_B")]
            updates[f"{module}.weight"] = config["lora_alpha"] / a.shape[0] * (b.double() @ a.double())
    return updates


def dense_combination(base_dir: str, adapters: list[tuple[str, float]]) -> dict[str, torch.Tensor]:
    state = {k: v.double() for k, v in load_file(os.path.join(base_dir, "model.safetensors")).items()}
    for adapter_dir, weight in adapters:
        for name, update in adapter_updates(adapter_dir).items():
            state[name] += weight * update
    return state


def lora_products(adapter_dir: str) -> dict[str, torch.Tensor]:
    """module -> scale * B @ A of any adapter stepmerge or PEFT wrote (config scale, patterns honoured)."""
    from merge_engine.lora.adapter_io import read_adapter

    adapter, source = read_adapter(adapter_dir)
    try:
        return {m.module: m.scale * (source.read(m.b).double() @ source.read(m.a).double())
                for m in adapter.modules.values()}
    finally:
        source.close()


def peft_multi_adapter_logits(base_dir: str, adapter_dirs: list[str]) -> torch.Tensor:
    """PEFT with every adapter active: the forward adds all their updates."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(base_dir), adapter_dirs[0], adapter_name="a0")
    for i, path in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    model.base_model.set_adapter([f"a{i}" for i in range(len(adapter_dirs))])
    return logits(model.eval())


@pytest.mark.parametrize("method, given, effective", [
    ("concat", None, (1.0, 1.0)),
    ("weighted", (0.7, -0.4), (0.7, -0.4)),
    ("average", None, (0.5, 0.5)),
])
def test_fused_combination_equals_dense_computation(tmp_path, tiny_base, peft_adapters, method, given, effective):
    """W + sum_i w_i * scale_i * B_i @ A_i, tensor by tensor (float64 reference)."""
    adapters = [peft_adapters["qv"], peft_adapters["qv2"]]
    merge_lora(tiny_base, adapters, str(tmp_path / "out"), OutputOptions(method=method, weights=given))
    want = dense_combination(tiny_base, list(zip(adapters, effective)))
    got = weights(str(tmp_path / "out"))
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        torch.testing.assert_close(value.double(), want[name], atol=1e-6, rtol=1e-6, msg=name)


def test_concat_of_mixed_adapters_equals_peft_with_all_active(tmp_path, tiny_base, peft_adapters):
    """Rank/alpha patterns + rsLoRA + an embedding LoRA with a module to save, all at once."""
    adapters = [peft_adapters["patterns"], peft_adapters["rslora"], peft_adapters["embed_save"]]
    merge_lora(tiny_base, adapters, str(tmp_path / "fused"))
    fused = logits(load_causal_lm(str(tmp_path / "fused")))
    torch.testing.assert_close(fused, peft_multi_adapter_logits(tiny_base, adapters), atol=ATOL, rtol=RTOL)


def test_concat_adapter_output_is_exact(tmp_path, tiny_base, peft_adapters):
    """--output adapter: one PEFT adapter (ranks stacked, scale 1) that PEFT loads and that gives the
    fused model's logits."""
    adapters = [peft_adapters["patterns"], peft_adapters["rslora"], peft_adapters["embed_save"]]
    merge_lora(tiny_base, adapters, str(tmp_path / "fused"))
    result = merge_lora(tiny_base, adapters, str(tmp_path / "adapter"), OutputOptions(output="adapter"))
    config = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert config["peft_type"] == "LORA" and config["modules_to_save"] == ["lm_head"]
    assert config["rank_pattern"] == {k: int(v) for k, v in config["alpha_pattern"].items()}
    q1 = config["rank_pattern"].get("model.layers.1.self_attn.q_proj", config["r"])
    assert q1 == 2  # patterns' rank for layer 1 q_proj (2) stacked with nothing else
    torch.testing.assert_close(peft_logits(tiny_base, result.target_url), logits(load_causal_lm(str(tmp_path / "fused"))),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("weights_", [(1.0, 1.0), (0.7, -0.4)])
def test_stacked_adapter_equals_peft_cat(tmp_path, tiny_base, peft_adapters, weights_):
    """PEFT's add_weighted_adapter(combination_type="cat") is exact; ours gives the same updates."""
    from peft import PeftModel

    adapters = [peft_adapters["qv"], peft_adapters["qv2"]]
    merge_lora(None, adapters, str(tmp_path / "ours"), OutputOptions(method="weighted", weights=weights_,
                                                                        output="adapter"))
    model = PeftModel.from_pretrained(load_causal_lm(tiny_base), adapters[0], adapter_name="a")
    model.load_adapter(adapters[1], adapter_name="b")
    model.add_weighted_adapter(["a", "b"], list(weights_), "cat", combination_type="cat")
    model.save_pretrained(str(tmp_path / "peft"), selected_adapters=["cat"])
    ours, theirs = lora_products(str(tmp_path / "ours")), lora_products(str(tmp_path / "peft" / "cat"))
    assert sorted(ours) == sorted(theirs)
    for module in ours:
        torch.testing.assert_close(ours[module], theirs[module], atol=1e-6, rtol=1e-6, msg=module)


def svd_refactoring_and_peft_svd(tmp_path, tiny_base: str, peft_adapters: dict[str, str], **options):
    """0.7 * qv - 0.4 * qv2 re-factored to rank 3 by stepmerge (``options`` added to its `OutputOptions`)
    and by PEFT's ``add_weighted_adapter(..., "svd")``: (stepmerge's result, its per-module B@A, PEFT's,
    the exact combined update)."""
    from peft import PeftModel

    adapters = [peft_adapters["qv"], peft_adapters["qv2"]]
    result = merge_lora(tiny_base, adapters, str(tmp_path / "ours"), OutputOptions(
        method="weighted", weights=(0.7, -0.4), output="adapter", rank=3, **options))
    model = PeftModel.from_pretrained(load_causal_lm(tiny_base), adapters[0], adapter_name="a")
    model.load_adapter(adapters[1], adapter_name="b")
    model.add_weighted_adapter(["a", "b"], [0.7, -0.4], "svd", combination_type="svd", svd_rank=3)
    model.save_pretrained(str(tmp_path / "peft"), selected_adapters=["svd"])
    ours, theirs = lora_products(str(tmp_path / "ours")), lora_products(str(tmp_path / "peft" / "svd"))
    exact = {name[:-len(".weight")]: 0.7 * u for name, u in adapter_updates(adapters[0]).items()}
    for name, u in adapter_updates(adapters[1]).items():
        exact[name[:-len(".weight")]] -= 0.4 * u
    return result, ours, theirs, exact


def test_svd_adapter_matches_peft_svd_and_reports_its_error(tmp_path, tiny_base, peft_adapters):
    """--rank 3 re-factors each module's combined update; PEFT's "svd" gives the same product, and
    the reported relative error is ||delta - B'A'||_F / ||delta||_F."""
    result, ours, theirs, exact = svd_refactoring_and_peft_svd(tmp_path, tiny_base, peft_adapters)
    reports = {r.module: r for r in result.modules}
    assert sorted(ours) == sorted(theirs) == sorted(reports)
    for module in ours:
        torch.testing.assert_close(ours[module], theirs[module], atol=1e-5, rtol=1e-4, msg=module)
        error = float(torch.linalg.norm(exact[module] - ours[module]) / torch.linalg.norm(exact[module]))
        assert reports[module].rank == 3 and error > 1e-3
        assert reports[module].relative_error == pytest.approx(error, rel=1e-4)
    provenance = json.load(open(tmp_path / "ours" / "stepmerge.json"))
    assert set(provenance["svd"]) == set(reports)


def test_energy_threshold_keeps_the_smallest_sufficient_rank(tmp_path, tiny_base, peft_adapters):
    """--energy e: per module, the fewest singular values whose squares reach e of the total."""
    adapters = [peft_adapters["qv"], peft_adapters["qv2"]]
    result = merge_lora(None, adapters, str(tmp_path / "ours"), OutputOptions(output="adapter", energy=0.9))
    exact = {}
    for adapter in adapters:
        for name, u in adapter_updates(adapter).items():
            exact[name[:-len(".weight")]] = exact.get(name[:-len(".weight")], 0) + u
    for report in result.modules:
        s2 = torch.linalg.svdvals(exact[report.module]) ** 2
        kept = torch.cumsum(s2, 0) / s2.sum()
        assert kept[report.rank - 1] >= 0.9 - 1e-9
        assert report.rank == 1 or kept[report.rank - 2] < 0.9
    assert len({r.rank for r in result.modules}) > 1  # ranks differ by module: a rank_pattern was needed
    config = json.load(open(tmp_path / "ours" / "adapter_config.json"))
    assert config["rank_pattern"]


def test_weighted_is_a_sum_of_updates_unlike_peft_linear(tmp_path, tiny_base, peft_adapters):
    """PEFT's "linear" sums sqrt(w s) A_i and sqrt(w s) B_i separately, so its update holds cross terms
    B_1 @ A_2; ours is exactly 0.5 * (update_1 + update_2)."""
    import peft
    from peft import PeftModel

    from tests.merge_engine.lora.conftest import save_adapter

    other = save_adapter(load_causal_lm(tiny_base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj"], task_type="CAUSAL_LM"), str(tmp_path / "other"), seed=77)
    adapters = [peft_adapters["qv"], other]
    ours = lora_products(merge_lora(None, adapters, str(tmp_path / "ours"), OutputOptions(
        method="weighted", weights=(0.5, 0.5), output="adapter")).target_url)
    model = PeftModel.from_pretrained(load_causal_lm(tiny_base), adapters[0], adapter_name="a")
    model.load_adapter(adapters[1], adapter_name="b")
    model.add_weighted_adapter(["a", "b"], [0.5, 0.5], "linear", combination_type="linear")
    model.save_pretrained(str(tmp_path / "peft"), selected_adapters=["linear"])
    linear = lora_products(str(tmp_path / "peft" / "linear"))
    exact = {}
    for adapter in adapters:
        for name, update in adapter_updates(adapter).items():
            exact[name[:-len(".weight")]] = exact.get(name[:-len(".weight")], 0) + 0.5 * update
    for module in exact:
        torch.testing.assert_close(ours[module], exact[module], atol=1e-6, rtol=1e-6)
        assert float((linear[module] - exact[module]).abs().max()) > 10 * float(
            (ours[module] - exact[module]).abs().max()) + 1e-4


def test_svd_needs_adapter_output(tmp_path, tiny_base, peft_adapters):
    from merge_engine.errors import InvalidOption

    with pytest.raises(InvalidOption):
        merge_lora(tiny_base, [peft_adapters["qv"]], str(tmp_path / "x"), OutputOptions(rank=2))
    assert not os.path.exists(tmp_path / "x")


def test_mismatched_adapters_cannot_be_stacked(tmp_path, tiny_base, peft_adapters, gpt2_adapter):
    with pytest.raises(AdapterError):
        merge_lora(tiny_base, [peft_adapters["qv"], gpt2_adapter], str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


def _bf16_adapter(folder, seed: int, r: int, alpha: float) -> str:
    """A PEFT adapter saved in bfloat16 (as bf16 training saves them), on two modules of a 2-layer model."""
    from safetensors.torch import save_file

    from merge_engine.lora.config import adapter_config

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, (out_f, in_f) in {"q_proj": (24, 16), "v_proj": (8, 16)}.items():
            key = f"{PREFIX}model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, in_f, generator=generator).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, r, generator=generator).to(torch.bfloat16)
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(r=r, lora_alpha=alpha, target_modules=["q_proj", "v_proj"]), f)
    return str(folder)


@pytest.mark.parametrize("method, given", [("concat", None), ("weighted", (0.7, -0.4)), ("average", None)])
def test_stacking_bf16_adapters_is_exact(tmp_path, method, given):
    """bf16 adapters with scales 16/12 and 8/4: w * s * A does not fit bf16, so the stacked factors
    are written in float32 and the stacked adapter's update is the weighted sum of the inputs'
    updates to float32 rounding (storing w * s * A back in bf16 was off by ~1e-3, relative)."""
    adapters = [_bf16_adapter(tmp_path / "a", 1, r=12, alpha=16), _bf16_adapter(tmp_path / "b", 2, r=4, alpha=8)]
    merge_lora(None, adapters, str(tmp_path / "out"), OutputOptions(method=method, weights=given,
                                                                       output="adapter"))
    stored = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.float32}
    effective = given or ((1.0, 1.0) if method == "concat" else (0.5, 0.5))
    inputs = [lora_products(a) for a in adapters]
    got = lora_products(str(tmp_path / "out"))
    assert sorted(got) == sorted(inputs[0])
    for module, update in got.items():
        want = sum(w * products[module] for w, products in zip(effective, inputs))
        torch.testing.assert_close(update, want, atol=1e-6, rtol=1e-6, msg=module)


def test_stacking_keeps_the_adapter_dtype_when_nothing_is_scaled(tmp_path):
    """concat of adapters with lora_alpha = r (scale 1): A and B are copied as stored, so the
    stacked adapter stays bf16 and is exact; an explicit --dtype is honoured as given."""
    adapters = [_bf16_adapter(tmp_path / "a", 1, r=4, alpha=4), _bf16_adapter(tmp_path / "b", 2, r=2, alpha=2)]
    merge_lora(None, adapters, str(tmp_path / "out"), OutputOptions(output="adapter"))
    stored = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    got, inputs = lora_products(str(tmp_path / "out")), [lora_products(a) for a in adapters]
    for module, update in got.items():
        torch.testing.assert_close(update, inputs[0][module] + inputs[1][module], atol=1e-12, rtol=1e-12)
    merge_lora(None, adapters, str(tmp_path / "f16"), OutputOptions(output="adapter", method="average",
                                                                       dtype="float16"))
    stored = load_file(str(tmp_path / "f16" / "adapter_model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.float16}


@pytest.mark.parametrize("weights_format", ["hub", "transformers"])
def test_fused_model_is_written_in_the_weights_format(tmp_path, single_rank_family_loras, weights_format):
    """merge-lora's model passes through the Hub-format step: a VL base and adapter under transformers v5's
    in-memory names (model.language_model) fuse to the Hub names by default, as stored with
    ``weights_format="transformers"``; recorded in stepmerge.json; logits equal the trained model's."""
    from merge_engine.commands.extract import extract_lora
    from merge_engine.output.jobs import OutputOptions

    run = single_rank_family_loras["qwen2_vl"]
    adapter = str(tmp_path / "adapter")
    extract_lora(run.checkpoint_dir, adapter, OutputOptions(weights_format="transformers"))
    target = str(tmp_path / "fused")
    merge_lora(os.path.join(adapter, "base"), [adapter], target, OutputOptions(weights_format=weights_format))
    names = set(load_file(os.path.join(target, "model.safetensors")))
    assert ("model.language_model.layers.0.self_attn.q_proj.weight" in names) == (weights_format == "transformers")
    assert ("model.layers.0.self_attn.q_proj.weight" in names) == (weights_format == "hub")
    with open(os.path.join(target, "stepmerge.json")) as handle:
        assert json.load(handle)["options"]["weights_format"] == weights_format
    from transformers import Qwen2VLForConditionalGeneration

    fused = Qwen2VLForConditionalGeneration.from_pretrained(target).eval()
    torch.testing.assert_close(logits(fused), logits(run.model), rtol=RTOL, atol=ATOL)
