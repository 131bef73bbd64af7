"""Prefect flows: merge one step (`merge_step`), merge every new step (`merge_new_steps`, scheduled),
release a LoRA adapter (`release_adapter`). Parameters are pydantic models (`flows.params`)."""
