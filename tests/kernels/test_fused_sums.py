"""common.sums2 / sums3 in their compiled form, under the interpreter.

Compiled, they reduce their tensors together (one tl.reduce over a tuple: one exchange of partial sums for all). The
interpreter runs such a reduction's combine element by element in Python, so there they are plain tl.sum calls,
and the other kernel tests never run the tuple form. Here it runs, at tiny sizes, through every op that uses it,
against the eager reference: a tuple whose sums came back in the wrong order fails these."""

import pytest
import test_attnres_block as block_tests
import test_attnres_mix as mix_tests
import test_grn as grn_tests
import test_streams as streams_tests
from kernel_checks import interpreted

from mega_depth.kernels import common


@pytest.fixture
def fused(monkeypatch):
    if not interpreted() or not common.interpreting():
        pytest.skip("runs the Triton kernels under the interpreter (compiled, the sums are always fused)")
    monkeypatch.setattr(common, "FORCE_TRITON", True)
    monkeypatch.setattr(common, "FUSED_SUMS", common.tl.constexpr(True))
    return "triton"


@pytest.mark.parametrize("heads, weight, norm", [(1, "softmax", True), (2, "sigmoid", True), (2, "softmax", False)])
def test_attnres_mix(fused, heads, weight, norm):
    """Forward: a source's dot and square sums (sums2); backward: dot, go . v and squares (sums3), or two."""
    mix_tests.test_values_and_gradients(fused, 3, (2, 3), 12, heads, weight, norm, False)


def test_attnres_block(fused):
    """Phase 1's backward (dots, go . v), phase 2's partial logit (dot, squares) and backward (three sums)."""
    block_tests.test_phases(fused, 3, 2, "softmax", True)


def test_grn(fused, monkeypatch):
    """The whole-row backward's gate and go . v sums, and the chunked kernels' pass 1 (both sums of a block)."""
    grn_tests.test_values_and_gradients(fused, "v3", 3)
    grn_tests.test_in_chunks_where_whole_rows_do_not_fit(fused, monkeypatch, "v3")


@pytest.mark.parametrize("n", [1, 3])
def test_streams(fused, n):
    """The residual merge's backward: the first two input streams' mix gradients and the post gradient a reduction
    (sums3; one stream: sums2), an odd one after them alone."""
    streams_tests.test_values_and_gradients(fused, n, True)
