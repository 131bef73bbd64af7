"""LoRA adapters: extract to PEFT, fuse into a base, combine, SVD-extract -- streaming and exact.

Modules, one job each:
- `keys`        PEFT's tensor names (training checkpoints and adapter files), classified
- `config`      adapter_config.json semantics (scaling, rank/alpha patterns, target modules)
- `peft_settings` each module's (r, lora_alpha, scaling) as PEFT trained it, asked of PEFT on the meta
                device (verl records only r / lora_alpha; PEFT 0.21 gives fused gate/up 2r AND 2 * alpha)
- `adapter_io`  read an adapter folder, check it against a base, plan writing one
- `sources`     renamed and namespaced views over tensor sources
- `fused_experts` LoRA on transformers v5's fused 3-D expert tensors (PEFT target_parameters):
                which wrapper adapts which tensor, each expert's A_e / B_e
- `hub_names`   an extracted adapter under the Hub checkpoint's module names (renamed, row bands and
                per-expert modules cut from fused ones), the form PEFT loads onto a Hub-format base
- `fuse`        W + scale * B @ A as a streaming TensorBuilder; the fused-model plan
- `combine`     several adapters as one, exactly (rank stacking) or re-factored by SVD: the combined adapter's plan
- `checkpoint`  the LoRA of a PEFT-wrapped training checkpoint (keys, alpha from the run); the
                trained-model plan the planner picks for a plain `merge`
- `svd`         low-rank factoring with per-module relative error, on the device asked (cuda when present):
                the rank rules, and the method per batch of same-shape updates (randomized, or full SVD)
- `lowrank`     the randomized SVD of a batch (seeded sketch, power iterations), checked against its residual
- `extracted_config` adapter_config.json of an adapter extracted from a LoRA checkpoint (ranks, PEFT's alphas)
- `finetune_delta` what a full fine-tune changed: the modules an SVD extraction factors, the other changed tensors
- `svd_updates` many modules' updates factored: reads prefetched by a thread, same-shape batches on the device
The commands built on this library (extract, svd-extract, combine, a Megatron LoRA step's release) are output
jobs in `merge_engine.commands`; everything here sits below the planner.
Validating an adapter folder (PEFT loads it on its base, logits equal the fused model's) is
`merge_engine.validate.adapter`, beside the other checks.
"""
