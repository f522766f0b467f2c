"""mega_depth/kernels/depth_attention.py: Depth-Attention's value mix against mixing.depth_attention_mix."""

import pytest
import torch
from kernel_checks import (EPS, SCALES, SourceGradAdds, bf16_matches_fp32, check, detached, gradcheck, leaf, opcheck,
                           rms_normed, saves_only_inputs)

from mega_depth.kernels.depth_attention import (depth_attention_backward_into_op, depth_attention_backward_op,
                                                depth_attention_mix, depth_attention_mix_normed,
                                                depth_attention_mix_qk_normed, depth_attention_op,
                                                depth_attention_qk_backward_into_op, depth_attention_qk_backward_op,
                                                depth_attention_qk_op)
from mega_depth.model import mixing


@pytest.mark.parametrize("mode, hv", [("query", 4), ("query", 2), ("group", 2)])
@pytest.mark.parametrize("c", [0, 1, 2])
def test_values_and_gradients(path, mode, hv, c):
    """GQA 4 query heads / 2 key-value heads; candidate values with hq heads ("query" mode stores mixed values
    per query head) or hkv heads; C = 0 returns the value expanded like the reference."""
    lead, hq, hkv, hn = (3, 2), 4, 2, 6
    query, key, value = leaf(*lead, hq, hn), leaf(*lead, hkv, hn), leaf(*lead, hkv, hn)
    cand_keys = leaf(c, *lead, hkv, hn) if c else None
    cand_values = leaf(c, *lead, hv, hn, scale=2.0) if c else None
    check(lambda *a: depth_attention_mix(*a, gqa_mode=mode), lambda *a: mixing.depth_attention_mix(*a, gqa_mode=mode),
          [query, key, value, cand_keys, cand_values], f"depth attention {mode} hv={hv} C={c}")


@pytest.mark.parametrize("layout", ["a group a program", "two groups a program, the last masked",
                                    "the token's groups a program"])
@pytest.mark.parametrize("mode", ["query", "group"])
def test_every_program_layout(path, monkeypatch, layout, mode):
    """The grid is (tokens, group blocks): 3 key-value groups of 2 heads each, one to a program (the 1B size's
    layout), two to a program (the second block's second group masked: small heads), and 4 heads a group, every
    group in one program (7B's layout)."""
    from mega_depth.kernels import depth_attention

    hkv, r, c, hn = 3, 4 if layout.startswith("the token") else 2, 2, 6
    if layout.startswith("two"):
        monkeypatch.setattr(depth_attention, "_groups_per_program", lambda hkv_, r_, hn_: 2)
    lead = (5,)
    query, key, value = leaf(*lead, hkv * r, hn), leaf(*lead, hkv, hn), leaf(*lead, hkv, hn)
    hv = hkv * r if mode == "query" else hkv
    cand_keys, cand_values = leaf(c, *lead, hkv, hn), leaf(c, *lead, hv, hn, scale=2.0)
    check(lambda *a: depth_attention_mix(*a, gqa_mode=mode), lambda *a: mixing.depth_attention_mix(*a, gqa_mode=mode),
          [query, key, value, cand_keys, cand_values], f"depth attention {layout} {mode}")


@pytest.mark.parametrize("c", [1, 2])
def test_many_heads_a_group_with_the_candidates_read_as_tiles(path, monkeypatch, c):
    """4 heads a group, 8 groups of 128 channels (a 7B layer on one rank): every group in one program, and the
    candidates read as one tile each, where a key row spreads over enough threads (_bwd_tiles_kernel; the small
    shapes above take the entry-by-entry kernel there). The launcher once chose its resident warps from a flag set
    only for a few heads a group, and failed here."""
    from mega_depth.kernels import common, depth_attention

    chosen = []

    def launch(kernel, *args, **kwargs):  # the kernels the op launches, named
        chosen.append(kernel.__name__)
        common.launch(kernel, *args, **kwargs)

    monkeypatch.setattr(depth_attention, "launch", launch)
    hkv, r, hn, lead = 8, 4, 128, (2,)
    query, key, value = leaf(*lead, hkv * r, hn), leaf(*lead, hkv, hn), leaf(*lead, hkv, hn)
    cand_keys, cand_values = leaf(c, *lead, hkv, hn), leaf(c, *lead, hkv * r, hn, scale=2.0)
    check(depth_attention_mix, mixing.depth_attention_mix, [query, key, value, cand_keys, cand_values],
          f"depth attention, {r} heads a group, C={c}")
    if path == "triton":
        assert {"_fwd_tiles_kernel", "_bwd_tiles_kernel"} <= set(chosen), chosen


def query_of(f, r=2, hn=6):
    return f[..., :r * hn].reshape(*f.shape[:-2], f.shape[-2] * r, hn)


def kv_of(f, r=2, hn=6):
    return f[..., r * hn:(r + 1) * hn], f[..., (r + 1) * hn:]


def test_reads_strided_keys_and_values(path):
    """A key and value split off a fused projection are strided views: read in place, gradients land in the
    fused tensor; candidates given as a list."""
    lead, hkv, r, hn = (3, 2), 2, 2, 6
    fused_kv = leaf(*lead, hkv, (r + 2) * hn)
    key, value = kv_of(fused_kv)
    cands_k, cands_v = [leaf(*lead, hkv, hn) for _ in range(2)], [leaf(*lead, hkv * r, hn) for _ in range(2)]
    check(lambda f, *c: depth_attention_mix(query_of(f), *kv_of(f), list(c[:2]), list(c[2:]), "query"),
          lambda f, *c: mixing.depth_attention_mix(query_of(f), *kv_of(f), torch.stack(c[:2]), torch.stack(c[2:]),
                                                   "query"),
          [fused_kv, *cands_k, *cands_v], "depth attention strided")
    assert key.stride(-2) != hn and value.stride(-2) != hn  # really strided


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("mode, hv", [("query", 4), ("group", 2)])
def test_gradcheck(twin, scale, mode, hv):
    f64 = torch.float64
    inputs = [leaf(3, 4, 4, scale=scale, dtype=f64), leaf(3, 2, 4, scale=scale, dtype=f64),
              leaf(3, 2, 4, scale=scale, dtype=f64), leaf(2, 3, 2, 4, scale=scale, dtype=f64),
              leaf(2, 3, hv, 4, scale=scale, dtype=f64)]
    gradcheck(lambda *a: depth_attention_mix(*a, gqa_mode=mode), inputs, f"depth attention {mode} scale={scale}")


def test_opcheck(twin):
    q, k, v = leaf(3, 4, 6), leaf(3, 2, 6), leaf(3, 2, 6)
    ck, cv = [leaf(3, 2, 6) for _ in range(2)], [leaf(3, 4, 6) for _ in range(2)]
    for group in (False, True):
        values = cv if not group else [leaf(3, 2, 6) for _ in range(2)]
        for weight in (None, leaf(6, shift=1.0)):  # without and with the candidates' key norm
            opcheck(depth_attention_op, (q, k, v, ck, values, weight, EPS, group))
            grad = torch.randn(3, 2 if group else 4, 6)
            opcheck(depth_attention_backward_op, (grad, *detached([q, k, v]), detached(ck), detached(values),
                                                  None if weight is None else weight.detach(), EPS, group))
            into = [torch.randn(t.shape) for t in ck + values]
            opcheck(depth_attention_backward_into_op, (grad, *detached([q, k, v]), detached(ck), detached(values),
                                                       into, [False, True, True, False],
                                                       None if weight is None else weight.detach(), EPS, group),
                    eager_only=True)


def test_saves_only_its_inputs(path):
    n = 6
    cands = [leaf(n, 2, 3) for _ in range(6)]
    saves_only_inputs(lambda q, key, v, *c: depth_attention_mix(q, key, v, list(c[:3]), list(c[3:]), "query"),
                      [leaf(n, 4, 3), leaf(n, 2, 3), leaf(n, 2, 3), *cands])


def test_bf16(path):
    bf16_matches_fp32(lambda *a: depth_attention_mix(*a, "query"), lambda *a: mixing.depth_attention_mix(*a, "query"),
                      torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(2, 6, 2, 8),
                      torch.randn(2, 6, 4, 8))


@pytest.mark.parametrize("mode, hv", [("query", 4), ("group", 2)])
def test_candidates_read_by_several_layers_add_into_one_buffer(path, mode, hv):
    """Depth-Attention's stored candidates are read by every later layer's mix (and a value by its own layer's
    attention too: here a product outside the mixing): the gradients equal autograd's sums, and the mixes'
    gradients are added in the backward kernel, into one buffer per candidate (kernels/grad_sink.py)."""
    lead, hq, hkv, hn = (3, 2), 4, 2, 6
    keys, values = [leaf(*lead, hkv, hn) for _ in range(2)], [leaf(*lead, hv, hn, scale=2.0) for _ in range(2)]
    queries = [leaf(*lead, hq, hn) for _ in range(2)]
    own = [leaf(*lead, hkv, hn) for _ in range(4)]  # each layer's own key and value

    def layers(mix):
        def run(*t):
            k0, k1, v0, v1, q1, q2, ok1, ov1, ok2, ov2 = t
            out1 = mix(q1, ok1, ov1, [k0], [v0], mode)  # layer 1 reads candidate 0
            out2 = mix(q2, ok2, ov2, [k0, k1], [v0, v1], mode)  # layer 2 candidates 0 and 1
            return out1 * out2 + (v0 * 3.0).sum()

        return run

    def reference(q, k, v, ck, cv, gqa_mode):
        return mixing.depth_attention_mix(q, k, v, torch.stack(ck), torch.stack(cv), gqa_mode)

    inputs = [*keys, *values, *queries, *own]
    check(layers(depth_attention_mix), layers(reference), inputs, f"candidates read twice {mode}")
    out = layers(depth_attention_mix)(*inputs)
    with SourceGradAdds(values[0].shape) as adds:
        torch.autograd.grad((out * torch.randn_like(out)).sum(), values)
    # one add: v0's gradient from outside the mixing joins the buffer (the torch twin adds with aten in the op)
    assert adds.count == 1 or path == "torch", f"{adds.count} adds of a candidate's gradient"
    with SourceGradAdds(values[0].shape) as adds:  # the reference: autograd adds every reader's gradient
        out = layers(reference)(*inputs)
        torch.autograd.grad(out.sum(), values)
    assert adds.count >= 2


@pytest.mark.parametrize("mode, hv", [("query", 4), ("group", 2)])
def test_entry_by_entry_where_the_candidates_are_not_read_as_one_tile(path, monkeypatch, mode, hv):
    """The kernels that walk [candidates..., self] one entry at a time (more candidates than a tile holds), forced
    here: the sizes above read every candidate as one tile."""
    from mega_depth.kernels import depth_attention

    monkeypatch.setattr(depth_attention, "TILED_CANDIDATES", 0)
    test_values_and_gradients(path, mode, hv, 2)


def test_two_candidates_with_one_gradient_buffer_both_arrive(path):
    """The backward stores or adds the candidates' gradients as one tile; two candidates sharing a buffer would each
    read it before the other's store, and one gradient would be lost. The second one's must add to the first's."""
    lead, hq, hkv, hn = (2, 3), 4, 2, 6
    q, k, v = torch.randn(*lead, hq, hn), torch.randn(*lead, hkv, hn), torch.randn(*lead, hkv, hn)
    ck = [torch.randn(*lead, hkv, hn) for _ in range(2)]
    cv = [torch.randn(*lead, hq, hn) for _ in range(2)]
    grad = torch.randn(*lead, hq, hn)
    apart = [torch.zeros(*lead, hkv, hn) for _ in ck] + [torch.zeros(*lead, hq, hn) for _ in cv]
    depth_attention_backward_into_op(grad, q, k, v, ck, cv, apart, [False] * 4, None, EPS, False)
    shared_k, shared_v = torch.zeros(*lead, hkv, hn), torch.zeros(*lead, hq, hn)
    depth_attention_backward_into_op(grad, q, k, v, ck, cv, [shared_k, shared_k, shared_v, shared_v],
                                     [False, True, False, True], None, EPS, False)
    torch.testing.assert_close(shared_k, apart[0] + apart[1])
    torch.testing.assert_close(shared_v, apart[2] + apart[3])


# --- the candidates' keys normalised in the kernel (depth_attention_mix_normed) ---------------------------------


def normed_reference(weight, eps, q, k, v, cand_raw_keys, cand_values, gqa_mode):
    """What the model does without the fold: each raw candidate key through this layer's (eager) key norm, then the
    reference mix."""
    keys = torch.stack([rms_normed(c, weight, eps) for c in cand_raw_keys])
    return mixing.depth_attention_mix(q, k, v, keys, torch.stack(list(cand_values)), gqa_mode)


def normed(weight, eps, q, k, v, cand_raw_keys, cand_values, gqa_mode):
    return depth_attention_mix_normed(weight, eps, q, k, v, list(cand_raw_keys), list(cand_values), gqa_mode)


@pytest.mark.parametrize("tiles", [True, False], ids=["one tile", "entry by entry"])
@pytest.mark.parametrize("mode, hv", [("query", 4), ("group", 2)])
@pytest.mark.parametrize("c", [1, 3])
def test_normalised_candidate_keys(path, monkeypatch, tiles, mode, hv, c):
    """Raw candidate keys normalised by this layer's key norm inside the kernel: the values, and the gradients of
    the query, key, value, raw keys (through the norm), values and the norm's weight, equal the reference's (the
    eager norm, then the mix). Head rows of 6 channels in a block of 8: the norm's mean is over the 6."""
    from mega_depth.kernels import depth_attention

    if not tiles:
        monkeypatch.setattr(depth_attention, "TILED_CANDIDATES", 0)
    lead, hq, hkv, hn = (5,), 4, 2, 6
    q, k, v = leaf(*lead, hq, hn), leaf(*lead, hkv, hn), leaf(*lead, hkv, hn)
    raw = [leaf(*lead, hkv, hn, scale=0.5 + i) for i in range(c)]
    cv = [leaf(*lead, hv, hn, scale=2.0) for _ in range(c)]
    weight = leaf(hn, scale=0.3, shift=1.0)
    n = len(raw)
    check(lambda w, *t: normed(w, EPS, *t[:3], t[3:3 + n], t[3 + n:], mode),
          lambda w, *t: normed_reference(w, EPS, *t[:3], t[3:3 + n], t[3 + n:], mode),
          [weight, q, k, v, *raw, *cv], f"normed keys {mode} C={c} tiles={tiles}")


def test_normalised_candidate_keys_gradcheck(twin):
    f64 = torch.float64
    weight = leaf(4, scale=0.3, shift=1.0, dtype=f64)
    inputs = [weight, leaf(3, 4, 4, dtype=f64), leaf(3, 2, 4, dtype=f64), leaf(3, 2, 4, dtype=f64),
              leaf(3, 2, 4, dtype=f64), leaf(3, 2, 4, dtype=f64), leaf(3, 4, 4, dtype=f64), leaf(3, 4, 4, dtype=f64)]
    gradcheck(lambda w, q, k, v, k0, k1, v0, v1: normed(w, EPS, q, k, v, [k0, k1], [v0, v1], "query"), inputs,
              "depth attention, normed candidate keys")


def test_raw_candidate_keys_read_by_several_layers_add_into_one_buffer(path):
    """A raw key is read by every later layer's mix, each normalising it with its own key norm: the raw key's
    gradients (through the norms) equal autograd's sums, and the mixes add them in the backward kernel, into one
    buffer (the normalised keys are never tensors of their own)."""
    lead, hq, hkv, hn = (3, 2), 4, 2, 6
    keys, values = [leaf(*lead, hkv, hn) for _ in range(2)], [leaf(*lead, hq, hn, scale=2.0) for _ in range(2)]
    queries, weights = [leaf(*lead, hq, hn) for _ in range(2)], [leaf(hn, scale=0.3, shift=1.0) for _ in range(2)]
    own = [leaf(*lead, hkv, hn) for _ in range(4)]

    def layers(mix):
        def run(*t):
            k0, k1, v0, v1, q1, q2, w1, w2, ok1, ov1, ok2, ov2 = t
            out1 = mix(w1, EPS, q1, ok1, ov1, [k0], [v0], "query")
            out2 = mix(w2, EPS, q2, ok2, ov2, [k0, k1], [v0, v1], "query")
            return out1 * out2 + (k0 * 3.0).sum()  # k0 also feeds its own layer (here: a product)

        return run

    inputs = [*keys, *values, *queries, *weights, *own]
    check(layers(normed), layers(normed_reference), inputs, "raw keys read twice")
    out = layers(normed)(*inputs)
    with SourceGradAdds(keys[0].shape) as adds:
        torch.autograd.grad((out * torch.randn_like(out)).sum(), keys)
    assert adds.count == 1 or path == "torch", f"{adds.count} adds of a raw key's gradient"


def test_normalised_candidate_keys_bf16(path):
    weight = torch.randn(8) * 0.3 + 1.0
    bf16_matches_fp32(lambda w, *a: normed(w, EPS, *a[:3], [a[3], a[4]], [a[5], a[6]], "query"),
                      lambda w, *a: normed_reference(w, EPS, *a[:3], [a[3], a[4]], [a[5], a[6]], "query"),
                      weight, torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8),
                      torch.randn(6, 2, 8) * 3, torch.randn(6, 2, 8), torch.randn(6, 4, 8), torch.randn(6, 4, 8))


def test_a_key_norm_weight_of_the_wrong_width_is_refused():
    q, k, v = torch.randn(3, 4, 6), torch.randn(3, 2, 6), torch.randn(3, 2, 6)
    with pytest.raises(ValueError, match="key norm weight of shape"):
        depth_attention_mix_normed(torch.ones(8), EPS, q, k, v, [torch.randn(3, 2, 6)], [torch.randn(3, 4, 6)])


# --- this layer's query and key norms in the mix too (depth_attention_mix_qk_normed) ------------------------------


def qk_reference(wq, q_eps, wk, k_eps, raw_q, raw_k, v, cand_raw_keys, cand_values, gqa_mode):
    """What the model does without the fold: the layer's (eager) query and key norms, the candidates' keys through
    the key norm, then the reference mix; the attention reads the normalised query and key."""
    q, k = rms_normed(raw_q, wq, q_eps), rms_normed(raw_k, wk, k_eps)
    return q, k, normed_reference(wk, k_eps, q, k, v, cand_raw_keys, cand_values, gqa_mode)


def qk_normed(wq, q_eps, wk, k_eps, raw_q, raw_k, v, cand_raw_keys, cand_values, gqa_mode):
    return depth_attention_mix_qk_normed(wq, q_eps, wk, k_eps, raw_q, raw_k, v, list(cand_raw_keys),
                                         list(cand_values), gqa_mode)


@pytest.mark.parametrize("tiles", [True, False], ids=["one tile", "entry by entry"])
@pytest.mark.parametrize("mode, hv", [("query", 4), ("group", 2)])
@pytest.mark.parametrize("c", [1, 3])
def test_the_layers_query_and_key_normalised_in_the_mix(path, monkeypatch, tiles, mode, hv, c):
    """The raw query and key normalised by this layer's norms in the kernel, and written out for the attention: the
    three outputs, and the gradients of the raw query, key, value, raw candidate keys, values and both norms'
    weights (from the outputs' gradients together: the attention's of the query and key join the mix's in the
    kernel) equal the reference's. Head rows of 6 channels in a block of 8; the query norm's epsilon differs from
    the key norm's."""
    from mega_depth.kernels import depth_attention

    if not tiles:
        monkeypatch.setattr(depth_attention, "TILED_CANDIDATES", 0)
    lead, hq, hkv, hn = (5,), 4, 2, 6
    q, k, v = leaf(*lead, hq, hn, scale=2.0), leaf(*lead, hkv, hn, scale=0.7), leaf(*lead, hkv, hn)
    raw = [leaf(*lead, hkv, hn, scale=0.5 + i) for i in range(c)]
    cv = [leaf(*lead, hv, hn, scale=2.0) for _ in range(c)]
    wq, wk = leaf(hn, scale=0.3, shift=1.0), leaf(hn, scale=0.3, shift=1.0)
    n = len(raw)
    check(lambda wq_, wk_, *t: qk_normed(wq_, 1e-5, wk_, EPS, *t[:3], t[3:3 + n], t[3 + n:], mode),
          lambda wq_, wk_, *t: qk_reference(wq_, 1e-5, wk_, EPS, *t[:3], t[3:3 + n], t[3 + n:], mode),
          [wq, wk, q, k, v, *raw, *cv], f"normed query and key {mode} C={c} tiles={tiles}")


@pytest.mark.parametrize("layout", ["a group a program", "the token's groups a program"])
def test_the_layers_query_and_key_normalised_in_every_program_layout(path, layout):
    """3 key-value groups of 2 heads (one to a program, 1B's layout) or of 4 (every group in one program, 7B's), a
    strided key and value split off a fused projection."""
    hkv, r, hn = 3, 4 if layout.startswith("the token") else 2, 6
    fused = leaf(4, hkv, (r + 2) * hn)
    raw, cv = [leaf(4, hkv, hn) for _ in range(2)], [leaf(4, hkv * r, hn, scale=2.0) for _ in range(2)]
    wq, wk = leaf(hn, scale=0.3, shift=1.0), leaf(hn, scale=0.3, shift=1.0)

    def run(mix):
        return lambda f, wq_, wk_, *t: mix(wq_, EPS, wk_, EPS, query_of(f, r), *kv_of(f, r), t[:2], t[2:], "query")

    check(run(qk_normed), run(qk_reference), [fused, wq, wk, *raw, *cv], f"normed query and key, {layout}")


def test_the_layers_query_and_key_normalised_gradcheck(twin):
    f64 = torch.float64
    inputs = [leaf(4, scale=0.3, shift=1.0, dtype=f64), leaf(4, scale=0.3, shift=1.0, dtype=f64),
              leaf(3, 4, 4, dtype=f64), leaf(3, 2, 4, dtype=f64), leaf(3, 2, 4, dtype=f64), leaf(3, 2, 4, dtype=f64),
              leaf(3, 4, 4, dtype=f64)]
    gradcheck(lambda wq, wk, q, k, v, k0, v0: qk_normed(wq, EPS, wk, EPS, q, k, v, [k0], [v0], "query"), inputs,
              "depth attention, normed query and key")


def test_the_layers_query_and_key_normalised_bf16(path):
    wq, wk = torch.randn(8) * 0.3 + 1.0, torch.randn(8) * 0.3 + 1.0
    bf16_matches_fp32(lambda a, b, *t: qk_normed(a, EPS, b, EPS, *t[:3], [t[3]], [t[4]], "group"),
                      lambda a, b, *t: qk_reference(a, EPS, b, EPS, *t[:3], [t[3]], [t[4]], "group"),
                      wq, wk, torch.randn(6, 4, 8) * 2, torch.randn(6, 2, 8), torch.randn(6, 2, 8),
                      torch.randn(6, 2, 8) * 3, torch.randn(6, 2, 8))


def test_the_qk_op_passes_opcheck(twin):
    q, k, v = leaf(3, 4, 6), leaf(3, 2, 6), leaf(3, 2, 6)
    ck, cv = [leaf(3, 2, 6) for _ in range(2)], [leaf(3, 4, 6) for _ in range(2)]
    wq, wk = leaf(6, shift=1.0), leaf(6, shift=1.0)
    opcheck(depth_attention_qk_op, (q, k, v, ck, cv, wk, EPS, wq, 1e-5, False))
    grads = [torch.randn(3, 4, 6), torch.randn(3, 2, 6), torch.randn(3, 4, 6)]
    opcheck(depth_attention_qk_backward_op, (*grads, *detached([q, k, v]), detached(ck), detached(cv), wk.detach(),
                                             EPS, wq.detach(), 1e-5, False))
    into = [torch.randn(t.shape) for t in ck + cv]
    opcheck(depth_attention_qk_backward_into_op, (*grads, *detached([q, k, v]), detached(ck), detached(cv), into,
                                                  [False, True, True, False], wk.detach(), EPS, wq.detach(), 1e-5,
                                                  False), eager_only=True)


def test_no_candidates_for_the_qk_fold_is_refused():
    q, k, v = torch.randn(3, 4, 6), torch.randn(3, 2, 6), torch.randn(3, 2, 6)
    with pytest.raises(ValueError, match="C >= 1 candidates"):
        depth_attention_mix_qk_normed(torch.ones(6), EPS, torch.ones(6), EPS, q, k, v, [], [])
    with pytest.raises(ValueError, match="query norm weight of shape"):
        depth_attention_mix_qk_normed(torch.ones(8), EPS, torch.ones(6), EPS, q, k, v, [k], [v])
