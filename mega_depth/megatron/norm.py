"""RMSNorm for Megatron-core specs that works under sequence parallelism.

megatron-core's torch fallback norm (WrappedTorchNorm) refuses sequence parallelism, and TransformerEngine is not
always there. This one computes like Llama/Qwen3 (normalise in fp32, cast back, then scale) and tags its weight
`sequence_parallel` so that Megatron all-reduces its grad over the TP group when SP splits the sequence.
"""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
