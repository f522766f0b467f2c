"""Fast paths of the mixing math, selected by --mixing-impl. The eager functions of mega_depth/model/mixing.py stay
the reference (and the CPU default); every fast twin here has the same signature and a test that ties its values
and gradients to the reference.

    eager      the reference itself (mechanism.kernels = None); the CPU default
    compiled   torch.compile'd twins (fused elementwise kernels on a GPU)
    triton     fused.py: autograd Functions that read each source in place and save no stacked copy; Triton
               kernels on a GPU, the same Functions with torch inner compute on the CPU; the GPU default
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from mega_depth.model import mixing

# The functions a mechanism may ask for by name (Mechanism.kernel(name, reference)).
FAST_FUNCTIONS = ("attnres_mix_sources", "attnres_phase1_sources", "attnres_phase2", "grn_apply_sources",
                  "depth_attention_mix", "streams_in", "streams_out", "sinkhorn")
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
        from mega_depth.kernels import fused

        return fused.fast_functions()
    raise ValueError(f"unknown --mixing-impl {impl!r}")


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
