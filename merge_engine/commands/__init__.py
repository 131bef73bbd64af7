"""The commands that write or check an output, each an `merge_engine.output.jobs.OutputJob` (or built on one).

- `merge`             checkpoint URL -> Hugging Face folder (`MergeJob`)
- `extract`           a LoRA checkpoint -> PEFT adapter + clean base; SVD extraction from a full fine-tune
- `combine`           several adapters -> one (concat / weighted / average, fused or exact or SVD)
- `layout_jobs`       the jobs module of a layout with its own semantics, by layout name (``JOBS``: a verl
                      Megatron LoRA step's, as an adapter release and as a fused model; torchtitan's)
- `split`             Hugging Face model -> Megatron shards
- `reference_check`   verl's ``test``: a checkpoint, merged, against a reference folder
- `adapter_target`    fingerprints and reports shared by the adapter commands
"""
