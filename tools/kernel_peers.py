"""The published kernels that compute one of our mixing ops, called on our inputs (tools/bench_kernels.py).

Each peer is wrapped to take the arguments of the op's case (bench_kernels.Case.run) and return the same output, so
that its values and gradients can be checked against ours before it is timed. The settings are matched where the
peer computes a narrower function (all three compute the softmax, one-head, static-query case with a key RMSNorm):
- flash-linear-attention (`fla-core`) `fla.ops.attnres.fused_attnres`: the Full AttnRes mix (sources as a list, the
  key-norm gain as its `rms_weight`); CUDA tensors only.
- Liger-Kernel `liger_attn_res`: the Full AttnRes mix, sources stacked ([K, N, d]: the stack is its input, not
  timed), the gain in fp32 (in bf16 it rounds the normalised keys); `liger_mhc_post_res`: HC's stream update, on
  streams laid out [*, n, d] (ours are [n, *, d]: transposed before the call, not timed); `mhc_mm_norm_fwd` / `_bwd`:
  mHC's coefficient projection with its RMS applied, (x~ phi) rsqrt(mean(x~^2) + eps) (the case's function), on
  tokens laid out [N, n*d] and phi [n*d, m] (both transposed before the call, not timed).
- Liger-Kernel's RMSNorm after our own phase 2: the unfused form of `phase2_normed` (the merge written, then
  normalised), as a GPU step ran it before the merge and the norm shared a kernel.
- flash-attn-res: one block of Block AttnRes, its phase 1 (blocks stacked [K, 1, N, d]; no key-norm gain: ours is
  folded into its queries, as our kernels fold it; it returns the normalised output o / z and the LSE, in bf16) and
  its phase-2 merges from them; and phase 2 alone (it takes phase 1's normalised output and LSE: converted from our
  (m, z, o) inside the timed call).
A peer that is not installed, or cannot run on this device, is skipped with the reason.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional


@dataclass
class Peer:
    run: Callable
    prepare: Optional[Callable] = None  # our inputs -> the peer's (a layout it needs; untimed)
    grads_back: Optional[Callable] = None  # the peer's input gradients -> ours (the inverse of prepare)
    note: str = ""
    rounds_to_bf16: bool = False  # its kernels round their output to bf16 whatever the inputs' dtype


def peers_for(op: str, eps: float) -> Dict[str, Peer]:
    return {"attnres_mix": _attnres_mix, "attnres_block": _attnres_block, "phase2": _phase2,
            "phase2_normed": _phase2_normed, "streams_out": _streams_out,
            "mhc_projection": _mhc_projection}.get(op, lambda eps: {})(eps)


def _attnres_mix(eps):
    import torch

    def fla(*a):
        from fla.ops.attnres import fused_attnres

        *sources, q, g = a
        return fused_attnres(q, list(sources), g, rms_eps=eps)

    def liger(stacked, q, g):
        from liger_kernel.transformers.functional import liger_attn_res

        return liger_attn_res(stacked, q, g.float(), eps)

    def stack(inputs):
        *sources, q, g = inputs
        return [torch.stack(sources).detach(), q, g]

    return {"fla fused_attnres": Peer(fla, note="sources as a list"),
            "liger attn_res": Peer(liger, prepare=stack, grads_back=lambda g: [*g[0].unbind(0), *g[1:]],
                                   note="sources stacked (untimed), gain in fp32")}


def _flash_attn_res():
    """The package, with one autotune config a kernel under Triton's interpreter (its autotuner needs a GPU)."""
    import flash_attn_res as far
    from mega_depth.kernels.common import interpreting

    if interpreting():
        from flash_attn_res.kernels import phase_1 as k1, phase_2 as k2, reduce as kr

        for kernel in (k1.phase_1_batched_attention_forward_kernel, k1.phase_1_batched_attention_backward_kernel,
                       k2.phase_2_online_softmax_merge_forward_kernel,
                       k2.phase_2_online_softmax_merge_backward_kernel, kr.reduce_grad_queries_kernel):
            far.set_autotune_configs(kernel, kernel.configs[:1])
    return far


def _attnres_block(eps):
    import torch

    def block(*a):  # blocks [K, 1, N, d], q - 1 partials [N, d], queries [q, d], gains [q, d]
        far = _flash_attn_res()
        stacked, *partials, q, g = a
        folded = (g * q).to(stacked.dtype)
        normalised, lse = far.phase_1_batched_attention_triton_op(stacked, folded, eps)
        merged = [far.phase_2_online_softmax_merge_triton_op(x.unsqueeze(0), folded[s + 1], normalised[s + 1],
                                                             lse[s + 1], eps)[0] for s, x in enumerate(partials)]
        return (normalised[0, 0], *merged)

    def stack(inputs):
        queries = len(inputs[-2])
        blocks, partials = inputs[:-2 - (queries - 1)], inputs[-2 - (queries - 1):-2]
        return [torch.stack(blocks).unsqueeze(1).detach(), *partials, *inputs[-2:]]

    return {"flash-attn-res": Peer(block, prepare=stack, grads_back=lambda g: [*g[0][:, 0].unbind(0), *g[1:]],
                                   note="blocks stacked (untimed), gain folded into the queries, bf16 out",
                                   rounds_to_bf16=True)}


def _phase2(eps):
    def merge(m, z, o, x, q, g):
        far = _flash_attn_res()
        lse = (m + z.log())[..., 0]
        out = far.phase_2_online_softmax_merge_triton_op(x.unsqueeze(0), (g * q).to(o.dtype),
                                                         (o / z).to(o.dtype).unsqueeze(0), lse.unsqueeze(0), eps)
        return out[0]

    return {"flash-attn-res phase 2": Peer(merge, note="our (m, z, o) converted to its (o / z, LSE) in the call, "
                                                 "bf16 out", rounds_to_bf16=True)}


def _phase2_normed(eps):
    def unfused(m, z, o, x, q, g, w):
        from bench_kernels import NORM_EPS
        from liger_kernel.transformers.functional import liger_rms_norm

        from mega_depth.kernels.attnres_block import attnres_phase2

        return liger_rms_norm(attnres_phase2(m, z, o, x, q, g, eps), w, NORM_EPS, casting_mode="llama",
                              in_place=False)

    return {"phase 2, then liger rms_norm": Peer(unfused, note="the unfused path: our merge written, then Liger's "
                                                              "norm (llama casting) reads it")}


def _streams_out(eps):
    def post_res(x, y, mix, post):
        from liger_kernel.transformers.functional import liger_mhc_post_res

        return liger_mhc_post_res(x, y, post.movedim(0, -1).to(x.dtype), mix.movedim(0, -1).to(x.dtype)).movedim(-2, 0)

    def layout(inputs):
        streams, y, mix, post = inputs
        return [streams.movedim(0, -2).contiguous().detach(), y, mix, post]

    return {"liger mhc_post_res": Peer(post_res, prepare=layout, grads_back=lambda g: [g[0].movedim(-2, 0), *g[1:]],
                                       note="streams laid out [*, n, d] (untimed)")}


def _mhc_projection(eps):
    import torch

    class Liger(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, phi):
            from liger_kernel.ops.mhc import mhc_mm_norm_fwd

            mix, invr = mhc_mm_norm_fwd(x, phi, eps)
            ctx.save_for_backward(x, phi, mix, invr)
            return mix

        @staticmethod
        def backward(ctx, grad):
            from liger_kernel.ops.mhc import mhc_mm_norm_bwd

            x, phi, mix, invr = ctx.saved_tensors
            grad_x, grad_phi = mhc_mm_norm_bwd(x, phi, mix, invr, grad.contiguous())
            return grad_x, grad_phi.to(phi.dtype)

    streams_shape = []  # [n, N, d] of the case's streams, for the gradient's way back

    def layout(inputs):
        streams, phi = inputs
        streams_shape[:] = streams.shape
        return [streams.movedim(0, -2).flatten(-2).contiguous().detach(), phi.t().contiguous().detach()]

    def back(grads):
        grad_x, grad_phi = grads
        n, _, d = streams_shape
        return [grad_x.unflatten(-1, (n, d)).movedim(-2, 0), grad_phi.t()]

    return {"liger mhc_mm_norm": Peer(lambda x, phi: Liger.apply(x, phi), prepare=layout, grads_back=back,
                                      note="tokens [N, n*d], phi [n*d, m] (untimed)")}
