"""Megatron-core (full, TP=1 layout) <-> canonical parameter names and layouts (the plain decoder / Hugging Face).

Megatron fuses q/k/v into linear_qkv with rows [query group g: its r query heads | k | v] x head_dim, and gate/up
into linear_fc1 ([gate; up]); the canonical form splits them like Hugging Face's Llama/Qwen3. An MoE layer's MLP
takes Qwen3-MoE's names: mlp.router -> mlp.gate (its expert bias: gate.e_score_correction_bias, DeepSeek-V3's
name), mlp.experts.local_experts.<e> -> mlp.experts.<e> (global expert indices, as in a full checkpoint) and
mlp.shared_experts -> mlp.shared_expert. A mechanism's
parameters keep their names (`layers.<i>.<module>.*`, `final_*` at the decoder end) on both sides. Pure
re-layout, no Megatron import: to_canonical(from_canonical(x)) == x bit for bit.
"""

from __future__ import annotations

import re
from typing import Dict

import torch
from torch import Tensor

from .config import DecoderConfig
from .registry import owner_of

_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_TOP_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_FUSED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_ROUTER = {"mlp.router.weight": "mlp.gate.weight", "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"}
# Megatron's names of a routed expert's weights, in one place (the builder, the checkpoint reader and this adapter):
# per-expert modules `mlp.experts.local_experts.<e>.linear_fc1.weight` (the local index on an expert-parallel rank);
# grouped-GEMM weights `mlp.experts.linear_fc1.weight<e>`; and, in a dist checkpoint, stacked over the layer's
# experts as `mlp.experts.experts.linear_fc1.weight` [E, ...].
LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")
STACKED_EXPERTS = ".mlp.experts.experts."


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (sharded over the expert-TP group, one per expert-parallel rank's experts)."""
    return ".mlp.experts." in "." + name


def renumber_experts(name: str, first_expert: int) -> str:
    """A local expert's weight name with its global index (the rank's first expert + the local index)."""
    name = LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m[1]) + first_expert}.", name)
    return _GROUPED_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + first_expert}", name)


# a SwiGLU MLP's prefix: a dense layer's, a routed expert's, the shared expert's (Megatron -> canonical)
_MEGATRON_MLP = re.compile(r"(mlp\.(?:experts\.local_experts\.(\d+)\.|shared_experts\.)?)linear_fc([12])\.weight")
_CANONICAL_MLP = re.compile(r"(mlp\.(?:experts\.(\d+)\.|shared_expert\.)?)(gate_proj|up_proj|down_proj)\.weight")


def _canonical_mlp_prefix(megatron_prefix: str, expert) -> str:
    if expert is not None:
        return f"mlp.experts.{expert}."
    return "mlp.shared_expert." if "shared_experts" in megatron_prefix else "mlp."


def _megatron_mlp_prefix(canonical_prefix: str, expert) -> str:
    if expert is not None:
        return f"mlp.experts.local_experts.{expert}."
    return "mlp.shared_experts." if "shared_expert" in canonical_prefix else "mlp."


def to_canonical(megatron: Dict[str, Tensor], cfg: DecoderConfig) -> Dict[str, Tensor]:
    out = {}
    r, hn, ng = cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim, cfg.num_query_groups
    for name, t in megatron.items():
        mixing = bool(owner_of(name))
        if name.endswith("._extra_state") or (name.endswith(".bias") and not mixing):
            continue
        if name in _TOP_RENAMES:
            if not (name == "output_layer.weight" and cfg.tie_word_embeddings):
                out[_TOP_RENAMES[name]] = t
            continue
        if name.startswith("decoder.") and mixing and not name.startswith("decoder.layers."):
            out["model." + name[len("decoder."):]] = t  # the decoder end's mixing (final_mixer.*, ...)
            continue
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise KeyError(f"unexpected Megatron parameter {name}")
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest == "self_attention.linear_qkv.weight":
            w = t.view(ng, r + 2, hn, -1)
            out[prefix + "self_attn.q_proj.weight"] = w[:, :r].reshape(-1, w.shape[-1]).clone()
            out[prefix + "self_attn.k_proj.weight"] = w[:, r].reshape(-1, w.shape[-1]).clone()
            out[prefix + "self_attn.v_proj.weight"] = w[:, r + 1].reshape(-1, w.shape[-1]).clone()
        elif _MEGATRON_MLP.fullmatch(rest):
            mlp = _MEGATRON_MLP.fullmatch(rest)
            mlp_prefix = prefix + _canonical_mlp_prefix(mlp.group(1), mlp.group(2))
            if mlp.group(3) == "1":
                gate, up = t.chunk(2, dim=0)
                out[mlp_prefix + "gate_proj.weight"], out[mlp_prefix + "up_proj.weight"] = gate.clone(), up.clone()
            else:
                out[mlp_prefix + "down_proj.weight"] = t
        elif rest in _ROUTER:
            out[prefix + _ROUTER[rest]] = t
        elif rest in _LAYER_RENAMES:
            out[prefix + _LAYER_RENAMES[rest]] = t
        elif mixing:
            out[prefix + rest] = t
        else:
            raise KeyError(f"unexpected Megatron parameter {name}")
    return out


def from_canonical(canonical: Dict[str, Tensor], cfg: DecoderConfig) -> Dict[str, Tensor]:
    out = {}
    r, hn, ng, d = (cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim, cfg.num_query_groups,
                    cfg.hidden_size)
    top = {v: k for k, v in _TOP_RENAMES.items()}
    layer_names = {v: k for k, v in _LAYER_RENAMES.items()}
    router = {v: k for k, v in _ROUTER.items()}
    for name, t in canonical.items():
        mixing = bool(owner_of(name))
        if name in top:
            out[top[name]] = t
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            if not (mixing and name.startswith("model.")):
                raise KeyError(f"unexpected parameter {name}")
            out["decoder." + name[len("model."):]] = t
            continue
        prefix, rest = f"decoder.layers.{m.group(1)}.", m.group(2)
        mlp = _CANONICAL_MLP.fullmatch(rest)
        if rest in layer_names:
            out[prefix + layer_names[rest]] = t
        elif mixing:
            out[prefix + rest] = t
        elif rest in router:
            out[prefix + router[rest]] = t
        elif mlp is not None:  # gate/up are fused below, from the gate's entry
            megatron_prefix = prefix + _megatron_mlp_prefix(mlp.group(1), mlp.group(2))
            if mlp.group(3) == "down_proj":
                out[megatron_prefix + "linear_fc2.weight"] = t
            elif mlp.group(3) == "gate_proj":
                up = canonical[f"model.layers.{m.group(1)}.{mlp.group(1)}up_proj.weight"]
                out[megatron_prefix + "linear_fc1.weight"] = torch.cat([t, up])
        elif rest not in _FUSED:  # the fused ones are assembled below
            raise KeyError(f"unexpected parameter {name}")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = canonical[p + "self_attn.q_proj.weight"].view(ng, r, hn, d)
        k = canonical[p + "self_attn.k_proj.weight"].view(ng, 1, hn, d)
        v = canonical[p + "self_attn.v_proj.weight"].view(ng, 1, hn, d)
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, d)
    if cfg.tie_word_embeddings:
        out.pop("output_layer.weight", None)
    return out
