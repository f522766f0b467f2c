"""mHC's Sinkhorn-Knopp over per-token [n, n] logits, fused: `sinkhorn` (reference: mixing.sinkhorn).

Every iteration runs in one kernel, a block of tokens held in registers. Backward keeps nothing from the forward
but the logits: it runs the chain again, keeping each normalisation's input in a scratch buffer (n^2 fp32 a token a
half-step, read back from L2), then applies the gradients of the normalisations, last to first, and the start's.

The computation is a start and a chain of half-steps (one normalisation each, by max(sum, eps) for the clamp style,
by sum + eps for deepseek):
    clamp:    M0 = exp(R - max R) over the whole matrix; 2 * iters half-steps, the first along the axis that the
              order normalises first. The max is not detached: its gradient flows too (ties share it, as amax's).
    deepseek: M0 = softmax(R) along that first axis, + eps; then 2 * iters - 1 half-steps, starting with the other
              axis (the softmax is the first iteration's first normalisation).
The op is `mega_depth::mhc_sinkhorn`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mega_depth.kernels.common import (cdiv, jit, launch, pow2, pow2_floor, register_fake, sm_count, tl,
                                       uses_triton)
from mega_depth.kernels.eager import autograd, call
from mega_depth.model import mixing

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------
# A block of BT tokens is [BT, BN, BN] (token, row i, column j); padded lanes hold 0 after the start, so sums are
# unaffected. FIRST: the axis normalised first in an iteration (1 = column sums over i, the paper's order; 2 = row
# sums); SECOND the other.


@jit
def _load(r_ptr, pid, N, NS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    """(offsets, lanes, R) of a block of tokens; R is -inf on padded lanes."""
    ot = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    oi = tl.arange(0, BN)
    lane = (oi[:, None] < NS) & (oi[None, :] < NS)
    offs = ot[:, None, None] * NS * NS + oi[None, :, None] * NS + oi[None, None, :]
    lanes = (ot < N)[:, None, None] & lane[None, :, :]
    r = tl.load(r_ptr + offs, mask=lanes, other=0.).to(tl.float32)
    return offs, lanes, tl.where(lane[None, :, :], r, -float("inf"))


@jit
def _softmax(r, lanes, axis: tl.constexpr):
    """Softmax of r along axis on the real lanes (0 elsewhere, also where a whole slice is padding)."""
    peak = tl.expand_dims(tl.max(r, axis=axis), axis)
    peak = tl.where(peak == -float("inf"), 0., peak)
    e = tl.where(lanes, tl.exp(r - peak), 0.)
    total = tl.expand_dims(tl.sum(e, axis=axis), axis)
    return e / tl.where(total == 0., 1., total)


@jit
def _start(r, lanes, eps, FIRST: tl.constexpr, CLAMP: tl.constexpr):
    if CLAMP:
        peak = tl.max(tl.max(r, axis=2), axis=1)
        return tl.where(lanes, tl.exp(r - peak[:, None, None]), 0.)
    return tl.where(lanes, _softmax(r, lanes, FIRST) + eps, 0.)


@jit
def _normalise(t, axis: tl.constexpr, eps, CLAMP: tl.constexpr):
    total = tl.expand_dims(tl.sum(t, axis=axis), axis)
    return t / (tl.maximum(total, eps) if CLAMP else total + eps)


@jit
def _normalise_bwd(t, g, axis: tl.constexpr, eps, CLAMP: tl.constexpr):
    """The gradient w.r.t. t of t / s(t) (s: the sum along axis, clamped or shifted by eps) given g."""
    total = tl.expand_dims(tl.sum(t, axis=axis), axis)
    s = tl.maximum(total, eps) if CLAMP else total + eps
    ds = -tl.expand_dims(tl.sum(g * t, axis=axis), axis) / (s * s)
    if CLAMP:
        ds = tl.where(total >= eps, ds, 0.)  # clamp(min=eps) passes the gradient where total >= eps
    return g / s + ds


@jit
def _half_step(t, h, eps, FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr):
    """Half-step h of the chain: along FIRST when h is even for clamp (odd for deepseek), else along SECOND."""
    if (h + (0 if CLAMP else 1)) % 2 == 0:
        t = _normalise(t, FIRST, eps, CLAMP)
    else:
        t = _normalise(t, SECOND, eps, CLAMP)
    return t


@jit
def _half_step_bwd(t, g, h, eps, FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr):
    if (h + (0 if CLAMP else 1)) % 2 == 0:
        g = _normalise_bwd(t, g, FIRST, eps, CLAMP)
    else:
        g = _normalise_bwd(t, g, SECOND, eps, CLAMP)
    return g


@jit
def _fwd_kernel(r_ptr, out_ptr, N, STEPS, eps, NS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr):
    offs, lanes, r = _load(r_ptr, tl.program_id(0), N, NS, BT, BN)
    m = _start(r, lanes, eps, FIRST, CLAMP)
    for h in range(STEPS):
        m = _half_step(m, h, eps, FIRST, SECOND, CLAMP)
    tl.store(out_ptr + offs, m, mask=lanes)


@jit
def _bwd_kernel(r_ptr, go_ptr, dr_ptr, chain_ptr, N, STEPS, eps, NS: tl.constexpr, BT: tl.constexpr,
                BN: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr):
    offs, lanes, r = _load(r_ptr, tl.program_id(0), N, NS, BT, BN)
    g = tl.load(go_ptr + offs, mask=lanes, other=0.).to(tl.float32)
    grad = logits_grad(r, lanes, g, STEPS, eps, chain_ptr, offs, N * NS * NS, FIRST, SECOND, CLAMP)
    tl.store(dr_ptr + offs, grad, mask=lanes)


@jit
def logits_grad(r, lanes, g, STEPS, eps, chain_ptr, offs, STEP, FIRST: tl.constexpr, SECOND: tl.constexpr,
                CLAMP: tl.constexpr):
    """The logits' gradient [BT, BN, BN] given the output's g, the logits r in registers (-inf on padded lanes):
    the chain again, each half-step's input kept in chain_ptr [STEPS, N, n, n] (at offs + h * STEP: offs are the
    tokens' own [n, n] lanes), then each half-step's gradient, last to first (kernels/mhc_maps.py runs it too).
    Recomputing each input from the start instead cost O(STEPS^2) half-steps: 820 a token at mHC's 20 iterations
    against these 40, for 2.5 KB a token of scratch, read back from L2."""
    m0 = _start(r, lanes, eps, FIRST, CLAMP)
    x = m0
    for h in range(STEPS):
        tl.store(chain_ptr + h * STEP + offs, x, mask=lanes)
        x = _half_step(x, h, eps, FIRST, SECOND, CLAMP)
    # the stores seen by every thread of the program before it reads them back: where a block holds fewer lanes than
    # threads, a lane's reader need not be its writer
    tl.debug_barrier()
    for back in range(STEPS):
        h = STEPS - 1 - back
        x = tl.load(chain_ptr + h * STEP + offs, mask=lanes, other=0.)
        g = _half_step_bwd(x, g, h, eps, FIRST, SECOND, CLAMP)
    if CLAMP:  # m0 = exp(R - max R): the max's gradient is shared by the entries that attain it
        gm = g * m0
        peak = tl.max(tl.max(r, axis=2), axis=1)[:, None, None]
        is_peak = lanes & (r == peak)
        ties = tl.sum(tl.sum(is_peak.to(tl.float32), axis=2), axis=1)[:, None, None]
        total = tl.sum(tl.sum(gm, axis=2), axis=1)[:, None, None]
        return gm - tl.where(is_peak, total / tl.maximum(ties, 1.), 0.)
    # m0 = softmax(R) + eps along FIRST
    s = _softmax(r, lanes, FIRST)
    return s * (g - tl.expand_dims(tl.sum(g * s, axis=FIRST), FIRST))


def launch_args(order: str, eps_style: str, iters: int, n: int, tokens: int, device: torch.device):
    """(grid, constexprs, STEPS, warps): a block of tokens a program, about 2k fp32 values, fewer where that would
    leave under 4 programs an SM (each program is a serial chain of half-steps: 128 tokens a program gave the 1B
    step's 4,096 32 programs for 132 SMs); 8 values a thread, on one warp where there are fewer."""
    first = 1 if order == "paper" else 2  # axis 1: sums over rows i (column sums), the reference's dim -2
    clamp = eps_style == "clamp"
    bn = pow2(n)
    bt = max(1, min(pow2(tokens), 2048 // (bn * bn), pow2_floor(tokens // (4 * sm_count(device)))))
    consts = dict(NS=n, BT=bt, BN=bn, FIRST=first, SECOND=3 - first, CLAMP=clamp)
    return (cdiv(tokens, bt),), consts, 2 * iters - (0 if clamp else 1), max(1, min(8, bt * bn * bn // 256))


def chain(steps: int, tokens: int, n: int, device: torch.device) -> Tensor:
    """logits_grad's scratch: every half-step's input, [steps, tokens, n, n] fp32."""
    return torch.empty((steps, tokens, n, n), dtype=torch.float32, device=device)


def _triton_fwd(r: Tensor, iters: int, order: str, eps_style: str, eps: float) -> Tensor:
    """r: [N, n, n] fp32 logits -> [N, n, n] fp32."""
    tokens, n = r.shape[0], r.shape[-1]
    out = torch.empty_like(r)
    if tokens:
        grid, consts, steps, num_warps = launch_args(order, eps_style, iters, n, tokens, r.device)
        launch(_fwd_kernel, grid, (r, out, tokens, steps, eps), num_warps, **consts)
    return out


def _triton_bwd(go: Tensor, r: Tensor, iters: int, order: str, eps_style: str, eps: float) -> Tensor:
    tokens, n = r.shape[0], r.shape[-1]
    dr = torch.empty_like(r)
    if tokens:
        grid, consts, steps, num_warps = launch_args(order, eps_style, iters, n, tokens, r.device)
        launch(_bwd_kernel, grid, (r, go, dr, chain(steps, tokens, n, r.device), tokens, steps, eps), num_warps,
               **consts)
    return dr


# --------------------------------------------------------------------------------------------------------------
# The torch twin: the kernels' start and half-steps in torch (an op's implementation runs below autograd, so its
# backward is written out as the kernel's is; here every half-step's input is kept instead of recomputed)
# --------------------------------------------------------------------------------------------------------------


def _torch_chain(r, iters, order, eps_style, eps):
    """(M0, [(input, dim) of every half-step], output): dims -2 (column sums) and -1 (row sums)."""
    first, second = (-2, -1) if order == "paper" else (-1, -2)
    clamp = eps_style == "clamp"
    m = torch.exp(r - r.amax((-2, -1), keepdim=True)) if clamp else torch.softmax(r, first) + eps
    dims = [first, second] * iters if clamp else [second] + [first, second] * (iters - 1)
    steps, m0 = [], m
    for dim in dims:
        steps.append((m, dim))
        total = m.sum(dim, keepdim=True)
        m = m / (total.clamp(min=eps) if clamp else total + eps)
    return m0, steps, m


def _torch_fwd(r, iters, order, eps_style, eps):
    return _torch_chain(r, iters, order, eps_style, eps)[2]


def _torch_bwd(go, r, iters, order, eps_style, eps):
    clamp = eps_style == "clamp"
    m0, steps, _ = _torch_chain(r, iters, order, eps_style, eps)
    g = go
    for t, dim in reversed(steps):
        total = t.sum(dim, keepdim=True)
        den = total.clamp(min=eps) if clamp else total + eps
        ds = -(g * t).sum(dim, keepdim=True) / den.pow(2)
        if clamp:
            ds = torch.where(total >= eps, ds, 0.)  # clamp(min=eps) passes the gradient where total >= eps
        g = g / den + ds
    if clamp:  # m0 = exp(R - max R): the max's gradient is shared by the entries that attain it (as amax's)
        gm = g * m0
        is_peak = r == r.amax((-2, -1), keepdim=True)
        ties = is_peak.sum((-2, -1), keepdim=True)
        return gm - is_peak * gm.sum((-2, -1), keepdim=True) / ties
    first = -2 if order == "paper" else -1
    s = torch.softmax(r, first)
    return s * (g - (g * s).sum(first, keepdim=True))


# --------------------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mega_depth::mhc_sinkhorn", mutates_args=())
def sinkhorn_op(logits: Tensor, iters: int, order: str, eps_style: str, eps: float) -> Tensor:
    """logits [*, n, n] (fp32 or fp64) -> doubly stochastic [*, n, n], same dtype."""
    r = logits.reshape(-1, *logits.shape[-2:]).contiguous()
    return (_triton_fwd if uses_triton(r) else _torch_fwd)(r, iters, order, eps_style, eps).view(logits.shape)


@register_fake(sinkhorn_op)
def _(logits, iters, order, eps_style, eps):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("mega_depth::mhc_sinkhorn_backward", mutates_args=())
def sinkhorn_backward_op(grad: Tensor, logits: Tensor, iters: int, order: str, eps_style: str,
                         eps: float) -> Tensor:
    r = logits.reshape(-1, *logits.shape[-2:]).contiguous()
    go = grad.reshape(r.shape).to(r.dtype).contiguous()
    return (_triton_bwd if uses_triton(r) else _torch_bwd)(go, r, iters, order, eps_style, eps).view(logits.shape)


@register_fake(sinkhorn_backward_op)
def _(grad, logits, iters, order, eps_style, eps):
    return logits.new_empty(logits.shape)


def _setup(ctx, inputs, output):
    logits, *cfg = inputs
    ctx.save_for_backward(logits)
    ctx.cfg = cfg


def _backward(ctx, grad):
    (logits,) = ctx.saved_tensors
    return call(sinkhorn_backward_op, grad, logits, *ctx.cfg), None, None, None, None


autograd(sinkhorn_op, _backward, _setup)


def sinkhorn(logits: Tensor, iters: int, order: str = "paper", eps_style: str = "clamp", eps: float = 1e-6) -> Tensor:
    """== mixing.sinkhorn(...): logits [*, n, n] -> doubly stochastic [*, n, n], fp32 (fp64 stays fp64)."""
    if order not in mixing.MHC_SK_ORDERS or eps_style not in mixing.MHC_EPS_STYLES:
        raise ValueError(f"unknown Sinkhorn order {order!r} or epsilon style {eps_style!r}; choose from "
                         f"{mixing.MHC_SK_ORDERS} and {mixing.MHC_EPS_STYLES}")
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    return call(sinkhorn_op, mixing.fp32(logits), int(iters), order, eps_style, float(eps))
