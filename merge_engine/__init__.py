"""stepmerge's engine: distributed training checkpoints -> exact Hugging Face models. No Prefect here."""

__version__ = "0.1.0"
