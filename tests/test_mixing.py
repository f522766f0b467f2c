"""The depth-mixing math (mega_depth.mixing) against SPEC.md, in plain PyTorch."""

import math

import pytest
import torch

from mega_depth import mixing

torch.set_default_dtype(torch.float64)  # reference-precision checks; the modules are dtype-generic


def naive_attnres(sources, query, gain, eps):
    """SPEC.md section 1 written out: softmax_i(w . RMSNorm(v_i)), a weighted sum."""
    normed = sources / torch.sqrt(sources.pow(2).mean(-1, keepdim=True) + eps) * gain
    alpha = torch.softmax((normed * query).sum(-1), dim=0)
    return (alpha.unsqueeze(-1) * sources).sum(0)


def test_attnres_zero_query_is_uniform_average():
    mixer = mixing.AttnResMixer(16, eps=1e-6)
    sources = torch.randn(5, 3, 2, 16) * torch.arange(1, 6).view(5, 1, 1, 1)  # very different magnitudes
    torch.testing.assert_close(mixer(sources), sources.mean(0))


def test_attnres_matches_naive_formula_and_softmax_is_fp32():
    mixer = mixing.AttnResMixer(8)
    with torch.no_grad():
        mixer.query.normal_()
        mixer.key_norm_weight.uniform_(0.5, 1.5)
    sources = torch.randn(4, 5, 8)
    torch.testing.assert_close(mixer(sources), naive_attnres(sources, mixer.query, mixer.key_norm_weight, 1e-6))
    half = mixing.attnres_logits(sources.bfloat16(), mixer.query.bfloat16(), mixer.key_norm_weight.bfloat16(), 1e-6)
    assert half.dtype == torch.float32


def test_attnres_layout_blocks_and_remainder():
    lay = mixing.AttnResLayout(num_sublayers=10, num_blocks=3)  # S = 3, last block takes 4
    assert [lay.block_of(i) for i in range(1, 11)] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert lay.num_sources_before(1) == 1  # embedding only
    assert lay.num_sources_before(2) == 2  # b0 + partial
    assert lay.num_sources_before(4) == 2  # b0, b1
    assert lay.num_sources_before(11) == 4  # final: b0..b3
    full = mixing.AttnResLayout(6, 6)
    assert [full.num_sources_before(i) for i in range(1, 8)] == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="num_blocks"):
        mixing.AttnResLayout(4, 5)


def test_block_state_sums_outputs_within_a_block():
    lay = mixing.AttnResLayout(6, 2)
    emb = torch.randn(3, 4)
    state = mixing.AttnResState.from_embedding(lay, emb)
    outs = [torch.randn(3, 4) for _ in range(6)]
    for o in outs:
        state.record(o)
    torch.testing.assert_close(state.sources(), torch.stack([emb, sum(outs[:3]), sum(outs[3:])]))


@pytest.mark.parametrize("completed", [1, 3])
def test_two_phase_block_equals_naive(completed):
    d, S = 12, 4
    mixers = [mixing.AttnResMixer(d) for _ in range(S)]
    for m in mixers:
        with torch.no_grad():
            m.query.normal_()
            m.key_norm_weight.uniform_(0.5, 2.0)
    blocks = torch.randn(completed, 2, 5, d) * 3
    weights = [torch.randn(d, d) / math.sqrt(d) for _ in range(S)]
    fns = [lambda h, w=w: torch.tanh(h @ w) for w in weights]
    two_phase = mixing.attnres_two_phase_block(blocks, fns, mixers)
    naive, partial = [], None
    for fn, m in zip(fns, mixers):
        srcs = torch.cat([blocks, partial.unsqueeze(0)]) if partial is not None else blocks
        out = fn(naive_attnres(srcs, m.query, m.key_norm_weight, m.eps))
        naive.append(out)
        partial = out if partial is None else partial + out
    for a, b in zip(two_phase, naive):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_grn_at_init_is_the_plain_residual_sum(version):
    grn = mixing.GRN(8, num_sources=4, version=version, count=3)
    stack = torch.randn(4, 5, 8)
    torch.testing.assert_close(grn(stack), stack.sum(0).expand(3, 5, 8))


def test_grn_v3_matches_formula():
    grn = mixing.GRN(6, num_sources=3, version="v3", count=2)
    with torch.no_grad():
        grn.bias.normal_()
        grn.proj.normal_()
    stack = torch.randn(3, 7, 6)
    for g in range(2):
        expected = sum((grn.bias[g, :, i] + torch.relu(stack[i] @ grn.proj[g]).unsqueeze(-1)) * stack[i]
                       for i in range(3))
        torch.testing.assert_close(grn(stack)[g], expected)


def test_grn_v3_input_dependent_term_learns_from_zero_init():
    grn = mixing.GRN(6, num_sources=3, version="v3")
    grn(torch.randn(3, 7, 6)).pow(2).sum().backward()
    assert grn.proj.grad.abs().max() > 0


def test_kdca_keeps_input_sum_and_last_k():
    x = torch.randn(2, 4)
    outs = [torch.randn(2, 4) for _ in range(5)]
    state = mixing.DCAState.from_embedding(2, x)
    sizes = []
    for t, f in enumerate(outs, start=1):
        assert state.stack().shape[0] == mixing.dca_num_sources(t, 2)
        sizes.append(state.stack().shape[0])
        state.record(f)
    assert sizes == [1, 2, 3, 4, 4]
    torch.testing.assert_close(state.stack(), torch.stack([x, outs[0] + outs[1] + outs[2], outs[3], outs[4]]))
    assert mixing.dca_num_sources(6, None) == 6


def test_dca_block_at_init_is_the_prenorm_transformer_block():
    d = 8
    norm = lambda v: v / v.norm(dim=-1, keepdim=True)  # noqa: E731
    wa, wm = torch.randn(d, d), torch.randn(d, d)
    attn = lambda q, k, v: norm(q) @ wa  # noqa: E731  (q == k == v at init)
    mlp = lambda v: torch.tanh(norm(v) @ wm)  # noqa: E731
    x, f1 = torch.randn(3, d), torch.randn(3, d)
    state = mixing.DCAState.from_embedding(None, x)
    state.record(f1)
    mixing.dca_block(state, mixing.GRN(d, 2, "v3", count=3), attn, mlp)
    h = x + f1  # the standard residual stream
    h = h + attn(h, h, h)
    h = h + mlp(h)
    torch.testing.assert_close(state.stack().sum(0), h)


def test_depth_attention_candidates_and_what_travels():
    assert mixing.depth_attention_candidates(0, 24, 0) == []
    assert mixing.depth_attention_candidates(24, 24, 0) == [0]
    assert mixing.depth_attention_candidates(30, 24, 0) == [0, 24]
    assert mixing.depth_attention_candidates(5, 2, 1) == [0, 2, 4]
    assert mixing.depth_attention_candidates(5, None, 2) == [3, 4]
    assert mixing.depth_attention_needed_after(10, 48, 24, 0) == [0]
    assert mixing.depth_attention_needed_after(30, 48, 24, 0) == [0, 24]
    assert mixing.depth_attention_needed_after(3, 6, None, 1) == [3]
    assert mixing.depth_attention_needed_after(5, 6, None, 1) == []


def _qkv(hq=4, hkv=2, hn=8, lead=(3, 2)):
    return torch.randn(*lead, hq, hn), torch.randn(*lead, hkv, hn), torch.randn(*lead, hkv, hn)


def test_depth_attention_without_candidates_returns_the_value():
    q, k, v = _qkv()
    out = mixing.depth_attention_mix(q, k, v, None, None, lambda t: t, "group")
    assert out is v
    out = mixing.depth_attention_mix(q, k, v, None, None, lambda t: t, "query")
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=-2))


def test_depth_attention_matches_formula_per_query_head():
    q, k, v = _qkv()
    cand_k, cand_v = torch.randn(2, 3, 2, 2, 8), torch.randn(2, 3, 2, 4, 8)
    knorm = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    out = mixing.depth_attention_mix(q, k, v, cand_k, cand_v, knorm, "query")
    for h in range(4):
        g = h // 2
        keys = [knorm(cand_k[j][..., g, :]) for j in range(2)] + [k[..., g, :]]
        vals = [cand_v[j][..., h, :] for j in range(2)] + [v[..., g, :]]
        scores = torch.stack([(q[..., h, :] * kk).sum(-1) / math.sqrt(8) for kk in keys])
        alpha = torch.softmax(scores, 0)
        torch.testing.assert_close(out[..., h, :], sum(a.unsqueeze(-1) * vv for a, vv in zip(alpha, vals)))


def test_depth_attention_group_mode_equals_query_mode_for_mha():
    q, k, v = _qkv(hq=4, hkv=4)
    cand_k, cand_v = torch.randn(3, 3, 2, 4, 8), torch.randn(3, 3, 2, 4, 8)
    a = mixing.depth_attention_mix(q, k, v, cand_k, cand_v, lambda t: t, "query")
    b = mixing.depth_attention_mix(q, k, v, cand_k, cand_v, lambda t: t, "group")
    torch.testing.assert_close(a, b)


def test_depth_attention_state_keeps_only_what_later_layers_need():
    state = mixing.DepthAttentionState(hidden=torch.zeros(1))
    for layer in range(6):
        state.store(layer, torch.randn(2, 1, 8), torch.randn(2, 1, 8), num_layers=6, stride=3, window=1)
        assert sorted(state.raw_keys) == mixing.depth_attention_needed_after(layer, 6, 3, 1)
    with pytest.raises(RuntimeError, match="not carried"):
        mixing.DepthAttentionState(hidden=torch.zeros(1)).candidates(4, 3, 1)


def test_compiled_kernels_equal_the_eager_math():
    """--compile-mixing routes the three hot functions through torch.compile; values and gradients must not move.
    The heatmap recorder always gets the eager path."""
    g = torch.Generator().manual_seed(0)

    def inputs():
        return dict(sources=torch.randn(3, 2, 5, 16, generator=g), query=torch.randn(16, generator=g),
                    gain=1 + 0.1 * torch.randn(16, generator=g), stack=torch.randn(3, 2, 5, 16, generator=g),
                    bias=torch.randn(2, 16, 3, generator=g), proj=torch.randn(2, 16, generator=g),
                    q=torch.randn(2, 5, 4, 8, generator=g), k=torch.randn(2, 5, 2, 8, generator=g),
                    v=torch.randn(2, 5, 2, 8, generator=g), ck=torch.randn(2, 2, 5, 2, 8, generator=g),
                    cv=torch.randn(2, 2, 5, 4, 8, generator=g))

    def run(x):
        x = {k: t.clone().requires_grad_() for k, t in x.items()}
        out = (mixing.kernel(mixing.attnres_mix)(x["sources"], x["query"], x["gain"], 1e-6).square().sum()
               + mixing.kernel(mixing.grn_apply)(x["stack"], x["bias"], x["proj"], "v3").square().sum()
               + mixing.kernel(mixing.depth_attention_mix)(x["q"], x["k"], x["v"], x["ck"], x["cv"],
                                                            lambda t: t * 1.5).square().sum())
        out.backward()
        return out.detach(), {k: t.grad for k, t in x.items()}

    x = inputs()
    try:
        mixing.compile_kernels(True)
        assert mixing.kernel(mixing.attnres_mix) is not mixing.attnres_mix
        with mixing.record_depth_weights():
            assert mixing.kernel(mixing.attnres_mix) is mixing.attnres_mix
        compiled, compiled_grads = run(x)
    finally:
        mixing.compile_kernels(False)
    eager, eager_grads = run(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)
