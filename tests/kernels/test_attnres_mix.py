"""mega_depth/kernels/attnres_mix.py: AttnRes's mix over K sources against mixing.attnres_mix."""

import pytest
import torch
from kernel_checks import (EPS, SCALES, SourceGradAdds, bf16_matches_fp32, check, close, detached, gradcheck, leaf,
                           opcheck, saved_storages, sources_of)

from mega_depth.kernels import attnres_mix
from mega_depth.kernels.attnres_mix import (attnres_mix_backward_deferred_op, attnres_mix_backward_into_op,
                                            attnres_mix_backward_op, attnres_mix_op, attnres_mix_sources,
                                            attnres_source_grad_op)
from mega_depth.model import base as model_base
from mega_depth.model import mixing


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
def test_values_and_gradients(path, k, lead, d, heads, weight, norm, per_token):
    sources = sources_of(k, *lead, d)
    query = leaf(*lead, d) if per_token else leaf(d)
    gain = leaf(d, scale=0.3, shift=1.0) if norm else None
    check(lambda q, g, *s: attnres_mix_sources(list(s), q, g, EPS, weight, heads),
          lambda q, g, *s: mixing.attnres_mix(torch.stack(s), q, g, EPS, weight, heads),
          [query, gain, *sources], f"attnres_mix k={k} heads={heads} {weight} norm={norm} per_token={per_token}")


def test_a_stacked_tensor_and_views(path):
    stacked = leaf(3, 4, 12)
    query, gain = leaf(12), leaf(12, scale=0.3, shift=1.0)
    close(attnres_mix_sources(stacked, query, gain, EPS), mixing.attnres_mix(stacked, query, gain, EPS), "stacked")
    sources = [stacked[i, :, 1:9] for i in range(3)]  # non-contiguous views
    close(attnres_mix_sources(sources, query[:8], gain[:8], EPS),
          mixing.attnres_mix(torch.stack(sources), query[:8], gain[:8], EPS), "views")


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("weight, heads, per_token", [("softmax", 1, False), ("softmax", 2, True),
                                                       ("sigmoid", 2, False)])
def test_gradcheck(twin, scale, weight, heads, per_token):
    sources = sources_of(3, 2, 8, dtype=torch.float64)
    sources = [(s * scale).detach().requires_grad_() for s in sources]
    query = leaf(2, 8, scale=scale, dtype=torch.float64) if per_token else leaf(8, scale=scale, dtype=torch.float64)
    gain = leaf(8, scale=0.3, shift=1.0, dtype=torch.float64)
    gradcheck(lambda q, g, *s: attnres_mix_sources(list(s), q, g, EPS, weight, heads), [query, gain, *sources],
              f"attnres_mix scale={scale} {weight}")


def test_opcheck(twin):
    sources = sources_of(3, 2, 3, 8)
    for query, gain in ((leaf(8), leaf(8)), (leaf(2, 3, 8), None)):
        opcheck(attnres_mix_op, (sources, query, gain, EPS, False, 2))
        grad = torch.randn(2, 3, 8)
        bare = (detached(sources), query.detach(), None if gain is None else gain.detach())
        for sigmoid, heads in ((True, 1), (False, 2)):
            saved = attnres_mix_op(*bare, EPS, sigmoid, heads)  # the forward's output and lse
            opcheck(attnres_mix_backward_op, (grad, *bare, *saved, EPS, sigmoid, heads))
        for adding in ([False] * 3, [True, False, True]):
            opcheck(attnres_mix_backward_into_op, (grad, bare[0], [torch.randn(2, 3, 8) for _ in sources], adding,
                                                   *bare[1:], *saved, EPS, False, 2), eager_only=True)


def test_saves_no_stacked_copy(path):
    k, lead, d = 4, (3, 5), 16
    n = 15
    sources = sources_of(k, *lead, d)
    query, gain = leaf(d), leaf(d, scale=0.3, shift=1.0)
    saved, out = saved_storages(lambda: attnres_mix_sources(sources, query, gain, EPS, heads=2))
    assert k * n * d not in saved.values(), saved
    assert max(saved.values()) <= n * d
    assert {s.untyped_storage().data_ptr() for s in sources} <= set(saved)  # the sources by reference
    out.sum().backward()
    assert all(s.grad is not None and s.grad.shape == s.shape for s in sources)
    # The eager reference does save a stacked copy: the check above would see one.
    ref, _ = saved_storages(lambda: mixing.attnres_mix(torch.stack(sources), query, gain, EPS, heads=2))
    assert k * n * d in ref.values()


def test_bf16(path):
    src = [torch.randn(6, 24) * (1 + i) for i in range(3)]
    bf16_matches_fp32(lambda q, g, *s: attnres_mix_sources(s, q, g, EPS, heads=2),
                      lambda q, g, *s: mixing.attnres_mix(torch.stack(s), q, g, EPS, heads=2),
                      torch.randn(24), torch.rand(24) + 0.5, *src)


def _readers(mix):
    """Full AttnRes in small: sublayer l mixes sources 0..l (each a new mix of the ones before), the final mix reads
    them all; source 1 is also used outside the mixing (its gradient from there is added to the sink's)."""
    def run(q0, q1, q2, g, *s):
        h1 = mix(list(s[:2]), q0, g)
        h2 = mix(list(s[:3]), q1, g)
        out = mix(list(s) + [h1 * h2], q2, g)
        return out, h1, s[1] * 3.0
    return run


@pytest.mark.parametrize("views", [False, True])
def test_readers_of_one_source_add_into_one_buffer(path, views):
    """Sources read by several mixes: the gradients equal autograd's sum, and autograd adds none of them: the
    backward kernels add into one buffer per source (kernels/grad_sink.py). Sources that are views (a model's
    usually are: their `_base` is another tensor) share their alias too."""
    lead, d = (2, 3), 12
    sources = sources_of(4, *lead, d)
    if views:
        sources = [s.view(s.shape) for s in sources]
    queries, gain = [leaf(d) for _ in range(3)], leaf(d, scale=0.3, shift=1.0)
    check(_readers(lambda s, q, g: attnres_mix_sources(s, q, g, EPS, heads=2)),
          _readers(lambda s, q, g: mixing.attnres_mix(torch.stack(s), q, g, EPS, heads=2)),
          [*queries, gain, *sources], "readers of shared sources")
    out = _readers(lambda s, q, g: attnres_mix_sources(s, q, g, EPS, heads=2))(*queries, gain, *sources)[0]
    loss = (out * torch.randn_like(out)).sum()
    with SourceGradAdds(sources[0].shape) as adds:
        torch.autograd.grad(loss, sources)
    # the Triton kernels add in place; the torch twin (the CPU kernel) adds with aten inside the op
    assert adds.count == 0 or path == "torch", f"{adds.count} adds of a source's gradient"
    with SourceGradAdds(sources[0].shape) as adds:  # the eager reference: one add per extra reader
        ref = _readers(lambda s, q, g: mixing.attnres_mix(torch.stack(s), q, g, EPS, heads=2))
        torch.autograd.grad(ref(*queries, gain, *sources)[0].sum(), sources)
    assert adds.count > 0  # the counter sees autograd's adds


@pytest.mark.parametrize("defer_readers", [model_base.DEFER_READERS, 1])
def test_a_second_backward_and_a_partial_one_give_the_same_gradients(path, defer_readers, monkeypatch):
    """A buffer (or deferred readers' records, grad_sink.Sink.defer) left by a backward pass that did not reach the
    source (autograd.grad of a query alone) is never added to by the next pass; retain_graph's second pass equals
    the first."""
    monkeypatch.setattr(model_base, "DEFER_READERS", defer_readers)
    lead, d = (5,), 12
    sources = sources_of(3, *lead, d)
    queries, gain = [leaf(d) for _ in range(3)], leaf(d, scale=0.3, shift=1.0)
    out, h1, extra = _readers(lambda s, q, g: attnres_mix_sources(s, q, g, EPS))(*queries, gain, *sources)
    loss = out.square().sum() + extra.sum()
    torch.autograd.grad(loss, [queries[2]], retain_graph=True)  # the final mix's backward alone
    first = torch.autograd.grad(loss, sources, retain_graph=True)
    second = torch.autograd.grad(loss, sources)
    ref_out, _, ref_extra = _readers(lambda s, q, g: mixing.attnres_mix(torch.stack(s), q, g, EPS))(
        *queries, gain, *sources)
    expected = torch.autograd.grad(ref_out.square().sum() + ref_extra.sum(), sources)
    for a, b, e in zip(first, second, expected):
        close(a, e, "first pass")
        assert torch.equal(a, b), "second pass"


def test_an_aliased_source_is_freed_with_its_graph(path):
    """The alias that sums a source's gradients holds the source (its view base); the source must not hold the
    alias back (an attribute would: a cycle through C++ that no garbage collection frees, every step's activations
    kept). After backward and the last reference, each source's storage has no other owner."""
    x = leaf(6, 12)
    sources = [x * (i + 1) for i in range(3)]
    storages = [s.untyped_storage() for s in sources]
    query = leaf(12)
    out = attnres_mix_sources(sources, query, None, EPS) + attnres_mix_sources(sources[:2], query, None, EPS)
    out.sum().backward()
    del out, sources
    assert [torch._C._storage_Use_Count(s._cdata) for s in storages] == [1, 1, 1]


def test_each_call_reads_a_source_through_its_one_alias_and_counts_as_its_reader():
    """grad_sink.aliased: the first reader makes a source's alias, later readers look it up and are counted (the
    count decides which sources' gradients are left to their sinks); an alias or a tensor without grad passes as
    it is, uncounted."""
    from mega_depth.kernels import grad_sink

    x, plain = leaf(6, 12), torch.randn(6, 12)
    a, b = x * 1, x * 2
    first = grad_sink.aliased([a, b, plain])
    second = grad_sink.aliased([a, b])
    assert second[0] is first[0] and second[1] is first[1] and first[0] is not a and first[2] is plain
    sinks = grad_sink.sinks_of(second)
    assert [s.readers for s in sinks] == [2, 2] and grad_sink.sinks_of([plain]) is None
    again = grad_sink.aliased(first[:2])
    assert again[0] is first[0] and again[1] is first[1] and [s.readers for s in sinks] == [2, 2]
    assert grad_sink.aliased([a, a])[0] is a  # one tensor twice: no alias (its two gradients would race)
    w = leaf(6, 12)
    alias_of_w = grad_sink.aliased([w])[0]
    w.requires_grad_(False)  # frozen after a reader aliased it: later readers read it as itself, uncounted
    assert grad_sink.aliased([w])[0] is w and grad_sink.sinks_of([alias_of_w])[0].readers == 1


def _one_mix(d, heads):
    """Three detached sources [2, 3, d], a static query and gain, one mix's forward (out, lse) and a gradient."""
    sources = detached(sources_of(3, 2, 3, d))
    query, gain = torch.randn(d), torch.randn(d) * 0.3 + 1.0
    out, lse = attnres_mix_op(sources, query, gain, EPS, False, heads)
    return sources, query, gain, out, lse, torch.randn_like(out)


def test_two_sources_with_one_gradient_buffer_both_arrive(path):
    """The backward stores or adds a block of sources' gradients as one tile; two sources of one block that share
    a buffer would each read it before the other's store, and one gradient would be lost. The second one's must
    add to the first's, as one source at a time does."""
    d = 8
    sources, query, gain, out, lse, grad = _one_mix(d, heads=1)
    apart = [torch.zeros(2, 3, d) for _ in sources]
    attnres_mix_backward_into_op(grad, sources, apart, [False] * 3, query, gain, out, lse, EPS, False, 1)
    shared, last = torch.zeros(2, 3, d), torch.zeros(2, 3, d)
    attnres_mix_backward_into_op(grad, sources, [shared, shared, last], [False, True, False], query, gain, out, lse,
                                 EPS, False, 1)
    torch.testing.assert_close(shared, apart[0] + apart[1])
    torch.testing.assert_close(last, apart[2])


def test_two_sources_with_one_gradient_buffer_take_no_pipelined_loads():
    """The launch behind the test above, on any machine: a buffer for each source, two sources a step with the next
    step's rows and held gradients loaded ahead (STAGES 2); one buffer for two sources, one source a step and each
    step's held gradient loaded after the step before's store (STAGES 1). A load ahead would read the buffer before
    the store, which only a compiled kernel does: on a CPU the interpreter runs the loop in order either way."""
    from mega_depth.kernels import common

    sources, query, gain, out, lse, grad = _one_mix(64, heads=1)
    shared = torch.zeros(2, 3, 64)
    for buffers, adding, expected in (([torch.zeros(2, 3, 64) for _ in sources], [False] * 3, (2, 2)),
                                      ([shared, shared, torch.zeros(2, 3, 64)], [False, True, False], (1, 1))):
        with common.recording(132) as launches:
            attnres_mix_backward_into_op(grad, sources, buffers, adding, query, gain, out, lse, EPS, False, 1)
        (mix,) = [launch for launch in launches if launch.kernel.__name__ == "_bwd_kernel"]
        assert (mix.constexprs["KB"], mix.constexprs["STAGES"]) == expected, mix.constexprs


def _chain(mix, per_token_at=()):
    """Full AttnRes deeper: 5 mixes, mix i reading sources 0 .. i + 1 and the outputs of the mixes before it, so
    that the first sources have 5 readers and the last ones 1 or 2. The mixes in per_token_at read a per-token query
    (made from the first source): they add their sources' gradients into the sinks' buffers, never defer."""
    def run(q0, q1, q2, q3, q4, g, *s):
        sources, outs = list(s[:2]), []
        for i, q in enumerate((q0, q1, q2, q3, q4)):
            query = s[0] * q if i in per_token_at else q
            outs.append(mix(sources + outs, query, g))
            sources.append(s[2 + i] if i + 2 < len(s) else outs[-1] * 0.5)
        return outs[-1], outs[1]
    return run


@pytest.mark.parametrize("weight, heads, norm, per_token_at", [
    ("softmax", 1, True, ()), ("softmax", 2, True, (2,)), ("sigmoid", 2, True, ()), ("softmax", 2, False, (1,)),
])
def test_a_source_that_many_mixes_read_sums_their_gradients_at_once(path, weight, heads, norm, per_token_at,
                                                                   monkeypatch):
    """A source read by DEFER_READERS or more mixes (4 here: off by default, model/base.py): each static-query mix
    leaves its part of the source's gradient to the sink (coefficients a token), and the sink sums all of them in
    one call (attnres_source_grad), adding what per-token mixes put in its buffer. The gradients equal the eager
    reference's; every such source is summed once, with one record per static reader; a source with fewer readers is
    added into its buffer as before."""
    monkeypatch.setattr(model_base, "DEFER_READERS", 4)
    d = 12
    sources = sources_of(5, 2, 3, d)
    queries, gain = [leaf(d) for _ in range(5)], (leaf(d, scale=0.3, shift=1.0) if norm else None)
    fast = _chain(lambda s, q, g: attnres_mix_sources(s, q, g, EPS, weight, heads), per_token_at)
    ref = _chain(lambda s, q, g: mixing.attnres_mix(torch.stack(s), q, g, EPS, weight, heads), per_token_at)
    check(fast, ref, [*queries, gain, *sources], f"deferred {weight} heads={heads} norm={norm}")
    resolved, resolve = [], attnres_mix._resolve

    def spy(source, records, held, *settings):
        resolved.append((len(records), held is not None))
        return resolve(source, records, held, *settings)

    attnres_mix._resolve = spy
    try:
        out, _ = fast(*queries, gain, *sources)
        torch.autograd.grad((out * torch.randn_like(out)).sum(), sources + queries)
    finally:
        attnres_mix._resolve = resolve
    # sources 0 and 1 are read by all 5 mixes, source 2 and the first mix's output by the last 4, the rest by 3 or
    # fewer: (records, whether a per-token reader's buffer was added) for each summed source
    expected = [(len(readers - set(per_token_at)), bool(readers & set(per_token_at)))
                for readers in [{0, 1, 2, 3, 4}] * 2 + [{1, 2, 3, 4}] * 2]
    assert sorted(resolved) == sorted(expected), resolved


def test_deferred_gradients_pass_gradcheck(twin, monkeypatch):
    """fp64 gradcheck through the deferred path: every source deferred (one reader is enough here)."""
    monkeypatch.setattr(model_base, "DEFER_READERS", 1)
    sources = [s.double().detach().requires_grad_() for s in sources_of(3, 2, 8)]
    queries = [leaf(8, dtype=torch.float64) for _ in range(2)]
    gain = leaf(8, scale=0.3, shift=1.0, dtype=torch.float64)

    def run(q0, q1, g, *s):
        h = attnres_mix_sources(list(s), q0, g, EPS, heads=2)
        return attnres_mix_sources(list(s) + [h], q1, g, EPS, heads=2)
    gradcheck(run, [*queries, gain, *sources], "deferred attnres_mix")


def test_opcheck_of_the_deferred_ops(twin):
    sources = detached(sources_of(3, 2, 3, 8))
    query, gain = torch.randn(8), torch.randn(8) * 0.3 + 1.0
    for sigmoid, heads, g in ((False, 2, gain), (True, 1, None)):
        out, lse = attnres_mix_op(sources, query, g, EPS, sigmoid, heads)
        grad = torch.randn_like(out)
        into = [torch.randn(2, 3, 8), torch.empty(0), torch.randn(2, 3, 8)]
        args = (grad, sources, into, [False, False, True], [False, True, False], query, g, out, lse, EPS, sigmoid,
                heads)
        opcheck(attnres_mix_backward_deferred_op, args, eager_only=True)
        coef, folded = attnres_mix_backward_deferred_op(*args)[:2]
        for held in (None, torch.randn(2, 3, 8)):
            opcheck(attnres_source_grad_op, (sources[1], [grad, grad * 2], [folded, folded], [coef[1], coef[1]],
                                             heads, g is not None, held))


def test_the_deferred_source_gradient_is_the_one_a_mix_stores(path):
    """One mix, its middle source deferred: the coefficients it leaves, summed by attnres_source_grad, give the
    gradient that attnres_mix_backward_into stores for it; the other sources' gradients are stored as before."""
    d = 8
    sources, query, gain, out, lse, grad = _one_mix(d, heads=2)
    stored = [torch.zeros(2, 3, d) for _ in sources]
    dq, dg = attnres_mix_backward_into_op(grad, sources, stored, [False] * 3, query, gain, out, lse, EPS, False, 2)
    into = [torch.zeros(2, 3, d), torch.empty(0), torch.zeros(2, 3, d)]
    coef, folded, dq_, dg_ = attnres_mix_backward_deferred_op(grad, sources, into, [False] * 3, [False, True, False],
                                                              query, gain, out, lse, EPS, False, 2)
    close(into[0], stored[0], "stored source 0")
    close(into[2], stored[2], "stored source 2")
    close(attnres_source_grad_op(sources[1], [grad], [folded], [coef[1]], 2, True, None), stored[1], "deferred")
    close(dq_, dq, "query")
    close(dg_, dg, "gain")


def test_two_graphs_over_the_same_sources_each_get_their_gradients(path, monkeypatch):
    """Two forward passes over the same leaf sources share each source's alias (and its sink), so its readers count
    both graphs'. The first graph's backward, without retain_graph, must leave what the second one's sums need: each
    equals the eager reference's gradients."""
    monkeypatch.setattr(model_base, "DEFER_READERS", 2)
    d = 12
    sources = sources_of(5, 2, 3, d)
    queries, gain = [leaf(d) for _ in range(5)], leaf(d, scale=0.3, shift=1.0)
    fast = _chain(lambda s, q, g: attnres_mix_sources(s, q, g, EPS, heads=2))
    ref = _chain(lambda s, q, g: mixing.attnres_mix(torch.stack(s), q, g, EPS, heads=2))
    first, second = fast(*queries, gain, *sources)[0], fast(*queries, gain, *sources)[0]
    expected = torch.autograd.grad(ref(*queries, gain, *sources)[0].square().sum(), sources)
    for out in (first, second):
        for got, want in zip(torch.autograd.grad(out.square().sum(), sources), expected):
            close(got, want, "a graph sharing its sources' sinks")
