"""RMSNorm for Megatron-core specs that works under sequence parallelism, fused on a GPU.

megatron-core's torch fallback norm (WrappedTorchNorm) refuses sequence parallelism, and TransformerEngine is not
always there. This one computes like Llama/Qwen3 (normalise in fp32, cast back, then scale) and tags its weight
`sequence_parallel` so that Megatron all-reduces its grad over the TP group when SP splits the sequence.

Eagerly that is about 20 passes over a [tokens, d] tensor (two fp32 copies, the square, the mean, the scale, the
casts, and as many again in backward), for every norm of every layer, again in every recomputation. On a GPU the
norm runs as Liger-Kernel's fused RMSNorm instead (its "llama" casting: the same computation, one read and one
write a row forward, the weight's gradient from per-SM fp32 partials), where Liger-Kernel is installed (`pip
install "mega_depth[gpu]"`) and the layer is not being compiled (inductor fuses the eager form itself). The eager
form stays the reference and the CPU path; tests/kernels/test_liger.py ties the two under Triton's interpreter.
"""

import torch
from torch import nn

from mega_depth.kernels import common


def _liger_rms_norm():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return LigerRMSNormFunction


def fused_applies(x: torch.Tensor) -> bool:
    """Whether the fused kernel runs for `x`: a GPU tensor (or the kernel tests and the step trace, which force
    or record Triton launches), Liger-Kernel importable, outside torch.compile."""
    return (common.uses_triton(x) and not torch.compiler.is_compiling() and _liger_rms_norm() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x normalised in fp32, cast to x's dtype): fused where `fused_applies`, else eager."""
    if fused_applies(x):
        # in_place=False: the gradient of the norm's output may be read by another node of the graph
        return _liger_rms_norm().apply(x, weight, eps, 0.0, "llama", False)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
