"""Hugging Face configuration of an exported mega_depth depth-mixing model (loaded with trust_remote_code).

`residual` holds the mechanism's name and its own options (mega_depth/model/config.py: DecoderConfig), so a new
mechanism needs nothing here; `moe` the mixture-of-experts fields of an MoE model (the same names); and
`depth_mixing_inference` says how decoding computes the mixing (e.g. Block AttnRes's
exact two-phase form).
"""

from transformers import PretrainedConfig


class MegaDepthConfig(PretrainedConfig):
    model_type = "mega_depth_lm"  # must not clash with a built-in model type

    def __init__(self, vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=None, intermediate_size=1408, rms_norm_eps=1e-6, rope_theta=10000.0,
                 qk_layernorm=True, residual=None, depth_mixing_inference=None, tie_word_embeddings=True,
                 max_position_embeddings=4096, moe=None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.qk_layernorm = qk_layernorm
        self.residual = dict(residual or {"mechanism": "standard"})
        self.depth_mixing_inference = depth_mixing_inference
        self.max_position_embeddings = max_position_embeddings
        self.moe = dict(moe or {})  # mixture of experts: DecoderConfig's num_experts and moe_* fields; {}: dense
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
