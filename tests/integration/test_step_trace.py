"""One training step of every catalogue setting at the 1B shape (24 layers, d 2048, GQA 16/8, seq 2048, micro-batch
4, bf16, the Triton mixing), traced on meta tensors (mega_depth/megatron/step_trace.py; tools/step_trace.py prints
the table docs/benchmarks.md keeps). Seconds per setting, no GPU."""

import os
import sys

import pytest

from fixtures import ROOT
from mega_depth.catalogue import SETTINGS

# The memory-bound aten traffic outside the mixing's kernels over the baseline's, GB per step, as measured when the
# trace was written (docs/benchmarks.md): a ratchet against new waste, not the speed issue's targets (8-30 GB).
MEASURED_OVER_BASELINE_GB = {"attnres-full": 109, "attnres-block": 72, "attnres-input-query": 236, "dca": 193,
                             "dca-2": 174, "depth-attention": 187, "hc": 818, "mhc": 407, "denseformer": 52}
BASELINE_GB = 297


@pytest.fixture(scope="module")
def traced():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from step_trace import ONE_B, trace_settings

    return trace_settings(SETTINGS, ONE_B)


def test_every_projection_is_one_gemm_and_the_mixing_adds_no_gemm_flops(traced):
    """DCA's q/k/v inputs were strided slices of one buffer, so each projection ran as a batched GEMM over the
    sequence (2,048 small GEMMs); now every GEMM is an mm. The mixing of AttnRes, DCA and Depth-Attention adds no
    GEMM FLOPs; HC, mHC and the input-dependent query add their own projections' (mm too)."""
    base = traced["standard"][0]
    assert base.attention_calls == 24 and not [g for g in base.gemms if g.op == "bmm"]
    for name, (trace, summary) in traced.items():
        batched = [g for g in trace.gemms if g.op in ("bmm", "baddbmm")]
        if name == "denseformer":  # its depth-weighted average is an einsum over the stored outputs (still open)
            assert len(batched) == 72, len(batched)
        else:
            assert not batched, (name, batched[:3])
        if name in ("attnres-full", "attnres-block", "dca", "dca-2", "depth-attention"):
            assert trace.gemm_flops == base.gemm_flops, name
        assert trace.attention_calls == 24, name


def test_the_memory_bound_traffic_does_not_grow(traced):
    base = traced["standard"][1]["memory_bound_gb"]
    assert base <= BASELINE_GB, base
    for name, expected in MEASURED_OVER_BASELINE_GB.items():
        over = traced[name][1]["memory_bound_gb"] - base
        assert over <= expected, (name, over)
