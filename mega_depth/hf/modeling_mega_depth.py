"""Hugging Face model of an exported mega_depth depth-mixing model: a thin wrapper of mega_depth's plain decoder.

In an exported folder the decoder, the mechanisms and the math sit beside this file (tools/convert_to_hf.py copies
mega_depth/model/*.py there; transformers' remote-code loader follows the `from .x import` lines). Inside the
package the same names come from mega_depth.model.
"""

from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

_OUTPUT_FIELDS = CausalLMOutputWithPast.__dataclass_fields__

try:  # an exported folder: the files beside this one
    from .configuration_mega_depth import MegaDepthConfig
    from .config import DecoderConfig
    from .decoder import Decoder
except ImportError:  # inside the package
    from mega_depth.hf.configuration_mega_depth import MegaDepthConfig
    from mega_depth.model.config import DecoderConfig
    from mega_depth.model.decoder import Decoder


def decoder_config(config: MegaDepthConfig) -> DecoderConfig:
    return DecoderConfig.from_dict(dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
        ffn_hidden_size=config.intermediate_size, norm_epsilon=config.rms_norm_eps, rotary_base=config.rope_theta,
        qk_layernorm=config.qk_layernorm, tie_word_embeddings=config.tie_word_embeddings,
        residual=config.residual, **getattr(config, "moe", {})))


class MegaDepthForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegaDepthConfig
    base_model_prefix = "model"
    _no_split_modules = ["Layer"]
    # the routers' expert bias stays fp32 in a bf16 model, as Megatron keeps it ("to avoid routing errors"): its
    # updates are smaller than bf16's steps near its values
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegaDepthConfig):
        super().__init__(config)
        self.model = Decoder(decoder_config(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, labels=None, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None and not isinstance(cache, DynamicCache):
            # a static (or sliding-window) cache returns its whole preallocated length of keys, which the
            # attention's causal mask, sized by the keys it gets, would read as real ones: wrong logits, silently
            raise ValueError(f"the mega_depth model takes a DynamicCache (the default), not {type(cache).__name__}: "
                             "drop cache_implementation from generate(), or pass past_key_values=DynamicCache()")
        # Padded batches (left or right): attention_mask [b, cached + current] (1 = token, 0 = pad) masks the pads'
        # keys and, without position_ids, numbers the real tokens from 0 (decoder.py: padding_mask). An all-ones mask
        # is the unpadded computation, exactly.
        hidden = self.model(input_ids, position_ids, cache if use_cache or cache is not None else None, attention_mask)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) and logits_to_keep else slice(None)
        logits = self.lm_head(hidden[:, keep])
        loss = None
        if labels is not None:
            # transformers' own causal-LM loss, as its native models call it: given num_items_in_batch (the Trainer
            # passes it to a forward that takes **kwargs, and then does not divide by the accumulation steps) it
            # sums and divides by the window's label count, else it is the mean over the non-ignored labels
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        # transformers 5 names the output's cache `cache` (`past_key_values` warns); older releases the other way
        cache_field = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{cache_field: cache if use_cache else None})
