"""Checks of a Hugging Face model folder or a PEFT adapter (any storage URL) -> a `ValidationReport`.

Contract:
- `validate_structure`: config parses; the weights read through the HF layout's reader
  (`merge_engine.layouts.hf`, one check per stage: index with safe, existing file names; every
  safetensors header (`merge_engine.formats.safetensors_file`); index and headers agree; ``total_size``);
  the keys and shapes the config implies (its model class on the ``meta`` device, saved the way
  ``save_pretrained`` would save it; under the names of the weights format ``stepmerge.json``
  records: ``hub`` by default, ``transformers`` = as stored) are exactly the keys and shapes on
  disk; no NaN/inf.
- `compare_to_reference`: the one comparison (`compare.compare_tensors`, verl's ``test``
  semantics): same keys, shapes, dtypes, and values within ``atol + rtol * |reference|`` with
  the one set of tolerances (`WEIGHT_TOLERANCE` 1e-6 / 1e-6); NaN never equal; the first failing
  key is named. `merge_engine.commands.reference_check` uses the same comparison for a planned merge.
- `forward_check`: the one forward pass (`forward`): ``from_pretrained`` with the config's
  architecture, fixed token ids (GPU when present), finite logits; with a reference, the logits
  compared within `LOGIT_TOLERANCE` (1e-4 / 1e-4).
- `validate_model`: all of the above in one report.
- `validate_adapter` (`adapter`): a PEFT adapter folder: config, finite factors, its ``base/``,
  PEFT loads it, and PEFT(base + adapter) reproduces the fused model's logits (dtype-aware).
- `check_against_trained` (`trained`): against the TRAINED model, not against stepmerge's own outputs:
  PEFT's model of the run (its LoraConfig, ``all-linear`` when verl recorded no targets, PEFT's own
  rank/alpha patterns) rebuilt strictly from the checkpoint's un-merged tensors; the fused model and
  the adapter (on its ``base/``) must reproduce its logits. Over the memory budget: reported skipped.
Memory: tensors are read from their byte ranges (`storage.RangeReader`, local or remote) in chunks of
`CHUNK_BYTES`, never a whole model or even a whole tensor. A failed check is a result, not an
exception: only `ValidationReport.raise_for_failure` raises (`ValidationFailed`).

Modules: `report` (Check, ValidationReport), `weights` (an HF folder's weights, stage by stage),
`structure`, `compare` (the comparison and its tolerances), `forward` (the forward pass), `model`
(`validate_model`), `adapter` (`validate_adapter`), `trained` (`check_against_trained`), `staging`
(a local copy for transformers / PEFT).
"""

from __future__ import annotations

from merge_engine.layouts.hf import unsafe_file_name
from merge_engine.validate.compare import (
    LOGIT_TOLERANCE, WEIGHT_TOLERANCE, TensorSide, Tolerance, compare_tensors, compare_to_reference,
)
from merge_engine.validate.forward import default_device, fixed_token_ids, forward_check
from merge_engine.validate.model import validate_model
from merge_engine.validate.report import Check, ValidationReport
from merge_engine.validate.structure import CONFIG_FILE, expected_tensors, validate_structure
from merge_engine.validate.weights import CHUNK_BYTES

__all__ = [
    "CHUNK_BYTES", "CONFIG_FILE", "LOGIT_TOLERANCE", "WEIGHT_TOLERANCE", "Check", "TensorSide", "Tolerance",
    "ValidationReport", "compare_tensors", "compare_to_reference", "default_device", "expected_tensors",
    "fixed_token_ids", "forward_check", "unsafe_file_name", "validate_model", "validate_structure",
]
