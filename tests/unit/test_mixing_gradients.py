"""Every differentiable function of mega_depth/model/mixing.py (the eager reference) has the gradient of its forward:
fp64 torch.autograd.gradcheck at input scales 1, 3 and 10, and where a function clamps, inputs on which the clamp
fires (Sinkhorn's sums under eps, the GRN's ReLU). The fused ops are checked the same way in tests/kernels.

Block AttnRes's phase 1 returns a stabiliser m that the reference detaches: z and o alone depend on it, the merged
result does not, so phase 1 is checked through phase 2, as the model chains them."""

import pytest
import torch

from mega_depth.model import mixing

SCALES = (1.0, 3.0, 10.0)
F64 = torch.float64
EPS = 1e-6


def x(*shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, dtype=F64) * scale + shift).requires_grad_()


def check(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


def vanishing_rows(tokens, n, shift, scale=0.5):
    """[tokens, n, n] logits whose first row and second column lie `shift` below the rest: after exp their sums
    fall under eps, where the clamp fires."""
    logits = torch.randn(tokens, n, n, dtype=F64) * scale
    logits[:, 0, :] -= shift
    logits[:, :, 1] -= shift  # and a column: the clamp fires in the first normalisation of either order
    return logits.requires_grad_()


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("s", SCALES)
def test_attnres(s):
    src, q, g = x(3, 2, 8, scale=s), x(8, scale=s), x(8, scale=0.3, shift=1.0)
    check(lambda v: mixing.rms_inverse(v, EPS), src)
    check(lambda v, q, g: mixing.attnres_logits(v, q, g, EPS, heads=2), src, q, g)
    check(lambda v, q: mixing.attnres_logits(v, q, None, EPS), src, x(2, 8, scale=s))
    check(lambda l: mixing.depth_weights(l, "softmax"), x(3, 4, scale=s))
    check(lambda l: mixing.depth_weights(l, "sigmoid"), x(3, 4, scale=s))
    check(lambda a, v: mixing.mix_sources(a, v), x(3, 2, 2), src)
    for weight, heads in (("softmax", 1), ("sigmoid", 2)):
        check(lambda v, q, g: mixing.attnres_mix(v, q, g, EPS, weight, heads), src, q, g)
        check(lambda q, g, *v: mixing.attnres_mix_sources(v, q, g, EPS, weight, heads), q, g, *src.unbind(0))
    check(lambda v, c: mixing.scalar_mix(v, c), src, x(3, scale=s))


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("weight", ["softmax", "sigmoid"])
def test_attnres_two_phase(s, weight):
    blocks, queries, gains, partial = x(3, 2, 8, scale=s), x(2, 8, scale=s), x(2, 8, scale=0.3, shift=1.0), \
        x(2, 8, scale=s)

    def chain(b, q, g, p):
        m, z, o = mixing.attnres_block_phase1(b, q, g, EPS, weight, heads=2)
        return (mixing.attnres_block_phase2(m[0], z[0], o[0], None, q[0], g[0], EPS, weight, heads=2),
                mixing.attnres_block_phase2(m[1], z[1], o[1], p, q[1], g[1], EPS, weight, heads=2))

    check(chain, blocks, queries, gains, partial)
    check(lambda q, *b: mixing.attnres_phase1_sources(b, q, None, EPS, weight)[2].sum(0) if weight == "sigmoid"
          else chain(torch.stack(b), q, gains, partial)[1], queries, *blocks.unbind(0))
    with torch.no_grad():
        m, z, o = mixing.attnres_block_phase1(blocks, queries, gains, EPS, weight)
    soft = weight == "softmax"
    check(lambda *a: mixing.attnres_block_phase2(*a, EPS, weight), m[1].clone().requires_grad_(soft),
          z[1].clone().requires_grad_(soft), o[1].clone().requires_grad_(), partial, x(8, scale=s), x(8))


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_grn(s, version):
    """v3's ReLU fires on about half the gates at every scale (finite differences stay off the kink)."""
    stack = x(3, 4, 6, scale=s)
    bias = x(2, 3) if version == "v1" else x(2, 6, 3)
    proj = x(2, 6) if version == "v3" else None
    if proj is not None:
        pre = torch.einsum("knd,gd->gkn", stack, proj)
        assert (pre < 0).any() and (pre > 0).any() and pre.abs().min() > 1e-4
    check(lambda v, b, p: mixing.grn_apply(v, b, p, version), stack, bias, proj)
    check(lambda b, p, *v: mixing.grn_apply_sources(v, b, p, version), bias, proj, *stack.unbind(0))
    check(lambda v, b, p: mixing.grn_mean_weights(v, b, p, version), stack, bias, proj)


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("mode", ["query", "group"])
def test_depth_attention(s, mode):
    q, k, v = x(3, 4, 4, scale=s), x(3, 2, 4, scale=s), x(3, 2, 4, scale=s)
    ck, cv = x(2, 3, 2, 4, scale=s), x(2, 3, 4 if mode == "query" else 2, 4, scale=s)
    check(lambda t: mixing.expand_heads(t, 4), k)
    check(lambda q, keys: mixing.depth_attention_weights(q, keys, mode), q, torch.cat([ck, k.unsqueeze(0)]))
    check(lambda *a: mixing.depth_attention_mix(*a, gqa_mode=mode), q, k, v, ck, cv)


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("use_tanh", [True, False])
def test_hyper_connections(s, use_tanh):
    n, d = 3, 6
    streams = x(n, 4, d, scale=s)
    statics = (x(n), x(n, n), x(n))
    dynamic = (x(d, shift=1.0), x(d), x(d, n), x(d), x(1, scale=0.1), x(1, scale=0.1))
    check(lambda st, *p: mixing.hc_coefficients(st, *p[:3], tuple(p[3:]), use_tanh), streams, *statics, *dynamic)
    check(lambda st, *p: mixing.hc_coefficients(st, *p), streams, *statics)
    check(mixing.streams_in, streams, x(n, 4))
    check(mixing.streams_out, streams, x(4, d, scale=s), x(n, 4, n), x(n, 4))
    layers = 3
    check(lambda *p: mixing.hc_unfold(list(p[:layers]), list(p[layers:2 * layers]), list(p[2 * layers:])),
          *[x(n) for _ in range(layers)], *[x(n, n) for _ in range(layers)], *[x(n) for _ in range(layers)])


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("eps_style", ["clamp", "deepseek"])
@pytest.mark.parametrize("order", ["paper", "megatron"])
def test_sinkhorn(s, eps_style, order):
    """Logits of std 1, 3, 10 (at 10 the clamp fires on most tokens), and a row far below the rest, where it
    fires by construction: the result then depends on max R, whose gradient must flow."""
    check(lambda r: mixing.sinkhorn(r, 20, order, eps_style), x(3, 4, 4, scale=s))
    check(lambda r: mixing.sinkhorn(r, 6, order, eps_style), vanishing_rows(3, 4, shift=14.0 * s / 3))


def test_sinkhorn_gradient_flows_through_the_max_where_a_clamp_fires():
    """H_res = SK(exp(R - max R)) does not change when R shifts by a constant, so its gradient sums to zero over
    R. Where a clamp fires (logits of std 10) SK itself is not scale-invariant, and only a gradient that also
    flows through max R sums to zero: with the max detached (as before) it did not."""
    logits = x(4, 4, 4, scale=10.0)
    weights = torch.randn(4, 4, 4, dtype=F64)
    (grad,) = torch.autograd.grad((mixing.sinkhorn(logits, 20) * weights).sum(), logits)
    assert grad.sum((-2, -1)).abs().max() < 1e-12

    def detached_max(r):
        m = torch.exp(r - r.amax((-2, -1), keepdim=True).detach())
        for _ in range(20):
            m = m / m.sum(-2, keepdim=True).clamp(min=EPS)
            m = m / m.sum(-1, keepdim=True).clamp(min=EPS)
        return m

    (wrong,) = torch.autograd.grad((detached_max(logits) * weights).sum(), logits)
    assert wrong.sum((-2, -1)).abs().max() > 1e-4


def test_deepseek_style_starts_from_an_exact_softmax():
    """DeepSeek-V4's code (HF DeepseekV4HyperConnection): softmax along the first-normalised axis + eps, then
    sums + eps. A column 14 below the global max keeps its share (the old exp(R - max R) / (sum + eps) lost it)."""
    logits = torch.zeros(1, 4, 4, dtype=F64)
    logits[..., 0] -= 20.0  # column 0 far below the rest
    h = mixing.sinkhorn(logits, 1, "paper", "deepseek")
    softmax = torch.softmax(logits, dim=-2) + EPS
    expected = softmax / (softmax.sum(-1, keepdim=True) + EPS)
    torch.testing.assert_close(h, expected)
    assert h[..., 0].sum() > 0.2  # the far column is a real column of a near-doubly-stochastic matrix


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("eps_style", ["clamp", "deepseek"])
def test_mhc(s, eps_style):
    n, d = 2, 4
    streams = x(n, 3, d, scale=s)
    params = (x(n * n + 2 * n, n * d, scale=0.3), x(n * n + 2 * n), x(1), x(1), x(1))
    check(lambda st, *p: mixing.mhc_maps(st, *p, eps_style), streams, *params)
    check(lambda st, *p: mixing.mhc_coefficients(st, *p, iters=8, eps_style=eps_style), streams, *params)
    check(lambda st, phi: mixing.mhc_projection(st, phi), streams, params[0])
    check(lambda ms: mixing.mhc_rms(ms, eps_style), x(3, 1, scale=s).abs())
    check(lambda st, phi, b, a: mixing.mhc_head_weights(st, phi, b, a, eps_style), streams, x(n, n * d, scale=0.3),
          x(n), x(1))


def test_mhc_head_takes_its_eps_where_the_style_puts_it():
    streams = torch.zeros(2, 1, 3, dtype=F64)  # RMS 0: r is the eps term alone
    phi, bias, alpha = torch.ones(2, 6, dtype=F64), torch.zeros(2, dtype=F64), torch.ones(1, dtype=F64)
    _, mean_square = mixing.mhc_projection(streams, phi)
    r_clamp, r_deepseek = mixing.mhc_rms(mean_square, "clamp", 1e-6), mixing.mhc_rms(mean_square, "deepseek", 1e-6)
    assert r_clamp.item() == pytest.approx(1e-6) and r_deepseek.item() == pytest.approx(1e-3)
    assert mixing.mhc_head_weights(streams, phi, bias, alpha, "deepseek").shape == (2, 1)


@pytest.mark.parametrize("s", SCALES)
def test_denseformer(s):
    check(lambda out, a: mixing.dwa(out, a), x(3, 2, 4, scale=s), x(3, scale=s))
