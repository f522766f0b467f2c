"""DCA's generalised residuals over the stack, fused: `grn_apply_sources` (reference: mixing.grn_apply).

    out[g] = sum_k (bias[g, :, k] + ReLU(proj[g] . G[k])) * G[k]     (v1: a scalar bias per source; v2: no ReLU)

for the g GRN instances of one call (DCA: 3 for q/k/v, 1 for the final mix). Contract: the K stack entries are
read in place; forward reads each once for all instances; saves bias, proj and the entries (references); backward
recomputes the v3 gates (clamp's subgradient 1 at 0, as the reference). The op is `mega_depth::dca_grn`.

Forward: where a token's source rows fit in registers (_rows_fit), the Triton kernel reads each row once as one tile
(_fwd_rows_kernel). Elsewhere it walks a token's sources in chunks of channels, so registers do not grow with d, and
loads a block of sources a step as one tile (16-byte loads where a lone row would load 4): the v3 gates (full-row
dot products) come from a first pass, the weighted sums from a second one, which walks the chunks last to first so
that its reads of the token's sources meet the lines the first pass read last (kept with evict_last).

Backward, three kernels, each a stream with no exchange between a program's warps inside its loops: (v3) the gates
and their gradients of a few tokens, a token a warp, the dots over the channels summed in each lane and the lanes
summed once (_gates_bwd_kernel); the sources' gradients, a [tokens, sources, channels] tile at a time with the
instances summed in each thread (_source_grads_kernel); and the parameter gradients (sums over tokens), one program
per channel chunk, block of sources and token split, which reads the sources and the output gradients once more;
its per-program partial sums are added in order (common.sum_rows): deterministic. The kernel that held a token's
whole rows on 8 warps, one token a program, reached 15 % of copy bandwidth on the H200 (2026-12-04).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.kernels.common import (F32, STREAM_PAIR, STREAM_STAGES, Sources, accumulation_dtype, as_list, cast_grad,
                                       cdiv, chunk, contiguous, gradient_table, gradients_at, in_dtype, interpreting,
                                       jit, launch, nothing, partial_sums, pointer_table, pointers_at, pow2, programs,
                                       reduction_grid, register_fake, row_warps, source_rows, sum_rows, tl, token,
                                       uses_triton, warps)
from mega_depth.kernels.eager import autograd, call, traced
from mega_depth.model import mixing

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@jit
def _rounded(x, like_ptr):
    """A parameter rounded to the sources' dtype, as the reference multiplies in that dtype."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


# The chunked kernels' 3-D tiles: every tile that meets another in one expression is loaded at the full shape
# (rows repeated where a factor does not vary along an axis; the repeats come from L1). Triton gives a load a layout
# by its shape, and tiles of different shapes ([KB, 1, BCH] times [1, BG, BCH]) met through a layout change in
# shared memory, 2 barriers, every chunk. The forward's pass 2 sums over the sources of [BG, KB, BCH] tiles, whose
# warps lie along the instances (a sum in each thread); the backward's sums over the instances one at a time.


@jit
def _source_tile(table, b, K, n, od, valid, D, like_ptr, KB: tl.constexpr, BG: tl.constexpr, POLICY: tl.constexpr):
    """Sources b * KB .. b * KB + KB - 1 of token n at channels od, each row repeated for the BG instances: ([BG,
    KB, BCH] fp32, their indices [KB], mask [KB]). One 16-byte-a-thread load for KB rows: a lone row of 256 bf16
    channels on 4 warps loads 4 bytes a thread, one after another. POLICY: the cache eviction hint."""
    ok = b * KB + tl.arange(0, KB)
    kmask = ok < K
    at = pointers_at(table, ok, kmask, like_ptr)[None, :, None] + 0 * tl.arange(0, BG)[:, None, None]  # [BG, KB, 1]
    v = tl.load(at + n * D + od[None, None, :], mask=kmask[None, :, None] & (od < D)[None, None, :] & valid,
                other=0., eviction_policy=POLICY)
    return v.to(tl.float32), ok, kmask


@jit
def _bias_tile(bias_ptr, ok, kmask, og, gmask, od, K, D, like_ptr, VERSION: tl.constexpr):
    """The bias of sources ok for every instance: [BG, KB, *], where * is 1 (v1: scalars, bias_ptr [G, K] fp32) or
    BCH (v2/v3: a chunk of channels; bias_ptr [G, K, d], the parameter's [G, d, K] transposed so that it is
    contiguous)."""
    g3, k3 = og[:, None, None], ok[None, :, None]
    kg = gmask[:, None, None] & kmask[None, :, None]
    if VERSION == 1:
        b = tl.load(bias_ptr + g3 * K + k3, mask=kg, other=0.)
    else:
        b = tl.load(bias_ptr + (g3 * K + k3) * D + od[None, None, :], mask=kg & (od < D)[None, None, :], other=0.)
    return _rounded(b, like_ptr)


@jit
def _gates(table, proj_ptr, n, valid, K, D, G, like_ptr, NB: tl.constexpr, KB: tl.constexpr, BG: tl.constexpr,
           BCH: tl.constexpr):
    """v3, pass 1 over a token's K sources, KB sources a load, chunk by chunk: proj_g . v_k [NB, KB, BG] (source
    b * KB + i at [b, i]). A block's products are summed over the channels once, after its last chunk (a sum across
    a warp's threads and a change of layout), not once a chunk. The reads of the sources ask the cache to keep their
    lines (evict_last): pass 2 reads them again."""
    ob = tl.arange(0, NB)
    og = tl.arange(0, BG)
    gmask = og < G
    pre = tl.zeros([NB, KB, BG], dtype=tl.float32)
    oi = tl.arange(0, KB)
    for b in range(0, tl.cdiv(K, KB)):
        dots = tl.zeros([KB, BG, BCH], dtype=tl.float32)
        ok = b * KB + oi
        kmask = ok < K
        at = pointers_at(table, ok, kmask, like_ptr)[:, None, None] + 0 * og[None, :, None]  # [KB, BG, 1]
        kg = kmask[:, None, None] & gmask[None, :, None] & valid
        g_rows = og[None, :, None].to(tl.int64) + 0 * ok[:, None, None]  # [KB, BG, 1]
        for c0 in range(0, D, BCH):
            # the sources and projections as [KB, BG, BCH] tiles (the repeats from L1): one layout for both, where
            # [KB, 1, BCH] times [1, BG, BCH] took a layout change (2 barriers) a chunk
            od = (c0 + tl.arange(0, BCH))[None, None, :]
            tile = kg & (od < D)
            v = tl.load(at + n * D + od, mask=tile, other=0., eviction_policy="evict_last")
            dots += v.to(tl.float32) * _rounded(tl.load(proj_ptr + g_rows * D + od, mask=tile, other=0.), like_ptr)
        pre = tl.where((ob == b)[:, None, None], tl.sum(dots, axis=2)[None, :, :], pre)
    return pre


@jit
def _store_gates(ptr, gates, n, valid, NB: tl.constexpr, KB: tl.constexpr, BG: tl.constexpr):
    """A token's [NB, KB, BG] gates into ptr [N, BG, NB x KB] (_gate_scratch): every entry of
    the token's rows, the padding's zeros (instances past G, sources past K: their gates are 0) included, so that
    pass 2 loads a block's KB sources unmasked, in vectors (a mask that varies along a vector splits it). Pass 2
    reads them back in another layout, so in other threads: a barrier between (tl.debug_barrier: global writes
    before it are visible to the program's threads after it)."""
    k3 = tl.arange(0, NB)[:, None, None] * KB + tl.arange(0, KB)[None, :, None]
    og = tl.arange(0, BG)[None, None, :]
    tl.store(ptr + (n * BG + og) * (NB * KB) + k3, gates, mask=valid)


@jit
def _fwd_kernel(table, bias_ptr, proj_ptr, out_ptr, gate_ptr, K, N, D, G, TOK, NB: tl.constexpr, KB: tl.constexpr,
                BG: tl.constexpr, BCH: tl.constexpr, VERSION: tl.constexpr):
    """Per token: (v3) pass 1 finds the K x G gates, pass 2 sums the sources weighted by bias + gate, chunk by
    chunk and KB sources a load, for all G instances at once. Pass 2 walks the chunks last to first: the ones
    pass 1 read last are the likeliest still in cache. The gates go through gate_ptr [N, BG, NB x KB] (fp32
    scratch, in L1): a block's gates loaded in the tile's layout, where picking them out of the [NB, KB, BG]
    registers took a sum across warps and layout changes, 6 barriers, every chunk and block."""
    og = tl.arange(0, BG)
    gmask = og < G
    chunks = tl.cdiv(D, BCH)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        if VERSION == 3:
            pre = _gates(table, proj_ptr, n, valid, K, D, G, out_ptr, NB, KB, BG, BCH)
            _store_gates(gate_ptr, tl.maximum(pre, 0.), n, valid, NB, KB, BG)
            tl.debug_barrier()
        for i in range(chunks):
            od = (chunks - 1 - i) * BCH + tl.arange(0, BCH)
            acc = tl.zeros([BG, BCH], dtype=tl.float32)
            for b in range(0, tl.cdiv(K, KB)):
                v, ok, kmask = _source_tile(table, b, K, n, od, valid, D, out_ptr, KB, BG, "evict_first")
                coef = _bias_tile(bias_ptr, ok, kmask, og, gmask, od, K, D, out_ptr, VERSION)  # [BG, KB, *]
                if VERSION == 3:
                    coef = coef + tl.load(gate_ptr + (n * BG + og[:, None]) * (NB * KB) + ok[None, :], mask=valid,
                                          other=0.)[:, :, None]  # [BG, KB] -> [BG, KB, 1]
                acc += tl.sum(coef * v, axis=1)
            tl.store(out_ptr + og[:, None].to(tl.int64) * N * D + n * D + od[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=gmask[:, None] & (od < D)[None, :] & valid)


@jit
def _coefficients(bias_ptr, g, ok, kmask, od, tile, K, D, like_ptr, VERSION: tl.constexpr):
    """bias[g] of the sources ok, rounded to the sources' dtype, as [BK, BD] (v1: scalars, bias_ptr [G, K] fp32,
    broadcast over the channels: both branches must return one type; v2/v3: bias_ptr [G, K, d])."""
    if VERSION == 1:
        return tl.where(tile, _rounded(tl.load(bias_ptr + g * K + ok, mask=kmask, other=0.), like_ptr)[:, None], 0.)
    return _rounded(tl.load(bias_ptr + (g * K + ok[:, None]) * D + od[None, :], mask=tile, other=0.), like_ptr)


@jit
def _fwd_rows_kernel(table, bias_ptr, proj_ptr, out_ptr, K, N, D, G, TOK, BK: tl.constexpr, BD: tl.constexpr,
                     VERSION: tl.constexpr):
    """Per token, where its K whole source rows fit in registers (_rows_fit): the rows [BK, BD] read once, as one
    tile of 16-byte loads; each instance's gates (v3) and weighted sum come from that tile, one instance after
    another, so that an instance's bias rows are the only other tile held."""
    ok = tl.arange(0, BK)
    kmask = ok < K
    od = tl.arange(0, BD)
    dmask = od < D
    tile = kmask[:, None] & dmask[None, :]
    rows_at = pointers_at(table, ok, kmask, out_ptr)
    for t in range(TOK):
        n = token(tl.program_id(0), t, TOK)
        valid = n < N
        v = tl.load(rows_at[:, None] + n * D + od[None, :], mask=tile & valid, other=0.).to(tl.float32)
        # the next instance's bias rows and projection (from L2: every token reads them) in flight while this
        # instance's gate is exchanged (2 stages: 106 registers and 25 % at 4 sources, as 96 without)
        for g in tl.range(G, num_stages=STREAM_PAIR):
            coef = _coefficients(bias_ptr, g, ok, kmask, od, tile, K, D, out_ptr, VERSION)
            if VERSION == 3:
                proj = _rounded(tl.load(proj_ptr + g * D + od, mask=dmask, other=0.), out_ptr)
                coef = coef + tl.maximum(tl.sum(v * proj[None, :], axis=1), 0.)[:, None]
            out = tl.sum(coef * v, axis=0)
            tl.store(out_ptr + (g * N + n) * D + od, out.to(out_ptr.dtype.element_ty), mask=dmask & valid)


@jit
def _gates_bwd_kernel(table, proj_ptr, go_ptr, w_ptr, gate_ptr, K, N, D, G, KP, BG: tl.constexpr,
                      KB: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr, BV: tl.constexpr):
    """v3's gates and their gradients for BT tokens, one token a warp: per (token, instance g, source k) the dots
    proj_g . v_k and go_g . v_k, KB sources at a time, over chunks of BL x BV channels. Tiles are [BT, BG, KB, BL x
    BV] (tokens, instances, sources, channels): the tokens lie across the warps, a chunk's channels across a warp's
    lanes (a 16-byte vector each), the instances and sources in each thread. A chunk's products are summed over
    each thread's vector into [BT, BG, KB, BL] partial sums (viewed [..., BL, BV]: no data moves), and the lanes'
    sums are added once, at the end, within each warp: no exchange between warps from one chunk to the next, whose
    loads are in flight while one is summed (STREAM_STAGES: through shared memory, a barrier a chunk).
    (The whole-row kernel this replaced held a token's rows on 8 warps, one token a program: 197 registers, 8 warps
    an SM, and a barrier for each instance's two sums.) -> the gates' gradients (clamp's subgradient 1 at 0) into
    w_ptr and the gates into gate_ptr, both [N, BG, KP] (_gate_scratch)."""
    CW: tl.constexpr = BL * BV
    n = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)[:, None, None, None]  # [BT, 1, 1, 1]
    og = tl.arange(0, BG)[None, :, None, None]
    oc = tl.arange(0, CW)[None, None, None, :]
    tg = (n < N) & (og < G)
    for b in range(0, tl.cdiv(K, KB)):
        ok = b * KB + tl.arange(0, KB)
        rows_at = pointers_at(table, ok, ok < K, go_ptr)[None, None, :, None]  # [1, 1, KB, 1]
        rk = (n < N) & (ok < K)[None, None, :, None]
        pre = tl.zeros([BT, BG, KB, BL], dtype=tl.float32)
        gv = tl.zeros([BT, BG, KB, BL], dtype=tl.float32)
        for c0 in tl.range(0, D, CW, num_stages=STREAM_STAGES):
            c = c0 + oc
            v = tl.load(rows_at + n * D + c, mask=rk & (c < D), other=0.).to(tl.float32)  # [BT, 1, KB, CW]
            go = tl.load(go_ptr + (og * N + n) * D + c, mask=tg & (c < D), other=0.).to(tl.float32)  # [BT, BG, 1, CW]
            # the projection's chunk for each warp's token (the repeats from L1): in the tiles' layout
            proj = _rounded(tl.load(proj_ptr + og * D + c + 0 * n, mask=tg & (c < D), other=0.), go_ptr)
            pre += tl.sum(tl.reshape(v * proj, [BT, BG, KB, BL, BV]), axis=4)
            gv += tl.sum(tl.reshape(v * go, [BT, BG, KB, BL, BV]), axis=4)
        pre = tl.sum(pre, axis=3)  # [BT, BG, KB]
        gv = tl.sum(gv, axis=3)
        at = (n.reshape(BT, 1, 1) * BG + og.reshape(1, BG, 1)) * KP + ok[None, None, :]  # KB divides KP
        tl.store(w_ptr + at, tl.where(pre >= 0., gv, 0.), mask=n.reshape(BT, 1, 1) < N)  # clamp's subgradient 1 at 0
        tl.store(gate_ptr + at, tl.maximum(pre, 0.), mask=n.reshape(BT, 1, 1) < N)


@jit
def _source_grads_kernel(gtable, bias_ptr, proj_ptr, go_ptr, w_ptr, gate_ptr, K, N, D, G, SG, KP, KB: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr, VERSION: tl.constexpr):
    """The sources' gradients of BT tokens x BC channels: dv_k = sum_g (bias[g, k] + gate_gk) go_g (+ dgate_gk
    proj_g, v3), KB sources a step as one [BT, KB, BC] tile, stored or added to what the buffers hold (gtable:
    common.gradient_table). A stream of rows with no reduction: the tokens lie across the warps (the first dim, so
    that Triton lays every tile of the kernel, [BT, 1, BC] rows included, alike: no layout change), the channels
    across the lanes, the sources and the instances' sum in each thread. The gates and their gradients come from
    _gates_bwd_kernel (v3: w_ptr and gate_ptr [N, SG, KP])."""
    n = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)[:, None, None]
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, None, :]
    rows = (n < N) & (c < D)  # [BT, 1, BC]
    for b in range(0, tl.cdiv(K, KB)):
        ok = b * KB + tl.arange(0, KB)
        into, adding = gradients_at(gtable, ok, ok < K, go_ptr)
        ok = ok[None, :, None]
        kmask = ok < K
        tile = kmask & rows
        at = into[None, :, None] + n * D + c
        dv = tl.load(at, mask=tile & adding[None, :, None], other=0.).to(tl.float32)
        for g in range(G):
            go = tl.load(go_ptr + (g * N + n) * D + c, mask=rows, other=0.).to(tl.float32)  # [BT, 1, BC]
            if VERSION == 1:
                coef = _rounded(tl.load(bias_ptr + g * K + ok + 0 * n, mask=kmask & (n < N), other=0.), go_ptr)
            else:  # bias_ptr [G, K, d], a chunk of its rows for each warp's token (the repeats from L1)
                coef = _rounded(tl.load(bias_ptr + (g * K + ok) * D + c + 0 * n, mask=tile, other=0.), go_ptr)
            dv += coef * go
            if VERSION == 3:  # the gate and its gradient of each (token, source): [BT, KB, 1]
                at_g = (n * SG + g) * KP + ok
                gate_g = tl.load(gate_ptr + at_g, mask=kmask & (n < N), other=0.)
                dgate_g = tl.load(w_ptr + at_g, mask=kmask & (n < N), other=0.)
                proj = _rounded(tl.load(proj_ptr + g * D + c + 0 * n, mask=rows, other=0.), go_ptr)  # [BT, 1, BC]
                dv += gate_g * go + dgate_g * proj
        tl.store(at, dv.to(go_ptr.dtype.element_ty), mask=tile)


@jit
def _params_kernel(table, like_ptr, go_ptr, w_ptr, bias_part_ptr, proj_part_ptr, K, N, D, G, KP, TOK, BIAS_ROW,
                   PROJ_ROW, BK: tl.constexpr, BG: tl.constexpr, BCH: tl.constexpr, VERSION: tl.constexpr):
    """Program (channel chunk, block of BK sources, token split), over its split's tokens: dbias[g, c, k] =
    sum_n go[g, n, c] v_k[n, c] for its BK sources (v1: summed over its channels too) and (v3) dproj[g, c] =
    sum_n sum_k dgate[n, k, g] v_k[n, c] over its sources (w_ptr [N, BG, KP]: _gate_scratch). Each token's
    output gradient [BG, BCH] is read once for BK sources ([BK, BCH] in 16-byte loads), not once a source; the
    sums stay in [BK, BG, BCH] registers and go to the program's rows of the partial buffers, which common.sum_rows
    adds in order (the same bits every run). The tokens' loads are pipelined (STREAM_STAGES): a token's tiles are a
    few KB, and one at a time left each step waiting on its own loads.
    bias_part [splits (v1: x chunks), G x K (v2/v3: x d)] as [G, K, d] (whole rows of channels, contiguous),
    proj_part [splits x source blocks, G x d]."""
    chunk_id, block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ok = block * BK + tl.arange(0, BK)
    kmask = ok < K
    og = tl.arange(0, BG)
    gmask = og < G
    od = chunk_id * BCH + tl.arange(0, BCH)
    cmask = od < D
    rows_at = pointers_at(table, ok, kmask, like_ptr)  # [BK]
    dbias = tl.zeros([BK, BG, BCH], dtype=tl.float32)
    dproj = tl.zeros([BK, BG, BCH], dtype=tl.float32)  # summed over the sources once, at the end (v3)
    for t in tl.range(TOK, num_stages=STREAM_STAGES):
        n = token(split, t, TOK)
        valid = n < N
        # loaded as [BK, 1, BCH] and [1, BG, BCH], not as 2-D tiles broadcast after: the loads then land in the
        # accumulator's layout (2-D tiles took 10-30 more registers a thread and a layout change through shared memory)
        v = tl.load(rows_at[:, None, None] + n * D + od[None, None, :],
                    mask=kmask[:, None, None] & cmask[None, None, :] & valid, other=0.).to(tl.float32)
        go = tl.load(go_ptr + og[None, :, None].to(tl.int64) * N * D + n * D + od[None, None, :],
                     mask=gmask[None, :, None] & cmask[None, None, :] & valid, other=0.).to(tl.float32)
        dbias += v * go
        if VERSION == 3:
            # [BK, BG] expanded, not a [BK, BG, 1] load: that one repeats its loads over the channel axis's lanes
            dgate = tl.load(w_ptr + (n * BG + og[None, :]) * KP + ok[:, None], mask=kmask[:, None] & valid,
                            other=0.)[:, :, None]  # (padding instances: sums never stored, no mask needed)
            dproj += dgate * v
    kg = kmask[:, None] & gmask[None, :]  # [BK, BG]
    if VERSION == 1:
        row = split.to(tl.int64) * tl.num_programs(0) + chunk_id
        tl.store(bias_part_ptr + row * BIAS_ROW + og[None, :] * K + ok[:, None], tl.sum(dbias, axis=2), mask=kg)
    else:
        at = (og[None, :, None] * K + ok[:, None, None]) * D + od[None, None, :]
        tl.store(bias_part_ptr + split.to(tl.int64) * BIAS_ROW + at, dbias,
                 mask=kg[:, :, None] & cmask[None, None, :])
    if VERSION == 3:
        row = split.to(tl.int64) * tl.num_programs(1) + block
        tl.store(proj_part_ptr + row * PROJ_ROW + og[:, None] * D + od[None, :], tl.sum(dproj, axis=0),
                 mask=gmask[:, None] & cmask[None, :])


def _bias_rows(bias: Tensor, version: int) -> Tensor:
    """The bias as the kernels read it: v2/v3's [G, d, K] as [G, K, d] (a copy of G x d x K values), so that a
    chunk of one source's channels loads in 16-byte vectors instead of one strided value at a time; v1's scalars
    [G, K] in fp32 (exact; the kernel rounds them to the sources' dtype), since a lone bf16 scalar compiles to a
    2-byte load, which the resource check refuses."""
    return bias.float() if version == 1 else bias.transpose(1, 2).contiguous()


def _blocks(srcs: List[Tensor], bias: Tensor) -> Tuple[int, int, int, int]:
    """(NB, KB, BG, BCH) of the chunked forward kernel for K sources and G instances: chunks of BCH channels (a
    [BG, BCH] tile of about 1k values), KB sources a load, enough for a [KB, BCH] tile of rows to load 16 bytes a
    thread on 4 warps, and NB blocks of KB to cover K. 2 sources a load under the interpreter, so that the tests
    walk several blocks and a masked tail."""
    k, d = len(srcs), srcs[0].shape[1]
    bg = pow2(bias.shape[0])
    bch = chunk(d, bg)
    wide = 4 * 32 * 16 // srcs[0].element_size()  # values that 4 warps load at 16 bytes a thread (1,024 bf16)
    kb = min(pow2(k), 2 if interpreting() else max(1, wide // bch))
    return pow2(k) // kb, kb, bg, bch


ROWS_IN_REGISTERS = 32768  # fp32 values of a program's whole-row tiles (64 a thread at 16 warps): _rows_fit


def _rows_live(k: int) -> int:
    """The rows a whole-row forward program holds: the sources, an instance's bias rows, an output row and a
    projection row."""
    return 2 * pow2(k) + 2


def _rows_fit(k: int, d: int) -> bool:
    """Whether a token's k source rows, and what _rows_live adds, fit one program's registers (2-DCA's q/k/v and
    final GRNs at the 1B config's d = 2048 and up to 4 sources; tests/unit/test_kernels_aot.py compiles them
    without a spill): then the forward reads each row once (_fwd_rows_kernel), else it walks the rows in chunks of
    channels."""
    return _rows_live(k) * pow2(d) <= ROWS_IN_REGISTERS


def _triton_fwd(srcs: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int) -> Tensor:
    n, d = srcs[0].shape
    out = torch.empty((bias.shape[0], n, d), dtype=srcs[0].dtype, device=srcs[0].device)
    if n == 0:
        return out
    count, tok = programs(n, out.device, reduces=False)
    if _rows_fit(len(srcs), d):
        launch(_fwd_rows_kernel, (count,), (pointer_table(srcs), _bias_rows(bias, version),
                                            bias if proj is None else proj, out, len(srcs), n, d, bias.shape[0], tok),
               min(warps(pow2(d), _rows_live(len(srcs))), row_warps(pow2(d), out.element_size())),
               BK=pow2(len(srcs)), BD=pow2(d), VERSION=version)  # (row_warps: the sum over sources in each thread)
        return out
    nb, kb, bg, bch = _blocks(srcs, bias)
    gates = _gate_scratch(n, len(srcs), bias.shape[0], version, out.device)
    launch(_fwd_kernel, (count,), (pointer_table(srcs), _bias_rows(bias, version), bias if proj is None else proj,
                                   out, gates, len(srcs), n, d, bias.shape[0], tok),
           4, NB=nb, KB=kb, BG=bg, BCH=bch, VERSION=version)
    return out


def _gate_scratch(n: int, k: int, g: int, version: int, device: torch.device) -> Tensor:
    """v3's gates (or their gradients) per token, instance and source, fp32: [N, pow2(G), pow2(K)], so that a
    block of sources' gates lies contiguous, at a constant stride, and loads in vectors. The chunked kernels write
    the gates in pass 1 and read them back in pass 2 (pow2(K) x pow2(G) x 4 bytes a token, against its K rows of d
    values read twice); the backward kernels write the gate gradients for _params_kernel. A placeholder for v1/v2,
    which have none."""
    return torch.empty((n, pow2(g), pow2(k)) if version == 3 else (1,), dtype=F32, device=device)


# A warp a token in the backward kernels: 4 tokens a program on 4 warps.
TOKENS_A_PROGRAM = 4


def _vector(element_size: int) -> int:
    """Channels of one 16-byte load of a thread (8 bf16, 4 fp32); 2 under the interpreter, so that the tests walk
    several vectors, lanes and chunks, and their masked tails."""
    return 2 if interpreting() else 16 // element_size


def _gate_blocks(k: int, g: int, d: int, element_size: int) -> Tuple[int, int, int, int]:
    """(KB, BT, BL, BV) of _gates_bwd_kernel for K sources and G instances: a token a warp, a chunk of a warp's 32
    lanes x a 16-byte vector of channels each (fewer lanes for a narrow row), and KB sources at a time, up to 4 and
    at most 8 / pow2(G), so that a thread's partial sums and rows fit the default 128 registers (2-DCA at 1B: 4
    sources x 4 instances spilled 8-20 bytes there on sm_80 / sm_90 / sm_100; 2 x 4 take 122-128 with the chunks'
    loads pipelined, 16 warps an SM); then a token's output gradients are read once a block of sources, the second
    time from L2."""
    bv = _vector(element_size)
    if interpreting():
        return min(pow2(k), 2), 2, 2, bv
    return min(pow2(k), 4, max(1, 8 // pow2(g))), TOKENS_A_PROGRAM, min(32, pow2(cdiv(d, bv))), bv


def _grad_blocks(k: int, d: int, version: int, element_size: int, shared: bool) -> Tuple[int, int, int]:
    """(KB, BT, BC) of _source_grads_kernel: KB sources a step (one where two share a buffer; up to 4 with rows of
    bias, 8 with scalars), a token a warp, 32 lanes x a 16-byte vector of channels each."""
    bv = _vector(element_size)
    kb = 1 if shared else min(pow2(k), 2 if interpreting() else 8 if version == 1 else 4)
    if interpreting():
        return kb, 2, 2 * bv
    return kb, TOKENS_A_PROGRAM, min(pow2(d), 32 * bv)


def _param_blocks(k: int, g_block: int, d: int, version: int, element_size: int) -> Tuple[int, int]:
    """(sources, channels) of a _params_kernel program. Triton spreads a load over every thread, so a small tile
    loads narrow (a lone gradient row of 128 bf16 channels on 4 warps: 2 bytes a thread). So: a [g_block,
    channels] tile of output gradients that 4 warps load 8 bytes a thread or more, and rows of 128 bytes at least;
    then as many sources (up to 16; 8 for v3, which keeps two sums) as keep each [sources, g_block, channels] fp32
    sum within 4k values (32 registers a thread); then channels enough for the [sources, channels] tile of rows to
    load 16 bytes a thread. 2 sources and 4 channels under the interpreter, so that the tests walk several
    blocks of each and their masked tails."""
    if interpreting():
        return min(pow2(k), 2), chunk(d)
    wide = 4 * 32 * 16 // element_size  # values that 4 warps load at 16 bytes a thread (1,024 bf16)
    channels = min(pow2(d), max(wide // 2 // g_block, 128 // element_size))
    sources = min(pow2(k), 8 if version == 3 else 16, max(1, 4096 // (g_block * channels)))
    return sources, min(pow2(d), max(channels, wide // sources))


def _triton_bwd(go: Tensor, srcs: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int,
                grads: List[Tensor], adding: List[bool]):
    """Source gradients into `grads` (rows; added to those with `adding` set) -> (dbias, dproj or None), in the
    parameters' dtypes (fp32 where there is no token)."""
    n, d = srcs[0].shape
    g, k = bias.shape[0], len(srcs)
    if n == 0:
        dproj = torch.zeros(proj.shape, dtype=F32, device=go.device) if proj is not None else None
        return torch.zeros(bias.shape, dtype=F32, device=go.device), dproj
    bg = pow2(g)
    # one buffer for two sources: a tile of several sources would read it twice and store it twice, losing one
    # source's gradient; one source a step adds them in turn (meta tensors, recorded launches, share no memory)
    shared = go.device.type != "meta" and len({t.data_ptr() for t in grads}) < k
    w = _gate_scratch(n, k, g, version, go.device)  # the gates' gradients
    gates = _gate_scratch(n, k, g, version, go.device)
    table = pointer_table(srcs)
    if version == 3:
        kb, bt, bl, bv = _gate_blocks(k, g, d, go.element_size())
        launch(_gates_bwd_kernel, (cdiv(n, bt),), (table, proj, go, w, gates, k, n, d, g, w.shape[-1]), bt, BG=bg,
               KB=kb, BT=bt, BL=bl, BV=bv)
    kb, bt, bc = _grad_blocks(k, d, version, go.element_size(), shared)
    launch(_source_grads_kernel, (cdiv(n, bt), cdiv(d, bc)),
           (gradient_table(grads, adding), _bias_rows(bias, version), bias if proj is None else proj, go, w, gates, k,
            n, d, g, bg, w.shape[-1]), bt, KB=kb, BT=bt, BC=bc, VERSION=version)
    sources, channels = _param_blocks(k, bg, d, version, go.element_size())
    chunks, blocks = cdiv(d, channels), cdiv(k, sources)
    splits, tok = reduction_grid(n, chunks * blocks, go.device)
    bias_cols = g * k if version == 1 else g * k * d
    bias_parts = partial_sums(splits * chunks if version == 1 else splits, bias_cols, go.device)
    proj_parts = partial_sums(splits * blocks, g * d, go.device) if version == 3 else bias_parts
    launch(_params_kernel, (chunks, blocks, splits),
           (table, srcs[0], go, w, bias_parts, proj_parts, k, n, d, g, w.shape[-1], tok, bias_parts.stride(0),
            proj_parts.stride(0)),
           4, BK=sources, BG=bg, BCH=channels, VERSION=version)
    # in the parameters' dtypes; v2/v3 summed as [G, K, d] (rows of channels), the parameter's [G, d, K] one copy
    # (and cast) of G x d x K values away
    if version == 1:
        dbias = sum_rows(bias_parts, bias_cols, dtypes=[bias.dtype]).view(g, k)
    else:
        dbias = sum_rows(bias_parts, bias_cols).view(g, k, d).transpose(1, 2).to(bias.dtype,
                                                                                 memory_format=torch.contiguous_format)
    return dbias, sum_rows(proj_parts, g * d, dtypes=[proj.dtype]).view(g, d) if version == 3 else None


# --------------------------------------------------------------------------------------------------------------
# The torch twin
# --------------------------------------------------------------------------------------------------------------


def _torch_coefficient(v, bias, proj, version, k, dt):
    """(bias + gate) of source k for every instance: v1 [g, 1, 1], v2 [g, 1, d], v3 [g, N, d]; and pre."""
    ct = v.dtype
    b = bias[..., k].to(dt).to(ct)
    coef = b.view(-1, 1, 1) if version == 1 else b.unsqueeze(1)
    if version != 3:
        return coef, None
    pre = torch.einsum("nd,gd->gn", v, proj.to(dt).to(ct))
    return coef + pre.clamp(min=0).unsqueeze(-1), pre


def _torch_fwd(srcs, bias, proj, version):
    (n, d), dt = srcs[0].shape, srcs[0].dtype
    ct = accumulation_dtype(dt)
    out = torch.zeros(bias.shape[0], n, d, dtype=ct, device=srcs[0].device)
    for k, src in enumerate(srcs):
        v = src.to(ct)
        coef, _ = _torch_coefficient(v, bias, proj, version, k, dt)
        out += coef * v
    return out.to(dt)


def _torch_bwd(go, srcs, bias, proj, version, grads, adding):
    dt = srcs[0].dtype
    ct = accumulation_dtype(dt)
    go = go.to(ct)
    dbias = torch.zeros(bias.shape, dtype=ct, device=go.device)
    dproj = torch.zeros(proj.shape, dtype=ct, device=go.device) if proj is not None else None
    for k, src in enumerate(srcs):
        v = src.to(ct)
        coef, pre = _torch_coefficient(v, bias, proj, version, k, dt)
        gv = go * v  # [g, N, d]
        dbias[..., k] = gv.sum((1, 2)) if version == 1 else gv.sum(1)
        dv = (coef * go).sum(0)
        if version == 3:
            dgate = torch.where(pre >= 0, gv.sum(-1), 0.)  # clamp(min=0): subgradient 1 at 0
            dv = dv + torch.einsum("gn,gd->nd", dgate, proj.to(dt).to(ct))
            dproj += torch.einsum("gn,nd->gd", dgate, v)
        grads[k].copy_(dv + grads[k].to(ct) if adding[k] else dv)
    return dbias, dproj


# --------------------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mega_depth::dca_grn", mutates_args=())
def grn_op(sources: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int) -> Tensor:
    """K sources [*, d]; bias v1 [g, K], v2/v3 [g, d, K]; proj (v3) [g, d] -> [g, *, d]."""
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    srcs = source_rows(sources, d)
    fwd = _triton_fwd if uses_triton(srcs[0]) else _torch_fwd
    return fwd(srcs, bias.contiguous(), contiguous(proj), version).view(bias.shape[0], *lead, d)


@register_fake(grn_op)
def _(sources, bias, proj, version):
    return sources[0].new_empty((bias.shape[0], *sources[0].shape))


@torch.library.custom_op("mega_depth::dca_grn_backward", mutates_args=())
def grn_backward_op(grad: Tensor, sources: List[Tensor], bias: Tensor, proj: Optional[Tensor],
                    version: int) -> List[Tensor]:
    """-> [source gradients..., dbias, dproj (or empty)], the parameter gradients in the parameters' dtypes."""
    grads = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources]
    return grads + _backward_into(grad, sources, grads, [False] * len(sources), bias, proj, version)


@register_fake(grn_backward_op)
def _fake_backward(grad, sources, bias, proj, version):
    dproj = proj.new_empty(proj.shape) if proj is not None else nothing(grad)
    return [s.new_empty(s.shape) for s in sources] + [bias.new_empty(bias.shape), dproj]


@torch.library.custom_op("mega_depth::dca_grn_backward_into", mutates_args=("into",))
def grn_backward_into_op(grad: Tensor, sources: List[Tensor], into: List[Tensor], adding: List[bool], bias: Tensor,
                         proj: Optional[Tensor], version: int) -> List[Tensor]:
    """The source gradients stored into `into` (contiguous tensors shaped like the sources), or added to those with
    `adding` set (kernels/grad_sink.py) -> [dbias, dproj] as dca_grn_backward."""
    return _backward_into(grad, sources, into, adding, bias, proj, version)


@register_fake(grn_backward_into_op)
def _(grad, sources, into, adding, bias, proj, version):
    return _fake_backward(grad, sources, bias, proj, version)[len(sources):]


def _backward_into(grad, sources, into, adding, bias, proj, version) -> List[Tensor]:
    d = sources[0].shape[-1]
    srcs = source_rows(sources, d)
    bwd = _triton_bwd if uses_triton(srcs[0]) else _torch_bwd
    dbias, dproj = bwd(grad.reshape(bias.shape[0], -1, d).contiguous(), srcs, bias.contiguous(), contiguous(proj),
                       version, source_rows(into, d), adding)
    # in the parameters' dtypes (the Triton launcher's already are; the twin's are fp32 or wider until here)
    return [in_dtype(dbias, bias.dtype), nothing(grad) if dproj is None else in_dtype(dproj, proj.dtype)]


def _setup(ctx, inputs, output):
    sources, bias, proj, version = inputs
    ctx.save_for_backward(bias, proj, *sources)
    ctx.version = version
    ctx.sinks = grad_sink.sinks_of(sources)


def _backward(ctx, grad):
    bias, proj, *sources = ctx.saved_tensors
    need = ctx.needs_input_grad
    if ctx.sinks is None:
        out = call(grn_backward_op, grad, sources, bias, proj, ctx.version)
        grads = list(out[:-2])
    else:  # the sinks' buffers take the sources' gradients in the kernel (kernels/grad_sink.py)
        into, adding = grad_sink.buffers(ctx.sinks, sources)
        out = call(grn_backward_into_op, grad, sources, into, adding, bias, proj, ctx.version)
        grads = grad_sink.returned(ctx.sinks, into, need[0])
    return grads, cast_grad(out[-2], bias, need[1]), cast_grad(out[-1], proj, need[2]), None


autograd(grn_op, _backward, _setup)


def grn_apply_sources(sources: Sources, bias: Tensor, proj: Optional[Tensor], version: str) -> Tensor:
    """== mixing.grn_apply(torch.stack(sources), ...): K sources [*, d]; bias v1 [g, K], v2/v3 [g, d, K]; proj
    (v3) [g, d]. -> [g, *, d]."""
    if version not in mixing.GRN_VERSIONS:
        raise ValueError(f"unknown GRN version {version!r}; choose one of {mixing.GRN_VERSIONS}")
    sources = as_list(sources)
    if bias.shape[-1] != len(sources):
        raise ValueError(f"GRN bias for {bias.shape[-1]} sources got {len(sources)}")
    if version == "v3" and proj is None:
        raise ValueError("GRN v3 needs proj")
    proj = proj if version == "v3" else None
    if not traced(sources) and not traced((bias, proj)):  # readers of one source add into one gradient buffer
        sources = grad_sink.aliased(sources)
    return call(grn_op, sources, bias, proj, int(version[1]))


def dwa_mix(outputs: Sources, alpha: Tensor) -> Tensor:
    """== mixing.dwa(torch.stack(outputs), alpha): DenseFormer's depth-weighted average is a GRN v1 with one
    instance (a plain scalar per source; the scalar rounded to the outputs' dtype, fp32 sums, as the einsum of the
    reference). The outputs are read in place, not stacked (an einsum over the stack ran as a batched GEMM), and a
    stored output's gradients from every later DWA are summed in the kernel. -> [*, d]."""
    outputs = as_list(outputs)
    # squeeze, not [0]: the backward of an index zero-fills a whole [1, N, d] gradient to write its one slice
    return grn_apply_sources(outputs, alpha.view(1, len(outputs)), None, "v1").squeeze(0)
