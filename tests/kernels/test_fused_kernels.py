"""The fused depth-mixing Functions (mega_depth/kernels/fused.py) against the eager reference (mixing.py).

Both inner paths of every Function run here: the Triton kernels (on CPU tensors under the Triton interpreter,
TRITON_INTERPRET=1 set before triton is imported; on a GPU for real) and the torch twins (the Triton switch forced
off). Values and the gradients w.r.t. every tensor input are compared in fp32 at ~1e-5 relative; tiny shapes keep
it fast. It runs in its own process (tests/unit/test_kernels.py starts it with the environment it needs, so that
the interpreter setting never leaks into other tests); on a GPU: `pytest tests/kernels`.
"""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton (and of the kernels)
os.environ.setdefault("MEGA_DEPTH_KERNELS_FORCE_TRITON", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the fused kernels' Triton path cannot run")

from mega_depth.kernels import fused  # noqa: E402
from mega_depth.model import mixing  # noqa: E402

EPS = 1e-6


def _interpreted() -> bool:
    """The kernels run under the interpreter only if nothing imported them before TRITON_INTERPRET was set."""
    if not fused.triton_available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fused._triton_ops._attnres_fwd_kernel, InterpretedFunction)


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Run the test once through the Triton kernels (interpreted) and once through the torch twins."""
    if request.param == "triton":
        if not _interpreted():
            pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 (or triton is missing)")
        monkeypatch.setattr(fused, "FORCE_TRITON", True)
    else:
        monkeypatch.setattr(fused, "FORCE_TRITON", False)
    assert fused.uses_triton(torch.zeros(1)) == (request.param == "triton")
    return request.param


def leaf(*shape, scale=1.0, shift=0.0, dtype=torch.float32):
    return (torch.randn(*shape, dtype=dtype) * scale + shift).requires_grad_()


def sources_of(k, *shape):
    """K sources of clearly different magnitudes (a non-uniform depth softmax)."""
    return [leaf(*shape, scale=0.5 + i) for i in range(k)]


def close(actual, expected, what, rtol=1e-5):
    scale = max(float(expected.detach().abs().max()), 1e-6) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def check(fast, reference, inputs, label):
    """Values of every output, then the gradients of a random projection of the outputs w.r.t. every input
    tensor that requires grad (None on one side only passes if the other side is all zeros)."""
    torch.manual_seed(1234)
    out_f, out_r = fast(*inputs), reference(*inputs)
    outs_f = out_f if isinstance(out_f, tuple) else (out_f,)
    outs_r = out_r if isinstance(out_r, tuple) else (out_r,)
    assert len(outs_f) == len(outs_r)
    for i, (a, b) in enumerate(zip(outs_f, outs_r)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), f"{label} output {i}: {a.shape} {a.dtype} vs {b.dtype}"
        assert a.requires_grad == b.requires_grad, f"{label} output {i}: requires_grad differs"
        close(a, b, f"{label} output {i}")
    weights = [torch.randn_like(b) for b in outs_r]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    loss_f = sum((a * w).sum() for a, w in zip(outs_f, weights) if a.requires_grad)
    loss_r = sum((b * w).sum() for b, w in zip(outs_r, weights) if b.requires_grad)
    grads_f = torch.autograd.grad(loss_f, leaves, allow_unused=True)
    grads_r = torch.autograd.grad(loss_r, leaves, allow_unused=True)
    for i, (a, b) in enumerate(zip(grads_f, grads_r)):
        if a is None or b is None:
            other = a if b is None else b
            assert other is None or not other.abs().any(), f"{label} grad {i}: None vs nonzero"
            continue
        close(a, b, f"{label} grad of input {i}")


# --------------------------------------------------------------------------------------------------------------
# AttnRes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k, lead, d, heads, weight, norm, per_token", [
    (1, (5,), 12, 1, "softmax", True, False),
    (3, (2, 3), 12, 1, "softmax", True, False),
    (4, (7,), 24, 2, "softmax", True, False),
    (3, (3, 2), 12, 1, "sigmoid", True, False),
    (3, (5,), 12, 2, "sigmoid", True, False),
    (3, (5,), 12, 2, "softmax", False, False),
    (3, (2, 3), 12, 1, "softmax", True, True),
    (2, (5,), 24, 2, "softmax", False, True),
])
def test_attnres_mix_sources(path, k, lead, d, heads, weight, norm, per_token):
    sources = sources_of(k, *lead, d)
    query = leaf(*lead, d) if per_token else leaf(d)
    gain = leaf(d, scale=0.3, shift=1.0) if norm else None
    check(lambda q, g, *s: fused.attnres_mix_sources(list(s), q, g, EPS, weight, heads),
          lambda q, g, *s: mixing.attnres_mix(torch.stack(s), q, g, EPS, weight, heads),
          [query, gain, *sources], f"attnres_mix k={k} heads={heads} {weight} norm={norm} per_token={per_token}")


def test_attnres_mix_accepts_a_stacked_tensor_and_views(path):
    stacked = leaf(3, 4, 12)
    query, gain = leaf(12), leaf(12, scale=0.3, shift=1.0)
    out = fused.attnres_mix_sources(stacked, query, gain, EPS)
    close(out, mixing.attnres_mix(stacked, query, gain, EPS), "stacked")
    sources = [stacked[i, :, 1:9] for i in range(3)]  # non-contiguous views
    close(fused.attnres_mix_sources(sources, query[:8], gain[:8], EPS),
          mixing.attnres_mix(torch.stack(sources), query[:8], gain[:8], EPS), "views")


@pytest.mark.parametrize("heads, weight, norm", [(1, "softmax", True), (2, "softmax", True), (1, "sigmoid", True),
                                                 (2, "sigmoid", False), (1, "softmax", False)])
@pytest.mark.parametrize("completed", [1, 3])
def test_attnres_block_phases(path, completed, heads, weight, norm):
    """Phase 1 over 1 or 3 completed blocks with S = 3 queries; phase 2 for the block's first sublayer (no
    partial sum yet) and for its last (a partial sum)."""
    d, lead, s_ = 12, (2, 3), 3
    blocks = sources_of(completed, *lead, d)
    queries = leaf(s_, d)
    gains = leaf(s_, d, scale=0.3, shift=1.0) if norm else None
    label = f"completed={completed} heads={heads} {weight} norm={norm}"
    check(lambda q, g, *b: fused.attnres_phase1_sources(list(b), q, g, EPS, weight, heads),
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
        check(lambda *a: fused.attnres_phase2(*a, EPS, weight, heads),
              lambda *a: mixing.attnres_block_phase2(*a, EPS, weight, heads),
              [mi, zi, oi, partial, query, gain], f"phase2 {label} query={i} partial={partial is not None}")


@pytest.mark.parametrize("weight", ["softmax", "sigmoid"])
def test_attnres_block_phases_chained(path, weight):
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

    check(chain(lambda b, q, g: fused.attnres_phase1_sources(b, q, g, EPS, weight, heads),
                lambda *a: fused.attnres_phase2(*a, EPS, weight, heads)),
          chain(lambda b, q, g: mixing.attnres_block_phase1(torch.stack(b), q, g, EPS, weight, heads),
                lambda *a: mixing.attnres_block_phase2(*a, EPS, weight, heads)),
          [queries, gains, partial, *blocks], f"phases chained {weight}")


def test_phase1_m_is_a_detached_stabiliser(path):
    blocks = sources_of(2, 4, 12)
    m, z, o = fused.attnres_phase1_sources(blocks, leaf(2, 12), leaf(2, 12), EPS)
    assert not m.requires_grad and z.requires_grad and o.requires_grad
    m, z, _ = fused.attnres_phase1_sources(blocks, leaf(2, 12), leaf(2, 12), EPS, weight="sigmoid")
    assert not m.requires_grad and not z.requires_grad and not m.any() and (z == 1).all()


# --------------------------------------------------------------------------------------------------------------
# DCA (GRN)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_grn_apply_sources(path, version, k):
    """g = 3 instances (q, k, v); K = 4 is k-DCA's stack [x, sum, f_{t-1}, f_t]."""
    g, lead, d = 3, (5,), 12
    sources = sources_of(k, *lead, d)
    bias = leaf(g, k) if version == "v1" else leaf(g, d, k)
    proj = leaf(g, d) if version == "v3" else None
    check(lambda b, p, *s: fused.grn_apply_sources(list(s), b, p, version),
          lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, version),
          [bias, proj, *sources], f"grn {version} k={k}")


def test_grn_v3_gate_has_subgradient_one_at_zero(path):
    """proj starts at exactly zero: every gate sits on the kink, where clamp's subgradient (1) must be kept."""
    sources = sources_of(3, 2, 3, 12)
    bias, proj = leaf(3, 12, 3), torch.zeros(3, 12, requires_grad=True)
    check(lambda b, p, *s: fused.grn_apply_sources(list(s), b, p, "v3"),
          lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, "v3"),
          [bias, proj, *sources], "grn v3 at zero proj")
    out = fused.grn_apply_sources(sources, bias, proj, "v3")
    (grad,) = torch.autograd.grad(out.sum(), [proj])
    assert grad.abs().sum() > 0


# --------------------------------------------------------------------------------------------------------------
# Depth-Attention
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, hv", [("query", 4), ("query", 2), ("group", 2)])
@pytest.mark.parametrize("c", [0, 1, 2])
def test_depth_attention_mix(path, mode, hv, c):
    """GQA 4 query heads / 2 key-value heads; candidate values with hq heads ("query" mode stores mixed values
    per query head) or hkv heads; C = 0 returns the value expanded like the reference."""
    lead, hq, hkv, hn = (3, 2), 4, 2, 6
    query, key, value = leaf(*lead, hq, hn), leaf(*lead, hkv, hn), leaf(*lead, hkv, hn)
    cand_keys = leaf(c, *lead, hkv, hn) if c else None
    cand_values = leaf(c, *lead, hv, hn, scale=2.0) if c else None
    check(lambda *a: fused.depth_attention_mix(*a, gqa_mode=mode),
          lambda *a: mixing.depth_attention_mix(*a, gqa_mode=mode),
          [query, key, value, cand_keys, cand_values], f"depth attention {mode} hv={hv} C={c}")


def test_depth_attention_reads_strided_keys_and_values(path):
    """A key and value split off a fused projection are strided views: read in place, gradients land in the
    fused tensor; candidates given as a list."""
    lead, hkv, r, hn = (3, 2), 2, 2, 6
    fused_kv = leaf(*lead, hkv, (r + 2) * hn)
    key, value = fused_kv[..., r * hn:(r + 1) * hn], fused_kv[..., (r + 1) * hn:]
    cands_k, cands_v = [leaf(*lead, hkv, hn) for _ in range(2)], [leaf(*lead, hkv * r, hn) for _ in range(2)]
    check(lambda f, *c: fused.depth_attention_mix(query_of(f), *kv_of(f), list(c[:2]), list(c[2:]), "query"),
          lambda f, *c: mixing.depth_attention_mix(query_of(f), *kv_of(f), torch.stack(c[:2]), torch.stack(c[2:]),
                                                   "query"),
          [fused_kv, *cands_k, *cands_v], "depth attention strided")
    assert key.stride(-2) != hn and value.stride(-2) != hn  # really strided


def query_of(f, r=2, hn=6):
    return f[..., :r * hn].reshape(*f.shape[:-2], f.shape[-2] * r, hn)


def kv_of(f, r=2, hn=6):
    return f[..., r * hn:(r + 1) * hn], f[..., (r + 1) * hn:]


# --------------------------------------------------------------------------------------------------------------
# HC / mHC: the streams' read and write, and mHC's Sinkhorn
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("per_token", [True, False])
def test_streams_in_and_out(path, n, per_token):
    """mHC's per-token coefficients, and HC's static ones broadcast over the tokens ([n, 1, 1], [n, 1, 1, n]);
    n = 3 is not a power of two (masked stream lanes)."""
    lead, d = (5, 2), 24
    streams, output = leaf(n, *lead, d), leaf(*lead, d, scale=2.0)
    coef = lead if per_token else (1,) * len(lead)
    weights, post = leaf(n, *coef), leaf(n, *coef, shift=1.0)
    mix = leaf(n, *coef, n, scale=0.5)
    check(fused.streams_in, mixing.streams_in, [streams, weights], f"streams_in n={n}")
    check(fused.streams_out, mixing.streams_out, [streams, output, mix, post], f"streams_out n={n}")


def test_streams_read_an_expanded_embedding_and_a_pipeline_view(path):
    """The first layer's streams are the embedding expanded n times (stream stride 0) and a received pipeline
    tensor is viewed [s, b, n*d] -> [n, s, b, d] (permuted strides): both read in place, gradients flow back."""
    n, (s_, b), d = 4, (5, 2), 16
    embedding = leaf(s_, b, d)
    payload = leaf(s_, b, n * d)
    weights, mix, post = leaf(n, s_, b), leaf(n, s_, b, n, scale=0.5), leaf(n, s_, b)
    output = leaf(s_, b, d)

    def expanded(e):
        return e.unsqueeze(0).expand(n, *e.shape)

    def viewed(p):
        return p.unflatten(2, (n, d)).permute(2, 0, 1, 3)

    for make, label in ((expanded, "expanded"), (viewed, "pipeline view")):
        src = embedding if make is expanded else payload
        assert fused._stream_rows(make(src)).data_ptr() == src.data_ptr()  # no copy
        check(lambda x, w: fused.streams_in(make(x), w), lambda x, w: mixing.streams_in(make(x), w),
              [src, weights], f"streams_in {label}")
        check(lambda x, y, m, p: fused.streams_out(make(x), y, m, p),
              lambda x, y, m, p: mixing.streams_out(make(x), y, m, p), [src, output, mix, post],
              f"streams_out {label}")


@pytest.mark.parametrize("order", ["paper", "megatron"])
@pytest.mark.parametrize("eps_style", ["clamp", "deepseek"])
@pytest.mark.parametrize("n, iters", [(1, 3), (3, 6), (4, 20)])
def test_sinkhorn(path, order, eps_style, n, iters):
    """mHC's H_res: every iteration in one kernel; backward recomputes the iterations (n = 3: masked lanes)."""
    logits = leaf(7, 2, n, n, scale=2.0)
    check(lambda r: fused.sinkhorn(r, iters, order, eps_style), lambda r: mixing.sinkhorn(r, iters, order, eps_style),
          [logits], f"sinkhorn n={n} {order} {eps_style}")


def test_sinkhorn_clamp_stops_the_gradient_of_vanishing_sums(path):
    """A row far below the others underflows after exp: its sums fall under eps, where the reference's
    clamp(min=eps) passes no gradient through the sum; the kernel must agree (and deepseek's +eps always does)."""
    logits = torch.randn(6, 4, 4) * 0.5
    logits[:, 0, :] -= 16.0  # exp: ~1e-7 per entry, row sums just under eps = 1e-6
    logits.requires_grad_()
    for style in ("clamp", "deepseek"):
        check(lambda r: fused.sinkhorn(r, 5, "paper", style), lambda r: mixing.sinkhorn(r, 5, "paper", style),
              [logits], f"sinkhorn underflow {style}")


# --------------------------------------------------------------------------------------------------------------
# The memory contract and bf16
# --------------------------------------------------------------------------------------------------------------


def saved_storages(fn):
    """{storage pointer: elements} of every tensor saved for backward while running fn()."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def test_attnres_mix_saves_no_stacked_copy(path):
    k, lead, d = 4, (3, 5), 16
    n = 15
    sources = sources_of(k, *lead, d)
    query, gain = leaf(d), leaf(d, scale=0.3, shift=1.0)
    saved, out = saved_storages(lambda: fused.attnres_mix_sources(sources, query, gain, EPS, heads=2))
    assert k * n * d not in saved.values(), saved
    assert max(saved.values()) <= n * d
    assert {s.untyped_storage().data_ptr() for s in sources} <= set(saved)  # the sources by reference
    out.sum().backward()
    assert all(s.grad is not None and s.grad.shape == s.shape for s in sources)
    # The eager reference does save a stacked copy: the check above would see one.
    ref, _ = saved_storages(lambda: mixing.attnres_mix(torch.stack(sources), query, gain, EPS, heads=2))
    assert k * n * d in ref.values()


def test_other_functions_save_only_their_inputs(path):
    """Phase 1, GRN and depth-attention save references to their inputs and (phase 1) the small m [S, N, H]."""
    k, n, d, s_ = 4, 6, 12, 3
    sources = sources_of(k, n, d)

    def only_inputs(fn, *inputs, small=0):
        saved, _ = saved_storages(lambda: fn(*inputs))
        given = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        given |= {t.untyped_storage().data_ptr() for t in sources}
        extra = {ptr: size for ptr, size in saved.items() if ptr not in given}
        assert all(size <= small for size in extra.values()), extra
        assert k * n * d not in extra.values()

    only_inputs(lambda q, g: fused.attnres_phase1_sources(sources, q, g, EPS, heads=2), leaf(s_, d), leaf(s_, d),
                small=s_ * n * 2)
    only_inputs(lambda b, p: fused.grn_apply_sources(sources, b, p, "v3"), leaf(3, d, k), leaf(3, d))
    cands = [leaf(n, 2, 3) for _ in range(6)]
    only_inputs(lambda q, key, v, *c: fused.depth_attention_mix(q, key, v, list(c[:3]), list(c[3:]), "query"),
                leaf(n, 4, 3), leaf(n, 2, 3), leaf(n, 2, 3), *cands)
    streams = leaf(4, n, d)
    only_inputs(lambda x, w: fused.streams_in(x, w), streams, leaf(4, n))
    only_inputs(lambda r: fused.sinkhorn(r, 20), leaf(n, 4, 4))
    only_inputs(lambda x, y, m, p: fused.streams_out(x, y, m, p), streams, leaf(n, d), leaf(4, n, 4), leaf(4, n))


def test_bf16_matches_the_fp32_reference(path):
    """bf16 in, bf16 out; the depth weights are fp32 inside, so the result is within bf16 rounding of the
    reference evaluated in fp32 on the same (bf16-representable) values."""
    torch.manual_seed(0)
    b16 = torch.bfloat16

    def both(fast, reference, *tensors):
        low = [t.to(b16).detach().requires_grad_() if t is not None else None for t in tensors]
        high = [t.to(b16).float().detach().requires_grad_() if t is not None else None for t in tensors]
        out_l, out_h = fast(*low), reference(*high)
        tuples = [o if isinstance(o, tuple) else (o,) for o in (out_l, out_h)]
        for a, b in zip(*tuples):
            assert a.dtype in (b16, torch.float32)
            close(a.float(), b, "bf16", rtol=3e-2)
        out_l = out_l[-1] if isinstance(out_l, tuple) else out_l
        out_h = out_h[-1] if isinstance(out_h, tuple) else out_h
        assert out_l.dtype == b16
        w = torch.randn(out_h.shape)
        gl = torch.autograd.grad((out_l.float() * w).sum(), [t for t in low if t is not None])
        gh = torch.autograd.grad((out_h * w).sum(), [t for t in high if t is not None])
        for a, b in zip(gl, gh):
            assert a.dtype == b16
            close(a.float(), b, "bf16 grad", rtol=3e-2)

    src = [torch.randn(6, 24) * (1 + i) for i in range(3)]
    q, g = torch.randn(24), torch.rand(24) + 0.5
    both(lambda q, g, *s: fused.attnres_mix_sources(s, q, g, EPS, heads=2),
         lambda q, g, *s: mixing.attnres_mix(torch.stack(s), q, g, EPS, heads=2), q, g, *src)
    both(lambda q, g, *s: fused.attnres_phase1_sources(s, q, g, EPS),
         lambda q, g, *s: mixing.attnres_block_phase1(torch.stack(s), q, g, EPS), torch.randn(2, 24),
         torch.rand(2, 24) + 0.5, *src)
    both(lambda b, p, *s: fused.grn_apply_sources(s, b, p, "v3"),
         lambda b, p, *s: mixing.grn_apply(torch.stack(s), b, p, "v3"), torch.randn(3, 24, 3), torch.randn(3, 24),
         *src)
    both(lambda *a: fused.depth_attention_mix(*a, "query"), lambda *a: mixing.depth_attention_mix(*a, "query"),
         torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(2, 6, 2, 8),
         torch.randn(2, 6, 4, 8))
    both(fused.streams_in, mixing.streams_in, torch.randn(4, 6, 24), torch.rand(4, 6))
    both(fused.streams_out, mixing.streams_out, torch.randn(4, 6, 24), torch.randn(6, 24), torch.rand(4, 6, 4),
         torch.rand(4, 6) * 2)
