"""The plan records and the Hub's format: what every planner fills (`MergePlan`) and the rules each applies; the
planners themselves sit above (`merge_engine.architectures.megatron_to_hf`, `merge_engine.lora.checkpoint`, and
`merge_engine.planner`, which picks one).

- `merge_plan`        `MergePlan`: every output tensor (name, shape, dtype, how to build it) and its shard
- `hf_plan`           the plan of a source whose tensors already carry Hugging Face names
- `output_heads`      the tied / untied output-head rules every planner applies, once
- `model_heads`       a model's input embedding and output head, named by the model itself
- `stored_aliases`    names that share stored bytes: an output never holds more than the input justifies
- `config_shapes`     whether ``config.json`` agrees with the tensors, checked before anything is written
- `model_shapes`      every tensor's shape in transformers' own model of a config (meta device), kept per config
- `hub_format`        Hub-format output: the names and per-expert tensors of the Hub checkpoint
- `hub_config`        the Hub folder's ``config.json``, with the keys transformers 4.x reads
- `hub_config_memo`   `hub_config`'s answer kept on disk per config: a run's next step asks transformers nothing
- `transformers_conversion`  transformers' own weight-name conversion, read from the installed package
"""
