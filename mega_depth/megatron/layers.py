"""Megatron-core layers that read and write a depth-mixing state. The math is in mega_depth.mixing.

`DepthMixingSelfAttention` is Megatron's SelfAttention with two hooks, both off unless the layer sets them for
one call: DCA's separate query/key/value inputs, and Depth-Attention's value mixing.
`DepthMixingLayer` is Megatron's TransformerLayer driven by a state object instead of a hidden state:
- attnres: each sublayer's input is the AttnRes mix of the state's sources, its output is recorded;
- dca: one DCA block (three GRNs -> Q/K/V inputs, f = a + m);
- depth-attention: Megatron's own layer math on the residual stream, with depth-mixed values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from mega_depth import mixing
from mega_depth.config import ResidualConfig


@dataclass
class DepthAttentionCall:
    """What one Depth-Attention layer needs for one forward: the state and the candidate settings."""

    state: mixing.DepthAttentionState
    layer: int  # 0-based global layer index
    num_layers: int
    stride: Optional[int]
    window: int
    gqa_mode: str


@dataclass
class AttentionHooks:
    qkv_inputs: Optional[tuple] = None  # DCA: normalised (q_in, k_in, v_in), each [s(/tp), b, h]
    depth: Optional[DepthAttentionCall] = None


class DepthMixingSelfAttention(SelfAttention):
    def __init__(self, config, submodules, layer_number, attn_mask_type=None, cp_comm_type=None,
                 pg_collection=None, depth_attn_query_heads: bool = False):
        kwargs = {} if attn_mask_type is None else {"attn_mask_type": attn_mask_type}
        super().__init__(config, submodules, layer_number, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         **kwargs)
        self.hooks: Optional[AttentionHooks] = None
        self.values_per_query_head = (
            depth_attn_query_heads and self.num_query_groups_per_partition < self.num_attention_heads_per_partition
        )
        if self.values_per_query_head:
            # Per-query-head depth mixing gives every query head its own value (and so its own key): the core
            # attention runs as multi-head attention (the same trick Megatron uses when TP > query groups).
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

    def _project_separate(self, q_in, k_in, v_in):
        """QKV projection with a different input for each of Q, K and V, at the FLOPs of one projection.

        The fused weight's rows are [ng, q heads of the group | k | v, hn]; each input meets only its rows. The
        inputs take the column-parallel input path of linear_qkv (all-gather under SP, identity under TP).
        """
        hn, ng = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
        r = self.num_attention_heads_per_partition // ng
        lin = self.linear_qkv
        x = torch.cat([q_in, k_in, v_in], dim=1)  # [s(/tp), 3b, h]
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
        elif self.world_size > 1:
            x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        xq, xk, xv = x.chunk(3, dim=1)
        w = lin.weight.view(ng, r + 2, hn, -1)
        b = lin.bias.view(ng, r + 2, hn) if getattr(lin, "bias", None) is not None else None
        out = []
        for xi, rows in ((xq, slice(0, r)), (xk, slice(r, r + 1)), (xv, slice(r + 1, r + 2))):
            wi = w[:, rows].reshape(-1, w.shape[-1])
            bi = b[:, rows].reshape(-1) if b is not None else None
            out.append(F.linear(xi, wi, bi).view(*xi.shape[:2], -1, hn))
        return out[0], out[1], out[2]

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        hooks = self.hooks
        if hooks is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        if hooks.qkv_inputs is not None:
            query, raw_key, value = self._project_separate(*hooks.qkv_inputs)
        else:
            mixed, _ = self.linear_qkv(hidden_states)
            query, raw_key, value = self._split_heads(mixed)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        key = self.k_layernorm(raw_key) if self.k_layernorm is not None else raw_key
        if hooks.depth is not None:
            call = hooks.depth
            key_norm = self.k_layernorm if self.k_layernorm is not None else IdentityOp()
            cand_keys, cand_values = call.state.candidates(call.layer, call.stride, call.window)
            mix = mixing.kernel(mixing.depth_attention_mix)
            value = mix(query, key, value, cand_keys, cand_values, key_norm, call.gqa_mode,
                        record_key=("depth-attention", call.layer))
            call.state.store(call.layer, raw_key, value, call.num_layers, call.stride, call.window)
            if self.values_per_query_head:
                key = mixing._expand_heads(key, query.shape[-2])
        return query, key, value


class DepthMixingLayer(TransformerLayer):
    """A TransformerLayer whose forward reads and updates a depth-mixing state (see module doc)."""

    def __init__(self, config, submodules, layer_number=1, hidden_dropout=None, pg_collection=None, vp_stage=None,
                 residual: Optional[ResidualConfig] = None):
        super().__init__(config, submodules, layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.residual = residual
        d, dtype = config.hidden_size, config.params_dtype
        if residual.residual == "attnres":
            self.attn_mixer = mixing.AttnResMixer(d, config.layernorm_epsilon, dtype)
            self.mlp_mixer = mixing.AttnResMixer(d, config.layernorm_epsilon, dtype)
        elif residual.residual == "dca":
            sources = mixing.dca_num_sources(self.layer_number, residual.dca_last_k)
            self.grn_qkv = mixing.GRN(d, sources, residual.dca_grn, count=3, dtype=dtype)
        mark_replicated(self, config)

    def _attention(self, x, kwargs, hooks: Optional[AttentionHooks] = None):
        self.self_attention.hooks = hooks
        try:
            out, bias = self.self_attention(
                x, attention_mask=kwargs.get("attention_mask"), rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                attention_bias=kwargs.get("attention_bias"), packed_seq_params=kwargs.get("packed_seq_params"),
            )
        finally:
            self.self_attention.hooks = None
        return out if bias is None else out + bias

    def _dca_attention(self, q_in, k_in, v_in, kwargs):
        """Attention whose query, key and value come from their own GRN, each with the layer's pre-norm."""
        norm = self.input_layernorm
        q, k, v = norm(q_in), norm(k_in), norm(v_in)
        return self._attention(q, kwargs, AttentionHooks(qkv_inputs=(q, k, v)))

    def _mlp(self, x):
        out, bias = self.mlp(self.pre_mlp_layernorm(x))
        return out if bias is None else out + bias

    def forward(self, state, **kwargs):
        kind = self.residual.residual
        if kind == "attnres":
            h = self.attn_mixer(state.sources())
            state.record(self._attention(self.input_layernorm(h), kwargs))
            state.record(self._mlp(self.mlp_mixer(state.sources())))
        elif kind == "dca":
            mixing.dca_block(state, self.grn_qkv, lambda q, k, v: self._dca_attention(q, k, v, kwargs), self._mlp)
        elif kind == "depth-attention":
            r = self.residual
            self.self_attention.hooks = AttentionHooks(depth=DepthAttentionCall(
                state, self.layer_number - 1, self.config.num_layers, r.depth_attn_stride, r.depth_attn_window,
                r.depth_attn_gqa,
            ))
            try:
                state.hidden, _ = super().forward(hidden_states=state.hidden, **kwargs)
            finally:
                self.self_attention.hooks = None
        else:
            raise ValueError(f"DepthMixingLayer does not handle residual {kind!r}")
        return state


def mark_replicated(module: torch.nn.Module, config) -> None:
    """Depth-mixing parameters are replicated across TP ranks: under SP each rank sees a different slice of the
    sequence, so their grads are all-reduced over TP exactly like Megatron's norm weights (`sequence_parallel`)."""
    for name, param in module.named_parameters():
        if any(key in name for key in ("_mixer.", "grn_", "final_grn.")):
            param.sequence_parallel = config.sequence_parallel
