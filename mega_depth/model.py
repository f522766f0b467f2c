"""The plain-PyTorch mega_depth decoder: the same model as the Megatron-core one, in one process, with a KV cache.

Used by the Hugging Face export (copied next to py into the exported folder) and by the torch-xla path.
Its state dict is the canonical one (Hugging Face Llama/Qwen3 names plus the depth-mixing parameters); the
Megatron <-> canonical mapping is mega_depth/megatron/state_dict.py. All depth mixing comes from mixing.py.

Layout: activations are [b, s, d]; attention heads [b, s, h, hn]. A cache object needs `update(key, value,
layer_idx) -> (keys, values)` over the sequence dim 2 of [b, h, s, hn] and `get_seq_length()` (Hugging Face's
DynamicCache fits). Depth state never enters the cache: it is per token and rebuilt within each forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Relative import: the same line works in the package and in an exported Hugging Face folder, where
# transformers' remote-code loader follows `from .x import` lines to copy py along.
from .mixing import (AttnResLayout, AttnResMixer, DCAState, DepthAttentionState, GRN, attnres_two_phase_block,
                     dca_block, dca_num_sources, depth_attention_mix)


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    norm_epsilon: float = 1e-6
    rotary_base: float = 10000.0
    qk_layernorm: bool = True
    tie_word_embeddings: bool = True
    residual: str = "standard"
    attnres_num_blocks: Optional[int] = None
    dca_last_k: Optional[int] = None
    dca_grn: str = "v3"
    depth_attn_stride: Optional[int] = None
    depth_attn_window: int = 1
    depth_attn_gqa: str = "query"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Llama/Qwen3 RMSNorm (normalise in fp32, cast back, scale): the same formula as the Megatron spec's."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, base: float, dtype) -> tuple:
    """Megatron's non-interleaved RoPE (= Hugging Face rotate_half): positions [b, s] -> cos, sin [b, s, 1, hn]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        hq, hkv, hn, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(d, hq * hn, bias=False)
        self.k_proj = nn.Linear(d, hkv * hn, bias=False)
        self.v_proj = nn.Linear(d, hkv * hn, bias=False)
        self.o_proj = nn.Linear(hq * hn, d, bias=False)
        if cfg.qk_layernorm:
            self.q_norm = RMSNorm(hn, cfg.norm_epsilon)
            self.k_norm = RMSNorm(hn, cfg.norm_epsilon)

    def forward(self, x_q: Tensor, x_k: Tensor, x_v: Tensor, rope, cache=None, depth=None) -> Tensor:
        """x_*: [b, s, d] (DCA feeds three different inputs; the others pass the same one three times)."""
        cfg = self.cfg
        b, s, _ = x_q.shape
        hn = cfg.head_dim
        q = self.q_proj(x_q).view(b, s, -1, hn)
        raw_k = self.k_proj(x_k).view(b, s, -1, hn)
        v = self.v_proj(x_v).view(b, s, -1, hn)
        if cfg.qk_layernorm:
            q, k = self.q_norm(q), self.k_norm(raw_k)
        else:
            k = raw_k
        if depth is not None:  # Depth-Attention: mix this token's values over earlier layers (py)
            key_norm = self.k_norm if cfg.qk_layernorm else (lambda t: t)
            cand_k, cand_v = depth.candidates(self.layer, cfg.depth_attn_stride, cfg.depth_attn_window)
            v = depth_attention_mix(q, k, v, cand_k, cand_v, key_norm, cfg.depth_attn_gqa,
                                           record_key=("depth-attention", self.layer))
            depth.store(self.layer, raw_k, v, cfg.num_layers, cfg.depth_attn_stride, cfg.depth_attn_window)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, s, hn]
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        hq = q.shape[1]
        k = k.repeat_interleave(hq // k.shape[1], dim=1) if k.shape[1] != hq else k
        v = v.repeat_interleave(hq // v.shape[1], dim=1) if v.shape[1] != hq else v
        # Causal over the cached prefix: query i (absolute position past + i) sees keys 0..past + i.
        past = k.shape[2] - s
        mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hn))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = MLP(cfg)
        if cfg.residual == "attnres":
            self.attn_mixer = AttnResMixer(cfg.hidden_size, cfg.norm_epsilon)
            self.mlp_mixer = AttnResMixer(cfg.hidden_size, cfg.norm_epsilon)
        elif cfg.residual == "dca":
            self.grn_qkv = GRN(cfg.hidden_size, dca_num_sources(layer + 1, cfg.dca_last_k),
                                      cfg.dca_grn, count=3)

    def attention_sublayer(self, h: Tensor, rope, cache) -> Tensor:
        x = self.input_layernorm(h)
        return self.self_attn(x, x, x, rope, cache)

    def mlp_sublayer(self, h: Tensor) -> Tensor:
        return self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        if cfg.residual == "attnres":
            self.final_mixer = AttnResMixer(cfg.hidden_size, cfg.norm_epsilon)
        elif cfg.residual == "dca":
            self.final_grn = GRN(cfg.hidden_size, dca_num_sources(cfg.num_layers + 1, cfg.dca_last_k),
                                        cfg.dca_grn, count=1)

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None, cache=None) -> Tensor:
        """Final hidden states [b, s, d] (after the final norm)."""
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        rope = rope_cos_sin(position_ids, cfg.head_dim, cfg.rotary_base, x.dtype)
        run = {"standard": self._standard, "attnres": self._attnres, "dca": self._dca,
               "depth-attention": self._depth_attention}[cfg.residual]
        return self.norm(run(x, rope, cache))

    def _standard(self, x, rope, cache):
        for layer in self.layers:
            x = x + layer.attention_sublayer(x, rope, cache)
            x = x + layer.mlp_sublayer(x)
        return x

    def _attnres(self, x, rope, cache):
        L = 2 * self.cfg.num_layers
        layout = AttnResLayout(L, self.cfg.attnres_num_blocks or L)
        sublayers = []  # (function f(h) -> output, mixer) in depth order
        for layer in self.layers:
            sublayers.append((lambda h, l=layer: l.attention_sublayer(h, rope, cache), layer.attn_mixer))
            sublayers.append((lambda h, l=layer: l.mlp_sublayer(h), layer.mlp_mixer))
        blocks = [x]
        for n in range(1, layout.num_blocks + 1):  # exact two-phase computation, one block at a time
            members = sublayers[layout.block_start(n) - 1: layout.block_end(n)]
            outputs = attnres_two_phase_block(torch.stack(blocks), [f for f, _ in members],
                                                     [m for _, m in members])
            blocks.append(torch.stack(outputs).sum(0))
        return self.final_mixer(torch.stack(blocks))

    def _dca(self, x, rope, cache):
        state = DCAState.from_embedding(self.cfg.dca_last_k, x)
        for layer in self.layers:
            def attention(q_in, k_in, v_in, l=layer):
                norm = l.input_layernorm
                return l.self_attn(norm(q_in), norm(k_in), norm(v_in), rope, cache)

            dca_block(state, layer.grn_qkv, attention, layer.mlp_sublayer)
        return self.final_grn(state.stack())[0]

    def _depth_attention(self, x, rope, cache):
        depth = DepthAttentionState(hidden=x)
        for layer in self.layers:
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, h, h, rope, cache, depth=depth)
            x = x + layer.mlp_sublayer(x)
        return x


class CausalLM(nn.Module):
    """Decoder + LM head (tied to the embedding unless the config unties them)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head. Call again after moving to a device whose tensors cannot be
        converted in place (XLA): Module.to() then makes a new Parameter per module and unties them."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None, cache=None) -> Tensor:
        return self.lm_head(self.model(input_ids, position_ids, cache))
