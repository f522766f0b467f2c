"""AttnRes's depth mix over K sources, fused: `attnres_mix_sources` (reference: mixing.attnres_mix).

    h = sum_k alpha_k v_k,  alpha = softmax_k(w . RMSNorm(v_k)) (or an independent sigmoid per source, per head)

Contract: the sources are read in place (a list of tensors, never stacked); forward saves for backward
references to the query, the key-norm gain, the K sources and its own output h, and one fp32 scalar per token and
head: the softmax's log-normaliser (lse; none with sigmoid weights). Backward recomputes each source's logit and
RMS norm and reads every source once: its weight is exp(logit - lse), and the softmax gradient's normaliser
sum_j alpha_j go . v_j is go . h (as flash attention's rowsum(dO * O)), so source k's gradient needs only v_k.
Forward also reads each source once (an online softmax over the sources).

A source that many mixes read (Full AttnRes: sublayer j's output is read by every later mix) gets its gradient
from each of them. Added in turn, each reader reads and writes the source's gradient buffer (3 rows a reader: the
source, the buffer twice). Instead a static-query mix leaves its part to the source's gradient sink
(kernels/grad_sink.py, `Sink.defer`): its backward stores 2H + 1 fp32 coefficients a token for the source, and the
sink sums every reader's part in one kernel once all of them ran (`attnres_source_grad`): source k's gradient from
reader m is a * go_m + e * f_m - u * v_k, so the sum reads each reader's output gradient once, and the source and its
gradient once (2 rows a reader, plus 2). A 1B Full AttnRes step: 169 GB of mixing traffic -> 133.

The op is `mega_depth::attnres_mix` (and `::attnres_mix_backward`, `::attnres_mix_backward_deferred`,
`::attnres_source_grad`): Triton kernels on a GPU, the torch twin on a CPU, a fake implementation for torch.compile,
and autograd registered, so a compiled layer sees it whole.
"""

from __future__ import annotations

import itertools
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.kernels.common import (F32, PAIR_STAGES, RESIDENT_WARPS, Sources, accumulation_dtype, as_list,
                                       cast_grad, cdiv, channel_block, check_heads, contiguous_each,
                                       depth_weight_is_sigmoid, folded_query, folded_query_torch, gradient_modes_at,
                                       gradient_table, gradients_at, in_dtype, interpreting, jit, launch, nothing,
                                       partial_sums, pointer_table, pointers_at, pow2, programs, register_fake,
                                       rms_inverse_torch, row_warps, rows, source_rows, sum_rows, sums2, sums3, tl,
                                       token, uses_triton, warps)
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
def _source_block(table, k0, K, row, mask, like_ptr, KB: tl.constexpr):
    """Sources k0 .. k0 + KB - 1 of a token row: ([KB, BH, BC] fp32, their mask [KB]). KB rows a load, so that KB
    times the bytes are in flight and the chain of dependent loads and reductions is KB times shorter."""
    ok = k0 + tl.arange(0, KB)
    kmask = ok < K
    v = tl.load(pointers_at(table, ok, kmask, like_ptr)[:, None, None] + row[None, :, :],
                mask=kmask[:, None, None] & mask[None, :, :], other=0.).to(tl.float32)
    return v, kmask


@jit
def _fwd_kernel(table, q_ptr, g_ptr, out_ptr, lse_ptr, K, N, D, C, H, eps, TOK,
                BH: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, PER_TOKEN: tl.constexpr, NORM: tl.constexpr,
                SIGMOID: tl.constexpr):
    """h [N, d] and, for softmax weights, lse [N, H] (fp32 log-normaliser, for backward). An online softmax over
    the sources, KB a step ([KB, BH, BC] tiles): each source read once."""
    oh, offs, cmask = channel_block(C, H, BH, BC)
    static = folded_query(q_ptr, g_ptr, offs, cmask, out_ptr, NORM)  # per-token queries replace it
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        mask, row, f = _row(q_ptr, g_ptr, static, n, offs, cmask, N, D, out_ptr, PER_TOKEN, NORM)
        acc = tl.zeros([BH, BC], dtype=tl.float32)
        m = tl.full([BH], float("-inf"), tl.float32)
        z = tl.zeros([BH], dtype=tl.float32)
        for k0 in range(0, K, KB):
            v, kmask = _source_block(table, k0, K, row, mask, out_ptr, KB)
            if NORM:
                s, vv = sums2(v * f[None, :, :], v * v, 2)  # [KB, BH]: one exchange for both
                s = s * tl.rsqrt(tl.sum(vv, axis=1) / D + eps)[:, None]
            else:
                s = tl.sum(v * f[None, :, :], axis=2)  # [KB, BH]
            if SIGMOID:
                acc += tl.sum(tl.where(kmask[:, None], tl.sigmoid(s), 0.)[:, :, None] * v, axis=0)
            else:
                s = tl.where(kmask[:, None], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))
                scale = tl.exp(m - m_new)
                p = tl.exp(s - m_new[None, :])  # 0 for the masked sources
                z = z * scale + tl.sum(p, axis=0)
                acc = acc * scale[:, None] + tl.sum(p[:, :, None] * v, axis=0)
                m = m_new
        if not SIGMOID:
            acc = acc / z[:, None]
            tl.store(lse_ptr + n * H + oh, m + tl.log(z), mask=(oh < H) & (n < N))
        tl.store(out_ptr + row, acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _bwd_kernel(table, gtable, q_ptr, g_ptr, go_ptr, o_ptr, lse_ptr, dq_ptr, part_ptr, coef_ptr, fold_ptr, PW, K, N,
                NP, D, C, H, eps, TOK, BH: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, PER_TOKEN: tl.constexpr,
                NORM: tl.constexpr, SIGMOID: tl.constexpr, DEFER: tl.constexpr = False, STAGES: tl.constexpr = 1):
    """One pass over the sources per token, KB a step: source k's weight from its logit and the saved lse, the
    softmax gradient's normaliser go . h from the saved output h. The source gradients are stored, or added to what
    a buffer holds (gtable: common.gradient_table). Per-token query: dL/dq per token goes to dq_ptr [N, d]. The
    parameter gradient summed over the program's tokens (fp32; the folded query's with a static query, the gain's
    with a per-token one) goes to its row of part_ptr [programs, PW], which common.sum_rows reduces in order.

    DEFER (a static query): the sources whose gradient-table entry has bit 1 set get no gradient here. Source k's
    gradient is a * go + e * f - u * v_k (per token; a and e per head): for those the kernel stores the coefficients
    in coef_ptr [K, 2H + 1, NP] (fp32, rows a | e | u, NP the token count rounded up to 4), and program 0 the folded
    query f in fold_ptr [d] (fp32). Each such source's gradient is then summed over all of its readers at once
    (`attnres_source_grad`), one pass over their output gradients."""
    oh, offs, cmask = channel_block(C, H, BH, BC)
    if NORM:
        gain = tl.load(g_ptr + offs, mask=cmask, other=0.).to(tl.float32)
    static = folded_query(q_ptr, g_ptr, offs, cmask, go_ptr, NORM)  # per-token queries replace it
    if DEFER:
        tl.store(fold_ptr + offs, static, mask=cmask & (tl.program_id(0) == 0))
    total = tl.zeros([BH, BC], dtype=tl.float32)  # static: sum of df; per-token: sum of df * q (the gain's)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        mask, row, f = _row(q_ptr, g_ptr, static, n, offs, cmask, N, D, go_ptr, PER_TOKEN, NORM)
        go = tl.load(go_ptr + row, mask=mask, other=0.).to(tl.float32)
        if not SIGMOID:
            lse = tl.load(lse_ptr + n * H + oh, mask=(oh < H) & (n < N), other=0.)  # [BH]
            go_h = tl.sum(go * tl.load(o_ptr + row, mask=mask, other=0.).to(tl.float32), axis=1)  # [BH]
        df = tl.zeros([BH, BC], dtype=tl.float32)
        # STAGES 2: the next step's source rows and held gradients in flight while this step's are reduced (at 3,
        # 136 registers and one program an SM; at 2, 118 and two, as without). 1 where two sources share a gradient
        # buffer: the next step's held gradient must be loaded after this step's store (the launcher)
        for k0 in tl.range(0, K, KB, num_stages=STAGES):
            v, kmask = _source_block(table, k0, K, row, mask, go_ptr, KB)
            # the gradients already there (added to), loaded beside the rows: both in flight before the reductions
            if DEFER:  # a deferred source's gradient is left to its sink: its coefficients are stored instead
                into, adding, lazy = gradient_modes_at(gtable, k0 + tl.arange(0, KB), kmask, go_ptr)
                stored = kmask & (lazy == 0)
            else:
                into, adding = gradients_at(gtable, k0 + tl.arange(0, KB), kmask, go_ptr)
                stored = kmask
            tile = stored[:, None, None] & mask[None, :, :]
            held = tl.load(into[:, None, None] + row[None, :, :], mask=tile & adding[:, None, None], other=0.)
            if NORM:  # [KB, BH] each: one exchange for the three
                dot, gv, vv = sums3(v * f[None, :, :], go[None, :, :] * v, v * v, 2)
                r = tl.rsqrt(tl.sum(vv, axis=1) / D + eps)  # [KB]
                logit = dot * r[:, None]
            else:
                dot, gv = sums2(v * f[None, :, :], go[None, :, :] * v, 2)
                logit = dot
            if SIGMOID:
                a = tl.sigmoid(logit)
                ds = gv * a * (1. - a)
            else:
                a = tl.exp(logit - lse[None, :])
                ds = a * (gv - go_h[None, :])
            a = tl.where(kmask[:, None], a, 0.)
            ds = tl.where(kmask[:, None], ds, 0.)
            if NORM:
                dr = tl.sum(ds * dot, axis=1)  # dL/dr [KB]
                ds = ds * r[:, None]
                u = dr * r * r * r / D  # [KB]: v_k's own term
            if DEFER:  # the coefficients of a * go + e * f - u * v_k, ds being e
                ok = (k0 + tl.arange(0, KB)).to(tl.int64) * (2 * H + 1)
                at = coef_ptr + (ok[:, None] + oh[None, :]) * NP + n
                kept = kmask & lazy & (n < N)
                cm = kept[:, None] & (oh < H)[None, :]
                tl.store(at, a, mask=cm)
                tl.store(at + H * NP, ds, mask=cm)
                if NORM:
                    tl.store(coef_ptr + (ok + 2 * H) * NP + n, u, mask=kept)
            dv = a[:, :, None] * go[None, :, :]
            if NORM:
                dv -= u[:, None, None] * v
            dv += ds[:, :, None] * f[None, :, :]
            dv += held.to(tl.float32)
            tl.store(into[:, None, None] + row[None, :, :], dv.to(go_ptr.dtype.element_ty), mask=tile)
            df += tl.sum(ds[:, :, None] * v, axis=0)
        if PER_TOKEN:
            if NORM:
                tl.store(dq_ptr + row, df * gain, mask=mask)
                total += df * tl.load(q_ptr + row, mask=mask, other=0.).to(tl.float32)
            else:
                tl.store(dq_ptr + row, df, mask=mask)
        else:
            total += df
    if NORM or not PER_TOKEN:
        tl.store(part_ptr + tl.program_id(0).to(tl.int64) * PW + offs, total, mask=cmask)


@jit
def _source_grad_kernel(v_ptr, table, held_ptr, out_ptr, f32_ptr, R, N, NP, D, C, H,
                        BT: tl.constexpr, BC: tl.constexpr, RB: tl.constexpr, NORM: tl.constexpr,
                        ADD: tl.constexpr):
    """One source's gradient from all R mixes that read it (their DEFER backward): for a [BT tokens, BC channels]
    tile of one head, sum over the readers m of a_m * go_m + e_m * f_m, minus (sum of u_m) * v, RB readers a step.
    table [3R]: the readers' output gradients (rows [N, d], v's dtype), their folded queries ([d] fp32), then their
    coefficient blocks of this source ([2H + 1, NP] fp32: a | e | u). ADD: held_ptr's gradient (other readers') is
    added. A stream of rows: no reduction, each output gradient read once."""
    tok = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    h = tl.program_id(1)
    col = tl.program_id(2) * BC + tl.arange(0, BC)
    tmask, cmask = tok < N, col < C
    tile = tmask[:, None] & cmask[None, :]
    offs = tok[:, None] * D + (h * C + col)[None, :]  # [BT, BC]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    usum = tl.zeros([BT], dtype=tl.float32)
    for m0 in range(0, R, RB):
        om = m0 + tl.arange(0, RB)
        rmask = om < R
        go = pointers_at(table, om, rmask, v_ptr)  # [RB]
        f = pointers_at(table + R, om, rmask, f32_ptr)
        c = pointers_at(table + 2 * R, om, rmask, f32_ptr)
        both = rmask[:, None] & tmask[None, :]
        a = tl.load(c[:, None] + h * NP + tok[None, :], mask=both, other=0.)  # [RB, BT]
        e = tl.load(c[:, None] + (H + h) * NP + tok[None, :], mask=both, other=0.)
        g = tl.load(go[:, None, None] + offs[None, :, :], mask=rmask[:, None, None] & tile[None, :, :],
                    other=0.).to(tl.float32)  # [RB, BT, BC]
        fq = tl.load(f[:, None] + (h * C + col)[None, :], mask=rmask[:, None] & cmask[None, :], other=0.)  # [RB, BC]
        acc += tl.sum(a[:, :, None] * g + e[:, :, None] * fq[:, None, :], axis=0)
        if NORM:
            usum += tl.sum(tl.load(c[:, None] + 2 * H * NP + tok[None, :], mask=both, other=0.), axis=0)
    if NORM:
        acc -= usum[:, None] * tl.load(v_ptr + offs, mask=tile, other=0.).to(tl.float32)
    if ADD:
        acc += tl.load(held_ptr + offs, mask=tile, other=0.).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=tile)


def _lse_like(out: Tensor, heads: int, sigmoid: bool) -> Tensor:
    """The forward's saved log-normaliser [N, H] (at least fp32); empty with sigmoid weights, which need none."""
    ct = accumulation_dtype(out.dtype)
    return nothing(out).to(ct) if sigmoid else out.new_empty((out.shape[0], heads), dtype=ct)


def _triton_fwd(srcs: List[Tensor], q: Tensor, g: Optional[Tensor], eps: float, sigmoid: bool, heads: int):
    """-> (h [N, d], lse [N, H] fp32, or empty with sigmoid weights)."""
    n, d = srcs[0].shape
    out = torch.empty_like(srcs[0])
    lse = _lse_like(out, heads, sigmoid)
    if n == 0:
        return out, lse
    bh, bc = pow2(heads), pow2(d // heads)
    kb = _sources_a_step(len(srcs), bh * bc, FWD_SOURCES_A_STEP)
    num_warps = min(warps(bh * bc, kb + 2), row_warps(bh * bc, srcs[0].element_size()))  # sources in a thread
    # a register cap by the values a thread holds (the tile and two rows): 64 registers up to 24 (2 programs of 16
    # warps an SM), 85 up to 48 (d = 2048 on 8 warps: 3 programs an SM, 80 registers, as the H200's tuner chose;
    # 64 spilled 24-44 bytes), else 128
    values = (kb + 2) * bh * bc // (32 * num_warps)
    resident = 2 * RESIDENT_WARPS if values <= 24 else 3 * RESIDENT_WARPS // 2 if values <= 48 else RESIDENT_WARPS
    count, tok = programs(n, out.device, reduces=False)
    launch(_fwd_kernel, (count,), (pointer_table(srcs), q, q if g is None else g, out, out if sigmoid else lse,
                                   len(srcs), n, d, d // heads, heads, eps, tok),
           num_warps, resident_warps=resident, BH=bh, BC=bc, KB=kb, PER_TOKEN=q.dim() == 2, NORM=g is not None,
           SIGMOID=sigmoid)
    return out, lse


# Sources a step. The forward's [4, d] tile, on 16 warps at d = 2048, compiles to 64 registers (sm_90, bf16, no
# spill), so a 64-register cap keeps 2 programs an SM: 32 KiB of rows in flight and 7 dependent steps a token of
# 25 sources, where one source a step had 16 KiB and 25 steps. The backward's [2, d] tile and its gradients take
# 115 registers on 8 warps (a 64-register cap spills): 2 programs an SM, as before, each with 2 sources in flight.
FWD_SOURCES_A_STEP = 4
BWD_SOURCES_A_STEP = 2
ROW_VALUES_A_STEP = 8192  # at most KB x the row's values a step (d = 4096 halves KB)


def _sources_a_step(k: int, row: int, most: int) -> int:
    """KB: the sources a kernel step loads as one tile, up to `most`, fewer for a wide row (registers) or few
    sources."""
    kb = min(most, pow2(k))
    while kb > 1 and kb * row > ROW_VALUES_A_STEP:
        kb //= 2
    return kb


def _triton_bwd(go: Tensor, srcs: List[Tensor], q: Tensor, g: Optional[Tensor], out: Tensor, lse: Tensor, eps: float,
                sigmoid: bool, heads: int, grads: List[Tensor], adding: List[bool],
                deferred: Optional[Tuple[Tensor, Tensor, List[bool]]] = None):
    """Source gradients into `grads` (rows [N, d]; added to those with `adding` set) -> (dq shaped like q, dg [d] or
    None): the parameter gradients in the parameters' dtypes, a per-token query's (an activation's) in fp32. out
    and lse: the forward's (unused with sigmoid weights). deferred (coef [K, 2H + 1, NP] and folded query [d], both
    fp32, and a flag per source; a static query): the flagged sources' coefficients go to coef instead of their
    gradients to grads (theirs are placeholders), and the folded query to its buffer."""
    n, d = srcs[0].shape
    per_token = q.dim() == 2
    if n == 0:
        if deferred is not None:
            deferred[1].copy_(folded_query_torch(q, g, srcs[0].dtype, F32))
        return (torch.zeros(q.shape, dtype=F32, device=go.device),
                None if g is None else torch.zeros(d, dtype=F32, device=go.device))
    dq = torch.empty(q.shape, dtype=F32, device=go.device) if per_token else None  # stored row by row
    bh, bc = pow2(heads), pow2(d // heads)
    count, tok = programs(n, go.device, reduces=True)
    # per-program partial sums of the parameter gradient (a per-token query without a key norm has none)
    parts = partial_sums(count, d, go.device) if g is not None or not per_token else dq
    kb = _sources_a_step(len(srcs), bh * bc, BWD_SOURCES_A_STEP)
    coef, fold, flags = deferred if deferred is not None else (parts, parts, [False] * len(grads))
    stored = [t.data_ptr() for t, lazy in zip(grads, flags) if not lazy]
    stages = PAIR_STAGES
    if go.device.type != "meta" and len(set(stored)) < len(stored):
        # one buffer for two sources: a [KB, d] tile would read it twice and store it twice, losing one source's
        # gradient; one source a step adds them in turn, each step's load after the step before's store (no
        # pipelined loads) (meta tensors, recorded launches, share no memory)
        kb, stages = 1, 1
    gtable = gradient_table(grads, adding, flags if deferred is not None else None)
    defer = {"DEFER": True} if deferred is not None else {}  # (the key of a launch without it, as tuned.json has)
    launch(_bwd_kernel, (count,), (pointer_table(srcs), gtable, q, q if g is None else g, go, go if sigmoid else out,
                                   go if sigmoid else lse, parts if dq is None else dq, parts, coef, fold,
                                   parts.shape[1], len(srcs), n, coef.shape[-1], d, d // heads, heads, eps, tok),
           warps(bh * bc, 4), BH=bh, BC=bc, KB=kb, PER_TOKEN=per_token, NORM=g is not None, SIGMOID=sigmoid,
           STAGES=stages, **defer)
    if per_token:  # the gain's gradient, summed over tokens
        return dq, None if g is None else sum_rows(parts, d, dtypes=[g.dtype])
    if g is None:
        return sum_rows(parts, d, dtypes=[q.dtype]), None  # the folded query's, summed over tokens
    # folded = gain * query: the sum times each other factor, in the parameters' dtypes
    dq_, dg = sum_rows(parts, d, (g, q), (q.dtype, g.dtype))
    return dq_, dg


def _coefficients(k: int, n: int, heads: int, like: Tensor) -> Tensor:
    """The DEFER backward's coefficient buffer [K, 2H + 1, NP] (in the accumulation dtype of `like`'s, fp32 for the
    kernels; NP = n rounded up to 4, so that each source's [2H + 1, NP] block starts on a 16-byte boundary, as a
    pointer table needs). Each reader's buffer lives until its last deferred source is summed (Full AttnRes: the
    end of the stage's backward): about 120 MB a 1B step with one depth head, 2H + 1 times a third of that with H."""
    dtype = torch.float64 if like.dtype == torch.float64 else F32  # (no promote_types call: host time)
    return torch.empty((k, 2 * heads + 1, cdiv(n, 4) * 4), dtype=dtype, device=like.device)


# Readers a step of the source-gradient kernel, and its [tokens, channels] tile: 4 x 4 x 512 values, 16 KiB of bf16
# output-gradient rows in flight a program on 8 warps.
SOURCE_GRAD_READERS = 4
SOURCE_GRAD_TILE = 2048  # tokens x channels


def _triton_source_grad(v: Tensor, grads: List[Tensor], folds: List[Tensor], coefs: List[Tensor], heads: int,
                        norm: bool, held: Optional[Tensor]) -> Tensor:
    """attnres_source_grad's kernel: v, grads and held as rows [N, d] -> the source's gradient rows [N, d]."""
    n, d = v.shape
    c = d // heads
    out = torch.empty_like(v)
    if n == 0:
        return out
    if interpreting():  # several token tiles, chunks and reader steps, with masked tails, in the tests
        rb, bc, bt = 2, min(pow2(c), 4), 2
    else:
        rb = min(SOURCE_GRAD_READERS, pow2(len(grads)))
        bc = min(pow2(c), 512)
        bt = max(1, SOURCE_GRAD_TILE // bc)
    launch(_source_grad_kernel, (cdiv(n, bt), heads, cdiv(c, bc)),
           (v, pointer_table(grads + folds + coefs), v if held is None else held, out, folds[0], len(grads), n,
            coefs[0].shape[-1], d, c, heads),
           max(1, min(8, rb * bt * bc // 1024)), BT=bt, BC=bc, RB=rb, NORM=norm, ADD=held is not None)
    return out


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
    acc, m, z = accumulate(srcs, f, (n, heads, c), (n, heads, c), ct, g, eps, sigmoid)
    if sigmoid:
        return acc.view(n, d).to(dt), _lse_like(srcs[0], heads, sigmoid)
    return (acc / z.unsqueeze(-1)).view(n, d).to(dt), m + torch.log(z)


def _torch_bwd(go, srcs, q, g, out, lse, eps, sigmoid, heads, grads, adding, deferred=None):
    (n, d), dt = srcs[0].shape, srcs[0].dtype
    ct, c = accumulation_dtype(dt), d // heads
    f = folded_query_torch(q, g, dt, ct).view(-1, heads, c)
    if deferred is not None:
        deferred[1].copy_(f.reshape(-1))
    go = go.to(ct).view(n, heads, c)
    if not sigmoid:
        go_h = (go * out.to(ct).view(n, heads, c)).sum(-1)  # = sum_j alpha_j go . v_j
    df = torch.zeros(n, heads, c, dtype=ct, device=go.device)
    for k, src in enumerate(srcs):  # one pass: source k's gradient from v_k and per-token scalars
        v = src.to(ct).view(n, heads, c)
        dot = (v * f).sum(-1)
        gv = (go * v).sum(-1)
        r = rms_inverse_torch(v, eps) if g is not None else None
        logit = dot if r is None else dot * r.unsqueeze(-1)
        if sigmoid:
            a = torch.sigmoid(logit)
            ds = gv * a * (1 - a)
        else:
            a = torch.exp(logit - lse)
            ds = a * (gv - go_h)
        dv = a.unsqueeze(-1) * go
        if r is not None:
            dr = (ds * dot).sum(-1)
            ds = ds * r.unsqueeze(-1)
            u = dr * r.pow(3) / d
            dv = dv - u.view(n, 1, 1) * v
        df += ds.unsqueeze(-1) * v
        if deferred is not None and deferred[2][k]:  # the coefficients of a * go + e * f - u * v (DEFER)
            coef = deferred[0][k]
            coef[:heads, :n] = a.t()
            coef[heads:2 * heads, :n] = ds.t()
            if r is not None:
                coef[2 * heads, :n] = u
            continue
        dv = dv + ds.unsqueeze(-1) * f
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


def _torch_source_grad(v, grads, folds, coefs, heads, norm, held):
    """_triton_source_grad's twin."""
    (n, d), dt = v.shape, v.dtype
    ct, c = accumulation_dtype(dt), d // heads
    acc = torch.zeros(n, heads, c, dtype=ct, device=v.device)
    usum = torch.zeros(n, dtype=ct, device=v.device)
    for go, f, coef in zip(grads, folds, coefs):
        a, e = coef[:heads, :n].t().to(ct), coef[heads:2 * heads, :n].t().to(ct)  # [n, H]
        acc += a.unsqueeze(-1) * go.to(ct).view(n, heads, c) + e.unsqueeze(-1) * f.to(ct).view(1, heads, c)
        if norm:
            usum += coef[2 * heads, :n].to(ct)
    if norm:
        acc -= usum.view(n, 1, 1) * v.to(ct).view(n, heads, c)
    acc = acc.view(n, d)
    if held is not None:
        acc += held.to(ct)
    return acc.to(dt)


# --------------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------------


def _query_rows(query: Tensor, d: int) -> Tensor:
    return query.contiguous() if query.dim() == 1 else rows(query, d)


@torch.library.custom_op("mega_depth::attnres_mix", mutates_args=())
def attnres_mix_op(sources: List[Tensor], query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                   sigmoid: bool, heads: int) -> List[Tensor]:
    """sources K x [*, d]; query [d] or [*, d]; key_norm_weight [d] or None -> [h [*, d], lse [*, H] (at least
    fp32; empty with sigmoid weights)]: lse is for backward, not differentiable."""
    d = sources[0].shape[-1]
    srcs = source_rows(sources, d)
    fwd = _triton_fwd if uses_triton(srcs[0]) else _torch_fwd
    g = None if key_norm_weight is None else key_norm_weight.contiguous()
    out, lse = fwd(srcs, _query_rows(query, d), g, eps, sigmoid, heads)
    return [out.view_as(sources[0]), lse if sigmoid else lse.view(*sources[0].shape[:-1], heads)]


@register_fake(attnres_mix_op)
def _(sources, query, key_norm_weight, eps, sigmoid, heads):
    shape, ct = sources[0].shape, accumulation_dtype(sources[0].dtype)
    lse = nothing(sources[0]).to(ct) if sigmoid else sources[0].new_empty((*shape[:-1], heads), dtype=ct)
    return [sources[0].new_empty(shape), lse]


@torch.library.custom_op("mega_depth::attnres_mix_backward", mutates_args=())
def attnres_mix_backward_op(grad: Tensor, sources: List[Tensor], query: Tensor, key_norm_weight: Optional[Tensor],
                            out: Tensor, lse: Tensor, eps: float, sigmoid: bool, heads: int) -> List[Tensor]:
    """out, lse: the forward's. -> [source gradients..., dq (the query's shape and dtype), dg (the key-norm gain's,
    or empty without a key norm)]."""
    grads = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources]
    return grads + _backward_into(grad, sources, grads, [False] * len(sources), query, key_norm_weight, out, lse, eps,
                                  sigmoid, heads)


@register_fake(attnres_mix_backward_op)
def _fake_backward(grad, sources, query, key_norm_weight, *_):
    dg = key_norm_weight.new_empty(key_norm_weight.shape) if key_norm_weight is not None else nothing(grad)
    return [s.new_empty(s.shape) for s in sources] + [query.new_empty(query.shape), dg]


@torch.library.custom_op("mega_depth::attnres_mix_backward_into", mutates_args=("into",))
def attnres_mix_backward_into_op(grad: Tensor, sources: List[Tensor], into: List[Tensor], adding: List[bool],
                                 query: Tensor, key_norm_weight: Optional[Tensor], out: Tensor, lse: Tensor,
                                 eps: float, sigmoid: bool, heads: int) -> List[Tensor]:
    """The source gradients stored into `into` (contiguous tensors shaped like the sources), or added to those with
    `adding` set (kernels/grad_sink.py) -> [dq, dg] as attnres_mix_backward."""
    return _backward_into(grad, sources, into, adding, query, key_norm_weight, out, lse, eps, sigmoid, heads)


@register_fake(attnres_mix_backward_into_op)
def _(grad, sources, into, adding, query, key_norm_weight, *_):
    return _fake_backward(grad, sources, query, key_norm_weight)[len(sources):]


def _backward_into(grad, sources, into, adding, query, key_norm_weight, out, lse, eps, sigmoid, heads,
                   deferred: Optional[List[bool]] = None) -> List[Tensor]:
    """[dq, dg], the source gradients into `into`; with `deferred` flags, [coef, folded, dq, dg] and the flagged
    sources' coefficients instead of their gradients (attnres_mix_backward_deferred)."""
    d = sources[0].shape[-1]
    srcs = source_rows(sources, d)
    bwd = _triton_bwd if uses_triton(srcs[0]) else _torch_bwd
    g = None if key_norm_weight is None else key_norm_weight.contiguous()
    if not sigmoid:
        out, lse = rows(out, d), rows(lse, heads)
    lazy = None
    if deferred is None:
        into = source_rows(into, d)
    else:  # a deferred source's `into` is a placeholder
        coef = _coefficients(len(srcs), srcs[0].shape[0], heads, srcs[0])
        folded = torch.empty(d, dtype=coef.dtype, device=grad.device)  # (fp64 sources: fp64, as the twin computes)
        into = [t if flag else rows(t, d) for t, flag in zip(into, deferred)]
        lazy = (coef, folded, deferred)
    dq, dg = bwd(rows(grad, d), srcs, _query_rows(query, d), g, out, lse, eps, sigmoid, heads, into, adding, lazy)
    # in the parameters' dtypes (the static query's sum_rows already made them so; the rest are fp32 until here)
    grads = [in_dtype(dq.view_as(query), query.dtype),
             nothing(grad) if dg is None else in_dtype(dg, key_norm_weight.dtype)]
    return grads if lazy is None else [coef, folded] + grads


@torch.library.custom_op("mega_depth::attnres_mix_backward_deferred", mutates_args=("into",))
def attnres_mix_backward_deferred_op(grad: Tensor, sources: List[Tensor], into: List[Tensor], adding: List[bool],
                                     deferred: List[bool], query: Tensor, key_norm_weight: Optional[Tensor],
                                     out: Tensor, lse: Tensor, eps: float, sigmoid: bool,
                                     heads: int) -> List[Tensor]:
    """A static query's backward with the `deferred` sources' gradients left out -> [coef [K, 2H + 1, NP], folded
    [d] (the folded query), both fp32 (fp64 for fp64 sources), dq, dg]. A deferred source's gradient is a * grad +
    e * folded - u * source per token, from its block of coef (rows a | e (per head) | u): `attnres_source_grad`
    sums it over all of the source's readers at once. The other sources' gradients are stored into `into` or added
    (attnres_mix_backward_into); a deferred source's `into` is a placeholder, never written."""
    return _backward_into(grad, sources, into, adding, query, key_norm_weight, out, lse, eps, sigmoid, heads,
                          deferred)


@register_fake(attnres_mix_backward_deferred_op)
def _(grad, sources, into, adding, deferred, query, key_norm_weight, out, lse, eps, sigmoid, heads):
    n = sources[0].numel() // sources[0].shape[-1]
    ct = accumulation_dtype(sources[0].dtype)
    coef = grad.new_empty((len(sources), 2 * heads + 1, cdiv(n, 4) * 4), dtype=ct)
    return [coef, grad.new_empty(sources[0].shape[-1:], dtype=ct)] + _fake_backward(grad, sources, query,
                                                                                     key_norm_weight)[len(sources):]


@torch.library.custom_op("mega_depth::attnres_source_grad", mutates_args=())
def attnres_source_grad_op(source: Tensor, grads: List[Tensor], folds: List[Tensor], coefs: List[Tensor],
                           heads: int, norm: bool, held: Optional[Tensor]) -> Tensor:
    """A source's gradient from all the mixes that read it: sum over readers m of a_m * grads[m] + e_m * folds[m] -
    u_m * source (coefs[m]: this source's [2H + 1, NP] block of reader m's `attnres_mix_backward_deferred`
    coefficients; u only with a key norm), plus held (other readers' gradient) where given."""
    d = source.shape[-1]
    v = rows(source, d)
    fn = _triton_source_grad if uses_triton(v) else _torch_source_grad
    return fn(v, source_rows(grads, d), contiguous_each(folds), contiguous_each(coefs), heads, norm,
              None if held is None else rows(held, d)).view(source.shape)


@register_fake(attnres_source_grad_op)
def _(source, grads, folds, coefs, heads, norm, held):
    return source.new_empty(source.shape)


def _resolve(source: Tensor, records: List[tuple], held: Optional[Tensor], heads: int, norm: bool) -> Tensor:
    """A gradient sink's resolver (grad_sink.Sink.defer): the source's gradient from its readers' records
    (output gradient rows, folded query, coefficient block)."""
    grads, folds, coefs = (list(x) for x in zip(*records))
    return call(attnres_source_grad_op, source, grads, folds, coefs, heads, norm, held)


def _setup(ctx, inputs, output):
    sources, query, gain, eps, sigmoid, heads = inputs
    out, lse = output
    ctx.save_for_backward(query, gain, out, lse, *sources)
    ctx.cfg = (eps, sigmoid, heads)
    ctx.sinks = grad_sink.sinks_of(sources)
    ctx.static = query.dim() == 1
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, grads):
    query, gain, out, lse, *sources = ctx.saved_tensors
    grad = torch.zeros_like(out) if grads[0] is None else grads[0]  # (lse's is always None)
    need = ctx.needs_input_grad
    # A static query: the gradients of sources that many mixes read are left to their sinks, which sum all of
    # their readers' at once (one pass over the readers' output gradients), not added into a buffer in turn
    deferred = grad_sink.deferring(ctx.sinks) if ctx.static and need[0] else None
    if deferred is not None:
        grad = rows(grad, grad.shape[-1])  # what the records keep: contiguous, aligned rows
        into, adding = grad_sink.buffers(ctx.sinks, sources, deferred)
        coef, folded, dq, dg = call(attnres_mix_backward_deferred_op, grad, sources, into, adding, deferred, query,
                                    gain, out, lse, *ctx.cfg)
        key, blocks = (_resolve, ctx.cfg[2], gain is not None), coef.unbind(0)  # (one call, not one index a source)
        grad_sink.defer_each(ctx.sinks, deferred, key, zip(itertools.repeat(grad), itertools.repeat(folded), blocks))
        source_grads = grad_sink.returned(ctx.sinks, into, need[0])
        return source_grads, cast_grad(dq, query, need[1]), cast_grad(dg, gain, need[2]), None, None, None
    if ctx.sinks is None:
        got = call(attnres_mix_backward_op, grad, sources, query, gain, out, lse, *ctx.cfg)
        source_grads = [g if need[0] else None for g in got[:-2]]
    else:  # the sinks' buffers take the sources' gradients in the kernel (kernels/grad_sink.py)
        into, adding = grad_sink.buffers(ctx.sinks, sources)
        got = call(attnres_mix_backward_into_op, grad, sources, into, adding, query, gain, out, lse, *ctx.cfg)
        source_grads = grad_sink.returned(ctx.sinks, into, need[0])
    return source_grads, cast_grad(got[-2], query, need[1]), cast_grad(got[-1], gain, need[2]), None, None, None


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
    return call(attnres_mix_op, sources, query, key_norm_weight, float(eps), depth_weight_is_sigmoid(weight), heads)[0]
