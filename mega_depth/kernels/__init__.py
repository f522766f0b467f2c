"""Fast paths of the mixing math, selected by --mixing-impl. The eager functions of mega_depth/model/mixing.py stay
the reference (and the CPU default); every fast twin here has the same signature and a test that ties its values
and gradients to the reference.

    eager      the reference itself (mechanism.kernels = None); the CPU default
    compiled   torch.compile'd twins (fused elementwise kernels on a GPU)
    triton     the fused ops below: torch.library custom ops that read each source in place and save no stacked
               copy; Triton kernels on a GPU, their torch twins on a CPU; the GPU default

One module per op (flash-linear-attention's layout): its Triton kernels, its torch twin, its custom op (fake
implementation and autograd included) and its public function, which has its reference's signature.

    attnres_mix.py      AttnRes's mix over K sources                 (mixing.attnres_mix)
    attnres_block.py    Block AttnRes's phase 1 and phase 2          (mixing.attnres_block_phase1 / _phase2)
                        (the merge and the host's norm of it in one: attnres_phase2_normed)
    grn.py              DCA's GRNs over the stack                    (mixing.grn_apply)
                        and DenseFormer's DWA, a GRN v1 of one instance (mixing.dwa)
    depth_attention.py  Depth-Attention's value mix                  (mixing.depth_attention_mix)
                        (the candidates' keys normalised in it: depth_attention_mix_normed; and the
                        layer's query and key too: depth_attention_mix_qk_normed)
    streams.py          HC / mHC's stream read and write             (mixing.streams_in / streams_out)
                        (the read and the host's norm of it in one: streams_in_normed)
    sinkhorn.py         mHC's Sinkhorn-Knopp                         (mixing.sinkhorn)
    mhc_projection.py   mHC's coefficient projection and RMS         (mixing.mhc_projection)
    mhc_maps.py         mHC's coefficients from it, Sinkhorn included (mixing.mhc_projected_coefficients)
    common.py           dispatch, launch heuristics, pointer tables, shared jit helpers
    aot.py              ahead-of-time compilation for GPU targets: the resource check of every launch
    tuning.py           GPU-measured launch settings (tuned.json), per kernel specialisation and GPU generation
    saved_bytes.py      activation memory as autograd sees it
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from mega_depth.model import mixing

# The functions a mechanism may ask for by name (Mechanism.kernel(name, reference)).
FAST_FUNCTIONS = ("attnres_mix_sources", "attnres_phase1_sources", "attnres_phase2", "grn_apply_sources",
                  "depth_attention_mix", "streams_in", "streams_out", "sinkhorn", "dwa_mix", "mhc_projection",
                  "mhc_projected_coefficients")
# the reference each name stands for, in mixing.py
REFERENCES = {"attnres_phase2": "attnres_block_phase2"}


def select(impl: str) -> Optional[SimpleNamespace]:
    """The namespace of fast twins for `impl`, or None for the eager reference."""
    if impl == "eager":
        return None
    if impl == "compiled":
        import torch

        # One compiled graph per distinct source count / None pattern: a deep model needs more than dynamo's
        # default of 8 before it would fall back to eager (seen on an H200 with 24 sublayers).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        return SimpleNamespace(**{name: torch.compile(getattr(mixing, REFERENCES.get(name, name)), dynamic=True)
                                  for name in FAST_FUNCTIONS})
    if impl == "triton":
        return fast_functions()
    raise ValueError(f"unknown --mixing-impl {impl!r}")


def fast_functions() -> SimpleNamespace:
    """The fused ops under the names mechanisms ask for (FAST_FUNCTIONS)."""
    from mega_depth.kernels import (attnres_block, attnres_mix, depth_attention, grad_sink, grn, mhc_maps,
                                    mhc_projection, sinkhorn, streams)

    return SimpleNamespace(attnres_mix_sources=attnres_mix.attnres_mix_sources,
                           attnres_phase1_sources=attnres_block.attnres_phase1_sources,
                           attnres_phase2=attnres_block.attnres_phase2,
                           attnres_phase2_normed=attnres_block.attnres_phase2_normed,
                           grn_apply_sources=grn.grn_apply_sources,
                           depth_attention_mix=depth_attention.depth_attention_mix,
                           depth_attention_mix_normed=depth_attention.depth_attention_mix_normed,
                           depth_attention_mix_qk_normed=depth_attention.depth_attention_mix_qk_normed,
                           streams_in=streams.streams_in,
                           streams_in_normed=streams.streams_in_normed,
                           streams_out=streams.streams_out, sinkhorn=sinkhorn.sinkhorn, dwa_mix=grn.dwa_mix,
                           mhc_projection=mhc_projection.mhc_projection,
                           mhc_projected_coefficients=mhc_maps.mhc_projected_coefficients,
                           recompute=grad_sink.recompute, unbound=grad_sink.unbound,
                           fused=True)


def default_impl() -> str:
    """triton on a GPU where triton is importable, else eager (the reference)."""
    import torch

    if torch.cuda.is_available():
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            pass
    return "eager"
