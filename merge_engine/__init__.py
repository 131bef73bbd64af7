"""stepmerge's engine: distributed training checkpoints -> exact Hugging Face models. No Prefect here.

Layers, each importing only from those below it (checked by ``tests/test_layers.py``):
``cli`` -> ``jobs`` (merge, split, lora.extract, lora.combine; ``output_target``, ``writer``) ->
``planner``, ``discovery`` -> the planners (``hf_plan``, ``architectures.megatron_to_hf``, ``lora``,
``stored_aliases``) -> ``layouts``, ``architectures`` -> ``merge_plan``, ``output_heads``, the readers
(``torch_archive`` with ``zip_crc``), ``tensor_source`` ->
``storage``, ``errors``. The README's layout section maps the modules.
"""

__version__ = "0.1.0"
