"""Manifold-constrained Hyper-Connections (arXiv 2512.24880, docs/mechanisms.md §8): HC's n streams, with coefficients
read from all n*d values of a token at once (a gain-less RMS, one projection phi, three scales alpha, biases b), a
sigmoid for the sublayer's input weights H_pre, 2*sigmoid for its output weights H_post, and a doubly stochastic
stream mix H_res from Sinkhorn-Knopp. All coefficient math runs in fp32. Streams, payload and collapse as HC (hc.py).

Choices (docs/mechanisms.md §8; each an option): Sinkhorn order (paper: columns then rows, rows exact; megatron: rows
then columns), epsilon style (clamp; deepseek), init (default: phi = 0, alpha = 0.01, LUMIA's biases so that
H_pre = 1/n, H_post = 1, H_res ~ 0.99 I; megatron: xavier phi, zero biases; lumia: N(0, 0.01) phi [unverified]),
collapse (mean; sum; learned head).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import Option, sublayer_label
from .hc import COLLAPSES, StreamMechanism
from .mixing import MHC_EPS_STYLES, MHC_SK_ORDERS, mhc_projected_coefficients, mhc_projection

INITS = ("default", "megatron", "lumia")


def lumia_bias(n: int) -> torch.Tensor:
    """[pre | post | res]: logit(1/n), 0, log(0.99 I + 0.01/(n-1) (J - I)); zero at n = 1 (the logs diverge)."""
    if n == 1:
        return torch.zeros(3)
    pre = torch.full((n,), math.log((1 / n) / (1 - 1 / n)))
    res = torch.full((n, n), 0.01 / (n - 1)).fill_diagonal_(0.99).log()
    return torch.cat([pre, torch.zeros(n), res.flatten()])


class MHCMixer(nn.Module):
    """One sublayer's mHC: mapping_proj.weight = phi [n^2 + 2n, n*d], bias [n^2 + 2n], alpha_pre/post/res [1]
    (Megatron-compatible names)."""

    def __init__(self, n: int, hidden_size: int, init: str, dtype=None):
        super().__init__()
        self.mapping_proj = nn.Linear(n * hidden_size, n * n + 2 * n, bias=False, dtype=dtype)
        nn.init.zeros_(self.mapping_proj.weight)  # random inits are drawn by Mechanism.random_init (keyed)
        bias = torch.zeros(n * n + 2 * n) if init == "megatron" else lumia_bias(n)
        self.bias = nn.Parameter(bias.to(dtype or torch.get_default_dtype()))
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            setattr(self, name, nn.Parameter(torch.full((1,), 0.01, dtype=dtype)))


class MHC(StreamMechanism):
    name = "mhc"
    options = (
        Option("mhc_sinkhorn_iters", int, 20, "mHC: Sinkhorn-Knopp iterations for H_res"),
        Option("mhc_sk_order", str, "paper", "mHC: per iteration normalise columns then rows (paper, DeepSeek: rows "
               "exact) or rows then columns (Megatron-LM)", MHC_SK_ORDERS),
        Option("mhc_eps_style", str, "clamp", "mHC: clamp: Sinkhorn from exp(R - max R), divisions by max(sum, "
               "1e-6), r + 1e-6; deepseek (DeepSeek-V4's code): Sinkhorn from an exact softmax + 1e-6, divisions by "
               "sum + 1e-6, sigmoid + 1e-6 for H_pre, 1e-6 inside the RMS (also the learned collapse head's)",
               MHC_EPS_STYLES),
        Option("mhc_init", str, "default", "mHC: default (phi 0, LUMIA biases), megatron (xavier phi, zero "
               "biases), lumia (N(0, 0.01) phi, LUMIA biases)", INITS),
        Option("mhc_collapse", str, "mean", "mHC: streams -> one before the final norm", COLLAPSES),
    )
    shared_options = ("hc_expansion",)

    @classmethod
    def validate(cls, cfg, fail):
        r = cfg.residual
        fail(r.hc_expansion >= 1, "--hc-expansion must be >= 1 (mHC uses 4)")
        fail(r.mhc_sinkhorn_iters >= 1, "--mhc-sinkhorn-iters must be >= 1 (the paper uses 20)")

    @property
    def eps_style(self):
        return self.residual.mhc_eps_style

    def layer_modules(self, layer, dtype=None):
        d, init = self.shape.hidden_size, self.residual.mhc_init
        return {"attn_mhc": MHCMixer(self.n, d, init, dtype), "mlp_mhc": MHCMixer(self.n, d, init, dtype)}

    def decays(self, param_name, param):
        return param_name.endswith("mapping_proj.weight") or param_name.endswith(".phi")  # b, alpha: no

    def random_init(self, param_name, shape, generator):
        init = self.residual.mhc_init
        if not param_name.endswith("mapping_proj.weight") or init == "default":
            return None
        if init == "megatron":  # xavier_uniform
            bound = math.sqrt(6.0 / (shape[0] + shape[1]))
            return (torch.rand(list(shape), generator=generator) * 2 - 1) * bound
        return torch.randn(list(shape), generator=generator) * 0.01

    def coefficients(self, compute, streams):
        """Kept, not recomputed, on the fused path: its projection keeps nothing but the streams (which the stream
        update keeps anyway), and the rest a few numbers a token (the m projections and the RMS, Sinkhorn's
        logits); recomputing would cost a second read of the streams and a nested backward pass a sublayer."""
        return compute(streams) if self.fused else super().coefficients(compute, streams)

    def coefficient_io_units(self, read, recompute):
        """The projection and its RMS read the streams (once: kept, not recomputed, see `coefficients`), and so does
        the streams' gradient sum for the projection's part, which makes phi's gradient in the same pass (phi goes
        through the streams' sink: kernels/grad_sink.aliased_with; a kernel of its own read the streams a third
        time). The coefficient kernel's backward (kernels/mhc_maps.py) writes Sinkhorn's chain, every half-step's n
        x n fp32 input a token, and reads it back (from L2: counted once, as the recorded launches count it). Its
        other reads and writes, m + n^2 values a token, and phi's partial sums are left out."""
        r = self.residual
        steps = 2 * r.mhc_sinkhorn_iters - (0 if r.mhc_eps_style == "clamp" else 1)
        chain = steps * self.n * self.n * 4 / (2 * self.shape.hidden_size)  # fp32, in units of a bf16 row of d
        return 2 * read + chain

    def sublayer(self, mixer, streams, run, sublayer):
        r = self.residual
        projection = self.kernel("mhc_projection", mhc_projection)  # the fast path: x~ phi and its RMS in one pass
        # the fast path: the maps and Sinkhorn in one kernel
        maps = self.kernel("mhc_projected_coefficients", mhc_projected_coefficients)

        def compute(s):  # == mhc_coefficients(s, ...)
            proj, mean_square = projection(s, mixer.mapping_proj.weight)
            return maps(proj, mean_square, mixer.bias, mixer.alpha_pre, mixer.alpha_post, mixer.alpha_res,
                        r.mhc_sinkhorn_iters, r.mhc_sk_order, r.mhc_eps_style)

        pre, post, res = self.coefficients(compute, streams)
        if self.recorder is not None:  # token means; H_res[i, j]: stream j -> i, one n x n grid per sublayer
            order, label = sublayer_label(sublayer, self.shape.num_sublayers)
            self.recorder.add("mhc-H_pre", order, label, pre)
            self.recorder.add("mhc-H_post", order, label, post)
            self.recorder.add_matrix("mhc-H_res", order, label, res.movedim(-2, 0).movedim(-1, 1))
        mix = res.transpose(-1, -2).movedim(-2, 0)  # [j (in), *, i (out)] as streams_out takes it
        return self.update(streams, run, pre, mix, post)
