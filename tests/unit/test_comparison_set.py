"""docs/mechanisms.md §3: the identities of Hyper-Connections, mHC, DenseFormer and AttnRes's ablation variants, on the
math and on the plain decoder (the Megatron model is tied to the plain decoder in tests/integration)."""

import itertools
import math

import pytest
import torch

from mega_depth.model import mixing
from mega_depth.model.config import DecoderConfig, ResidualConfig
from mega_depth.model.decoder import CausalLM

F64 = torch.float64


def decoder(eps=1e-6, layers=4, **residual):
    torch.manual_seed(0)
    return CausalLM(DecoderConfig(vocab_size=64, hidden_size=32, num_layers=layers, num_attention_heads=4,
                                  num_query_groups=2, ffn_hidden_size=64, norm_epsilon=eps,
                                  residual=ResidualConfig(**residual))).eval()


def with_baseline_weights(model, eps=1e-6, layers=4):
    """(model, baseline) with the same transformer weights; the model's own parameters stay at their init."""
    base = decoder(eps, layers, mechanism="standard")
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            else:
                p.uniform_(0.5, 1.5)  # norm gains away from one
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(model.model.mechanism.owns(k) for k in missing), missing
    return model, base


IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))


def logits(model):
    with torch.no_grad():
        return model(IDS)


# --- Hyper-Connections ------------------------------------------------------------------------------------------


def test_hc_with_one_stream_and_unit_weights_is_the_baseline_bit_for_bit():
    model, base = with_baseline_weights(decoder(mechanism="hc", hc_expansion=1, hc_dynamic=False))
    assert torch.equal(logits(model), logits(base))


def test_hc_at_init_keeps_identical_streams_and_the_baseline_inputs():
    """Every sublayer input equals the baseline's bit for bit (tanh(0) = 0); the final sum is n x_L, which the final
    norm cancels up to its epsilon (0 here)."""
    model, base = with_baseline_weights(decoder(eps=0.0, mechanism="hc", hc_expansion=4), eps=0.0)
    seen = {"model": [], "base": []}
    hooks = [layer.input_layernorm.register_forward_hook(lambda m, i, o, k=k: seen[k].append(i[0]))
             for k, net in (("model", model), ("base", base)) for layer in net.model.layers]
    torch.testing.assert_close(logits(model), logits(base), rtol=1e-5, atol=1e-5)
    for h in hooks:
        h.remove()
    assert len(seen["model"]) == len(seen["base"]) == 4
    assert all(torch.equal(a, b) for a, b in zip(seen["model"], seen["base"]))


def test_hc_unfolded_depth_weights_reproduce_the_sublayer_inputs():
    """Eq. 27: x_k = sum_j c_kj v_j with v_0 the embedding and v_j the sublayer outputs (static HC, random)."""
    n, L, d = 3, 5, 8
    g = torch.Generator().manual_seed(0)
    a_m = [torch.randn(n, generator=g) for _ in range(L)]
    a_r = [torch.randn(n, n, generator=g) * 0.5 for _ in range(L)]
    b = [torch.randn(n, generator=g) for _ in range(L)]
    v = [torch.randn(d, generator=g)]
    streams, inputs = v[0].expand(n, d), []
    for k in range(L):
        x = mixing.streams_in(streams, a_m[k])
        inputs.append(x)
        v.append(torch.tanh(x * (k + 1)))
        streams = mixing.streams_out(streams, v[-1], a_r[k], b[k])
    c = mixing.hc_unfold(a_m, a_r, b)
    for k in range(L):
        torch.testing.assert_close(sum(c[k, j] * v[j] for j in range(k + 1)), inputs[k], rtol=1e-5, atol=4e-7)


def test_hc_parameter_count_matches_eq_25():
    n, d, L = 4, 32, 4
    model = decoder(mechanism="hc", hc_expansion=n)
    extra = sum(p.numel() for k, p in model.named_parameters() if model.model.mechanism.owns(k))
    assert extra == 2 * L * (d * (n + 2) + n * (n + 2) + 2 + d)
    static = decoder(mechanism="hc", hc_expansion=n, hc_dynamic=False)
    assert sum(p.numel() for k, p in static.named_parameters() if static.model.mechanism.owns(k)) == \
        2 * L * n * (n + 2)


# --- mHC ------------------------------------------------------------------------------------------------------


def test_mhc_at_default_init_is_the_baseline_to_fp_tolerance():
    model, base = with_baseline_weights(decoder(eps=0.0, mechanism="mhc", hc_expansion=4), eps=0.0)
    torch.testing.assert_close(logits(model), logits(base), rtol=1e-5, atol=1e-5)
    pre, post, res = mixing.mhc_coefficients(torch.randn(4, 3, 32), torch.zeros(24, 128),
                                             model.model.layers[0].attn_mhc.bias, torch.tensor([0.01]),
                                             torch.tensor([0.01]), torch.tensor([0.01]))
    torch.testing.assert_close(pre, torch.full_like(pre, 0.25))
    torch.testing.assert_close(post, torch.ones_like(post))
    torch.testing.assert_close(res.sum(-1), torch.ones(3, 4))


@pytest.mark.parametrize("order", mixing.MHC_SK_ORDERS)
@pytest.mark.parametrize("std", [1.0, 1.5])
def test_h_res_is_doubly_stochastic_within_the_sinkhorn_residual(order, std):
    logits_ = torch.randn(200, 4, 4, generator=torch.Generator().manual_seed(1)) * std
    h = mixing.sinkhorn(logits_, 20, order)
    assert (h >= 0).all()
    exact, other = (-1, -2) if order == "paper" else (-2, -1)  # the last normalisation is exact
    torch.testing.assert_close(h.sum(exact), torch.ones(200, 4), rtol=0, atol=5e-7)
    residual = (h.sum(other) - 1).abs().max().item()
    assert residual < 0.05, residual
    assert torch.linalg.matrix_norm(h, ord=2).max().item() <= 1 + residual + 1e-6
    torch.testing.assert_close(mixing.sinkhorn(logits_ + 3.7, 20, order), h, rtol=0, atol=1e-6)  # shift-free


def test_mhc_ranges_and_the_single_stream_case():
    streams = torch.randn(4, 5, 16) * 3
    g = torch.Generator().manual_seed(2)
    pre, post, res = mixing.mhc_coefficients(streams, torch.randn(24, 64, generator=g), torch.randn(24, generator=g),
                                             torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert ((pre >= 0) & (pre <= 1)).all() and ((post >= 0) & (post <= 2)).all()
    one = torch.randn(1, 5, 16)
    pre, post, res = mixing.mhc_coefficients(one, torch.randn(3, 16), torch.zeros(3), torch.tensor([1.0]),
                                             torch.tensor([1.0]), torch.tensor([1.0]))
    assert torch.equal(res, torch.ones_like(res))  # n = 1: H_res = 1 exactly


def test_relabelling_mhc_streams_only_relabels_its_outputs():
    n, d = 4, 8
    g = torch.Generator().manual_seed(4)
    streams, y = torch.randn(n, 3, d, generator=g), torch.randn(3, d, generator=g)
    phi, bias = torch.randn(n * n + 2 * n, n * d, generator=g) * 0.3, torch.randn(n * n + 2 * n, generator=g)
    alphas = [torch.tensor([0.7]), torch.tensor([0.9]), torch.tensor([1.1])]
    perm = torch.tensor([2, 0, 3, 1])

    def step(x, p, b):
        pre, post, res = mixing.mhc_coefficients(x, p, b, *alphas)
        mix = res.transpose(-1, -2).movedim(-2, 0)
        return mixing.streams_in(x, pre), mixing.streams_out(x, y, mix, post)

    block_perm = (perm.view(n, 1) * d + torch.arange(d)).flatten()  # phi's input columns, stream by stream
    out_perm = torch.cat([perm, n + perm, 2 * n + (perm.view(n, 1) * n + perm.view(1, n)).flatten()])
    x_in, x_out = step(streams, phi, bias)
    p_in, p_out = step(streams[perm], phi[out_perm][:, block_perm], bias[out_perm])
    torch.testing.assert_close(p_in, x_in, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p_out, x_out[perm], rtol=1e-5, atol=1e-6)


def test_mhc_parameter_count_matches_the_spec():
    n, d, L = 4, 32, 4
    model = decoder(mechanism="mhc", hc_expansion=n)
    extra = sum(p.numel() for k, p in model.named_parameters() if model.model.mechanism.owns(k))
    assert extra == 2 * L * ((n * n + 2 * n) * (n * d + 1) + 3) and (n * n + 2 * n) * (n * d + 1) + 3 == 96 * d + 27


# --- DenseFormer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k, p", [(1, 1), (4, 1), (2, 2), (4, 5)])
def test_denseformer_at_init_is_the_baseline_bit_for_bit(k, p):
    model, base = with_baseline_weights(decoder(layers=6, mechanism="denseformer", denseformer_dilation=k,
                                                denseformer_period=p), layers=6)
    assert torch.equal(logits(model), logits(base))


@pytest.mark.parametrize("k, p", list(itertools.product([1, 2, 4, 5], [1, 2, 4, 5])))
def test_denseformer_sparsity_pattern_and_parameter_count(k, p):
    L = 12
    model = decoder(layers=L, mechanism="denseformer", denseformer_dilation=k, denseformer_period=p)
    counts = {int(n.split(".")[2]) + 1: t.numel() for n, t in model.named_parameters() if n.endswith("dwa.alpha")}
    assert counts == {i: i // k + 1 for i in range(1, L + 1) if i % p == 0}
    for i in counts:
        assert mixing.dwa_sources(i, k) == [j for j in range(i + 1) if j % k == i % k]
    if (k, p) == (1, 1):
        assert sum(counts.values()) == L * (L + 3) // 2


def test_denseformer_payload_widths_of_the_spec():
    """docs/mechanisms.md §11, checked for 48 blocks: 1 x 1 after block 24 sends 26 d; 4 x 4 sends 8 d; nothing a
    later DWA reads is dropped and nothing else is carried."""
    from mega_depth.model.base import ModelShape
    from mega_depth.model.denseformer import DenseFormer

    def width(k, p, boundary):
        mech = DenseFormer(ResidualConfig(mechanism="denseformer", denseformer_dilation=k, denseformer_period=p),
                           ModelShape(48, 1, 1, 1, 1e-6))
        return sum(e.width for e in mech.layout(boundary))

    assert width(1, 1, 24) == 26 and width(4, 4, 24) == 8
    for k, p, i in itertools.product([1, 2, 4, 5], [1, 2, 4, 5], range(0, 48)):
        later_reads = {j for unit in mixing.dwa_units(48, p) if unit > i for j in mixing.dwa_sources(unit, k)
                       if j <= i}
        assert set(mixing.dwa_needed_after(i, 48, k, p)) == later_reads


def test_dwa_at_identity_is_exact_even_for_extreme_values():
    outputs = torch.tensor([[1e30, -3.0], [5e-30, 7.25], [-2.5, 1e-38]])
    assert torch.equal(mixing.dwa(outputs, torch.tensor([0.0, 0.0, 1.0])), outputs[-1])


# --- AttnRes ablations (§4) -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [dict(attnres_query="input"), dict(attnres_heads=4),
                                     dict(attnres_key_norm=False), dict(attnres_mixing="scalar")])
@pytest.mark.parametrize("blocks", [None, 3])
def test_attnres_variants_at_init_equal_attnres(variant, blocks):
    ref, _ = with_baseline_weights(decoder(mechanism="attnres", attnres_num_blocks=blocks))
    model, _ = with_baseline_weights(decoder(mechanism="attnres", attnres_num_blocks=blocks, **variant))
    torch.testing.assert_close(logits(model), logits(ref), rtol=1e-5, atol=1e-5)


def test_sigmoid_attnres_at_init_is_the_baseline_up_to_the_norm_epsilon():
    model, base = with_baseline_weights(decoder(eps=0.0, mechanism="attnres", attnres_weight="sigmoid"), eps=0.0)
    torch.testing.assert_close(logits(model), logits(base), rtol=1e-4, atol=1e-4)


def test_attnres_input_query_parameter_count():
    d, L = 32, 4
    static = decoder(mechanism="attnres")
    model = decoder(mechanism="attnres", attnres_query="input")
    owned = lambda m: sum(p.numel() for k, p in m.named_parameters() if m.model.mechanism.owns(k))  # noqa: E731
    assert owned(model) - owned(static) == (2 * L + 1) * (d * d - d)
    assert owned(decoder(mechanism="attnres", attnres_key_norm=False)) == owned(static) - (2 * L + 1) * d


def test_hc_and_mhc_heads_are_the_learned_collapse():
    for residual in (dict(mechanism="hc", hc_collapse="learned"), dict(mechanism="mhc", mhc_collapse="learned")):
        model = decoder(**residual)
        names = [k for k, _ in model.named_parameters() if k.startswith("model.final_")]
        assert sorted(n.rsplit(".", 1)[1] for n in names) == ["alpha", "bias", "phi"]
    assert math.isfinite(logits(decoder(mechanism="mhc", mhc_collapse="learned")).sum().item())
