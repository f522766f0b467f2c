"""The depth-mixing math (mega_depth/model/mixing.py) against docs/mechanisms.md, in plain PyTorch.

Reference-precision checks build their tensors in float64 explicitly; nothing changes torch's default dtype.
"""

import math

import pytest
import torch

from mega_depth.model import mixing
from mega_depth.model.attnres import AttnResLayout
from mega_depth.model.dca import DCAState
from mega_depth.model.depth_attention import DepthAttentionState

F64 = torch.float64


def randn(*shape, scale=1.0):
    return torch.randn(*shape, dtype=F64) * scale


def naive_attnres(sources, query, gain, eps):
    """docs/mechanisms.md §4 written out: softmax_i(w . RMSNorm(v_i)), a weighted sum."""
    normed = sources / torch.sqrt(sources.pow(2).mean(-1, keepdim=True) + eps) * gain
    alpha = torch.softmax((normed * query).sum(-1), dim=0)
    return (alpha.unsqueeze(-1) * sources).sum(0)


def test_attnres_zero_query_is_uniform_average():
    sources = randn(5, 3, 2, 16) * torch.arange(1, 6, dtype=F64).view(5, 1, 1, 1)  # very different magnitudes
    out = mixing.attnres_mix(sources, torch.zeros(16, dtype=F64), torch.ones(16, dtype=F64), 1e-6)
    torch.testing.assert_close(out, sources.mean(0))


def test_attnres_matches_naive_formula_and_weights_are_fp32():
    query, gain, sources = randn(8), 0.5 + torch.rand(8, dtype=F64), randn(4, 5, 8)
    torch.testing.assert_close(mixing.attnres_mix(sources, query, gain, 1e-6), naive_attnres(sources, query, gain, 1e-6))
    half = mixing.attnres_logits(sources.bfloat16(), query.bfloat16(), gain.bfloat16(), 1e-6)
    assert half.dtype == torch.float32


def test_attnres_variants_follow_their_definitions():
    """docs/mechanisms.md §4: multi-head (per channel group), sigmoid (no normalisation), no key norm, per-token
    query."""
    sources, query, gain, eps = randn(4, 3, 8), randn(8), 0.5 + torch.rand(8, dtype=F64), 1e-6
    normed = sources / torch.sqrt(sources.pow(2).mean(-1, keepdim=True) + eps) * gain
    heads = mixing.attnres_mix(sources, query, gain, eps, heads=2)
    for h in range(2):
        c = slice(4 * h, 4 * h + 4)
        alpha = torch.softmax((normed[..., c] * query[c]).sum(-1), 0)
        torch.testing.assert_close(heads[..., c], (alpha.unsqueeze(-1) * sources[..., c]).sum(0))
    sig = mixing.attnres_mix(sources, query, gain, eps, weight="sigmoid")
    torch.testing.assert_close(sig, (torch.sigmoid((normed * query).sum(-1)).unsqueeze(-1) * sources).sum(0))
    no_norm = mixing.attnres_mix(sources, query, None, eps)
    torch.testing.assert_close(no_norm, (torch.softmax((sources * query).sum(-1), 0).unsqueeze(-1) * sources).sum(0))
    per_token = randn(3, 8)
    out = mixing.attnres_mix(sources, per_token, gain, eps)
    torch.testing.assert_close(out, (torch.softmax((normed * per_token).sum(-1), 0).unsqueeze(-1) * sources).sum(0))
    logits = randn(4)
    torch.testing.assert_close(mixing.scalar_mix(sources, logits),
                               (torch.softmax(logits, 0).view(4, 1, 1) * sources).sum(0))


def test_attnres_layout_blocks_and_remainder():
    lay = AttnResLayout(num_sublayers=10, num_blocks=3)  # S = 3, last block takes 4
    assert [lay.block_of(i) for i in range(1, 11)] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert lay.num_sources_before(1) == 1  # embedding only
    assert lay.num_sources_before(2) == 2  # b0 + partial
    assert lay.num_sources_before(4) == 2  # b0, b1
    assert lay.num_sources_before(11) == 4  # final: b0..b3
    full = AttnResLayout(6, 6)
    assert [full.num_sources_before(i) for i in range(1, 8)] == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="num_blocks"):
        AttnResLayout(4, 5)


@pytest.mark.parametrize("weight, heads", [("softmax", 1), ("softmax", 2), ("sigmoid", 1)])
@pytest.mark.parametrize("completed", [1, 3])
def test_two_phase_block_equals_sequential_in_values_and_gradients(completed, weight, heads):
    """Phase 1 (all queries of a block against the completed blocks at once) + phase 2 (online-softmax merge of
    the partial sum) gives the sequential computation's values AND gradients (docs/mechanisms.md §4; the speed issue
    needs it in training, so the stabilising max must not leak into the gradient)."""
    d, S, eps = 12, 4, 1e-6
    queries = randn(S, d).requires_grad_()
    gains = (0.5 + torch.rand(S, d, dtype=F64)).requires_grad_()
    blocks = (randn(completed, 2, 5, d) * 3).requires_grad_()
    weights = [randn(d, d) / math.sqrt(d) for _ in range(S)]

    def run(two_phase):
        outs, partial = [], None
        if two_phase:
            m, z, o = mixing.attnres_block_phase1(blocks, queries, gains, eps, weight, heads)
        for i, w in enumerate(weights):
            if two_phase:
                h = mixing.attnres_block_phase2(m[i], z[i], o[i], partial, queries[i], gains[i], eps, weight, heads)
            else:
                srcs = torch.cat([blocks, partial.unsqueeze(0)]) if partial is not None else blocks
                h = mixing.attnres_mix(srcs, queries[i], gains[i], eps, weight, heads)
            out = torch.tanh(h @ w)
            outs.append(out)
            partial = out if partial is None else partial + out
        loss = sum((o * torch.linspace(-1, 1, d, dtype=F64)).sum() for o in outs)
        grads = torch.autograd.grad(loss, [queries, gains, blocks])
        return torch.stack(outs), grads

    values, grads = run(True)
    ref_values, ref_grads = run(False)
    torch.testing.assert_close(values, ref_values, rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_grn_at_init_is_the_plain_residual_sum(version):
    from mega_depth.model.dca import GRN

    grn = GRN(8, num_sources=4, version=version, count=3, dtype=F64)
    stack = randn(4, 5, 8)
    torch.testing.assert_close(mixing.grn_apply(stack, grn.bias, grn.proj, version), stack.sum(0).expand(3, 5, 8))


def test_grn_v3_matches_formula_and_learns_from_zero_init():
    bias, proj, stack = randn(2, 6, 3), randn(2, 6), randn(3, 7, 6)
    out = mixing.grn_apply(stack, bias, proj, "v3")
    for g in range(2):
        expected = sum((bias[g, :, i] + torch.relu(stack[i] @ proj[g]).unsqueeze(-1)) * stack[i] for i in range(3))
        torch.testing.assert_close(out[g], expected)
    zero = torch.zeros(1, 6, dtype=F64, requires_grad=True)
    mixing.grn_apply(stack, torch.ones(1, 6, 3, dtype=F64), zero, "v3").pow(2).sum().backward()
    assert zero.grad.abs().max() > 0  # clamp's subgradient at 0: the input-dependent term is not dead at init


def test_kdca_keeps_input_sum_and_last_k():
    x = randn(2, 4)
    outs = [randn(2, 4) for _ in range(5)]
    state = DCAState(2, x, None, [], 1)
    sizes = []
    for t, f in enumerate(outs, start=1):
        assert state.stack().shape[0] == mixing.dca_num_sources(t, 2)
        sizes.append(state.stack().shape[0])
        state.record(f)
    assert sizes == [1, 2, 3, 4, 4]
    torch.testing.assert_close(state.stack(), torch.stack([x, outs[0] + outs[1] + outs[2], outs[3], outs[4]]))
    assert mixing.dca_num_sources(6, None) == 6


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
    return randn(*lead, hq, hn), randn(*lead, hkv, hn), randn(*lead, hkv, hn)


def test_depth_attention_without_candidates_returns_the_value():
    q, k, v = _qkv()
    torch.testing.assert_close(mixing.depth_attention_mix(q, k, v, None, None, "group"), v)
    torch.testing.assert_close(mixing.depth_attention_mix(q, k, v, None, None, "query"), v.repeat_interleave(2, -2))


def test_depth_attention_matches_formula_per_query_head():
    q, k, v = _qkv()
    cand_k, cand_v = randn(2, 3, 2, 2, 8), randn(2, 3, 2, 4, 8)
    out = mixing.depth_attention_mix(q, k, v, cand_k, cand_v, "query")
    for h in range(4):
        g = h // 2
        keys = [cand_k[j][..., g, :] for j in range(2)] + [k[..., g, :]]
        vals = [cand_v[j][..., h, :] for j in range(2)] + [v[..., g, :]]
        scores = torch.stack([(q[..., h, :] * kk).sum(-1) / math.sqrt(8) for kk in keys])
        alpha = torch.softmax(scores, 0)
        torch.testing.assert_close(out[..., h, :], sum(a.unsqueeze(-1) * vv for a, vv in zip(alpha, vals)))


def test_depth_attention_group_mode_equals_query_mode_for_mha():
    q, k, v = _qkv(hq=4, hkv=4)
    cand_k, cand_v = randn(3, 3, 2, 4, 8), randn(3, 3, 2, 4, 8)
    torch.testing.assert_close(mixing.depth_attention_mix(q, k, v, cand_k, cand_v, "query"),
                               mixing.depth_attention_mix(q, k, v, cand_k, cand_v, "group"))


def test_depth_attention_state_keeps_only_what_later_layers_need():
    state = DepthAttentionState(hidden=torch.zeros(1))
    for layer in range(6):
        state.store(layer, randn(2, 1, 8), randn(2, 1, 8), num_layers=6, stride=3, window=1)
        assert sorted(state.raw_keys) == mixing.depth_attention_needed_after(layer, 6, 3, 1)
    with pytest.raises(RuntimeError, match="not carried"):
        DepthAttentionState(hidden=torch.zeros(1)).candidates(4, 3, 1)
