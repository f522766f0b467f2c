"""The plain-PyTorch mega_depth decoder: the same model as the Megatron-core one, in one process, with a KV cache.

Serves the Hugging Face export (this folder is copied into the exported folder) and the torch-xla trainer. Its
state dict is the canonical one (Hugging Face Llama/Qwen3 names plus the mechanism's parameters under their own
module names); state_dict_adapter.py maps it to and from Megatron's. All depth mixing is the mechanism's
(registry.py); this file only supplies the host layer it runs on (base.py: attention_sublayer, mlp_sublayer).

Layout: activations [b, s, d]; attention heads [b, s, h, hn]. A cache object needs `update(key, value,
layer_idx) -> (keys, values)` over the sequence dim 2 of [b, h, s, hn] and `get_seq_length()` (Hugging Face's
DynamicCache fits). Depth state never enters the cache: it is per token and rebuilt within each forward
(Depth-Attention's mixed values are the cache's values).

Padding: a 2D attention_mask [b, past + s] (1 = real token, 0 = pad; Hugging Face's, left or right padded) removes
the pads from every query's keys; positions then count real tokens only. Depth mixing is per token, so a pad's own
mixing reaches a real token only through attention, which masks it. Every query keeps its own key (a left pad
would otherwise attend to nothing: NaN, which would leak through `0 * NaN` in later layers). Without a mask, or
with an all-ones one, the computation is exactly the unpadded one.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Relative imports: the same lines work in the package and in an exported Hugging Face folder, where
# transformers' remote-code loader follows `from .x import` lines to copy the files along.
from .base import normed
from .config import DecoderConfig
from .mlp import MLP
from .moe import MoEMLP


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

    def forward(self, x_q: Tensor, x_k: Tensor, x_v: Tensor, rope, cache=None, value_mixer=None,
                allowed: Optional[Tensor] = None) -> Tensor:
        """x_*: [b, s, d], already normalised (DCA feeds three different inputs; the others one, three times).
        allowed: None (causal over the cached prefix) or [b, 1, s, past + s] bool, True where a query may see a key
        (padding_mask)."""
        cfg = self.cfg
        b, s, _ = x_q.shape
        hn = cfg.head_dim
        raw_q = self.q_proj(x_q).view(b, s, -1, hn)
        raw_k = self.k_proj(x_k).view(b, s, -1, hn)
        v = self.v_proj(x_v).view(b, s, -1, hn)
        q_norm, k_norm = (self.q_norm, self.k_norm) if cfg.qk_layernorm else (nn.Identity(), nn.Identity())
        if value_mixer is None:
            q, k = q_norm(raw_q), k_norm(raw_k)
        else:  # Depth-Attention: this token's values mixed over earlier layers (the mixer applies the q/k norms)
            q, k, v = value_mixer(raw_q, raw_k, v, q_norm, k_norm)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, s, hn]
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        hq = q.shape[1]
        k = k.repeat_interleave(hq // k.shape[1], dim=1) if k.shape[1] != hq else k
        v = v.repeat_interleave(hq // v.shape[1], dim=1) if v.shape[1] != hq else v
        if allowed is None:
            # Causal over the cached prefix: query i (absolute position past + i) sees keys 0..past + i.
            past = k.shape[2] - s
            mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=past)
        else:
            if allowed.shape[-1] != k.shape[2]:
                raise ValueError(f"the attention mask covers {allowed.shape[-1]} keys but layer {self.layer} has "
                                 f"{k.shape[2]} (cached + current)")
            mask = allowed
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hn),
                                             dropout_p=cfg.attention_dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    """A Llama/Qwen3 layer (a Qwen3-MoE one where the config makes this layer MoE), plus the mechanism's modules for
    this layer (as named children)."""

    def __init__(self, cfg: DecoderConfig, layer: int, mechanism):
        super().__init__()
        self.cfg, self.layer_index = cfg, layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = MoEMLP(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.ffn_hidden_size)
        for name, module in mechanism.layer_modules(layer).items():
            self.add_module(name, module)


def padding_mask(attention_mask: Tensor, s: int, past: int):
    """(allowed [b, 1, s, past + s] bool, positions [b, s]) of a 2D padding mask over the cached and current tokens
    (1 = real, 0 = pad), or (None, None) when nothing is padded (the unpadded computation, exactly).

    allowed = causal & (key is real | key is the query itself): a pad never feeds a real token, and no query row is
    empty. positions = the number of real tokens before each one (Hugging Face's cumsum - 1; a left pad gets 0)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2D [batch, cached + current tokens] (1 = token, 0 = pad); got "
                         f"shape {tuple(attention_mask.shape)}")
    total = past + s
    if attention_mask.shape[1] != total:
        raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens but the cache holds {past} and the "
                         f"input {s}: pass the mask of all {total} tokens (cached + current), as generate does")
    real = attention_mask.bool()
    if bool(real.all()):
        return None, None
    query = torch.arange(past, total, device=real.device).unsqueeze(1)  # absolute positions [s, 1]
    key = torch.arange(total, device=real.device).unsqueeze(0)  # [1, total]
    allowed = (key <= query) & (real.unsqueeze(1) | (key == query))  # [b, s, total]
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    return allowed.unsqueeze(1), positions


class PlainHost:
    """The host a mechanism runs one layer on (base.py), bound to one forward call's RoPE tables, cache and padding
    mask (padding_mask; None: causal). Its twin for Megatron's layers: megatron/layer.py (MegatronHost)."""

    def __init__(self, layer: Layer, rope, cache, allowed: Optional[Tensor] = None):
        self._layer, self._rope, self._cache, self._allowed = layer, rope, cache, allowed
        self.layer_index = layer.layer_index

    def __getattr__(self, name):  # the mechanism's own modules
        return getattr(self._layer, name)

    def _dropout(self, x: Tensor) -> Tensor:
        return F.dropout(x, self._layer.cfg.hidden_dropout, self._layer.training)

    def attention_sublayer(self, x, k_in=None, v_in=None, value_mixer=None):
        norm = self._layer.input_layernorm
        q = normed(norm, x)
        k = q if k_in is None else norm(k_in)
        v = q if v_in is None else norm(v_in)
        return self._dropout(self._layer.self_attn(q, k, v, self._rope, self._cache, value_mixer, self._allowed))

    def attention_sublayer_recomputed(self, make_inputs, sources, remakes=False):
        q_in, k_in, v_in = make_inputs(*sources).unbind(0)  # no fast path here: the plain composition
        return self.attention_sublayer(q_in, k_in, v_in), q_in

    def mlp_sublayer(self, x):
        return self._dropout(self._layer.mlp(normed(self._layer.post_attention_layernorm, x)))


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.mechanism = cfg.mechanism()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i, self.mechanism) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        for name, module in self.mechanism.final_modules().items():
            self.add_module(name, module)

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None, cache=None,
                attention_mask: Optional[Tensor] = None) -> Tensor:
        """Final hidden states [b, s, d] (after the final norm). attention_mask: None or [b, past + s], 1 = token,
        0 = pad (left or right padding); positions default to the real tokens' count (padding_mask)."""
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        s = input_ids.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        allowed, mask_positions = (None, None) if attention_mask is None else padding_mask(attention_mask, s, past)
        if position_ids is None:
            position_ids = (mask_positions if allowed is not None
                            else torch.arange(past, past + s, device=input_ids.device).expand_as(input_ids))
        rope = rope_cos_sin(position_ids, cfg.head_dim, cfg.rotary_base, x.dtype)
        mech = self.mechanism
        hosts = [PlainHost(layer, rope, cache, allowed) for layer in self.layers]
        state = mech.run_layers(hosts, mech.initial_state(x))
        return self.norm(mech.final_hidden(state, self))


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

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None, cache=None,
                attention_mask: Optional[Tensor] = None) -> Tensor:
        return self.lm_head(self.model(input_ids, position_ids, cache, attention_mask))
