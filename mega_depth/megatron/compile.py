"""--compile-layers: torch.compile (inductor) of every layer's norms, attention and MLP.

The small sizes are launch-bound on a GPU: RMSNorm, q/k-norm, RoPE and SwiGLU are chains of elementwise kernels
around each GEMM. Compiling the sublayer modules fuses them. The unit is the same for every mechanism: the baseline's
layer and a depth-mixing layer compile the same four Megatron modules (input_layernorm, self_attention,
pre_mlp_layernorm, mlp). The mixing between them stays with --mixing-impl (its Triton kernels or compiled twins), so
the ratio to the baseline compares like with like. Eager stays the reference: a layout test checks that losses and
gradients equal the eager ones.

`nn.Module.compile` compiles a module's call in place, so parameter names, checkpoints, DDP and DeepSpeed see the
same module tree.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch

SUBLAYER_MODULES = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")


def compile_layers(chunks: Iterable[torch.nn.Module], num_layers: int) -> int:
    """Compile the sublayer modules of every layer of these model chunks; returns how many modules it compiled."""
    import torch._dynamo

    # megatron-core warns (rank 0 only) inside linear layers; a warning would split the graph, so Dynamo emits it
    # after the graph instead of breaking there.
    torch._dynamo.config.reorderable_logging_functions.add(warnings.warn)
    # Layers share compiled code where their guards agree; a layer that differs (Depth-Attention's value mixer,
    # recompute's no-grad forward) compiles once more. Room for every layer, so none falls back to eager.
    limit = max(torch._dynamo.config.recompile_limit, 4 * num_layers)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           16 * limit)
    compiled = 0
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for name in SUBLAYER_MODULES:
                module = getattr(layer, name, None)
                if module is None or not any(True for _ in module.parameters()):  # IdentityOp: nothing to fuse
                    continue
                module.compile()
                compiled += 1
    return compiled
