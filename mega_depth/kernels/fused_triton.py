"""Triton kernels of the fused depth-mixing Functions (mega_depth/kernels/fused.py holds the contract).

Every launcher here has the same signature and results as its torch twin in fused.py (`_TorchOps`): tensors come
in as token rows ([N, d], [N, h, hn]), already checked and flattened by the Function. Sets of sources are read
through a pointer table (an int64 tensor of data pointers on the device) so that they are never stacked.

Layout choices, for every kernel:
- one program walks TOK consecutive tokens and keeps a whole token row of each tensor in registers (a row is what
  the RMS norm and the depth softmax need at once), so the feature dim is one power-of-two block, masked;
- heads are a second block dim ([BH, BC]: channel h*C + c) so that per-head reductions are plain tl.sum calls;
- parameter gradients are summed over the program's tokens in registers, then added to an fp32 buffer with one
  atomic add per program (the summation order across programs is not fixed: last-bit nondeterminism on a GPU).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

F32 = torch.float32


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _warps(elements: int, live: int) -> int:
    """Warps for a program holding `live` fp32 tensors of `elements` values each (whole rows in registers):
    about 64 values a thread, 4 to 16 warps (checked with ptxas for sm_90 at d = 2048..4096: no or small spills)."""
    return min(16, max(4, triton.next_power_of_2(triton.cdiv(elements * live, 32 * 64))))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _programs(n: int, device: torch.device, reduces: bool):
    """(programs, tokens per program). Kernels that reduce parameter gradients over tokens use a few programs per
    SM (fewer atomics); the rest one token per program. Under the interpreter a handful of programs of several
    tokens each, so that the tests walk the token loop, its masked tail and the cross-program reduction."""
    if _interpreting() or device.type != "cuda":
        programs = min(n, 3)
    elif reduces:
        programs = min(n, 8 * torch.cuda.get_device_properties(device).multi_processor_count)
    else:
        programs = n
    tok = triton.cdiv(n, max(programs, 1))
    return triton.cdiv(n, tok), tok


def _patch_interpreter_index() -> None:
    """TRITON_INTERPRET only: triton 3.6's interpreter turns a scalar into a Python int (`range(K)` over a
    runtime argument) with int() of a 1-element numpy array, which numpy >= 2.3 rejects. Wrap its tensor patch
    so that __index__ takes the element instead. A no-op where numpy still accepts it or the hook is gone."""
    import numpy as np

    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_mega_depth", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mega_depth = True
    interpreter._patch_lang_tensor = patched


if _interpreting():
    _patch_interpreter_index()


def _table(tensors: Sequence[Tensor]) -> Tensor:
    """The data pointers of `tensors` as an int64 tensor on their device (how a kernel reads a set unstacked)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)


# --------------------------------------------------------------------------------------------------------------
# AttnRes: one mix over K sources
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _attnres_fwd_kernel(table, q_ptr, g_ptr, out_ptr, K, N, D, C, H, eps, TOK,
                        BH: tl.constexpr, BC: tl.constexpr, PER_TOKEN: tl.constexpr, NORM: tl.constexpr,
                        SIGMOID: tl.constexpr):
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BC)
    offs = oh[:, None] * C + oc[None, :]  # channel of (head, column)
    cmask = (oh < H)[:, None] & (oc < C)[None, :]
    if not PER_TOKEN:  # the folded query gain * query, rounded to the source dtype like the reference
        f = tl.load(q_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        if NORM:
            f = f * tl.load(g_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        f = f.to(dt).to(tl.float32)
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        mask = cmask & (n < N)
        row = n * D + offs
        if PER_TOKEN:
            f = tl.load(q_ptr + row, mask=mask, other=0.).to(tl.float32)
            if NORM:
                f = f * tl.load(g_ptr + offs, mask=cmask, other=0.).to(tl.float32)
            f = f.to(dt).to(tl.float32)
        acc = tl.zeros([BH, BC], dtype=tl.float32)
        m = tl.full([BH], float("-inf"), tl.float32)
        z = tl.zeros([BH], dtype=tl.float32)
        for k in range(K):  # each source read once: an online softmax over the sources
            src = tl.load(table + k).to(tl.pointer_type(dt))
            v = tl.load(src + row, mask=mask, other=0.).to(tl.float32)
            s = tl.sum(v * f, axis=1)
            if NORM:
                s = s * tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / D + eps)
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
        tl.store(out_ptr + row, acc.to(dt), mask=mask)


@triton.jit
def _attnres_bwd_kernel(table, gtable, q_ptr, g_ptr, go_ptr, dq_ptr, dg_ptr, df_ptr, K, N, D, C, H, eps, TOK,
                        BK: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, PER_TOKEN: tl.constexpr,
                        NORM: tl.constexpr, SIGMOID: tl.constexpr):
    """Two passes per token: (1) logits and go . v_k of every source (to normalise the softmax gradient),
    (2) the source gradients. Static query: the fp32 sum over tokens of dL/d(folded query) goes to df_ptr [d].
    Per-token query: dL/dq per token goes to dq_ptr [N, d] and the gain's sum to dg_ptr [d]."""
    pid = tl.program_id(0)
    dt = go_ptr.dtype.element_ty
    ok = tl.arange(0, BK)
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BC)
    offs = oh[:, None] * C + oc[None, :]
    cmask = (oh < H)[:, None] & (oc < C)[None, :]
    if NORM:
        gain = tl.load(g_ptr + offs, mask=cmask, other=0.).to(tl.float32)
    if not PER_TOKEN:
        f = tl.load(q_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        if NORM:
            f = f * gain
        f = f.to(dt).to(tl.float32)
    total = tl.zeros([BH, BC], dtype=tl.float32)  # static: sum of df; per-token: sum of df * q (the gain's)
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        mask = cmask & (n < N)
        row = n * D + offs
        if PER_TOKEN:
            qrow = tl.load(q_ptr + row, mask=mask, other=0.).to(tl.float32)
            f = qrow
            if NORM:
                f = f * gain
            f = f.to(dt).to(tl.float32)
        go = tl.load(go_ptr + row, mask=mask, other=0.).to(tl.float32)
        logit = tl.zeros([BK, BH], dtype=tl.float32)
        dots = tl.zeros([BK, BH], dtype=tl.float32)
        gv = tl.zeros([BK, BH], dtype=tl.float32)
        rinv = tl.zeros([BK], dtype=tl.float32)
        for k in range(K):
            src = tl.load(table + k).to(tl.pointer_type(dt))
            v = tl.load(src + row, mask=mask, other=0.).to(tl.float32)
            dot = tl.sum(v * f, axis=1)
            sel = (ok == k)[:, None]
            dots = tl.where(sel, dot[None, :], dots)
            gv = tl.where(sel, tl.sum(go * v, axis=1)[None, :], gv)
            if NORM:
                r = tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / D + eps)
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
            src = tl.load(table + k).to(tl.pointer_type(dt))
            v = tl.load(src + row, mask=mask, other=0.).to(tl.float32)
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
            dst = tl.load(gtable + k).to(tl.pointer_type(dt))
            tl.store(dst + row, dv.to(dt), mask=mask)
        if PER_TOKEN:
            if NORM:
                tl.store(dq_ptr + row, df * gain, mask=mask)
                total += df * qrow
            else:
                tl.store(dq_ptr + row, df, mask=mask)
        else:
            total += df
    if PER_TOKEN:
        if NORM:
            tl.atomic_add(dg_ptr + offs, total, mask=cmask)
    else:
        tl.atomic_add(df_ptr + offs, total, mask=cmask)


def attnres_fwd(srcs: List[Tensor], q: Tensor, g: Optional[Tensor], eps: float, sigmoid: bool, heads: int) -> Tensor:
    n, d = srcs[0].shape
    out = torch.empty_like(srcs[0])
    if n == 0:
        return out
    bh, bc = _pow2(heads), _pow2(d // heads)
    programs, tok = _programs(n, out.device, reduces=False)
    _attnres_fwd_kernel[(programs,)](
        _table(srcs), q, q if g is None else g, out, len(srcs), n, d, d // heads, heads, eps, tok,
        BH=bh, BC=bc, PER_TOKEN=q.dim() == 2, NORM=g is not None, SIGMOID=sigmoid, num_warps=_warps(bh * bc, 3))
    return out


def attnres_bwd(go: Tensor, srcs: List[Tensor], q: Tensor, g: Optional[Tensor], eps: float, sigmoid: bool,
                heads: int):
    """-> (source gradients, dq fp32 shaped like q, dg fp32 [d] or None)."""
    n, d = srcs[0].shape
    grads = [torch.empty_like(s) for s in srcs]
    per_token = q.dim() == 2
    dq = torch.zeros(q.shape, dtype=F32, device=go.device)
    dg = torch.zeros(d, dtype=F32, device=go.device) if g is not None else None
    if n == 0:
        return grads, dq, dg
    df = dq if not per_token else None  # static query: the folded query's gradient, summed over tokens
    bh, bc = _pow2(heads), _pow2(d // heads)
    programs, tok = _programs(n, go.device, reduces=True)
    _attnres_bwd_kernel[(programs,)](
        _table(srcs), _table(grads), q, q if g is None else g, go, dq, dq if dg is None else dg,
        dq if df is None else df, len(srcs), n, d, d // heads, heads, eps, tok,
        BK=_pow2(len(srcs)), BH=bh, BC=bc, PER_TOKEN=per_token, NORM=g is not None, SIGMOID=sigmoid,
        num_warps=_warps(bh * bc, 4))
    if not per_token and g is not None:  # folded = gain * query
        dq, dg = df * g.float(), df * q.float()
    return grads, dq, dg


# --------------------------------------------------------------------------------------------------------------
# Block AttnRes: phase 1 (S queries against n completed blocks) and phase 2 (the online-softmax merge)
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _phase1_fwd_kernel(table, q_ptr, g_ptr, m_ptr, z_ptr, o_ptr, K, N, S, D, C, H, eps, TOK,
                       BS: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr):
    pid = tl.program_id(0)
    dt = o_ptr.dtype.element_ty
    os_ = tl.arange(0, BS)
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BC)
    offs = oh[:, None] * C + oc[None, :]
    cmask = (oh < H)[:, None] & (oc < C)[None, :]
    smask = os_ < S
    qoffs = os_[:, None, None] * D + offs[None, :, :]
    qmask = smask[:, None, None] & cmask[None, :, :]
    f = tl.load(q_ptr + qoffs, mask=qmask, other=0.).to(tl.float32)  # [BS, BH, BC]: every query of the block
    if NORM:
        f = f * tl.load(g_ptr + qoffs, mask=qmask, other=0.).to(tl.float32)
    f = f.to(dt).to(tl.float32)
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        mask = cmask & (n < N)
        acc = tl.zeros([BS, BH, BC], dtype=tl.float32)
        m = tl.full([BS, BH], float("-inf"), tl.float32)
        z = tl.zeros([BS, BH], dtype=tl.float32)
        for k in range(K):  # each completed block read once for all S queries
            src = tl.load(table + k).to(tl.pointer_type(dt))
            v = tl.load(src + n * D + offs, mask=mask, other=0.).to(tl.float32)
            s = tl.sum(v[None, :, :] * f, axis=2)
            if NORM:
                s = s * tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / D + eps)
            if SIGMOID:
                acc += tl.sigmoid(s)[:, :, None] * v[None, :, :]
            else:
                m_new = tl.maximum(m, s)
                scale = tl.exp(m - m_new)
                p = tl.exp(s - m_new)
                z = z * scale + p
                acc = acc * scale[:, :, None] + p[:, :, None] * v[None, :, :]
                m = m_new
        omask = smask[:, None, None] & mask[None, :, :]
        orow = os_[:, None, None].to(tl.int64) * N * D + n * D + offs[None, :, :]
        tl.store(o_ptr + orow, acc.to(dt), mask=omask)
        if not SIGMOID:
            soffs = os_[:, None].to(tl.int64) * N * H + n * H + oh[None, :]
            smask2 = smask[:, None] & (oh < H)[None, :] & (n < N)
            tl.store(m_ptr + soffs, m, mask=smask2)
            tl.store(z_ptr + soffs, z, mask=smask2)


@triton.jit
def _phase1_bwd_kernel(table, gtable, q_ptr, g_ptr, m_ptr, go_ptr, gz_ptr, df_ptr, K, N, S, D, C, H, eps, TOK,
                       BS: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr, HAS_GZ: tl.constexpr):
    """One pass per token: m is a saved constant of the forward, so every p_sj = exp(l_sj - m_s) and its
    gradient are local to block j (no normalisation couples the blocks)."""
    pid = tl.program_id(0)
    dt = go_ptr.dtype.element_ty
    os_ = tl.arange(0, BS)
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BC)
    offs = oh[:, None] * C + oc[None, :]
    cmask = (oh < H)[:, None] & (oc < C)[None, :]
    smask = os_ < S
    qoffs = os_[:, None, None] * D + offs[None, :, :]
    qmask = smask[:, None, None] & cmask[None, :, :]
    f = tl.load(q_ptr + qoffs, mask=qmask, other=0.).to(tl.float32)
    if NORM:
        f = f * tl.load(g_ptr + qoffs, mask=qmask, other=0.).to(tl.float32)
    f = f.to(dt).to(tl.float32)
    total = tl.zeros([BS, BH, BC], dtype=tl.float32)  # dL/d(folded queries), summed over tokens
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        mask = cmask & (n < N)
        omask = smask[:, None, None] & mask[None, :, :]
        go = tl.load(go_ptr + os_[:, None, None].to(tl.int64) * N * D + n * D + offs[None, :, :], mask=omask,
                     other=0.).to(tl.float32)
        if not SIGMOID:
            soffs = os_[:, None].to(tl.int64) * N * H + n * H + oh[None, :]
            smask2 = smask[:, None] & (oh < H)[None, :] & (n < N)
            m = tl.load(m_ptr + soffs, mask=smask2, other=0.)
            if HAS_GZ:
                gz = tl.load(gz_ptr + soffs, mask=smask2, other=0.)
        for k in range(K):
            src = tl.load(table + k).to(tl.pointer_type(dt))
            v = tl.load(src + n * D + offs, mask=mask, other=0.).to(tl.float32)
            dot = tl.sum(v[None, :, :] * f, axis=2)  # [BS, BH]
            l = dot
            if NORM:
                r = tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / D + eps)
                l = dot * r
            gov = tl.sum(go * v[None, :, :], axis=2)
            if SIGMOID:
                p = tl.sigmoid(l)
                dl = gov * p * (1. - p)
            else:
                p = tl.exp(l - m)
                if HAS_GZ:
                    gov = gov + gz
                dl = gov * p
            dl = tl.where(smask[:, None], dl, 0.)
            p = tl.where(smask[:, None], p, 0.)
            dv = tl.sum(p[:, :, None] * go, axis=0)
            if NORM:
                dr = tl.sum(tl.sum(dl * dot, axis=1), axis=0)
                dl = dl * r
                dv += tl.sum(dl[:, :, None] * f, axis=0) - (dr * r * r * r / D) * v
            else:
                dv += tl.sum(dl[:, :, None] * f, axis=0)
            total += dl[:, :, None] * v[None, :, :]
            dst = tl.load(gtable + k).to(tl.pointer_type(dt))
            tl.store(dst + n * D + offs, dv.to(dt), mask=mask)
    tl.atomic_add(df_ptr + qoffs, total, mask=qmask)


def phase1_fwd(srcs: List[Tensor], q: Tensor, g: Optional[Tensor], eps: float, sigmoid: bool, heads: int):
    """-> m [S, N, H] fp32, z [S, N, H] fp32, o [S, N, d] in the source dtype."""
    (n, d), s = srcs[0].shape, q.shape[0]
    o = torch.empty((s, n, d), dtype=srcs[0].dtype, device=srcs[0].device)
    m = (torch.zeros if sigmoid else torch.empty)((s, n, heads), dtype=F32, device=o.device)  # sigmoid: m = 0
    z = (torch.ones if sigmoid else torch.empty)((s, n, heads), dtype=F32, device=o.device)  # and z = 1
    if n == 0:
        return m, z, o
    bs, bh, bc = _pow2(s), _pow2(heads), _pow2(d // heads)
    programs, tok = _programs(n, o.device, reduces=False)
    _phase1_fwd_kernel[(programs,)](
        _table(srcs), q, q if g is None else g, m, z, o, len(srcs), n, s, d, d // heads, heads, eps, tok,
        BS=bs, BH=bh, BC=bc, NORM=g is not None, SIGMOID=sigmoid, num_warps=_warps(bs * bh * bc, 2))
    return m, z, o


def phase1_bwd(go: Tensor, gz: Optional[Tensor], m: Tensor, srcs: List[Tensor], q: Tensor, g: Optional[Tensor],
               eps: float, sigmoid: bool, heads: int):
    """-> (block gradients, dq [S, d] fp32, dg [S, d] fp32 or None)."""
    (n, d), s = srcs[0].shape, q.shape[0]
    grads = [torch.empty_like(x) for x in srcs]
    df = torch.zeros((s, d), dtype=F32, device=go.device)
    if n > 0:
        bs, bh, bc = _pow2(s), _pow2(heads), _pow2(d // heads)
        programs, tok = _programs(n, go.device, reduces=True)
        _phase1_bwd_kernel[(programs,)](
            _table(srcs), _table(grads), q, q if g is None else g, m, go, m if gz is None else gz, df, len(srcs),
            n, s, d, d // heads, heads, eps, tok, BS=bs, BH=bh, BC=bc, NORM=g is not None, SIGMOID=sigmoid,
            HAS_GZ=gz is not None, num_warps=_warps(bs * bh * bc, 3))
    if g is None:
        return grads, df, None
    return grads, df * g.float(), df * q.float()


@triton.jit
def _phase2_fwd_kernel(m_ptr, z_ptr, o_ptr, x_ptr, q_ptr, g_ptr, out_ptr, N, D, C, H, eps, TOK,
                       BH: tl.constexpr, BC: tl.constexpr, HAS_PARTIAL: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr):
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BC)
    offs = oh[:, None] * C + oc[None, :]
    cmask = (oh < H)[:, None] & (oc < C)[None, :]
    hmask = oh < H
    if HAS_PARTIAL:
        f = tl.load(q_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        if NORM:
            f = f * tl.load(g_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        f = f.to(x_ptr.dtype.element_ty).to(tl.float32)
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        mask = cmask & (n < N)
        row = n * D + offs
        o = tl.load(o_ptr + row, mask=mask, other=0.).to(tl.float32)
        if HAS_PARTIAL:
            x = tl.load(x_ptr + row, mask=mask, other=0.).to(tl.float32)
            l = tl.sum(x * f, axis=1)
            if NORM:
                l = l * tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / D + eps)
            if SIGMOID:
                out = o + tl.sigmoid(l)[:, None] * x
            else:
                m = tl.load(m_ptr + n * H + oh, mask=hmask & (n < N), other=0.)
                z = tl.load(z_ptr + n * H + oh, mask=hmask & (n < N), other=1.)
                m_new = tl.maximum(m, l)
                a = tl.exp(m - m_new)
                b = tl.exp(l - m_new)
                out = (o * a[:, None] + x * b[:, None]) / (z * a + b)[:, None]
        else:
            z = tl.load(z_ptr + n * H + oh, mask=hmask & (n < N), other=1.)
            out = o / z[:, None]
        tl.store(out_ptr + row, out.to(dt), mask=mask)


@triton.jit
def _phase2_bwd_kernel(m_ptr, z_ptr, o_ptr, x_ptr, q_ptr, g_ptr, go_ptr, dm_ptr, dz_ptr, do_ptr, dx_ptr, df_ptr,
                       N, D, C, H, eps, TOK, BH: tl.constexpr, BC: tl.constexpr, HAS_PARTIAL: tl.constexpr,
                       NORM: tl.constexpr, SIGMOID: tl.constexpr):
    """With a = exp(m - M), b = exp(l - M), den = z a + b (M = max(m, l), a constant) and A = a / den,
    B = b / den: out = o A + x B, so do = go A, dx = go B (+ the logit's path), dz = -A (go . out),
    dm = A (go . (o - z out)), dl = B (go . (x - out)) per head. Sigmoid: do = go (left to the host)."""
    pid = tl.program_id(0)
    dt = go_ptr.dtype.element_ty
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BC)
    offs = oh[:, None] * C + oc[None, :]
    cmask = (oh < H)[:, None] & (oc < C)[None, :]
    hmask = oh < H
    if HAS_PARTIAL:
        f = tl.load(q_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        if NORM:
            f = f * tl.load(g_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        f = f.to(x_ptr.dtype.element_ty).to(tl.float32)
    total = tl.zeros([BH, BC], dtype=tl.float32)
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        mask = cmask & (n < N)
        hm = hmask & (n < N)
        row = n * D + offs
        go = tl.load(go_ptr + row, mask=mask, other=0.).to(tl.float32)
        if HAS_PARTIAL:
            x = tl.load(x_ptr + row, mask=mask, other=0.).to(tl.float32)
            dot = tl.sum(x * f, axis=1)
            l = dot
            if NORM:
                r = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / D + eps)
                l = dot * r
            if SIGMOID:
                sg = tl.sigmoid(l)
                dx = go * sg[:, None]
                dl = tl.sum(go * x, axis=1) * sg * (1. - sg)
            else:
                o = tl.load(o_ptr + row, mask=mask, other=0.).to(tl.float32)
                m = tl.load(m_ptr + n * H + oh, mask=hm, other=0.)
                z = tl.load(z_ptr + n * H + oh, mask=hm, other=1.)
                m_new = tl.maximum(m, l)
                a = tl.exp(m - m_new)
                b = tl.exp(l - m_new)
                den = z * a + b
                aa = a / den
                bb = b / den
                out = o * aa[:, None] + x * bb[:, None]
                tl.store(do_ptr + row, (go * aa[:, None]).to(dt), mask=mask)
                tl.store(dz_ptr + n * H + oh, -aa * tl.sum(go * out, axis=1), mask=hm)
                tl.store(dm_ptr + n * H + oh, aa * tl.sum(go * (o - z[:, None] * out), axis=1), mask=hm)
                dx = go * bb[:, None]
                dl = bb * tl.sum(go * (x - out), axis=1)
            if NORM:
                dr = tl.sum(dl * dot, axis=0)
                dl = dl * r
                dx += dl[:, None] * f - (dr * r * r * r / D) * x
            else:
                dx += dl[:, None] * f
            total += dl[:, None] * x
            tl.store(dx_ptr + row, dx.to(x_ptr.dtype.element_ty), mask=mask)
        else:  # softmax without a partial: out = o / z
            o = tl.load(o_ptr + row, mask=mask, other=0.).to(tl.float32)
            z = tl.load(z_ptr + n * H + oh, mask=hm, other=1.)
            tl.store(do_ptr + row, (go / z[:, None]).to(dt), mask=mask)
            tl.store(dz_ptr + n * H + oh, -tl.sum(go * o, axis=1) / (z * z), mask=hm)
    if HAS_PARTIAL:
        tl.atomic_add(df_ptr + offs, total, mask=cmask)


def phase2_fwd(m: Tensor, z: Tensor, o: Tensor, x: Optional[Tensor], q: Tensor, g: Optional[Tensor], eps: float,
               sigmoid: bool, heads: int) -> Tensor:
    n, d = o.shape
    out = torch.empty_like(o)
    if n == 0:
        return out
    bh, bc = _pow2(heads), _pow2(d // heads)
    programs, tok = _programs(n, o.device, reduces=False)
    _phase2_fwd_kernel[(programs,)](
        m, z, o, o if x is None else x, q, q if g is None else g, out, n, d, d // heads, heads, eps, tok,
        BH=bh, BC=bc, HAS_PARTIAL=x is not None, NORM=g is not None, SIGMOID=sigmoid, num_warps=_warps(bh * bc, 4))
    return out


def phase2_bwd(go: Tensor, m: Tensor, z: Tensor, o: Tensor, x: Optional[Tensor], q: Tensor, g: Optional[Tensor],
               eps: float, sigmoid: bool, heads: int):
    """-> (dm, dz, do, dx, dq, dg): dm/dz fp32 [N, H] or None (sigmoid), dq/dg fp32 or None (no partial)."""
    n, d = o.shape
    dev = go.device
    dm = torch.zeros_like(m, dtype=F32) if x is not None and not sigmoid else None
    dz = torch.zeros_like(z, dtype=F32) if not sigmoid else None
    do = go if sigmoid else torch.empty_like(o)
    dx = torch.empty_like(x) if x is not None else None
    df = torch.zeros(d, dtype=F32, device=dev) if x is not None else None
    if n > 0 and (x is not None or not sigmoid):
        bh, bc = _pow2(heads), _pow2(d // heads)
        programs, tok = _programs(n, dev, reduces=x is not None)
        _phase2_bwd_kernel[(programs,)](
            m, z, o, o if x is None else x, q, q if g is None else g, go, go if dm is None else dm,
            go if dz is None else dz, do, go if dx is None else dx, go if df is None else df,
            n, d, d // heads, heads, eps, tok, BH=bh, BC=bc, HAS_PARTIAL=x is not None, NORM=g is not None,
            SIGMOID=sigmoid, num_warps=_warps(bh * bc, 4))
    if df is None:
        return dm, dz, do, dx, None, None
    if g is None:
        return dm, dz, do, dx, df, None
    return dm, dz, do, dx, df * g.float(), df * q.float()


# --------------------------------------------------------------------------------------------------------------
# DCA: the GRN instances over K sources
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _grn_fwd_kernel(table, bias_ptr, proj_ptr, out_ptr, K, N, D, G, TOK, BG: tl.constexpr, BD: tl.constexpr,
                    VERSION: tl.constexpr):
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    og = tl.arange(0, BG)
    od = tl.arange(0, BD)
    gmask = og < G
    dmask = od < D
    mask2 = gmask[:, None] & dmask[None, :]
    if VERSION == 3:
        proj = tl.load(proj_ptr + og[:, None] * D + od[None, :], mask=mask2, other=0.).to(dt).to(tl.float32)
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        acc = tl.zeros([BG, BD], dtype=tl.float32)
        for k in range(K):  # each source read once for all G instances
            src = tl.load(table + k).to(tl.pointer_type(dt))
            v = tl.load(src + n * D + od, mask=dmask & (n < N), other=0.).to(tl.float32)
            if VERSION == 1:
                coef = tl.load(bias_ptr + og * K + k, mask=gmask, other=0.).to(dt).to(tl.float32)[:, None]
            else:
                coef = tl.load(bias_ptr + og[:, None] * D * K + od[None, :] * K + k, mask=mask2,
                               other=0.).to(dt).to(tl.float32)
            if VERSION == 3:
                coef = coef + tl.maximum(tl.sum(proj * v[None, :], axis=1), 0.)[:, None]
            acc += coef * v[None, :]
        orow = og[:, None].to(tl.int64) * N * D + n * D + od[None, :]
        tl.store(out_ptr + orow, acc.to(dt), mask=mask2 & (n < N))


@triton.jit
def _grn_bwd_kernel(table, gtable, bias_ptr, proj_ptr, go_ptr, dbias_ptr, dproj_ptr, K, N, D, G, TOK,
                    BG: tl.constexpr, BD: tl.constexpr, VERSION: tl.constexpr):
    """Sources outside, tokens inside: a source's gradient needs nothing from the other sources, and the bias
    gradient of source k is then one register sum over the program's tokens (one atomic add per program)."""
    pid = tl.program_id(0)
    dt = go_ptr.dtype.element_ty
    og = tl.arange(0, BG)
    od = tl.arange(0, BD)
    gmask = og < G
    dmask = od < D
    mask2 = gmask[:, None] & dmask[None, :]
    if VERSION == 3:
        proj = tl.load(proj_ptr + og[:, None] * D + od[None, :], mask=mask2, other=0.).to(dt).to(tl.float32)
        dproj = tl.zeros([BG, BD], dtype=tl.float32)
    for k in range(K):
        src = tl.load(table + k).to(tl.pointer_type(dt))
        dst = tl.load(gtable + k).to(tl.pointer_type(dt))
        if VERSION == 1:
            bias = tl.load(bias_ptr + og * K + k, mask=gmask, other=0.).to(dt).to(tl.float32)[:, None]
        else:
            bias = tl.load(bias_ptr + og[:, None] * D * K + od[None, :] * K + k, mask=mask2,
                           other=0.).to(dt).to(tl.float32)
        dbias = tl.zeros([BG, BD], dtype=tl.float32)
        for t in range(TOK):
            n = (pid * TOK + t).to(tl.int64)
            v = tl.load(src + n * D + od, mask=dmask & (n < N), other=0.).to(tl.float32)
            go = tl.load(go_ptr + og[:, None].to(tl.int64) * N * D + n * D + od[None, :], mask=mask2 & (n < N),
                         other=0.).to(tl.float32)
            gv = go * v[None, :]
            dbias += gv
            coef = bias
            if VERSION == 3:
                pre = tl.sum(proj * v[None, :], axis=1)
                coef = coef + tl.maximum(pre, 0.)[:, None]
                dgate = tl.where(pre >= 0., tl.sum(gv, axis=1), 0.)  # clamp(min=0): subgradient 1 at 0
                dv = tl.sum(coef * go + dgate[:, None] * proj, axis=0)
                dproj += dgate[:, None] * v[None, :]
            else:
                dv = tl.sum(coef * go, axis=0)
            tl.store(dst + n * D + od, dv.to(dt), mask=dmask & (n < N))
        if VERSION == 1:
            tl.atomic_add(dbias_ptr + og * K + k, tl.sum(dbias, axis=1), mask=gmask)
        else:
            tl.atomic_add(dbias_ptr + og[:, None] * D * K + od[None, :] * K + k, dbias, mask=mask2)
    if VERSION == 3:
        tl.atomic_add(dproj_ptr + og[:, None] * D + od[None, :], dproj, mask=mask2)


def grn_fwd(srcs: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int) -> Tensor:
    n, d = srcs[0].shape
    g = bias.shape[0]
    out = torch.empty((g, n, d), dtype=srcs[0].dtype, device=srcs[0].device)
    if n == 0:
        return out
    bg, bd = _pow2(g), _pow2(d)
    programs, tok = _programs(n, out.device, reduces=False)
    _grn_fwd_kernel[(programs,)](_table(srcs), bias, bias if proj is None else proj, out, len(srcs), n, d, g, tok,
                                 BG=bg, BD=bd, VERSION=version, num_warps=_warps(bg * bd, 3))
    return out


def grn_bwd(go: Tensor, srcs: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int):
    """-> (source gradients, dbias fp32, dproj fp32 or None)."""
    n, d = srcs[0].shape
    g = bias.shape[0]
    grads = [torch.empty_like(s) for s in srcs]
    dbias = torch.zeros(bias.shape, dtype=F32, device=go.device)
    dproj = torch.zeros(proj.shape, dtype=F32, device=go.device) if proj is not None else None
    if n == 0:
        return grads, dbias, dproj
    bg, bd = _pow2(g), _pow2(d)
    programs, tok = _programs(n, go.device, reduces=True)
    _grn_bwd_kernel[(programs,)](_table(srcs), _table(grads), bias, bias if proj is None else proj, go, dbias,
                                 dbias if dproj is None else dproj, len(srcs), n, d, g, tok, BG=bg, BD=bd,
                                 VERSION=version, num_warps=_warps(bg * bd, 5))
    return grads, dbias, dproj


# --------------------------------------------------------------------------------------------------------------
# Depth-Attention: the value mix with its depth softmax over [candidates..., self]
# --------------------------------------------------------------------------------------------------------------
# Head tensors are [BKV, BR, BN]: key-value group, head within the group, channel (output head = kv * R + r).
# "query" mode: R = hq / hkv; "group" mode: R = 1 and the query is the mean of each group's RQ query heads.


@triton.jit
def _da_query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP: tl.constexpr,
              BRQ: tl.constexpr):
    """The query of a token as [BKV, BR, BN] fp32 (group mode: the mean query of each group, [BKV, 1, BN],
    rounded to the input dtype like the reference's mean)."""
    if GROUP:
        oq = tl.arange(0, BRQ)
        heads = okv[:, None] * RQ + oq[None, :]
        qmask = ((okv < HKV)[:, None] & (oq < RQ)[None, :])[:, :, None] & nmask[None, None, :] & valid
        qq = tl.load(q_ptr + n * sq_n + heads[:, :, None] * sq_h + on[None, None, :], mask=qmask, other=0.)
        q = (tl.sum(qq.to(tl.float32), axis=1) / RQ).to(q_ptr.dtype.element_ty).to(tl.float32)
        return q[:, None, :]
    else:
        heads = okv[:, None] * R + orr[None, :]
        return tl.load(q_ptr + n * sq_n + heads[:, :, None] * sq_h + on[None, None, :],
                       mask=hmask[:, :, None] & nmask[None, None, :] & valid, other=0.).to(tl.float32)


@triton.jit
def _da_fwd_kernel(q_ptr, k_ptr, v_ptr, ktab, vtab, out_ptr, N, C, HKV, R, RQ, HN, scale, TOK,
                   sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
                   BKV: tl.constexpr, BR: tl.constexpr, BRQ: tl.constexpr, BN: tl.constexpr,
                   GROUP: tl.constexpr, CV_PER_HEAD: tl.constexpr):
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    kdt = k_ptr.dtype.element_ty
    vdt = v_ptr.dtype.element_ty
    okv = tl.arange(0, BKV)
    orr = tl.arange(0, BR)
    on = tl.arange(0, BN)
    nmask = on < HN
    hmask = (okv < HKV)[:, None] & (orr < R)[None, :]
    kvmask = (okv < HKV)[:, None] & nmask[None, :]
    heads = okv[:, None] * R + orr[None, :]  # output head of [BKV, BR]
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        valid = n < N
        q = _da_query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP, BRQ)
        acc = tl.zeros([BKV, BR, BN], dtype=tl.float32)
        m = tl.full([BKV, BR], float("-inf"), tl.float32)
        z = tl.zeros([BKV, BR], dtype=tl.float32)
        for j in range(C + 1):  # candidates, then this layer's own key and value (j == C)
            if j < C:
                kp = tl.load(ktab + j).to(tl.pointer_type(kdt))
                vp = tl.load(vtab + j).to(tl.pointer_type(vdt))
                key = tl.load(kp + n * HKV * HN + okv[:, None] * HN + on[None, :], mask=kvmask & valid, other=0.)
                if CV_PER_HEAD:
                    val = tl.load(vp + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :],
                                  mask=hmask[:, :, None] & nmask[None, None, :] & valid, other=0.)
                else:
                    val = tl.load(vp + n * HKV * HN + okv[:, None, None] * HN + on[None, None, :],
                                  mask=kvmask[:, None, :] & valid, other=0.)
                val = val.to(tl.float32) + tl.zeros([BKV, BR, BN], dtype=tl.float32)
            else:
                key = tl.load(k_ptr + n * sk_n + okv[:, None] * sk_h + on[None, :], mask=kvmask & valid, other=0.)
                val = tl.load(v_ptr + n * sv_n + okv[:, None, None] * sv_h + on[None, None, :],
                              mask=kvmask[:, None, :] & valid, other=0.)
                val = val.to(tl.float32) + tl.zeros([BKV, BR, BN], dtype=tl.float32)
            key = key.to(tl.float32)
            s = tl.sum(q * key[:, None, :], axis=2) * scale  # [BKV, BR]
            m_new = tl.maximum(m, s)
            a = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            z = z * a + p
            acc = acc * a[:, :, None] + p[:, :, None] * val
            m = m_new
        out = acc / z[:, :, None]
        tl.store(out_ptr + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :], out.to(dt),
                 mask=hmask[:, :, None] & nmask[None, None, :] & valid)


@triton.jit
def _da_bwd_kernel(q_ptr, k_ptr, v_ptr, ktab, vtab, go_ptr, dq_ptr, dk_ptr, dv_ptr, dktab, dvtab,
                   N, C, HKV, R, RQ, HN, scale, TOK, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
                   BJ: tl.constexpr, BKV: tl.constexpr, BR: tl.constexpr, BRQ: tl.constexpr, BN: tl.constexpr,
                   GROUP: tl.constexpr, CV_PER_HEAD: tl.constexpr):
    """Pass 1: scores and go . value of every [candidate..., self] (the softmax gradient needs their weighted
    mean); pass 2: key, value and query gradients. Values shared by the R heads of a group get their sum."""
    pid = tl.program_id(0)
    kdt = k_ptr.dtype.element_ty
    vdt = v_ptr.dtype.element_ty
    oj = tl.arange(0, BJ)
    okv = tl.arange(0, BKV)
    orr = tl.arange(0, BR)
    on = tl.arange(0, BN)
    nmask = on < HN
    hmask = (okv < HKV)[:, None] & (orr < R)[None, :]
    kvmask = (okv < HKV)[:, None] & nmask[None, :]
    heads = okv[:, None] * R + orr[None, :]
    m3 = hmask[:, :, None] & nmask[None, None, :]
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        valid = n < N
        q = _da_query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP, BRQ)
        go = tl.load(go_ptr + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :], mask=m3 & valid,
                     other=0.).to(tl.float32)
        scores = tl.zeros([BJ, BKV, BR], dtype=tl.float32)
        gv = tl.zeros([BJ, BKV, BR], dtype=tl.float32)
        for j in range(C + 1):
            if j < C:
                kp = tl.load(ktab + j).to(tl.pointer_type(kdt))
                vp = tl.load(vtab + j).to(tl.pointer_type(vdt))
                key = tl.load(kp + n * HKV * HN + okv[:, None] * HN + on[None, :], mask=kvmask & valid, other=0.)
                if CV_PER_HEAD:
                    cval = tl.load(vp + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :],
                                   mask=m3 & valid, other=0.)
                else:
                    cval = tl.load(vp + n * HKV * HN + okv[:, None, None] * HN + on[None, None, :],
                                   mask=kvmask[:, None, :] & valid, other=0.)
                gvj = tl.sum(go * cval.to(tl.float32), axis=2)
            else:
                key = tl.load(k_ptr + n * sk_n + okv[:, None] * sk_h + on[None, :], mask=kvmask & valid, other=0.)
                sval = tl.load(v_ptr + n * sv_n + okv[:, None, None] * sv_h + on[None, None, :],
                               mask=kvmask[:, None, :] & valid, other=0.)
                gvj = tl.sum(go * sval.to(tl.float32), axis=2)
            s = tl.sum(q * key.to(tl.float32)[:, None, :], axis=2) * scale
            sel = (oj == j)[:, None, None]
            scores = tl.where(sel, s[None, :, :], scores)
            gv = tl.where(sel, gvj[None, :, :], gv)
        scores = tl.where((oj <= C)[:, None, None], scores, float("-inf"))
        e = tl.exp(scores - tl.max(scores, axis=0)[None, :, :])
        alpha = e / tl.sum(e, axis=0)[None, :, :]
        ds = alpha * (gv - tl.sum(alpha * gv, axis=0)[None, :, :]) * scale
        dq = tl.zeros([BKV, BR, BN], dtype=tl.float32)
        for j in range(C + 1):
            sel = (oj == j)[:, None, None]
            a = tl.sum(tl.where(sel, alpha, 0.), axis=0)
            dsj = tl.sum(tl.where(sel, ds, 0.), axis=0)
            dkey = tl.sum(dsj[:, :, None] * q, axis=1)  # [BKV, BN]
            dval = a[:, :, None] * go
            if j < C:
                kp = tl.load(ktab + j).to(tl.pointer_type(kdt))
                key = tl.load(kp + n * HKV * HN + okv[:, None] * HN + on[None, :], mask=kvmask & valid, other=0.)
                dkp = tl.load(dktab + j).to(tl.pointer_type(kdt))
                dvp = tl.load(dvtab + j).to(tl.pointer_type(vdt))
                tl.store(dkp + n * HKV * HN + okv[:, None] * HN + on[None, :], dkey.to(kdt), mask=kvmask & valid)
                if CV_PER_HEAD:
                    tl.store(dvp + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :], dval.to(vdt),
                             mask=m3 & valid)
                else:
                    tl.store(dvp + n * HKV * HN + okv[:, None] * HN + on[None, :], tl.sum(dval, axis=1).to(vdt),
                             mask=kvmask & valid)
            else:
                key = tl.load(k_ptr + n * sk_n + okv[:, None] * sk_h + on[None, :], mask=kvmask & valid, other=0.)
                tl.store(dk_ptr + n * HKV * HN + okv[:, None] * HN + on[None, :], dkey.to(kdt), mask=kvmask & valid)
                tl.store(dv_ptr + n * HKV * HN + okv[:, None] * HN + on[None, :], tl.sum(dval, axis=1).to(vdt),
                         mask=kvmask & valid)
            dq += dsj[:, :, None] * key.to(tl.float32)[:, None, :]
        if GROUP:  # the mean query: each of the RQ query heads of a group gets 1 / RQ of its gradient
            oq = tl.arange(0, BRQ)
            qh = okv[:, None] * RQ + oq[None, :]
            qmask = ((okv < HKV)[:, None] & (oq < RQ)[None, :])[:, :, None] & nmask[None, None, :] & valid
            grad = tl.sum(dq, axis=1)[:, None, :] / RQ + tl.zeros([BKV, BRQ, BN], dtype=tl.float32)
            tl.store(dq_ptr + n * HKV * RQ * HN + qh[:, :, None] * HN + on[None, None, :],
                     grad.to(dq_ptr.dtype.element_ty), mask=qmask)
        else:
            tl.store(dq_ptr + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :],
                     dq.to(dq_ptr.dtype.element_ty), mask=m3 & valid)


def _da_args(q: Tensor, k: Tensor, v: Tensor, cv: List[Tensor], group: bool):
    hq, hkv, hn = q.shape[1], k.shape[1], k.shape[2]
    r = 1 if group else hq // hkv
    per_head = bool(cv) and cv[0].shape[1] != hkv
    consts = dict(BKV=_pow2(hkv), BR=_pow2(r), BRQ=_pow2(hq // hkv), BN=_pow2(hn), GROUP=group, CV_PER_HEAD=per_head)
    return hkv, r, hq // hkv, hn, consts


def da_fwd(q: Tensor, k: Tensor, v: Tensor, ck: List[Tensor], cv: List[Tensor], group: bool) -> Tensor:
    """q [N, hq, hn], k / v [N, hkv, hn] (token and head strides free, channels contiguous); ck [N, hkv, hn] and
    cv [N, hv, hn] contiguous, C >= 1 of each. -> [N, heads, hn] in the value dtype."""
    n = q.shape[0]
    hkv, r, rq, hn, consts = _da_args(q, k, v, cv, group)
    out = torch.empty((n, hkv * r, hn), dtype=v.dtype, device=v.device)
    if n == 0:
        return out
    programs, tok = _programs(n, v.device, reduces=False)
    _da_fwd_kernel[(programs,)](
        q, k, v, _table(ck), _table(cv), out, n, len(ck), hkv, r, rq, hn, hn ** -0.5, tok,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), **consts,
        num_warps=_warps(consts["BKV"] * consts["BR"] * consts["BN"], 3))
    return out


def da_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, ck: List[Tensor], cv: List[Tensor], group: bool):
    """-> (dq, dk, dv, candidate key gradients, candidate value gradients), each in its input's dtype."""
    n = q.shape[0]
    hkv, r, rq, hn, consts = _da_args(q, k, v, cv, group)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dck = [torch.empty_like(x) for x in ck]
    dcv = [torch.empty_like(x) for x in cv]
    if n == 0:
        return dq, dk, dv, dck, dcv
    programs, tok = _programs(n, go.device, reduces=False)
    _da_bwd_kernel[(programs,)](
        q, k, v, _table(ck), _table(cv), go, dq, dk, dv, _table(dck), _table(dcv), n, len(ck), hkv, r, rq, hn,
        hn ** -0.5, tok, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BJ=_pow2(len(ck) + 1), **consts, num_warps=_warps(consts["BKV"] * consts["BR"] * consts["BN"], 4))
    return dq, dk, dv, dck, dcv


# --------------------------------------------------------------------------------------------------------------
# HC / mHC: the n residual streams' read (streams_in) and write (streams_out), each stream read once
# --------------------------------------------------------------------------------------------------------------
# Streams come as [n, N, d] with free stream and token strides (an expanded embedding, a pipeline tensor's view);
# coefficients as contiguous fp32-or-other [n, N] (weights, post) and [n, N, n] (mix: from stream i to stream j).
# A coefficient is rounded to the streams' dtype first, as the reference multiplies in that dtype; sums are fp32.
# Offsets of whole [N, d] planes are int64 (r = n * 0 + i: the stream index as an int64 scalar).


@triton.jit
def _streams_in_fwd_kernel(s_ptr, w_ptr, out_ptr, N, D, SN, ST, TOK, NS: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    od = tl.arange(0, BD)
    dmask = od < D
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        valid = n < N
        acc = tl.zeros([BD], dtype=tl.float32)
        for i in tl.static_range(NS):
            r = n * 0 + i
            w = tl.load(w_ptr + r * N + n, mask=valid, other=0.).to(dt).to(tl.float32)
            x = tl.load(s_ptr + r * SN + n * ST + od, mask=dmask & valid, other=0.).to(tl.float32)
            acc += w * x
        tl.store(out_ptr + n * D + od, acc.to(dt), mask=dmask & valid)


@triton.jit
def _streams_in_bwd_kernel(s_ptr, w_ptr, go_ptr, ds_ptr, dw_ptr, N, D, SN, ST, TOK, NS: tl.constexpr,
                           BD: tl.constexpr):
    pid = tl.program_id(0)
    dt = go_ptr.dtype.element_ty
    od = tl.arange(0, BD)
    dmask = od < D
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        valid = n < N
        go = tl.load(go_ptr + n * D + od, mask=dmask & valid, other=0.).to(tl.float32)
        for i in tl.static_range(NS):
            r = n * 0 + i
            w = tl.load(w_ptr + r * N + n, mask=valid, other=0.).to(dt).to(tl.float32)
            x = tl.load(s_ptr + r * SN + n * ST + od, mask=dmask & valid, other=0.).to(tl.float32)
            tl.store(ds_ptr + (r * N + n) * D + od, (w * go).to(dt), mask=dmask & valid)
            tl.store(dw_ptr + r * N + n, tl.sum(x * go, axis=0), mask=valid)


@triton.jit
def _streams_out_fwd_kernel(s_ptr, y_ptr, mix_ptr, post_ptr, out_ptr, N, D, SN, ST, TOK, NS: tl.constexpr,
                            BN: tl.constexpr, BD: tl.constexpr):
    """out[j] = post[j] y + sum_i mix[i, j] x[i]: each input stream row read once, the n outputs in registers."""
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    oj = tl.arange(0, BN)
    od = tl.arange(0, BD)
    jmask = oj < NS
    dmask = od < D
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        valid = n < N
        y = tl.load(y_ptr + n * D + od, mask=dmask & valid, other=0.).to(tl.float32)
        post = tl.load(post_ptr + oj * N + n, mask=jmask & valid, other=0.).to(dt).to(tl.float32)
        acc = post[:, None] * y[None, :]
        for i in tl.static_range(NS):
            r = n * 0 + i
            x = tl.load(s_ptr + r * SN + n * ST + od, mask=dmask & valid, other=0.).to(tl.float32)
            mix = tl.load(mix_ptr + (r * N + n) * NS + oj, mask=jmask & valid, other=0.).to(dt).to(tl.float32)
            acc += mix[:, None] * x[None, :]
        orow = oj[:, None].to(tl.int64) * N * D + n * D + od[None, :]
        tl.store(out_ptr + orow, acc.to(dt), mask=jmask[:, None] & dmask[None, :] & valid)


@triton.jit
def _streams_out_bwd_kernel(s_ptr, y_ptr, mix_ptr, post_ptr, go_ptr, ds_ptr, dy_ptr, dmix_ptr, dpost_ptr, N, D, SN,
                            ST, TOK, NS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """One pass: the n output gradients of a token stay in registers while each input stream is read once."""
    pid = tl.program_id(0)
    dt = go_ptr.dtype.element_ty
    oj = tl.arange(0, BN)
    od = tl.arange(0, BD)
    jmask = oj < NS
    dmask = od < D
    for t in range(TOK):
        n = (pid * TOK + t).to(tl.int64)
        valid = n < N
        mask2 = jmask[:, None] & dmask[None, :] & valid
        go = tl.load(go_ptr + oj[:, None].to(tl.int64) * N * D + n * D + od[None, :], mask=mask2,
                     other=0.).to(tl.float32)
        y = tl.load(y_ptr + n * D + od, mask=dmask & valid, other=0.).to(tl.float32)
        post = tl.load(post_ptr + oj * N + n, mask=jmask & valid, other=0.).to(dt).to(tl.float32)
        tl.store(dy_ptr + n * D + od, tl.sum(post[:, None] * go, axis=0).to(dt), mask=dmask & valid)
        tl.store(dpost_ptr + oj * N + n, tl.sum(go * y[None, :], axis=1), mask=jmask & valid)
        for i in tl.static_range(NS):
            r = n * 0 + i
            x = tl.load(s_ptr + r * SN + n * ST + od, mask=dmask & valid, other=0.).to(tl.float32)
            mix = tl.load(mix_ptr + (r * N + n) * NS + oj, mask=jmask & valid, other=0.).to(dt).to(tl.float32)
            tl.store(ds_ptr + (r * N + n) * D + od, tl.sum(mix[:, None] * go, axis=0).to(dt), mask=dmask & valid)
            tl.store(dmix_ptr + (r * N + n) * NS + oj, tl.sum(go * x[None, :], axis=1), mask=jmask & valid)


def streams_in_fwd(s: Tensor, w: Tensor) -> Tensor:
    ns, n, d = s.shape
    out = torch.empty((n, d), dtype=s.dtype, device=s.device)
    if n == 0:
        return out
    bd = _pow2(d)
    programs, tok = _programs(n, s.device, reduces=False)
    _streams_in_fwd_kernel[(programs,)](s, w, out, n, d, s.stride(0), s.stride(1), tok, NS=ns, BD=bd,
                                        num_warps=_warps(bd, 2))
    return out


def streams_in_bwd(go: Tensor, s: Tensor, w: Tensor):
    """-> (stream gradients [n, N, d], weight gradients fp32 [n, N])."""
    ns, n, d = s.shape
    ds = torch.empty((ns, n, d), dtype=s.dtype, device=s.device)
    dw = torch.empty((ns, n), dtype=F32, device=s.device)
    if n == 0:
        return ds, dw
    bd = _pow2(d)
    programs, tok = _programs(n, s.device, reduces=False)
    _streams_in_bwd_kernel[(programs,)](s, w, go, ds, dw, n, d, s.stride(0), s.stride(1), tok, NS=ns, BD=bd,
                                        num_warps=_warps(bd, 3))
    return ds, dw


def streams_out_fwd(s: Tensor, y: Tensor, mix: Tensor, post: Tensor) -> Tensor:
    ns, n, d = s.shape
    out = torch.empty((ns, n, d), dtype=s.dtype, device=s.device)
    if n == 0:
        return out
    bn, bd = _pow2(ns), _pow2(d)
    programs, tok = _programs(n, s.device, reduces=False)
    _streams_out_fwd_kernel[(programs,)](s, y, mix, post, out, n, d, s.stride(0), s.stride(1), tok, NS=ns, BN=bn,
                                         BD=bd, num_warps=_warps(bn * bd, 2))
    return out


def streams_out_bwd(go: Tensor, s: Tensor, y: Tensor, mix: Tensor, post: Tensor):
    """-> (stream gradients [n, N, d], output gradient [N, d], mix gradient fp32 [n, N, n], post gradient fp32
    [n, N])."""
    ns, n, d = s.shape
    ds = torch.empty((ns, n, d), dtype=s.dtype, device=s.device)
    dy = torch.empty((n, d), dtype=s.dtype, device=s.device)
    dmix = torch.empty((ns, n, ns), dtype=F32, device=s.device)
    dpost = torch.empty((ns, n), dtype=F32, device=s.device)
    if n == 0:
        return ds, dy, dmix, dpost
    bn, bd = _pow2(ns), _pow2(d)
    programs, tok = _programs(n, s.device, reduces=False)
    _streams_out_bwd_kernel[(programs,)](s, y, mix, post, go, ds, dy, dmix, dpost, n, d, s.stride(0), s.stride(1),
                                         tok, NS=ns, BN=bn, BD=bd, num_warps=_warps(bn * bd, 2))
    return ds, dy, dmix, dpost


# --------------------------------------------------------------------------------------------------------------
# mHC: Sinkhorn-Knopp over per-token [n, n] logits, all iterations in one kernel
# --------------------------------------------------------------------------------------------------------------
# A block of BT tokens is [BT, BN, BN] (token, row i, column j); padded lanes hold 0 after the exp, so sums are
# unaffected. FIRST: the axis normalised first in an iteration (1 = column sums over i, the paper's order; 2 = row
# sums). Backward keeps nothing from the forward: for each iteration, last to first, it recomputes that
# iteration's input from the logits (O(iters^2) work on n^2 numbers per token, no memory traffic) and applies the
# normalisations' gradients.


@triton.jit
def _sk_normalise(t, axis: tl.constexpr, eps, CLAMP: tl.constexpr):
    total = tl.expand_dims(tl.sum(t, axis=axis), axis)
    return t / (tl.maximum(total, eps) if CLAMP else total + eps)


@triton.jit
def _sk_normalise_bwd(t, g, axis: tl.constexpr, eps, CLAMP: tl.constexpr):
    """The gradient w.r.t. t of t / s(t) (s: the sum along axis, clamped or shifted by eps) given g."""
    total = tl.expand_dims(tl.sum(t, axis=axis), axis)
    s = tl.maximum(total, eps) if CLAMP else total + eps
    ds = -tl.expand_dims(tl.sum(g * t, axis=axis), axis) / (s * s)
    if CLAMP:
        ds = tl.where(total >= eps, ds, 0.)  # clamp(min=eps) passes the gradient where total >= eps
    return g / s + ds


@triton.jit
def _sk_step(m, it, lanes, eps, FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr,
             SHIFT_FIRST: tl.constexpr):
    m = _sk_normalise(m, FIRST, eps, CLAMP)
    if SHIFT_FIRST:  # deepseek: + eps after the first normalisation of the first iteration
        m = tl.where(lanes & (it == 0), m + eps, m)
    return _sk_normalise(m, SECOND, eps, CLAMP)


@triton.jit
def _sk_start(r_ptr, pid, N, NS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    """(offsets, lanes, M0 = exp(R - max R)) of a block of tokens; M0 is 0 on padded lanes."""
    ot = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    oi = tl.arange(0, BN)
    lane = (oi[:, None] < NS) & (oi[None, :] < NS)
    offs = ot[:, None, None] * NS * NS + oi[None, :, None] * NS + oi[None, None, :]
    tokens = (ot < N)[:, None, None]
    lanes = tokens & lane[None, :, :]
    r = tl.load(r_ptr + offs, mask=lanes, other=0.).to(tl.float32)
    r = tl.where(lane[None, :, :], r, -float("inf"))
    peak = tl.max(tl.max(r, axis=2), axis=1)
    m = tl.where(lanes, tl.exp(r - peak[:, None, None]), 0.)
    return offs, lanes, m


@triton.jit
def _sinkhorn_fwd_kernel(r_ptr, out_ptr, N, ITERS, eps, NS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                         FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr, SHIFT_FIRST: tl.constexpr):
    offs, lanes, m = _sk_start(r_ptr, tl.program_id(0), N, NS, BT, BN)
    for it in range(ITERS):
        m = _sk_step(m, it, lanes, eps, FIRST, SECOND, CLAMP, SHIFT_FIRST)
    tl.store(out_ptr + offs, m, mask=lanes)


@triton.jit
def _sinkhorn_bwd_kernel(r_ptr, go_ptr, dr_ptr, N, ITERS, eps, NS: tl.constexpr, BT: tl.constexpr,
                         BN: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr, CLAMP: tl.constexpr,
                         SHIFT_FIRST: tl.constexpr):
    offs, lanes, m0 = _sk_start(r_ptr, tl.program_id(0), N, NS, BT, BN)
    g = tl.load(go_ptr + offs, mask=lanes, other=0.).to(tl.float32)
    for back in range(ITERS):
        it = ITERS - 1 - back
        x = m0
        for j in range(it):  # this iteration's input, recomputed
            x = _sk_step(x, j, lanes, eps, FIRST, SECOND, CLAMP, SHIFT_FIRST)
        a = _sk_normalise(x, FIRST, eps, CLAMP)
        if SHIFT_FIRST:
            a = tl.where(lanes & (it == 0), a + eps, a)
        g = _sk_normalise_bwd(a, g, SECOND, eps, CLAMP)
        g = _sk_normalise_bwd(x, g, FIRST, eps, CLAMP)
    tl.store(dr_ptr + offs, g * m0, mask=lanes)  # through exp(R - max R), the max detached


def _sk_args(order: str, eps_style: str) -> dict:
    first = 1 if order == "paper" else 2  # axis 1: sums over rows i (column sums), the reference's dim -2
    return dict(FIRST=first, SECOND=3 - first, CLAMP=eps_style == "clamp", SHIFT_FIRST=eps_style == "deepseek")


def _sk_grid(n: int, tokens: int):
    bn = _pow2(n)
    bt = max(1, min(_pow2(tokens), 2048 // (bn * bn)))  # about 2k fp32 values a program
    return (triton.cdiv(tokens, bt),), bt, bn


def sinkhorn_fwd(r: Tensor, iters: int, order: str, eps_style: str, eps: float) -> Tensor:
    """r: [N, n, n] fp32 logits -> [N, n, n] fp32."""
    tokens, n = r.shape[0], r.shape[-1]
    out = torch.empty_like(r)
    if tokens == 0:
        return out
    grid, bt, bn = _sk_grid(n, tokens)
    _sinkhorn_fwd_kernel[grid](r, out, tokens, iters, eps, NS=n, BT=bt, BN=bn, **_sk_args(order, eps_style),
                               num_warps=4)
    return out


def sinkhorn_bwd(go: Tensor, r: Tensor, iters: int, order: str, eps_style: str, eps: float) -> Tensor:
    tokens, n = r.shape[0], r.shape[-1]
    dr = torch.empty_like(r)
    if tokens == 0:
        return dr
    grid, bt, bn = _sk_grid(n, tokens)
    _sinkhorn_bwd_kernel[grid](r, go, dr, tokens, iters, eps, NS=n, BT=bt, BN=bn, **_sk_args(order, eps_style),
                               num_warps=4)
    return dr
