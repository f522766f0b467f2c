"""Depth-Attention's value mix, fused: `depth_attention_mix` (reference: mixing.depth_attention_mix).

    v~ = sum_j alpha_j v_j over [candidates..., self],  alpha = softmax_j(q . k_j / sqrt(hn))   per head and token

Contract: query, key and value are read in place (a key and value split off a fused QKV projection are strided
views); the C candidate keys and values are a list, never stacked. Forward saves references to its inputs;
backward recomputes the scores and the depth softmax. Up to TILED_CANDIDATES candidates are read as one tile of
keys and one of values, each candidate once a token (_fwd_tiles_kernel, _bwd_tiles_kernel); past that, or where two
candidates share a gradient buffer, the kernels walk the entries one at a time (backward: two passes). GQA:
"query" mode mixes per query head (R = hq / hkv heads per key-value group), "group" mode once per group with the
group's mean query. C = 0 returns the value expanded, without an op. A candidate read by several layers' mixes gets
its gradients summed in the backward kernel (kernels/grad_sink.py). The op is `mega_depth::depth_attention_mix`.

`depth_attention_mix_normed` takes the candidates' raw keys and this layer's key-norm weight: the kernels normalise
each key row as the host's RMSNorm does (Llama's casting), and backward takes the raw keys' gradients through the
norm (into the sinks) and the weight's from per-program partial sums (common.sum_rows). The layer's own query and
key come normalised.

`depth_attention_mix_qk_normed` (the op `mega_depth::depth_attention_mix_qk`) takes the layer's own query and key raw
as well, with its query norm's weight: forward normalises both in the kernel (the key with the key norm, like the
candidates') and writes them out for the attention beside the mixed values; backward normalises them again from
the raw rows in the kernel, adds the attention's gradients of the normalised query and key to the mix's there, and
a second launch over the head rows (_norm_rows_bwd_kernel) takes the sums through both norms in place. Where the
host normalised them, its norm kernels ran for them forward, again in backward for the mix's saved copies, and
backward, and autograd added the mix's and the attention's gradients: two adds of [N, h, hn] a layer. (The norms'
backward inside the mix's backward kernel, a loop of its own after the tokens' or at each token's end, spilled the
1B config's 2-warp programs at 128 registers: the second launch costs a read of the raw rows and of the sums.)
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.kernels.common import (RESIDENT_WARPS, Sources, accumulation_dtype, aligned, cdiv, contiguous,
                                       gradient_at, gradient_table, gradients_at, interpreting, jit, launch, nothing,
                                       partial_sums, pointer_at, pointer_table, pointers_at, pow2, programs,
                                       register_fake, rms_norm_grad_torch, rms_normed_torch, store_or_add_torch,
                                       sum_rows, tl, token, uses_triton, warps)
from mega_depth.kernels.eager import autograd, call, traced
from mega_depth.model import mixing

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------
# Head tensors are [BKV, BR, BN]: key-value group, head within the group, channel (output head = kv * R + r).
# "query" mode: R = hq / hkv; "group" mode: R = 1 and the query is the mean of each group's RQ query heads.
# The grid is (token programs, group blocks): the groups mix independently, so a program takes BKV of them
# (_groups_per_program), not the token's every head.


@jit
def _heads(HKV, R, HN, BKV: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """(this program's kv groups [BKV] (grid axis 1: BKV groups a program), heads in a group [BR], channels [BN],
    their masks: channel [BN], head [BKV, BR], key row [BKV, BN], and the output head of [BKV, BR])."""
    okv = tl.program_id(1) * BKV + tl.arange(0, BKV)
    orr = tl.arange(0, BR)
    on = tl.arange(0, BN)
    nmask = on < HN
    hmask = (okv < HKV)[:, None] & (orr < R)[None, :]
    kvmask = (okv < HKV)[:, None] & nmask[None, :]
    return okv, orr, on, nmask, hmask, kvmask, okv[:, None] * R + orr[None, :]


@jit
def _query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP: tl.constexpr,
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


@jit
def _head_normed(raw, w, HN, eps, like_ptr, AXIS: tl.constexpr):
    """This layer's key norm of raw candidate keys (fp32 of the stored rows; one head row along AXIS), as the host's
    fused norm makes them (Llama's casting, megatron/norm.py) and the eager path then holds them: normalised in
    fp32, rounded, times the weight w (fp32, broadcast along the rows), rounded again."""
    dt = like_ptr.dtype.element_ty
    rstd = tl.rsqrt(tl.sum(raw * raw, axis=AXIS) / HN + eps)
    return ((raw * tl.expand_dims(rstd, AXIS)).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)


@jit
def _head_norm_grad(raw, dkey, w, HN, eps, AXIS: tl.constexpr):
    """The backward of _head_normed at raw: (the raw keys' gradient, the weight's gradient terms, both raw's
    shape). With hn = raw * rstd and g = dkey * w: d raw = rstd * (g - hn * mean(g * hn)); dw = dkey * hn. (The
    host's norm takes dw at hn rounded to the keys' dtype: equal in fp32, within that rounding in bf16, where one
    more conversion live made the 1B backward of 2 candidates spill.)"""
    rstd = tl.expand_dims(tl.rsqrt(tl.sum(raw * raw, axis=AXIS) / HN + eps), AXIS)
    hn = raw * rstd
    g = dkey * w
    mean = tl.expand_dims(tl.sum(g * hn, axis=AXIS) / HN, AXIS)
    return rstd * (g - hn * mean), dkey * hn


@jit
def _key(j, C, ktab, k_ptr, n, valid, sk_n, sk_h, HKV, HN, okv, on, kvmask, w, eps, KNORM: tl.constexpr,
         QKNORM: tl.constexpr):
    """Key [BKV, BN] (fp32) of entry j: candidate j < C (contiguous [N, hkv, hn]; KNORM: raw, normalised here with
    the weight w [BKV, BN]) or this layer's own (strided; normalised by the host, or with QKNORM raw and normalised
    here with the same weight)."""
    if j < C:
        key = tl.load(pointer_at(ktab, j, k_ptr) + n * HKV * HN + okv[:, None] * HN + on[None, :],
                      mask=kvmask & valid, other=0.).to(tl.float32)
        if KNORM:
            key = _head_normed(key, w, HN, eps, k_ptr, 1)
    else:
        key = tl.load(k_ptr + n * sk_n + okv[:, None] * sk_h + on[None, :], mask=kvmask & valid,
                      other=0.).to(tl.float32)
        if QKNORM:
            key = _head_normed(key, w, HN, eps, k_ptr, 1)
    return key


@jit
def _value(j, C, vtab, v_ptr, n, valid, sv_n, sv_h, HKV, R, HN, okv, on, heads, hmask, nmask, kvmask,
           BKV: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, CV_PER_HEAD: tl.constexpr):
    """Value [BKV, BR, BN] (fp32) of entry j: a candidate's (per head or per group), or this layer's own. (Each
    branch broadcasts to [BKV, BR, BN] itself: the compiler needs one type out of both; the interpreter would not
    mind.)"""
    full = tl.zeros([BKV, BR, BN], dtype=tl.float32)
    if j < C:
        vp = pointer_at(vtab, j, v_ptr)
        if CV_PER_HEAD:
            val = tl.load(vp + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :],
                          mask=hmask[:, :, None] & nmask[None, None, :] & valid, other=0.).to(tl.float32) + full
        else:
            val = tl.load(vp + n * HKV * HN + okv[:, None, None] * HN + on[None, None, :],
                          mask=kvmask[:, None, :] & valid, other=0.).to(tl.float32) + full
    else:
        val = tl.load(v_ptr + n * sv_n + okv[:, None, None] * sv_h + on[None, None, :], mask=kvmask[:, None, :] & valid,
                      other=0.).to(tl.float32) + full
    return val


@jit
def _store_query_gradient(dq, dq_ptr, n, valid, okv, on, heads, m3, nmask, R, RQ, HKV, HN, BKV: tl.constexpr,
                          BRQ: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, dqi_ptr, QKNORM: tl.constexpr):
    """A token's query gradient dq [BKV, BR, BN]; group mode: each of the RQ query heads of a group gets 1 / RQ of
    its mean query's. QKNORM: the gradient of the normalised query, to which the attention's (dqi_ptr, laid out
    as dq_ptr) is added here, not by autograd (the norm's backward follows: _norm_rows_bwd_kernel)."""
    if GROUP:
        oq = tl.arange(0, BRQ)
        qh = okv[:, None] * RQ + oq[None, :]
        qmask = ((okv < HKV)[:, None] & (oq < RQ)[None, :])[:, :, None] & nmask[None, None, :] & valid
        rows = n * HKV * RQ * HN + qh[:, :, None] * HN + on[None, None, :]
        grad = tl.sum(dq, axis=1)[:, None, :] / RQ + tl.zeros([BKV, BRQ, BN], dtype=tl.float32)
    else:
        qmask = m3 & valid
        rows = n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :]
        grad = dq
    if QKNORM:
        grad += tl.load(dqi_ptr + rows, mask=qmask, other=0.).to(tl.float32)
    tl.store(dq_ptr + rows, grad.to(dq_ptr.dtype.element_ty), mask=qmask)


@jit
def _own_key_gradient(dkey, dk_ptr, n, valid, okv, on, kvmask, HKV, HN, dki_ptr, QKNORM: tl.constexpr):
    """This layer's key's gradient dkey [BKV, BN] into dk_ptr [N, hkv, hn]; QKNORM: of the normalised key, the
    attention's (dki_ptr) added, as _store_query_gradient's."""
    own = n * HKV * HN + okv[:, None] * HN + on[None, :]
    if QKNORM:
        dkey += tl.load(dki_ptr + own, mask=kvmask & valid, other=0.).to(tl.float32)
    tl.store(dk_ptr + own, dkey.to(dk_ptr.dtype.element_ty), mask=kvmask & valid)


@jit
def _norm_rows_bwd_kernel(x_ptr, g_ptr, w_ptr, part_ptr, ROWS, H, HN, sx_n, sx_h, eps, PART0, PW, TOK,
                          BR: tl.constexpr, BN: tl.constexpr):
    """QKNORM's second launch: the backward of the host's norm of head rows (Llama's casting: normalised in fp32,
    rounded, times the weight). x [N, H, hn]: the raw rows (token and head strides free); g [N * H, hn] contiguous:
    the normalised rows' gradient, replaced in place by the raw rows'. A program walks TOK rows, BR at a time, and
    writes its sum of the weight's gradient to row PART0 + program of part_ptr [*, PW] (common.sum_rows). With
    hn = x / RMS(x): dx = (g w - hn mean(g w hn)) / RMS(x); dw = g round(hn). (Inside the mix's backward kernel, a
    second loop over the program's tokens, or their last step, spilled the 1B program's 2 warps at 128 registers.)"""
    on = tl.arange(0, BN)
    nmask = on < HN
    orow = tl.arange(0, BR)
    dt = g_ptr.dtype.element_ty
    # the weight as a [BR, BN] tile (repeated rows, from L1): a lone [BN] row loads narrower than 16 bytes a thread
    w = tl.load(w_ptr + orow[:, None] * 0 + on[None, :], mask=nmask[None, :], other=0.).to(tl.float32)
    dw = tl.zeros([BR, BN], dtype=tl.float32)
    first = tl.program_id(0).to(tl.int64) * TOK
    for r0 in range(0, TOK, BR):
        r = first + r0 + orow
        mask = ((r < ROWS) & (r0 + orow < TOK))[:, None] & nmask[None, :]
        x = tl.load(x_ptr + (r // H)[:, None] * sx_n + (r % H)[:, None] * sx_h + on[None, :], mask=mask,
                    other=0.).to(tl.float32)
        g = tl.load(g_ptr + r[:, None] * HN + on[None, :], mask=mask, other=0.).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HN + eps)[:, None]
        hn = x * rstd
        gw = g * w
        dx = rstd * (gw - hn * (tl.sum(gw * hn, axis=1) / HN)[:, None])
        tl.store(g_ptr + r[:, None] * HN + on[None, :], dx.to(dt), mask=mask)
        dw += g * hn.to(dt).to(tl.float32)
    tl.store(part_ptr + (PART0 + tl.program_id(0)).to(tl.int64) * PW + on, tl.sum(dw, axis=0), mask=nmask)


@jit
def _query_heads(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, HN, GROUP: tl.constexpr,
                 BRQ: tl.constexpr):
    """Every query head of the program's groups as stored ([BKV, BR, BN] fp32; group mode [BKV, BRQ, BN]), the
    offsets of its rows in a contiguous [N, hq, hn] tensor, and their mask: the same expressions as _query's and
    _store_query_gradient's (shared values: each distinct offset or mask tile held across the token loop costs
    registers, and the 1B backward spilled)."""
    if GROUP:
        oq = tl.arange(0, BRQ)
        heads = okv[:, None] * RQ + oq[None, :]
        qmask = ((okv < HKV)[:, None] & (oq < RQ)[None, :])[:, :, None] & nmask[None, None, :] & valid
        rows = n * HKV * RQ * HN + heads[:, :, None] * HN + on[None, None, :]
    else:
        heads = okv[:, None] * R + orr[None, :]
        qmask = hmask[:, :, None] & nmask[None, None, :] & valid
        rows = n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :]
    raw = tl.load(q_ptr + n * sq_n + heads[:, :, None] * sq_h + on[None, None, :], mask=qmask, other=0.)
    return raw.to(tl.float32), rows, qmask


@jit
def _normed_query(q_ptr, wq_ptr, qn_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, kvmask, R, RQ, HKV, HN,
                  q_eps, BKV: tl.constexpr, BN: tl.constexpr, BRQ: tl.constexpr, GROUP: tl.constexpr,
                  STORE: tl.constexpr):
    """QKNORM: this layer's query norm of its raw query (weight wq_ptr [hn], Llama's casting, as _head_normed) ->
    the query the mix reads ([BKV, BR, BN]; group mode: the mean of each group's normalised heads, rounded like the
    reference's mean). STORE (forward): the normalised heads go to qn_ptr [N, hq, hn], the attention's query. The
    weight is loaded a token (from cache), not held across the token loop: in the backward every register counts."""
    raw, rows, qmask = _query_heads(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, HN, GROUP,
                                    BRQ)
    wq = _norm_weight(wq_ptr, okv, on, kvmask, BKV, BN, True)
    qn = _head_normed(raw, wq[:, None, :], HN, q_eps, q_ptr, 2)
    if STORE:
        tl.store(qn_ptr + rows, qn.to(qn_ptr.dtype.element_ty), mask=qmask)
    if GROUP:
        return (tl.sum(qn, axis=1) / RQ).to(q_ptr.dtype.element_ty).to(tl.float32)[:, None, :]
    return qn


@jit
def _norm_weight(w_ptr, okv, on, kvmask, BKV: tl.constexpr, BN: tl.constexpr, KNORM: tl.constexpr):
    """The candidates' key-norm weight as a [BKV, BN] fp32 tile of the program's key rows (KNORM; loaded like a key
    row, as wide a load a thread: a lone [BN] row on 4 warps read 2 bytes a thread), else zeros never read (one
    type out of both branches: the compiler needs it)."""
    w = tl.zeros([BKV, BN], dtype=tl.float32)
    if KNORM:
        w += tl.load(w_ptr + okv[:, None] * 0 + on[None, :], mask=kvmask, other=0.).to(tl.float32)
    return w


@jit
def _store_weight_gradient(dw_ptr, dw_stride, dw, on, nmask, KNORM: tl.constexpr):
    """This program's partial sum of the key-norm weight's gradient (dw [BKV, BN], summed over its groups here), one
    row of a partial_sums buffer (the programs of a (tokens, groups) grid in row-major order; sum_rows adds them)."""
    if KNORM:
        row = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        tl.store(dw_ptr + row * dw_stride + on, tl.sum(dw, axis=0), mask=nmask)


@jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, ktab, vtab, w_ptr, out_ptr, wq_ptr, qn_ptr, kn_ptr, N, C, HKV, R, RQ, HN, scale,
                eps, q_eps, TOK, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
                BKV: tl.constexpr, BR: tl.constexpr, BRQ: tl.constexpr, BN: tl.constexpr,
                GROUP: tl.constexpr, CV_PER_HEAD: tl.constexpr, KNORM: tl.constexpr, QKNORM: tl.constexpr):
    """Entry by entry, an online softmax over [candidates..., self]. QKNORM: this layer's query and key come raw
    and are normalised here (query-norm weight wq_ptr, key norm w_ptr, the candidates' too), and written to qn_ptr
    [N, hq, hn] and kn_ptr [N, hkv, hn] for the attention."""
    pid = tl.program_id(0)
    okv, orr, on, nmask, hmask, kvmask, heads = _heads(HKV, R, HN, BKV, BR, BN)
    w = _norm_weight(w_ptr, okv, on, kvmask, BKV, BN, KNORM)
    for t in range(TOK):
        n = token(pid, t, TOK)
        valid = n < N
        if QKNORM:
            q = _normed_query(q_ptr, wq_ptr, qn_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, kvmask, R, RQ,
                              HKV, HN, q_eps, BKV, BN, BRQ, GROUP, True)
            own = _key(C, C, ktab, k_ptr, n, valid, sk_n, sk_h, HKV, HN, okv, on, kvmask, w, eps, KNORM, True)
            tl.store(kn_ptr + n * HKV * HN + okv[:, None] * HN + on[None, :], own.to(kn_ptr.dtype.element_ty),
                     mask=kvmask & valid)
        else:
            q = _query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP, BRQ)
        acc = tl.zeros([BKV, BR, BN], dtype=tl.float32)
        m = tl.full([BKV, BR], float("-inf"), tl.float32)
        z = tl.zeros([BKV, BR], dtype=tl.float32)
        for j in range(C + 1):  # candidates, then this layer's own key and value (j == C)
            key = _key(j, C, ktab, k_ptr, n, valid, sk_n, sk_h, HKV, HN, okv, on, kvmask, w, eps, KNORM, QKNORM)
            val = _value(j, C, vtab, v_ptr, n, valid, sv_n, sv_h, HKV, R, HN, okv, on, heads, hmask, nmask, kvmask,
                         BKV, BR, BN, CV_PER_HEAD)
            s = tl.sum(q * key[:, None, :], axis=2) * scale  # [BKV, BR]
            m_new = tl.maximum(m, s)
            a = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            z = z * a + p
            acc = acc * a[:, :, None] + p[:, :, None] * val
            m = m_new
        out = acc / z[:, :, None]
        tl.store(out_ptr + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, :, None] & nmask[None, None, :] & valid)


@jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, ktab, vtab, w_ptr, go_ptr, dq_ptr, dk_ptr, dv_ptr, dktab, dvtab, dw_ptr,
                wq_ptr, dqi_ptr, dki_ptr, dw_stride, N, C, HKV, R, RQ, HN, scale, eps, q_eps, TOK, sq_n, sq_h, sk_n,
                sk_h, sv_n, sv_h, BJ: tl.constexpr, BKV: tl.constexpr, BR: tl.constexpr, BRQ: tl.constexpr,
                BN: tl.constexpr, GROUP: tl.constexpr, CV_PER_HEAD: tl.constexpr, KNORM: tl.constexpr,
                QKNORM: tl.constexpr):
    """Pass 1: scores and go . value of every [candidate..., self] (the softmax gradient needs their weighted
    mean); pass 2: key, value and query gradients. Values shared by the R heads of a group get their sum. QKNORM
    (as _fwd_kernel): the query and own key are normalised again from their raw rows, and their gradients are the
    normalised ones' with the attention's (dqi_ptr, dki_ptr) added: _norm_rows_bwd_kernel takes them through the
    norms after."""
    pid = tl.program_id(0)
    kdt = k_ptr.dtype.element_ty
    vdt = v_ptr.dtype.element_ty
    oj = tl.arange(0, BJ)
    okv, orr, on, nmask, hmask, kvmask, heads = _heads(HKV, R, HN, BKV, BR, BN)
    m3 = hmask[:, :, None] & nmask[None, None, :]
    w = _norm_weight(w_ptr, okv, on, kvmask, BKV, BN, KNORM)
    dw = tl.zeros([BKV, BN], dtype=tl.float32)  # the weight's gradient: summed over the groups once, at the end
    for t in range(TOK):
        n = token(pid, t, TOK)
        valid = n < N
        if QKNORM:
            q = _normed_query(q_ptr, wq_ptr, q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, kvmask, R, RQ,
                              HKV, HN, q_eps, BKV, BN, BRQ, GROUP, False)
        else:
            q = _query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP, BRQ)
        go = tl.load(go_ptr + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :], mask=m3 & valid,
                     other=0.).to(tl.float32)
        scores = tl.zeros([BJ, BKV, BR], dtype=tl.float32)
        gv = tl.zeros([BJ, BKV, BR], dtype=tl.float32)
        for j in range(C + 1):
            key = _key(j, C, ktab, k_ptr, n, valid, sk_n, sk_h, HKV, HN, okv, on, kvmask, w, eps, KNORM, QKNORM)
            val = _value(j, C, vtab, v_ptr, n, valid, sv_n, sv_h, HKV, R, HN, okv, on, heads, hmask, nmask, kvmask,
                         BKV, BR, BN, CV_PER_HEAD)
            sel = (oj == j)[:, None, None]
            scores = tl.where(sel, (tl.sum(q * key[:, None, :], axis=2) * scale)[None, :, :], scores)
            gv = tl.where(sel, tl.sum(go * val, axis=2)[None, :, :], gv)
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
            if j < C:  # a candidate's gradients: stored, or added where its buffer holds other readers' (sinks)
                kv_row = n * HKV * HN + okv[:, None] * HN + on[None, :]
                raw = tl.load(pointer_at(ktab, j, k_ptr) + kv_row, mask=kvmask & valid, other=0.).to(tl.float32)
                key = raw
                if KNORM:
                    key = _head_normed(raw, w, HN, eps, k_ptr, 1)
                dq += dsj[:, :, None] * key[:, None, :]
                if KNORM:  # through this layer's norm of it, to the raw key
                    dkey, dw_terms = _head_norm_grad(raw, dkey, w, HN, eps, 1)
                    dw += dw_terms
                dkp, kadd = gradient_at(dktab, j, k_ptr)
                dkey += tl.load(dkp + kv_row, mask=kvmask & valid & kadd, other=0.).to(tl.float32)
                tl.store(dkp + kv_row, dkey.to(kdt), mask=kvmask & valid)
                dvp, vadd = gradient_at(dvtab, j, v_ptr)
                if CV_PER_HEAD:
                    head_row = n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :]
                    dval += tl.load(dvp + head_row, mask=m3 & valid & vadd, other=0.).to(tl.float32)
                    tl.store(dvp + head_row, dval.to(vdt), mask=m3 & valid)
                else:
                    dsum = tl.sum(dval, axis=1) + tl.load(dvp + kv_row, mask=kvmask & valid & vadd,
                                                          other=0.).to(tl.float32)
                    tl.store(dvp + kv_row, dsum.to(vdt), mask=kvmask & valid)
            else:
                key = tl.load(k_ptr + n * sk_n + okv[:, None] * sk_h + on[None, :], mask=kvmask & valid,
                              other=0.).to(tl.float32)
                if QKNORM:
                    key = _head_normed(key, w, HN, eps, k_ptr, 1)
                dq += dsj[:, :, None] * key[:, None, :]
                _own_key_gradient(dkey, dk_ptr, n, valid, okv, on, kvmask, HKV, HN, dki_ptr, QKNORM)
                tl.store(dv_ptr + n * HKV * HN + okv[:, None] * HN + on[None, :], tl.sum(dval, axis=1).to(vdt),
                         mask=kvmask & valid)
        _store_query_gradient(dq, dq_ptr, n, valid, okv, on, heads, m3, nmask, R, RQ, HKV, HN, BKV, BRQ, BN, GROUP,
                              dqi_ptr, QKNORM)
    _store_weight_gradient(dw_ptr, dw_stride, dw, on, nmask, KNORM)


@jit
def _own_key_and_value(k_ptr, v_ptr, n, valid, sk_n, sk_h, sv_n, sv_h, okv, on, kvmask):
    """This layer's own key [BKV, BN] and value [BKV, 1, BN] (fp32; strided views read in place)."""
    key = tl.load(k_ptr + n * sk_n + okv[:, None] * sk_h + on[None, :], mask=kvmask & valid, other=0.)
    val = tl.load(v_ptr + n * sv_n + okv[:, None, None] * sv_h + on[None, None, :], mask=kvmask[:, None, :] & valid,
                  other=0.)
    return key.to(tl.float32), val.to(tl.float32)


@jit
def _candidates(ktab, vtab, oj, C, n, valid, HKV, R, HN, okv, on, heads, hmask, nmask, kvmask, k_ptr, v_ptr,
                BJ: tl.constexpr, BKV: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, CV_PER_HEAD: tl.constexpr):
    """Every candidate's key [BJ, BKV, BN] (in its dtype) and value [BJ, BKV, BR, BN] (fp32), each set in one load
    (the C loads of one layer's candidates are all in flight), and the candidates' mask [BJ]."""
    jmask = oj < C
    kv_rows = n * HKV * HN + okv[None, :, None] * HN + on[None, None, :]  # [1, BKV, BN]
    keys = tl.load(pointers_at(ktab, oj, jmask, k_ptr)[:, None, None] + kv_rows,
                   mask=jmask[:, None, None] & kvmask[None, :, :] & valid, other=0.)
    values_at = pointers_at(vtab, oj, jmask, v_ptr)[:, None, None, None]
    full = tl.zeros([BJ, BKV, BR, BN], dtype=tl.float32)
    if CV_PER_HEAD:
        head_rows = n * HKV * R * HN + heads[None, :, :, None] * HN + on[None, None, None, :]
        values = tl.load(values_at + head_rows, mask=jmask[:, None, None, None]
                         & (hmask[:, :, None] & nmask[None, None, :])[None, :, :, :] & valid, other=0.)
    else:  # one value per group, shared by its R heads
        values = tl.load(values_at + kv_rows[:, :, None, :], mask=jmask[:, None, None, None]
                         & kvmask[None, :, None, :] & valid, other=0.)
    return keys, values.to(tl.float32) + full, jmask


@jit
def _fwd_tiles_kernel(q_ptr, k_ptr, v_ptr, ktab, vtab, w_ptr, out_ptr, wq_ptr, qn_ptr, kn_ptr, N, C, HKV, R, RQ, HN,
                      scale, eps, q_eps, TOK, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
                      BJ: tl.constexpr, BKV: tl.constexpr, BR: tl.constexpr, BRQ: tl.constexpr, BN: tl.constexpr,
                      GROUP: tl.constexpr, CV_PER_HEAD: tl.constexpr, KNORM: tl.constexpr, QKNORM: tl.constexpr):
    """_fwd_kernel with every candidate's key and value loaded as one tile before any score is reduced: one
    softmax over [candidates..., self] instead of an online one, entry after entry, each a dependent load."""
    pid = tl.program_id(0)
    okv, orr, on, nmask, hmask, kvmask, heads = _heads(HKV, R, HN, BKV, BR, BN)
    oj = tl.arange(0, BJ)
    w = _norm_weight(w_ptr, okv, on, kvmask, BKV, BN, KNORM)
    for t in range(TOK):
        n = token(pid, t, TOK)
        valid = n < N
        if QKNORM:
            q = _normed_query(q_ptr, wq_ptr, qn_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, kvmask, R, RQ,
                              HKV, HN, q_eps, BKV, BN, BRQ, GROUP, True)
        else:
            q = _query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP, BRQ)
        keys, values, jmask = _candidates(ktab, vtab, oj, C, n, valid, HKV, R, HN, okv, on, heads, hmask, nmask,
                                          kvmask, k_ptr, v_ptr, BJ, BKV, BR, BN, CV_PER_HEAD)
        keys = keys.to(tl.float32)
        if KNORM:
            keys = _head_normed(keys, w[None, :, :], HN, eps, k_ptr, 2)
        key, val = _own_key_and_value(k_ptr, v_ptr, n, valid, sk_n, sk_h, sv_n, sv_h, okv, on, kvmask)
        if QKNORM:
            key = _head_normed(key, w, HN, eps, k_ptr, 1)
            tl.store(kn_ptr + n * HKV * HN + okv[:, None] * HN + on[None, :], key.to(kn_ptr.dtype.element_ty),
                     mask=kvmask & valid)
        s_c = tl.where(jmask[:, None, None], tl.sum(q[None, :, :, :] * keys[:, :, None, :], axis=3) * scale,
                       float("-inf"))  # [BJ, BKV, BR]
        s = tl.sum(q * key[:, None, :], axis=2) * scale  # [BKV, BR]
        m = tl.maximum(tl.max(s_c, axis=0), s)
        p_c = tl.exp(s_c - m[None, :, :])
        p = tl.exp(s - m)
        acc = tl.sum(p_c[:, :, :, None] * values, axis=0) + p[:, :, None] * val
        out = acc / (tl.sum(p_c, axis=0) + p)[:, :, None]
        tl.store(out_ptr + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, :, None] & nmask[None, None, :] & valid)


@jit
def _bwd_tiles_kernel(q_ptr, k_ptr, v_ptr, ktab, vtab, w_ptr, go_ptr, dq_ptr, dk_ptr, dv_ptr, dktab, dvtab, dw_ptr,
                      wq_ptr, dqi_ptr, dki_ptr, dw_stride, N, C, HKV, R, RQ, HN, scale, eps, q_eps, TOK, sq_n, sq_h,
                      sk_n, sk_h, sv_n, sv_h, BJ: tl.constexpr, BKV: tl.constexpr, BR: tl.constexpr,
                      BRQ: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, CV_PER_HEAD: tl.constexpr,
                      KNORM: tl.constexpr, QKNORM: tl.constexpr):
    """_bwd_kernel with every candidate's key and value read once, as one tile each, and their gradients stored (or
    added, gradient tables) as one tile each: one pass per token instead of two over the entries."""
    pid = tl.program_id(0)
    kdt = k_ptr.dtype.element_ty
    vdt = v_ptr.dtype.element_ty
    okv, orr, on, nmask, hmask, kvmask, heads = _heads(HKV, R, HN, BKV, BR, BN)
    oj = tl.arange(0, BJ)
    m3 = hmask[:, :, None] & nmask[None, None, :]
    w = _norm_weight(w_ptr, okv, on, kvmask, BKV, BN, KNORM)
    # the weight's gradient [BKV, BN], in the layout of the candidates' terms it sums (a [BJ, BKV, BN] tile's sum
    # over the candidates: no conversion a token, which spilled on sm_80), summed over the groups at the end
    dw = tl.sum(tl.zeros([BJ, BKV, BN], dtype=tl.float32), axis=0)
    for t in range(TOK):
        n = token(pid, t, TOK)
        valid = n < N
        if QKNORM:
            q = _normed_query(q_ptr, wq_ptr, q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, kvmask, R, RQ,
                              HKV, HN, q_eps, BKV, BN, BRQ, GROUP, False)
        else:
            q = _query(q_ptr, n, valid, sq_n, sq_h, okv, orr, on, hmask, nmask, R, RQ, HKV, GROUP, BRQ)
        go = tl.load(go_ptr + n * HKV * R * HN + heads[:, :, None] * HN + on[None, None, :], mask=m3 & valid,
                     other=0.).to(tl.float32)
        raw_keys, values, jmask = _candidates(ktab, vtab, oj, C, n, valid, HKV, R, HN, okv, on, heads, hmask, nmask,
                                              kvmask, k_ptr, v_ptr, BJ, BKV, BR, BN, CV_PER_HEAD)
        keys = raw_keys.to(tl.float32)  # (the raw keys stay in their dtype until the norm's backward: fewer registers)
        if KNORM:
            keys = _head_normed(keys, w[None, :, :], HN, eps, k_ptr, 2)
        key, val = _own_key_and_value(k_ptr, v_ptr, n, valid, sk_n, sk_h, sv_n, sv_h, okv, on, kvmask)
        if QKNORM:  # (the weight in the key row's layout, loaded a token: held, it spilled)
            key = _head_normed(key, _norm_weight(w_ptr, okv, on, kvmask, BKV, BN, True), HN, eps, k_ptr, 1)
        s_c = tl.where(jmask[:, None, None], tl.sum(q[None, :, :, :] * keys[:, :, None, :], axis=3) * scale,
                       float("-inf"))  # [BJ, BKV, BR]
        s = tl.sum(q * key[:, None, :], axis=2) * scale  # [BKV, BR]
        m = tl.maximum(tl.max(s_c, axis=0), s)
        e_c = tl.exp(s_c - m[None, :, :])
        e = tl.exp(s - m)
        z = tl.sum(e_c, axis=0) + e
        a_c = e_c / z[None, :, :]
        a = e / z
        gv_c = tl.sum(go[None, :, :, :] * values, axis=3)  # [BJ, BKV, BR]
        gv = tl.sum(go * val, axis=2)
        mean = tl.sum(a_c * gv_c, axis=0) + a * gv
        ds_c = a_c * (gv_c - mean[None, :, :]) * scale  # 0 for the masked candidates (a_c = 0)
        ds = a * (gv - mean) * scale
        # the query's and this layer's key and value gradients first: the normalised keys die here, before the raw
        # ones go through the norm's backward
        dq = tl.sum(ds_c[:, :, :, None] * keys[:, :, None, :], axis=0) + ds[:, :, None] * key[:, None, :]
        _store_query_gradient(dq, dq_ptr, n, valid, okv, on, heads, m3, nmask, R, RQ, HKV, HN, BKV, BRQ, BN, GROUP,
                              dqi_ptr, QKNORM)
        _own_key_gradient(tl.sum(ds[:, :, None] * q, axis=1), dk_ptr, n, valid, okv, on, kvmask, HKV, HN, dki_ptr,
                          QKNORM)
        tl.store(dv_ptr + n * HKV * HN + okv[:, None] * HN + on[None, :], tl.sum(a[:, :, None] * go, axis=1).to(vdt),
                 mask=kvmask & valid)
        # the candidates' gradients: stored, or added where a buffer holds other readers' (sinks)
        kv_rows = n * HKV * HN + okv[None, :, None] * HN + on[None, None, :]
        ktile = jmask[:, None, None] & kvmask[None, :, :] & valid
        dvp, vadd = gradients_at(dvtab, oj, jmask, v_ptr)
        dvals = a_c[:, :, :, None] * go[None, :, :, :]  # [BJ, BKV, BR, BN]
        if CV_PER_HEAD:
            head_rows = n * HKV * R * HN + heads[None, :, :, None] * HN + on[None, None, None, :]
            vtile = jmask[:, None, None, None] & m3[None, :, :, :] & valid
            dvals += tl.load(dvp[:, None, None, None] + head_rows, mask=vtile & vadd[:, None, None, None],
                             other=0.).to(tl.float32)
            tl.store(dvp[:, None, None, None] + head_rows, dvals.to(vdt), mask=vtile)
        else:  # a value shared by the R heads of its group: their sum
            dsum = tl.sum(dvals, axis=2) + tl.load(dvp[:, None, None] + kv_rows, mask=ktile & vadd[:, None, None],
                                                   other=0.).to(tl.float32)
            tl.store(dvp[:, None, None] + kv_rows, dsum.to(vdt), mask=ktile)
        dkp, kadd = gradients_at(dktab, oj, jmask, k_ptr)
        dkeys = tl.sum(ds_c[:, :, :, None] * q[None, :, :, :], axis=2)  # [BJ, BKV, BN]
        if KNORM:  # through this layer's norm of them, to the raw keys
            dkeys, dw_terms = _head_norm_grad(raw_keys.to(tl.float32), dkeys, w[None, :, :], HN, eps, 2)
            dw += tl.sum(dw_terms, axis=0)
        dkeys += tl.load(dkp[:, None, None] + kv_rows, mask=ktile & kadd[:, None, None], other=0.).to(tl.float32)
        tl.store(dkp[:, None, None] + kv_rows, dkeys.to(kdt), mask=ktile)
    _store_weight_gradient(dw_ptr, dw_stride, dw, on, nmask, KNORM)


TILED_CANDIDATES = 4  # at most this many candidates are read as one tile (registers grow with it)
GROUP_TILE = 128  # a program takes whole kv groups until its [groups, heads, channels] tile holds this many values
GROUP_HEADS = 2  # a program per kv group where a group has at most this many heads (below)


def _groups_per_program(hkv: int, r: int, hn: int) -> int:
    """Key-value groups a program mixes. The groups mix independently: a program per (token, group) puts hkv times
    more programs in flight than one per token, each a smaller tile whose reductions stay within one or two warps.
    So one group (1B: 2 heads x 128 channels), or as many as make GROUP_TILE values (125M: 2 groups of 64), where a
    group has at most GROUP_HEADS heads. With more, a group's values outweigh its key row: the one or two warps
    whose threads each load 4 bytes of that row or more spill (7B: 4 heads), so a program takes the token's groups.
    Under the interpreter one, so that the tests walk the grid's group axis."""
    if r > GROUP_HEADS:
        return pow2(hkv)
    if interpreting():
        return 1
    return min(pow2(hkv), max(1, GROUP_TILE // (pow2(r) * pow2(hn))))


def _group_warps(consts, element_size: int, live: int, values: int = 96) -> int:
    """Warps of a program of a few groups: one 16-byte vector of its [groups, heads, channels] tile a thread, more
    past `values` of its `live` fp32 tiles' values a thread, while a key row [groups, channels] still loads 4 bytes
    a thread or more. (One warp reduces with shuffles: the 1B backward's layout changes took 2 barriers a token on
    one warp, 58 on two. Compiled without a spill for 1 to 2 heads, 64 or 128 channels, 1 to 4 candidates, bf16 and
    fp32.)"""
    tile, row = consts["BKV"] * consts["BR"] * consts["BN"], consts["BKV"] * consts["BN"]
    num_warps = 1
    while (num_warps < 16 and row * element_size >= 4 * 32 * 2 * num_warps
           and (tile * element_size > 16 * 32 * num_warps or tile * live > values * 32 * num_warps)):
        num_warps *= 2
    return num_warps


WHOLE_FILE_VALUES = 192  # fp32 values a thread that one warp holds given the register file of 8 resident warps


def _launch_args(q: Tensor, k: Tensor, v: Tensor, cv: List[Tensor], group: bool):
    hq, hkv, hn = q.shape[1], k.shape[1], k.shape[2]
    r = 1 if group else hq // hkv
    per_head = bool(cv) and cv[0].shape[1] != hkv
    bkv = _groups_per_program(hkv, r, hn)
    consts = dict(BKV=bkv, BR=pow2(r), BRQ=pow2(hq // hkv), BN=pow2(hn), GROUP=group, CV_PER_HEAD=per_head)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    return hkv, r, hq // hkv, hn, consts, strides, cdiv(hkv, bkv)


def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, ck: List[Tensor], cv: List[Tensor], group: bool,
                w: Optional[Tensor] = None, eps: float = 0., wq: Optional[Tensor] = None, q_eps: float = 0.):
    """q [N, hq, hn], k / v [N, hkv, hn] (token and head strides free, channels contiguous); ck [N, hkv, hn] and
    cv [N, hv, hn] contiguous, C >= 1 of each; w [hn]: the candidates' keys are raw, normalised here with it; wq [hn]
    (with w): q and k are raw too, normalised here with wq and w. -> (the mixed values [N, heads, hn] in the value
    dtype, and with wq the normalised query and key [N, hq / hkv, hn], contiguous; else None, None)."""
    n = q.shape[0]
    hkv, r, rq, hn, consts, strides, group_blocks = _launch_args(q, k, v, cv, group)
    out = torch.empty((n, hkv * r, hn), dtype=v.dtype, device=v.device)
    qk = wq is not None
    qn = torch.empty(q.shape, dtype=q.dtype, device=q.device) if qk else None
    kn = torch.empty(k.shape, dtype=k.dtype, device=k.device) if qk else None
    if n == 0:
        return out, qn, kn
    count, tok = programs(n, v.device, reduces=False)
    grid = (count, group_blocks)
    args = (q, k, v, pointer_table(ck), pointer_table(cv), k if w is None else w, out, wq if qk else k,
            qn if qk else out, kn if qk else out, n, len(ck), hkv, r, rq, hn, hn ** -0.5, eps, q_eps, tok, *strides)
    consts.update(KNORM=w is not None, QKNORM=qk)
    tiled, bj = len(ck) <= TILED_CANDIDATES, pow2(len(ck))
    if r <= GROUP_HEADS:
        # a few groups: the query, the accumulator and each candidate's value (QKNORM: the query's raw heads too); a
        # 64-register cap (32 resident warps: 32 one-warp programs an SM, the most an SM schedules)
        live = (2 + 2 * bj if tiled else 3) + int(qk)
        num_warps, resident = _group_warps(consts, v.element_size(), live), 2 * RESIDENT_WARPS
    else:
        # 16-bit rows: a 64-register cap (32 resident warps); the H200's tuner found the entry-by-entry forward
        # 1.69x faster there than at the default 128 (docs/benchmarks.md)
        num_warps = warps(consts["BKV"] * consts["BR"] * consts["BN"], 3)
        resident = 2 * RESIDENT_WARPS if tiled and v.element_size() == 2 else RESIDENT_WARPS
    if tiled:
        launch(_fwd_tiles_kernel, grid, args, num_warps, resident_warps=resident, BJ=bj, **consts)
    else:
        launch(_fwd_kernel, grid, args, num_warps, resident_warps=resident, **consts)
    return out, qn, kn


def _triton_bwd(go: Tensor, q: Tensor, k: Tensor, v: Tensor, ck: List[Tensor], cv: List[Tensor], group: bool,
                dck: List[Tensor], dcv: List[Tensor], adding: List[bool], w: Optional[Tensor] = None, eps: float = 0.,
                wq: Optional[Tensor] = None, q_eps: float = 0., dqi: Optional[Tensor] = None,
                dki: Optional[Tensor] = None):
    """Candidate gradients into dck / dcv (rows like ck / cv; added to those with `adding` set, keys then values;
    with w, the raw keys' through the norm) -> (dq, dk, dv, dw or None, dwq or None), each in its input's dtype.
    With wq (the forward's QKNORM), q and k are raw: dq and dk are theirs, through the norms, from the mix's
    gradients and the attention's of the normalised query and key, dqi [N, hq, hn] and dki [N, hkv, hn] (added in
    the mix's kernel; the norms' backward is a second launch over the head rows, _norm_rows_backward)."""
    n = q.shape[0]
    hkv, r, rq, hn, consts, strides, group_blocks = _launch_args(q, k, v, cv, group)
    qk = wq is not None
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n == 0:
        return (dq, dk, dv, None if w is None else torch.zeros_like(w), torch.zeros_like(wq) if qk else None)
    c = len(ck)
    # with the norm, per-program partial sums of its weight's gradient: a few programs an SM, several tokens each;
    # QKNORM: the raw key's norm backward adds its programs' rows after them (one sum for the key norm's weight)
    count, tok = programs(n, go.device, reduces=w is not None)
    grid = (count, group_blocks)
    mix_rows = count * group_blocks
    key_rows = _norm_rows_grid(n * hkv, hn, go.device)[0] if qk else 0
    parts = None if w is None else partial_sums(mix_rows + key_rows, pow2(hn), go.device)
    args = (q, k, v, pointer_table(ck), pointer_table(cv), k if w is None else w, go, dq, dk, dv,
            gradient_table(dck, adding[:c]), gradient_table(dcv, adding[c:]), dq if parts is None else parts,
            wq if qk else k, dqi if qk else go, dki if qk else go, 0 if parts is None else parts.stride(0), n, c, hkv,
            r, rq, hn, hn ** -0.5, eps, q_eps, tok, *strides)
    consts.update(KNORM=w is not None, QKNORM=qk)
    # a tile of gradients reads all its rows before it stores any: two candidates sharing one buffer would lose one's
    # gradient, so they go entry by entry (meta tensors, recorded launches, share no memory)
    shared = go.device.type != "meta" and any(len({t.data_ptr() for t in grads}) < c for grads in (dck, dcv))
    tiled = c <= TILED_CANDIDATES and not shared
    one_warp = False
    if r <= GROUP_HEADS:
        # a few groups: the query, its output gradient and dq, each candidate's key, value and their gradients (with
        # the norm, its raw key and the norm's gradient too: the 1B bf16 backward of 2 candidates spilled on 1 warp)
        live = (3 + 4 * pow2(c) + (2 * pow2(c) if w is not None else 0)) if tiled else 4
        num_warps = _group_warps(consts, v.element_size(), live)
        # where only the registers asked for a second warp, one warp with a whole block's register file instead:
        # the 1B bf16 backward of 2 candidates (1 group of 2 heads x 128 channels, the norms folded in) went from 2
        # warps at 128 registers (8 programs an SM, 73 barriers a token: every reduction across the two warps goes
        # through shared memory) to 1 at 198 (10 programs an SM, 3 barriers; sm_80/90/100 without a spill)
        one_warp = tiled and num_warps == 2 and _group_warps(consts, v.element_size(), live, WHOLE_FILE_VALUES) == 1
        num_warps = 1 if one_warp else num_warps
    else:
        tile = consts["BKV"] * consts["BR"] * consts["BN"]
        # the token's groups: the candidates' keys, values and their gradients beside the rows (on 4 warps 2
        # candidates spilled), and a key row [hkv, hn] spread over more threads than 4 bytes each loads narrow (7B
        # at TP 4: 2 x 128): entry by entry then
        num_warps = warps(tile, 4 + 2 * pow2(c))
        if tiled and consts["BKV"] * consts["BN"] * 2 // (32 * num_warps) < 4:
            tiled = False
        if not tiled:
            num_warps = warps(tile, 4)
    if tiled:
        # fp32 rows with the layer's norms folded in (QKNORM): 8 resident warps' registers (at 16, the 125M config's
        # one-warp programs spilled 8 bytes on sm_100)
        resident = 8 if one_warp or (qk and v.element_size() > 2) else RESIDENT_WARPS
        launch(_bwd_tiles_kernel, grid, args, num_warps, resident_warps=resident, BJ=pow2(c), **consts)
    else:
        # with the norm, the entry-by-entry backward (7B: 4 heads a group) holds the weight's gradient beside its
        # rows: 170 registers, not 128 (it spilled on sm_80)
        resident = 12 if w is not None else RESIDENT_WARPS
        launch(_bwd_kernel, grid, args, num_warps, resident_warps=resident, BJ=pow2(c + 1), **consts)
    if parts is None:
        return dq, dk, dv, None, None
    dwq = None
    if qk:  # the normalised query's and key's gradients (in dq, dk) through the norms, in place
        _norm_rows_backward(k, dk, w, eps, parts, mix_rows)
        q_parts = partial_sums(_norm_rows_grid(n * q.shape[1], hn, go.device)[0], pow2(hn), go.device)
        _norm_rows_backward(q, dq, wq, q_eps, q_parts, 0)
        dwq = sum_rows(q_parts, hn, dtypes=[wq.dtype])
    return dq, dk, dv, sum_rows(parts, hn, dtypes=[w.dtype]), dwq


def _norm_rows_grid(rows: int, hn: int, device: torch.device):
    """(programs, head rows a program, rows a step) of _norm_rows_bwd_kernel: a few programs an SM (each writes a row
    of partial sums), a [rows, hn] step of about 2k values (16 bytes of 16-bit rows a thread on 4 warps); 2 rows a
    step under the interpreter, so that the tests walk several steps and a masked tail."""
    br = 2 if interpreting() else max(1, 2048 // pow2(hn))
    count, tok = programs(rows, device, reduces=True)
    tok = cdiv(tok, br) * br
    return cdiv(rows, tok), tok, br


def _norm_rows_backward(x: Tensor, g: Tensor, weight: Tensor, eps: float, parts: Tensor, first: int) -> None:
    """x [N, h, hn] raw head rows (token and head strides free), g [N, h, hn] contiguous the gradient of their
    norm's output, replaced in place by theirs; the weight's partial sums into rows first.. of parts."""
    n, h, hn = x.shape
    count, tok, br = _norm_rows_grid(n * h, hn, x.device)
    launch(_norm_rows_bwd_kernel, (count,), (x, g, weight, parts, n * h, h, hn, x.stride(0), x.stride(1), eps, first,
                                             parts.stride(0), tok), 4, adds_into=(g,), BR=br, BN=pow2(hn))


# --------------------------------------------------------------------------------------------------------------
# The torch twin
# --------------------------------------------------------------------------------------------------------------


def _query_layout(q, k, group):
    """The query as [N, hkv, R, hn] (group: its mean over each group, [N, hkv, 1, hn]), in fp32."""
    n, hq, hn = q.shape
    hkv = k.shape[1]
    ct = accumulation_dtype(q.dtype)
    q4 = q.reshape(n, hkv, hq // hkv, hn)
    if group:
        return q4.mean(2, keepdim=True).to(ct)  # the mean in the input dtype, like the reference
    return q4.to(ct)


def _normed_keys_torch(ck, w, eps):
    """The candidates' raw keys [N, hkv, hn] normalised per head with w as the host's norm does (Llama's casting)
    -> ([normalised keys], [1 / RMS [N * hkv]])."""
    made = [rms_normed_torch(c.reshape(-1, c.shape[-1]), w, eps) for c in ck]
    return [y.view_as(c) for (y, _), c in zip(made, ck)], [rstd for _, rstd in made]


def _torch_fwd(q, k, v, ck, cv, group, w=None, eps=0., wq=None, q_eps=0.):
    """-> (mixed, normalised query, normalised key), the last two None without wq (as _triton_fwd)."""
    qn = kn = None
    if wq is not None:  # the raw query and key through this layer's norms first
        (q,), _ = _normed_keys_torch([q], wq, q_eps)
        (k,), _ = _normed_keys_torch([k], w, eps)
        qn, kn = q, k
    if w is not None:
        ck = _normed_keys_torch(ck, w, eps)[0]
    n, hkv, hn = k.shape
    q4 = _query_layout(q, k, group)
    ct, r = q4.dtype, q4.shape[2]
    acc = torch.zeros(n, hkv, r, hn, dtype=ct, device=v.device)
    m = torch.full((n, hkv, r), -math.inf, dtype=ct, device=v.device)
    z = torch.zeros((n, hkv, r), dtype=ct, device=v.device)
    for key, val in zip(list(ck) + [k], list(cv) + [v]):
        s = (q4 * key.to(ct).unsqueeze(2)).sum(-1) / math.sqrt(hn)
        val = val.to(ct).reshape(n, hkv, -1, hn)  # [N, hkv, 1 or R, hn]: shared or per-head values
        m_new = torch.maximum(m, s)
        a, p = torch.exp(m - m_new), torch.exp(s - m_new)
        z = z * a + p
        acc = acc * a.unsqueeze(-1) + p.unsqueeze(-1) * val
        m = m_new
    return (acc / z.unsqueeze(-1)).view(n, hkv * r, hn).to(v.dtype), qn, kn


def _torch_bwd(go, q, k, v, ck, cv, group, dck, dcv, adding, w=None, eps=0., wq=None, q_eps=0., dqi=None, dki=None):
    """-> (dq, dk, dv, dw, dwq), as _triton_bwd."""
    if wq is not None:  # the twin on the normalised query and key, the attention's gradients of them added; the norms'
        (qn,), (q_rstd,) = _normed_keys_torch([q], wq, q_eps)
        (kn,), (k_rstd,) = _normed_keys_torch([k], w, eps)
        dqn, dkn, dv, dw, _ = _torch_bwd(go, qn, kn, v, ck, cv, group, dck, dcv, adding, w, eps)
        dq, dwq = rms_norm_grad_torch(q.reshape(-1, q.shape[-1]), (dqn + dqi).reshape(-1, q.shape[-1]), wq, q_rstd)
        dk, dwk = rms_norm_grad_torch(k.reshape(-1, k.shape[-1]), (dkn + dki).reshape(-1, k.shape[-1]), w, k_rstd)
        return (dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype), dv, (dw.to(dwk.dtype) + dwk).to(w.dtype),
                dwq)
    if w is not None:  # the twin without the norm, the normalised keys' gradients into fresh buffers; then the norm's
        normed, rstds = _normed_keys_torch(ck, w, eps)
        grads = [torch.empty_like(c) for c in ck]
        dq, dk, dv, _, _ = _torch_bwd(go, q, k, v, normed, cv, group, grads, dcv,
                                      [False] * len(ck) + list(adding[len(ck):]))
        dw = torch.zeros(w.shape, dtype=accumulation_dtype(w.dtype), device=w.device)
        for raw, grad, rstd, into, add in zip(ck, grads, rstds, dck, adding):
            dh, dw_j = rms_norm_grad_torch(raw.reshape(-1, raw.shape[-1]), grad.view(-1, raw.shape[-1]), w, rstd)
            store_or_add_torch(into, dh.view_as(raw), add)
            dw += dw_j
        return dq, dk, dv, dw.to(w.dtype), None
    n, hkv, hn = k.shape
    q4 = _query_layout(q, k, group)
    ct, r = q4.dtype, q4.shape[2]
    go = go.to(ct).view(n, hkv, r, hn)
    keys, vals = list(ck) + [k], list(cv) + [v]
    scores, gvs = [], []
    for key, val in zip(keys, vals):  # pass 1
        scores.append((q4 * key.to(ct).unsqueeze(2)).sum(-1) / math.sqrt(hn))
        gvs.append((go * val.to(ct).reshape(n, hkv, -1, hn)).sum(-1))
    alpha = torch.softmax(torch.stack(scores), 0)  # [C + 1, N, hkv, R]
    gv = torch.stack(gvs)
    ds = alpha * (gv - (alpha * gv).sum(0)) / math.sqrt(hn)
    dq = torch.zeros_like(q4)
    dkeys, dvals = [], []
    for j, (key, val) in enumerate(zip(keys, vals)):  # pass 2
        dkeys.append((ds[j].unsqueeze(-1) * q4).sum(2).to(key.dtype))
        dval = alpha[j].unsqueeze(-1) * go
        if val.shape[1] == hkv:  # a value shared by the R heads of its group: their sum
            dval = dval.sum(2)
        dvals.append(dval.reshape(val.shape).to(val.dtype))
        dq += ds[j].unsqueeze(-1) * key.to(ct).unsqueeze(2)
    if group:
        rq = q.shape[1] // hkv
        dq = (dq / rq).expand(n, hkv, rq, hn)
    for into, grad, add in zip(dck + dcv, dkeys[:-1] + dvals[:-1], adding):
        store_or_add_torch(into, grad, add)
    return dq.reshape(q.shape).to(q.dtype), dkeys[-1], dvals[-1], None, None


# --------------------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------------------


def _head_rows(t: Tensor) -> Tensor:
    """[*, h, hn] as [N, h, hn] with contiguous channels (token and head strides stay free: a key split off a
    fused QKV projection is read in place)."""
    t = t.reshape(-1, *t.shape[-2:])
    return t if t.stride(-1) == 1 else t.contiguous()


def _operands(query, key, value, cand_keys, cand_values):
    ck = [aligned(_head_rows(c).contiguous()) for c in cand_keys]
    cv = [aligned(_head_rows(c).contiguous()) for c in cand_values]
    return _head_rows(query), _head_rows(key), _head_rows(value), ck, cv


@torch.library.custom_op("mega_depth::depth_attention_mix", mutates_args=())
def depth_attention_op(query: Tensor, key: Tensor, value: Tensor, cand_keys: List[Tensor],
                       cand_values: List[Tensor], key_norm_weight: Optional[Tensor], eps: float,
                       group: bool) -> Tensor:
    """query [*, hq, hn]; key / value [*, hkv, hn]; C >= 1 candidate keys [*, hkv, hn] and values [*, hv, hn]
    -> [*, heads, hn] (heads: hq, or hkv in group mode). key_norm_weight [hn]: the candidate keys are raw, and
    normalised with it (this layer's key norm) in the kernel."""
    return _forward(query, key, value, cand_keys, cand_values, key_norm_weight, eps, group)[0]


@register_fake(depth_attention_op)
def _(query, key, value, cand_keys, cand_values, key_norm_weight, eps, group):
    return _fake_mixed(query, key, value, group)


def _fake_mixed(query, key, value, group):
    heads = key.shape[-2] if group else query.shape[-2]
    return value.new_empty((*value.shape[:-2], heads, value.shape[-1]))


@torch.library.custom_op("mega_depth::depth_attention_mix_qk", mutates_args=())
def depth_attention_qk_op(query: Tensor, key: Tensor, value: Tensor, cand_keys: List[Tensor],
                          cand_values: List[Tensor], key_norm_weight: Tensor, eps: float, query_norm_weight: Tensor,
                          query_eps: float, group: bool) -> List[Tensor]:
    """depth_attention_mix of this layer's raw query and key, and raw candidate keys, normalised in the kernel: the
    query with query_norm_weight [hn], the key and the candidates' keys with key_norm_weight [hn] (this layer's
    norms) -> [the normalised query [*, hq, hn], the normalised key [*, hkv, hn], the mixed values [*, heads, hn]]."""
    out, qn, kn = _forward(query, key, value, cand_keys, cand_values, key_norm_weight, eps, group, query_norm_weight,
                           query_eps)
    return [qn, kn, out]


@register_fake(depth_attention_qk_op)
def _(query, key, value, cand_keys, cand_values, key_norm_weight, eps, query_norm_weight, query_eps, group):
    return [query.new_empty(query.shape), key.new_empty(key.shape), _fake_mixed(query, key, value, group)]


def _forward(query, key, value, cand_keys, cand_values, key_norm_weight, eps, group, query_norm_weight=None,
             query_eps=0.):
    """-> (mixed, normalised query, normalised key) shaped as the inputs (the last two None without the query
    norm)."""
    q, k, v, ck, cv = _operands(query, key, value, cand_keys, cand_values)
    out, qn, kn = (_triton_fwd if uses_triton(v) else _torch_fwd)(q, k, v, ck, cv, group, contiguous(key_norm_weight),
                                                                  eps, contiguous(query_norm_weight), query_eps)
    out = out.view(*value.shape[:-2], out.shape[-2], out.shape[-1])
    return out, None if qn is None else qn.view(query.shape), None if kn is None else kn.view(key.shape)


@torch.library.custom_op("mega_depth::depth_attention_mix_backward", mutates_args=())
def depth_attention_backward_op(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, cand_keys: List[Tensor],
                                cand_values: List[Tensor], key_norm_weight: Optional[Tensor], eps: float,
                                group: bool) -> List[Tensor]:
    """-> [dq, dk, dv, d key_norm_weight (or empty), candidate key gradients..., candidate value gradients...]."""
    into = _candidate_buffers(cand_keys, cand_values)
    return _backward_into(grad, query, key, value, cand_keys, cand_values, into, [False] * len(into),
                          key_norm_weight, eps, group)[:4] + into


def _candidate_buffers(cand_keys, cand_values) -> List[Tensor]:
    return [torch.empty_like(c, memory_format=torch.contiguous_format) for c in list(cand_keys) + list(cand_values)]


@register_fake(depth_attention_backward_op)
def _fake_backward(grad, query, key, value, cand_keys, cand_values, key_norm_weight, eps, group):
    return ([t.new_empty(t.shape) for t in (query, key, value)] + [_weight_gradient_like(grad, key_norm_weight)]
            + [t.new_empty(t.shape) for t in (*cand_keys, *cand_values)])


@torch.library.custom_op("mega_depth::depth_attention_mix_backward_into", mutates_args=("into",))
def depth_attention_backward_into_op(grad: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                     cand_keys: List[Tensor], cand_values: List[Tensor], into: List[Tensor],
                                     adding: List[bool], key_norm_weight: Optional[Tensor], eps: float,
                                     group: bool) -> List[Tensor]:
    """The candidates' gradients stored into `into` (contiguous tensors shaped like the candidate keys, then values),
    or added to those with `adding` set (kernels/grad_sink.py) -> [dq, dk, dv, d key_norm_weight (or empty)]."""
    return _backward_into(grad, query, key, value, cand_keys, cand_values, into, adding, key_norm_weight, eps,
                          group)[:4]


@register_fake(depth_attention_backward_into_op)
def _(grad, query, key, value, cand_keys, cand_values, into, adding, key_norm_weight, eps, group):
    return [t.new_empty(t.shape) for t in (query, key, value)] + [_weight_gradient_like(grad, key_norm_weight)]


@torch.library.custom_op("mega_depth::depth_attention_mix_qk_backward", mutates_args=())
def depth_attention_qk_backward_op(grad_query: Tensor, grad_key: Tensor, grad: Tensor, query: Tensor, key: Tensor,
                                   value: Tensor, cand_keys: List[Tensor], cand_values: List[Tensor],
                                   key_norm_weight: Tensor, eps: float, query_norm_weight: Tensor, query_eps: float,
                                   group: bool) -> List[Tensor]:
    """depth_attention_mix_qk's backward, given the gradients of its three outputs -> [d raw query, d raw key, dv,
    d key_norm_weight, d query_norm_weight, candidate key gradients..., candidate value gradients...]."""
    into = _candidate_buffers(cand_keys, cand_values)
    return _backward_into(grad, query, key, value, cand_keys, cand_values, into, [False] * len(into),
                          key_norm_weight, eps, group, (query_norm_weight, query_eps, grad_query, grad_key)) + into


@register_fake(depth_attention_qk_backward_op)
def _fake_qk_backward(grad_query, grad_key, grad, query, key, value, cand_keys, cand_values, key_norm_weight, eps,
                      query_norm_weight, query_eps, group):
    return ([t.new_empty(t.shape) for t in (query, key, value, key_norm_weight, query_norm_weight)]
            + [t.new_empty(t.shape) for t in (*cand_keys, *cand_values)])


@torch.library.custom_op("mega_depth::depth_attention_mix_qk_backward_into", mutates_args=("into",))
def depth_attention_qk_backward_into_op(grad_query: Tensor, grad_key: Tensor, grad: Tensor, query: Tensor,
                                        key: Tensor, value: Tensor, cand_keys: List[Tensor],
                                        cand_values: List[Tensor], into: List[Tensor], adding: List[bool],
                                        key_norm_weight: Tensor, eps: float, query_norm_weight: Tensor,
                                        query_eps: float, group: bool) -> List[Tensor]:
    """depth_attention_mix_qk_backward with the candidates' gradients into `into` (stored, or added where `adding`)
    -> [d raw query, d raw key, dv, d key_norm_weight, d query_norm_weight]."""
    return _backward_into(grad, query, key, value, cand_keys, cand_values, into, adding, key_norm_weight, eps, group,
                          (query_norm_weight, query_eps, grad_query, grad_key))


@register_fake(depth_attention_qk_backward_into_op)
def _(grad_query, grad_key, grad, query, key, value, cand_keys, cand_values, into, adding, key_norm_weight, eps,
      query_norm_weight, query_eps, group):
    return [t.new_empty(t.shape) for t in (query, key, value, key_norm_weight, query_norm_weight)]


def _weight_gradient_like(grad: Tensor, key_norm_weight: Optional[Tensor]) -> Tensor:
    return nothing(grad) if key_norm_weight is None else key_norm_weight.new_empty(key_norm_weight.shape)


def _backward_into(grad, query, key, value, cand_keys, cand_values, into, adding, key_norm_weight, eps, group,
                   qk=None) -> List[Tensor]:
    """-> [dq, dk, dv, d key_norm_weight (or empty)], and with qk = (query_norm_weight, query_eps, the attention's
    gradients of the normalised query and key) the raw query's and key's gradients there, and d query_norm_weight
    after."""
    q, k, v, ck, cv = _operands(query, key, value, cand_keys, cand_values)
    go = grad.reshape(-1, *grad.shape[-2:]).contiguous()
    rows = [t.view(-1, *t.shape[-2:]) for t in into]
    c = len(ck)
    wq, q_eps, dqi, dki = (None, 0., None, None) if qk is None else qk
    if qk is not None:
        dqi, dki = (t.reshape(-1, *t.shape[-2:]).contiguous() for t in (dqi, dki))
    dq, dk, dv, dw, dwq = (_triton_bwd if uses_triton(v) else _torch_bwd)(
        go, q, k, v, ck, cv, group, rows[:c], rows[c:], list(adding), contiguous(key_norm_weight), eps,
        contiguous(wq), q_eps, dqi, dki)
    out = [dq.view_as(query), dk.view_as(key), dv.view_as(value), nothing(grad) if dw is None else dw]
    return out if qk is None else out + [dwq]


def _setup(ctx, inputs, output):
    """Both ops': the plain mix's inputs end (..., eps, group), the qk op's (..., eps, query-norm weight, its eps,
    group)."""
    query, key, value, cand_keys, cand_values, key_norm_weight, eps, *rest = inputs
    query_norm_weight, query_eps = (None, 0.) if len(rest) == 1 else rest[:2]
    ctx.save_for_backward(query, key, value, key_norm_weight, query_norm_weight, *cand_keys, *cand_values)
    ctx.cfg = (eps, rest[-1], len(cand_keys), len(rest) > 1, query_eps)
    ctx.sinks = grad_sink.sinks_of(list(cand_keys) + list(cand_values))


def _backward(ctx, grads):
    """Both ops': the mix's (grads: the mixed values' gradient) and the qk op's (grads: its three outputs')."""
    query, key, value, weight, query_weight, *cands = ctx.saved_tensors
    eps, group, c, qk, query_eps = ctx.cfg
    need = ctx.needs_input_grad
    if qk:
        grad_query, grad_key, grad = grads
        args = (grad_query, grad_key, grad, query, key, value, cands[:c], cands[c:])
        plain, into_op = depth_attention_qk_backward_op, depth_attention_qk_backward_into_op
        tail = (query_weight, query_eps)
    else:
        grad = grads
        args = (grad, query, key, value, cands[:c], cands[c:])
        plain, into_op, tail = depth_attention_backward_op, depth_attention_backward_into_op, ()
    if ctx.sinks is None:
        out = call(plain, *args, weight, eps, *tail, group)
        dc = out[len(out) - 2 * c:]
    else:  # the candidates' sinks take their gradients in the kernel (kernels/grad_sink.py)
        into, adding = grad_sink.buffers(ctx.sinks, cands)
        out = call(into_op, *args, into, adding, weight, eps, *tail, group)
        dc = (grad_sink.returned(ctx.sinks[:c], into[:c], need[3])
              + grad_sink.returned(ctx.sinks[c:], into[c:], need[4]))
    dq, dk, dv, dw = out[:4]
    grads = [dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dc[:c], dc[c:],
             dw if weight is not None and need[5] else None, None]
    if qk:
        return (*grads, out[4] if need[7] else None, None, None)
    return (*grads, None)


autograd(depth_attention_op, _backward, _setup)
autograd(depth_attention_qk_op, _backward, _setup)


def depth_attention_mix(query: Tensor, key: Tensor, value: Tensor, cand_keys: Optional[Sources],
                        cand_values: Optional[Sources], gqa_mode: str = "query") -> Tensor:
    """== mixing.depth_attention_mix(...): query [*, hq, hn]; key / value [*, hkv, hn]; cand_keys [C, *, hkv, hn]
    and cand_values [C, *, hv, hn] (or sequences of C tensors, or None). -> [*, heads, hn]."""
    return _mix(query, key, value, cand_keys, cand_values, gqa_mode, None, 0.0)


def depth_attention_mix_normed(norm_weight: Tensor, norm_eps: float, query: Tensor, key: Tensor, value: Tensor,
                               cand_raw_keys: Optional[Sources], cand_values: Optional[Sources],
                               gqa_mode: str = "query") -> Tensor:
    """depth_attention_mix of the candidates' raw keys normalised by this layer's key norm (the host's RMSNorm,
    weight norm_weight [hn], Llama's casting: megatron/norm.py's fused norm), the norm inside the mix kernel each
    way: no normalised candidate key is written, made again in backward, or summed over its readers' gradients.
    == depth_attention_mix(query, key, value, [norm(k) for k in cand_raw_keys], cand_values, gqa_mode)."""
    _check_head_norm("key", norm_weight, key)
    return _mix(query, key, value, cand_raw_keys, cand_values, gqa_mode, norm_weight, float(norm_eps))


def depth_attention_mix_qk_normed(query_norm_weight: Tensor, query_eps: float, key_norm_weight: Tensor,
                                  key_eps: float, raw_query: Tensor, raw_key: Tensor, value: Tensor,
                                  cand_raw_keys: Sources, cand_values: Sources,
                                  gqa_mode: str = "query") -> Tuple[Tensor, Tensor, Tensor]:
    """This layer's query and key norms (the host's RMSNorms of head rows, weights [hn], Llama's casting) and the
    value mix of the candidates' raw keys under the key norm, in one op each way -> (the normalised query, the
    normalised key, the mixed values), what the attention reads:
    == (query, key, depth_attention_mix(query, key, value, [knorm(k) for k in cand_raw_keys], cand_values)) with
    query = qnorm(raw_query), key = knorm(raw_key). The attention's gradients of the normalised query and key join
    the mix's inside the backward kernel and go through the norms there, where autograd added them and the norms'
    own kernels ran forward, again for the mix's saved copies, and backward. C >= 1 candidates (with none, the
    caller's norms and the plain mix, which is the value itself)."""
    _check_head_norm("query", query_norm_weight, raw_query)
    _check_head_norm("key", key_norm_weight, raw_key)
    if cand_raw_keys is None or not len(cand_raw_keys):
        raise ValueError("depth_attention_mix_qk_normed mixes C >= 1 candidates; without any, normalise the query "
                         "and key with the layer's norms and use the value as it is")
    return tuple(_mix(raw_query, raw_key, value, cand_raw_keys, cand_values, gqa_mode, key_norm_weight,
                      float(key_eps), (query_norm_weight, float(query_eps))))


def _check_head_norm(which: str, weight: Tensor, like: Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != like.shape[-1]:
        raise ValueError(f"a {which} norm weight of shape {tuple(weight.shape)} does not normalise head rows of "
                         f"{like.shape[-1]} channels")


def _mix(query, key, value, cand_keys, cand_values, gqa_mode, key_norm_weight, eps, query_norm=None):
    """The mix's checks and call; query_norm (weight, eps): the qk op (-> its list of three)."""
    if gqa_mode not in mixing.DEPTH_ATTN_GQA_MODES:
        raise ValueError(f"unknown depth-attention GQA mode {gqa_mode!r}; choose one of "
                         f"{mixing.DEPTH_ATTN_GQA_MODES}")
    hq, hkv = query.shape[-2], key.shape[-2]
    heads = hq if gqa_mode == "query" else hkv
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group into {hkv} key-value heads")
    ck = [] if cand_keys is None else (list(cand_keys.unbind(0)) if isinstance(cand_keys, Tensor)
                                       else list(cand_keys))
    if not ck:
        return mixing.expand_heads(value, heads)
    cv = list(cand_values.unbind(0)) if isinstance(cand_values, Tensor) else list(cand_values)
    if len(cv) != len(ck):
        raise ValueError(f"{len(ck)} candidate keys but {len(cv)} candidate values")
    hv = cv[0].shape[-2]
    if hv not in (heads, hkv):
        raise ValueError(f"candidate values with {hv} heads mix into {heads} heads")
    for c in ck:
        if c.dtype != key.dtype or c.shape != key.shape:
            raise ValueError("candidate keys must match the key's shape and dtype")
    for c in cv:
        if c.dtype != value.dtype or c.shape != cv[0].shape or c.shape[:-2] != value.shape[:-2]:
            raise ValueError("candidate values must match the value's leading shape and dtype")
    if not traced([query, key, value]) and not traced(ck + cv):  # readers of a candidate add into one buffer
        shared = grad_sink.aliased(ck + cv)
        ck, cv = shared[:len(ck)], shared[len(ck):]
    if query_norm is not None:
        return call(depth_attention_qk_op, query, key, value, ck, cv, key_norm_weight, eps, *query_norm,
                    gqa_mode == "group")
    return call(depth_attention_op, query, key, value, ck, cv, key_norm_weight, eps, gqa_mode == "group")
