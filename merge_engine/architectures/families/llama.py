"""Llama: the plain dense decoder. Its names are the base the other dense families build on."""

from merge_engine.architectures.mappings import FamilyTable, GatedMLPMapping, QKVMapping, VocabMapping

# Megatron name -> Hugging Face name, same values (``*`` = layer index)
DIRECT = {
    "decoder.layers.*.input_layernorm.weight": "model.layers.*.input_layernorm.weight",
    "decoder.layers.*.self_attention.linear_proj.weight": "model.layers.*.self_attn.o_proj.weight",
    "decoder.layers.*.pre_mlp_layernorm.weight": "model.layers.*.post_attention_layernorm.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}
DENSE_MLP_DIRECT = {
    "decoder.layers.*.mlp.linear_fc2.weight": "model.layers.*.mlp.down_proj.weight",
}

EMBEDDINGS = (
    # padded vocabulary rows trimmed to config.vocab_size
    VocabMapping("embedding.word_embeddings.weight", hf_name="model.embed_tokens.weight"),
    # absent from the release when config.tie_word_embeddings
    VocabMapping("output_layer.weight", hf_name="lm_head.weight", head=True),
)
# rows grouped per query group [q heads; k; v] (GQA)
QKV = QKVMapping("decoder.layers.*.self_attention.linear_qkv.weight", q="model.layers.*.self_attn.q_proj.weight",
                 k="model.layers.*.self_attn.k_proj.weight", v="model.layers.*.self_attn.v_proj.weight")
QKV_BIAS = QKVMapping("decoder.layers.*.self_attention.linear_qkv.bias", q="model.layers.*.self_attn.q_proj.bias",
                      k="model.layers.*.self_attn.k_proj.bias", v="model.layers.*.self_attn.v_proj.bias")
# [gate; up] in one linear_fc1
GATE_UP = GatedMLPMapping("decoder.layers.*.mlp.linear_fc1.weight", gate="model.layers.*.mlp.gate_proj.weight",
                          up="model.layers.*.mlp.up_proj.weight")

TABLE = FamilyTable(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    direct={**DIRECT, **DENSE_MLP_DIRECT},
    special=(
        *EMBEDDINGS,
        QKV,
        QKVMapping(QKV_BIAS.megatron, q=QKV_BIAS.q, k=QKV_BIAS.k, v=QKV_BIAS.v, requires="attention_bias"),
        GATE_UP,
    ),
)
