"""AttnRes's depth mix over K sources, fused: `attnres_mix_sources` (reference: mixing.attnres_mix).

    h = sum_k alpha_k v_k,  alpha = softmax_k(w . RMSNorm(v_k)) (or an independent sigmoid per source, per head)

Contract: the sources are read in place (a list of tensors, never stacked); forward saves for backward only
references to the query, the key-norm gain and the K sources; backward recomputes the logits, the RMS norms and
the depth weights. Forward reads each source once (an online softmax over the sources); backward reads them twice
(pass 1: logits and go . v_k, which the softmax gradient needs from every source; pass 2: the K gradients).

The op is `mega_depth::attnres_mix` (and `::attnres_mix_backward`): Triton kernels on a GPU, the torch twin on a
CPU, a fake implementation for torch.compile, and autograd registered, so a compiled layer sees it whole.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.kernels.common import (F32, Sources, accumulation_dtype, as_list, cast_grad, channel_block, check_heads,
                                       depth_weight_is_sigmoid, folded_query, folded_query_torch, gradient_at,
                                       gradient_table, jit, launch, nothing, pointer_at, pointer_table, pow2, programs,
                                       register_fake, rms_inverse, rms_inverse_torch, rows, tl, token, uses_triton,
                                       warps)
from mega_depth.kernels.eager import autograd, call, traced

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@jit
def _row(q_ptr, g_ptr, f, n, offs, cmask, N, D, like_ptr, PER_TOKEN: tl.constexpr, NORM: tl.constexpr):
    """(mask, offsets, folded query) of token n's row: the static query f, or the token's own query."""
    mask = cmask & (n < N)
    if PER_TOKEN:
        f = folded_query(q_ptr + n * D, g_ptr, offs, mask, like_ptr, NORM)
    return mask, n * D + offs, f


@jit
def _fwd_kernel(table, q_ptr, g_ptr, out_ptr, K, N, D, C, H, eps, TOK,
                BH: tl.constexpr, BC: tl.constexpr, PER_TOKEN: tl.constexpr, NORM: tl.constexpr,
                SIGMOID: tl.constexpr):
    oh, offs, cmask = channel_block(C, H, BH, BC)
    static = folded_query(q_ptr, g_ptr, offs, cmask, out_ptr, NORM)  # per-token queries replace it
    for t in range(TOK):
        mask, row, f = _row(q_ptr, g_ptr, static, token(tl.program_id(0), t, TOK), offs, cmask, N, D, out_ptr,
                            PER_TOKEN, NORM)
        acc = tl.zeros([BH, BC], dtype=tl.float32)
        m = tl.full([BH], float("-inf"), tl.float32)
        z = tl.zeros([BH], dtype=tl.float32)
        for k in range(K):  # each source read once: an online softmax over the sources
            v = tl.load(pointer_at(table, k, out_ptr) + row, mask=mask, other=0.).to(tl.float32)
            s = tl.sum(v * f, axis=1)
            if NORM:
                s = s * rms_inverse(v, D, eps)
            if SIGMOID:
                acc += tl.sigmoid(s)[:, None] * v
            else:
                m_new = tl.maximum(m, s)
                scale = tl.exp(m - m_new)
                p = tl.exp(s - m_new)
                z = z * scale + p
                acc = acc * scale[:, None] + p[:, None] * v
                m = m_new
        if not SIGMOID:
            acc = acc / z[:, None]
        tl.store(out_ptr + row, acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _bwd_kernel(table, gtable, q_ptr, g_ptr, go_ptr, dq_ptr, dg_ptr, df_ptr, K, N, D, C, H, eps, TOK,
                BK: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, PER_TOKEN: tl.constexpr,
                NORM: tl.constexpr, SIGMOID: tl.constexpr):
    """Two passes per token: (1) logits and go . v_k of every source (to normalise the softmax gradient),
    (2) the source gradients, stored or added to what a buffer holds (gtable: common.gradient_table). Static query: the fp32 sum over tokens of dL/d(folded query) goes to df_ptr [d].
    Per-token query: dL/dq per token goes to dq_ptr [N, d] and the gain's sum to dg_ptr [d]."""
    ok = tl.arange(0, BK)
    oh, offs, cmask = channel_block(C, H, BH, BC)
    if NORM:
        gain = tl.load(g_ptr + offs, mask=cmask, other=0.).to(tl.float32)
    static = folded_query(q_ptr, g_ptr, offs, cmask, go_ptr, NORM)  # per-token queries replace it
    total = tl.zeros([BH, BC], dtype=tl.float32)  # static: sum of df; per-token: sum of df * q (the gain's)
    for t in range(TOK):
        mask, row, f = _row(q_ptr, g_ptr, static, token(tl.program_id(0), t, TOK), offs, cmask, N, D, go_ptr,
                            PER_TOKEN, NORM)
        go = tl.load(go_ptr + row, mask=mask, other=0.).to(tl.float32)
        logit = tl.zeros([BK, BH], dtype=tl.float32)
        dots = tl.zeros([BK, BH], dtype=tl.float32)
        gv = tl.zeros([BK, BH], dtype=tl.float32)
        rinv = tl.zeros([BK], dtype=tl.float32)
        for k in range(K):
            v = tl.load(pointer_at(table, k, go_ptr) + row, mask=mask, other=0.).to(tl.float32)
            dot = tl.sum(v * f, axis=1)
            sel = (ok == k)[:, None]
            dots = tl.where(sel, dot[None, :], dots)
            gv = tl.where(sel, tl.sum(go * v, axis=1)[None, :], gv)
            if NORM:
                r = rms_inverse(v, D, eps)
                rinv = tl.where(ok == k, r, rinv)
                dot = dot * r
            logit = tl.where(sel, dot[None, :], logit)
        if SIGMOID:
            alpha = tl.sigmoid(logit)
            ds = gv * alpha * (1. - alpha)
        else:
            logit = tl.where((ok < K)[:, None], logit, float("-inf"))
            e = tl.exp(logit - tl.max(logit, axis=0)[None, :])
            alpha = e / tl.sum(e, axis=0)[None, :]
            ds = alpha * (gv - tl.sum(alpha * gv, axis=0)[None, :])
        df = tl.zeros([BH, BC], dtype=tl.float32)
        for k in range(K):
            v = tl.load(pointer_at(table, k, go_ptr) + row, mask=mask, other=0.).to(tl.float32)
            sel = (ok == k)[:, None]
            a = tl.sum(tl.where(sel, alpha, 0.), axis=0)
            dsk = tl.sum(tl.where(sel, ds, 0.), axis=0)
            if NORM:
                r = tl.sum(tl.where(ok == k, rinv, 0.), axis=0)
                dr = tl.sum(dsk * tl.sum(tl.where(sel, dots, 0.), axis=0), axis=0)  # dL/dr
                dsk = dsk * r
                dv = a[:, None] * go + dsk[:, None] * f - (dr * r * r * r / D) * v
            else:
                dv = a[:, None] * go + dsk[:, None] * f
            df += dsk[:, None] * v
            into, adding = gradient_at(gtable, k, go_ptr)
            dv += tl.load(into + row, mask=mask & adding, other=0.).to(tl.float32)
            tl.store(into + row, dv.to(go_ptr.dtype.element_ty), mask=mask)
        if PER_TOKEN:
            if NORM:
                tl.store(dq_ptr + row, df * gain, mask=mask)
                total += df * tl.load(q_ptr + row, mask=mask, other=0.).to(tl.float32)
            else:
                tl.store(dq_ptr + row, df, mask=mask)
        else:
            total += df
    if PER_TOKEN:
        if NORM:
            tl.atomic_add(dg_ptr + offs, total, mask=cmask)
    else:
        tl.atomic_add(df_ptr + offs, total, mask=cmask)


def _triton_fwd(srcs: List[Tensor], q: Tensor, g: Optional[Tensor], eps: float, sigmoid: bool, heads: int) -> Tensor:
    n, d = srcs[0].shape
    out = torch.empty_like(srcs[0])
    if n == 0:
        return out
    bh, bc = pow2(heads), pow2(d // heads)
    count, tok = programs(n, out.device, reduces=False)
    launch(_fwd_kernel, (count,), (pointer_table(srcs), q, q if g is None else g, out, len(srcs), n, d, d // heads,
                                   heads, eps, tok),
           warps(bh * bc, 3), BH=bh, BC=bc, PER_TOKEN=q.dim() == 2, NORM=g is not None, SIGMOID=sigmoid)
    return out


def _triton_bwd(go: Tensor, srcs: List[Tensor], q: Tensor, g: Optional[Tensor], eps: float, sigmoid: bool,
                heads: int, grads: List[Tensor], adding: List[bool]):
    """Source gradients into `grads` (rows [N, d]; added to those with `adding` set) -> (dq fp32 shaped like q, dg
    fp32 [d] or None)."""
    n, d = srcs[0].shape
    per_token = q.dim() == 2
    # a per-token query's gradient is stored row by row (every row once); a static one is summed into by atomics
    dq = (torch.empty if per_token else torch.zeros)(q.shape, dtype=F32, device=go.device)
    dg = torch.zeros(d, dtype=F32, device=go.device) if g is not None else None
    if n == 0:
        return dq, dg
    df = dq if not per_token else None  # static query: the folded query's gradient, summed over tokens
    bh, bc = pow2(heads), pow2(d // heads)
    count, tok = programs(n, go.device, reduces=True)
    launch(_bwd_kernel, (count,), (pointer_table(srcs), gradient_table(grads, adding), q, q if g is None else g, go, dq,
                                   dq if dg is None else dg, dq if df is None else df, len(srcs), n, d, d // heads,
                                   heads, eps, tok),
           warps(bh * bc, 4), BK=pow2(len(srcs)), BH=bh, BC=bc, PER_TOKEN=per_token, NORM=g is not None,
           SIGMOID=sigmoid)
    if not per_token and g is not None:  # folded = gain * query
        dq, dg = df * g.float(), df * q.float()
    return dq, dg


# --------------------------------------------------------------------------------------------------------------
# The torch twin (same signatures and results as the Triton launchers)
# --------------------------------------------------------------------------------------------------------------


def accumulate(srcs, f, source_shape, out_shape, ct, g, eps, sigmoid):
    """One pass over the sources: logits against the folded queries f, and the weighted sum with an online softmax
    (running max m and normaliser z; unnormalised acc) or sigmoid weights. Sources are viewed as source_shape
    [..., H, C] and broadcast against f; acc is out_shape [..., H, C]. (Block AttnRes's phase 1 shares it.)"""
    acc = torch.zeros(out_shape, dtype=ct, device=srcs[0].device)
    m = torch.full(out_shape[:-1], -math.inf, dtype=ct, device=acc.device)
    z = torch.zeros(out_shape[:-1], dtype=ct, device=acc.device)
    for src in srcs:
        v = src.to(ct).view(source_shape)
        s = (v * f).sum(-1)
        if g is not None:
            s = s * rms_inverse_torch(v, eps).unsqueeze(-1)
        if sigmoid:
            acc += torch.sigmoid(s).unsqueeze(-1) * v
        else:
            m_new = torch.maximum(m, s)
            scale, p = torch.exp(m - m_new), torch.exp(s - m_new)
            z = z * scale + p
            acc = acc * scale.unsqueeze(-1) + p.unsqueeze(-1) * v
            m = m_new
    return acc, m, z


def _torch_fwd(srcs, q, g, eps, sigmoid, heads):
    (n, d), dt = srcs[0].shape, srcs[0].dtype
    ct, c = accumulation_dtype(dt), d // heads
    f = folded_query_torch(q, g, dt, ct).view(-1, heads, c)  # [1 or N, H, C]
    acc, _, z = accumulate(srcs, f, (n, heads, c), (n, heads, c), ct, g, eps, sigmoid)
    if not sigmoid:
        acc = acc / z.unsqueeze(-1)
    return acc.view(n, d).to(dt)


def _torch_bwd(go, srcs, q, g, eps, sigmoid, heads, grads, adding):
    (n, d), dt = srcs[0].shape, srcs[0].dtype
    ct, c = accumulation_dtype(dt), d // heads
    f = folded_query_torch(q, g, dt, ct).view(-1, heads, c)
    go = go.to(ct).view(n, heads, c)
    logits, dots, gvs, rinvs = [], [], [], []
    for src in srcs:  # pass 1: what the softmax gradient needs from every source
        v = src.to(ct).view(n, heads, c)
        dot = (v * f).sum(-1)
        dots.append(dot)
        gvs.append((go * v).sum(-1))
        if g is not None:
            rinvs.append(rms_inverse_torch(v, eps))
            dot = dot * rinvs[-1].unsqueeze(-1)
        logits.append(dot)
    logit, gv = torch.stack(logits), torch.stack(gvs)  # [K, N, H]: per-token scalars only
    if sigmoid:
        alpha = torch.sigmoid(logit)
        ds = gv * alpha * (1 - alpha)
    else:
        alpha = torch.softmax(logit, 0)
        ds = alpha * (gv - (alpha * gv).sum(0))
    df = torch.zeros(n, heads, c, dtype=ct, device=go.device)
    for k, src in enumerate(srcs):  # pass 2: the source gradients
        v = src.to(ct).view(n, heads, c)
        dsk = ds[k]
        dv = alpha[k].unsqueeze(-1) * go
        if g is not None:
            r = rinvs[k]
            dr = (dsk * dots[k]).sum(-1)
            dsk = dsk * r.unsqueeze(-1)
            dv = dv - (dr * r.pow(3) / d).view(n, 1, 1) * v
        dv = dv + dsk.unsqueeze(-1) * f
        df += dsk.unsqueeze(-1) * v
        if adding[k]:
            dv = dv.view(n, d) + grads[k].to(ct)
        grads[k].copy_(dv.view(n, d))
    df = df.view(n, d)
    if q.dim() == 1:
        df = df.sum(0)
    if g is None:
        return df, None
    dg = df * q.to(ct)
    return df * g.to(ct), dg.sum(0) if q.dim() == 2 else dg


# --------------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------------


def _query_rows(query: Tensor, d: int) -> Tensor:
    return query.contiguous() if query.dim() == 1 else rows(query, d)


@torch.library.custom_op("mega_depth::attnres_mix", mutates_args=())
def attnres_mix_op(sources: List[Tensor], query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                   sigmoid: bool, heads: int) -> Tensor:
    """sources K x [*, d]; query [d] or [*, d]; key_norm_weight [d] or None -> [*, d]."""
    d = sources[0].shape[-1]
    srcs = [rows(s, d) for s in sources]
    fwd = _triton_fwd if uses_triton(srcs[0]) else _torch_fwd
    g = None if key_norm_weight is None else key_norm_weight.contiguous()
    return fwd(srcs, _query_rows(query, d), g, eps, sigmoid, heads).view(sources[0].shape)


@register_fake(attnres_mix_op)
def _(sources, query, key_norm_weight, eps, sigmoid, heads):
    return sources[0].new_empty(sources[0].shape)


@torch.library.custom_op("mega_depth::attnres_mix_backward", mutates_args=())
def attnres_mix_backward_op(grad: Tensor, sources: List[Tensor], query: Tensor, key_norm_weight: Optional[Tensor],
                            eps: float, sigmoid: bool, heads: int) -> List[Tensor]:
    """-> [source gradients..., dq (fp32, query's shape), dg (fp32 [d], or empty without a key norm)]."""
    grads = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources]
    return grads + _backward_into(grad, sources, grads, [False] * len(sources), query, key_norm_weight, eps, sigmoid, heads)


@register_fake(attnres_mix_backward_op)
def _fake_backward(grad, sources, query, key_norm_weight, eps=0.0, sigmoid=False, heads=1):
    d, ct = sources[0].shape[-1], accumulation_dtype(sources[0].dtype)
    dg = grad.new_empty(d, dtype=ct) if key_norm_weight is not None else nothing(grad)
    return [s.new_empty(s.shape) for s in sources] + [query.new_empty(query.shape, dtype=ct), dg]


@torch.library.custom_op("mega_depth::attnres_mix_backward_into", mutates_args=("into",))
def attnres_mix_backward_into_op(grad: Tensor, sources: List[Tensor], into: List[Tensor], adding: List[bool],
                                 query: Tensor, key_norm_weight: Optional[Tensor], eps: float, sigmoid: bool,
                                 heads: int) -> List[Tensor]:
    """The source gradients stored into `into` (contiguous tensors shaped like the sources), or added to those with
    `adding` set (kernels/grad_sink.py) -> [dq, dg] as attnres_mix_backward."""
    return _backward_into(grad, sources, into, adding, query, key_norm_weight, eps, sigmoid, heads)


@register_fake(attnres_mix_backward_into_op)
def _(grad, sources, into, adding, query, key_norm_weight, eps, sigmoid, heads):
    return _fake_backward(grad, sources, query, key_norm_weight)[len(sources):]


def _backward_into(grad, sources, into, adding, query, key_norm_weight, eps, sigmoid, heads) -> List[Tensor]:
    d = sources[0].shape[-1]
    srcs = [rows(s, d) for s in sources]
    bwd = _triton_bwd if uses_triton(srcs[0]) else _torch_bwd
    g = None if key_norm_weight is None else key_norm_weight.contiguous()
    dq, dg = bwd(rows(grad, d), srcs, _query_rows(query, d), g, eps, sigmoid, heads, [t.view(-1, d) for t in into],
                 adding)
    return [dq.view(query.shape), nothing(grad) if dg is None else dg]


def _setup(ctx, inputs, output):
    sources, query, gain, eps, sigmoid, heads = inputs
    ctx.save_for_backward(query, gain, *sources)
    ctx.cfg = (eps, sigmoid, heads)
    ctx.sinks = grad_sink.sinks_of(sources)


def _backward(ctx, grad):
    query, gain, *sources = ctx.saved_tensors
    need = ctx.needs_input_grad
    if ctx.sinks is None:
        out = call(attnres_mix_backward_op, grad, sources, query, gain, *ctx.cfg)
        grads = [g if need[0] else None for g in out[:-2]]
    else:  # the sinks' buffers take the sources' gradients in the kernel (kernels/grad_sink.py)
        into, adding = grad_sink.buffers(ctx.sinks, sources)
        out = call(attnres_mix_backward_into_op, grad, sources, into, adding, query, gain, *ctx.cfg)
        grads = grad_sink.returned(ctx.sinks, into, need[0])
    return grads, cast_grad(out[-2], query, need[1]), cast_grad(out[-1], gain, need[2]), None, None, None


autograd(attnres_mix_op, _backward, _setup)


def attnres_mix_sources(sources: Sources, query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                        weight: str = "softmax", heads: int = 1) -> Tensor:
    """== mixing.attnres_mix(torch.stack(sources), ...): sources K tensors [*, d] (or a stacked [K, *, d]);
    query [d] (static) or [*, d] (per token); key_norm_weight [d] or None. -> [*, d]."""
    sources = as_list(sources)
    shape = sources[0].shape
    heads = check_heads(shape[-1], heads)
    if query.dim() > 1 and query.shape != shape:
        query = query.expand(shape)  # a broadcast query: autograd sums its gradient back
    args = (query, key_norm_weight)
    if not traced(sources) and not traced(args):  # readers of one source add into one gradient buffer
        sources = grad_sink.aliased(sources)
    return call(attnres_mix_op, sources, query, key_norm_weight, float(eps), depth_weight_is_sigmoid(weight), heads)
