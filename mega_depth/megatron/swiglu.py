"""SwiGLU fused on a GPU: Liger-Kernel's gate-up kernel behind Megatron's own fusion switch.

Without Transformer Engine, Megatron's MLP computes silu(gate) * up eagerly (two passes over [tokens, 2f] forward,
three backward) unless its config sets `bias_activation_fusion`; then it calls `bias_swiglu_impl`, which applies
`fused_bias_swiglu.SwiGLUFunction`. Where a GPU runs the model and Liger-Kernel is installed, `transformer_config`
sets that switch and `apply()` puts `SwiGLU` in SwiGLUFunction's place: Liger's fused gate-up kernel (one read of
fc1's [gate | up] buffer and one write, the silu recomputed in backward), the eager silu(gate) * up for tensors the
fused kernels do not take. MoE's routed experts with routing weights keep Megatron's WeightedSwiGLUFunction.
tests/kernels/test_liger.py ties the kernel to the eager product under Triton's interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mega_depth.megatron.norm import fused_applies

FORCE = False  # the step trace builds the GPU's configuration on a CPU machine


def _liger_swiglu():
    try:
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except ImportError:
        return None
    return LigerFusedGateUpSiLUMulFunction


def enabled() -> bool:
    """Whether Megatron's fused-activation switch is set: a GPU (or the step trace) and Liger-Kernel."""
    return (torch.cuda.is_available() or FORCE) and _liger_swiglu() is not None


class SwiGLU:
    """fused_bias_swiglu.SwiGLUFunction's interface: apply(input [rows, 2f], fp8_input_store, cpu_offload_input)."""

    @staticmethod
    def apply(input, fp8_input_store=False, cpu_offload_input=False):
        if fused_applies(input) and not (fp8_input_store or cpu_offload_input):
            return _liger_swiglu().apply(input, False)
        gate, up = torch.chunk(input, 2, dim=-1)
        return F.silu(gate) * up


def apply() -> None:
    """Put SwiGLU in Megatron's SwiGLUFunction's place (idempotent); bias_swiglu_impl looks it up at each call."""
    from megatron.core.fusions import fused_bias_swiglu

    fused_bias_swiglu.SwiGLUFunction = SwiGLU
