"""Fusing one adapter into a base (`stepmerge merge-lora`): the fused model IS the adapted model.

Tolerance: float32 logits of these tiny models agree within ATOL/RTOL below (measured differences
are ~1e-6: only the order of float32 additions differs); adapters move the logits by > 0.05.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.errors import TargetExists
from merge_engine.commands.combine import merge_lora
from merge_engine.output.jobs import OutputOptions
from merge_engine.lora.sources import NamespacedSource
from tests.merge_engine.lora.conftest import ADAPTER_CONFIGS, load_causal_lm, logits, peft_logits

ATOL, RTOL = 5e-5, 1e-5


def weights(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize("name", sorted(ADAPTER_CONFIGS))
def test_fused_model_gives_peft_logits(tmp_path, tiny_base, peft_adapters, name):
    """PeftModel.from_pretrained(base, adapter) and the fused model agree; both differ from the base
    (covers rank/alpha patterns, rsLoRA, an embedding LoRA and a module to save)."""
    result = merge_lora(tiny_base, [peft_adapters[name]], str(tmp_path / "fused"))
    fused = logits(load_causal_lm(result.target_url))
    torch.testing.assert_close(fused, peft_logits(tiny_base, peft_adapters[name]), atol=ATOL, rtol=RTOL)
    assert float((fused - logits(load_causal_lm(tiny_base))).abs().max()) > 0.05


@pytest.mark.parametrize("name", sorted(ADAPTER_CONFIGS))
def test_fused_weights_equal_peft_merge_and_unload(tmp_path, tiny_base, peft_adapters, name):
    """Tensor by tensor, the fused weights are PEFT's merge_and_unload weights (same keys)."""
    from peft import PeftModel

    merge_lora(tiny_base, [peft_adapters[name]], str(tmp_path / "fused"))
    theirs = PeftModel.from_pretrained(load_causal_lm(tiny_base), peft_adapters[name]).merge_and_unload().state_dict()
    ours = weights(str(tmp_path / "fused"))
    theirs = {k: v for k, v in theirs.items() if k != "lm_head.weight" or k in ours}
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], atol=1e-6, rtol=1e-6, msg=key)


def test_fan_in_fan_out_gpt2(tmp_path, gpt2_base, gpt2_adapter):
    """GPT-2's Conv1D weights are (in, out): the update is laid transposed, as PEFT does."""
    result = merge_lora(gpt2_base, [gpt2_adapter], str(tmp_path / "fused"))
    fused = logits(load_causal_lm(result.target_url), torch.arange(1, 21).reshape(2, 10))
    want = peft_logits(gpt2_base, gpt2_adapter, torch.arange(1, 21).reshape(2, 10))
    torch.testing.assert_close(fused, want, atol=ATOL, rtol=RTOL)
    assert float((fused - logits(load_causal_lm(gpt2_base), torch.arange(1, 21).reshape(2, 10))).abs().max()) > 0.01


def test_chunk_size_does_not_change_a_bit(tmp_path, tiny_base, peft_adapters, monkeypatch):
    """Chunks that cut rows anywhere (1000 bytes: 250 of 64 columns), over LoRA row blocks of 15 rows,
    give the very same bytes as whole-tensor chunks."""
    from merge_engine.lora import fuse

    monkeypatch.setattr(fuse, "ROW_BLOCK_ELEMENTS", 1000)
    adapters = [peft_adapters["patterns"], peft_adapters["embed_save"]]
    merge_lora(tiny_base, adapters, str(tmp_path / "big"))
    merge_lora(tiny_base, adapters, str(tmp_path / "small"), OutputOptions(chunk_bytes=1000))
    big, small = weights(str(tmp_path / "big")), weights(str(tmp_path / "small"))
    assert sorted(big) == sorted(small)
    assert all(torch.equal(big[k], small[k]) for k in big)


def test_base_weights_are_streamed_never_read_whole(tmp_path, tiny_base, peft_adapters, monkeypatch):
    """Bounded memory: base tensors are only streamed in chunks of at most the chunk size; only the
    small LoRA factors are read whole."""
    reads, largest = [], [0]
    original_read, original_chunks = NamespacedSource.read, NamespacedSource.iter_chunks

    def read(self, name):
        reads.append(name)
        return original_read(self, name)

    def iter_chunks(self, name, max_bytes=16 << 20):
        for chunk in original_chunks(self, name, max_bytes):
            largest[0] = max(largest[0], chunk.numel() * chunk.element_size())
            yield chunk

    monkeypatch.setattr(NamespacedSource, "read", read)
    monkeypatch.setattr(NamespacedSource, "iter_chunks", iter_chunks)
    merge_lora(tiny_base, [peft_adapters["qv"]], str(tmp_path / "fused"), OutputOptions(chunk_bytes=4096))
    assert reads and all(".lora_" in name for name in reads)
    assert largest[0] <= 4096


def test_output_dtype_is_the_float32_result_cast_once(tmp_path, tiny_base, peft_adapters):
    """--dtype bfloat16: W + scale * B @ A computed in float32, then one cast."""
    merge_lora(tiny_base, [peft_adapters["qv"]], str(tmp_path / "fp32"))
    merge_lora(tiny_base, [peft_adapters["qv"]], str(tmp_path / "bf16"), OutputOptions(dtype="bfloat16"))
    fp32, bf16 = weights(str(tmp_path / "fp32")), weights(str(tmp_path / "bf16"))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(fp32[k].to(torch.bfloat16), bf16[k]) for k in fp32)
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"


def test_target_is_a_loadable_folder_with_provenance(tmp_path, tiny_base, peft_adapters):
    """Tokenizer and config come along; a rerun is skipped; a different output needs --overwrite."""
    target = str(tmp_path / "fused")
    first = merge_lora(tiny_base, [peft_adapters["qv"]], target)
    assert {"config.json", "tokenizer.json", "generation_config.json", "stepmerge.json"} <= set(os.listdir(target))
    provenance = json.load(open(os.path.join(target, "stepmerge.json")))
    # an adapter folder of this machine outside any run is named by its last component (no path of this machine)
    assert provenance["adapters"] == [os.path.basename(peft_adapters["qv"])]
    assert provenance["fingerprint"] == first.fingerprint
    assert merge_lora(tiny_base, [peft_adapters["qv"]], target).skipped
    with pytest.raises(TargetExists):
        merge_lora(tiny_base, [peft_adapters["qv2"]], target)
    replaced = merge_lora(tiny_base, [peft_adapters["qv2"]], target, OutputOptions(overwrite=True))
    assert not replaced.skipped and json.load(open(os.path.join(target, "stepmerge.json")))["adapters"] == \
        [os.path.basename(peft_adapters["qv2"])]
