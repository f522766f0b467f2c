"""--compile-layers: torch.compile (inductor) of every transformer layer, whole: norms, attention, MLP and the
depth mixing between them.

The small sizes are launch-bound on a GPU: RMSNorm, q/k-norm, RoPE, SwiGLU and the mixing's elementwise glue are
chains of small kernels around each GEMM. The compiled unit is the same for the baseline and every mechanism: one
layer. The baseline compiles Megatron's TransformerLayer module; a depth-mixing mechanism compiles its
`layer_forward` (mega_depth/model/base.py), which runs the layer's two sublayers on inputs it mixes from its
cross-layer state. The fused mixing ops are torch.library custom ops (mega_depth/kernels), so Dynamo sees them whole:
no graph break (tests/integration/test_layouts.py counts Dynamo's graph breaks and asserts none, for every
mechanism). Cross-layer work that spans layers (Block AttnRes's phase 1 queries) is set up outside, in
`Mechanism.prepare`. Recomputation inside a compiled layer uses non-reentrant activation checkpointing, which
Dynamo traces. Eager stays the reference: a layout test checks that losses and gradients equal the eager ones.

`nn.Module.compile` compiles a module's call in place, so parameter names, checkpoints, DDP and DeepSpeed see the
same module tree.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch


def compile_layers(chunks: Iterable[torch.nn.Module], mechanism, num_layers: int) -> int:
    """Compile every layer of these model chunks; returns how many layers this rank runs compiled."""
    import torch._dynamo

    # megatron-core warns inside its linear layers (a deprecation, on rank 0); warnings.warn with a warning class
    # cannot be reordered after the graph, so inside a compiled layer warnings are dropped instead of splitting it.
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    # Layers share compiled code where their guards agree; a layer that differs (its depth, its state's sources,
    # recompute's no-grad forward) compiles once more. Room for every layer, so none falls back to eager.
    limit = max(torch._dynamo.config.recompile_limit, 4 * num_layers)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           16 * limit)
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    if mechanism is not None and mechanism.mixes_depth:
        mechanism.compiled_layer_forward = torch.compile(mechanism.layer_forward)
    else:
        for layer in layers:
            layer.compile()
    for layer in layers:
        layer.compiled_whole = True  # what tests and the start-up line count
    return len(layers)
