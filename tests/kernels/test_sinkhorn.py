"""mega_depth/kernels/sinkhorn.py: mHC's Sinkhorn-Knopp against mixing.sinkhorn."""

import pytest
import torch
from kernel_checks import SCALES, check, gradcheck, leaf, opcheck, saves_only_inputs

from mega_depth.kernels.sinkhorn import sinkhorn, sinkhorn_backward_op, sinkhorn_op
from mega_depth.model import mixing


@pytest.mark.parametrize("order", ["paper", "megatron"])
@pytest.mark.parametrize("eps_style", ["clamp", "deepseek"])
@pytest.mark.parametrize("n, iters", [(1, 3), (3, 6), (4, 20)])
def test_values_and_gradients(path, order, eps_style, n, iters):
    """Every iteration in one kernel; backward recomputes the iterations (n = 3: masked lanes)."""
    logits = leaf(7, 2, n, n, scale=2.0)
    check(lambda r: sinkhorn(r, iters, order, eps_style), lambda r: mixing.sinkhorn(r, iters, order, eps_style),
          [logits], f"sinkhorn n={n} {order} {eps_style}")


def vanishing_rows(tokens, n, shift=16.0, dtype=torch.float32):
    """Logits whose first row and second column lie far below the others: after exp their sums fall under
    eps = 1e-6, where the clamp fires."""
    logits = torch.randn(tokens, n, n, dtype=dtype) * 0.5
    logits[:, 0, :] -= shift
    logits[:, :, 1] -= shift  # and a column: the clamp fires in the first normalisation of either order
    return logits.requires_grad_()


def test_clamp_fires_on_vanishing_sums(path):
    logits = vanishing_rows(6, 4)
    for style in ("clamp", "deepseek"):
        for order in ("paper", "megatron"):
            check(lambda r: sinkhorn(r, 5, order, style), lambda r: mixing.sinkhorn(r, 5, order, style), [logits],
                  f"sinkhorn underflow {style} {order}")


def test_ties_share_the_maximum_s_gradient(path):
    """Two entries attain max R: the shift's gradient is split between them, as amax's is."""
    logits = vanishing_rows(3, 4)
    with torch.no_grad():
        logits[:, 1, 1] = logits[:, 2, 3] = logits.amax((-2, -1)) + 1.0
    check(lambda r: sinkhorn(r, 4, "paper", "clamp"), lambda r: mixing.sinkhorn(r, 4, "paper", "clamp"), [logits],
          "sinkhorn ties")


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("eps_style", ["clamp", "deepseek"])
@pytest.mark.parametrize("order", ["paper", "megatron"])
def test_gradcheck(twin, scale, eps_style, order):
    """Logits of std 1, 3, 10: at 10 the clamp fires on most tokens; and logits built so that it fires."""
    logits = leaf(3, 4, 4, scale=scale, dtype=torch.float64)
    gradcheck(lambda r: sinkhorn(r, 20, order, eps_style), [logits], f"sinkhorn {eps_style} {order} std {scale}")
    gradcheck(lambda r: sinkhorn(r, 6, order, eps_style), [vanishing_rows(3, 4, shift=14.0 * scale / 3,
                                                                          dtype=torch.float64)],
              f"sinkhorn {eps_style} {order} vanishing rows")


def test_opcheck(twin):
    logits = leaf(5, 4, 4)
    for style in ("clamp", "deepseek"):
        opcheck(sinkhorn_op, (logits, 6, "paper", style, 1e-6))
        opcheck(sinkhorn_backward_op, (torch.randn(5, 4, 4), logits.detach(), 6, "megatron", style, 1e-6))


def test_saves_only_its_input(path):
    saves_only_inputs(lambda r: sinkhorn(r, 20), [leaf(6, 4, 4)])
