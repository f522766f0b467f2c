"""Model FLOPs and the peak of the accelerator: what MFU is measured against (the trainer's log, the benchmarks)."""

from __future__ import annotations

from typing import List, Optional

# bf16 dense peak FLOP/s and HBM bandwidth (bytes/s) by device-name fragment (vendor datasheets, SXM parts)
DEVICES = {"h200": (989e12, 4.8e12), "h100": (989e12, 3.35e12), "a100": (312e12, 2.0e12)}


def flops_per_token(L: int, d: int, heads: int, groups: int, ffn: int, vocab: int, seq: int,
                    active_ffn: Optional[List[int]] = None) -> float:
    """Training FLOPs per token of the decoder (3 x the forward: 2 per multiply-add in the matmuls, plus causal
    attention's scores and weighted sum over the full sequence, as Megatron-LM counts them). The depth mixing's own
    FLOPs are O(d) per source and left out: it is memory-bound (see Mechanism.io_units). active_ffn: the SwiGLU width
    each layer runs per token, where it differs from `ffn` (an MoE layer: top-k x expert width + shared expert; the
    router's d x E is left out with the mixing's)."""
    hn = d // heads
    attention = d * heads * hn + 2 * d * groups * hn + heads * hn * d
    mlp = 3 * d * (sum(active_ffn) if active_ffn else L * ffn)
    forward = 2 * (L * attention + mlp + d * vocab) + 4 * L * seq * heads * hn
    return 3.0 * forward


def device_key(name: str) -> Optional[str]:
    """The DEVICES entry of a device name ("NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    return next((k for k in DEVICES if k in name.lower()), None)


def peak_flops(name: str) -> Optional[float]:
    key = device_key(name)
    return DEVICES[key][0] if key else None
