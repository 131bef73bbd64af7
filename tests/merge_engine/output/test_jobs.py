"""Output jobs (`merge_engine.output.jobs`): one job shape, one result type, one options record, an executor
that can be swapped without changing a byte.

Specification: `run_job` hands the plan's outputs to the executor it is given (the scale-out seam);
another executor writing the same plan gives the same bytes; a second run finds the target "same" and
is skipped without preparing; each command's fingerprint keys are the documented ones (a change of
them would silently rebuild every released output).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from merge_engine.output.executors.local import LOCAL
from merge_engine.output.jobs import OutputOptions, OutputResult, run_job
from merge_engine.commands.merge import MergeJob

TENSORS = {"model.embed_tokens.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4),
           "model.layers.0.mlp.down_proj.weight": torch.full((4, 8), 0.5),
           "model.norm.weight": torch.ones(4),
           "lm_head.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4) * -1}


def _hf_folder(tmp_path) -> str:
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(TENSORS, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({  # the sizes of TENSORS: the config must not contradict them
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False, "vocab_size": 6,
        "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1}))
    return str(folder)


def _contents(folder) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


class RecordingExecutor:
    """Writes through LOCAL and remembers which outputs and shards it was handed."""

    def __init__(self) -> None:
        self.shards: list[str] = []

    def write(self, job, outputs, url, *, chunk_bytes, on_bytes):
        self.shards += [shard.filename for output in outputs for shard in output.plan.shards]
        return LOCAL.write(job, outputs, url, chunk_bytes=chunk_bytes, on_bytes=on_bytes)


def test_the_executor_gets_the_plans_shards_and_bytes_do_not_depend_on_it(tmp_path):
    source = _hf_folder(tmp_path)
    options = OutputOptions(max_shard_size=100)  # several shards
    recording = RecordingExecutor()
    ours = run_job(MergeJob(source, str(tmp_path / "a"), options), executor=recording)
    local = run_job(MergeJob(source, str(tmp_path / "b"), options))
    assert isinstance(ours, OutputResult) and ours.command == "merge" and not ours.skipped
    assert len(recording.shards) > 1 and recording.shards == [n for n, _ in ours.files if n.endswith(".safetensors")]
    assert _contents(tmp_path / "a") == _contents(tmp_path / "b")
    assert ours.fingerprint == local.fingerprint and ours.files == local.files


def test_a_target_holding_this_output_is_skipped_without_preparing(tmp_path):
    source = _hf_folder(tmp_path)
    first = run_job(MergeJob(source, str(tmp_path / "out"), OutputOptions()))

    class NoPrepare(MergeJob):
        def prepare(self):
            raise AssertionError("prepared although the target holds this output")

    again = run_job(NoPrepare(source, str(tmp_path / "out"), OutputOptions()))
    assert again.skipped and again.fingerprint == first.fingerprint
    assert again.tensors == first.tensors == len(TENSORS) and again.layout == "hf"


def test_each_commands_fingerprint_keys():
    """The keys that shape each command's output, as they were before the options became one record, plus
    the weights format of every command that writes a model (merge, extract-lora's base, merge-lora)."""
    options = OutputOptions()
    assert set(options.output_options("merge")) == {"dtype", "max_shard_size", "hf_model_path", "weights_format"}
    assert set(OutputOptions(lora_alpha=16.0).output_options("merge")) == {"dtype", "max_shard_size", "hf_model_path",
                                                                          "weights_format", "lora_alpha"}
    assert set(options.output_options("extract-lora")) == {"backend", "lora_alpha", "base_model", "write_base",
                                                           "hf_model_path", "dtype", "max_shard_size",
                                                           "weights_format"}
    assert set(options.output_options("extract-lora --finetuned")) == {"backend", "rank", "energy",
                                                                       "target_modules", "dtype"}
    assert set(options.output_options("merge-lora")) == {"method", "weights", "output", "rank", "energy",
                                                         "lora_alpha", "dtype", "max_shard_size", "weights_format"}
    assert options.output_options("split") == {"tp": 1, "pp": 1, "vpp": None, "ep": 1, "format": "legacy",
                                               "make_vocab_size_divisible_by": 128, "dtype": None,
                                               "custom_mapping": None}
    # how to run never changes what is written
    for command in ("merge", "extract-lora", "extract-lora --finetuned", "merge-lora", "split"):
        assert not {"overwrite", "chunk_bytes", "device", "workers", "ray_address"} & set(options.output_options(command))
