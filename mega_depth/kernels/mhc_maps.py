"""mHC's coefficients from the projection, fused: `mhc_projected_coefficients` (reference:
mixing.mhc_projected_coefficients, the maps and Sinkhorn).

From a token's projection x~ phi^T (m = n^2 + 2n values) and mean square, one kernel computes the RMS, the scaled and
biased coefficients, H_pre = sigmoid(.) (+ eps: deepseek), H_post = 2 sigmoid(.) and H_res = Sinkhorn(.) (the
half-steps of kernels/sinkhorn.py): about twenty eager ops a sublayer and the Sinkhorn launch become one launch, and
as many in backward become one. Backward keeps the projection and the mean square (m + 1 values a token) and
recomputes the rest; it writes the projection's and the mean square's gradients (fp32) and, per program, fp32
partial sums of the bias's and the three alphas' gradients, which common.sum_rows reduces (deterministic).
H_pre and H_post come out as [n, *] (the stream kernels read them so), H_res as [*, n, n]. The op is
`mega_depth::mhc_projected_coefficients`.
"""

from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from mega_depth.kernels.common import (F32, in_dtype, jit, launch, partial_sums, partial_width, register_fake,
                                       sum_rows, tl, uses_triton)
from mega_depth.kernels.eager import autograd, call
from mega_depth.kernels.sinkhorn import _half_step, _start, chain, launch_args, logits_grad
from mega_depth.kernels.sinkhorn import _torch_bwd as _torch_sinkhorn_bwd
from mega_depth.kernels.sinkhorn import _torch_fwd as _torch_sinkhorn_fwd
from mega_depth.model import mixing

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------
# A block of BT tokens; proj rows [N, M] (M = NS^2 + 2 NS: pre | post | res row-major), mean squares [N]; alphas
# fp32 [3] (pre, post, res). H_pre / H_post [NS, N], H_res [N, NS, NS]. The pre and post lanes are [BT, BN], the res
# lanes [BT, BN, BN] (token, row i, column j); padded lanes are masked.


@jit
def _rows(pid, N, NS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    """(tokens [BT] int64, their mask, stream lanes [BN], their mask, res offsets within a row [BN, BN], mask)."""
    ot = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    oi = tl.arange(0, BN)
    lane = (oi[:, None] < NS) & (oi[None, :] < NS)
    return ot, ot < N, oi, oi < NS, 2 * NS + oi[:, None] * NS + oi[None, :], lane


@jit
def _rms(ms_ptr, ot, tmask, eps, CLAMP: tl.constexpr):
    """(r [BT], d r / d ms [BT]): sqrt(ms) + eps (clamp) or sqrt(ms + eps) (deepseek)."""
    ms = tl.load(ms_ptr + ot, mask=tmask, other=1.)
    root = tl.sqrt(ms) if CLAMP else tl.sqrt(ms + eps)
    return (root + eps if CLAMP else root), 0.5 / root


@jit
def _vector(p_ptr, b_ptr, a, r, ot, tmask, oi, imask, shift, M):
    """(proj [BT, BN], coefficients proj * alpha / r + bias [BT, BN]) of the n values at `shift` of each row."""
    mask = tmask[:, None] & imask[None, :]
    p = tl.load(p_ptr + ot[:, None] * M + shift + oi[None, :], mask=mask, other=0.)
    b = tl.load(b_ptr + shift + oi, mask=imask, other=0.)
    return p, p * a / r[:, None] + b[None, :]


@jit
def _matrix(p_ptr, b_ptr, a, r, ot, tmask, offs, lane, M):
    """(proj [BT, BN, BN], logits [BT, BN, BN], -inf on padded lanes) of the n x n res values of each row."""
    mask = tmask[:, None, None] & lane[None, :, :]
    p = tl.load(p_ptr + ot[:, None, None] * M + offs[None, :, :], mask=mask, other=0.)
    b = tl.load(b_ptr + offs, mask=lane, other=0.)
    logits = p * a / r[:, None, None] + b[None, :, :]
    return p, tl.where(lane[None, :, :], logits, -float("inf"))


@jit
def _fwd_kernel(p_ptr, ms_ptr, b_ptr, a_ptr, pre_ptr, post_ptr, res_ptr, N, M, STEPS, eps, NS: tl.constexpr,
                BT: tl.constexpr, BN: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr):
    ot, tmask, oi, imask, offs, lane = _rows(tl.program_id(0), N, NS, BT, BN)
    r, _ = _rms(ms_ptr, ot, tmask, eps, CLAMP)
    vmask = imask[None, :] & tmask[:, None]
    _, c = _vector(p_ptr, b_ptr, tl.load(a_ptr), r, ot, tmask, oi, imask, 0, M)
    tl.store(pre_ptr + oi[None, :] * N + ot[:, None], tl.sigmoid(c) + (0. if CLAMP else eps), mask=vmask)
    _, c = _vector(p_ptr, b_ptr, tl.load(a_ptr + 1), r, ot, tmask, oi, imask, NS, M)
    tl.store(post_ptr + oi[None, :] * N + ot[:, None], 2. * tl.sigmoid(c), mask=vmask)
    _, logits = _matrix(p_ptr, b_ptr, tl.load(a_ptr + 2), r, ot, tmask, offs, lane, M)
    lanes = tmask[:, None, None] & lane[None, :, :]
    m = _start(logits, lanes, eps, FIRST, CLAMP)
    for h in range(STEPS):
        m = _half_step(m, h, eps, FIRST, SECOND, CLAMP)
    tl.store(res_ptr + ot[:, None, None] * NS * NS + (offs - 2 * NS)[None, :, :], m, mask=lanes)


@jit
def _bwd_kernel(p_ptr, ms_ptr, b_ptr, a_ptr, gpre_ptr, gpost_ptr, gres_ptr, dp_ptr, dms_ptr, part_ptr, chain_ptr, W,
                AOFF, N, M, STEPS, eps, NS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, FIRST: tl.constexpr,
                SECOND: tl.constexpr, CLAMP: tl.constexpr):
    """dp = d coeff * alpha / r; d r = -sum(d coeff * proj * alpha) / r^2; the bias's partial sums of this
    program's tokens in row pid of part [P, W >= AOFF + 3], the alphas' from column AOFF (masked tokens add
    zero)."""
    pid = tl.program_id(0)
    db_ptr = part_ptr + pid.to(tl.int64) * W
    da_ptr = db_ptr + AOFF
    ot, tmask, oi, imask, offs, lane = _rows(pid, N, NS, BT, BN)
    r, root_grad = _rms(ms_ptr, ot, tmask, eps, CLAMP)
    vmask = imask[None, :] & tmask[:, None]
    lanes = tmask[:, None, None] & lane[None, :, :]
    a_pre, a_post, a_res = tl.load(a_ptr), tl.load(a_ptr + 1), tl.load(a_ptr + 2)
    # H_pre = sigmoid(c) (+ eps), H_post = 2 sigmoid(c): d c = g * s (1 - s) (* 2)
    p, c = _vector(p_ptr, b_ptr, a_pre, r, ot, tmask, oi, imask, 0, M)
    s = tl.sigmoid(c)
    dc = tl.load(gpre_ptr + oi[None, :] * N + ot[:, None], mask=vmask, other=0.) * s * (1. - s)
    dr = tl.sum(dc * p, axis=1) * a_pre
    tl.store(dp_ptr + ot[:, None] * M + oi[None, :], dc * a_pre / r[:, None], mask=vmask)
    tl.store(db_ptr + oi, tl.sum(dc, axis=0), mask=imask)
    tl.store(da_ptr, tl.sum(tl.sum(dc * p, axis=1) / r, axis=0))
    p, c = _vector(p_ptr, b_ptr, a_post, r, ot, tmask, oi, imask, NS, M)
    s = tl.sigmoid(c)
    dc = tl.load(gpost_ptr + oi[None, :] * N + ot[:, None], mask=vmask, other=0.) * 2. * s * (1. - s)
    dr += tl.sum(dc * p, axis=1) * a_post
    tl.store(dp_ptr + ot[:, None] * M + NS + oi[None, :], dc * a_post / r[:, None], mask=vmask)
    tl.store(db_ptr + NS + oi, tl.sum(dc, axis=0), mask=imask)
    tl.store(da_ptr + 1, tl.sum(tl.sum(dc * p, axis=1) / r, axis=0))
    # H_res = Sinkhorn(logits)
    p, logits = _matrix(p_ptr, b_ptr, a_res, r, ot, tmask, offs, lane, M)
    res = ot[:, None, None] * NS * NS + (offs - 2 * NS)[None, :, :]  # [BT, BN, BN] lanes of [N, n, n]
    g = tl.load(gres_ptr + res, mask=lanes, other=0.)
    dc = tl.where(lanes, logits_grad(logits, lanes, g, STEPS, eps, chain_ptr, res, N * NS * NS, FIRST, SECOND,
                                     CLAMP), 0.)
    dcp = tl.sum(tl.sum(dc * p, axis=2), axis=1)
    dr += dcp * a_res
    tl.store(dp_ptr + ot[:, None, None] * M + offs[None, :, :], dc * a_res / r[:, None, None], mask=lanes)
    tl.store(db_ptr + offs, tl.sum(dc, axis=0), mask=lane)
    tl.store(da_ptr + 2, tl.sum(dcp / r, axis=0))
    # coefficients = proj * alpha / r + bias: d r = -sum(d c * proj * alpha) / r^2, then r's root
    tl.store(dms_ptr + ot, -dr / (r * r) * root_grad, mask=tmask)


def _triton_fwd(proj, ms, bias, alphas, n, iters, order, eps_style, eps):
    """bias [m] and alphas [3]: fp32 (or fp64), views of one packed vector (_inputs)."""
    tokens, m = proj.shape
    pre = torch.empty((n, tokens), dtype=F32, device=proj.device)
    post = torch.empty_like(pre)
    res = torch.empty((tokens, n, n), dtype=F32, device=proj.device)
    if tokens:
        grid, consts, steps, num_warps = launch_args(order, eps_style, iters, n, tokens, proj.device)
        launch(_fwd_kernel, grid, (proj, ms, bias, alphas, pre, post, res, tokens, m, steps, eps), num_warps,
               **consts)
    return pre, post, res


def _triton_bwd(g_pre, g_post, g_res, proj, ms, bias, alphas, n, iters, order, eps_style, eps,
                dtypes=(F32, F32)):
    """-> (d_proj, d_ms, d_bias, d_alphas), the last two in `dtypes` (the parameters')."""
    tokens, m = proj.shape
    grid, consts, steps, num_warps = launch_args(order, eps_style, iters, n, tokens, proj.device)
    d_proj = torch.empty_like(proj)
    d_ms = torch.empty_like(ms)
    # the bias's partials, then the alphas' from the next multiple of 16: one sum_rows launch sums both, each
    # rounded to its parameter's dtype (no cast launches after it)
    alphas_at = partial_width(m)
    parts = partial_sums(grid[0], alphas_at + 3, proj.device)
    if tokens:
        launch(_bwd_kernel, grid, (proj, ms, bias, alphas, g_pre, g_post, g_res, d_proj, d_ms, parts,
                                   chain(steps, tokens, n, proj.device), parts.shape[1], alphas_at, tokens, m, steps,
                                   eps),
               num_warps, **consts)
    d_bias, d_alphas = sum_rows(parts, m, dtypes=[dtypes[0]], tail=(alphas_at, 3, dtypes[1]))
    return d_proj, d_ms, d_bias, d_alphas


# --------------------------------------------------------------------------------------------------------------
# The torch twin: the kernels' math in torch, Sinkhorn's from kernels/sinkhorn.py (below autograd, so backward is
# written out); proj [N, m], ms [N] in the accumulation dtype
# --------------------------------------------------------------------------------------------------------------


def _torch_coefficients(proj, ms, bias, alphas, n, eps_style, eps):
    """(r [N, 1], scale [m], coefficients [N, m]) as the reference computes them."""
    r = mixing.mhc_rms(ms.unsqueeze(-1), eps_style, eps)
    scale = torch.cat([alphas[0].expand(n), alphas[1].expand(n), alphas[2].expand(n * n)])
    return r, scale, proj * scale / r + bias


def _torch_fwd(proj, ms, bias, alphas, n, iters, order, eps_style, eps):
    _, _, c = _torch_coefficients(proj, ms, bias, alphas, n, eps_style, eps)
    pre = torch.sigmoid(c[:, :n]) + (eps if eps_style == "deepseek" else 0.0)
    post = 2 * torch.sigmoid(c[:, n:2 * n])
    res = _torch_sinkhorn_fwd(c[:, 2 * n:].reshape(-1, n, n).contiguous(), iters, order, eps_style, eps)
    return pre.t().contiguous(), post.t().contiguous(), res


def _torch_bwd(g_pre, g_post, g_res, proj, ms, bias, alphas, n, iters, order, eps_style, eps):
    r, scale, c = _torch_coefficients(proj, ms, bias, alphas, n, eps_style, eps)
    s_pre, s_post = torch.sigmoid(c[:, :n]), torch.sigmoid(c[:, n:2 * n])
    dc = torch.cat([g_pre.t() * s_pre * (1 - s_pre), g_post.t() * 2 * s_post * (1 - s_post),
                    _torch_sinkhorn_bwd(g_res, c[:, 2 * n:].reshape(-1, n, n).contiguous(), iters, order,
                                        eps_style, eps).flatten(1)], dim=1)
    root = ms.unsqueeze(-1).sqrt() if eps_style == "clamp" else r
    d_ms = (-(dc * proj * scale).sum(1, keepdim=True) / (r * r) * 0.5 / root).squeeze(1)
    by_group = (dc * proj / r)
    d_alphas = torch.stack([by_group[:, :n].sum(), by_group[:, n:2 * n].sum(), by_group[:, 2 * n:].sum()])
    return dc * scale / r, d_ms, dc.sum(0), d_alphas


# --------------------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------------------


def _inputs(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res):
    """proj as [N, m], the mean squares as [N], the bias [m] and the alphas [3], all contiguous in proj's dtype
    (fp32 at least: a kernel reads no lone 16-bit value). The bias and the alphas are views of one vector: one
    concatenation and one cast a call (it was a concatenation and two casts)."""
    ct, m = proj.dtype, proj.shape[-1]
    rows = proj.reshape(-1, m).contiguous()
    packed = in_dtype(torch.cat([bias.reshape(m), alpha_pre.reshape(1), alpha_post.reshape(1),
                                 alpha_res.reshape(1)]), ct)
    return rows, in_dtype(mean_square.reshape(-1), ct).contiguous(), packed[:m], packed[m:]


@torch.library.custom_op("mega_depth::mhc_projected_coefficients", mutates_args=())
def coefficients_op(proj: Tensor, mean_square: Tensor, bias: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                    alpha_res: Tensor, iters: int, order: str, eps_style: str, eps: float) -> List[Tensor]:
    """proj [*, m] and mean_square [*, 1] (fp32 or fp64) -> [H_pre [n, *], H_post [n, *], H_res [*, n, n]]."""
    n, lead = mixing.mhc_streams_of(proj.shape[-1]), proj.shape[:-1]
    rows, ms, b, alphas = _inputs(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res)
    fwd = _triton_fwd if uses_triton(rows) else _torch_fwd
    pre, post, res = fwd(rows, ms, b, alphas, n, iters, order, eps_style, eps)
    return [pre.view(n, *lead), post.view(n, *lead), res.view(*lead, n, n)]


@register_fake(coefficients_op)
def _(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res, iters, order, eps_style, eps):
    n, lead = mixing.mhc_streams_of(proj.shape[-1]), proj.shape[:-1]
    return [proj.new_empty((n, *lead)), proj.new_empty((n, *lead)), proj.new_empty((*lead, n, n))]


@torch.library.custom_op("mega_depth::mhc_projected_coefficients_backward", mutates_args=())
def coefficients_backward_op(grad_pre: Tensor, grad_post: Tensor, grad_res: Tensor, proj: Tensor,
                             mean_square: Tensor, bias: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                             alpha_res: Tensor, iters: int, order: str, eps_style: str, eps: float) -> List[Tensor]:
    """-> [proj's gradient [*, m], mean_square's [*, 1] (proj's dtype), bias's [m] (the bias's dtype), the alphas'
    [3] (alpha_pre's dtype)]."""
    n = mixing.mhc_streams_of(proj.shape[-1])
    rows, ms, b, alphas = _inputs(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res)
    ct = rows.dtype
    grads = [in_dtype(g.reshape(shape), ct).contiguous()
             for g, shape in ((grad_pre, (n, -1)), (grad_post, (n, -1)), (grad_res, (-1, n, n)))]
    dtypes = (bias.dtype, alpha_pre.dtype)
    if uses_triton(rows):
        d_proj, d_ms, d_bias, d_alphas = _triton_bwd(*grads, rows, ms, b, alphas, n, iters, order, eps_style, eps,
                                                     dtypes)
    else:
        d_proj, d_ms, d_bias, d_alphas = _torch_bwd(*grads, rows, ms, b, alphas, n, iters, order, eps_style, eps)
    return [d_proj.view_as(proj), d_ms.view_as(mean_square), in_dtype(d_bias, dtypes[0]),
            in_dtype(d_alphas, dtypes[1])]


@register_fake(coefficients_backward_op)
def _(grad_pre, grad_post, grad_res, proj, mean_square, bias, alpha_pre, alpha_post, alpha_res, iters, order,
      eps_style, eps):
    return [proj.new_empty(proj.shape), mean_square.new_empty(mean_square.shape),
            bias.new_empty((proj.shape[-1],)), alpha_pre.new_empty((3,))]


def _setup(ctx, inputs, output):
    proj, mean_square, bias, alpha_pre, alpha_post, alpha_res, *cfg = inputs
    ctx.save_for_backward(proj, mean_square, bias, alpha_pre, alpha_post, alpha_res)
    ctx.cfg = cfg
    ctx.set_materialize_grads(False)


def _backward(ctx, grads):
    proj, mean_square, bias, alpha_pre, alpha_post, alpha_res = ctx.saved_tensors
    n, lead = mixing.mhc_streams_of(proj.shape[-1]), proj.shape[:-1]
    shapes = ((n, *lead), (n, *lead), (*lead, n, n))
    grads = [g if g is not None else proj.new_zeros(shape) for g, shape in zip(grads, shapes)]
    d_proj, d_ms, d_bias, d_alphas = call(coefficients_backward_op, *grads, proj, mean_square, bias, alpha_pre,
                                          alpha_post, alpha_res, *ctx.cfg)
    need = ctx.needs_input_grad
    # (in the parameters' dtypes already, where the three alphas share one)
    alphas = [in_dtype(d_alphas[i:i + 1], a.dtype) if need[3 + i] else None
              for i, a in enumerate((alpha_pre, alpha_post, alpha_res))]
    return (d_proj if need[0] else None, d_ms if need[1] else None, in_dtype(d_bias, bias.dtype) if need[2] else None,
            *alphas, None, None, None, None)


autograd(coefficients_op, _backward, _setup)


def mhc_projected_coefficients(proj: Tensor, mean_square: Tensor, bias: Tensor, alpha_pre: Tensor,
                               alpha_post: Tensor, alpha_res: Tensor, iters: int = 20, order: str = "paper",
                               eps_style: str = "clamp", eps: float = 1e-6):
    """== mixing.mhc_projected_coefficients(...): proj [*, n^2 + 2n], mean_square [*, 1] -> (H_pre [n, *],
    H_post [n, *], H_res [*, n, n]), fp32 (fp64 stays fp64)."""
    if order not in mixing.MHC_SK_ORDERS or eps_style not in mixing.MHC_EPS_STYLES:
        raise ValueError(f"unknown Sinkhorn order {order!r} or epsilon style {eps_style!r}; choose from "
                         f"{mixing.MHC_SK_ORDERS} and {mixing.MHC_EPS_STYLES}")
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    pre, post, res = call(coefficients_op, mixing.fp32(proj), mixing.fp32(mean_square), bias, alpha_pre,
                          alpha_post, alpha_res, int(iters), order, eps_style, float(eps))
    return pre, post, res
