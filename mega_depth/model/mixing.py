"""The depth-mixing math (docs/mechanisms.md), in plain PyTorch: the eager reference.

Pure functions of tensors. Parameters live in the mechanism files (attnres.py, dca.py, ...), cross-layer state
and pipeline payloads too; nothing here knows about modules, parallelism, pipelines or Megatron. Fast paths
(kernels/, torch.compile) keep these functions as their reference, and tests tie them together.

Conventions
- Every function works on tensors whose LAST dim is the feature dim, with any leading layout ([s, b, d] in
  Megatron, [b, s, d] in Hugging Face); "sources" / "stack" tensors are [K, *lead, d].
- Depth weights are computed in fp32 (at least: fp64 stays fp64 for reference checks) and cast back.
- Sublayers are numbered 1..L (L = 2 * num_layers: attention = 2t-1, MLP = 2t for transformer layer t).
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def fp32(x: Tensor) -> Tensor:
    """At least fp32 (bf16/fp16 are upcast; fp64 stays, for reference checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_inverse(x: Tensor, eps: float) -> Tensor:
    """1 / RMS(x) over the last dim, in fp32: [*, d] -> [*]."""
    return torch.rsqrt(fp32(x).pow(2).mean(-1) + eps)


# --------------------------------------------------------------------------------------------------------------
# AttnRes (arXiv 2603.15031, docs/mechanisms.md §4) and its ablation variants
# --------------------------------------------------------------------------------------------------------------


def attnres_logits(sources: Tensor, query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                   heads: int = 1) -> Tensor:
    """w . RMSNorm(v_i) per source (and per head), fp32: sources [K, *, d], query [d] or [*, d] -> [K, *, heads].

    RMSNorm(v) . w = (v . (g * w)) / rms(v), so the gain folds into the query and the keys are never
    materialised normalised. key_norm_weight None: no key norm (`--attnres-key-norm false`). With heads > 1 the
    full-width norm is applied first, then the dot product is split into `heads` groups of d / heads.
    """
    folded = fp32(query) if key_norm_weight is None else fp32(key_norm_weight) * fp32(query)
    d = sources.shape[-1]
    grouped = sources.unflatten(-1, (heads, d // heads))  # [K, *, H, d/H]
    folded = folded.unflatten(-1, (heads, d // heads)).to(sources.dtype)
    if query.dim() == 1:  # one pseudo-query for every token
        logits = fp32(torch.einsum("k...hc,hc->k...h", grouped, folded))
    else:  # an input-dependent query per token [*, d]
        logits = fp32((grouped * folded.unsqueeze(0)).sum(-1))
    if key_norm_weight is not None:
        logits = logits * rms_inverse(sources, eps).unsqueeze(-1)
    return logits


def depth_weights(logits: Tensor, weight: str = "softmax") -> Tensor:
    """Weights over the source dim 0: softmax, or an independent sigmoid per source (docs/mechanisms.md §4); fp32."""
    return torch.softmax(logits, dim=0) if weight == "softmax" else torch.sigmoid(logits)


def mix_sources(alpha: Tensor, sources: Tensor) -> Tensor:
    """sum_i alpha_i v_i: alpha [K, *, H] (H groups of d/H channels share a weight), sources [K, *, d] -> [*, d]."""
    heads = alpha.shape[-1]
    grouped = sources.unflatten(-1, (heads, sources.shape[-1] // heads))
    return torch.einsum("k...h,k...hc->...hc", alpha.to(sources.dtype), grouped).flatten(-2)


def attnres_mix(sources: Tensor, query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                weight: str = "softmax", heads: int = 1) -> Tensor:
    """h = sum_i alpha_i v_i with alpha = softmax_i(w . RMSNorm(v_i)) (or its variants): [K, *, d] -> [*, d]."""
    return mix_sources(depth_weights(attnres_logits(sources, query, key_norm_weight, eps, heads), weight), sources)


def attnres_block_phase1(completed: Tensor, queries: Tensor, key_norm_weights: Optional[Tensor], eps: float,
                         weight: str = "softmax", heads: int = 1):
    """Phase 1 of the exact two-phase Block AttnRes: all S queries of a block against the completed blocks.

    completed [n, *, d]; queries / key_norm_weights [S, d]. Returns per query the running max m [S, *, H], the
    sum of exponentials z [S, *, H] (relative to m) and the unnormalised weighted sum o [S, *, d]. With sigmoid
    weights there is no normalisation: m = 0, z = 1 and o is the weighted sum itself.
    """
    folded = fp32(queries) if key_norm_weights is None else fp32(key_norm_weights) * fp32(queries)  # [S, d]
    d = completed.shape[-1]
    grouped = completed.unflatten(-1, (heads, d // heads))  # [n, *, H, d/H]
    logits = fp32(torch.einsum("n...hc,shc->sn...h", grouped,
                               folded.view(len(queries), heads, -1).to(completed.dtype)))  # [S, n, *, H]
    if key_norm_weights is not None:
        logits = logits * rms_inverse(completed, eps).unsqueeze(-1).unsqueeze(0)
    if weight == "sigmoid":
        o = torch.einsum("sn...h,n...hc->s...hc", torch.sigmoid(logits).to(completed.dtype), grouped).flatten(-2)
        return torch.zeros_like(logits[:, 0]), torch.ones_like(logits[:, 0]), o
    m = logits.amax(dim=1).detach()  # only stabilises the exponentials: the result does not depend on it
    p = torch.exp(logits - m.unsqueeze(1))
    o = torch.einsum("sn...h,n...hc->s...hc", p.to(completed.dtype), grouped).flatten(-2)
    return m, p.sum(dim=1), o


def attnres_block_phase2(m: Tensor, z: Tensor, o: Tensor, partial: Optional[Tensor], query: Tensor,
                         key_norm_weight: Optional[Tensor], eps: float, weight: str = "softmax",
                         heads: int = 1) -> Tensor:
    """Phase 2 for one sublayer: merge the partial sum into phase 1's (m, z, o) by an online-softmax update
    (sigmoid: a plain sum). m, z [*, H]; o [*, d]; partial [*, d] or None (first sublayer of the block)."""
    d = o.shape[-1]

    def per_head(x: Tensor) -> Tensor:  # [*, H] -> [*, d]: one scale per group of d/H channels
        return x.repeat_interleave(d // heads, dim=-1)

    if partial is None:
        return o if weight == "sigmoid" else (fp32(o) / per_head(z)).to(o.dtype)
    logit = attnres_logits(partial.unsqueeze(0), query, key_norm_weight, eps, heads)[0]  # [*, H]
    if weight == "sigmoid":
        return o + mix_sources(torch.sigmoid(logit).unsqueeze(0), partial.unsqueeze(0))
    new_m = torch.maximum(m, logit).detach()  # a stabiliser again (see phase 1)
    scale_old, scale_new = torch.exp(m - new_m), torch.exp(logit - new_m)
    numerator = fp32(o) * per_head(scale_old) + fp32(partial) * per_head(scale_new)
    return (numerator / per_head(z * scale_old + scale_new)).to(o.dtype)


def attnres_mix_sources(sources: Sequence[Tensor], query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                        weight: str = "softmax", heads: int = 1) -> Tensor:
    """attnres_mix over separate source tensors (the form fast paths take: they read each source in place)."""
    return attnres_mix(torch.stack(list(sources)), query, key_norm_weight, eps, weight, heads)


def attnres_phase1_sources(completed: Sequence[Tensor], queries: Tensor, key_norm_weights: Optional[Tensor],
                           eps: float, weight: str = "softmax", heads: int = 1):
    """attnres_block_phase1 over separate completed-block tensors."""
    return attnres_block_phase1(torch.stack(list(completed)), queries, key_norm_weights, eps, weight, heads)


def scalar_mix(sources: Tensor, logits: Tensor) -> Tensor:
    """Input-independent mixing: softmax over learned scalars c [K], shared by every token."""
    alpha = torch.softmax(fp32(logits), dim=0)
    return torch.einsum("k,k...d->...d", alpha.to(sources.dtype), sources)


# --------------------------------------------------------------------------------------------------------------
# DeepCrossAttention (arXiv 2502.06785, docs/mechanisms.md §5)
# --------------------------------------------------------------------------------------------------------------

GRN_VERSIONS = ("v1", "v2", "v3")


def dca_num_sources(block: int, last_k: Optional[int]) -> int:
    """Entries of the DCA stack G_t seen by transformer block t (1-based); t = L_b + 1 is the final GRN."""
    produced = block - 1
    if last_k is None or produced <= last_k:
        return 1 + produced
    return last_k + 2


def grn_apply(stack: Tensor, bias: Tensor, proj: Optional[Tensor], version: str) -> Tensor:
    """Generalised residuals of G for several GRN instances at once.

    stack [K, *, d]; bias: v1 [n, K], v2/v3 [n, d, K]; proj (v3 only) [n, d]. Returns [n, *, d]:
      out[g] = sum_i (bias[g, :, i] + ReLU(proj[g] . G[i])) * G[i]
    """
    if version == "v1":
        return torch.einsum("gk,k...d->g...d", bias.to(stack.dtype), stack)
    out = torch.einsum("gdk,k...d->g...d", bias.to(stack.dtype), stack)
    if version == "v3":
        # ReLU with subgradient 1 at 0 (clamp, not torch.relu): proj starts at exactly zero, where torch.relu's
        # zero subgradient would leave the input-dependent term dead for the whole run. Forward is unchanged.
        gate = torch.einsum("k...d,gd->gk...", stack, proj.to(stack.dtype)).clamp(min=0)  # [n, K, *]
        out = out + torch.einsum("gk...,k...d->g...d", gate, stack)
    return out


def grn_apply_sources(sources: Sequence[Tensor], bias: Tensor, proj: Optional[Tensor], version: str) -> Tensor:
    """grn_apply over separate stack entries (the form fast paths take)."""
    return grn_apply(torch.stack(list(sources)), bias, proj, version)


def grn_mean_weights(stack: Tensor, bias: Tensor, proj: Optional[Tensor], version: str) -> Tensor:
    """Per-instance, per-source weight averaged over channels and tokens [n, K] (for heatmaps)."""
    b = fp32(bias) if version == "v1" else fp32(bias).mean(1)
    if version != "v3":
        return b
    gate = torch.einsum("k...d,gd->gk...", fp32(stack), fp32(proj)).clamp(min=0)
    return b + gate.flatten(2).mean(-1)


# --------------------------------------------------------------------------------------------------------------
# Depth-Attention (arXiv 2606.05014, docs/mechanisms.md §6)
# --------------------------------------------------------------------------------------------------------------

DEPTH_ATTN_GQA_MODES = ("query", "group")


def depth_attention_candidates(layer: int, stride: Optional[int], window: int) -> List[int]:
    """Earlier layers (0-based) whose key/value layer `layer` mixes: j % stride == 0, plus the last `window`."""
    return [j for j in range(layer) if (stride and j % stride == 0) or j >= layer - window]


def depth_attention_needed_after(layer: int, num_layers: int, stride: Optional[int], window: int) -> List[int]:
    """Layers j <= layer whose stored key/value some layer after `layer` still mixes (what a hop carries)."""
    return list(_needed_after(layer, num_layers, stride, window))


@functools.lru_cache(maxsize=4096)
def _needed_after(layer: int, num_layers: int, stride: Optional[int], window: int) -> Tuple[int, ...]:
    # cubic in the depth, asked once a layer a step (the state drops what no later layer reads): cached
    later = range(layer + 1, num_layers)
    return tuple(j for j in range(layer + 1)
                 if any(j in depth_attention_candidates(l, stride, window) for l in later))


def expand_heads(x: Tensor, heads: int) -> Tensor:
    """[*, h, hn] -> [*, heads, hn], repeating each head in place (query group g serves heads g*r .. g*r+r-1)."""
    if x.shape[-2] == heads:
        return x
    return x.repeat_interleave(heads // x.shape[-2], dim=-2)


def depth_attention_weights(query: Tensor, keys: Tensor, gqa_mode: str) -> Tensor:
    """softmax over [candidates..., self] of q . k / sqrt(hn), fp32: keys [C+1, *, hkv, hn] (normalised) ->
    [C+1, *, heads] with heads = hq ("query") or hkv ("group": the mean query of each key-value group)."""
    hq, hkv = query.shape[-2], keys.shape[-2]
    if gqa_mode == "query":
        heads, q = hq, query
    elif gqa_mode == "group":
        heads, q = hkv, query.unflatten(-2, (hkv, hq // hkv)).mean(-2)
    else:
        raise ValueError(f"unknown depth-attention GQA mode {gqa_mode!r}; choose one of {DEPTH_ATTN_GQA_MODES}")
    scores = (fp32(expand_heads(keys, heads)) * fp32(q).unsqueeze(0)).sum(-1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=0)


def depth_attention_mix(query: Tensor, key: Tensor, value: Tensor, cand_keys: Optional[Sequence[Tensor]],
                        cand_values: Optional[Sequence[Tensor]], gqa_mode: str = "query") -> Tensor:
    """Depth-mixed value of one layer (docs/mechanisms.md §6).

    query [*, hq, hn] after q-norm (RoPE cancels at equal positions, so none is applied); key [*, hkv, hn] this
    layer's normalised key; value [*, hkv, hn]; cand_keys [C, *, hkv, hn] earlier layers' keys normalised with
    THIS layer's key norm; cand_values [C, *, hv, hn] their stored (mixed) values (or sequences of C tensors).
    Returns v~ with hq heads ("query": the authors' per-query-head form) or hkv heads ("group": keeps the GQA cache
    size).
    """
    heads = query.shape[-2] if gqa_mode == "query" else key.shape[-2]
    if cand_keys is None or len(cand_keys) == 0:
        return expand_heads(value, heads)
    cand_keys, cand_values = (c if isinstance(c, Tensor) else torch.stack(list(c)) for c in (cand_keys, cand_values))
    alpha = depth_attention_weights(query, torch.cat([cand_keys, key.unsqueeze(0)]), gqa_mode)  # [C+1, *, heads]
    values = torch.cat([expand_heads(cand_values, heads), expand_heads(value, heads).unsqueeze(0)])
    return (alpha.to(value.dtype).unsqueeze(-1) * values).sum(0)


# --------------------------------------------------------------------------------------------------------------
# Hyper-Connections (arXiv 2409.19606, docs/mechanisms.md §7). Streams X [n, *, d]: n residual streams per token.
# --------------------------------------------------------------------------------------------------------------


def hc_coefficients(streams: Tensor, A_m: Tensor, A_r: Tensor, B: Tensor, dynamic: Optional[tuple] = None,
                    use_tanh: bool = True, eps: float = 1e-6):
    """Per-token HC weights: a_m [n, *] (stream i into the sublayer input), a_r [n, *, n] (stream i into output
    stream j), b [n, *] (the sublayer output into stream j). Static: the learned A_m, A_r, B.
    dynamic = (gain [d], W_m [d], W_r [d, n], W_b [d], s_alpha, s_beta): each row of X, RMS-normalised with the
    gain, adds s * act(X_i W) to the static values (eqs. 10-13); act = tanh or the identity."""
    lead = (1,) * (streams.dim() - 2)
    a_m = A_m.view(-1, *lead)
    a_r = A_r.view(A_r.shape[0], *lead, A_r.shape[1])
    b = B.view(-1, *lead)
    if dynamic is None:
        return a_m, a_r, b
    gain, W_m, W_r, W_b, s_alpha, s_beta = dynamic
    act = torch.tanh if use_tanh else (lambda t: t)
    normed = (fp32(streams) * rms_inverse(streams, eps).unsqueeze(-1) * fp32(gain))  # [n, *, d] fp32
    a_m = a_m + fp32(s_alpha) * act(normed @ fp32(W_m))
    a_r = a_r + fp32(s_alpha) * act(normed @ fp32(W_r))
    b = b + fp32(s_beta) * act(normed @ fp32(W_b))
    return a_m, a_r, b


def streams_in(streams: Tensor, weights: Tensor) -> Tensor:
    """sum_i w_i X_i: streams [n, *, d], weights [n, *] (or [n, 1...]) -> [*, d] (HC's A_m X, mHC's H_pre X)."""
    return (weights.to(streams.dtype).unsqueeze(-1) * streams).sum(0)


def streams_out(streams: Tensor, output: Tensor, mix: Tensor, post: Tensor) -> Tensor:
    """X'_j = post_j y + sum_i mix[i, j] X_i: streams [n, *, d], output y [*, d], mix [n, *, n] (from i to j),
    post [n, *] -> [n, *, d]."""
    dtype = streams.dtype
    carried = torch.einsum("i...j,i...d->j...d", mix.to(dtype), streams)
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(0) + carried


def hc_unfold(a_m: List[Tensor], a_r: List[Tensor], b: List[Tensor]) -> Tensor:
    """The depth weights c_kj of static HC (eq. 27): x_k = sum_j c_kj v_j with v_0 the embedding (B^0 = 1) and
    v_j the output of sublayer j. a_m[k], b[k]: [n]; a_r[k]: [n, n] (from i to j); sublayers k = 0..L-1.
    Returns c [L, L] (row k: the input of sublayer k; columns j = 0..k)."""
    L, n = len(a_m), a_m[0].shape[0]
    c = torch.zeros(L, L, dtype=a_m[0].dtype)
    for k in range(L):
        for j in range(k + 1):
            vec = torch.ones(n, dtype=a_m[0].dtype) if j == 0 else b[j - 1]  # B^j: v_j into each stream
            for t in range(j, k):  # carried through the residual mixes of sublayers j..k-1, in increasing t
                vec = vec @ a_r[t]
            c[k, j] = vec @ a_m[k]
    return c


# --------------------------------------------------------------------------------------------------------------
# Manifold-constrained Hyper-Connections (arXiv 2512.24880, docs/mechanisms.md §8). All coefficient math in fp32.
# --------------------------------------------------------------------------------------------------------------

MHC_SK_ORDERS = ("paper", "megatron")
MHC_EPS_STYLES = ("clamp", "deepseek")


def sinkhorn(logits: Tensor, iters: int, order: str = "paper", eps_style: str = "clamp", eps: float = 1e-6) -> Tensor:
    """Sinkhorn-Knopp on [*, n, n] logits (eq. 9), fp32. "paper": each iteration normalises the columns, then the
    rows (rows end exact); "megatron": rows, then columns.

    clamp (the paper's form, Megatron-LM's eps): M0 = exp(R - max R), then `iters` iterations, each division by
    max(sum, eps). The max is not detached: once a clamp fires the result depends on the shift, so its gradient
    flows through max R too (where no clamp fires that gradient is exactly zero).
    deepseek (DeepSeek-V4's code, HF transformers' DeepseekV4HyperConnection): the first normalisation is an exact
    softmax of R along the axis normalised first, plus eps; every later division is by sum + eps; the first
    iteration counts as one of `iters`."""
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    r = fp32(logits)
    first, second = (-2, -1) if order == "paper" else (-1, -2)  # -2: column sums (over rows i); -1: row sums

    def normalise(t: Tensor, dim: int) -> Tensor:
        total = t.sum(dim, keepdim=True)
        return t / (total.clamp(min=eps) if eps_style == "clamp" else total + eps)

    if eps_style == "deepseek":
        m = normalise(torch.softmax(r, dim=first) + eps, second)
        iters -= 1
    else:
        m = torch.exp(r - r.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = normalise(normalise(m, first), second)
    return m


def mhc_coefficients(streams: Tensor, phi: Tensor, bias: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                     alpha_res: Tensor, iters: int = 20, order: str = "paper", eps_style: str = "clamp",
                     eps: float = 1e-6):
    """H_pre [n, *], H_post [n, *], H_res [*, n, n] (H_res[i, j]: input stream j into output stream i), fp32.

    streams [n, *, d]; phi [n^2 + 2n, n*d] laid out [pre (n) | post (n) | res (n^2, row-major)]; bias [n^2 + 2n];
    alphas [1]. x~ = vec(X): the streams concatenated per token; r = RMS(x~) (+eps, or inside the root: deepseek)."""
    proj, mean_square = mhc_projection(streams, phi)
    return mhc_projected_coefficients(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res, iters, order,
                                      eps_style, eps)


def mhc_projected_coefficients(proj: Tensor, mean_square: Tensor, bias: Tensor, alpha_pre: Tensor,
                               alpha_post: Tensor, alpha_res: Tensor, iters: int = 20, order: str = "paper",
                               eps_style: str = "clamp", eps: float = 1e-6):
    """mhc_coefficients from the projection (proj [*, n^2 + 2n], mean_square [*, 1], as mhc_projection gives
    them): the maps and Sinkhorn (the fast twin: one kernel)."""
    pre, post, res_logits = mhc_projected_maps(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res, eps_style,
                                               eps)
    return pre, post, sinkhorn(res_logits, iters, order, eps_style, eps)


def mhc_maps(streams: Tensor, phi: Tensor, bias: Tensor, alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor,
             eps_style: str = "clamp", eps: float = 1e-6, project=None):
    """mhc_coefficients before Sinkhorn: H_pre [n, *], H_post [n, *] and H_res's logits [*, n, n], fp32. `project`
    computes mhc_projection (its fast twin on the fast path)."""
    proj, mean_square = (project or mhc_projection)(streams, phi)  # [*, n^2 + 2n], [*, 1]
    return mhc_projected_maps(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res, eps_style, eps)


def mhc_projected_maps(proj: Tensor, mean_square: Tensor, bias: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                       alpha_res: Tensor, eps_style: str = "clamp", eps: float = 1e-6):
    """mhc_maps from the projection."""
    n = mhc_streams_of(proj.shape[-1])
    r = mhc_rms(mean_square, eps_style, eps)
    scale = torch.cat([fp32(alpha_pre).expand(n), fp32(alpha_post).expand(n), fp32(alpha_res).expand(n * n)])
    coeff = proj * scale / r + fp32(bias)
    pre = torch.sigmoid(coeff[..., :n]) + (eps if eps_style == "deepseek" else 0.0)
    post = 2 * torch.sigmoid(coeff[..., n:2 * n])
    return pre.movedim(-1, 0), post.movedim(-1, 0), coeff[..., 2 * n:].unflatten(-1, (n, n))


def mhc_streams_of(m: int) -> int:
    """n from the projection's width m = n^2 + 2n = (n + 1)^2 - 1."""
    return math.isqrt(m + 1) - 1


def mhc_projection(streams: Tensor, phi: Tensor):
    """(x~ phi^T [*, m], the mean square of x~ [*, 1]), fp32: x~ the n streams [n, *, d] of each token concatenated
    [*, n*d], phi [m, n*d]. The fast twin reads the streams once for both, with no fp32 copy of them."""
    flat = fp32(streams).movedim(0, -2).flatten(-2)
    return flat @ fp32(phi).T, flat.pow(2).mean(-1, keepdim=True)


def mhc_rms(mean_square: Tensor, eps_style: str = "clamp", eps: float = 1e-6) -> Tensor:
    """The gain-less RMS r [*, 1] of x~ from its mean square, with eps added to r (clamp) or inside the root
    (deepseek, as DeepSeek-V4's code)."""
    return torch.sqrt(mean_square + eps) if eps_style == "deepseek" else torch.sqrt(mean_square) + eps


def mhc_head_weights(streams: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, eps_style: str = "clamp",
                     eps: float = 1e-6, project=None) -> Tensor:
    """The learned collapse (DeepSeek-V4's hc_head): w_i = sigmoid(alpha (x~ phi)_i / r + b_i) + eps -> [n, *], with
    r as mhc_maps computes it for the same eps style."""
    proj, mean_square = (project or mhc_projection)(streams, phi)
    r = mhc_rms(mean_square, eps_style, eps)
    return (torch.sigmoid(fp32(alpha) * proj / r + fp32(bias)) + eps).movedim(-1, 0)


# --------------------------------------------------------------------------------------------------------------
# DenseFormer (arXiv 2402.02622, docs/mechanisms.md §9): depth-weighted averages of block outputs
# --------------------------------------------------------------------------------------------------------------


def dwa_sources(unit: int, dilation: int) -> List[int]:
    """S_i: the outputs X_j (j = 0..i, X_0 the embedding) a DWA after unit i averages: j = i (mod k)."""
    return [j for j in range(unit + 1) if j % dilation == unit % dilation]


def dwa_units(num_units: int, period: int) -> List[int]:
    """The units (1-based) followed by a DWA: every p-th."""
    return [i for i in range(1, num_units + 1) if i % period == 0]


def dwa_needed_after(unit: int, num_units: int, dilation: int, period: int) -> List[int]:
    """Outputs X_j, j <= unit, that a DWA after `unit` still reads (what a pipeline hop carries,
    docs/mechanisms.md §11)."""
    later = {i % dilation for i in dwa_units(num_units, period) if i > unit}
    return [j for j in range(unit + 1) if j % dilation in later]


def dwa(outputs: Tensor, alpha: Tensor) -> Tensor:
    """Y = sum_j alpha_j X_j over outputs [K, *, d] with plain scalars alpha [K] (no softmax): at the identity
    init (0, ..., 0, 1) the result is X_i bit for bit."""
    return torch.einsum("k,k...d->...d", alpha.to(outputs.dtype), outputs)


def dwa_mix(outputs: Sequence[Tensor], alpha: Tensor) -> Tensor:
    """dwa over separate output tensors (the form fast paths take)."""
    return dwa(torch.stack(list(outputs)), alpha)
