"""mega_depth/kernels/streams.py: HC / mHC's stream read and write against mixing.streams_in / streams_out."""

import pytest
import torch
from kernel_checks import (SCALES, SourceGradAdds, bf16_matches_fp32, check, close, detached, gradcheck, leaf, opcheck,
                           rms_normed, saves_only_inputs)

from mega_depth.kernels.streams import (stream_rows, streams_in, streams_in_backward_into_op, streams_in_backward_op,
                                        streams_in_normed, streams_in_op, streams_out, streams_out_backward_op,
                                        streams_out_op)
from mega_depth.model import mixing


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("per_token", [True, False])
def test_values_and_gradients(path, n, per_token):
    """mHC's per-token coefficients, and HC's static ones broadcast over the tokens ([n, 1, 1], [n, 1, 1, n]);
    n = 3 is not a power of two (masked stream lanes)."""
    lead, d = (5, 2), 24
    streams, output = leaf(n, *lead, d), leaf(*lead, d, scale=2.0)
    coef = lead if per_token else (1,) * len(lead)
    weights, post = leaf(n, *coef), leaf(n, *coef, shift=1.0)
    mix = leaf(n, *coef, n, scale=0.5)
    check(streams_in, mixing.streams_in, [streams, weights], f"streams_in n={n}")
    check(streams_out, mixing.streams_out, [streams, output, mix, post], f"streams_out n={n}")


@pytest.mark.parametrize("n", [3, 4])
def test_mhc_s_mix_is_read_in_place_and_its_gradient_laid_out_as_h_res(path, n):
    """mHC's mix is H_res [*, n (to), n (from)] transposed, a view [n (from), *, n (to)]: the write reads it at its
    strides (no copy a sublayer, forward or backward) and stores its gradient laid out as H_res, so H_res's
    gradient arrives contiguous (no copy in the coefficients' backward either). Values and gradients as the
    reference's."""
    from mega_depth.kernels import common

    lead, d = (5, 2), 24
    streams, output, post = leaf(n, *lead, d), leaf(*lead, d, scale=2.0), leaf(n, *lead, shift=1.0)
    res = leaf(*lead, n, n, scale=0.5)

    def write(s, y, h_res, p):
        return streams_out(s, y, h_res.transpose(-1, -2).movedim(-2, 0), p)

    def reference(s, y, h_res, p):
        return mixing.streams_out(s, y, h_res.transpose(-1, -2).movedim(-2, 0), p)

    check(write, reference, [streams, output, res, post], f"streams_out of H_res n={n}")
    if path == "triton":  # (the twins, the CPU path, stack theirs)
        seen = []
        held = res.detach().requires_grad_()
        held.register_hook(lambda g: seen.append(g.is_contiguous()))
        write(streams.detach(), output.detach(), held, post.detach()).sum().backward()
        assert seen == [True]
        # the launches recorded, not interpreted (the interpreter copies to run them)
        from torch.utils._python_dispatch import TorchDispatchMode

        copies = []

        class Copies(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
                    copies.append(str(func))
                return func(*args, **(kwargs or {}))

        with common.recording(132), Copies():  # (a dense output gradient, as a step's: .sum()'s is a broadcast)
            out = write(streams.detach(), output.detach(), held, post.detach())
            out.backward(torch.ones(out.shape))
        assert not copies, copies


def test_read_an_expanded_embedding_and_a_pipeline_view(path):
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
        assert stream_rows(make(src)).data_ptr() == src.data_ptr()  # no copy
        check(lambda x, w: streams_in(make(x), w), lambda x, w: mixing.streams_in(make(x), w), [src, weights],
              f"streams_in {label}")
        check(lambda x, y, m, p: streams_out(make(x), y, m, p), lambda x, y, m, p: mixing.streams_out(make(x), y, m, p),
              [src, output, mix, post], f"streams_out {label}")


@pytest.mark.parametrize("scale", SCALES)
def test_gradcheck(twin, scale):
    f64 = torch.float64
    streams, output = leaf(3, 4, 6, scale=scale, dtype=f64), leaf(4, 6, scale=scale, dtype=f64)
    weights, mix, post = leaf(3, 4, dtype=f64), leaf(3, 4, 3, dtype=f64), leaf(3, 4, dtype=f64)
    gradcheck(streams_in, [streams, weights], f"streams_in scale={scale}")
    gradcheck(streams_out, [streams, output, mix, post], f"streams_out scale={scale}")


def test_opcheck(twin):
    streams, output, weights, mix, post = leaf(3, 4, 6), leaf(4, 6), leaf(3, 4), leaf(3, 4, 3), leaf(3, 4)
    norm_weight = leaf(6, scale=0.3, shift=1.0)
    opcheck(streams_in_op, (streams, weights, None, 0.))
    opcheck(streams_in_backward_op, (torch.randn(4, 6), *detached([streams, weights]), None, None))
    opcheck(streams_in_op, (streams, weights, norm_weight, 1e-5))
    rstd = streams_in_op(*detached([streams, weights, norm_weight]), 1e-5)[1]
    opcheck(streams_in_backward_op, (torch.randn(4, 6), *detached([streams, weights, norm_weight]), rstd))
    opcheck(streams_in_backward_into_op, (torch.randn(4, 6), *detached([streams, weights, norm_weight]), rstd,
                                          torch.randn(3, 4, 6), True), eager_only=True)
    opcheck(streams_out_op, (streams, output, mix, post))
    # mHC's mix, H_res transposed (a view): its gradient's strides, as the fake says them, are the kernels'; laid
    # out as the mix in an eager call, contiguous where the op is traced
    h_res = leaf(4, 3, 3)
    viewed = h_res.transpose(-1, -2).movedim(-2, 0)
    opcheck(streams_out_op, (streams, output, viewed, post))
    for coefficients in ([mix, post], [viewed, post]):
        for mix_layout in (True, False):
            args = (torch.randn(3, 4, 6), *detached([streams, output, *coefficients]), mix_layout)
            opcheck(streams_out_backward_op, args)
            got = streams_out_backward_op(*args)[2]
            assert got.stride() == (coefficients[0].stride() if mix_layout else (12, 3, 1))


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("per_token", [True, False])
def test_the_read_and_its_norm_in_one_op(path, n, per_token):
    """streams_in_normed: the values and gradients (the norm weight's included) of the host's norm of the read,
    on per-token and broadcast weights, through an expanded embedding too. (Not one stream: the norm undoes its
    weight, whose gradient is then zero but for eps, and a check of it would compare fp32 noise.)"""
    lead, d = (5, 2), 24
    streams, norm_weight = leaf(n, *lead, d), leaf(d, scale=0.3, shift=1.0)
    weights = leaf(n, *(lead if per_token else (1,) * len(lead)))
    check(lambda w, s, c: streams_in_normed(w, 1e-5, s, c),
          lambda w, s, c: rms_normed(mixing.streams_in(s, c), w, 1e-5), [norm_weight, streams, weights],
          f"streams_in_normed n={n}")
    embedding = leaf(*lead, d)
    check(lambda w, e, c: streams_in_normed(w, 1e-5, e.unsqueeze(0).expand(n, *e.shape), c),
          lambda w, e, c: rms_normed(mixing.streams_in(e.unsqueeze(0).expand(n, *e.shape), c), w, 1e-5),
          [norm_weight, embedding, weights], f"streams_in_normed expanded n={n}")


def test_gradcheck_the_read_and_its_norm(twin):
    f64 = torch.float64
    gradcheck(lambda w, s, c: streams_in_normed(w, 1e-5, s, c),
              [leaf(6, scale=0.3, shift=1.0, dtype=f64), leaf(3, 4, 6, dtype=f64), leaf(3, 4, dtype=f64)],
              "streams_in_normed")


def test_save_only_their_inputs(path):
    n, d = 6, 12
    streams = leaf(4, n, d)
    saves_only_inputs(streams_in, [streams, leaf(4, n)])
    saves_only_inputs(streams_out, [streams, leaf(n, d), leaf(4, n, 4), leaf(4, n)])


def test_bf16(path):
    bf16_matches_fp32(streams_in, mixing.streams_in, torch.randn(4, 6, 24), torch.rand(4, 6))
    bf16_matches_fp32(streams_out, mixing.streams_out, torch.randn(4, 6, 24), torch.randn(6, 24), torch.rand(4, 6, 4),
                      torch.rand(4, 6) * 2)


def _two_sublayers(read, write, project, checkpoint):
    """Two mHC-like sublayers on n streams that start as an expanded embedding: each reads its streams three times,
    its coefficients and its input in recomputed regions (`checkpoint`), and writes them once."""
    def run(embedding, phi, scale):
        n = phi.shape[1] // embedding.shape[-1]
        streams = embedding.unsqueeze(0).expand(n, *embedding.shape)

        def coefficients(s, phi):  # phi passed in: a closed-over tensor gets its gradient in .grad only
            proj, mean_square = project(s, phi)
            proj = proj / mean_square.sqrt()
            pre, post = torch.sigmoid(proj[..., :n]), 2 * torch.sigmoid(proj[..., n:2 * n])
            mix = torch.softmax(proj[..., 2 * n:].unflatten(-1, (n, n)), -1)  # [*, n (in), n (out)]
            return pre.movedim(-1, 0), mix.movedim(-2, 0), post.movedim(-1, 0)

        for _ in range(2):
            pre, mix, post = checkpoint(coefficients, streams, phi)
            x = checkpoint(read, streams, pre)
            streams = write(streams, torch.tanh(x) * scale, mix, post)
        return streams
    return run


def test_a_sublayers_readers_add_into_one_buffer_across_recomputed_regions(path):
    """HC / mHC's fast path: the coefficients and the sublayer input are recomputed in backward (the sink-keeping
    checkpoint, grad_sink.recompute), the stream write is not; all three readers' backward kernels add into the
    streams' one buffer, the nested passes' included, and autograd adds none of them. Gradients equal the
    reference's (no checkpoint, autograd's sums), through an expanded embedding."""
    from mega_depth.kernels import grad_sink
    from mega_depth.kernels.mhc_projection import mhc_projection

    n, lead, d = 3, (4, 2), 8
    embedding, phi, scale = leaf(*lead, d), leaf(n * n + 2 * n, n * d, scale=0.3), leaf(d)
    fast = _two_sublayers(streams_in, streams_out, mhc_projection, grad_sink.recompute)
    reference = _two_sublayers(mixing.streams_in, mixing.streams_out, mixing.mhc_projection, lambda f, *t: f(*t))
    check(fast, reference, [embedding, phi, scale], "two sublayers")
    out = fast(embedding, phi, scale)
    with SourceGradAdds((n, *lead, d)) as adds:
        torch.autograd.grad((out * torch.randn_like(out)).sum(), [embedding, phi, scale])
    assert adds.count == 0 or path == "torch", f"{adds.count} adds of the streams' gradient"
    with SourceGradAdds((n, *lead, d)) as adds:  # the reference: autograd adds the readers' gradients
        out = reference(embedding, phi, scale)
        torch.autograd.grad(out.sum(), [embedding, phi, scale])
    assert adds.count > 0


def test_the_sink_keeping_checkpoint_is_a_checkpoint(path):
    """grad_sink.recompute: the values and gradients of fn, None inputs passed through, an output that does not
    reach the loss skipped, parameters that fn closes over get their gradients, and nothing of fn's inside is kept
    for backward beyond the inputs."""
    from mega_depth.kernels import grad_sink
    from kernel_checks import saved_storages

    weight = leaf(6)

    def fn(a, none, b):
        assert none is None
        h = torch.tanh(a * weight) * b
        return h.sum(-1), h.exp()

    a, b = leaf(5, 6), leaf(5, 6)
    got = grad_sink.recompute(fn, a, None, b)
    want = fn(a, None, b)
    for x, y in zip(got, want):
        close(x, y, "values")
    grads = []
    for out in (got, want):  # .backward(): as under any reentrant checkpoint, weight's gradient lands in .grad
        for t in (a, b, weight):
            t.grad = None
        out[0].sum().backward()  # the second output does not reach the loss
        grads.append([a.grad, b.grad, weight.grad])
    for x, y in zip(*grads):
        close(x, y, "gradients")
    saved, _ = saved_storages(lambda: grad_sink.recompute(fn, a, None, b))
    assert set(saved) <= {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}


@pytest.mark.parametrize("parts", ["write", "read", "proj", "write,read,proj"])
@pytest.mark.parametrize("held", [False, True])
def test_the_sink_sums_its_deferred_readers_as_their_own_backward_stores_them(path, parts, held):
    """streams.sum_deferred (a sublayer's readers' parts of the streams' gradient, one pass): equal to what each
    reader's own backward stores (the write's, the read's with its norm and mHC's projection's), added to what the
    buffer held; each part alone and all three together. A sign flip or a dropped part fails here."""
    from mega_depth.kernels.mhc_projection import projection_backward_op
    from mega_depth.kernels.streams import gradient_sum_op

    n, lead, d = 3, (4, 2), 8
    streams, output, weights, mix, post = (torch.randn(n, *lead, d), torch.randn(*lead, d), torch.rand(n, *lead),
                                           torch.rand(n, *lead, n), torch.rand(n, *lead))
    norm_weight, phi = torch.rand(d) + 0.5, torch.randn(n * n + 2 * n, n * d) * 0.3
    rstd = streams_in_op(streams, weights, norm_weight, 1e-5)[1]
    go, g_in = torch.randn(n, *lead, d), torch.randn(*lead, d)
    g_proj, g_ms = torch.randn(*lead, n * n + 2 * n), torch.randn(*lead, 1)
    want = torch.randn(n, *lead, d) if held else torch.zeros(n, *lead, d)
    into = want.clone()
    args = {"write": (None, None), "read": (None, None), "proj": (None, None, None)}
    for part in parts.split(","):
        if part == "write":
            want += streams_out_backward_op(go, streams, output, mix, post, True)[0]
            args["write"] = (go, mix)
        elif part == "read":
            want += streams_in_backward_op(g_in, streams, weights, norm_weight, rstd)[0]
            from mega_depth.kernels.streams import streams_in_backward_deferred_op
            gi = streams_in_backward_deferred_op(g_in, streams, weights, norm_weight, rstd)[2]
            args["read"] = (gi, weights)
        else:
            want += projection_backward_op(g_proj, g_ms, streams, phi)[0]
            args["proj"] = (g_proj, g_ms, phi)
    dphi = gradient_sum_op(into, held, streams, *args["write"], *args["read"], *args["proj"], "proj" in parts)
    close(into, want, f"the sum of {parts}")
    assert len(dphi) == ("proj" in parts)
    if "proj" in parts:  # phi's gradient from the same pass, as the projection's own backward makes it
        close(dphi[0], projection_backward_op(g_proj, g_ms, streams, phi)[1], f"phi's gradient beside {parts}")


def test_opcheck_the_deferred_backward_and_the_sum(twin):
    from mega_depth.kernels.streams import (gradient_sum_op, streams_in_backward_deferred_op,
                                            streams_out_backward_deferred_op)

    streams, output, weights, mix, post = (torch.randn(3, 4, 6), torch.randn(4, 6), torch.rand(3, 4),
                                           torch.rand(3, 4, 3), torch.rand(3, 4))
    norm_weight, phi = torch.rand(6) + 0.5, torch.randn(15, 18)
    rstd = streams_in_op(streams, weights, norm_weight, 1e-5)[1]
    opcheck(streams_in_backward_deferred_op, (torch.randn(4, 6), streams, weights, None, None))
    opcheck(streams_in_backward_deferred_op, (torch.randn(4, 6), streams, weights, norm_weight, rstd))
    opcheck(streams_out_backward_deferred_op, (torch.randn(3, 4, 6), streams, output, mix, post, False))
    for phi_grad in (False, True):
        opcheck(gradient_sum_op, (torch.randn(3, 4, 6), True, streams, torch.randn(3, 4, 6), mix, torch.randn(4, 6),
                                  weights, torch.randn(4, 15), torch.randn(4, 1), phi, phi_grad), eager_only=True)


@pytest.mark.parametrize("projection_first", [True, False])
def test_phis_gradient_comes_from_the_streams_sum(path, monkeypatch, projection_first):
    """mHC's sublayer reads its streams with the projection first: phi goes through the streams' sink node beside
    them (grad_sink.aliased_with), the projection leaves both its parts to the sink, and the sink's one pass over the
    streams makes phi's gradient too: one sum a sublayer, no other pass for phi. Where another reader made the
    streams' alias first, the projection adds its part into the buffer and makes phi's gradient in that launch. Both
    equal the reference (autograd's sums), one phi read by two sublayers."""
    from mega_depth.kernels import streams as streams_module
    from mega_depth.kernels.mhc_projection import mhc_projection

    n, lead, d = 3, (4, 2), 8
    embedding, phi, scale = leaf(*lead, d), leaf(n * n + 2 * n, n * d, scale=0.3), leaf(d)

    def sublayers(read, write, project):
        def run(embedding, phi, scale):
            streams = embedding.unsqueeze(0).expand(n, *embedding.shape)
            for _ in range(2):
                if not projection_first:
                    x0 = read(streams, torch.full((n, *lead), 1.0 / n))  # another reader first
                proj, mean_square = project(streams, phi)
                proj = proj / mean_square.sqrt()
                pre, post = torch.sigmoid(proj[..., :n]), 2 * torch.sigmoid(proj[..., n:2 * n])
                mix = torch.softmax(proj[..., 2 * n:].unflatten(-1, (n, n)), -1)
                x = read(streams, pre.movedim(-1, 0))
                if not projection_first:
                    x = x + 0.5 * x0
                streams = write(streams, torch.tanh(x) * scale, mix.movedim(-2, 0), post.movedim(-1, 0))
            return streams
        return run

    passes = []  # a pass over the streams for their gradient: whether it made phi's gradient too
    for name in ("_triton_sum", "_torch_sum"):
        def counted(ds, adding, s, write=None, read=None, proj=None, phi_grad=False, _sum=getattr(streams_module, name)):
            passes.append(phi_grad)
            return _sum(ds, adding, s, write, read, proj, phi_grad)
        monkeypatch.setattr(streams_module, name, counted)
    fast = sublayers(streams_in, streams_out, mhc_projection)
    check(fast, sublayers(mixing.streams_in, mixing.streams_out, mixing.mhc_projection), [embedding, phi, scale],
          f"phi through the sink, projection first {projection_first}")
    passes.clear()
    out = fast(embedding, phi, scale)
    torch.autograd.grad((out * torch.randn_like(out)).sum(), [embedding, phi, scale])
    if projection_first:  # one pass a sublayer, phi's gradient in it
        assert passes == [True, True], passes
    else:  # the projection's own pass (phi's gradient in it), then the sink's sums of the others' parts (a launch
        # takes one part of each kind: two reads, two launches)
        assert passes == [True, False, False] * 2, passes
