"""The Megatron-core host layer a mechanism runs on (mega_depth/model/base.py), and its attention.

`DepthMixingLayer` is Megatron's TransformerLayer with the mechanism's modules as children. It does not thread a
hidden state itself: the mechanism calls its two sublayers (`attention_sublayer`, `mlp_sublayer`: pre-norm,
Megatron's attention / MLP, hidden dropout) on inputs it forms from its cross-layer state.
`DepthMixingSelfAttention` is Megatron's SelfAttention with two hooks, both off unless one call sets them:
query/key/value projected from separate inputs (DCA; megatron/qkv_projection.py) and a value mixer
(Depth-Attention).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from mega_depth.kernels import grad_sink
from mega_depth.megatron.attention import SDPAttention
from mega_depth.megatron.norm import RMSNorm, fused_applies
from mega_depth.megatron.qkv_projection import RecomputedQKVProjection, RemadeQKVProjection, project_separate
from mega_depth.model.base import normed
from mega_depth.model.mixing import expand_heads


@dataclass
class AttentionHooks:
    qkv: Optional[tuple] = None  # projected (query [s, b, np, hn], raw key [s, b, ng, hn], value [s, b, ng, hn])
    # (raw_query, raw_key, value, query_norm, key_norm) -> (query, key, value): normalised, values mixed
    value_mixer: Optional[Callable] = None


class DepthMixingSelfAttention(SelfAttention):
    def __init__(self, config, submodules, layer_number, attn_mask_type=None, cp_comm_type=None,
                 pg_collection=None, values_per_query_head: bool = False):
        kwargs = {} if attn_mask_type is None else {"attn_mask_type": attn_mask_type}
        super().__init__(config, submodules, layer_number, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         **kwargs)
        self.hooks: Optional[AttentionHooks] = None
        self.values_per_query_head = (
            values_per_query_head and self.num_query_groups_per_partition < self.num_attention_heads_per_partition
        )
        if self.values_per_query_head:
            # Values with one head per query head give every query head its own key too: the core attention runs
            # as multi-head attention (the same trick Megatron uses when TP > query groups).
            mha_config = copy.deepcopy(self.config)
            mha_config.num_query_groups = mha_config.num_attention_heads
            self.core_attention = submodules.core_attention(
                config=mha_config, layer_number=self.layer_number, attn_mask_type=self.attn_mask_type,
                attention_type=self.attention_type, cp_comm_type=cp_comm_type,
                softmax_scale=self.config.softmax_scale, pg_collection=self.pg_collection,
            )

    def _split_heads(self, mixed: torch.Tensor):
        """[s, b, ng*(r+2)*hn] -> query [s, b, np, hn], key [s, b, ng, hn], value [s, b, ng, hn]."""
        hn, ng = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
        r = self.num_attention_heads_per_partition // ng
        mixed = mixed.view(*mixed.shape[:-1], ng, (r + 2) * hn)
        query, key, value = torch.split(mixed, [r * hn, hn, hn], dim=-1)
        return query.reshape(*query.shape[:2], -1, hn), key, value

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        hooks = self.hooks
        if hooks is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        if hooks.qkv is not None:
            query, raw_key, value = hooks.qkv
        else:
            mixed, _ = self.linear_qkv(hidden_states)
            query, raw_key, value = self._split_heads(mixed)
        query_norm = self.q_layernorm if self.q_layernorm is not None else IdentityOp()
        key_norm = self.k_layernorm if self.k_layernorm is not None else IdentityOp()
        if hooks.value_mixer is None:
            return query_norm(query), key_norm(raw_key), value
        # the mixer normalises the query and key (once: it needs them too) and mixes the values
        query, key, value = hooks.value_mixer(query, raw_key, value, query_norm, key_norm)
        if value.shape[-2] != key.shape[-2] and not isinstance(self.core_attention, SDPAttention):
            # per-query-head values: the keys follow (SDPA repeats them itself, after RoPE: half the rotary
            # traffic of repeating them here)
            key = expand_heads(key, value.shape[-2])
        return query, key, value


class DepthMixingLayer(TransformerLayer):
    """A TransformerLayer whose two sublayers a mechanism calls (see module doc); holds the mechanism's modules."""

    def __init__(self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None, vp_stage=None,
                 mechanism=None):
        super().__init__(config, submodules, layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.layer_index = self.layer_number - 1  # 0-based global
        for name, module in mechanism.layer_modules(self.layer_index, config.params_dtype).items():
            self.add_module(name, module)
        mark_replicated(self, mechanism, config)

    def bind(self, layer_kwargs: dict) -> "MegatronHost":
        """The host for one forward call (attention mask, RoPE, ... of this micro-batch)."""
        return MegatronHost(self, layer_kwargs)

    def forward(self, *args, **kwargs):
        raise RuntimeError("DepthMixingLayer is driven by its mechanism through DepthMixingBlock, not called")


class MegatronHost:
    """The host a mechanism runs one Megatron layer on (model/base.py), bound to one forward call's attention mask,
    RoPE and the rest of this micro-batch's layer arguments. Its twin for the plain decoder: model/decoder.py."""

    def __init__(self, layer: DepthMixingLayer, layer_kwargs: dict):
        self._layer, self._kwargs = layer, layer_kwargs
        self.layer_index = layer.layer_index

    def __getattr__(self, name):  # the mechanism's own modules
        return getattr(self._layer, name)

    def _dropout(self, out, bias):
        out = out if bias is None else out + bias
        return F.dropout(out, self._layer.hidden_dropout, self._layer.training)

    def attention_sublayer(self, x, k_in=None, v_in=None, value_mixer=None):
        layer = self._layer
        if k_in is not None:  # DCA: three inputs, each normalised and met by its rows of linear_qkv
            qkv = project_separate(layer.self_attention, layer.input_layernorm, x, k_in, v_in)
            return self._attention(x, AttentionHooks(qkv=qkv))
        hooks = None if value_mixer is None else AttentionHooks(value_mixer=value_mixer)
        return self._attention(normed(layer.input_layernorm, x), hooks)

    def attention_sublayer_recomputed(self, make_inputs, sources, remakes=False):
        layer = self._layer
        if torch.compiler.is_compiling():  # in a compiled layer: the same recomputation, as Dynamo traces it
            return self._attention_recomputed_compiled(make_inputs, sources)
        lin, norm = layer.self_attention.linear_qkv, layer.input_layernorm
        sources = grad_sink.aliased(sources)  # the regions of all layers add into one gradient buffer per source
        if remakes and isinstance(norm, RMSNorm) and fused_applies(sources[0]) and torch.is_grad_enabled():
            qkv_in = make_inputs(*sources)  # its node keeps the sources; the Function makes them again
            q_in, *qkv = RemadeQKVProjection.apply(layer.self_attention, norm.eps, make_inputs, norm.weight,
                                                   lin.weight, getattr(lin, "bias", None), qkv_in, *sources)
        else:
            q_in, *qkv = RecomputedQKVProjection.apply(layer.self_attention, norm, make_inputs, lin.weight,
                                                       getattr(lin, "bias", None), *sources)
        return self._attention(q_in, AttentionHooks(qkv=tuple(qkv))), q_in

    def _attention_recomputed_compiled(self, make_inputs, sources):
        """attention_sublayer_recomputed inside a compiled layer: the inputs, their norms and the projection under
        non-reentrant activation checkpointing (RecomputedQKVProjection's own backward is opaque to Dynamo).
        AOTAutograd recomputes in backward what the projection's backward needs (the normalised inputs), not the
        projection itself, whose output backward does not read."""
        from torch.utils.checkpoint import checkpoint

        attention, norm = self._layer.self_attention, self._layer.input_layernorm

        def project(*tensors):
            q_in, k_in, v_in = make_inputs(*tensors).unbind(0)
            return (q_in, *project_separate(attention, norm, q_in, k_in, v_in))

        q_in, *qkv = checkpoint(project, *sources, use_reentrant=False, preserve_rng_state=False)
        return self._attention(q_in, AttentionHooks(qkv=tuple(qkv))), q_in

    def _attention(self, hidden, hooks):
        """Megatron's attention on `hidden` [s(/tp), b, h] (normalised; only a stand-in when hooks.qkv is set)."""
        kw, attention = self._kwargs, self._layer.self_attention
        attention.hooks = hooks
        try:
            out, bias = attention(hidden, attention_mask=kw.get("attention_mask"),
                                  rotary_pos_emb=kw.get("rotary_pos_emb"), attention_bias=kw.get("attention_bias"),
                                  packed_seq_params=kw.get("packed_seq_params"))
        finally:
            attention.hooks = None
        return self._dropout(out, bias)

    def mlp_sublayer(self, x):
        out, bias = self._layer.mlp(normed(self._layer.pre_mlp_layernorm, x))
        return self._dropout(out, bias)


def mark_replicated(module: torch.nn.Module, mechanism, config) -> None:
    """A mechanism's parameters are replicated across TP ranks: under SP each rank sees a different slice of the
    sequence, so their grads are all-reduced over TP exactly like Megatron's norm weights (`sequence_parallel`)."""
    for name, param in module.named_parameters():
        if mechanism.owns(name):
            param.sequence_parallel = config.sequence_parallel
