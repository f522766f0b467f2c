"""megatron-core 0.16.1 without Transformer Engine: a name its MoE code reads but never binds.

`moe_utils.py` imports `te_general_gemm` inside a `try` whose `except ImportError` leaves the name unbound, and the
router's gating linear then tests `te_general_gemm is not None`: a NameError on any machine without Transformer
Engine (a CPU, or a GPU where it is not installed). Binding the name to None selects the torch matmul that the
code already has for that case. Applied where Megatron starts (training/backends/startup.py); it changes nothing
where Transformer Engine imported.
"""

from __future__ import annotations

import importlib


def apply() -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
