"""The mixture-of-experts MLP of the plain decoder: Megatron-core's routing math, in one process.

Each token's router logits (fp32, [T, E]) choose its top-k experts:
- softmax: the top-k logits, then a softmax over them (= a softmax over all experts renormalised over the chosen:
  Qwen3-MoE's norm_topk_prob); with pre_softmax, the top-k of a softmax over all experts, not renormalised;
- sigmoid (DeepSeek-V3): sigmoid scores; the choice may add a per-expert bias (`expert_bias`, aux-loss-free
  balancing: it steers the choice, never the weights); the chosen scores renormalised to sum to 1 (top-k > 1).
The layer's output is sum_e p_e * expert_e(x) over the chosen experts (SwiGLU each), plus a shared expert's output
where there is one. Megatron's `topk_routing_with_score_function` and `switch_load_balancing_loss_func`
(megatron-core 0.16.1) are the reference; tests tie the Megatron model's logits and losses to this module's.

The load-balancing losses Megatron attaches to the router (Switch Transformer's, over a micro-batch's tokens, or
per sequence) are computed here when the trainer asks for them (`load_balancing`), and left in `aux_loss`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .mlp import MLP


def route(logits: Tensor, topk: int, score_function: str, expert_bias: Optional[Tensor] = None,
          pre_softmax: bool = False) -> Tuple[Tensor, Tensor]:
    """logits [T, E] (fp32) -> (probs [T, E]: the chosen experts' weights, 0 elsewhere; routing_map [T, E] bool)."""
    if score_function == "softmax" and pre_softmax:  # softmax over every expert, then the top-k of it
        weights, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits), k=topk, dim=1)
    elif score_function == "softmax":
        chosen, index = torch.topk(logits, k=topk, dim=1)
        weights = torch.softmax(chosen, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, index = torch.topk(scores + expert_bias, k=topk, dim=1)
            chosen = torch.gather(scores, dim=1, index=index)
        else:
            chosen, index = torch.topk(scores, k=topk, dim=1)
        weights = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else chosen
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    probs = torch.zeros_like(logits).scatter(1, index, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, index, 1).bool()
    return probs, routing_map


def switch_loss(scores: Tensor, routing_map: Tensor, topk: int, coeff: float) -> Tensor:
    """Switch Transformer's load-balancing loss over T tokens: coeff * E / (k T^2) * sum_e P_e f_e, with P_e the
    summed scores and f_e the tokens routed to expert e (Megatron's switch_load_balancing_loss_func)."""
    tokens, experts = scores.shape
    per_expert = routing_map.sum(dim=0).to(scores.dtype)
    return torch.sum(scores.sum(dim=0) * per_expert) * (experts * coeff / (topk * tokens * tokens))


def aux_scores(logits: Tensor, topk: int, score_function: str) -> Tuple[Tensor, Tensor]:
    """(routing_map, scores) the load-balancing loss reads: scores over all experts (softmax, or sigmoid
    normalised), the map of each token's top-k of those scores (no expert bias)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, index = torch.topk(scores, k=topk, dim=1)
    return torch.zeros_like(logits, dtype=torch.int32).scatter(1, index, 1).bool(), scores


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, expert_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        if expert_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: Tensor) -> Tensor:
        return x.float() @ self.weight.float().t()  # the router in fp32, as Megatron's (moe_router_dtype fp32)


class MoEMLP(nn.Module):
    """The MoE MLP of one layer (Qwen3-MoE names: gate, experts.<e>.*, plus shared_expert.*)."""

    def __init__(self, cfg):
        super().__init__()
        self.topk, self.score_function = cfg.moe_router_topk, cfg.moe_router_score_function
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.moe_router_enable_expert_bias)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_ffn_hidden_size) for _ in range(cfg.num_experts))
        width = cfg.moe_shared_expert_intermediate_size
        self.shared_expert = MLP(cfg.hidden_size, width) if width else None
        # set by a trainer: (aux_loss | seq_aux_loss | none, coeff, groups): the loss of each of `groups` equal
        # slices of the batch (a data-parallel rank's micro-batch in Megatron), averaged
        self.load_balancing: Tuple[str, float, int] = ("none", 0.0, 1)
        self.aux_loss: Optional[Tensor] = None
        self.tokens_per_expert: Optional[Tensor] = None  # [E] of the last forward (for the expert bias, the logs)

    def forward(self, x: Tensor) -> Tensor:
        """x [b, s, d] -> [b, s, d]."""
        b, s, d = x.shape
        tokens = x.transpose(0, 1).reshape(-1, d)  # Megatron's token order: [s, b] flattened
        logits = self.gate(tokens)
        probs, routing_map = route(logits, self.topk, self.score_function, self.gate.e_score_correction_bias,
                                   self.pre_softmax)
        self.tokens_per_expert = routing_map.sum(dim=0).detach()
        self.aux_loss = self._balancing_loss(logits, b, s) if self.training and torch.is_grad_enabled() else None
        out = torch.zeros_like(tokens)
        if tokens.device.type == "xla":  # static shapes for the compiler: every expert on every token, weighted
            for e, expert in enumerate(self.experts):  # (0 for the experts a token did not choose)
                out = out + (expert(tokens).float() * probs[:, e:e + 1]).to(out.dtype)
        else:  # each expert on its own tokens
            for e, expert in enumerate(self.experts):
                rows = routing_map[:, e].nonzero(as_tuple=True)[0]
                if rows.numel():
                    weight = probs[rows, e].unsqueeze(-1)
                    out.index_add_(0, rows, (expert(tokens[rows]).float() * weight).to(out.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(s, b, d).transpose(0, 1)

    def _balancing_loss(self, logits: Tensor, b: int, s: int) -> Optional[Tensor]:
        kind, coeff, groups = self.load_balancing
        if kind == "none" or coeff == 0:
            return None
        routing_map, scores = aux_scores(logits, self.topk, self.score_function)
        scores, routing_map = scores.view(s, b, -1), routing_map.view(s, b, -1)  # tokens in [s, b] order
        if kind == "seq_aux_loss":  # one loss per sequence, averaged over the sequences
            return sum(switch_loss(scores[:, i], routing_map[:, i], self.topk, coeff) for i in range(b)) / b
        per = b // groups  # aux_loss: over each group's tokens
        return sum(switch_loss(scores[:, g * per:(g + 1) * per].reshape(-1, scores.shape[-1]),
                               routing_map[:, g * per:(g + 1) * per].reshape(-1, scores.shape[-1]), self.topk, coeff)
                   for g in range(groups)) / groups


@torch.no_grad()
def update_expert_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> None:
    """DeepSeek-V3's step of the expert bias after an optimizer step: up for experts below the mean load, down for
    those above (Megatron's get_updated_expert_bias)."""
    counts = tokens_per_expert.float()
    bias.add_(torch.sign(counts.mean() - counts) * rate)
