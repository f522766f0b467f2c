"""Fused depth-mixing Functions: the reference math of mega_depth/model/mixing.py with a memory contract.

Each public function below has the semantics of its reference in mixing.py (values and gradients, fp32 depth
weights, outputs in the input dtype) and runs one torch.autograd.Function whose contract is the same on every
device: forward saves for backward only references to the tensors it read and, where noted, small per-token
scalars; backward recomputes the rest (logits, RMS norms, depth weights) from those references. No stacked copy
of a set of sources is ever made or saved: the Triton kernels read a set through a table of data pointers, the
torch twins loop over it. A set may also be passed stacked ([K, *, d]): it is then taken as its K views.

    attnres_mix_sources(sources, query, key_norm_weight, eps, weight="softmax", heads=1)
        == mixing.attnres_mix(torch.stack(sources), ...)
        saves: query, key_norm_weight, the K sources (references); nothing computed.
        forward: one read of each source per token (an online softmax over the sources).
        backward: pass 1 recomputes logits, RMS and depth weights per token, pass 2 writes the K gradients.
    attnres_phase1_sources(completed, queries, key_norm_weights, eps, weight="softmax", heads=1)
        == mixing.attnres_block_phase1(torch.stack(completed), ...)
        saves: queries, key_norm_weights, the n blocks (references) and its own output m [S, *, H] (fp32, per
        token): m is a detached stabiliser, so p_sj = exp(l_sj - m_s) is local to block j and backward is one
        pass over the blocks. m (and z, for sigmoid weights) are non-differentiable outputs, as in the reference.
    attnres_phase2(m, z, o, partial, query, key_norm_weight, eps, weight="softmax", heads=1)
        == mixing.attnres_block_phase2(...)
        saves: m, z, o, partial, query, key_norm_weight (references); backward recomputes the partial's logit.
        (sigmoid weights without a partial: returns o itself, like the reference.)
    grn_apply_sources(sources, bias, proj, version)
        == mixing.grn_apply(torch.stack(sources), ...)
        saves: bias, proj, the K sources (references); backward recomputes the v3 gates (clamp: gradient 1 at 0).
    depth_attention_mix(query, key, value, cand_keys, cand_values, gqa_mode="query")
        == mixing.depth_attention_mix(...)
        saves: query, key, value, the C candidate keys and values (references); backward recomputes the scores
        and the depth softmax (two passes over the candidates). C = 0 / None: the value expanded, no Function.
    streams_in(streams, weights) == mixing.streams_in(...)            (HC's A_m X, mHC's H_pre X)
        saves: streams, weights (references). One read of each of the n streams per token.
    streams_out(streams, output, mix, post) == mixing.streams_out(...)  (HC / mHC's residual merge)
        saves: streams, output, mix, post (references). Forward reads each stream and the output once and writes
        the n new streams: (n + 1) d reads per token, where the reference's einsum and broadcast add make and
        re-read intermediates. Backward is one pass too.
    sinkhorn(logits, iters, order="paper", eps_style="clamp", eps=1e-6) == mixing.sinkhorn(...)  (mHC's H_res)
        saves: the logits (a reference). Forward runs every iteration in one kernel (eagerly, a few kernels per
        iteration); backward recomputes each iteration's input from the logits, last iteration first.

Dispatch: only the inner compute differs. Triton kernels (mega_depth/kernels/fused_triton.py) run for CUDA
tensors, or for any tensor when FORCE_TRITON is set (env MEGA_DEPTH_KERNELS_FORCE_TRITON=1 at import, or assign
the module attribute; with TRITON_INTERPRET=1 this runs the kernels on CPU tensors, as the tests do). Otherwise
(CPU tensors, fp64, or no triton) a torch implementation of the same computation (`_TorchOps`) runs, holding one
source in fp32 at a time. The Triton path takes fp32 / bf16 / fp16; it builds its pointer tables from the host
on every call (not CUDA-graph capturable) and sums parameter gradients with fp32 atomics (last-bit
nondeterministic on a GPU). Backward is once-differentiable.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from mega_depth.model import mixing

FORCE_TRITON = os.environ.get("MEGA_DEPTH_KERNELS_FORCE_TRITON", "0") == "1"

try:  # triton is optional: without it every device runs the torch twins
    from mega_depth.kernels import fused_triton as _triton_ops
    TRITON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - depends on the environment
    _triton_ops = None
    TRITON_IMPORT_ERROR = exc

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Sources = Union[Tensor, Sequence[Tensor]]


def triton_available() -> bool:
    return _triton_ops is not None


def uses_triton(t: Tensor) -> bool:
    """Whether the Functions run the Triton kernels for inputs like `t`."""
    return _triton_ops is not None and t.dtype in _TRITON_DTYPES and (t.is_cuda or FORCE_TRITON)


def _ops(t: Tensor):
    return _triton_ops if uses_triton(t) else _TorchOps


# --------------------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------------------


def _as_list(sources: Sources) -> List[Tensor]:
    """A stacked [K, *, d] tensor is taken as its K views (no copy), so the functions also replace the
    references' stacked signatures."""
    out = list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)
    if not out:
        raise ValueError("at least one source is needed")
    first = out[0]
    for s in out[1:]:
        if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(f"sources differ: {tuple(s.shape)} {s.dtype} {s.device} vs "
                             f"{tuple(first.shape)} {first.dtype} {first.device}")
    return out


def _rows(t: Tensor, d: int) -> Tensor:
    """[*, d] as contiguous token rows [N, d]: a view when the layout allows, else a transient copy."""
    t = t.reshape(-1, d)
    return t if t.is_contiguous() else t.contiguous()


def _head_rows(t: Tensor) -> Tensor:
    """[*, h, hn] as [N, h, hn] with contiguous channels (token and head strides stay free: a key split off a
    fused QKV projection is read in place)."""
    t = t.reshape(-1, *t.shape[-2:])
    return t if t.stride(-1) == 1 else t.contiguous()


def _contig(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _weight(weight: str) -> bool:
    if weight not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown depth weight {weight!r}; choose softmax or sigmoid")
    return weight == "sigmoid"


def _heads(d: int, heads: int) -> int:
    if heads < 1 or d % heads:
        raise ValueError(f"hidden size {d} does not split into {heads} heads")
    return int(heads)


def _cast(grad: Optional[Tensor], like: Optional[Tensor], needed: bool) -> Optional[Tensor]:
    if grad is None or like is None or not needed:
        return None
    return grad.reshape(like.shape).to(like.dtype)


# --------------------------------------------------------------------------------------------------------------
# The torch twins of the kernels (same signatures and results as fused_triton's launchers)
# --------------------------------------------------------------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: at least fp32 (fp64 stays fp64, like the reference's fp32())."""
    return torch.promote_types(dtype, torch.float32)


def _fold(q: Tensor, g: Optional[Tensor], dtype: torch.dtype, ct: torch.dtype) -> Tensor:
    """gain * query, rounded to the source dtype like the reference's folded query."""
    f = q.to(ct) if g is None else g.to(ct) * q.to(ct)
    return f.to(dtype).to(ct)


def _rinv(v: Tensor, eps: float) -> Tensor:
    """1 / RMS over the whole row of v [..., H, C] -> [...]."""
    return torch.rsqrt(v.pow(2).mean((-2, -1)) + eps)


class _StreamOps:
    """Torch twins of the stream kernels: streams [n, N, d] (free strides), weights / post [n, N], mix [n, N, n];
    a coefficient is rounded to the streams' dtype, then everything is summed in fp32 (as the kernels do)."""

    @staticmethod
    def _coef(c, dt, ct):
        return c.to(dt).to(ct)

    @staticmethod
    def streams_in_fwd(s, w):
        dt, ct = s.dtype, _acc(s.dtype)
        out = torch.zeros(s.shape[1:], dtype=ct, device=s.device)
        for i in range(s.shape[0]):
            out += _StreamOps._coef(w[i], dt, ct).unsqueeze(-1) * s[i].to(ct)
        return out.to(dt)

    @staticmethod
    def streams_in_bwd(go, s, w):
        dt, ct = s.dtype, _acc(s.dtype)
        go = go.to(ct)
        ds = (_StreamOps._coef(w, dt, ct).unsqueeze(-1) * go).to(dt)
        dw = torch.stack([(s[i].to(ct) * go).sum(-1) for i in range(s.shape[0])])
        return ds, dw

    @staticmethod
    def streams_out_fwd(s, y, mix, post):
        dt, ct = s.dtype, _acc(s.dtype)
        out = _StreamOps._coef(post, dt, ct).unsqueeze(-1) * y.to(ct)
        for i in range(s.shape[0]):
            out += _StreamOps._coef(mix[i], dt, ct).t().unsqueeze(-1) * s[i].to(ct)  # [n (to), N, d]
        return out.to(dt)

    @staticmethod
    def streams_out_bwd(go, s, y, mix, post):
        dt, ct = s.dtype, _acc(s.dtype)
        go = go.to(ct)
        dy = (_StreamOps._coef(post, dt, ct).unsqueeze(-1) * go).sum(0).to(dt)
        dpost = (go * y.to(ct)).sum(-1)
        ds, dmix = [], []
        for i in range(s.shape[0]):
            x = s[i].to(ct)
            ds.append((_StreamOps._coef(mix[i], dt, ct).t().unsqueeze(-1) * go).sum(0).to(dt))
            dmix.append((go * x).sum(-1).t())  # [N, n (to)]
        return torch.stack(ds), dy, torch.stack(dmix), dpost


class _SinkhornOps:
    """Torch twin of the Sinkhorn kernels: the reference forward; backward recomputes it and differentiates."""

    @staticmethod
    def sinkhorn_fwd(r, iters, order, eps_style, eps):
        return mixing.sinkhorn(r, iters, order, eps_style, eps)

    @staticmethod
    def sinkhorn_bwd(go, r, iters, order, eps_style, eps):
        with torch.enable_grad():
            r = r.detach().requires_grad_()
            return torch.autograd.grad(mixing.sinkhorn(r, iters, order, eps_style, eps), r, go)[0]


class _TorchOps(_StreamOps, _SinkhornOps):
    """The kernels' computation in torch: one source in flight at a time, per-token scalars kept for the rest."""

    @staticmethod
    def _accumulate(srcs, f, source_shape, out_shape, ct, g, eps, sigmoid):
        """One pass over the sources: logits against the folded queries f, and the weighted sum with an online
        softmax (running max m and normaliser z; unnormalised acc) or sigmoid weights. Sources are viewed as
        source_shape [..., H, C] and broadcast against f; acc is out_shape [..., H, C]."""
        acc = torch.zeros(out_shape, dtype=ct, device=srcs[0].device)
        m = torch.full(out_shape[:-1], -math.inf, dtype=ct, device=acc.device)
        z = torch.zeros(out_shape[:-1], dtype=ct, device=acc.device)
        for src in srcs:
            v = src.to(ct).view(source_shape)
            s = (v * f).sum(-1)
            if g is not None:
                s = s * _rinv(v, eps).unsqueeze(-1)
            if sigmoid:
                acc += torch.sigmoid(s).unsqueeze(-1) * v
            else:
                m_new = torch.maximum(m, s)
                scale, p = torch.exp(m - m_new), torch.exp(s - m_new)
                z = z * scale + p
                acc = acc * scale.unsqueeze(-1) + p.unsqueeze(-1) * v
                m = m_new
        return acc, m, z

    @staticmethod
    def attnres_fwd(srcs, q, g, eps, sigmoid, heads):
        (n, d), dt = srcs[0].shape, srcs[0].dtype
        ct, c = _acc(dt), d // heads
        f = _fold(q, g, dt, ct).view(-1, heads, c)  # [1 or N, H, C]
        acc, _, z = _TorchOps._accumulate(srcs, f, (n, heads, c), (n, heads, c), ct, g, eps, sigmoid)
        if not sigmoid:
            acc = acc / z.unsqueeze(-1)
        return acc.view(n, d).to(dt)

    @staticmethod
    def attnres_bwd(go, srcs, q, g, eps, sigmoid, heads):
        (n, d), dt = srcs[0].shape, srcs[0].dtype
        ct, c = _acc(dt), d // heads
        f = _fold(q, g, dt, ct).view(-1, heads, c)
        go = go.to(ct).view(n, heads, c)
        logits, dots, gvs, rinvs = [], [], [], []
        for src in srcs:  # pass 1: what the softmax gradient needs from every source
            v = src.to(ct).view(n, heads, c)
            dot = (v * f).sum(-1)
            dots.append(dot)
            gvs.append((go * v).sum(-1))
            if g is not None:
                rinvs.append(_rinv(v, eps))
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
        grads = []
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
            grads.append(dv.view(n, d).to(dt))
        df = df.view(n, d)
        if q.dim() == 1:
            df = df.sum(0)
        if g is None:
            return grads, df, None
        dg = df * q.to(ct)
        return grads, df * g.to(ct), dg.sum(0) if q.dim() == 2 else dg

    @staticmethod
    def phase1_fwd(srcs, q, g, eps, sigmoid, heads):
        (n, d), dt, s_ = srcs[0].shape, srcs[0].dtype, q.shape[0]
        ct, c = _acc(dt), d // heads
        f = _fold(q, g, dt, ct).view(s_, 1, heads, c)
        acc, m, z = _TorchOps._accumulate(srcs, f, (1, n, heads, c), (s_, n, heads, c), ct, g, eps, sigmoid)
        if sigmoid:
            m, z = torch.zeros_like(m), torch.ones_like(z)
        f32 = torch.promote_types(ct, torch.float32)
        return m.to(f32), z.to(f32), acc.view(s_, n, d).to(dt)

    @staticmethod
    def phase1_bwd(go, gz, m, srcs, q, g, eps, sigmoid, heads):
        (n, d), dt, s_ = srcs[0].shape, srcs[0].dtype, q.shape[0]
        ct, c = _acc(dt), d // heads
        f = _fold(q, g, dt, ct).view(s_, 1, heads, c)
        go = go.to(ct).view(s_, n, heads, c)
        df = torch.zeros(s_, n, heads, c, dtype=ct, device=go.device)
        grads = []
        for src in srcs:  # one pass: m is a constant, so every block's weight is local to it
            v = src.to(ct).view(1, n, heads, c)
            dot = (v * f).sum(-1)
            logit = dot
            if g is not None:
                r = _rinv(v, eps)  # [1, N]
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

    @staticmethod
    def _phase2_logit(x, q, g, eps, heads):
        n, d = x.shape
        ct = _acc(x.dtype)
        f = _fold(q, g, x.dtype, ct).view(heads, d // heads)
        xv = x.to(ct).view(n, heads, d // heads)
        dot = (xv * f).sum(-1)
        r = _rinv(xv, eps) if g is not None else None
        return xv, f, dot, (dot if r is None else dot * r.unsqueeze(-1)), r

    @staticmethod
    def phase2_fwd(m, z, o, x, q, g, eps, sigmoid, heads):
        n, d = o.shape
        ct = _acc(o.dtype)
        ov = o.to(ct).view(n, heads, d // heads)
        if x is None:
            return (ov / z.to(ct).unsqueeze(-1)).view(n, d).to(o.dtype)
        xv, _, _, logit, _ = _TorchOps._phase2_logit(x, q, g, eps, heads)
        if sigmoid:
            out = ov + torch.sigmoid(logit).unsqueeze(-1) * xv
        else:
            m, z = m.to(ct), z.to(ct)
            m_new = torch.maximum(m, logit)
            a, b = torch.exp(m - m_new), torch.exp(logit - m_new)
            out = (ov * a.unsqueeze(-1) + xv * b.unsqueeze(-1)) / (z * a + b).unsqueeze(-1)
        return out.view(n, d).to(o.dtype)

    @staticmethod
    def phase2_bwd(go, m, z, o, x, q, g, eps, sigmoid, heads):
        n, d = o.shape
        ct, c = _acc(o.dtype), d // heads
        gov = go.to(ct).view(n, heads, c)
        ov = o.to(ct).view(n, heads, c)
        if x is None:  # softmax: out = o / z
            zz = z.to(ct)
            return None, -(gov * ov).sum(-1) / zz.pow(2), (gov / zz.unsqueeze(-1)).view(n, d).to(o.dtype), \
                None, None, None
        xv, f, dot, logit, r = _TorchOps._phase2_logit(x, q, g, eps, heads)
        if sigmoid:
            sg = torch.sigmoid(logit)
            dm = dz = None
            do = go
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

    @staticmethod
    def _grn_coef(v, bias, proj, version, k, dt):
        """(bias + gate) of source k for every instance: v1 [g, 1, 1], v2 [g, 1, d], v3 [g, N, d]; and pre."""
        ct = v.dtype
        b = bias[..., k].to(dt).to(ct)
        coef = b.view(-1, 1, 1) if version == 1 else b.unsqueeze(1)
        if version != 3:
            return coef, None
        pre = torch.einsum("nd,gd->gn", v, proj.to(dt).to(ct))
        return coef + pre.clamp(min=0).unsqueeze(-1), pre

    @staticmethod
    def grn_fwd(srcs, bias, proj, version):
        (n, d), dt = srcs[0].shape, srcs[0].dtype
        ct = _acc(dt)
        out = torch.zeros(bias.shape[0], n, d, dtype=ct, device=srcs[0].device)
        for k, src in enumerate(srcs):
            v = src.to(ct)
            coef, _ = _TorchOps._grn_coef(v, bias, proj, version, k, dt)
            out += coef * v
        return out.to(dt)

    @staticmethod
    def grn_bwd(go, srcs, bias, proj, version):
        dt = srcs[0].dtype
        ct = _acc(dt)
        go = go.to(ct)
        dbias = torch.zeros(bias.shape, dtype=ct, device=go.device)
        dproj = torch.zeros(proj.shape, dtype=ct, device=go.device) if proj is not None else None
        grads = []
        for k, src in enumerate(srcs):
            v = src.to(ct)
            coef, pre = _TorchOps._grn_coef(v, bias, proj, version, k, dt)
            gv = go * v  # [g, N, d]
            dbias[..., k] = gv.sum((1, 2)) if version == 1 else gv.sum(1)
            dv = (coef * go).sum(0)
            if version == 3:
                dgate = torch.where(pre >= 0, gv.sum(-1), 0.)  # clamp(min=0): subgradient 1 at 0
                dv = dv + torch.einsum("gn,gd->nd", dgate, proj.to(dt).to(ct))
                dproj += torch.einsum("gn,nd->gd", dgate, v)
            grads.append(dv.to(dt))
        return grads, dbias, dproj

    @staticmethod
    def _da_layout(q, k, group):
        """The query as [N, hkv, R, hn] (group: its mean over each group, [N, hkv, 1, hn]), in fp32."""
        n, hq, hn = q.shape
        hkv = k.shape[1]
        ct = _acc(q.dtype)
        q4 = q.reshape(n, hkv, hq // hkv, hn)
        if group:
            return q4.mean(2, keepdim=True).to(ct)  # the mean in the input dtype, like the reference
        return q4.to(ct)

    @staticmethod
    def da_fwd(q, k, v, ck, cv, group):
        n, hkv, hn = k.shape
        q4 = _TorchOps._da_layout(q, k, group)
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
        return (acc / z.unsqueeze(-1)).view(n, hkv * r, hn).to(v.dtype)

    @staticmethod
    def da_bwd(go, q, k, v, ck, cv, group):
        n, hkv, hn = k.shape
        q4 = _TorchOps._da_layout(q, k, group)
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
        return dq.reshape(q.shape).to(q.dtype), dkeys[-1], dvals[-1], dkeys[:-1], dvals[:-1]


# --------------------------------------------------------------------------------------------------------------
# The autograd Functions
# --------------------------------------------------------------------------------------------------------------


class _AttnResMix(torch.autograd.Function):
    """Saves: query, key_norm_weight, the sources (references). Backward recomputes everything else."""

    @staticmethod
    def forward(ctx, query, gain, eps, sigmoid, heads, *sources):
        shape, d = sources[0].shape, sources[0].shape[-1]
        rows = [_rows(s, d) for s in sources]
        q = query.contiguous() if query.dim() == 1 else _rows(query, d)
        out = _ops(rows[0]).attnres_fwd(rows, q, _contig(gain), eps, sigmoid, heads)
        ctx.save_for_backward(query, gain, *sources)
        ctx.cfg = (eps, sigmoid, heads)
        return out.view(shape)

    @staticmethod
    @once_differentiable  # the kernels' gradients are not themselves differentiable
    def backward(ctx, grad):
        query, gain, *sources = ctx.saved_tensors
        eps, sigmoid, heads = ctx.cfg
        d = sources[0].shape[-1]
        rows = [_rows(s, d) for s in sources]
        q = query.contiguous() if query.dim() == 1 else _rows(query, d)
        grads, dq, dg = _ops(rows[0]).attnres_bwd(_rows(grad, d), rows, q, _contig(gain), eps, sigmoid, heads)
        need = ctx.needs_input_grad
        return (_cast(dq, query, need[0]), _cast(dg, gain, need[1]), None, None, None,
                *[gr.view(s.shape) if need[5 + i] else None for i, (gr, s) in enumerate(zip(grads, sources))])


class _Phase1(torch.autograd.Function):
    """Saves: queries, key_norm_weights, the completed blocks (references) and m (its own [S, N, H] output)."""

    @staticmethod
    def forward(ctx, queries, gains, eps, sigmoid, heads, *completed):
        lead, d = completed[0].shape[:-1], completed[0].shape[-1]
        rows = [_rows(b, d) for b in completed]
        q, g = queries.contiguous(), _contig(gains)
        m, z, o = _ops(rows[0]).phase1_fwd(rows, q, g, eps, sigmoid, heads)
        s_ = queries.shape[0]
        m, z, o = m.view(s_, *lead, heads), z.view(s_, *lead, heads), o.view(s_, *lead, d)
        ctx.save_for_backward(queries, gains, None if sigmoid else m, *completed)
        ctx.cfg = (eps, sigmoid, heads)
        if sigmoid:  # m = 0 and z = 1: constants
            ctx.mark_non_differentiable(m, z)
        else:  # a stabiliser only (detached in the reference)
            ctx.mark_non_differentiable(m)
        ctx.set_materialize_grads(False)
        return m, z, o

    @staticmethod
    @once_differentiable
    def backward(ctx, gm, gz, go):
        queries, gains, m, *completed = ctx.saved_tensors
        eps, sigmoid, heads = ctx.cfg
        need = ctx.needs_input_grad
        if go is None and (gz is None or sigmoid):
            return (None,) * (5 + len(completed))
        d = completed[0].shape[-1]
        rows = [_rows(b, d) for b in completed]
        s_ = queries.shape[0]
        go = torch.zeros((s_, rows[0].shape[0], d), dtype=rows[0].dtype, device=rows[0].device) if go is None \
            else go.reshape(s_, -1, d).contiguous()
        gz = None if (gz is None or sigmoid) else gz.reshape(s_, -1, heads).float().contiguous()
        m = None if m is None else m.reshape(s_, -1, heads)
        q, g = queries.contiguous(), _contig(gains)
        grads, dq, dg = _ops(rows[0]).phase1_bwd(go, gz, m, rows, q, g, eps, sigmoid, heads)
        return (_cast(dq, queries, need[0]), _cast(dg, gains, need[1]), None, None, None,
                *[gr.view(b.shape) if need[5 + i] else None for i, (gr, b) in enumerate(zip(grads, completed))])


class _Phase2(torch.autograd.Function):
    """Saves: m, z, o, partial, query, key_norm_weight (references). Backward recomputes the partial's logit."""

    @staticmethod
    def forward(ctx, m, z, o, partial, query, gain, eps, sigmoid, heads):
        d = o.shape[-1]
        rows_o = _rows(o, d)
        x = _rows(partial, d) if partial is not None else None
        mm, zz = _rows(m, heads).float(), _rows(z, heads).float()
        out = _ops(rows_o).phase2_fwd(mm, zz, rows_o, x, query.contiguous(), _contig(gain), eps, sigmoid, heads)
        ctx.save_for_backward(m, z, o, partial, query, gain)
        ctx.cfg = (eps, sigmoid, heads)
        return out.view(o.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        m, z, o, partial, query, gain = ctx.saved_tensors
        eps, sigmoid, heads = ctx.cfg
        d = o.shape[-1]
        rows_o = _rows(o, d)
        x = _rows(partial, d) if partial is not None else None
        mm, zz = _rows(m, heads).float(), _rows(z, heads).float()
        dm, dz, do, dx, dq, dg = _ops(rows_o).phase2_bwd(_rows(grad, d), mm, zz, rows_o, x, query.contiguous(),
                                                         _contig(gain), eps, sigmoid, heads)
        need = ctx.needs_input_grad
        return (_cast(dm, m, need[0]), _cast(dz, z, need[1]), _cast(do, o, need[2]), _cast(dx, partial, need[3]),
                _cast(dq, query, need[4]), _cast(dg, gain, need[5]), None, None, None)


class _GRN(torch.autograd.Function):
    """Saves: bias, proj, the sources (references). Backward recomputes the v3 gates."""

    @staticmethod
    def forward(ctx, bias, proj, version, *sources):
        lead, d = sources[0].shape[:-1], sources[0].shape[-1]
        rows = [_rows(s, d) for s in sources]
        out = _ops(rows[0]).grn_fwd(rows, bias.contiguous(), _contig(proj), version)
        ctx.save_for_backward(bias, proj, *sources)
        ctx.version = version
        return out.view(bias.shape[0], *lead, d)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        bias, proj, *sources = ctx.saved_tensors
        d = sources[0].shape[-1]
        rows = [_rows(s, d) for s in sources]
        go = grad.reshape(bias.shape[0], -1, d).contiguous()
        grads, dbias, dproj = _ops(rows[0]).grn_bwd(go, rows, bias.contiguous(), _contig(proj), ctx.version)
        need = ctx.needs_input_grad
        return (_cast(dbias, bias, need[0]), _cast(dproj, proj, need[1]), None,
                *[gr.view(s.shape) if need[3 + i] else None for i, (gr, s) in enumerate(zip(grads, sources))])


class _DepthAttention(torch.autograd.Function):
    """Saves: query, key, value, the candidate keys and values (references). Backward recomputes the scores."""

    @staticmethod
    def forward(ctx, query, key, value, group, num_cands, *cands):
        q, k, v = _head_rows(query), _head_rows(key), _head_rows(value)
        ck = [_head_rows(c).contiguous() for c in cands[:num_cands]]
        cv = [_head_rows(c).contiguous() for c in cands[num_cands:]]
        out = _ops(v).da_fwd(q, k, v, ck, cv, group)
        ctx.save_for_backward(query, key, value, *cands)
        ctx.cfg = (group, num_cands)
        return out.view(*value.shape[:-2], out.shape[-2], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        query, key, value, *cands = ctx.saved_tensors
        group, num_cands = ctx.cfg
        q, k, v = _head_rows(query), _head_rows(key), _head_rows(value)
        ck = [_head_rows(c).contiguous() for c in cands[:num_cands]]
        cv = [_head_rows(c).contiguous() for c in cands[num_cands:]]
        go = grad.reshape(-1, *grad.shape[-2:]).contiguous()
        dq, dk, dv, dck, dcv = _ops(v).da_bwd(go, q, k, v, ck, cv, group)
        need = ctx.needs_input_grad
        dc = [gr.view(c.shape) if need[5 + i] else None for i, (gr, c) in enumerate(zip(dck + dcv, cands))]
        return (_cast(dq, query, need[0]), _cast(dk, key, need[1]), _cast(dv, value, need[2]), None, None, *dc)


# --------------------------------------------------------------------------------------------------------------
# Public functions (the references' semantics)
# --------------------------------------------------------------------------------------------------------------


def attnres_mix_sources(sources: Sources, query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                        weight: str = "softmax", heads: int = 1) -> Tensor:
    """== mixing.attnres_mix(torch.stack(sources), ...): sources K tensors [*, d] (or a stacked [K, *, d]);
    query [d] (static) or [*, d] (per token); key_norm_weight [d] or None. -> [*, d]."""
    sources = _as_list(sources)
    shape = sources[0].shape
    heads = _heads(shape[-1], heads)
    if query.dim() > 1 and query.shape != shape:
        query = query.expand(shape)  # a broadcast query: autograd sums its gradient back
    return _AttnResMix.apply(query, key_norm_weight, float(eps), _weight(weight), heads, *sources)


def attnres_phase1_sources(completed: Sources, queries: Tensor, key_norm_weights: Optional[Tensor], eps: float,
                           weight: str = "softmax", heads: int = 1):
    """== mixing.attnres_block_phase1(torch.stack(completed), ...): n blocks [*, d], queries / key_norm_weights
    [S, d]. -> (m [S, *, H], z [S, *, H], o [S, *, d]); m is a detached stabiliser."""
    completed = _as_list(completed)
    heads = _heads(completed[0].shape[-1], heads)
    return _Phase1.apply(queries, key_norm_weights, float(eps), _weight(weight), heads, *completed)


def attnres_phase2(m: Tensor, z: Tensor, o: Tensor, partial: Optional[Tensor], query: Tensor,
                   key_norm_weight: Optional[Tensor], eps: float, weight: str = "softmax", heads: int = 1) -> Tensor:
    """== mixing.attnres_block_phase2(...): merges the partial sum [*, d] (or None) into phase 1's (m, z, o)."""
    sigmoid = _weight(weight)
    heads = _heads(o.shape[-1], heads)
    if sigmoid and partial is None:
        return o  # the reference returns o itself
    if partial is not None and partial.shape != o.shape:
        partial = partial.expand(o.shape)
    m, z = m.expand(*o.shape[:-1], heads), z.expand(*o.shape[:-1], heads)
    return _Phase2.apply(m, z, o, partial, query, key_norm_weight, float(eps), sigmoid, heads)


def grn_apply_sources(sources: Sources, bias: Tensor, proj: Optional[Tensor], version: str) -> Tensor:
    """== mixing.grn_apply(torch.stack(sources), ...): K sources [*, d]; bias v1 [g, K], v2/v3 [g, d, K]; proj
    (v3) [g, d]. -> [g, *, d]."""
    if version not in mixing.GRN_VERSIONS:
        raise ValueError(f"unknown GRN version {version!r}; choose one of {mixing.GRN_VERSIONS}")
    sources = _as_list(sources)
    if bias.shape[-1] != len(sources):
        raise ValueError(f"GRN bias for {bias.shape[-1]} sources got {len(sources)}")
    if version == "v3" and proj is None:
        raise ValueError("GRN v3 needs proj")
    return _GRN.apply(bias, proj if version == "v3" else None, int(version[1]), *sources)


def depth_attention_mix(query: Tensor, key: Tensor, value: Tensor, cand_keys: Optional[Sources],
                        cand_values: Optional[Sources], gqa_mode: str = "query") -> Tensor:
    """== mixing.depth_attention_mix(...): query [*, hq, hn]; key / value [*, hkv, hn]; cand_keys [C, *, hkv, hn]
    and cand_values [C, *, hv, hn] (or sequences of C tensors, or None). -> [*, heads, hn]."""
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
    return _DepthAttention.apply(query, key, value, gqa_mode == "group", len(ck), *ck, *cv)


def _stream_rows(streams: Tensor) -> Tensor:
    """[n, *, d] as [n, N, d] with unit channel stride; the stream and token strides stay free (no copy of an
    expanded embedding or of a pipeline tensor's view where the layout allows)."""
    t = streams.reshape(streams.shape[0], -1, streams.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _coef_rows(coef: Tensor, n: int, tail: int = 0) -> Tensor:
    """A coefficient [n, *] (or [n, *, n] with tail=1) as contiguous [n, N] ([n, N, n]): a small copy."""
    shape = (n, -1) + tuple(coef.shape[coef.dim() - tail:])
    return coef.reshape(shape).contiguous()


class _StreamsIn(torch.autograd.Function):
    """Saves: streams, weights (references)."""

    @staticmethod
    def forward(ctx, streams, weights):
        s = _stream_rows(streams)
        out = _ops(s).streams_in_fwd(s, _coef_rows(weights, s.shape[0]))
        ctx.save_for_backward(streams, weights)
        return out.view(streams.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        streams, weights = ctx.saved_tensors
        s = _stream_rows(streams)
        ds, dw = _ops(s).streams_in_bwd(_rows(grad, s.shape[-1]), s, _coef_rows(weights, s.shape[0]))
        need = ctx.needs_input_grad
        return (ds.view(streams.shape) if need[0] else None,
                _cast(dw.view(weights.shape), weights, need[1]))


class _StreamsOut(torch.autograd.Function):
    """Saves: streams, output, mix, post (references)."""

    @staticmethod
    def forward(ctx, streams, output, mix, post):
        s = _stream_rows(streams)
        n, d = s.shape[0], s.shape[-1]
        out = _ops(s).streams_out_fwd(s, _rows(output, d), _coef_rows(mix, n, 1), _coef_rows(post, n))
        ctx.save_for_backward(streams, output, mix, post)
        return out.view(streams.shape[0], *output.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        streams, output, mix, post = ctx.saved_tensors
        s = _stream_rows(streams)
        n, d = s.shape[0], s.shape[-1]
        go = grad.reshape(n, -1, d).contiguous()
        ds, dy, dmix, dpost = _ops(s).streams_out_bwd(go, s, _rows(output, d), _coef_rows(mix, n, 1),
                                                      _coef_rows(post, n))
        need = ctx.needs_input_grad
        return (ds.view(streams.shape) if need[0] else None, dy.view(output.shape) if need[1] else None,
                _cast(dmix.view(mix.shape), mix, need[2]), _cast(dpost.view(post.shape), post, need[3]))


class _Sinkhorn(torch.autograd.Function):
    """Saves: the logits (a reference). Backward recomputes the iterations."""

    @staticmethod
    def forward(ctx, logits, iters, order, eps_style, eps):
        r = logits.reshape(-1, *logits.shape[-2:]).contiguous()
        out = _ops(r).sinkhorn_fwd(r, iters, order, eps_style, eps)
        ctx.save_for_backward(logits)
        ctx.cfg = (iters, order, eps_style, eps)
        return out.view(logits.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        r = logits.reshape(-1, *logits.shape[-2:]).contiguous()
        go = grad.reshape(r.shape).contiguous().float()
        return _ops(r).sinkhorn_bwd(go, r, *ctx.cfg).view(logits.shape), None, None, None, None


def sinkhorn(logits: Tensor, iters: int, order: str = "paper", eps_style: str = "clamp", eps: float = 1e-6) -> Tensor:
    """== mixing.sinkhorn(...): logits [*, n, n] -> doubly stochastic [*, n, n], fp32."""
    if order not in mixing.MHC_SK_ORDERS or eps_style not in mixing.MHC_EPS_STYLES:
        raise ValueError(f"unknown Sinkhorn order {order!r} or epsilon style {eps_style!r}; choose from "
                         f"{mixing.MHC_SK_ORDERS} and {mixing.MHC_EPS_STYLES}")
    return _Sinkhorn.apply(logits.float(), int(iters), order, eps_style, float(eps))


def streams_in(streams: Tensor, weights: Tensor) -> Tensor:
    """== mixing.streams_in(...): streams [n, *, d], weights [n, *] (or broadcastable, [n, 1...]) -> [*, d]."""
    return _StreamsIn.apply(streams, weights.expand(streams.shape[:-1]))  # autograd sums a broadcast back


def streams_out(streams: Tensor, output: Tensor, mix: Tensor, post: Tensor) -> Tensor:
    """== mixing.streams_out(...): streams [n, *, d], output [*, d], mix [n, *, n] (from i to j), post [n, *]
    (both may broadcast over the tokens) -> [n, *, d]."""
    n, lead = streams.shape[0], streams.shape[1:-1]
    if output.shape != streams.shape[1:]:
        output = output.expand(streams.shape[1:])
    return _StreamsOut.apply(streams, output, mix.expand(n, *lead, n), post.expand(n, *lead))


def fast_functions() -> SimpleNamespace:
    """The fast twins under the names mechanisms ask for (mega_depth/kernels/__init__.py: FAST_FUNCTIONS)."""
    return SimpleNamespace(attnres_mix_sources=attnres_mix_sources, attnres_phase1_sources=attnres_phase1_sources,
                           attnres_phase2=attnres_phase2, grn_apply_sources=grn_apply_sources,
                           depth_attention_mix=depth_attention_mix, streams_in=streams_in,
                           streams_out=streams_out, sinkhorn=sinkhorn)
