"""mHC's coefficient projection, fused: `mhc_projection` (reference: mixing.mhc_projection).

    proj = x~ phi^T [*, m]      mean_square = mean(x~^2) [*, 1]      x~ = the n streams of a token concatenated [n*d]

The reference takes an fp32 copy of the streams, flattens it (a clone), squares and averages it and runs an fp32 GEMM
[N, n*d] @ [n*d, m]: about 7 passes of the n streams a sublayer, plus as many again in backward (about 330 GB a 1B
mHC step). Here one pass reads the streams once for both outputs, as the published fused mHC kernels do: the
products on the tensor cores from the streams' own dtype (exact, fp32 sums) and the sum of squares in fp32. One
program per (token block, stream), so that the grid fills the GPU: each stream's share of both outputs is a row of
fp32 partial sums, added in order after (common.sum_rows: deterministic).

Backward, one kernel (streams._sum_kernel): the stream gradient (g_proj phi + 2 g_ms x~ / (n*d)) and phi's gradient
(g_proj^T x~) from one read of the streams, phi's by fp32 partial sums a token split, summed in order (no atomics,
deterministic); it read the streams again in a kernel of its own until 2026-12-01. The products with the fp32
gradients run as three TF32 products (fp32 accuracy). Where the streams have a gradient sink (kernels/grad_sink.py)
that the stream read and write also feed, both are left to it (g_proj, g_ms and phi kept): phi goes through the
sink's node beside the streams (grad_sink.aliased_with, where the projection is the streams' first reader, as in
mHC's sublayer), and the sink's one pass adds every reader's part and makes phi's gradient (streams.sum_deferred).

Streams come as [n, *, d] with free stream and token strides (an expanded embedding or a pipeline tensor's view is
read in place). The op is `mega_depth::mhc_projection`.
"""

from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from mega_depth.kernels import grad_sink
from mega_depth.kernels.common import (F32, RESIDENT_WARPS, accumulation_dtype, cast_grad, cdiv, dot32, dot_t, in_dtype,
                                       interpreting, jit, launch, partial_sums, partial_width, pow2, register_fake,
                                       sum_rows, tl, uses_triton)
from mega_depth.kernels.eager import autograd, call, traced
from mega_depth.kernels.streams import (defer, deferring, phi_tile, stream_gradient, stream_rows, stream_tile, sum_into,
                                        tile_blocks, token_block)

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------
# Streams [NS, N, D] (stream stride SN, token stride ST, unit channel stride); phi [M, NS * D] contiguous; proj
# [N, M] and mean_square [N] in fp32; the stream gradient [NS, N, D] contiguous.


@jit
def _fwd_kernel(s_ptr, phi_ptr, proj_ptr, ms_ptr, N, D, M, SN, ST, PROW, MROW, NS: tl.constexpr,
                BT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, HALF: tl.constexpr):
    """Program (token block, stream i): stream i's share of BT tokens' products, acc [BT, BM] += x_i [BT, BC] @
    phi_i^T over its chunks, and of their mean square, into row i of the partial sums proj_ptr [NS, PROW] (token t's
    at t * M) and ms_ptr [NS, MROW]; the launcher adds the NS rows in order (common.sum_rows). A program a stream:
    n times the programs of token blocks alone (128 at the 1B mHC config, 32 at 7B's, for 132 SMs)."""
    ot = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    i = tl.program_id(1)
    tmask = ot < N
    om = tl.arange(0, BM)
    mmask = om < M
    acc = tl.zeros([BT, BM], dtype=tl.float32)
    squares = tl.zeros([BT], dtype=tl.float32)
    for c0 in range(0, D, BC):
        oc = c0 + tl.arange(0, BC)
        cmask = oc < D
        x = stream_tile(s_ptr, i, ot, oc, tmask, cmask, SN, ST)
        w = phi_tile(phi_ptr, i, om, oc, mmask, cmask, NS, D)
        if HALF:  # bf16 (fp16) both: exact products on the tensor cores, fp32 sums
            acc = dot_t(x, w, acc)
        else:  # fp32, or phi kept in another dtype than the streams: fp32 operands, three TF32 products
            acc += dot32(x, tl.trans(w))
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
    tl.store(proj_ptr + i * PROW + ot[:, None] * M + om[None, :], acc, mask=tmask[:, None] & mmask[None, :])
    tl.store(ms_ptr + i * MROW + ot, squares / (NS * D), mask=tmask)


def _fwd_channels(d: int, bc: int, element_size: int) -> int:
    """Channels a forward step: 16-bit rows of 256 bytes ([32, 128] tiles on 8 warps), half the dependent steps a
    program of 128-byte rows. Liger's mhc_mm_norm steps 512 bytes ([32, 256] on 4 warps, no register cap) and ran
    2.65x faster than ours on the H200 (2026-11-30); here [32, 256] spilled at every cap that keeps two programs an
    SM (sm_90), [32, 128] on 8 warps compiles to 128 registers without a spill. fp32 keeps 128-byte rows."""
    if interpreting() or element_size != 2:
        return bc
    return min(128, max(bc, pow2(d)))


FWD_WARPS = {2: 8, 4: 4}  # the forward's warps by element size: 8 for the 16-bit [32, 128] tiles (_fwd_channels)


def _triton_fwd(s: Tensor, phi: Tensor):
    ns, n, d = s.shape
    m = phi.shape[0]
    if not n:
        return torch.empty((n, m), dtype=F32, device=s.device), torch.empty((n,), dtype=F32, device=s.device)
    bt, bm, bc = tile_blocks(d, m, s.element_size())
    bt, bc = token_block(bt, n, ns, s.device), _fwd_channels(d, bc, s.element_size())
    # each stream's share, summed in order after (deterministic; the stream-split grid fills the GPU): the
    # projection's and the mean square's side by side in one row, which one sum_rows launch reduces
    width = partial_width(n * m)
    parts_proj = partial_sums(ns, width + n, s.device)
    parts_ms = parts_proj[:, width:]
    # fp32 tiles take one block's whole register file (up to 201 registers); 16-bit ones fit the default 128
    launch(_fwd_kernel, (cdiv(n, bt), ns), (s, phi, parts_proj, parts_ms, n, d, m, s.stride(0), s.stride(1),
                                            parts_proj.stride(0), parts_ms.stride(0)),
           FWD_WARPS.get(s.element_size(), 4), resident_warps=RESIDENT_WARPS if s.element_size() == 2 else 1,
           NS=ns, BT=bt, BM=bm, BC=bc, HALF=phi.dtype == s.dtype and s.element_size() == 2)
    proj, ms = sum_rows(parts_proj, n * m, tail=(width, n, F32))
    return proj.view(n, m), ms


# --------------------------------------------------------------------------------------------------------------
# The torch twin: one stream in flight at a time (no copy of all n)
# --------------------------------------------------------------------------------------------------------------


def _torch_fwd(s: Tensor, phi: Tensor):
    ns, n, d = s.shape
    ct = accumulation_dtype(s.dtype)
    proj = torch.zeros((n, phi.shape[0]), dtype=ct, device=s.device)
    squares = torch.zeros((n,), dtype=ct, device=s.device)
    for i in range(ns):
        x = s[i].to(ct)
        proj += x @ phi[:, i * d:(i + 1) * d].to(ct).T
        squares += x.pow(2).sum(-1)
    return proj, squares / (ns * d)


# --------------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mega_depth::mhc_projection", mutates_args=())
def projection_op(streams: Tensor, phi: Tensor) -> List[Tensor]:
    """streams [n, *, d], phi [m, n*d] -> [x~ phi^T [*, m], mean(x~^2) [*, 1]] (fp32 at least)."""
    s = stream_rows(streams)
    proj, ms = (_triton_fwd if uses_triton(s) else _torch_fwd)(s, phi.contiguous())
    lead = streams.shape[1:-1]
    return [proj.view(*lead, phi.shape[0]), ms.view(*lead, 1)]


@register_fake(projection_op)
def _(streams, phi):
    lead, ct = streams.shape[1:-1], accumulation_dtype(streams.dtype)
    return [streams.new_empty((*lead, phi.shape[0]), dtype=ct), streams.new_empty((*lead, 1), dtype=ct)]


@torch.library.custom_op("mega_depth::mhc_projection_backward", mutates_args=())
def projection_backward_op(grad_proj: Tensor, grad_mean_square: Tensor, streams: Tensor,
                           phi: Tensor) -> List[Tensor]:
    """-> [stream gradients [n, *, d], phi's gradient [m, n*d] (phi's dtype)]."""
    into = torch.empty_like(streams, memory_format=torch.contiguous_format)
    return [into, _backward_into(grad_proj, grad_mean_square, streams, phi, into, False)]


@register_fake(projection_backward_op)
def _fake_backward(grad_proj, grad_mean_square, streams, phi):
    return [streams.new_empty(streams.shape), phi.new_empty(phi.shape)]


@torch.library.custom_op("mega_depth::mhc_projection_backward_into", mutates_args=("into",))
def projection_backward_into_op(grad_proj: Tensor, grad_mean_square: Tensor, streams: Tensor, phi: Tensor,
                                into: Tensor, adding: bool) -> Tensor:
    """The stream gradients stored into `into` (contiguous, shaped like the streams), or added to it with `adding`
    set (kernels/grad_sink.py) -> phi's gradient, as mhc_projection_backward."""
    return _backward_into(grad_proj, grad_mean_square, streams, phi, into, adding)


@register_fake(projection_backward_into_op)
def _(grad_proj, grad_mean_square, streams, phi, into, adding):
    return _fake_backward(grad_proj, grad_mean_square, streams, phi)[1]


def _backward_into(grad_proj, grad_mean_square, streams, phi, into, adding) -> Tensor:
    s = stream_rows(streams)
    m, ct = phi.shape[0], accumulation_dtype(streams.dtype)
    g_proj = grad_proj.reshape(-1, m).to(ct).contiguous()
    g_ms = grad_mean_square.reshape(-1).to(ct).contiguous()
    dphi = sum_into(into.view_as(s), adding, s, proj=(g_proj, g_ms, phi.contiguous()), phi_grad=True)
    return in_dtype(dphi, phi.dtype)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.sinks = grad_sink.sinks_of(inputs[:1])
    ctx.phi_companion = grad_sink.companion_of(inputs[1], ctx.sinks)  # phi through the streams' sink: its index


def _backward(ctx, grads):
    streams, phi = ctx.saved_tensors
    g_proj, g_ms = grads
    if g_proj is None or g_ms is None:  # one output unused: its gradient is zero
        lead, ct = streams.shape[1:-1], accumulation_dtype(streams.dtype)
        g_proj = g_proj if g_proj is not None else streams.new_zeros((*lead, phi.shape[0]), dtype=ct)
        g_ms = g_ms if g_ms is not None else streams.new_zeros((*lead, 1), dtype=ct)
    if ctx.phi_companion is not None and deferring(ctx):
        # both gradients left to the streams' sink: its pass over the streams makes phi's too (sum_deferred)
        defer(ctx, "proj", g_proj, g_ms, phi, ctx.phi_companion)
        return None, None
    ds, (dphi,) = stream_gradient(ctx, streams, projection_backward_op, projection_backward_into_op, g_proj, g_ms,
                                  streams, phi)
    return ds if ctx.needs_input_grad[0] else None, cast_grad(dphi, phi, ctx.needs_input_grad[1])


autograd(projection_op, _backward, _setup)


def mhc_projection(streams: Tensor, phi: Tensor):
    """== mixing.mhc_projection(streams, phi): streams [n, *, d], phi [m, n*d] -> (proj [*, m], mean square [*, 1]),
    fp32. Where the projection is the streams' first reader (mHC's sublayer), phi goes through their gradient sink's
    node (grad_sink.aliased_with): the streams' one gradient pass makes phi's gradient too."""
    if not traced([streams, phi]):
        streams, (phi,) = grad_sink.aliased_with(streams, [phi])
    proj, mean_square = call(projection_op, streams, phi)
    return proj, mean_square
