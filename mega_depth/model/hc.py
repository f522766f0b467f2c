"""Hyper-Connections (arXiv 2409.19606, docs/mechanisms.md §7): n residual streams per token. Each sublayer reads a
learned (dynamic: input-dependent) mix of the streams, and writes its output into every stream while the streams mix
among themselves. The embedding enters as n copies; the streams are summed before the final norm (the paper's
collapse).

The pipeline carries the streams, n*d per token, packed [s, b, n*d]; every sublayer rewrites them, so nothing is
cached across virtual stages. Shared with mHC (mhc.py): the stream state, the payload and the learned collapse head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import Entry, Mechanism, Option, sublayer_label
from .mixing import hc_coefficients, mhc_head_weights, mhc_projection, streams_in, streams_out

COLLAPSES = ("sum", "mean", "learned")


class StreamsState:
    """The n residual streams [n, *, d] before the next sublayer."""

    def __init__(self, streams: Tensor):
        self.streams = streams


class CollapseHead(nn.Module):
    """The learned collapse (DeepSeek-V4's hc_head; docs/mechanisms.md §8):
    w_i = sigmoid(alpha (x~ phi)_i / r + b_i) + eps,
    y = sum_i w_i X_i. phi = 0, b = 0, alpha = 0.01 at init [choice]."""

    def __init__(self, n: int, hidden_size: int, dtype=None):
        super().__init__()
        self.phi = nn.Parameter(torch.zeros(n, n * hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype))
        self.alpha = nn.Parameter(torch.full((1,), 0.01, dtype=dtype))


class StreamMechanism(Mechanism):
    """What HC and mHC share: n streams in the state and the payload, expansion and collapse."""

    module_prefix: str = ""  # the per-sublayer modules are attn_<prefix> and mlp_<prefix>
    final_name: str = ""  # the learned collapse head's module name: final_<prefix>
    collapse_option: str = ""  # the option that picks the collapse: <prefix>_collapse

    def __init_subclass__(cls, **kwargs):
        """A subclass names its prefix (its own name); its module names and collapse option follow from it."""
        super().__init_subclass__(**kwargs)
        p = cls.module_prefix = cls.name
        cls.final_name, cls.collapse_option = f"final_{p}", f"{p}_collapse"
        cls.module_names = (f"attn_{p}", f"mlp_{p}", cls.final_name)

    @classmethod
    def catalogue(cls, num_layers):
        return {cls.name: {"mechanism": cls.name, "hc_expansion": 4}}

    @property
    def n(self) -> int:
        return self.residual.hc_expansion

    def collapse(self) -> str:
        return getattr(self.residual, self.collapse_option)

    @property
    def eps_style(self) -> str:
        """Where the learned collapse head's RMS takes its eps (mixing.mhc_rms); mHC follows --mhc-eps-style."""
        return "clamp"

    def final_modules(self, dtype=None):
        if self.collapse() != "learned":
            return {}
        return {self.final_name: CollapseHead(self.n, self.shape.hidden_size, dtype)}

    def initial_state(self, embedding):
        return StreamsState(embedding.unsqueeze(0).expand(self.n, *embedding.shape))

    def final_hidden(self, state, decoder):
        x = state.streams
        kind = self.collapse()
        if kind == "sum":
            return x.sum(0)
        if kind == "mean":
            return x.mean(0)
        head = getattr(decoder, self.final_name)
        weights = mhc_head_weights(x, head.phi, head.bias, head.alpha, self.eps_style,
                                   project=self.kernel("mhc_projection", mhc_projection))
        return self.kernel("streams_in", streams_in)(x, weights)

    def layer_forward(self, layer, state):
        for kind, run in (("attn", layer.attention_sublayer), ("mlp", layer.mlp_sublayer)):
            sublayer = 2 * layer.layer_index + (1 if kind == "attn" else 2)
            state.streams = self.sublayer(getattr(layer, f"{kind}_{self.module_prefix}"), state.streams, run,
                                          sublayer)
        return state

    def sublayer(self, mixer, streams: Tensor, run, sublayer: int) -> Tensor:
        raise NotImplementedError

    def coefficients(self, compute, streams: Tensor):
        """compute(streams) -> a sublayer's coefficients. On the fast path they are recomputed in backward from the
        streams (which the stream update keeps anyway) instead of keeping the coefficient math's intermediates
        (the normalised [n*d] token, Sinkhorn's iterations)."""
        return self.recompute(compute, streams) if self.recomputes else compute(streams)

    def update(self, streams: Tensor, run, weights_in: Tensor, mix: Tensor, weights_out: Tensor) -> Tensor:
        """The sublayer on the streams' weighted sum, its output written into the mixed streams. On the fast path
        the sublayer's input is `Recomputed`: its pre-norm keeps the streams, not the sum (and where the host's
        norm is the fused one, reads and normalises in one kernel: the sum is never written)."""
        read, write = self.kernel("streams_in", streams_in), self.kernel("streams_out", streams_out)
        x = self.recomputed(read, streams, weights_in, normalised=getattr(self.kernels, "streams_in_normed", None)) \
            if self.recomputes else read(streams, weights_in)
        return write(streams, run(x), mix, weights_out)

    def io_units(self, fused=True):
        """Unfused, per sublayer: reads (5n+1)d, writes (3n+1)d (mHC paper Table 2, HC row); fused: the
        coefficients read the n streams, the read kernel reads them again and writes the input, the write kernel
        reads the streams and the output once and writes the n new streams: reads (3n+1)d, writes (n+1)d. Plus the
        collapse before the final norm."""
        n = self.n
        return self.shape.num_sublayers * (4 * n + 2 if fused else 8 * n + 2) + (n + 1)

    def kernel_io_units(self, recompute=True):
        """Per sublayer, on n streams (the first sublayer's are the embedding expanded: read as one): the read
        reads the streams and writes the input (with the recomputation, where the host's norm is the fused one, the
        normalised input: `streams_in_normed`, nothing made again), its backward reads them and the input's
        gradient and writes the read's gradient; the write reads the streams and the output and writes n streams,
        its backward reads them, the output and the n streams' gradients and writes the output's. Neither writes
        the streams' gradient: the streams' sink sums every reader's part once (kernels/streams.sum_deferred),
        reading the write's n output gradients and the read's gradient and writing the streams' gradient (plus
        what the coefficients' part reads: coefficient_io_units). Plus the learned collapse head's read and
        projection, once."""
        n, total = self.n, 0.0
        for sub in range(1, self.shape.num_sublayers + 1):
            read = 1 if sub == 1 else n
            total += (read + 1) + (read + 2)  # the read; its backward
            total += (read + 1 + n) + (read + 1 + n + 1)  # the write; its backward
            total += 2 * n + 1  # the sum
            total += self.coefficient_io_units(read, recompute)
        if self.collapse() == "learned":  # the read (its backward stores) and the projection (its backward adds)
            total += (n + 1) + (n + 1 + n) + n + (n + 2 * n) + n
        return total

    def coefficient_io_units(self, read: float, recompute: bool) -> float:
        """What one sublayer's coefficient kernels move, its streams read as `read` units (HC's are eager: none)."""
        return 0.0

    def layout(self, boundary):
        return [Entry("streams", self.n * self.shape.hidden_size, False)]

    def entries(self, state):
        return {"streams": state.streams}

    def state_from(self, entries, boundary):
        return StreamsState(entries["streams"])

    def flat(self, name, t):  # [n, s, b, d] -> [s, b, n*d]
        return t.permute(1, 2, 0, 3).flatten(2)

    def unflat(self, name, t):  # [s, b, n*d] -> [n, s, b, d]
        return t.unflatten(2, (self.n, self.shape.hidden_size)).permute(2, 0, 1, 3)

    def inference_form(self):
        return f"{self.n} residual streams carried between layers, per token; the KV cache has the standard layout"


class HCMixer(nn.Module):
    """One sublayer's hyper-connection. Static A_m (one-hot e_{k mod n}), A_r (identity), B (ones); dynamic:
    the stream norm's gain, W_m, W_r, W_b (zero) and the scales s_alpha, s_beta (0.01) (eq. 14, Alg. 2)."""

    def __init__(self, n: int, hidden_size: int, sublayer_index: int, dynamic: bool, dtype=None):
        super().__init__()
        self.A_m = nn.Parameter(torch.nn.functional.one_hot(torch.tensor(sublayer_index % n), n).to(
            dtype or torch.get_default_dtype()))
        self.A_r = nn.Parameter(torch.eye(n, dtype=dtype))
        self.B = nn.Parameter(torch.ones(n, dtype=dtype))
        self.dynamic = dynamic
        if dynamic:
            self.norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
            self.W_m = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            self.W_r = nn.Parameter(torch.zeros(hidden_size, n, dtype=dtype))
            self.W_b = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            self.s_alpha = nn.Parameter(torch.full((1,), 0.01, dtype=dtype))
            self.s_beta = nn.Parameter(torch.full((1,), 0.01, dtype=dtype))


class HC(StreamMechanism):
    name = "hc"
    options = (
        Option("hc_expansion", int, 4, "HC / mHC: the number of residual streams n"),
        Option("hc_dynamic", bool, True, "HC: input-dependent weights (DHC, the paper's default); false: static"),
        Option("hc_tanh", bool, True, "HC: tanh on the dynamic terms (the paper's W/O-tanh runs: false)"),
        Option("hc_collapse", str, "sum", "HC: how the streams become one before the final norm (the paper sums)",
               COLLAPSES),
        Option("hc_out_init_scale", str, "none", "HC: scale the std of the attention-output and FFN-down "
               "projections by sqrt(n) (multiply) or 1/sqrt(n) (divide); the paper's direction is unclear",
               ("none", "multiply", "divide")),
    )

    @classmethod
    def validate(cls, cfg, fail):
        fail(cfg.residual.hc_expansion >= 1, "--hc-expansion must be >= 1 (the paper uses 4; 1 is worse than the "
             "baseline)")

    def layer_modules(self, layer, dtype=None):
        d, dyn = self.shape.hidden_size, self.residual.hc_dynamic
        return {"attn_hc": HCMixer(self.n, d, 2 * layer, dyn, dtype), "mlp_hc": HCMixer(self.n, d, 2 * layer + 1,
                                                                                        dyn, dtype)}

    def decays(self, param_name, param):
        return param_name.rsplit(".", 1)[-1] in ("W_m", "W_r", "W_b")  # the static weights, scales, gain: no

    def output_init_scale(self):
        return {"none": 1.0, "multiply": math.sqrt(self.n), "divide": 1 / math.sqrt(self.n)}[
            self.residual.hc_out_init_scale]

    def sublayer(self, mixer, streams, run, sublayer):
        dynamic = None
        if mixer.dynamic:
            dynamic = (mixer.norm_weight, mixer.W_m, mixer.W_r, mixer.W_b, mixer.s_alpha, mixer.s_beta)
        a_m, a_r, b = self.coefficients(lambda s: hc_coefficients(s, mixer.A_m, mixer.A_r, mixer.B, dynamic,
                                                                  self.residual.hc_tanh, self.shape.norm_epsilon),
                                        streams)
        if self.recorder is not None:  # token means; A_r[i, *, j] is stream i -> j: drawn as rows j (to), columns i
            order, label = sublayer_label(sublayer, self.shape.num_sublayers)
            tokens = streams.shape[1:-1]
            self.recorder.add("hc-A_m", order, label, a_m.expand(-1, *tokens))
            self.recorder.add("hc-B", order, label, b.expand(-1, *tokens))
            self.recorder.add_matrix("hc-A_r", order, label, a_r.expand(-1, *tokens, -1).movedim(-1, 0))
        return self.update(streams, run, a_m, a_r, b)
