"""The bookkeeping files trainers write beside a model's config: never part of a release.

A trainer's step folder is often the folder that holds the model's ``config.json`` (HF Trainer's
``checkpoint-N/``, a run root holding Megatron's tracker), so its own files sit next to the tokenizer. They are the
training's state, scripts and pointers, not the model's: `TRAINER_FILES` names them, one row each (a file name or an
`fnmatch` pattern, the trainer that writes it, what it is), and `trainer_file` says which row a name matches.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import NamedTuple


class TrainerFile(NamedTuple):
    """One kind of trainer bookkeeping file: ``pattern`` (exact name or `fnmatch` pattern, case-sensitive), the
    ``trainer`` that writes it and ``what`` it holds."""

    pattern: str
    trainer: str
    what: str


TRAINER_FILES: tuple[TrainerFile, ...] = (
    TrainerFile("trainer_state.json", "HF Trainer", "the training state, step and log history"),
    TrainerFile("training_args.bin", "HF Trainer", "the pickled training arguments"),
    TrainerFile("optimizer.pt", "HF Trainer", "the optimizer state"),
    TrainerFile("scheduler.pt", "HF Trainer", "the learning-rate scheduler state"),
    TrainerFile("scaler.pt", "HF Trainer / Accelerate", "the mixed-precision grad scaler state"),
    TrainerFile("rng_state.pth", "HF Trainer", "the random number generator states"),
    TrainerFile("rng_state_*.pth", "HF Trainer", "a rank's random number generator states"),
    TrainerFile("random_states_*.pkl", "Accelerate", "a rank's pickled random number generator states"),
    TrainerFile("optimizer*.bin", "Accelerate", "the optimizer state"),
    TrainerFile("scheduler*.bin", "Accelerate", "the learning-rate scheduler state"),
    TrainerFile("sampler*.bin", "Accelerate", "the data sampler state"),
    TrainerFile("dl_state_dict*.bin", "Accelerate", "the data loader state"),
    TrainerFile("custom_checkpoint_*.pkl", "Accelerate", "a registered object's pickled state"),
    TrainerFile("latest", "DeepSpeed", "the tag of the last save"),
    TrainerFile("latest_universal", "DeepSpeed", "the tag of the last universal checkpoint"),
    TrainerFile("zero_to_fp32.py", "DeepSpeed", "its consolidation script"),
    TrainerFile("zero_to_torch.py", "DeepSpeed", "its consolidation script"),
    TrainerFile("latest_checkpointed_iteration.txt", "Megatron-LM / verl", "the tracker of the last iteration"),
    TrainerFile("ckpt_contents.json", "verl", "the marker of what a step saved"),
    TrainerFile("training_info.json", "NeMo-RL", "the training state of a step"),
    TrainerFile("run_config.yaml", "Megatron-Bridge", "the run's configuration"),
    TrainerFile("train_state.pt", "Megatron-Bridge", "the training state of a step"),
)


def trainer_file(name: str) -> TrainerFile | None:
    """The `TRAINER_FILES` row the top-level file ``name`` matches, None when it is no trainer's bookkeeping."""
    for row in TRAINER_FILES:
        if fnmatchcase(name, row.pattern):
            return row
    return None


__all__ = ["TRAINER_FILES", "TrainerFile", "trainer_file"]
