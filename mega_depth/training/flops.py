"""Model FLOPs and the peak of the accelerator: what MFU is measured against (the trainer's log, the benchmarks)."""

from __future__ import annotations

from typing import Optional

# bf16 dense peak FLOP/s and HBM bandwidth (bytes/s) by device-name fragment (vendor datasheets, SXM parts)
DEVICES = {"h200": (989e12, 4.8e12), "h100": (989e12, 3.35e12), "a100": (312e12, 2.0e12)}


def flops_per_token(L: int, d: int, heads: int, groups: int, ffn: int, vocab: int, seq: int) -> float:
    """Training FLOPs per token of the decoder (3 x the forward: 2 per multiply-add in the matmuls, plus causal
    attention's scores and weighted sum over the full sequence, as Megatron-LM counts them). The depth mixing's own
    FLOPs are O(d) per source and left out: it is memory-bound (see Mechanism.io_units)."""
    hn = d // heads
    per_layer = d * heads * hn + 2 * d * groups * hn + heads * hn * d + 3 * d * ffn
    forward = 2 * (L * per_layer + d * vocab) + 4 * L * seq * heads * hn
    return 3.0 * forward


def device_key(name: str) -> Optional[str]:
    """The DEVICES entry of a device name ("NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    return next((k for k in DEVICES if k in name.lower()), None)


def peak_flops(name: str) -> Optional[float]:
    key = device_key(name)
    return DEVICES[key][0] if key else None
