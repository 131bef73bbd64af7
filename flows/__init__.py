"""Prefect flows: merge one step (`merge_step`), merge every new step (`merge_new_steps`, scheduled),
release a LoRA adapter (`release_adapter`), verify every published release (`verify_releases`,
scheduled). Their stages are declared by name in `flows.stages.CHAINS`; parameters are pydantic
models (`flows.params`). `flows.cli` is the ``stepmerge`` console program: the engine's commands
plus ``notify`` (`flows.events`: the checkpoint-saved event)."""
