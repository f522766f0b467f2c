"""mega_depth/kernels/mhc_projection.py: mHC's coefficient projection and RMS against mixing.mhc_projection."""

import pytest
import torch
from kernel_checks import SCALES, check, close, detached, gradcheck, leaf, opcheck, saves_only_inputs

from mega_depth.kernels.mhc_projection import mhc_projection, projection_backward_op, projection_op
from mega_depth.model import mixing


@pytest.mark.parametrize("n", [1, 3, 4])
def test_values_and_gradients(path, n):
    """n = 3: neither the streams nor the n^2 + 2n outputs are a power of two (masked lanes); d = 10 leaves a masked
    channel tail; 11 tokens a masked token tail."""
    m, d = n * n + 2 * n, 10
    streams, phi = leaf(n, 11, d), leaf(m, n * d, scale=0.3)
    check(mhc_projection, mixing.mhc_projection, [streams, phi], f"mhc_projection n={n}")


def test_read_an_expanded_embedding_and_a_pipeline_view(path):
    """The first sublayer's streams are the embedding expanded n times (stream stride 0); a received pipeline tensor
    is viewed [s, b, n*d] -> [n, s, b, d]. Both are read in place."""
    n, (s_, b), d = 4, (5, 2), 8
    phi = leaf(n * n + 2 * n, n * d, scale=0.3)
    for src, make, label in ((leaf(s_, b, d), lambda e: e.unsqueeze(0).expand(n, *e.shape), "expanded"),
                             (leaf(s_, b, n * d), lambda p: p.unflatten(2, (n, d)).permute(2, 0, 1, 3), "view")):
        check(lambda x, w: mhc_projection(make(x), w), lambda x, w: mixing.mhc_projection(make(x), w), [src, phi],
              f"mhc_projection {label}")


def test_one_output_unused(path):
    """Only the RMS (or only the projection) reaches the loss: the other output's gradient is zero, not an error."""
    streams, phi = leaf(2, 6, 4), leaf(8, 8)
    for pick in (0, 1):
        got = torch.autograd.grad(mhc_projection(streams, phi)[pick].sum(), [streams, phi], allow_unused=True)
        want = torch.autograd.grad(mixing.mhc_projection(streams, phi)[pick].sum(), [streams, phi],
                                   allow_unused=True)
        for a, b, like in zip(got, want, (streams, phi)):
            zero = torch.zeros_like(like)
            close(zero if a is None else a, zero if b is None else b, f"output {pick} alone")


def test_bf16_streams_and_phi(path):
    """bf16 streams and phi (a bf16 model): the products are exact and summed in fp32, so the projection equals the
    reference's fp32 GEMM on the same values to fp32 rounding, with no fp32 copy of the streams; the stream gradient
    is bf16, phi's is rounded to bf16 from fp32 sums."""
    n, d = 4, 12
    b16 = torch.bfloat16
    streams = torch.randn(n, 9, d).to(b16).requires_grad_()
    phi = (torch.randn(n * n + 2 * n, n * d) * 0.3).to(b16).requires_grad_()
    proj, ms = mhc_projection(streams, phi)
    ref = mixing.mhc_projection(streams.float(), phi.float())
    assert proj.dtype == ms.dtype == torch.float32
    close(proj, ref[0], "bf16 projection")
    close(ms, ref[1], "bf16 mean square")
    w = torch.randn_like(proj)
    got = torch.autograd.grad((proj * w).sum() + ms.sum(), [streams, phi])
    high = [streams.detach().float().requires_grad_(), phi.detach().float().requires_grad_()]
    ref = mixing.mhc_projection(*high)
    want = torch.autograd.grad((ref[0] * w).sum() + ref[1].sum(), high)
    for a, b, label in zip(got, want, ("streams", "phi")):
        assert a.dtype == b16, label
        close(a.float(), b, f"bf16 grad of {label}", rtol=1e-2)


@pytest.mark.parametrize("scale", SCALES)
def test_gradcheck(twin, scale):
    f64 = torch.float64
    streams, phi = leaf(3, 4, 5, scale=scale, dtype=f64), leaf(15, 15, dtype=f64)
    gradcheck(mhc_projection, [streams, phi], f"mhc_projection scale={scale}")


def test_opcheck(twin):
    streams, phi = leaf(3, 4, 5), leaf(15, 15)
    opcheck(projection_op, (streams, phi))
    opcheck(projection_backward_op, (torch.randn(4, 15), torch.randn(4, 1), *detached([streams, phi])))


def test_saves_only_its_inputs(path):
    saves_only_inputs(mhc_projection, [leaf(4, 6, 8), leaf(24, 32)])
