"""DCA's generalised residuals over the stack, fused: `grn_apply_sources` (reference: mixing.grn_apply).

    out[g] = sum_k (bias[g, :, k] + ReLU(proj[g] . G[k])) * G[k]     (v1: a scalar bias per source; v2: no ReLU)

for the g GRN instances of one call (DCA: 3 for q/k/v, 1 for the final mix). Contract: the K stack entries are
read in place; forward reads each once for all instances; saves bias, proj and the entries (references); backward
recomputes the v3 gates (clamp's subgradient 1 at 0, as the reference). The op is `mega_depth::dca_grn`.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from mega_depth.kernels.common import (F32, Sources, accumulation_dtype, as_list, cast_grad, contiguous, jit, launch,
                                       nothing, pointer_at, pointer_table, pow2, programs, rows, tl, token,
                                       uses_triton, warps)
from mega_depth.model import mixing

# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@jit
def _coefficient(bias_ptr, og, od, gmask, mask2, k, K, D, like_ptr, VERSION: tl.constexpr):
    """bias of source k for every instance (rounded to the sources' dtype), [BG, 1] (v1) or [BG, BD]."""
    if VERSION == 1:
        b = tl.load(bias_ptr + og * K + k, mask=gmask, other=0.)[:, None]
    else:
        b = tl.load(bias_ptr + og[:, None] * D * K + od[None, :] * K + k, mask=mask2, other=0.)
    return b.to(like_ptr.dtype.element_ty).to(tl.float32)


@jit
def _fwd_kernel(table, bias_ptr, proj_ptr, out_ptr, K, N, D, G, TOK, BG: tl.constexpr, BD: tl.constexpr,
                VERSION: tl.constexpr):
    pid = tl.program_id(0)
    og = tl.arange(0, BG)
    od = tl.arange(0, BD)
    gmask = og < G
    dmask = od < D
    mask2 = gmask[:, None] & dmask[None, :]
    if VERSION == 3:
        proj = tl.load(proj_ptr + og[:, None] * D + od[None, :], mask=mask2, other=0.)
        proj = proj.to(out_ptr.dtype.element_ty).to(tl.float32)
    for t in range(TOK):
        n = token(pid, t, TOK)
        acc = tl.zeros([BG, BD], dtype=tl.float32)
        for k in range(K):  # each source read once for all G instances
            v = tl.load(pointer_at(table, k, out_ptr) + n * D + od, mask=dmask & (n < N), other=0.).to(tl.float32)
            coef = _coefficient(bias_ptr, og, od, gmask, mask2, k, K, D, out_ptr, VERSION)
            if VERSION == 3:
                coef = coef + tl.maximum(tl.sum(proj * v[None, :], axis=1), 0.)[:, None]
            acc += coef * v[None, :]
        orow = og[:, None].to(tl.int64) * N * D + n * D + od[None, :]
        tl.store(out_ptr + orow, acc.to(out_ptr.dtype.element_ty), mask=mask2 & (n < N))


@jit
def _bwd_kernel(table, gtable, bias_ptr, proj_ptr, go_ptr, dbias_ptr, dproj_ptr, K, N, D, G, TOK,
                BG: tl.constexpr, BD: tl.constexpr, VERSION: tl.constexpr):
    """Sources outside, tokens inside: a source's gradient needs nothing from the other sources, and the bias
    gradient of source k is then one register sum over the program's tokens (one atomic add per program)."""
    pid = tl.program_id(0)
    og = tl.arange(0, BG)
    od = tl.arange(0, BD)
    gmask = og < G
    dmask = od < D
    mask2 = gmask[:, None] & dmask[None, :]
    if VERSION == 3:
        proj = tl.load(proj_ptr + og[:, None] * D + od[None, :], mask=mask2, other=0.)
        proj = proj.to(go_ptr.dtype.element_ty).to(tl.float32)
        dproj = tl.zeros([BG, BD], dtype=tl.float32)
    for k in range(K):
        src = pointer_at(table, k, go_ptr)
        dst = pointer_at(gtable, k, go_ptr)
        bias = _coefficient(bias_ptr, og, od, gmask, mask2, k, K, D, go_ptr, VERSION)
        dbias = tl.zeros([BG, BD], dtype=tl.float32)
        for t in range(TOK):
            n = token(pid, t, TOK)
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
            tl.store(dst + n * D + od, dv.to(go_ptr.dtype.element_ty), mask=dmask & (n < N))
        if VERSION == 1:
            tl.atomic_add(dbias_ptr + og * K + k, tl.sum(dbias, axis=1), mask=gmask)
        else:
            tl.atomic_add(dbias_ptr + og[:, None] * D * K + od[None, :] * K + k, dbias, mask=mask2)
    if VERSION == 3:
        tl.atomic_add(dproj_ptr + og[:, None] * D + od[None, :], dproj, mask=mask2)


def _triton_fwd(srcs: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int) -> Tensor:
    n, d = srcs[0].shape
    g = bias.shape[0]
    out = torch.empty((g, n, d), dtype=srcs[0].dtype, device=srcs[0].device)
    if n == 0:
        return out
    bg, bd = pow2(g), pow2(d)
    count, tok = programs(n, out.device, reduces=False)
    launch(_fwd_kernel, (count,), (pointer_table(srcs), bias, bias if proj is None else proj, out, len(srcs), n, d,
                                   g, tok),
           warps(bg * bd, 3), BG=bg, BD=bd, VERSION=version)
    return out


def _triton_bwd(go: Tensor, srcs: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int):
    """-> (source gradients, dbias fp32, dproj fp32 or None)."""
    n, d = srcs[0].shape
    g = bias.shape[0]
    grads = [torch.empty_like(s) for s in srcs]
    dbias = torch.zeros(bias.shape, dtype=F32, device=go.device)
    dproj = torch.zeros(proj.shape, dtype=F32, device=go.device) if proj is not None else None
    if n == 0:
        return grads, dbias, dproj
    bg, bd = pow2(g), pow2(d)
    count, tok = programs(n, go.device, reduces=True)
    launch(_bwd_kernel, (count,), (pointer_table(srcs), pointer_table(grads), bias, bias if proj is None else proj,
                                   go, dbias, dbias if dproj is None else dproj, len(srcs), n, d, g, tok),
           warps(bg * bd, 5), BG=bg, BD=bd, VERSION=version)
    return grads, dbias, dproj


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


def _torch_bwd(go, srcs, bias, proj, version):
    dt = srcs[0].dtype
    ct = accumulation_dtype(dt)
    go = go.to(ct)
    dbias = torch.zeros(bias.shape, dtype=ct, device=go.device)
    dproj = torch.zeros(proj.shape, dtype=ct, device=go.device) if proj is not None else None
    grads = []
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
        grads.append(dv.to(dt))
    return grads, dbias, dproj


# --------------------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mega_depth::dca_grn", mutates_args=())
def grn_op(sources: List[Tensor], bias: Tensor, proj: Optional[Tensor], version: int) -> Tensor:
    """K sources [*, d]; bias v1 [g, K], v2/v3 [g, d, K]; proj (v3) [g, d] -> [g, *, d]."""
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    srcs = [rows(s, d) for s in sources]
    fwd = _triton_fwd if uses_triton(srcs[0]) else _torch_fwd
    return fwd(srcs, bias.contiguous(), contiguous(proj), version).view(bias.shape[0], *lead, d)


@grn_op.register_fake
def _(sources, bias, proj, version):
    return sources[0].new_empty((bias.shape[0], *sources[0].shape))


@torch.library.custom_op("mega_depth::dca_grn_backward", mutates_args=())
def grn_backward_op(grad: Tensor, sources: List[Tensor], bias: Tensor, proj: Optional[Tensor],
                    version: int) -> List[Tensor]:
    """-> [source gradients..., dbias, dproj (or empty)], the parameter gradients in fp32 (at least)."""
    d = sources[0].shape[-1]
    srcs = [rows(s, d) for s in sources]
    bwd = _triton_bwd if uses_triton(srcs[0]) else _torch_bwd
    grads, dbias, dproj = bwd(grad.reshape(bias.shape[0], -1, d).contiguous(), srcs, bias.contiguous(),
                              contiguous(proj), version)
    return [gr.view(s.shape) for gr, s in zip(grads, sources)] + [dbias, nothing(grad) if dproj is None else dproj]


@grn_backward_op.register_fake
def _(grad, sources, bias, proj, version):
    ct = accumulation_dtype(sources[0].dtype)
    dproj = proj.new_empty(proj.shape, dtype=ct) if proj is not None else nothing(grad)
    return [s.new_empty(s.shape) for s in sources] + [bias.new_empty(bias.shape, dtype=ct), dproj]


def _setup(ctx, inputs, output):
    sources, bias, proj, version = inputs
    ctx.save_for_backward(bias, proj, *sources)
    ctx.version = version


def _backward(ctx, grad):
    bias, proj, *sources = ctx.saved_tensors
    out = grn_backward_op(grad, sources, bias, proj, ctx.version)
    need = ctx.needs_input_grad
    return list(out[:-2]), cast_grad(out[-2], bias, need[1]), cast_grad(out[-1], proj, need[2]), None


grn_op.register_autograd(_backward, setup_context=_setup)


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
    return grn_op(sources, bias, proj if version == "v3" else None, int(version[1]))
