"""Block AttnRes's exact two-phase computation, fused (references: mixing.attnres_block_phase1 / _phase2).

    attnres_phase1_sources(completed, queries, key_norm_weights, eps, weight, heads) -> (m, z, o)
        all S queries of a block against the n completed blocks in one pass over the blocks: per query the running
        max m [S, *, H], the sum of exponentials z [S, *, H] (relative to m) and the unnormalised sum o [S, *, d].
        Saves: queries, key-norm gains, the n blocks (references) and m itself. m is a detached stabiliser, so
        p_sj = exp(l_sj - m_s) is local to block j and backward is one pass over the blocks. m (and z with sigmoid
        weights, where m = 0 and z = 1) are non-differentiable outputs, as in the reference.
    attnres_phase2(m, z, o, partial, query, key_norm_weight, eps, weight, heads) -> [*, d]
        one sublayer's online-softmax merge of the block's partial sum into phase 1's (m, z, o). Saves its inputs
        (references); backward recomputes the partial's logit. With sigmoid weights and no partial it returns o.
    attnres_phase2_normed(norm_weight, norm_eps, m, z, o, partial, ...) -> [*, d]
        the host's RMSNorm of that merge (the sublayer's normalised input), in the same kernels: the merge stays in
        registers, so it is neither written, read by the norm, nor made again for the norm's backward. Saves its
        inputs and 1 / RMS a token; backward makes the merge again in registers, runs the norm's backward there
        and goes on into the merge's. What the host's fused norm runs for a Block AttnRes sublayer input
        (megatron/norm.py, `Recomputed.normalised`): per sublayer with a partial sum, 3 Triton launches a step
        (forward, backward, the norm weight's partial sums) and 8 [tokens, d] passes, where the merge, its
        recomputation and Liger's norm took 5 launches, a torch sum and 16 passes.

The ops are `mega_depth::attnres_phase1` and `mega_depth::attnres_phase2` (each with a `_backward` op; phase 2
takes an optional norm weight).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.kernels.attnres_mix import accumulate
from mega_depth.kernels.common import (F32, RESIDENT_WARPS, STREAM_STAGES, Sources, accumulation_dtype, as_list,
                                       cast_grad, cdiv, channel_block, check_heads, chunk, contiguous,
                                       depth_weight_is_sigmoid, dot32, dot_dim, dot_t, folded_query, folded_query_torch,
                                       in_dtype, jit, launch, nothing, partial_sums, partial_width, pointer_at,
                                       pointer_table, pointers_at, pow2, programs, reduction_grid, register_fake,
                                       rms_inverse_torch, rms_norm_grad, rms_norm_grad_torch, rms_normed,
                                       rms_normed_torch, row_warps, rows, source_rows, sum_rows, sums2, sums3, tl,
                                       token, uses_triton, warps)
from mega_depth.kernels.eager import autograd, call

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@jit
def _phase1_pass1(table, q_ptr, g_ptr, go_ptr, n, valid, K, N, S, D, C, H, eps, like_ptr, BK: tl.constexpr,
                  BS: tl.constexpr, BH: tl.constexpr, BCH: tl.constexpr, NORM: tl.constexpr, GO: tl.constexpr):
    """Pass 1 over a token's K blocks, head by head and chunk by chunk: each chunk of all K blocks is one [BK, BCH]
    tile (16-byte loads), its products with the S folded queries (and, with GO, the S output gradients go_ptr
    [S, N, d]) one dot each, accumulated over the chunks. -> the logits of every (block, query, head) [BK, BS, BH],
    their dots before the key norm, go_s . v_k [BK, BS, BH] and 1 / RMS of every block [BK] (1 without a key
    norm)."""
    ok = tl.arange(0, BK)
    os_ = tl.arange(0, BS)
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BCH)
    kmask = ok < K
    smask = os_ < S
    blocks = pointers_at(table, ok, kmask, like_ptr)
    dots = tl.zeros([BK, BS, BH], dtype=tl.float32)
    gov = tl.zeros([BK, BS, BH], dtype=tl.float32)
    squares = tl.zeros([BK, BCH], dtype=tl.float32)
    for h in range(H):
        head_dots = tl.zeros([BK, BS], dtype=tl.float32)
        head_gov = tl.zeros([BK, BS], dtype=tl.float32)
        for c0 in range(0, C, BCH):
            offs = h * C + c0 + oc
            cmask = (c0 + oc < C) & valid
            v = tl.load(blocks[:, None] + n * D + offs[None, :], mask=kmask[:, None] & cmask[None, :], other=0.)
            qmask = smask[:, None] & cmask[None, :]
            f = folded_query(q_ptr, g_ptr, os_[:, None] * D + offs[None, :], qmask, like_ptr, NORM)
            head_dots = dot_t(v, f.to(v.dtype), head_dots)
            if GO:
                go = tl.load(go_ptr + os_[:, None].to(tl.int64) * N * D + n * D + offs[None, :], mask=qmask, other=0.)
                head_gov = dot_t(v, go, head_gov)
            if NORM:
                squares += v.to(tl.float32) * v.to(tl.float32)
        dots = tl.where((oh == h)[None, None, :], head_dots[:, :, None], dots)
        gov = tl.where((oh == h)[None, None, :], head_gov[:, :, None], gov)
    if NORM:
        rinv = tl.rsqrt(tl.sum(squares, axis=1) / D + eps)
    else:
        rinv = tl.full([BK], 1., tl.float32)
    return dots * rinv[:, None, None], dots, gov, rinv


@jit
def _head(tile, oh, h):
    """tile[:, :, h] of a [BK, BS, BH] tile: [BK, BS]."""
    return tl.sum(tl.where((oh == h)[None, None, :], tile, 0.), axis=2)


@jit
def _phase1_fwd_kernel(table, q_ptr, g_ptr, m_ptr, z_ptr, o_ptr, K, N, S, D, C, H, eps, TOK,
                       BK: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr, BCH: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr):
    """Per token: pass 1 finds the logits of every (block, query, head), pass 2 walks the chunks again, last to
    first, and sums the blocks weighted by exp(l - m) (or sigmoid(l)), one dot [BS, BK] x [BK, BCH] a chunk; the
    second read of a token's blocks then starts with the lines pass 1 read last. (An eviction hint would not reach
    the loads: Triton pipelines them into cp.async copies, which drop it.)"""
    ok = tl.arange(0, BK)
    os_ = tl.arange(0, BS)
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BCH)
    smask = os_ < S
    kmask = ok < K
    live = kmask[:, None, None] & smask[None, :, None] & (oh < H)[None, None, :]
    blocks = pointers_at(table, ok, kmask, o_ptr)
    chunks = tl.cdiv(C, BCH)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        logit, _, _, _ = _phase1_pass1(table, q_ptr, g_ptr, o_ptr, n, valid, K, N, S, D, C, H, eps, o_ptr, BK, BS,
                                       BH, BCH, NORM, False)
        if SIGMOID:
            p = tl.where(live, tl.sigmoid(logit), 0.)
        else:
            logit = tl.where(kmask[:, None, None], logit, float("-inf"))
            m = tl.max(logit, axis=0)
            p = tl.where(live, tl.exp(logit - m[None, :, :]), 0.)
            soffs = os_[:, None].to(tl.int64) * N * H + n * H + oh[None, :]
            smask2 = smask[:, None] & (oh < H)[None, :] & valid
            tl.store(m_ptr + soffs, m, mask=smask2)
            tl.store(z_ptr + soffs, tl.sum(p, axis=0), mask=smask2)
        for i in range(H):  # last head and chunk first: the lines pass 1 read last are the likeliest still cached
            h = H - 1 - i
            weights = tl.trans(_head(p, oh, h))  # [BS, BK]
            for j in range(chunks):
                c0 = (chunks - 1 - j) * BCH
                offs = h * C + c0 + oc
                cmask = (c0 + oc < C) & valid
                v = tl.load(blocks[:, None] + n * D + offs[None, :], mask=kmask[:, None] & cmask[None, :], other=0.)
                orow = os_[:, None].to(tl.int64) * N * D + n * D + offs[None, :]
                tl.store(o_ptr + orow, dot32(weights, v).to(o_ptr.dtype.element_ty),
                         mask=smask[:, None] & cmask[None, :])


@jit
def _phase1_fwd_rows_kernel(table, q_ptr, g_ptr, m_ptr, z_ptr, o_ptr, K, N, S, D, C, H, eps, TOK,
                            BK: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, NORM: tl.constexpr,
                            SIGMOID: tl.constexpr):
    """Per token, where a token's K whole block rows fit in registers (_rows_fit): the rows [BK, BH, BC] are read
    once, as one tile of 16-byte loads, and every query's logits, weights and weighted sum come from that tile (the
    chunked kernel above reads them twice, a [BK, chunk] tile at a time)."""
    ok = tl.arange(0, BK)
    kmask = ok < K
    oh, offs, cmask = channel_block(C, H, BH, BC)  # [BH], [BH, BC], [BH, BC]
    hmask = oh < H
    blocks = pointers_at(table, ok, kmask, o_ptr)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        v = tl.load(blocks[:, None, None] + n * D + offs[None, :, :], mask=kmask[:, None, None] & cmask[None, :, :]
                    & valid, other=0.).to(tl.float32)  # [BK, BH, BC]
        if NORM:
            rinv = tl.rsqrt(tl.sum(tl.sum(v * v, axis=2), axis=1) / D + eps)  # [BK]
        else:
            rinv = tl.full([BK], 1., tl.float32)
        # the next queries' rows (from L2: every token reads them) in flight while one query's sums are exchanged
        # (STREAM_STAGES): one query after another, each waited on its own loads
        for s in tl.range(S, num_stages=STREAM_STAGES):
            f = folded_query(q_ptr + s * D, g_ptr + s * D, offs, cmask, o_ptr, NORM)  # [BH, BC]
            logit = tl.sum(v * f[None, :, :], axis=2) * rinv[:, None]  # [BK, BH]
            live = kmask[:, None] & hmask[None, :]
            if SIGMOID:
                p = tl.where(live, tl.sigmoid(logit), 0.)
            else:
                m = tl.max(tl.where(kmask[:, None], logit, float("-inf")), axis=0)  # [BH]
                p = tl.where(live, tl.exp(logit - m[None, :]), 0.)
                soffs = (s * N + n) * H + oh
                tl.store(m_ptr + soffs, m, mask=hmask & valid)
                tl.store(z_ptr + soffs, tl.sum(p, axis=0), mask=hmask & valid)
            o = tl.sum(p[:, :, None] * v, axis=0)  # [BH, BC]
            tl.store(o_ptr + (s * N + n) * D + offs, o.to(o_ptr.dtype.element_ty), mask=cmask & valid)


@jit
def _phase1_bwd_kernel(table, gtable, q_ptr, g_ptr, m_ptr, go_ptr, gz_ptr, w_ptr, K, N, S, D, C, H, eps, TOK,
                       BK: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr, BCH: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr, HAS_GZ: tl.constexpr):
    """Per token: m is a saved constant of the forward, so every p_sj = exp(l_sj - m_s) and its gradient are local
    to block j. Pass 1: logits and go . v of every block; pass 2: the block gradients, chunk by chunk, as
    p^T go + dl^T f (two dots [BK, BS] x [BS, BCH]) less the key norm's term. The logit gradients (times 1 / RMS)
    go to w_ptr [N, K, S, H] for the queries' gradient (_phase1_dq_kernel)."""
    ok = tl.arange(0, BK)
    os_ = tl.arange(0, BS)
    oh = tl.arange(0, BH)
    oc = tl.arange(0, BCH)
    smask = os_ < S
    kmask = ok < K
    live = kmask[:, None, None] & smask[None, :, None] & (oh < H)[None, None, :]
    blocks = pointers_at(table, ok, kmask, go_ptr)
    block_grads = pointers_at(gtable, ok, kmask, go_ptr)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        logit, dots, gov, rinv = _phase1_pass1(table, q_ptr, g_ptr, go_ptr, n, valid, K, N, S, D, C, H, eps, go_ptr,
                                               BK, BS, BH, BCH, NORM, True)
        if SIGMOID:
            p = tl.sigmoid(logit)
            dl = gov * p * (1. - p)
        else:
            soffs = os_[:, None].to(tl.int64) * N * H + n * H + oh[None, :]
            smask2 = smask[:, None] & (oh < H)[None, :] & valid
            m = tl.load(m_ptr + soffs, mask=smask2, other=0.)
            p = tl.exp(logit - m[None, :, :])
            if HAS_GZ:
                gov = gov + tl.load(gz_ptr + soffs, mask=smask2, other=0.)[None, :, :]
            dl = gov * p
        p = tl.where(live, p, 0.)
        dl = tl.where(live, dl, 0.)
        dr = tl.sum(tl.sum(dl * dots, axis=2), axis=1)  # dL/d(1 / RMS) per block (0 without a key norm)
        dl = dl * rinv[:, None, None]
        woffs = ((n * K + ok[:, None, None]) * S + os_[None, :, None]) * H + oh[None, None, :]
        tl.store(w_ptr + woffs, dl, mask=live & valid)
        shrink = dr * rinv * rinv * rinv / D  # the key norm's term: dv -= shrink * v
        for h in range(H):  # first to last (last to first, as the forward, spilled in fp32 at 248 registers)
            p_h = _head(p, oh, h)
            dl_h = _head(dl, oh, h)
            for c0 in range(0, C, BCH):
                offs = h * C + c0 + oc
                cmask = (c0 + oc < C) & valid
                qmask = smask[:, None] & cmask[None, :]
                f = folded_query(q_ptr, g_ptr, os_[:, None] * D + offs[None, :], qmask, go_ptr, NORM)
                go = tl.load(go_ptr + os_[:, None].to(tl.int64) * N * D + n * D + offs[None, :], mask=qmask,
                             other=0.)
                dv = dot32(p_h, go) + dot32(dl_h, f)
                tile = kmask[:, None] & cmask[None, :]
                if NORM:
                    v = tl.load(blocks[:, None] + n * D + offs[None, :], mask=tile, other=0.).to(tl.float32)
                    dv -= shrink[:, None] * v
                tl.store(block_grads[:, None] + n * D + offs[None, :], dv.to(go_ptr.dtype.element_ty), mask=tile)


@jit
def _phase1_bwd_rows_kernel(table, gtable, q_ptr, g_ptr, m_ptr, go_ptr, gz_ptr, w_ptr, p_ptr, K, N, S, D, C, H, eps,
                            TOK, BK: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, NORM: tl.constexpr,
                            SIGMOID: tl.constexpr, HAS_GZ: tl.constexpr, ONE_PASS: tl.constexpr = False):
    """_phase1_bwd_kernel where a token's whole block rows fit in registers (_rows_fit): the rows [BK, BH, BC] are
    read once, each query's output gradient and folded query twice (the second time from cache). Pass 1 over the
    queries finds the weights p and the logit gradients dl (times 1 / RMS: w_ptr [N, K, S, H], for
    _phase1_dq_kernel; p to the scratch p_ptr, alike) and the key norm's gradient; the block gradients start as the
    key norm's term, the rows' last use, and pass 2 adds p^T go + dl^T f query by query, p and dl read back. So
    the rows and their gradients are never live together: at 8 blocks of 2,048 channels both spilled on sm_100.
    ONE_PASS (where the rows and their gradients fit together, _one_pass: up to 4 blocks of 2,048 bf16 channels):
    pass 1 adds each query's p^T go + dl^T f to the gradients while its output gradient and folded query are loaded,
    and the key norm's term comes last: each query's rows are read once a token, where two passes read them twice
    (2 x S rows a token from L2, about twice the token's DRAM traffic at 6 queries), and p makes no round trip."""
    ok = tl.arange(0, BK)
    kmask = ok < K
    oh, offs, cmask = channel_block(C, H, BH, BC)  # [BH], [BH, BC], [BH, BC]
    hmask = oh < H
    live = kmask[:, None] & hmask[None, :]
    tile = kmask[:, None, None] & cmask[None, :, :]
    blocks = pointers_at(table, ok, kmask, go_ptr)
    block_grads = pointers_at(gtable, ok, kmask, go_ptr)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        v = tl.load(blocks[:, None, None] + n * D + offs[None, :, :], mask=tile & valid, other=0.).to(tl.float32)
        if NORM:
            rinv = tl.rsqrt(tl.sum(tl.sum(v * v, axis=2), axis=1) / D + eps)  # [BK]
        else:
            rinv = tl.full([BK], 1., tl.float32)
        dr = tl.zeros([BK], dtype=tl.float32)  # dL/d(1 / RMS) per block (0 without a key norm)
        if ONE_PASS:
            dv = tl.zeros([BK, BH, BC], dtype=tl.float32)
        # as the forward, with each query's output gradient row (from DRAM) in flight too; pass 2's loop so
        # pipelined spilled 32 bytes at 8 blocks (sm_90)
        for s in tl.range(S, num_stages=STREAM_STAGES):
            f = folded_query(q_ptr + s * D, g_ptr + s * D, offs, cmask, go_ptr, NORM)  # [BH, BC]
            go = tl.load(go_ptr + (s * N + n) * D + offs, mask=cmask & valid, other=0.).to(tl.float32)
            dots, gov = sums2(v * f[None, :, :], v * go[None, :, :], 2)  # [BK, BH] each, one exchange
            logit = dots * rinv[:, None]
            if SIGMOID:
                p = tl.sigmoid(logit)
                dl = gov * p * (1. - p)
            else:
                soffs = (s * N + n) * H + oh
                p = tl.exp(logit - tl.load(m_ptr + soffs, mask=hmask & valid, other=0.)[None, :])
                if HAS_GZ:
                    gov = gov + tl.load(gz_ptr + soffs, mask=hmask & valid, other=0.)[None, :]
                dl = gov * p
            p = tl.where(live, p, 0.)
            dl = tl.where(live, dl, 0.)
            dr += tl.sum(dl * dots, axis=1)
            woffs = ((n * K + ok[:, None]) * S + s) * H + oh[None, :]
            if ONE_PASS:
                tl.store(w_ptr + woffs, dl * rinv[:, None], mask=live & valid)
                dv += p[:, :, None] * go[None, :, :] + (dl * rinv[:, None])[:, :, None] * f[None, :, :]
            elif BK >= 4:  # each [BK, BH] store changes its layout (2 barriers a query): one store of both
                tl.store(tl.join(w_ptr + woffs, p_ptr + woffs), tl.join(dl * rinv[:, None], p),
                         mask=tl.join(live & valid, live & valid))
            else:  # stored as they lie (joined, they would take the layout change)
                tl.store(w_ptr + woffs, dl * rinv[:, None], mask=live & valid)
                tl.store(p_ptr + woffs, p, mask=live & valid)
        if ONE_PASS:
            if NORM:
                dv -= (dr * rinv * rinv * rinv / D)[:, None, None] * v  # the key norm's term
        else:
            if NORM:
                dv = -(dr * rinv * rinv * rinv / D)[:, None, None] * v  # the key norm's term
            else:
                dv = tl.zeros([BK, BH, BC], dtype=tl.float32)
            tl.debug_barrier()  # pass 2 reads p and dl in other threads than wrote them (global writes: visible after)
            for s in range(S):
                f = folded_query(q_ptr + s * D, g_ptr + s * D, offs, cmask, go_ptr, NORM)
                go = tl.load(go_ptr + (s * N + n) * D + offs, mask=cmask & valid, other=0.).to(tl.float32)
                woffs = ((n * K + ok[:, None]) * S + s) * H + oh[None, :]
                p = tl.load(p_ptr + woffs, mask=live & valid, other=0.)
                dl = tl.load(w_ptr + woffs, mask=live & valid, other=0.)
                dv += p[:, :, None] * go[None, :, :] + dl[:, :, None] * f[None, :, :]
        tl.store(block_grads[:, None, None] + n * D + offs[None, :, :], dv.to(go_ptr.dtype.element_ty),
                 mask=tile & valid)


@jit
def _phase1_dq_kernel(table, like_ptr, w_ptr, part_ptr, PW, K, N, S, D, C, H, TOK, BS: tl.constexpr,
                      BT: tl.constexpr, BCH: tl.constexpr):
    """dL/d(folded queries) [S, d] = sum over tokens and blocks of w[n, k, s, h] v_k[n, h-th channels]: one
    program per (head, channel chunk, token split), BT tokens a step as one dot [BS, BT] x [BT, BCH]; each token
    split's sum [S, d] is a row of part_ptr [splits, PW], which common.sum_rows reduces in order."""
    chunks = tl.cdiv(C, BCH)
    h = tl.program_id(0) // chunks
    c0 = (tl.program_id(0) % chunks) * BCH
    os_ = tl.arange(0, BS)
    oc = tl.arange(0, BCH)
    ot = tl.arange(0, BT)
    offs = h * C + c0 + oc
    cmask = c0 + oc < C
    first = tl.program_id(1).to(tl.int64) * TOK
    end = tl.minimum(first + TOK, N)
    acc = tl.zeros([BS, BCH], dtype=tl.float32)
    for k in range(K):
        block = pointer_at(table, k, like_ptr)
        for t0 in range(0, TOK, BT):
            n = first + t0 + ot
            tmask = n < end
            v = tl.load(block + n[:, None] * D + offs[None, :], mask=tmask[:, None] & cmask[None, :], other=0.)
            w = tl.load(w_ptr + ((n[None, :] * K + k) * S + os_[:, None]) * H + h,
                        mask=(os_ < S)[:, None] & tmask[None, :], other=0.)
            acc += dot32(w, v)
    tl.store(part_ptr + tl.program_id(1).to(tl.int64) * PW + os_[:, None] * D + offs[None, :], acc,
             mask=(os_ < S)[:, None] & cmask[None, :])


@jit
def _partial_logit(x_ptr, f, row, mask, D, eps, NORM: tl.constexpr):
    """(x, its dot with the folded query per head, its logit, 1 / RMS(x) or 0) of the partial sum's row."""
    x = tl.load(x_ptr + row, mask=mask, other=0.).to(tl.float32)
    r = 0.
    if NORM:
        dot, squares = sums2(x * f, x * x, 1)  # [BH] each, one exchange
        r = tl.rsqrt(tl.sum(squares, axis=0) / D + eps)
        l = dot * r
    else:
        dot = tl.sum(x * f, axis=1)
        l = dot
    return x, dot, l, r


@jit
def _phase2_fwd_kernel(m_ptr, z_ptr, o_ptr, x_ptr, q_ptr, g_ptr, w_ptr, out_ptr, rstd_ptr, N, D, C, H, eps, norm_eps,
                       TOK, BH: tl.constexpr, BC: tl.constexpr, HAS_PARTIAL: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr, NORMED: tl.constexpr):
    """The merge of each token's row; NORMED: the host's RMSNorm of it (common.rms_normed, weight w_ptr [d]) instead,
    with its 1 / RMS into rstd_ptr [N] (fp32): the merged row itself never leaves the registers."""
    pid = tl.program_id(0)
    oh, offs, cmask = channel_block(C, H, BH, BC)
    hmask = oh < H
    if HAS_PARTIAL:
        f = folded_query(q_ptr, g_ptr, offs, cmask, x_ptr, NORM)
    if NORMED:
        w = tl.load(w_ptr + offs, mask=cmask, other=0.).to(tl.float32)
    for t in range(TOK):
        n = token(pid, t, TOK)
        mask = cmask & (n < N)
        row = n * D + offs
        o = tl.load(o_ptr + row, mask=mask, other=0.).to(tl.float32)
        if HAS_PARTIAL:
            x, _, l, _ = _partial_logit(x_ptr, f, row, mask, D, eps, NORM)
            if SIGMOID:
                out = o + tl.sigmoid(l)[:, None] * x
            else:
                m = tl.load(m_ptr + n * H + oh, mask=hmask & (n < N), other=0.)
                z = tl.load(z_ptr + n * H + oh, mask=hmask & (n < N), other=1.)
                m_new = tl.maximum(m, l)
                a = tl.exp(m - m_new)
                b = tl.exp(l - m_new)
                out = (o * a[:, None] + x * b[:, None]) / (z * a + b)[:, None]
        elif SIGMOID:  # (NORMED only: the merge alone is o itself, which the host returns)
            out = o
        else:
            z = tl.load(z_ptr + n * H + oh, mask=hmask & (n < N), other=1.)
            out = o / z[:, None]
        if NORMED:
            out, rstd = rms_normed(out, w, D, norm_eps, o_ptr)
            tl.store(rstd_ptr + n, rstd, mask=n < N)
        tl.store(out_ptr + row, out.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _phase2_bwd_kernel(m_ptr, z_ptr, o_ptr, x_ptr, q_ptr, g_ptr, go_ptr, w_ptr, rstd_ptr, dm_ptr, dz_ptr, do_ptr,
                       dx_ptr, part_ptr, wpart_ptr, PW, N, D, C, H, eps, TOK, BH: tl.constexpr, BC: tl.constexpr,
                       HAS_PARTIAL: tl.constexpr, NORM: tl.constexpr, SIGMOID: tl.constexpr, NORMED: tl.constexpr):
    """With a = exp(m - M), b = exp(l - M), den = z a + b (M = max(m, l), a constant) and A = a / den,
    B = b / den: out = o A + x B, so do = go A, dx = go B (+ the logit's path), dz = -A (go . out),
    dm = A (go . (o - z out)), dl = B (go . (x - out)) per head. Sigmoid: do = go (left to the host, but where
    NORMED makes go here). The folded query's gradient over the program's tokens goes to its row of part_ptr
    [programs, PW] (common.sum_rows). NORMED: go_ptr holds the gradient of the host norm's output, and go is the
    norm's backward at the merged row, made again here (common.rms_norm_grad, 1 / RMS from rstd_ptr); the norm weight's
    gradient over the program's tokens goes to its row of wpart_ptr [programs, PW]."""
    pid = tl.program_id(0)
    oh, offs, cmask = channel_block(C, H, BH, BC)
    hmask = oh < H
    if HAS_PARTIAL:
        f = folded_query(q_ptr, g_ptr, offs, cmask, x_ptr, NORM)
    if NORMED:
        w = tl.load(w_ptr + offs, mask=cmask, other=0.).to(tl.float32)
        wtotal = tl.zeros([BH, BC], dtype=tl.float32)
    total = tl.zeros([BH, BC], dtype=tl.float32)
    # the next tokens' rows in flight while one is reduced (STREAM_STAGES): each token's three exchanges left the
    # loads of a program's 4-8 tokens one after another (the 1B step's normed merge: 89 us a call, 45 % of copy)
    for t in tl.range(TOK, num_stages=STREAM_STAGES):
        n = token(pid, t, TOK)
        mask = cmask & (n < N)
        hm = hmask & (n < N)
        row = n * D + offs
        # the forward's merge again, as far as the gradient needs it (all of it where the norm's backward reads it)
        if NORMED or not SIGMOID:
            o = tl.load(o_ptr + row, mask=mask, other=0.).to(tl.float32)
        if not SIGMOID:
            z = tl.load(z_ptr + n * H + oh, mask=hm, other=1.)
        if HAS_PARTIAL:
            x, dot, l, r = _partial_logit(x_ptr, f, row, mask, D, eps, NORM)
            if SIGMOID:
                sg = tl.sigmoid(l)
                if NORMED:
                    out = o + sg[:, None] * x
            else:
                m = tl.load(m_ptr + n * H + oh, mask=hm, other=0.)
                m_new = tl.maximum(m, l)
                a = tl.exp(m - m_new)
                b = tl.exp(l - m_new)
                den = z * a + b
                aa = a / den
                bb = b / den
                out = o * aa[:, None] + x * bb[:, None]
        elif SIGMOID:
            out = o
        else:
            out = o / z[:, None]
        dy = tl.load(go_ptr + row, mask=mask, other=0.).to(tl.float32)
        if NORMED:
            go, dw = rms_norm_grad(out, dy, w, tl.load(rstd_ptr + n, mask=n < N, other=0.), D, o_ptr)
            wtotal += dw
        else:
            go = dy
        if HAS_PARTIAL:
            if SIGMOID:
                if NORMED:
                    tl.store(do_ptr + row, go.to(o_ptr.dtype.element_ty), mask=mask)
                dx = go * sg[:, None]
                dl = tl.sum(go * x, axis=1) * sg * (1. - sg)
            else:
                tl.store(do_ptr + row, (go * aa[:, None]).to(o_ptr.dtype.element_ty), mask=mask)
                go_out, go_rest, go_x = sums3(go * out, go * (o - z[:, None] * out), go * (x - out), 1)  # [BH] each
                tl.store(dz_ptr + n * H + oh, -aa * go_out, mask=hm)
                tl.store(dm_ptr + n * H + oh, aa * go_rest, mask=hm)
                dx = go * bb[:, None]
                dl = bb * go_x
            if NORM:
                dr = tl.sum(dl * dot, axis=0)
                dl = dl * r
                dx += dl[:, None] * f - (dr * r * r * r / D) * x
            else:
                dx += dl[:, None] * f
            total += dl[:, None] * x
            tl.store(dx_ptr + row, dx.to(x_ptr.dtype.element_ty), mask=mask)
        elif SIGMOID:  # out = o (NORMED only: without it there is nothing to run)
            tl.store(do_ptr + row, go.to(o_ptr.dtype.element_ty), mask=mask)
        else:  # softmax without a partial: out = o / z
            tl.store(do_ptr + row, (go / z[:, None]).to(o_ptr.dtype.element_ty), mask=mask)
            tl.store(dz_ptr + n * H + oh, -tl.sum(go * o, axis=1) / (z * z), mask=hm)
    if HAS_PARTIAL:
        tl.store(part_ptr + pid.to(tl.int64) * PW + offs, total, mask=cmask)
    if NORMED:
        tl.store(wpart_ptr + pid.to(tl.int64) * PW + offs, wtotal, mask=cmask)


def _dq_tiles(bs: int, element_size: int) -> Tuple[int, int]:
    """(tokens a step, warps) of the queries' gradient: a [BT, chunk] tile of a block's rows per load, 16 bytes a
    thread. 32 tokens on 8 warps; past 16 queries a block the [BS, 32] weights spill at the default 128 registers
    (sm_100), so 16 tokens, on 4 warps in 16-bit (8 in fp32, whose 16 bytes are 4 values)."""
    if bs <= 16:
        return 32, 8
    return 16, 4 if element_size == 2 else 8


def _phase1_warps(bs: int) -> int:
    """Warps of a phase-1 program: 4 (16-byte loads of a [16, 64] tile, 3 blocks an SM at the 1B size), 8 past 16
    queries a block, where 4 spill in fp32 (compiled for sm_80 / sm_90 / sm_100: tests/unit/test_kernels_aot.py)."""
    return 4 if bs <= 16 else 8


def _phase1_resident(x: Tensor) -> int:
    """The resident warps the phase-1 kernels' register cap aims at (common.options): the default (4 blocks of 4
    warps, 128 registers) for 16-bit rows; fp32 tiles take the whole register file of one block (up to 248
    registers), where a cap of 128 spills (compiled for sm_80 / sm_90 / sm_100: tests/unit/test_kernels_aot.py)."""
    return RESIDENT_WARPS if x.element_size() == 2 else 1


ROWS_IN_REGISTERS = 32768  # fp32 values of a program's whole-row tiles (64 a thread at 16 warps): _rows_fit


def _rows_fit(k: int, d: int, heads: int, backward: bool = False, element_size: int = 2) -> bool:
    """Whether a token's k block rows, with a query row and an output (gradient) row, fit one program's registers
    (the 1B config's Block AttnRes up to 8 blocks, the 7B's up to 4 in backward and 8 in forward;
    tests/unit/test_kernels_aot.py compiles them without a spill): then phase 1 reads each row once
    (_phase1_fwd_rows_kernel, _phase1_bwd_rows_kernel), else a chunk at a time."""
    return _rows_live(k, backward, element_size) * pow2(heads) * pow2(d // heads) <= ROWS_IN_REGISTERS


def _rows_live(k: int, backward: bool, element_size: int = 2, one_pass: bool = False) -> int:
    """The rows a whole-row phase-1 program holds: the blocks (or, later in backward, their gradients), a query and
    an output (gradient). fp32 rows in backward count twice: at 8 blocks ptxas spilled 16-44 bytes there (sm_90),
    where 16-bit rows fit. one_pass: the backward holds the blocks and their gradients together."""
    return pow2(k) * (2 if backward and (element_size > 2 or one_pass) else 1) + 2


ONE_PASS_VALUES = 80  # fp32 values of rows a thread of a one-pass backward holds at most (_one_pass)


def _one_pass(k: int, d: int, heads: int, element_size: int) -> bool:
    """Whether the whole-row backward holds a token's block rows and their gradients together (ONE_PASS: each
    query's output gradient and folded query read once a token, not twice): 16-bit rows where the blocks, their
    gradients, a query and an output gradient come to ONE_PASS_VALUES a thread or fewer on the program's warps (the
    125M, 1B and 7B configs' Block AttnRes up to 4 blocks, 128 registers and no spill on sm_80 / sm_90 / sm_100:
    tests/unit/test_kernels_aot.py; at 8 blocks, 144 values a thread, the 125M program spilled 404-484 bytes).
    fp32 rows held twice spilled already with two passes."""
    if element_size != 2:
        return False
    row = pow2(heads) * pow2(d // heads)
    num_warps, _ = _rows_warps(k, row, True, element_size, True)
    return _rows_live(k, True, element_size, True) * row <= ONE_PASS_VALUES * 32 * num_warps


def _rows_warps(k: int, row: int, backward: bool = False, element_size: int = 2,
                one_pass: bool = False) -> Tuple[int, int]:
    """(warps, resident warps) of a whole-row phase-1 program: about 32 values a thread, but no more warps than a row
    has 16-byte pieces for (common.row_warps: the blocks' axis then lies in each thread, and the forward's max, sum
    and weighted sum over blocks need no exchange; at 8 blocks, 1B: 18 barriers on 16 warps, 5 on 8), except for
    fp32 rows in backward, which spilled there (16 bytes, 125M); where the values are 24 a thread or fewer, a
    64-register cap keeps two 16-warp programs an SM (the 1B config's forward at 4 blocks: 64 registers, no spill,
    for sm_90; 72 and one program an SM left to ptxas)."""
    live = _rows_live(k, backward, element_size, one_pass)
    num_warps = warps(row, live)
    if not (backward and element_size > 2):
        num_warps = min(num_warps, row_warps(row, element_size))
    return num_warps, 2 * RESIDENT_WARPS if live * row <= 24 * 32 * num_warps else RESIDENT_WARPS


def _phase1_blocks(srcs: List[Tensor], s: int, heads: int):
    """Block dims of the phase-1 kernels: (BK, BS, BCH) for K blocks, S queries and a head's channels (compiled, at
    least 16 each: the dots' smallest tile)."""
    c = srcs[0].shape[1] // heads
    return dot_dim(len(srcs)), dot_dim(s), dot_dim(chunk(c, 16))  # 64 channels (a [16, 64] tile) when compiled


def _triton_phase1_fwd(srcs: List[Tensor], q: Tensor, g: Optional[Tensor], eps: float, sigmoid: bool, heads: int):
    """-> m [S, N, H] fp32, z [S, N, H] fp32, o [S, N, d] in the source dtype."""
    (n, d), s = srcs[0].shape, q.shape[0]
    o = torch.empty((s, n, d), dtype=srcs[0].dtype, device=srcs[0].device)
    m = (torch.zeros if sigmoid else torch.empty)((s, n, heads), dtype=F32, device=o.device)  # sigmoid: m = 0
    z = (torch.ones if sigmoid else torch.empty)((s, n, heads), dtype=F32, device=o.device)  # and z = 1
    if n == 0:
        return m, z, o
    count, tok = programs(n, o.device, reduces=False)
    if _rows_fit(len(srcs), d, heads):
        bh, bc = pow2(heads), pow2(d // heads)
        num_warps, resident = _rows_warps(len(srcs), bh * bc, False, o.element_size())
        launch(_phase1_fwd_rows_kernel, (count,), (pointer_table(srcs), q, q if g is None else g, m, z, o, len(srcs),
                                                   n, s, d, d // heads, heads, eps, tok),
               num_warps, resident_warps=resident, BK=pow2(len(srcs)), BH=bh, BC=bc, NORM=g is not None,
               SIGMOID=sigmoid)
        return m, z, o
    bk, bs, bch = _phase1_blocks(srcs, s, heads)
    launch(_phase1_fwd_kernel, (count,), (pointer_table(srcs), q, q if g is None else g, m, z, o, len(srcs), n, s,
                                          d, d // heads, heads, eps, tok),
           _phase1_warps(bs), resident_warps=_phase1_resident(o), BK=bk, BS=bs, BH=pow2(heads), BCH=bch,
           NORM=g is not None, SIGMOID=sigmoid)
    return m, z, o


def _triton_phase1_bwd(go: Tensor, gz: Optional[Tensor], m: Tensor, srcs: List[Tensor], q: Tensor,
                       g: Optional[Tensor], eps: float, sigmoid: bool, heads: int):
    """-> (block gradients, dq [S, d], dg [S, d] or None), in the parameters' dtypes."""
    (n, d), s = srcs[0].shape, q.shape[0]
    grads = [torch.empty_like(x) for x in srcs]
    if n == 0:  # no token: no gradient
        df = torch.zeros((s, d), dtype=F32, device=go.device)
        return grads, df, None if g is None else torch.zeros_like(df)
    bk, bs, bch = _phase1_blocks(srcs, s, heads)
    w = torch.empty((n, len(srcs), s, heads), dtype=F32, device=go.device)  # the logits' gradients
    table = pointer_table(srcs)
    count, tok = programs(n, go.device, reduces=False)
    args = (table, pointer_table(grads), q, q if g is None else g, m, go, m if gz is None else gz, w, len(srcs), n,
            s, d, d // heads, heads, eps, tok)
    if _rows_fit(len(srcs), d, heads, True, go.element_size()):
        bh, bc = pow2(heads), pow2(d // heads)
        one_pass = _one_pass(len(srcs), d, heads, go.element_size())
        num_warps, resident = _rows_warps(len(srcs), bh * bc, True, go.element_size(), one_pass)
        weights = w if one_pass else torch.empty_like(w)  # pass 1's p, for pass 2
        once = {"ONE_PASS": True} if one_pass else {}  # (the key of a launch without it, as tuned.json has)
        launch(_phase1_bwd_rows_kernel, (count,), (*args[:8], weights, *args[8:]), num_warps, resident_warps=resident,
               BK=pow2(len(srcs)), BH=bh, BC=bc, NORM=g is not None, SIGMOID=sigmoid, HAS_GZ=gz is not None, **once)
    else:
        launch(_phase1_bwd_kernel, (count,), args, _phase1_warps(bs), resident_warps=_phase1_resident(go), BK=bk,
               BS=bs, BH=pow2(heads), BCH=bch, NORM=g is not None, SIGMOID=sigmoid, HAS_GZ=gz is not None)
    chunks = cdiv(d // heads, bch)
    splits, tok = reduction_grid(n, heads * chunks, go.device)
    bt, dq_warps = _dq_tiles(bs, go.element_size())
    parts = partial_sums(splits, s * d, go.device)  # a token split's sums
    launch(_phase1_dq_kernel, (heads * chunks, splits), (table, srcs[0], w, parts, parts.shape[1], len(srcs), n,
                                                         s, d, d // heads, heads, tok),
           dq_warps, BS=bs, BT=bt, BCH=bch)
    if g is None:
        return grads, sum_rows(parts, s * d, dtypes=[q.dtype]).view(s, d), None
    # folded = gain * query: the sum times each other factor, in the parameters' dtypes
    dq, dg = sum_rows(parts, s * d, (g, q), (q.dtype, g.dtype))
    return grads, dq.view(s, d), dg.view(s, d)


def _triton_phase2_fwd(m: Tensor, z: Tensor, o: Tensor, x: Optional[Tensor], q: Tensor, g: Optional[Tensor],
                       eps: float, sigmoid: bool, heads: int, w: Optional[Tensor] = None, norm_eps: float = 0.):
    """-> (the merge [N, d], None); with the norm weight w: (its RMSNorm [N, d], 1 / RMS [N] fp32)."""
    n, d = o.shape
    out = torch.empty_like(o)
    rstd = torch.empty(n, dtype=F32, device=o.device) if w is not None else None
    if n == 0:
        return out, rstd
    bh, bc = pow2(heads), pow2(d // heads)
    count, tok = programs(n, o.device, reduces=False)
    launch(_phase2_fwd_kernel, (count,), (m, z, o, o if x is None else x, q, q if g is None else g,
                                          o if w is None else w, out, m if rstd is None else rstd, n, d, d // heads,
                                          heads, eps, norm_eps, tok),
           warps(bh * bc, 4), BH=bh, BC=bc, HAS_PARTIAL=x is not None, NORM=g is not None, SIGMOID=sigmoid,
           NORMED=w is not None)
    return out, rstd


def _triton_phase2_bwd(go: Tensor, m: Tensor, z: Tensor, o: Tensor, x: Optional[Tensor], q: Tensor,
                       g: Optional[Tensor], eps: float, sigmoid: bool, heads: int, w: Optional[Tensor] = None,
                       rstd: Optional[Tensor] = None, do_into: Optional[Tensor] = None):
    """-> (dm, dz, do, dx, dq, dg, dw): dm/dz fp32 [N, H] or None (sigmoid), do None with sigmoid and no norm (it
    is go), dq/dg None without a partial, else in the parameters' dtypes; with the norm weight w (go is then the
    norm's output gradient), its gradient dw in w's dtype, else None. do_into [N, d] (contiguous): where do is
    written (a slot of phase 1's output gradient, grad_sink.Slices)."""
    n, d = o.shape
    dev = go.device
    normed = w is not None
    # every token's dm and dz are stored (no fill)
    dm = torch.empty_like(m, dtype=F32) if x is not None and not sigmoid else None
    dz = torch.empty_like(z, dtype=F32) if not sigmoid else None
    do = (torch.empty_like(o) if do_into is None else do_into) if normed or not sigmoid else None
    dx = torch.empty_like(x) if x is not None else None
    dq = dg = dw = None
    if n == 0:  # no token: no gradient (zeros of their own: an op's outputs may not alias one another)
        def zero():
            return torch.zeros(d, dtype=F32, device=dev)
        if x is not None:
            dq, dg = zero(), None if g is None else zero()
        return dm, dz, do, dx, dq, dg, zero().to(w.dtype) if normed else None
    if not (x is not None or not sigmoid or normed):
        return dm, dz, do, dx, dq, dg, dw
    bh, bc = pow2(heads), pow2(d // heads)
    count, tok = programs(n, dev, reduces=x is not None or normed)
    # the folded query's and the norm weight's gradients a program; with both, side by side in one row ([the
    # query's, the weight's], each pw wide), which one sum_rows launch reduces
    pw = partial_width(d)
    if x is not None and normed:
        parts = partial_sums(count, 2 * pw, dev)
        wparts = parts[:, pw:]
    else:
        parts = partial_sums(count, d, dev) if x is not None else go
        wparts = partial_sums(count, d, dev) if normed else go
    stride = parts.stride(0) if x is not None else wparts.stride(0)
    launch(_phase2_bwd_kernel, (count,), (m, z, o, o if x is None else x, q, q if g is None else g, go,
                                          o if w is None else w, m if rstd is None else rstd,
                                          go if dm is None else dm, go if dz is None else dz,
                                          go if do is None else do, go if dx is None else dx, parts, wparts,
                                          stride, n, d, d // heads, heads, eps, tok),
           warps(bh * bc, 4), BH=bh, BC=bc, HAS_PARTIAL=x is not None, NORM=g is not None, SIGMOID=sigmoid,
           NORMED=normed)
    # folded = gain * query: the sum times each other factor, in the parameters' dtypes
    scales, dtypes = ((), [q.dtype]) if g is None else ((g, q), (q.dtype, g.dtype))
    if x is not None and normed:
        folded, dw = sum_rows(parts, d, scales, dtypes, tail=(pw, d, w.dtype))
    elif x is not None:
        folded = sum_rows(parts, d, scales, dtypes)
    else:
        folded = None
        if normed:
            dw = sum_rows(wparts, d, dtypes=[w.dtype])
    if folded is not None:
        dq, dg = (folded, None) if g is None else folded
    return dm, dz, do, dx, dq, dg, dw


# --------------------------------------------------------------------------------------------------------------
# The torch twins
# --------------------------------------------------------------------------------------------------------------


def _torch_phase1_fwd(srcs, q, g, eps, sigmoid, heads):
    (n, d), dt, s_ = srcs[0].shape, srcs[0].dtype, q.shape[0]
    ct, c = accumulation_dtype(dt), d // heads
    f = folded_query_torch(q, g, dt, ct).view(s_, 1, heads, c)
    acc, m, z = accumulate(srcs, f, (1, n, heads, c), (s_, n, heads, c), ct, g, eps, sigmoid)
    if sigmoid:
        m, z = torch.zeros_like(m), torch.ones_like(z)
    return m.to(ct), z.to(ct), acc.view(s_, n, d).to(dt)


def _torch_phase1_bwd(go, gz, m, srcs, q, g, eps, sigmoid, heads):
    (n, d), dt, s_ = srcs[0].shape, srcs[0].dtype, q.shape[0]
    ct, c = accumulation_dtype(dt), d // heads
    f = folded_query_torch(q, g, dt, ct).view(s_, 1, heads, c)
    go = go.to(ct).view(s_, n, heads, c)
    df = torch.zeros(s_, n, heads, c, dtype=ct, device=go.device)
    grads = []
    for src in srcs:  # one pass: m is a constant, so every block's weight is local to it
        v = src.to(ct).view(1, n, heads, c)
        dot = (v * f).sum(-1)
        logit = dot
        if g is not None:
            r = rms_inverse_torch(v, eps)  # [1, N]
            logit = dot * r.unsqueeze(-1)
        gov = (go * v).sum(-1)
        if sigmoid:
            p = torch.sigmoid(logit)
            dl = gov * p * (1 - p)
        else:
            p = torch.exp(logit - m.to(ct))
            dl = (gov if gz is None else gov + gz.to(ct)) * p
        dv = (p.unsqueeze(-1) * go).sum(0)
        if g is not None:
            dr = (dl * dot).sum((0, 2))  # [N]
            dl = dl * r.unsqueeze(-1)
            dv = dv - (dr * r[0].pow(3) / d).view(n, 1, 1) * v[0]
        dv = dv + (dl.unsqueeze(-1) * f).sum(0)
        df += dl.unsqueeze(-1) * v
        grads.append(dv.view(n, d).to(dt))
    df = df.sum(1).view(s_, d)
    if g is None:
        return grads, df, None
    return grads, df * g.to(ct), df * q.to(ct)


def _phase2_logit(x, q, g, eps, heads):
    n, d = x.shape
    ct = accumulation_dtype(x.dtype)
    f = folded_query_torch(q, g, x.dtype, ct).view(heads, d // heads)
    xv = x.to(ct).view(n, heads, d // heads)
    dot = (xv * f).sum(-1)
    r = rms_inverse_torch(xv, eps) if g is not None else None
    return xv, f, dot, (dot if r is None else dot * r.unsqueeze(-1)), r


def _torch_merge(m, z, o, x, q, g, eps, sigmoid, heads):
    n, d = o.shape
    ct = accumulation_dtype(o.dtype)
    ov = o.to(ct).view(n, heads, d // heads)
    if x is None:
        return o if sigmoid else (ov / z.to(ct).unsqueeze(-1)).view(n, d).to(o.dtype)
    xv, _, _, logit, _ = _phase2_logit(x, q, g, eps, heads)
    if sigmoid:
        out = ov + torch.sigmoid(logit).unsqueeze(-1) * xv
    else:
        m, z = m.to(ct), z.to(ct)
        m_new = torch.maximum(m, logit)
        a, b = torch.exp(m - m_new), torch.exp(logit - m_new)
        out = (ov * a.unsqueeze(-1) + xv * b.unsqueeze(-1)) / (z * a + b).unsqueeze(-1)
    return out.view(n, d).to(o.dtype)


def _torch_merge_bwd(go, m, z, o, x, q, g, eps, sigmoid, heads):
    n, d = o.shape
    ct, c = accumulation_dtype(o.dtype), d // heads
    gov = go.to(ct).view(n, heads, c)
    ov = o.to(ct).view(n, heads, c)
    if x is None:  # softmax: out = o / z
        zz = z.to(ct)
        return None, -(gov * ov).sum(-1) / zz.pow(2), (gov / zz.unsqueeze(-1)).view(n, d).to(o.dtype), \
            None, None, None
    xv, f, dot, logit, r = _phase2_logit(x, q, g, eps, heads)
    if sigmoid:
        sg = torch.sigmoid(logit)
        dm = dz = do = None
        dx = gov * sg.unsqueeze(-1)
        dl = (gov * xv).sum(-1) * sg * (1 - sg)
    else:
        m, z = m.to(ct), z.to(ct)
        m_new = torch.maximum(m, logit)
        a, b = torch.exp(m - m_new), torch.exp(logit - m_new)
        den = z * a + b
        aa, bb = a / den, b / den
        out = ov * aa.unsqueeze(-1) + xv * bb.unsqueeze(-1)
        do = (gov * aa.unsqueeze(-1)).view(n, d).to(o.dtype)
        dz = -aa * (gov * out).sum(-1)
        dm = aa * (gov * (ov - z.unsqueeze(-1) * out)).sum(-1)
        dx = gov * bb.unsqueeze(-1)
        dl = bb * (gov * (xv - out)).sum(-1)
    if r is not None:
        dr = (dl * dot).sum(-1)
        dl = dl * r.unsqueeze(-1)
        dx = dx - (dr * r.pow(3) / d).view(n, 1, 1) * xv
    dx = dx + dl.unsqueeze(-1) * f
    df = (dl.unsqueeze(-1) * xv).sum(0).view(d)
    dq, dg = (df, None) if g is None else (df * g.to(ct), df * q.to(ct))
    return dm, dz, do, dx.view(n, d).to(x.dtype), dq, dg


def _torch_phase2_fwd(m, z, o, x, q, g, eps, sigmoid, heads, w=None, norm_eps=0.):
    out = _torch_merge(m, z, o, x, q, g, eps, sigmoid, heads)
    return (out, None) if w is None else rms_normed_torch(out, w, norm_eps)


def _torch_phase2_bwd(go, m, z, o, x, q, g, eps, sigmoid, heads, w=None, rstd=None, do_into=None):
    grads = _torch_phase2_grads(go, m, z, o, x, q, g, eps, sigmoid, heads, w, rstd)
    if do_into is None or grads[2] is None:
        return grads
    do_into.copy_(grads[2])
    return (*grads[:2], do_into, *grads[3:])


def _torch_phase2_grads(go, m, z, o, x, q, g, eps, sigmoid, heads, w, rstd):
    if w is None:
        return (*_torch_merge_bwd(go, m, z, o, x, q, g, eps, sigmoid, heads), None)
    go, dw = rms_norm_grad_torch(_torch_merge(m, z, o, x, q, g, eps, sigmoid, heads), go, w, rstd)
    if x is None and sigmoid:  # out = o
        return None, None, go.to(o.dtype), None, None, None, dw
    dm, dz, do, dx, dq, dg = _torch_merge_bwd(go, m, z, o, x, q, g, eps, sigmoid, heads)
    return dm, dz, go.to(o.dtype) if sigmoid else do, dx, dq, dg, dw


# --------------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mega_depth::attnres_phase1", mutates_args=())
def phase1_op(completed: List[Tensor], queries: Tensor, key_norm_weights: Optional[Tensor], eps: float,
              sigmoid: bool, heads: int) -> List[Tensor]:
    """n blocks [*, d]; queries / key_norm_weights [S, d] -> [m [S, *, H] fp32, z [S, *, H] fp32, o [S, *, d]]."""
    lead, d = completed[0].shape[:-1], completed[0].shape[-1]
    srcs = source_rows(completed, d)
    fwd = _triton_phase1_fwd if uses_triton(srcs[0]) else _torch_phase1_fwd
    m, z, o = fwd(srcs, queries.contiguous(), contiguous(key_norm_weights), eps, sigmoid, heads)
    s = queries.shape[0]
    return [m.view(s, *lead, heads), z.view(s, *lead, heads), o.view(s, *lead, d)]


@register_fake(phase1_op)
def _(completed, queries, key_norm_weights, eps, sigmoid, heads):
    s, lead, ct = queries.shape[0], completed[0].shape[:-1], accumulation_dtype(completed[0].dtype)
    new = completed[0].new_empty
    return [new((s, *lead, heads), dtype=ct), new((s, *lead, heads), dtype=ct), new((s, *completed[0].shape))]


@torch.library.custom_op("mega_depth::attnres_phase1_backward", mutates_args=())
def phase1_backward_op(go: Tensor, gz: Optional[Tensor], m: Tensor, completed: List[Tensor], queries: Tensor,
                       key_norm_weights: Optional[Tensor], eps: float, sigmoid: bool, heads: int) -> List[Tensor]:
    """-> [block gradients..., dq [S, d], dg [S, d] (or empty)], in the queries' and gains' dtypes."""
    d, s = completed[0].shape[-1], queries.shape[0]
    srcs = source_rows(completed, d)
    bwd = _triton_phase1_bwd if uses_triton(srcs[0]) else _torch_phase1_bwd
    gz = None if gz is None else gz.reshape(s, -1, heads).to(m.dtype).contiguous()
    grads, dq, dg = bwd(go.reshape(s, -1, d).contiguous(), gz, m.reshape(s, -1, heads), srcs, queries.contiguous(),
                        contiguous(key_norm_weights), eps, sigmoid, heads)
    return ([gr.view_as(b) for gr, b in zip(grads, completed)]
            + [in_dtype(dq, queries.dtype), nothing(go) if dg is None else in_dtype(dg, key_norm_weights.dtype)])


@register_fake(phase1_backward_op)
def _(go, gz, m, completed, queries, key_norm_weights, eps, sigmoid, heads):
    dg = key_norm_weights.new_empty(key_norm_weights.shape) if key_norm_weights is not None else nothing(go)
    return [b.new_empty(b.shape) for b in completed] + [queries.new_empty(queries.shape), dg]


def _phase1_setup(ctx, inputs, output):
    completed, queries, gains, eps, sigmoid, heads = inputs
    m, z, _ = output
    ctx.save_for_backward(queries, gains, None if sigmoid else m, *completed)
    ctx.cfg = (eps, sigmoid, heads)
    ctx.set_materialize_grads(False)


def _phase1_backward(ctx, grads):
    queries, gains, m, *completed = ctx.saved_tensors
    eps, sigmoid, heads = ctx.cfg
    _, gz, go = grads
    need = ctx.needs_input_grad
    if go is None and (gz is None or sigmoid):
        return [None] * len(completed), None, None, None, None, None
    if go is None:
        go = completed[0].new_zeros((queries.shape[0], *completed[0].shape))
    out = call(phase1_backward_op, go, None if sigmoid else gz, completed[0].new_zeros(0) if m is None else m,
                             completed, queries, gains, eps, sigmoid, heads)
    return (list(out[:-2]), cast_grad(out[-2], queries, need[1]), cast_grad(out[-1], gains, need[2]), None, None,
            None)


autograd(phase1_op, _phase1_backward, _phase1_setup)


@torch.library.custom_op("mega_depth::attnres_phase2", mutates_args=())
def phase2_op(m: Tensor, z: Tensor, o: Tensor, partial: Optional[Tensor], query: Tensor,
              key_norm_weight: Optional[Tensor], norm_weight: Optional[Tensor], eps: float, norm_eps: float,
              sigmoid: bool, heads: int) -> List[Tensor]:
    """m, z [*, H]; o and partial [*, d] -> [the merge [*, d], nothing]; with norm_weight [d], [the host's RMSNorm
    of the merge [*, d], 1 / RMS [*] (fp32)]."""
    d = o.shape[-1]
    ro = rows(o, d)
    fwd = _triton_phase2_fwd if uses_triton(ro) else _torch_phase2_fwd
    x = rows(partial, d) if partial is not None else None
    ct = accumulation_dtype(o.dtype)
    out, rstd = fwd(in_dtype(rows(m, heads), ct), in_dtype(rows(z, heads), ct), ro, x, query.contiguous(),
                    contiguous(key_norm_weight), eps, sigmoid, heads, contiguous(norm_weight), norm_eps)
    if o.dim() == 2:  # (already its shape: a view is host time)
        return [out, nothing(o) if rstd is None else rstd]
    return [out.view_as(o), nothing(o) if rstd is None else rstd.view(*o.shape[:-1])]


@register_fake(phase2_op)
def _(m, z, o, partial, query, key_norm_weight, norm_weight, eps, norm_eps, sigmoid, heads):
    rstd = nothing(o) if norm_weight is None else o.new_empty(o.shape[:-1], dtype=accumulation_dtype(o.dtype))
    return [o.new_empty(o.shape), rstd]


@torch.library.custom_op("mega_depth::attnres_phase2_backward", mutates_args=())
def phase2_backward_op(grad: Tensor, m: Tensor, z: Tensor, o: Tensor, partial: Optional[Tensor], query: Tensor,
                       key_norm_weight: Optional[Tensor], norm_weight: Optional[Tensor], rstd: Optional[Tensor],
                       eps: float, sigmoid: bool, heads: int) -> List[Tensor]:
    """-> [dm, dz, do, dx, dq, dg, dw]; empty where there is no gradient (do with sigmoid weights and no norm: it is
    grad). With norm_weight, grad is the norm's output gradient and rstd its forward's 1 / RMS."""
    return _phase2_backward_into(grad, m, z, o, partial, query, key_norm_weight, norm_weight, rstd, eps, sigmoid,
                                 heads, None)


@torch.library.custom_op("mega_depth::attnres_phase2_backward_into", mutates_args=("do_into",))
def phase2_backward_into_op(grad: Tensor, m: Tensor, z: Tensor, o: Tensor, partial: Optional[Tensor], query: Tensor,
                            key_norm_weight: Optional[Tensor], norm_weight: Optional[Tensor], rstd: Optional[Tensor],
                            do_into: Tensor, eps: float, sigmoid: bool, heads: int) -> List[Tensor]:
    """phase2_backward_op with o's gradient written into do_into (o's shape, contiguous: its slot in phase 1's
    output gradient, grad_sink.Slices); its place in the list is empty."""
    out = _phase2_backward_into(grad, m, z, o, partial, query, key_norm_weight, norm_weight, rstd, eps, sigmoid,
                                heads, do_into)
    out[2] = nothing(grad)
    return out


@register_fake(phase2_backward_into_op)
def _(grad, m, z, o, partial, query, key_norm_weight, norm_weight, rstd, do_into, eps, sigmoid, heads):
    out = _fake_phase2_backward(grad, m, z, o, partial, query, key_norm_weight, norm_weight, rstd, eps, sigmoid,
                                heads)
    out[2] = nothing(o)
    return out


def _phase2_backward_into(grad, m, z, o, partial, query, key_norm_weight, norm_weight, rstd, eps, sigmoid, heads,
                          do_into) -> List[Tensor]:
    d = o.shape[-1]
    ro = rows(o, d)
    bwd = _triton_phase2_bwd if uses_triton(ro) else _torch_phase2_bwd
    x = rows(partial, d) if partial is not None else None
    ct = accumulation_dtype(o.dtype)
    grads = bwd(rows(grad, d), in_dtype(rows(m, heads), ct), in_dtype(rows(z, heads), ct), ro, x,
                query.contiguous(), contiguous(key_norm_weight), eps, sigmoid, heads, contiguous(norm_weight),
                None if rstd is None else rstd.reshape(-1), None if do_into is None else do_into.view(-1, d))
    dm, dz, do, dx, dq, dg, dw = grads
    dq = None if dq is None else in_dtype(dq, query.dtype)  # the parameters' dtypes
    dg = None if dg is None else in_dtype(dg, key_norm_weight.dtype)
    dw = None if dw is None else in_dtype(dw, norm_weight.dtype)
    return [nothing(grad) if t is None else t for t in (dm, dz, do, dx, dq, dg, dw)]


@register_fake(phase2_backward_op)
def _fake_phase2_backward(grad, m, z, o, partial, query, key_norm_weight, norm_weight, rstd, eps, sigmoid, heads):
    n, d, ct = o.numel() // o.shape[-1], o.shape[-1], accumulation_dtype(o.dtype)
    has_x, normed = partial is not None, norm_weight is not None
    shapes = [((n, heads), ct, has_x and not sigmoid), ((n, heads), ct, not sigmoid),
              ((n, d), o.dtype, normed or not sigmoid), ((n, d), o.dtype, has_x), ((d,), query.dtype, has_x)]
    if key_norm_weight is not None:  # the parameters' dtypes
        shapes.append(((d,), key_norm_weight.dtype, has_x))
    else:
        shapes.append(((d,), ct, False))
    shapes.append(((d,), norm_weight.dtype if normed else ct, normed))
    return [o.new_empty(shape, dtype=dtype) if present else nothing(o) for shape, dtype, present in shapes]


def _phase2_setup(ctx, inputs, output):
    m, z, o, partial, query, gain, norm_weight, eps, norm_eps, sigmoid, heads = inputs
    rstd = output[1] if norm_weight is not None else None
    ctx.save_for_backward(m, z, o, partial, query, gain, norm_weight, rstd)
    ctx.cfg = (eps, sigmoid, heads)
    ctx.o_slot = grad_sink.slot_of(o)  # o is a slice of phase 1's output: its gradient goes to its slot
    ctx.set_materialize_grads(False)


def _phase2_backward(ctx, grads):
    m, z, o, partial, query, gain, norm_weight, rstd = ctx.saved_tensors
    eps, sigmoid, heads = ctx.cfg
    grad = grads[0]  # (1 / RMS has none)
    if grad is None:
        return (None,) * 11
    need = ctx.needs_input_grad
    if ctx.o_slot is not None and need[2] and (norm_weight is not None or not sigmoid):
        slices, index = ctx.o_slot  # o's gradient written in place, into phase 1's output gradient
        dm, dz, _, dx, dq, dg, dw = call(phase2_backward_into_op, grad, m, z, o, partial, query, gain, norm_weight,
                                         rstd, slices.slot(index), eps, sigmoid, heads)
        do = None
    else:
        dm, dz, do, dx, dq, dg, dw = call(phase2_backward_op, grad, m, z, o, partial, query, gain, norm_weight,
                                          rstd, eps, sigmoid, heads)
    if sigmoid and norm_weight is None:  # out = o + sigmoid(l) x
        do = grad
    return (cast_grad(dm, m, need[0]), cast_grad(dz, z, need[1]), cast_grad(do, o, need[2]),
            cast_grad(dx, partial, need[3]), cast_grad(dq, query, need[4]), cast_grad(dg, gain, need[5]),
            cast_grad(dw, norm_weight, need[6]), None, None, None, None)


autograd(phase2_op, _phase2_backward, _phase2_setup)


# --------------------------------------------------------------------------------------------------------------
# Public functions (the references' semantics)
# --------------------------------------------------------------------------------------------------------------


def attnres_phase1_sources(completed: Sources, queries: Tensor, key_norm_weights: Optional[Tensor], eps: float,
                           weight: str = "softmax", heads: int = 1):
    """== mixing.attnres_block_phase1(torch.stack(completed), ...): n blocks [*, d], queries / key_norm_weights
    [S, d]. -> (m [S, *, H], z [S, *, H], o [S, *, d]); m is a detached stabiliser (and z a constant with
    sigmoid weights)."""
    completed = as_list(completed)
    heads = check_heads(completed[0].shape[-1], heads)
    sigmoid = depth_weight_is_sigmoid(weight)
    m, z, o = call(phase1_op, completed, queries, key_norm_weights, float(eps), sigmoid, heads)
    return m.detach(), (z.detach() if sigmoid else z), o


def attnres_phase2(m: Tensor, z: Tensor, o: Tensor, partial: Optional[Tensor], query: Tensor,
                   key_norm_weight: Optional[Tensor], eps: float, weight: str = "softmax", heads: int = 1) -> Tensor:
    """== mixing.attnres_block_phase2(...): merges the partial sum [*, d] (or None) into phase 1's (m, z, o)."""
    sigmoid = depth_weight_is_sigmoid(weight)
    heads = check_heads(o.shape[-1], heads)
    if sigmoid and partial is None:
        return o  # the reference returns o itself
    return _phase2(m, z, o, partial, query, key_norm_weight, None, eps, 0., sigmoid, heads)


def attnres_phase2_normed(norm_weight: Tensor, norm_eps: float, m: Tensor, z: Tensor, o: Tensor,
                          partial: Optional[Tensor], query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                          weight: str = "softmax", heads: int = 1) -> Tensor:
    """The host's RMSNorm (weight norm_weight [d], Llama's casting: megatron/norm.py's fused norm) of
    attnres_phase2(...), in one kernel each way: the merge is never written, so the norm neither reads it nor has it
    made again in backward. Where the host's norm runs fused (a `Recomputed`'s `normalised`)."""
    heads = check_heads(o.shape[-1], heads)
    return _phase2(m, z, o, partial, query, key_norm_weight, norm_weight, eps, float(norm_eps),
                   depth_weight_is_sigmoid(weight), heads)


def _phase2(m, z, o, partial, query, key_norm_weight, norm_weight, eps, norm_eps, sigmoid, heads) -> Tensor:
    if partial is not None and partial.shape != o.shape:
        partial = partial.expand(o.shape)
    lead = o.shape[:-1]
    if m.shape[:-1] != lead or m.shape[-1] != heads:  # (an expand to its own shape is host time)
        m = m.expand(*lead, heads)
    if z.shape[:-1] != lead or z.shape[-1] != heads:
        z = z.expand(*lead, heads)
    return call(phase2_op, m, z, o, partial, query, key_norm_weight, norm_weight, float(eps), norm_eps, sigmoid,
                heads)[0]
