"""mega_depth/kernels/mhc_maps.py: mHC's coefficients from the projection (the maps and Sinkhorn in one kernel)
against mixing.mhc_projected_coefficients."""

import pytest
import torch
from kernel_checks import check, gradcheck, leaf, opcheck, saves_only_inputs

from mega_depth.kernels.mhc_maps import coefficients_backward_op, coefficients_op, mhc_projected_coefficients
from mega_depth.model import mixing


def inputs(n, lead, dtype=torch.float32, spread=1.0):
    """proj [*lead, n^2 + 2n] and a mean square [*lead, 1] (both of a real projection's scale), the bias
    [n^2 + 2n] and three alphas [1], all leaves."""
    m = n * n + 2 * n
    proj = leaf(*lead, m, scale=spread, dtype=dtype)
    mean_square = (torch.rand(*lead, 1, dtype=dtype) + 0.5).requires_grad_()
    bias = leaf(m, scale=0.5, dtype=dtype)
    alphas = [leaf(1, scale=0.5, shift=1.0, dtype=dtype) for _ in range(3)]
    return [proj, mean_square, bias, *alphas]


@pytest.mark.parametrize("order", ["paper", "megatron"])
@pytest.mark.parametrize("eps_style", ["clamp", "deepseek"])
@pytest.mark.parametrize("n, lead, iters", [(1, (5,), 3), (3, (7, 2), 6), (4, (4, 3), 20)])
def test_values_and_gradients(path, order, eps_style, n, lead, iters):
    """H_pre, H_post and H_res and the gradients of the projection, the mean square, the bias and every alpha (n = 3:
    masked lanes; 14 tokens: a masked tail of the last token block on the GPU's block sizes)."""
    check(lambda *t: mhc_projected_coefficients(*t, iters, order, eps_style),
          lambda *t: mixing.mhc_projected_coefficients(*t, iters, order, eps_style),
          inputs(n, lead), f"mhc maps n={n} {order} {eps_style}")


def test_clamp_fires_on_large_coefficients(path):
    """Logits spread far (the projection of std 8): Sinkhorn's column sums fall to 1e-15, the clamp fires."""
    for style in ("clamp", "deepseek"):
        check(lambda *t: mhc_projected_coefficients(*t, 5, "paper", style),
              lambda *t: mixing.mhc_projected_coefficients(*t, 5, "paper", style),
              inputs(4, (6,), spread=8.0), f"mhc maps spread {style}")


@pytest.mark.parametrize("eps_style", ["clamp", "deepseek"])
def test_gradcheck(twin, eps_style):
    gradcheck(lambda *t: mhc_projected_coefficients(*t, 6, "megatron", eps_style),
              inputs(3, (3,), dtype=torch.float64), f"mhc maps {eps_style}")


def test_opcheck(twin):
    t = inputs(4, (5,))
    for style in ("clamp", "deepseek"):
        opcheck(coefficients_op, (*t, 6, "paper", style, 1e-6))
        grads = (torch.randn(4, 5), torch.randn(4, 5), torch.randn(5, 4, 4))
        opcheck(coefficients_backward_op, (*grads, *[x.detach() for x in t], 6, "megatron", style, 1e-6))


def test_saves_only_its_inputs(path):
    saves_only_inputs(lambda *t: mhc_projected_coefficients(*t, 20), inputs(4, (6,)))


def test_the_mechanism_s_coefficients_equal_the_reference(path):
    """mHC's sublayer coefficients on the fast path (the projection op, then this one) against
    mixing.mhc_coefficients, bf16 parameters included (the kernel reads them in fp32)."""
    from mega_depth.kernels.mhc_projection import mhc_projection

    n, d = 4, 16
    streams = leaf(n, 3, 2, d)
    phi = leaf(n * n + 2 * n, n * d, scale=0.2)
    _, _, bias, *alphas = inputs(n, (1,))

    def fast(s, phi, bias, *alphas):
        return mhc_projected_coefficients(*mhc_projection(s, phi), bias, *alphas, 20, "paper", "clamp")

    check(fast, lambda *t: mixing.mhc_coefficients(*t, 20, "paper", "clamp"), [streams, phi, bias, *alphas],
          "mhc coefficients")


def test_bf16_parameters_get_their_gradients_from_one_reduction(path):
    """Training keeps the bias and the alphas in bf16: the kernels read them as one fp32 vector, and backward's one
    partial-sum reduction returns both gradients in bf16 (the alphas' from a tail of its columns), with no cast
    after it: equal to the reference's gradients rounded to bf16."""
    from mega_depth.kernels import common

    proj, mean_square, bias, *alphas = inputs(4, (6,))
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in (bias, *alphas)]
    high = [t.detach().float().requires_grad_() for t in low]

    def grads(fn, params):
        out = fn(proj, mean_square, *params, 6, "paper", "clamp")
        return torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), params)

    weights = [torch.randn(4, 6), torch.randn(4, 6), torch.randn(6, 4, 4)]
    got, want = grads(mhc_projected_coefficients, low), grads(mixing.mhc_projected_coefficients, high)
    step = 2 ** -7 if path == "triton" else 0  # (the interpreter truncates to bf16: one rounding step)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.to(torch.bfloat16).float(), rtol=step, atol=1e-6)
    if path == "triton":  # what backward launches: the kernel and one sum_rows, the tail in the alphas' dtype
        with common.recording(132) as launches:
            grads(mhc_projected_coefficients, low)
        names = [launch.kernel.fn.__name__ for launch in launches]
        assert names == ["_fwd_kernel", "_bwd_kernel", "_sum_rows_kernel"], names
        assert launches[-1].constexprs.get("TAIL") and launches[-1].args[3].dtype == torch.bfloat16
