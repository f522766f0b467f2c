"""Core attention through torch's scaled_dot_product_attention (flash / memory-efficient kernels on a GPU), as the
local spec's `core_attention` submodule: the fast baseline every mechanism uses (Depth-Attention mixes its values
first, then calls the same attention).

Megatron-core's own local DotProductAttention (baddbmm + a separate masked softmax + bmm, the [b, np, s, s] scores
in memory) stays available as `--attention-backend unfused`, the reference. Same interface, sizes, softmax scale,
dropout and checkpoint keys: this class only replaces its forward.

Under context parallelism (--context-parallel-size) it runs all-gather CP attention (megatron/context_parallel.py);
Megatron's own local attention refuses CP, so the unfused reference does too.
"""

from __future__ import annotations

import contextlib
import copy

import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from mega_depth.megatron import context_parallel
from mega_depth.model.mixing import expand_heads


class SDPAttention(DotProductAttention):
    def __init__(self, config, *args, **kwargs):
        cp_size = config.context_parallel_size
        if cp_size > 1:  # DotProductAttention asserts CP = 1 (its forward has no CP); this forward does
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, **kwargs)
        pg = kwargs.get("pg_collection")
        self.cp_group = (getattr(pg, "cp", None) if pg is not None else None) or \
            (parallel_state.get_context_parallel_group() if cp_size > 1 else None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, np, hn], key / value [sk, b, ng, hn] (GQA groups, or np) -> context [sq, b, np * hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias need --transformer-impl "
                                      "transformer_engine")
        mask_type = attn_mask_type or self.attn_mask_type
        if attention_mask is None and mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise NotImplementedError(f"SDPA core attention without a mask handles causal or no masks, not "
                                      f"{mask_type}")
        cp = self.cp_group is not None and self.cp_group.size() > 1
        if cp and attention_mask is not None:
            raise NotImplementedError("context parallelism here takes the causal mask; an explicit attention mask "
                                      "needs --transformer-impl transformer_engine")
        if key.shape[-2] != value.shape[-2]:  # Depth-Attention's per-query-head values: each key serves its group
            key = expand_heads(key, value.shape[-2])
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        # GQA natively: each key/value group serves consecutive query heads (Megatron's order, SDPA's too), with
        # no repeated copy of K and V
        gqa = q.shape[1] != k.shape[1]
        dropout = self.attention_dropout.p if self.training else 0.0
        # attention_mask (Megatron's convention): True where a position is masked out
        mask = None if attention_mask is None else ~attention_mask
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 and not self.config.sequence_parallel \
            else contextlib.nullcontext()
        with rng:
            if cp:
                out = context_parallel.attention(query, key, value, self.cp_group, scale=self.softmax_scale,
                                                 dropout_p=dropout)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
