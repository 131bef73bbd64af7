"""LoRA adapters: extract to PEFT, fuse into a base, combine, SVD-extract -- streaming and exact.

Modules, one job each:
- `keys`        PEFT's tensor names (training checkpoints and adapter files), classified
- `config`      adapter_config.json semantics (scaling, rank/alpha patterns, target modules)
- `adapter_io`  read an adapter folder, check it against a base, plan writing one
- `sources`     renamed and namespaced views over tensor sources
- `fuse`        W + scale * B @ A as a streaming TensorBuilder; the fused-model plan
- `combine`     concat / weighted / average, fused or as one adapter (exact or SVD); `merge_lora`
- `svd`         low-rank factoring with per-module relative error, GPU when present
- `extract`     checkpoint -> adapter + clean base; trained-model plan for `merge`; SVD extraction
- `target`      the commands' result records and input fingerprints (outputs: `output_target`)
- `validate`    an adapter folder: loads with PEFT on its base, logits equal the fused model's
"""
