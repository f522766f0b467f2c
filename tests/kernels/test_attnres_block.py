"""mega_depth/kernels/attnres_block.py: Block AttnRes's phase 1 and phase 2 against the reference's two phases."""

import pytest
import torch
from kernel_checks import (EPS, SCALES, bf16_matches_fp32, check, detached, gradcheck, leaf, opcheck, rms_normed,
                           saves_only_inputs, sources_of)
from torch.utils._python_dispatch import TorchDispatchMode

from mega_depth.kernels import grad_sink
from mega_depth.kernels.attnres_block import (attnres_phase1_sources, attnres_phase2, attnres_phase2_normed,
                                              phase1_backward_op, phase1_op, phase2_backward_into_op,
                                              phase2_backward_op, phase2_op)
from mega_depth.model import mixing


@pytest.mark.parametrize("heads, weight, norm", [(1, "softmax", True), (2, "softmax", True), (1, "sigmoid", True),
                                                 (2, "sigmoid", False), (1, "softmax", False)])
@pytest.mark.parametrize("completed", [1, 3])
def test_phases(path, completed, heads, weight, norm):
    """Phase 1 over 1 or 3 completed blocks with S = 3 queries; phase 2 for the block's first sublayer (no
    partial sum yet) and for its last (a partial sum)."""
    d, lead, s_ = 12, (2, 3), 3
    blocks = sources_of(completed, *lead, d)
    queries = leaf(s_, d)
    gains = leaf(s_, d, scale=0.3, shift=1.0) if norm else None
    label = f"completed={completed} heads={heads} {weight} norm={norm}"
    check(lambda q, g, *b: attnres_phase1_sources(list(b), q, g, EPS, weight, heads),
          lambda q, g, *b: mixing.attnres_block_phase1(torch.stack(b), q, g, EPS, weight, heads),
          [queries, gains, *blocks], f"phase1 {label}")
    with torch.no_grad():
        m, z, o = mixing.attnres_block_phase1(torch.stack(blocks), queries, gains, EPS, weight, heads)
    # The block's first sublayer (no partial yet) and its last (a partial sum); m, z, o as leaves: phase 2's
    # gradients w.r.t. all of them (m too: here it is an input like any other).
    for i, partial in ((0, None), (s_ - 1, leaf(*lead, d, scale=2.0))):
        mi, zi, oi = (t[i].clone().requires_grad_() for t in (m, z, o))
        query = leaf(d)
        gain = leaf(d, scale=0.3, shift=1.0) if norm else None
        check(lambda *a: attnres_phase2(*a, EPS, weight, heads),
              lambda *a: mixing.attnres_block_phase2(*a, EPS, weight, heads),
              [mi, zi, oi, partial, query, gain], f"phase2 {label} query={i} partial={partial is not None}")


@pytest.mark.parametrize("heads, weight, norm", [(2, "softmax", True), (1, "sigmoid", True), (1, "softmax", False)])
def test_phase1_in_chunks_where_whole_rows_do_not_fit(path, monkeypatch, heads, weight, norm):
    """The phase-1 kernels that walk a token's blocks a chunk at a time (wide rows, many blocks), forced here: the
    sizes above fit in registers and take the whole-row kernels."""
    from mega_depth.kernels import attnres_block

    assert attnres_block._rows_fit(3, 12, heads)
    monkeypatch.setattr(attnres_block, "ROWS_IN_REGISTERS", 0)
    test_phases(path, 3, heads, weight, norm)


@pytest.mark.parametrize("heads, weight, norm", [(1, "softmax", True), (2, "sigmoid", True), (1, "softmax", False)])
def test_phase1_backward_in_one_pass(path, monkeypatch, heads, weight, norm):
    """The whole-row backward that holds the blocks and their gradients together (ONE_PASS: 16-bit rows up to 4
    blocks at 1B), forced here in fp32, which takes two passes; and it is what bf16 rows of 3 blocks take."""
    from mega_depth.kernels import attnres_block

    assert attnres_block._one_pass(3, 2048, 1, 2) and not attnres_block._one_pass(8, 2048, 1, 2)
    assert not attnres_block._one_pass(3, 12, 1, 4)
    monkeypatch.setattr(attnres_block, "_one_pass", lambda k, d, heads, element_size: True)
    test_phases(path, 3, heads, weight, norm)


@pytest.mark.parametrize("weight", ["softmax", "sigmoid"])
def test_phases_chained(path, weight):
    """Phase 1 then phase 2 (its m detached), end to end: the values and gradients of the reference chain, for
    each sublayer of an uneven block (the first without a partial sum)."""
    d, lead, s_, heads = 12, (5,), 2, 2
    blocks, partial = sources_of(3, *lead, d), leaf(*lead, d, scale=3.0)
    queries, gains = leaf(s_, d), leaf(s_, d, scale=0.3, shift=1.0)

    def chain(phase1, phase2):
        def run(q, g, x, *b):
            m, z, o = phase1(b, q, g)
            return tuple(phase2(m[i], z[i], o[i], None if i == 0 else x, q[i], g[i]) for i in range(s_))
        return run

    check(chain(lambda b, q, g: attnres_phase1_sources(b, q, g, EPS, weight, heads),
                lambda *a: attnres_phase2(*a, EPS, weight, heads)),
          chain(lambda b, q, g: mixing.attnres_block_phase1(torch.stack(b), q, g, EPS, weight, heads),
                lambda *a: mixing.attnres_block_phase2(*a, EPS, weight, heads)),
          [queries, gains, partial, *blocks], f"phases chained {weight}")


class _Stacks(TorchDispatchMode):
    """Counts aten stacks (and cats) of whole phase-1 outputs: unbind's backward."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.stack, torch.ops.aten.cat) and out.shape == self.shape:
            self.count += 1
        return out


@pytest.mark.parametrize("weight", ["softmax", "sigmoid"])
@pytest.mark.parametrize("unread", [False, True])
def test_each_phase2_writes_its_slice_of_phase1s_output_gradient(path, weight, unread):
    """On the fused path phase 1's output o [S, *, d] is unbound through grad_sink.unbound: each sublayer's phase 2
    (normed, as the fused path runs it) writes its slice's gradient into one [S, *, d] buffer, which is o's gradient,
    where unbind's backward stacked the S gradients into a new tensor. The values and gradients equal the
    reference chain's; a slice that no phase 2 reads gets a zero gradient (unread); no stack of o's shape runs."""
    d, lead, s_, heads, norm_eps = 12, (5,), 3, 2, 1e-5
    blocks, partial = sources_of(3, *lead, d), leaf(*lead, d, scale=3.0)
    queries, gains = leaf(s_, d), leaf(s_, d, scale=0.3, shift=1.0)
    norm_weights = leaf(s_, d, scale=0.3, shift=1.0)
    read = [i for i in range(s_) if not (unread and i == 1)]

    def chain(phase1, phase2, unbind):
        def run(q, g, x, w, *b):
            m, z, o = phase1(b, q, g)
            ms, zs, os_ = m.unbind(0), z.unbind(0), unbind(o)
            return tuple(phase2(w[i], ms[i], zs[i], os_[i], None if i == 0 else x, q[i], g[i]) for i in read)
        return run

    fused = chain(lambda b, q, g: attnres_phase1_sources(b, q, g, EPS, weight, heads),
                  lambda w, *a: attnres_phase2_normed(w, norm_eps, *a, EPS, weight, heads), grad_sink.unbound)
    check(fused,
          chain(lambda b, q, g: mixing.attnres_block_phase1(torch.stack(b), q, g, EPS, weight, heads),
                lambda w, *a: rms_normed(mixing.attnres_block_phase2(*a, EPS, weight, heads), w, norm_eps),
                lambda o: o.unbind(0)),
          [queries, gains, partial, norm_weights, *blocks], f"phase 2 into phase 1's slices {weight} {unread}")
    outs = fused(queries, gains, partial, norm_weights, *blocks)
    with _Stacks((s_, *lead, d)) as stacks:
        torch.autograd.grad(sum((t * torch.randn_like(t)).sum() for t in outs), blocks)
    assert stacks.count == 0


@pytest.mark.parametrize("heads, weight, norm", [(1, "softmax", True), (2, "softmax", True), (1, "sigmoid", True),
                                                 (2, "sigmoid", False)])
def test_phase2_normed(path, heads, weight, norm):
    """The merge and the host's RMSNorm of it in one op: the values and gradients (the norm weight's included) of
    the norm of the reference's merge, for a block's first sublayer (no partial sum) and a later one."""
    d, lead, norm_eps = 12, (2, 3), 1e-5
    blocks, queries = sources_of(3, *lead, d), leaf(2, d)
    gains = leaf(2, d, scale=0.3, shift=1.0) if norm else None
    with torch.no_grad():
        m, z, o = mixing.attnres_block_phase1(torch.stack(blocks), queries, gains, EPS, weight, heads)
    for i, partial in ((0, None), (1, leaf(*lead, d, scale=2.0))):
        mi, zi, oi = (t[i].clone().requires_grad_(weight == "softmax" or t is o) for t in (m, z, o))
        query, gain = leaf(d), (leaf(d, scale=0.3, shift=1.0) if norm else None)
        norm_weight = leaf(d, scale=0.3, shift=1.0)
        check(lambda w, *a: attnres_phase2_normed(w, norm_eps, *a, EPS, weight, heads),
              lambda w, *a: rms_normed(mixing.attnres_block_phase2(*a, EPS, weight, heads), w, norm_eps),
              [norm_weight, mi, zi, oi, partial, query, gain],
              f"phase2 normed heads={heads} {weight} norm={norm} partial={partial is not None}")


@pytest.mark.parametrize("weight", ["softmax", "sigmoid"])
def test_gradcheck_phase2_normed(twin, weight):
    f64 = torch.float64
    m = leaf(3, 2, dtype=f64).detach().requires_grad_(weight == "softmax")
    z = (leaf(3, 2, dtype=f64).abs() + 1).detach().requires_grad_(weight == "softmax")
    for partial in (None, leaf(3, 8, scale=2.0, dtype=f64)):
        inputs = [leaf(8, scale=0.3, shift=1.0, dtype=f64), m, z, leaf(3, 8, dtype=f64), partial, leaf(8, dtype=f64),
                  leaf(8, scale=0.3, shift=1.0, dtype=f64)]
        gradcheck(lambda w, *a: attnres_phase2_normed(w, 1e-5, *a, EPS, weight, 2), inputs,
                  f"phase2 normed {weight} partial={partial is not None}")


def test_phase1_m_is_a_detached_stabiliser(path):
    blocks = sources_of(2, 4, 12)
    m, z, o = attnres_phase1_sources(blocks, leaf(2, 12), leaf(2, 12), EPS)
    assert not m.requires_grad and z.requires_grad and o.requires_grad
    m, z, _ = attnres_phase1_sources(blocks, leaf(2, 12), leaf(2, 12), EPS, weight="sigmoid")
    assert not m.requires_grad and not z.requires_grad and not m.any() and (z == 1).all()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("weight, heads", [("softmax", 1), ("softmax", 2), ("sigmoid", 2)])
def test_gradcheck(twin, scale, weight, heads):
    """Phase 1's m is a detached stabiliser: z and o alone depend on it, the merged result does not. So phase 1 is
    checked through phase 2 (the chain the model runs), and phase 2 on its own, m included."""
    f64 = torch.float64
    blocks = [(b * scale).detach().requires_grad_() for b in sources_of(3, 3, 8, dtype=f64)]
    queries, gains = leaf(2, 8, scale=scale, dtype=f64), leaf(2, 8, scale=0.3, shift=1.0, dtype=f64)
    partial = leaf(3, 8, scale=scale, dtype=f64)

    def chain(q, g, x, *b):
        m, z, o = attnres_phase1_sources(list(b), q, g, EPS, weight, heads)
        return attnres_phase2(m[0], z[0], o[0], None, q[0], g[0], EPS, weight, heads), \
            attnres_phase2(m[1], z[1], o[1], x, q[1], g[1], EPS, weight, heads)

    gradcheck(chain, [queries, gains, partial, *blocks], f"phases scale={scale} {weight}")
    with torch.no_grad():
        m, z, o = mixing.attnres_block_phase1(torch.stack(blocks), queries, gains, EPS, weight, heads)
    inputs = [m[1].clone().requires_grad_(weight == "softmax"), z[1].clone().requires_grad_(weight == "softmax"),
              o[1].clone().requires_grad_(), leaf(3, 8, scale=scale, dtype=f64), leaf(8, scale=scale, dtype=f64),
              leaf(8, scale=0.3, shift=1.0, dtype=f64)]
    gradcheck(lambda *a: attnres_phase2(*a, EPS, weight, heads), inputs, f"phase2 scale={scale} {weight}")


def test_opcheck(twin):
    blocks, queries, gains = sources_of(2, 3, 8), leaf(2, 8), leaf(2, 8)
    opcheck(phase1_op, (blocks, queries, gains, EPS, False, 2))
    m, z, o = (t.detach() for t in phase1_op(blocks, queries, gains, EPS, False, 2))
    opcheck(phase1_backward_op, (torch.randn(2, 3, 8), torch.randn(2, 3, 2), m, detached(blocks), queries.detach(),
                                 gains.detach(), EPS, False, 2))
    x, q, g, w = leaf(3, 8), leaf(8), leaf(8), leaf(8, scale=0.3, shift=1.0)
    for sigmoid in (False, True):
        for norm_weight in (None, w):
            opcheck(phase2_op, (m[0].clone().requires_grad_(), z[0].clone().requires_grad_(),
                                o[0].clone().requires_grad_(), x, q, g, norm_weight, EPS, EPS, sigmoid, 2))
            rstd = None if norm_weight is None else phase2_op(m[0], z[0], o[0], x.detach(), q.detach(), g.detach(),
                                                              w.detach(), EPS, EPS, sigmoid, 2)[1]
            opcheck(phase2_backward_op, (torch.randn(3, 8), m[0], z[0], o[0], x.detach(), q.detach(), g.detach(),
                                         None if norm_weight is None else w.detach(), rstd, EPS, sigmoid, 2))
            opcheck(phase2_backward_into_op, (torch.randn(3, 8), m[0], z[0], o[0], x.detach(), q.detach(),
                                              g.detach(), None if norm_weight is None else w.detach(), rstd,
                                              torch.empty(3, 8), EPS, sigmoid, 2), eager_only=True)
        opcheck(phase2_op, (m[0], z[0].clone().requires_grad_(), o[0].clone().requires_grad_(), None, q, None, w,
                            EPS, EPS, sigmoid, 2))
    opcheck(phase2_op, (m[0], z[0].clone().requires_grad_(), o[0].clone().requires_grad_(), None, q, None, None,
                        EPS, 0., False, 2))


def test_save_only_their_inputs(path):
    """Phase 1 saves references to its inputs and the small m [S, N, H]; phase 2 references to its inputs."""
    k, n, d, s_ = 4, 6, 12, 3
    sources = sources_of(k, n, d)
    saves_only_inputs(lambda q, g, *b: attnres_phase1_sources(b, q, g, EPS, heads=2),
                      [leaf(s_, d), leaf(s_, d), *sources], small=s_ * n * 2)
    m, z, o = (leaf(n, 2), leaf(n, 2, scale=0.1, shift=2.0), leaf(n, d))
    saves_only_inputs(lambda *a: attnres_phase2(*a, EPS, heads=2), [m, z, o, leaf(n, d), leaf(d), leaf(d)])


def test_bf16(path):
    src = [torch.randn(6, 24) * (1 + i) for i in range(3)]
    bf16_matches_fp32(lambda q, g, *s: attnres_phase1_sources(s, q, g, EPS),
                      lambda q, g, *s: mixing.attnres_block_phase1(torch.stack(s), q, g, EPS), torch.randn(2, 24),
                      torch.rand(2, 24) + 0.5, *src)
