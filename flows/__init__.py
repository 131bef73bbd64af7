"""Prefect flows: merge one step (`merge_step`), merge every new step (`merge_new_steps`, scheduled),
release a LoRA adapter (`release_adapter`), verify every published release (`verify_releases`,
scheduled). Their stages are chained in plain code in `flows.stages` (`model_chain`, `adapter_chain`), and what a run did is a
record of `flows.outcomes`; parameters are pydantic models (`flows.params`). A deployed watcher
(`merge_new_steps` submitting to a deployment) imports neither torch nor transformers. `flows.cli` is the ``stepmerge`` console program: the engine's commands
plus ``notify`` (`flows.events`: the checkpoint-saved event).

A failed run's log names a user's error without its traceback (`flows.run_log`, installed here)."""

from flows import run_log as _run_log

_run_log.install()
