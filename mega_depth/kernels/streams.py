"""HC / mHC's n residual streams, fused: their read `streams_in` (HC's A_m X, mHC's H_pre X) and their write
`streams_out` (the residual merge); references: mixing.streams_in / mixing.streams_out.

    streams_in:  x = sum_i w_i X_i                              reads each stream once, writes d
    streams_out: X'_j = post_j y + sum_i mix[i, j] X_i           reads each stream and y once, writes the n streams
    streams_in_normed: the host's RMSNorm of streams_in, in the same kernels (the sublayer's normalised input; the
                 read itself is never written)

Streams come as [n, *, d] with free stream and token strides (an expanded embedding, a pipeline tensor's view: read
in place); coefficients [n, *] and [n, *, n] may broadcast over the tokens. A coefficient is rounded to the
streams' dtype first, as the reference multiplies in that dtype; sums are fp32. Forward saves references to its
inputs. The ops are `mega_depth::hc_streams_in` and `mega_depth::hc_streams_out`.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.kernels.common import (F32, PAIR_STAGES, RESIDENT_WARPS, accumulation_dtype, cast_grad, cdiv, chunk,
                                       contiguous, dot32, dot_dim, interpreting, jit, launch, nothing, partial_sums,
                                       pow2, programs, reduction_grid, register_fake, rms_norm_grad,
                                       rms_norm_grad_torch, rms_normed, rms_normed_torch, row_warps, rows, sm_count,
                                       store_or_add, store_or_add_torch, sum_rows, sums2, sums3, tl, token, uses_triton,
                                       warps)
from mega_depth.kernels.eager import autograd, call, traced

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------
# Streams [n, N, d] (stream stride SN, token stride ST); weights / post [n, N]; mix [n, N, n] (from i to j). Offsets
# of whole [N, d] planes are int64 (r = n * 0 + i: the stream index as an int64 scalar).


@jit
def _lanes(NS, D, BN: tl.constexpr, BD: tl.constexpr):
    """(output streams j [BN], channels [BD], their masks)."""
    oj = tl.arange(0, BN)
    od = tl.arange(0, BD)
    return oj, od, oj < NS, od < D


@jit
def _stream_row(s_ptr, w_ptr, i, n, N, SN, ST, od, dmask, valid, like_ptr):
    """(the coefficient of stream i at token n, rounded like the streams; its row [BD] in fp32)."""
    r = n * 0 + i
    w = tl.load(w_ptr + r * N + n, mask=valid, other=0.).to(like_ptr.dtype.element_ty).to(tl.float32)
    x = tl.load(s_ptr + r * SN + n * ST + od, mask=dmask & valid, other=0.).to(tl.float32)
    return w, x


@jit
def _in_fwd_kernel(s_ptr, w_ptr, nw_ptr, out_ptr, rstd_ptr, N, D, SN, ST, norm_eps, TOK, NS: tl.constexpr,
                   BD: tl.constexpr, NORMED: tl.constexpr):
    """NORMED: the host's RMSNorm of the read (common.rms_normed, weight nw_ptr [d]) in its place, and 1 / RMS
    into rstd_ptr [N]: the read itself never leaves the registers."""
    _, od, _, dmask = _lanes(1, D, 1, BD)
    if NORMED:
        nw = tl.load(nw_ptr + od, mask=dmask, other=0.).to(tl.float32)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        acc = tl.zeros([BD], dtype=tl.float32)
        for i in tl.static_range(NS):
            w, x = _stream_row(s_ptr, w_ptr, i, n, N, SN, ST, od, dmask, valid, out_ptr)
            acc += w * x
        if NORMED:
            acc, rstd = rms_normed(acc, nw, D, norm_eps, out_ptr)
            tl.store(rstd_ptr + n, rstd, mask=valid)
        tl.store(out_ptr + n * D + od, acc.to(out_ptr.dtype.element_ty), mask=dmask & valid)


@jit
def _in_bwd_kernel(s_ptr, w_ptr, go_ptr, nw_ptr, rstd_ptr, ds_ptr, dw_ptr, wpart_ptr, N, D, SN, ST, TOK,
                   NS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ADD: tl.constexpr, NORMED: tl.constexpr,
                   DEFER: tl.constexpr, STAGES: tl.constexpr = 1):
    """The n streams as one [BN, BD] tile: their weight gradients in one reduction (one a stream took a barrier
    each). ADD: the stream gradients are added to what ds holds (a gradient sink's buffer, kernels/grad_sink.py).
    NORMED: go_ptr holds the gradient of the host norm's output; the read is made again, row by row as the forward
    made it (the same sums, one row live at a time: at 7B in fp32 with the tile held as well it spilled on sm_80),
    and the norm's backward run on it (common.rms_norm_grad); the tile's load then meets those rows in cache. The
    norm weight's gradient over the program's tokens goes to its row of wpart_ptr [programs, D]. DEFER: the stream
    gradients are left to the streams' sink (_sum_kernel); with NORMED the read's gradient goes to ds_ptr [N, D]
    for it, without, the sum reads go itself."""
    oi, od, imask, dmask = _lanes(NS, D, BN, BD)
    if NORMED:
        wtotal = tl.zeros([BD], dtype=tl.float32)
    # STAGES 2: the next token's rows in flight while one is reduced (a program walks 8 tokens at 1B, its norm
    # weight's partial sums a program; _in_bwd_stages)
    for t in tl.range(TOK, num_stages=STAGES):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        tile = imask[:, None] & dmask[None, :] & valid
        go = tl.load(go_ptr + n * D + od, mask=dmask & valid, other=0.).to(tl.float32)
        if NORMED:  # (the norm weight loaded a token, from cache: held, it spilled too)
            h = tl.zeros([BD], dtype=tl.float32)
            for i in tl.static_range(NS):
                wi, xi = _stream_row(s_ptr, w_ptr, i, n, N, SN, ST, od, dmask, valid, go_ptr)
                h += wi * xi
            go, dnw = rms_norm_grad(h, go, tl.load(nw_ptr + od, mask=dmask, other=0.).to(tl.float32),
                                    tl.load(rstd_ptr + n, mask=valid, other=0.), D, go_ptr)
            wtotal += dnw
        w = tl.load(w_ptr + oi * N + n, mask=imask & valid, other=0.).to(go_ptr.dtype.element_ty).to(tl.float32)
        x = tl.load(s_ptr + oi[:, None].to(tl.int64) * SN + n * ST + od[None, :], mask=tile, other=0.).to(tl.float32)
        if DEFER:
            if NORMED:
                tl.store(ds_ptr + n * D + od, go.to(ds_ptr.dtype.element_ty), mask=dmask & valid)
        else:
            store_or_add(ds_ptr + (oi[:, None].to(tl.int64) * N + n) * D + od[None, :], w[:, None] * go[None, :],
                         tile, ADD)
        tl.store(dw_ptr + oi * N + n, tl.sum(x * go[None, :], axis=1), mask=imask & valid)
    if NORMED:
        tl.store(wpart_ptr + tl.program_id(0).to(tl.int64) * D + od, wtotal, mask=dmask)


@jit
def _out_fwd_kernel(s_ptr, y_ptr, mix_ptr, post_ptr, out_ptr, N, D, SN, ST, MI, MT, MJ, TOK, NS: tl.constexpr,
                    BN: tl.constexpr, BD: tl.constexpr):
    """out[j] = post[j] y + sum_i mix[i, j] x[i]: each input stream row read once, the n outputs in registers. mix
    [n (from i), N, n (to j)] at strides (MI, MT, MJ): mHC's is a view of H_res [N, j, i], read in place."""
    dt = out_ptr.dtype.element_ty
    oj, od, jmask, dmask = _lanes(NS, D, BN, BD)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        y = tl.load(y_ptr + n * D + od, mask=dmask & valid, other=0.).to(tl.float32)
        post = tl.load(post_ptr + oj * N + n, mask=jmask & valid, other=0.).to(dt).to(tl.float32)
        acc = post[:, None] * y[None, :]
        for i in tl.static_range(NS):
            r = n * 0 + i
            x = tl.load(s_ptr + r * SN + n * ST + od, mask=dmask & valid, other=0.).to(tl.float32)
            mix = tl.load(mix_ptr + r * MI + n * MT + oj * MJ, mask=jmask & valid, other=0.).to(dt).to(tl.float32)
            acc += mix[:, None] * x[None, :]
        orow = oj[:, None].to(tl.int64) * N * D + n * D + od[None, :]
        tl.store(out_ptr + orow, acc.to(dt), mask=jmask[:, None] & dmask[None, :] & valid)


@jit
def _out_bwd_kernel(s_ptr, y_ptr, mix_ptr, post_ptr, go_ptr, ds_ptr, dy_ptr, dmix_ptr, dpost_ptr, N, D, SN, ST, MI, MT,
                    MJ, GI, GT, GJ, TOK, NS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ADD: tl.constexpr,
                    DEFER: tl.constexpr):
    """One pass: the n output gradients of a token stay in registers while each input stream is read once. The mix
    gradients of two streams are reduced together (common.sums2), the first pair's with the post gradient
    (common.sums3): one exchange, and its barriers, a pair. The mix gradients are gathered into one [j, i] tile and
    stored once: each [BN] vector's own store changed its layout (two barriers), and there were n of them (the 1B
    step's: 18 barriers, now 9). ADD, DEFER: as _in_bwd_kernel (deferred, the sum reads go). mix at strides (MI,
    MT, MJ) as in _out_fwd_kernel, its gradient stored at strides (GI, GT, GJ) (mHC's laid out as H_res, whose
    gradient it becomes)."""
    dt = go_ptr.dtype.element_ty
    oj, od, jmask, dmask = _lanes(NS, D, BN, BD)
    oi = tl.arange(0, BN)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        mask2 = jmask[:, None] & dmask[None, :] & valid
        go = tl.load(go_ptr + oj[:, None].to(tl.int64) * N * D + n * D + od[None, :], mask=mask2,
                     other=0.).to(tl.float32)
        y = tl.load(y_ptr + n * D + od, mask=dmask & valid, other=0.).to(tl.float32)
        post = tl.load(post_ptr + oj * N + n, mask=jmask & valid, other=0.).to(dt).to(tl.float32)
        tl.store(dy_ptr + n * D + od, tl.sum(post[:, None] * go, axis=0).to(dt), mask=dmask & valid)
        mix_n = mix_ptr + n * MT + oj * MJ  # [BN]: the token's mix row of stream 0 (stream i's at i * MI)
        x = _out_stream_grad(s_ptr, mix_n, MI, go, ds_ptr, 0, n, N, D, SN, ST, od, oj, jmask, dmask, valid, NS, ADD,
                             DEFER)
        if NS > 1:
            x1 = _out_stream_grad(s_ptr, mix_n, MI, go, ds_ptr, 1, n, N, D, SN, ST, od, oj, jmask, dmask, valid, NS,
                                  ADD, DEFER)
            dmix0, dmix1, dpost = sums3(go * x[None, :], go * x1[None, :], go * y[None, :], 1)
            grads = tl.where((oi == 1)[None, :], dmix1[:, None], 0.)
        else:
            dmix0, dpost = sums2(go * x[None, :], go * y[None, :], 1)
            grads = tl.zeros([BN, BN], dtype=tl.float32)
        tl.store(dpost_ptr + oj * N + n, dpost, mask=jmask & valid)
        grads = tl.where((oi == 0)[None, :], dmix0[:, None], grads)
        for i in tl.static_range(2, NS, 2):
            x = _out_stream_grad(s_ptr, mix_n, MI, go, ds_ptr, i, n, N, D, SN, ST, od, oj, jmask, dmask, valid, NS,
                                 ADD, DEFER)
            if i + 1 < NS:
                x1 = _out_stream_grad(s_ptr, mix_n, MI, go, ds_ptr, i + 1, n, N, D, SN, ST, od, oj, jmask, dmask, valid,
                                      NS, ADD, DEFER)
                dmix, dmix1 = sums2(go * x[None, :], go * x1[None, :], 1)
                grads = tl.where((oi == i + 1)[None, :], dmix1[:, None], grads)
            else:
                dmix = tl.sum(go * x[None, :], axis=1)
            grads = tl.where((oi == i)[None, :], dmix[:, None], grads)
        # dmix [n (from i), N, n (to j)]: the tile is [j, i]
        tl.store(dmix_ptr + oi[None, :].to(tl.int64) * GI + n * GT + oj[:, None] * GJ, grads,
                 mask=jmask[:, None] & (oi < NS)[None, :] & valid)


@jit
def _out_stream_grad(s_ptr, mix_n, MI, go, ds_ptr, i, n, N, D, SN, ST, od, oj, jmask, dmask, valid, NS: tl.constexpr,
                     ADD: tl.constexpr, DEFER: tl.constexpr):
    """Input stream i's gradient sum_j mix[i, j] go_j [BD] stored (or added; DEFER: neither, the sink sums it) -> the
    stream's row [BD] in fp32, whose products with go give its mix gradients."""
    r = n * 0 + i
    x = tl.load(s_ptr + r * SN + n * ST + od, mask=dmask & valid, other=0.).to(tl.float32)
    if not DEFER:
        mix = tl.load(mix_n + r * MI, mask=jmask & valid, other=0.).to(ds_ptr.dtype.element_ty)
        store_or_add(ds_ptr + (r * N + n) * D + od, tl.sum(mix.to(tl.float32)[:, None] * go, axis=0), dmask & valid,
                     ADD)
    return x


@jit
def stream_tile(s_ptr, i, ot, oc, tmask, cmask, SN, ST):
    """Stream i's rows ot [BT] at channels oc [BC], as stored: [BT, BC] (ot is int64, so are the offsets)."""
    r = ot[:, None] * 0 + i
    return tl.load(s_ptr + r * SN + ot[:, None] * ST + oc[None, :], mask=tmask[:, None] & cmask[None, :], other=0.)


@jit
def phi_tile(phi_ptr, i, om, oc, mmask, cmask, NS, D):
    """mHC's projection phi [M, NS * D]: its columns of stream i at channels oc, for every output om: [BM, BC]."""
    return tl.load(phi_ptr + om[:, None] * (NS * D) + i * D + oc[None, :], mask=mmask[:, None] & cmask[None, :],
                   other=0.)


@jit
def _sum_kernel(ds_ptr, s_ptr, go_ptr, mix_ptr, gi_ptr, w_ptr, gp_ptr, gms_ptr, phi_ptr, dphi_ptr, N, D, M, SN, ST, MI,
                MT, MJ, TOK, DPHI_ROW, NS: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                WRITE: tl.constexpr, READ: tl.constexpr, PROJ: tl.constexpr, ADD: tl.constexpr, PHI: tl.constexpr,
                STAGES: tl.constexpr = None):
    """Program (stream i and channel chunk, token split): stream i's gradient at its chunk from its readers' parts,
    summed in fp32 and stored (or added: ADD) once, BT tokens a step over the split's TOK:
        WRITE: sum_j mix[i, j] go_j      the write's output gradients go [NS, N, D], mix at strides (MI, MT, MJ)
        READ:  w_i gi                    the read's input gradient gi [N, D], its weights w [NS, N]
        PROJ:  g_proj phi_i + (2 g_ms / (n d)) x_i     mHC's projection: g_proj [N, M], g_ms [N] (fp32), phi
    PHI (with PROJ): phi's gradient at the chunk of stream i's columns, g_proj^T x_i over the split's tokens, from
    the stream rows this pass reads anyway (a kernel of its own read all n streams again), into the split's row of
    dphi_ptr [splits, DPHI_ROW] (common.sum_rows adds the splits in order: deterministic). Coefficients are rounded
    to the streams' dtype first, as the readers' own kernels do. STAGES: the token loop's pipelining (_sum_stages)."""
    dt = ds_ptr.dtype.element_ty
    chunks = tl.cdiv(D, BC)
    i = tl.program_id(0) // chunks
    oc = (tl.program_id(0) % chunks) * BC + tl.arange(0, BC)
    cmask = oc < D
    split = tl.program_id(1)
    first = split.to(tl.int64) * TOK
    om = tl.arange(0, BM)
    mmask = om < M
    if PROJ:
        phi_i = phi_tile(phi_ptr, i, om, oc, mmask, cmask, NS, D)  # [BM, BC]: the program's, for all its tokens
    dphi = tl.zeros([BM, BC], dtype=tl.float32)
    for t0 in tl.range(0, TOK, BT, num_stages=STAGES):
        ot = first + t0 + tl.arange(0, BT)
        tmask = (ot < N) & (t0 + tl.arange(0, BT) < TOK)
        r = ot * 0 + i  # the stream index as int64 [BT]: offsets of whole [N, D] planes
        mask = tmask[:, None] & cmask[None, :]
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        if PROJ:
            g = tl.load(gp_ptr + ot[:, None] * M + om[None, :], mask=tmask[:, None] & mmask[None, :], other=0.)
            gms = tl.load(gms_ptr + ot, mask=tmask, other=0.) * (2.0 / (NS * D))
            x = stream_tile(s_ptr, i, ot, oc, tmask, cmask, SN, ST).to(tl.float32)
            acc += dot32(g, phi_i) + gms[:, None] * x
            if PHI:
                dphi += dot32(tl.trans(g), x)
        if WRITE:
            for j in tl.static_range(NS):
                m = tl.load(mix_ptr + r * MI + ot * MT + j * MJ, mask=tmask, other=0.).to(dt).to(tl.float32)
                go = tl.load(go_ptr + (j * N + ot[:, None]) * D + oc[None, :], mask=mask, other=0.)
                acc += m[:, None] * go.to(tl.float32)
        if READ:
            w = tl.load(w_ptr + r * N + ot, mask=tmask, other=0.).to(dt).to(tl.float32)
            acc += w[:, None] * tl.load(gi_ptr + ot[:, None] * D + oc[None, :], mask=mask, other=0.).to(tl.float32)
        store_or_add(ds_ptr + (r[:, None] * N + ot[:, None]) * D + oc[None, :], acc, mask, ADD)
    if PHI:
        tl.store(dphi_ptr + split.to(tl.int64) * DPHI_ROW + om[:, None] * (NS * D) + i * D + oc[None, :], dphi,
                 mask=mmask[:, None] & cmask[None, :])


def _launch(kernel, n: int, device, args, live: int, element_size: int, adds_into=(), reduces: bool = False,
            **constexprs) -> int:
    """One program per token, or a few programs an SM where the kernel reduces a parameter gradient over tokens
    (`reduces`) -> the programs. The warps hold the token's n outputs [BN, BD], but a stream row [BD] is read by
    all of them: at most one thread per 16 bytes of the row, so that each loads 16 (at 16 warps a bf16 row of 2048
    was read 8 bytes a thread)."""
    count, tok = programs(n, device, reduces=reduces)
    elements = constexprs.get("BN", 1) * constexprs["BD"]
    num_warps = min(warps(elements, live), max(4, row_warps(constexprs["BD"], element_size)))
    launch(kernel, (count,), (*args, tok), num_warps, adds_into, **constexprs)
    return count


def _triton_in_fwd(s: Tensor, w: Tensor, nw: Optional[Tensor] = None, norm_eps: float = 0.):
    """-> (the read [N, d], None); with the norm weight nw: (its RMSNorm [N, d], 1 / RMS [N] fp32)."""
    ns, n, d = s.shape
    out = torch.empty((n, d), dtype=s.dtype, device=s.device)
    rstd = None if nw is None else torch.empty(n, dtype=F32, device=s.device)
    if n:
        _launch(_in_fwd_kernel, n, s.device, (s, w, s if nw is None else nw, out, w if rstd is None else rstd, n, d,
                                              s.stride(0), s.stride(1), norm_eps), 2, s.element_size(), NS=ns,
                BD=pow2(d), NORMED=nw is not None)
    return out, rstd


def _read_gradient(go: Tensor, s: Tensor, normed: bool) -> Tensor:
    """Where a deferred read's backward leaves the read's gradient for the sum: the norm's backward output, a new
    [N, d] (with the host's norm fused in), else go itself."""
    return torch.empty((s.shape[1], s.shape[2]), dtype=s.dtype, device=s.device) if normed else go


PIPELINED_STREAM_BYTES = 32768  # a token's n stream rows up to this size are loaded a token ahead (_in_bwd_stages)


def _in_bwd_stages(ns: int, d: int, element_size: int, normed: bool) -> dict:
    """The read's backward, normed (a few programs an SM, each walking its tokens): the next token's rows loaded
    while one is reduced, where its n stream rows are PIPELINED_STREAM_BYTES or fewer. 2 stages keep the
    registers' occupancy (1B, bf16, sm_90: 119 registers and 25 %, as 98 without) in 41 KB of shared memory; 3 took
    82 KB, and the 7B config's fp32 rows took 164 KB at 2, an A100's whole allotment. ({} where there is no loop to
    pipeline: a token a program.)"""
    return {"STAGES": PAIR_STAGES} if normed and ns * d * element_size <= PIPELINED_STREAM_BYTES else {}


def _triton_in_bwd(go: Tensor, s: Tensor, w: Tensor, ds: Optional[Tensor], adding: bool,
                   nw: Optional[Tensor] = None, rstd: Optional[Tensor] = None):
    """Stream gradients into ds [n, N, d] (stored, or added to it: `adding`; ds None: deferred, left to the sink)
    -> (weight gradients fp32 [n, N], the norm weight's gradient in its dtype or None, the read's gradient [N, d]
    for the sum where deferred, else None); with the norm weight nw, go is the norm's output gradient."""
    ns, n, d = s.shape
    dw = torch.empty((ns, n), dtype=F32, device=s.device)
    normed, defer = nw is not None, ds is None
    gi = _read_gradient(go, s, normed) if defer else None
    if not n:
        return dw, torch.zeros_like(nw) if normed else None, gi
    count, _ = programs(n, s.device, reduces=normed)
    wparts = torch.empty((count, d), dtype=F32, device=s.device) if normed else dw
    _launch(_in_bwd_kernel, n, s.device, (s, w, go, s if nw is None else nw, w if rstd is None else rstd,
                                          gi if defer else ds, dw, wparts, n, d, s.stride(0), s.stride(1)), 3,
            s.element_size(), reduces=normed, NS=ns, BN=pow2(ns), BD=pow2(d), ADD=adding, NORMED=normed,
            DEFER=defer, adds_into=(ds,) if adding else (), **_in_bwd_stages(ns, d, s.element_size(), normed))
    return dw, sum_rows(wparts, d, dtypes=[nw.dtype]) if normed else None, gi


def _triton_out_fwd(s: Tensor, y: Tensor, mix: Tensor, post: Tensor) -> Tensor:
    ns, n, d = s.shape
    out = torch.empty((ns, n, d), dtype=s.dtype, device=s.device)
    if n:
        _launch(_out_fwd_kernel, n, s.device, (s, y, mix, post, out, n, d, s.stride(0), s.stride(1), *mix.stride()),
                2, s.element_size(), NS=ns, BN=pow2(ns), BD=pow2(d))
    return out


def _triton_out_bwd(go: Tensor, s: Tensor, y: Tensor, mix: Tensor, post: Tensor, ds: Optional[Tensor], adding: bool,
                    dmix: Tensor):
    """Stream gradients into ds [n, N, d] (stored, or added: `adding`; ds None: deferred, the sum reads go), the mix
    gradient into dmix [n, N, n] (fp32, at its strides) -> (output gradient [N, d], post gradient fp32 [n, N])."""
    ns, n, d = s.shape
    dy = torch.empty((n, d), dtype=s.dtype, device=s.device)
    dpost = torch.empty((ns, n), dtype=F32, device=s.device)
    if n:
        _launch(_out_bwd_kernel, n, s.device, (s, y, mix, post, go, dy if ds is None else ds, dy, dmix, dpost, n, d,
                                               s.stride(0), s.stride(1), *mix.stride(), *dmix.stride()), 2,
                s.element_size(), NS=ns, BN=pow2(ns), BD=pow2(d), ADD=adding, DEFER=ds is None,
                adds_into=(ds,) if adding else ())
    return dy, dpost


def tile_blocks(d: int, m: int, element_size: int):
    """(tokens a step, mHC's projection outputs padded, channels a step) of the kernels that walk [BT, BC] tiles of
    the streams (mhc_projection's forward, _sum_kernel): dot-sized when compiled, rows of 128 bytes (fp32 tiles of
    64 channels spilled); a few tokens and channels under the interpreter, so that the tests walk several of each
    and masked tails."""
    if interpreting():
        return 4, dot_dim(m), chunk(d)
    return 32, dot_dim(m), min(128 // element_size, max(16, chunk(d)))


def token_block(bt: int, n: int, ns: int, device: torch.device) -> int:
    """Tokens a program over a (token block, stream) grid: tile_blocks' 32, or 16 (the smallest dot tile) where 32
    would leave fewer than two programs an SM: the 7B mHC config's 1,024 tokens a rank made 128 programs for 132
    SMs."""
    if interpreting() or cdiv(n, bt) * ns >= 2 * sm_count(device):
        return bt
    return max(16, bt // 2)


def _sum_stages(proj: bool) -> Optional[int]:
    """The sum's token loop with mHC's projection: the next BT tokens' rows loaded (cp.async) while one step's are
    reduced, and (16-bit streams) channel chunks of 256 bytes where they were 128. Left to Triton, which pipelines a
    loop's dot operands alone, each of a program's 64 steps (1B, bf16) loaded its 12 KB of stream and gradient rows,
    8 bytes a thread, after the step before's two dots and their layout changes (17 barriers, 128 registers, 2
    programs an SM). Pipelined over [16, 128] tiles: 32 steps of 24 KB, 16 bytes a thread, 8 barriers, 128
    registers at the same occupancy, 62 KB of shared memory (sm_80/90/100, no spill; [16, 64] tiles took 109
    registers and 33 KB, 8-byte loads; fp32 keeps its 32-channel tiles, 205 registers where it took 248). HC's sum
    (no dot, no barrier) keeps its plain loop: its 4 programs an SM ask for 80 KB of 16-byte loads at once. None
    (also with MEGA_DEPTH_KERNELS_PIPELINE=0, which keeps the 128-byte chunks): the loop as Triton pipelines it."""
    return PAIR_STAGES if proj and PAIR_STAGES > 1 else None


def _triton_sum(ds: Tensor, adding: bool, s: Tensor, write=None, read=None, proj=None,
                phi_grad: bool = False) -> Optional[Tensor]:
    """The streams' gradient ds [n, N, d] (stored, or added: `adding`) from write = (go [n, N, d], mix [n, N, n]),
    read = (gi [N, d], w [n, N]) and proj = (g_proj [N, m], g_ms [N], phi [m, n*d]), each or None -> with phi_grad
    (and proj) phi's gradient [m, n*d] in phi's dtype (rounded once from the fp32 sums, by the reduction), else
    None."""
    ns, n, d = s.shape
    m = proj[2].shape[0] if proj is not None else 0
    if not n:
        return torch.zeros((m, ns * d), dtype=proj[2].dtype, device=s.device) if phi_grad else None
    bt, bm, bc = tile_blocks(d, m, s.element_size())
    stages = _sum_stages(proj is not None)
    if phi_grad and not interpreting():
        # phi's gradient beside the streams': its [BM, BC] fp32 sum and a second dot a step. 32 tokens a step spilled
        # 72-104 bytes at 128 registers in bf16 (sm_80 / sm_90 / sm_100), 16 fit
        bt = 16
        if stages and s.element_size() == 2:  # pipelined, 16-bit rows of 256 bytes: 16-byte loads, 26 KB a stage
            bc = max(bc, min(256 // s.element_size(), pow2(d)))
    go, mix = write if write is not None else (ds, None)
    gi, w = read if read is not None else (ds, ds)
    g, gms, phi = proj if proj is not None else (ds, ds, ds)
    chunks = ns * cdiv(d, bc)
    splits, tok = reduction_grid(n, chunks, s.device)  # a split's partial sums of phi's gradient: a row each
    parts = partial_sums(splits, m * ns * d, s.device) if phi_grad else ds
    # 8 warps: with the projection's [BT, BM] x [BM, BC] dot, 4 took up to 175 registers and spilled at 128; fp32
    # tiles with phi's gradient take up to 255 (8 resident warps: at 128 they spilled 32-76 bytes)
    resident = 8 if phi_grad and s.element_size() > 2 else RESIDENT_WARPS
    launch(_sum_kernel, (chunks, splits),
           (ds, s if proj is not None else ds, go, ds if mix is None else mix, gi, w, g, gms, phi, parts, n, d, m,
            s.stride(0), s.stride(1), *(mix.stride() if mix is not None else (0, 0, 0)), tok,
            parts.stride(0) if phi_grad else 0), 8, resident_warps=resident,
           adds_into=(ds,) if adding else (), NS=ns, BT=bt, BM=bm, BC=bc, WRITE=write is not None,
           READ=read is not None, PROJ=proj is not None, ADD=adding, PHI=phi_grad, STAGES=stages)
    return sum_rows(parts, m * ns * d, dtypes=[phi.dtype]).view(m, ns * d) if phi_grad else None


# --------------------------------------------------------------------------------------------------------------
# The torch twins: streams [n, N, d] (free strides), weights / post [n, N], mix [n, N, n]
# --------------------------------------------------------------------------------------------------------------


def _coef(c, dt, ct):
    return c.to(dt).to(ct)


def _torch_in_fwd(s, w, nw=None, norm_eps=0.):
    dt, ct = s.dtype, accumulation_dtype(s.dtype)
    out = torch.zeros(s.shape[1:], dtype=ct, device=s.device)
    for i in range(s.shape[0]):
        out += _coef(w[i], dt, ct).unsqueeze(-1) * s[i].to(ct)
    return (out.to(dt), None) if nw is None else rms_normed_torch(out.to(dt), nw, norm_eps)


def _torch_in_bwd(go, s, w, ds, adding, nw=None, rstd=None):
    dt, ct = s.dtype, accumulation_dtype(s.dtype)
    dnw, gi = None, None
    if nw is not None:
        go, dnw = rms_norm_grad_torch(_torch_in_fwd(s, w)[0], go, nw, rstd)
    if ds is None:  # deferred: the read's gradient for the sum, in the streams' dtype as the kernel stores it
        gi = go.to(dt)
    go = go.to(ct)
    if ds is not None:  # the read's part of the streams' gradient, as the sink sums it
        _torch_sum(ds, adding, s, read=(go, w))
    return torch.stack([(s[i].to(ct) * go).sum(-1) for i in range(s.shape[0])]), dnw, gi


def _torch_out_fwd(s, y, mix, post):
    dt, ct = s.dtype, accumulation_dtype(s.dtype)
    out = _coef(post, dt, ct).unsqueeze(-1) * y.to(ct)
    for i in range(s.shape[0]):
        out += _coef(mix[i], dt, ct).t().unsqueeze(-1) * s[i].to(ct)  # [n (to), N, d]
    return out.to(dt)


def _torch_out_bwd(go, s, y, mix, post, ds_into, adding, dmix_into):
    dt, ct = s.dtype, accumulation_dtype(s.dtype)
    if ds_into is not None:  # the write's part of the streams' gradient, as the sink sums it
        _torch_sum(ds_into, adding, s, write=(go, mix))
    go = go.to(ct)
    dy = (_coef(post, dt, ct).unsqueeze(-1) * go).sum(0).to(dt)
    dpost = (go * y.to(ct)).sum(-1)
    for i in range(s.shape[0]):
        dmix_into[i] = (go * s[i].to(ct)).sum(-1).t()  # [N, n (to)]
    return dy, dpost


def _torch_sum(ds, adding, s, write=None, read=None, proj=None, phi_grad=False):
    dt, ct = s.dtype, accumulation_dtype(s.dtype)
    ns, n, d = s.shape
    acc = torch.zeros((ns, n, d), dtype=ct, device=s.device)
    if write is not None:
        go, mix = write[0].to(ct), write[1]
        for i in range(ns):
            acc[i] += (_coef(mix[i], dt, ct).t().unsqueeze(-1) * go).sum(0)
    if read is not None:
        acc += _coef(read[1], dt, ct).unsqueeze(-1) * read[0].to(ct)
    dphi = None
    if proj is not None:
        g, scale, phi = proj[0].to(ct), (proj[1].to(ct) * (2.0 / (ns * d))).unsqueeze(-1), proj[2]
        for i in range(ns):
            acc[i] += g @ phi[:, i * d:(i + 1) * d].to(ct) + scale * s[i].to(ct)
        if phi_grad:
            dphi = torch.cat([g.T @ s[i].to(ct) for i in range(ns)], dim=1).to(phi.dtype)
    store_or_add_torch(ds, acc.to(dt), adding)
    return dphi


# --------------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------------


def stream_rows(streams: Tensor) -> Tensor:
    """[n, *, d] as [n, N, d] with unit channel stride; the stream and token strides stay free (no copy of an
    expanded embedding or of a pipeline tensor's view where the layout allows)."""
    t = streams.reshape(streams.shape[0], -1, streams.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _coef_rows(coef: Tensor, n: int, tail: int = 0) -> Tensor:
    """A coefficient [n, *] as contiguous [n, N] (a small copy where it is not); with tail=1 a mix [n, *, n] as
    [n, N, n] at any strides (the out kernels take them: mHC's mix is H_res transposed, a view), a copy only where
    the tokens do not merge into one stride."""
    if tail:
        return coef.reshape(n, -1, coef.shape[-1])
    return coef.reshape(n, -1).contiguous()


@torch.library.custom_op("mega_depth::hc_streams_in", mutates_args=())
def streams_in_op(streams: Tensor, weights: Tensor, norm_weight: Optional[Tensor], norm_eps: float) -> List[Tensor]:
    """streams [n, *, d], weights [n, *] -> [the read [*, d], nothing]; with norm_weight [d], [the host's RMSNorm of
    the read [*, d], 1 / RMS [*] (fp32)]."""
    s = stream_rows(streams)
    fwd = _triton_in_fwd if uses_triton(s) else _torch_in_fwd
    out, rstd = fwd(s, _coef_rows(weights, s.shape[0]), contiguous(norm_weight), norm_eps)
    return [out.view(*streams.shape[1:]), nothing(out) if rstd is None else rstd.view(*streams.shape[1:-1])]


@register_fake(streams_in_op)
def _(streams, weights, norm_weight, norm_eps):
    rstd = nothing(streams) if norm_weight is None else \
        streams.new_empty(streams.shape[1:-1], dtype=accumulation_dtype(streams.dtype))
    return [streams.new_empty(streams.shape[1:]), rstd]


@torch.library.custom_op("mega_depth::hc_streams_in_backward", mutates_args=())
def streams_in_backward_op(grad: Tensor, streams: Tensor, weights: Tensor, norm_weight: Optional[Tensor],
                           rstd: Optional[Tensor]) -> List[Tensor]:
    """-> [stream gradients [n, *, d], weight gradients [n, *] (fp32 at least), the norm weight's gradient (or
    nothing)]; with norm_weight, grad is the norm's output gradient and rstd its forward's 1 / RMS."""
    into = torch.empty_like(streams, memory_format=torch.contiguous_format)
    return [into, *_in_backward_into(grad, streams, weights, norm_weight, rstd, into, False)]


@register_fake(streams_in_backward_op)
def _fake_in_backward(grad, streams, weights, norm_weight, rstd):
    return [streams.new_empty(streams.shape),
            weights.new_empty(weights.shape, dtype=accumulation_dtype(streams.dtype)),
            nothing(streams) if norm_weight is None else norm_weight.new_empty(norm_weight.shape)]


@torch.library.custom_op("mega_depth::hc_streams_in_backward_into", mutates_args=("into",))
def streams_in_backward_into_op(grad: Tensor, streams: Tensor, weights: Tensor, norm_weight: Optional[Tensor],
                                rstd: Optional[Tensor], into: Tensor, adding: bool) -> List[Tensor]:
    """The stream gradients stored into `into` (contiguous, shaped like the streams), or added to it with `adding`
    set (kernels/grad_sink.py) -> [the weight gradients, the norm weight's], as hc_streams_in_backward."""
    return _in_backward_into(grad, streams, weights, norm_weight, rstd, into, adding)


@register_fake(streams_in_backward_into_op)
def _(grad, streams, weights, norm_weight, rstd, into, adding):
    return _fake_in_backward(grad, streams, weights, norm_weight, rstd)[1:]


@torch.library.custom_op("mega_depth::hc_streams_in_backward_deferred", mutates_args=())
def streams_in_backward_deferred_op(grad: Tensor, streams: Tensor, weights: Tensor, norm_weight: Optional[Tensor],
                                    rstd: Optional[Tensor]) -> List[Tensor]:
    """The stream gradients left to the streams' sink -> [the weight gradients, the norm weight's, the read's
    gradient [*, d] for the sum (with norm_weight; without, nothing: the sum reads grad)]."""
    return _in_backward_into(grad, streams, weights, norm_weight, rstd, None, False)


@register_fake(streams_in_backward_deferred_op)
def _(grad, streams, weights, norm_weight, rstd):
    gi = nothing(streams) if norm_weight is None else streams.new_empty(streams.shape[1:])
    return _fake_in_backward(grad, streams, weights, norm_weight, rstd)[1:] + [gi]


def _in_backward_into(grad, streams, weights, norm_weight, rstd, into, adding) -> List[Tensor]:
    """into None: deferred (-> one more output, the read's gradient for the sum, or nothing)."""
    s = stream_rows(streams)
    bwd = _triton_in_bwd if uses_triton(s) else _torch_in_bwd
    dw, dnw, gi = bwd(rows(grad, s.shape[-1]), s, _coef_rows(weights, s.shape[0]),
                      None if into is None else into.view_as(s), adding, contiguous(norm_weight),
                      None if rstd is None else rstd.reshape(-1))
    out = [dw.view_as(weights), nothing(grad) if dnw is None else dnw]
    if into is None:
        out.append(gi.view_as(grad) if norm_weight is not None else nothing(grad))
    return out


def _save_inputs(ctx, inputs, output):
    """The inputs by reference, and the streams' gradient sink (kernels/grad_sink.py) if they have one."""
    ctx.save_for_backward(*inputs)
    ctx.sinks = grad_sink.sinks_of(inputs[:1])


def stream_gradient(ctx, streams, backward, backward_into, *args):
    """Run an op's backward: `backward(*args)` -> [the streams' gradient, rest...], or, where the streams have a
    sink, `backward_into(*args, into, adding)` -> [rest...] into its buffer. -> (the streams' gradient for autograd,
    None where the sink took it; rest)."""
    if ctx.sinks is None:
        ds, *rest = call(backward, *args)
        return ds, rest
    (into,), (adding,) = grad_sink.buffers(ctx.sinks, [streams])
    rest = call(backward_into, *args, into, adding)
    rest = [rest] if isinstance(rest, Tensor) else rest
    return grad_sink.returned(ctx.sinks, [into], ctx.needs_input_grad[0])[0], rest


DEFER_READERS = 2  # a sink's readers from which its streams' readers leave their parts to it (below: one reader)


def deferring(ctx) -> bool:
    """Whether this reader of the streams leaves its part of their gradient to their sink, which sums every reader's
    part in one pass (`sum_deferred`): a sublayer's write, read and mHC projection each added theirs into the
    buffer in turn, reading and writing all n streams' gradients each time."""
    return grad_sink.deferring(ctx.sinks, DEFER_READERS) is not None


def defer(ctx, kind: str, *part: Tensor) -> None:
    """Leave a reader's part (`gradient_sum_op`'s arguments of that reader, `kind`: write, read or proj)."""
    ctx.sinks[0].defer((sum_deferred,), (kind, *part))


_PARTS = (("write", 2), ("read", 2), ("proj", 4))  # a record's kind and width (proj: g_proj, g_ms, phi, companion)


def sum_deferred(streams: Tensor, records: List[tuple], held: Optional[Tensor]):
    """The streams' sink's resolver (grad_sink.Sink.defer): held (what other readers stored, or None) plus every
    deferred reader's part, one launch for a write's, a read's and a projection's part together (a sublayer's
    three readers: one launch). A projection record names phi's place among the sink's companions where phi went
    through the sink's node (grad_sink.aliased_with): its gradient is made in the same launch, from the same pass
    over the streams, and returned for the node to hand on -> the buffer, or (the buffer, {companion: gradient})."""
    into = held if held is not None else torch.empty_like(streams, memory_format=torch.contiguous_format)
    parts = {kind: [r[1:] for r in records if r[0] == kind] for kind, _ in _PARTS}
    adding, made = held is not None, {}
    while any(parts.values()):
        args = [a for kind, width in _PARTS for a in (parts[kind].pop(0) if parts[kind] else (None,) * width)]
        companion = args.pop()  # the projection's phi, as the sink's companion (or None)
        dphi = call(gradient_sum_op, into, adding, streams, *args, companion is not None)
        if companion is not None:
            made[companion] = dphi[0]
        adding = True
    return (into, made) if made else into


@torch.library.custom_op("mega_depth::hc_streams_gradient_sum", mutates_args=("into",))
def gradient_sum_op(into: Tensor, adding: bool, streams: Tensor, grad_out: Optional[Tensor], mix: Optional[Tensor],
                    grad_in: Optional[Tensor], weights: Optional[Tensor], grad_proj: Optional[Tensor],
                    grad_mean_square: Optional[Tensor], phi: Optional[Tensor], phi_grad: bool) -> List[Tensor]:
    """into (contiguous, shaped like the streams [n, *, d]) = (into if adding, +) the parts of the streams' readers,
    each reader's arguments all None where it has none: the write's (its output gradient grad_out [n, *, d], mix
    [n, *, n]), the read's (its input's gradient grad_in [*, d], weights [n, *]) and mHC's projection's (grad_proj
    [*, m], grad_mean_square [*, 1], phi [m, n*d]) -> with phi_grad [phi's gradient [m, n*d] (phi's dtype)], made
    from the same pass over the streams; else [] (no placeholder tensor: an allocation a call)."""
    s = stream_rows(streams)
    n, d = s.shape[0], s.shape[-1]
    write = None if grad_out is None else (grad_out.reshape(n, -1, d).contiguous(), _coef_rows(mix, n, 1))
    read = None if grad_in is None else (rows(grad_in, d), _coef_rows(weights, n))
    proj = None if grad_proj is None else (grad_proj.reshape(-1, phi.shape[0]).contiguous(),
                                           grad_mean_square.reshape(-1).contiguous(), phi.contiguous())
    dphi = sum_into(into.view_as(s), adding, s, write, read, proj, phi_grad and proj is not None)
    return [] if dphi is None else [dphi]


@register_fake(gradient_sum_op)
def _(into, adding, streams, grad_out, mix, grad_in, weights, grad_proj, grad_mean_square, phi, phi_grad):
    return [phi.new_empty(phi.shape)] if phi_grad and phi is not None else []


def sum_into(ds: Tensor, adding: bool, s: Tensor, write=None, read=None, proj=None,
             phi_grad: bool = False) -> Optional[Tensor]:
    """_triton_sum's arguments, through the kernel or its torch twin -> phi's gradient with phi_grad, else None."""
    return (_triton_sum if uses_triton(s) else _torch_sum)(ds, adding, s, write, read, proj, phi_grad)


def _in_setup(ctx, inputs, output):
    streams, weights, norm_weight, _ = inputs
    ctx.save_for_backward(streams, weights, norm_weight, None if norm_weight is None else output[1])
    ctx.sinks = grad_sink.sinks_of([streams])
    ctx.set_materialize_grads(False)


def _in_backward(ctx, grads):
    streams, weights, norm_weight, rstd = ctx.saved_tensors
    grad = grads[0]  # (1 / RMS has none)
    if grad is None:
        return None, None, None, None
    if deferring(ctx):
        ds, (dw, dnw, gi) = None, call(streams_in_backward_deferred_op, grad, streams, weights, norm_weight, rstd)
        defer(ctx, "read", grad if norm_weight is None else gi, weights)
    else:
        ds, (dw, dnw) = stream_gradient(ctx, streams, streams_in_backward_op, streams_in_backward_into_op, grad,
                                        streams, weights, norm_weight, rstd)
    need = ctx.needs_input_grad
    return ds if need[0] else None, cast_grad(dw, weights, need[1]), cast_grad(dnw, norm_weight, need[2]), None


autograd(streams_in_op, _in_backward, _in_setup)


@torch.library.custom_op("mega_depth::hc_streams_out", mutates_args=())
def streams_out_op(streams: Tensor, output: Tensor, mix: Tensor, post: Tensor) -> Tensor:
    """streams [n, *, d], output [*, d], mix [n, *, n], post [n, *] -> [n, *, d]."""
    s = stream_rows(streams)
    n, d = s.shape[0], s.shape[-1]
    out = (_triton_out_fwd if uses_triton(s) else _torch_out_fwd)(s, rows(output, d), _coef_rows(mix, n, 1),
                                                                  _coef_rows(post, n))
    return out.view(n, *output.shape)


@register_fake(streams_out_op)
def _(streams, output, mix, post):
    return streams.new_empty((streams.shape[0], *output.shape))


@torch.library.custom_op("mega_depth::hc_streams_out_backward", mutates_args=())
def streams_out_backward_op(grad: Tensor, streams: Tensor, output: Tensor, mix: Tensor, post: Tensor,
                            mix_layout: bool) -> List[Tensor]:
    """-> [stream gradients, output gradient, mix gradient, post gradient] (coefficients in fp32 at least; the mix
    gradient laid out as the mix with mix_layout, else contiguous: _mix_gradient)."""
    into = torch.empty_like(streams, memory_format=torch.contiguous_format)
    return [into] + _out_backward_into(grad, streams, output, mix, post, mix_layout, into, False)


@register_fake(streams_out_backward_op)
def _fake_out_backward(grad, streams, output, mix, post, mix_layout):
    ct = accumulation_dtype(streams.dtype)
    return [streams.new_empty(streams.shape), output.new_empty(output.shape), _mix_gradient(mix, ct, mix_layout),
            post.new_empty(post.shape, dtype=ct)]


def _mix_gradient(mix: Tensor, dtype: torch.dtype, mix_layout: bool) -> Tensor:
    """An empty gradient of mix [n, *, n] as the write's backward stores it (its kernels, its twin and its fake
    alike). mix_layout (an eager call): as mix's rows where those are dense (mHC's mix, H_res transposed: its
    gradient then reaches H_res contiguous, with no copy), else contiguous (a broadcast mix: one row a token).
    Otherwise contiguous: under torch.compile the mix's strides at run time need not be those it was traced with,
    and the output's must be."""
    if not mix_layout:
        return mix.new_empty(mix.shape, dtype=dtype)
    return torch.empty_like(_coef_rows(mix, mix.shape[0], 1), dtype=dtype).view_as(mix)


@torch.library.custom_op("mega_depth::hc_streams_out_backward_into", mutates_args=("into",))
def streams_out_backward_into_op(grad: Tensor, streams: Tensor, output: Tensor, mix: Tensor, post: Tensor,
                                 mix_layout: bool, into: Tensor, adding: bool) -> List[Tensor]:
    """The stream gradients into `into` (stored, or added with `adding`) -> [output, mix, post gradients]."""
    return _out_backward_into(grad, streams, output, mix, post, mix_layout, into, adding)


@register_fake(streams_out_backward_into_op)
def _(grad, streams, output, mix, post, mix_layout, into, adding):
    return _fake_out_backward(grad, streams, output, mix, post, mix_layout)[1:]


@torch.library.custom_op("mega_depth::hc_streams_out_backward_deferred", mutates_args=())
def streams_out_backward_deferred_op(grad: Tensor, streams: Tensor, output: Tensor, mix: Tensor, post: Tensor,
                                     mix_layout: bool) -> List[Tensor]:
    """The stream gradients left to the streams' sink, which reads grad and mix -> [output, mix, post gradients]."""
    return _out_backward_into(grad, streams, output, mix, post, mix_layout, None, False)


@register_fake(streams_out_backward_deferred_op)
def _(grad, streams, output, mix, post, mix_layout):
    return _fake_out_backward(grad, streams, output, mix, post, mix_layout)[1:]


def _out_backward_into(grad, streams, output, mix, post, mix_layout, into, adding) -> List[Tensor]:
    """into None: deferred."""
    s = stream_rows(streams)
    n, d = s.shape[0], s.shape[-1]
    go = grad.reshape(n, -1, d).contiguous()
    dmix = _mix_gradient(mix, F32 if uses_triton(s) else accumulation_dtype(s.dtype), mix_layout)
    dy, dpost = (_triton_out_bwd if uses_triton(s) else _torch_out_bwd)(
        go, s, rows(output, d), _coef_rows(mix, n, 1), _coef_rows(post, n), None if into is None else into.view_as(s),
        adding, dmix.view(n, -1, n))
    return [dy.view_as(output), dmix, dpost.view_as(post)]


def _out_backward(ctx, grad):
    streams, output, mix, post = ctx.saved_tensors
    args = (grad, streams, output, mix, post)
    if deferring(ctx):
        ds, (dy, dmix, dpost) = None, call(streams_out_backward_deferred_op, *args, True)
        defer(ctx, "write", grad, mix)
    else:
        ds, (dy, dmix, dpost) = stream_gradient(ctx, streams, streams_out_backward_op, streams_out_backward_into_op,
                                                 *args, not traced(args))
    need = ctx.needs_input_grad
    return (ds if need[0] else None, dy if need[1] else None, cast_grad(dmix, mix, need[2]),
            cast_grad(dpost, post, need[3]))


autograd(streams_out_op, _out_backward, _save_inputs)


def sunk(streams: Tensor) -> Tensor:
    """The streams through their gradient sink's alias (kernels/grad_sink.py): a sublayer's three readers (the
    coefficients, the read, the write) add their gradients into one buffer instead of autograd adding three."""
    return streams if traced([streams]) else grad_sink.aliased([streams])[0]


def streams_in(streams: Tensor, weights: Tensor) -> Tensor:
    """== mixing.streams_in(...): streams [n, *, d], weights [n, *] (or broadcastable, [n, 1...]) -> [*, d]."""
    streams = sunk(streams)
    # autograd sums a broadcast back
    return call(streams_in_op, streams, weights.expand(streams.shape[:-1]), None, 0.)[0]


def streams_in_normed(norm_weight: Tensor, norm_eps: float, streams: Tensor, weights: Tensor) -> Tensor:
    """The host's RMSNorm (weight norm_weight [d], Llama's casting: megatron/norm.py's fused norm) of
    streams_in(streams, weights), in one kernel each way: the read stays in registers, so it is neither written,
    read by the norm, nor made again (from the n streams) for the norm's backward. Where the host's norm runs fused
    (a `Recomputed`'s `normalised`: HC / mHC's sublayer input)."""
    streams = sunk(streams)
    return call(streams_in_op, streams, weights.expand(streams.shape[:-1]), norm_weight, float(norm_eps))[0]


def streams_out(streams: Tensor, output: Tensor, mix: Tensor, post: Tensor) -> Tensor:
    """== mixing.streams_out(...): streams [n, *, d], output [*, d], mix [n, *, n] (from i to j), post [n, *]
    (both may broadcast over the tokens) -> [n, *, d]."""
    streams = sunk(streams)
    n, lead = streams.shape[0], streams.shape[1:-1]
    if output.shape != streams.shape[1:]:
        output = output.expand(streams.shape[1:])
    return call(streams_out_op, streams, output, mix.expand(n, *lead, n), post.expand(n, *lead))
