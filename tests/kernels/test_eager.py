"""mega_depth/kernels/eager.py: an eager call of a mixing op (a plain autograd.Function over the op's own
implementation, context and backward) equals the registered custom op in values and gradients, a list argument's
tensors get their gradients one by one (only those that need one), an op without a list argument (the short path:
no flattening, the Function's own context) gets its gradients argument by argument, and a traced call stays the
op."""

import torch
from kernel_checks import EPS, leaf, sources_of

from mega_depth.kernels import eager
from mega_depth.kernels.attnres_block import phase1_op, phase2_op
from mega_depth.kernels.attnres_mix import attnres_mix_op


def _grads(fn, tensors):
    out = fn()
    outs = out if isinstance(out, (list, tuple)) else [out]
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs
               if o.requires_grad)
    wanted = [t for t in tensors if t.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(loss, wanted)


def test_an_eager_call_equals_the_op_and_routes_list_gradients(path):
    sources = sources_of(3, 2, 3, 8)
    sources[1] = sources[1].detach()  # one source without a gradient: its place in the list must not shift
    query, gain = leaf(8), leaf(8, scale=0.3, shift=1.0)
    args = (sources, query, gain, EPS, False, 2)
    tensors = [*sources, query, gain]
    assert not eager.traced(args)
    out_op, grads_op = _grads(lambda: attnres_mix_op(*args), tensors)
    out_eager, grads_eager = _grads(lambda: eager.call(attnres_mix_op, *args), tensors)
    for a, b in zip(out_op + list(grads_op), out_eager + list(grads_eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(grads_eager) == 4 and all(g.abs().sum() > 0 for g in grads_eager)


def test_a_list_output_op_and_no_grad_calls(path):
    blocks = sources_of(2, 5, 8)
    queries, gains = leaf(3, 8), leaf(3, 8, scale=0.3, shift=1.0)
    args = (blocks, queries, gains, EPS, False, 1)
    out_op, grads_op = _grads(lambda: phase1_op(*args), [*blocks, queries, gains])
    out_eager, grads_eager = _grads(lambda: eager.call(phase1_op, *args), [*blocks, queries, gains])
    for a, b in zip(out_op + list(grads_op), out_eager + list(grads_eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():  # no graph: the implementation alone, a list as the op returns it
        plain = eager.call(phase1_op, *args)
    assert isinstance(plain, list) and not plain[2].requires_grad
    torch.testing.assert_close(plain[2], out_op[2], rtol=0, atol=0)


def test_an_op_without_a_list_argument_gets_its_gradients_by_argument(path):
    """phase2: no list argument, so the short path. m is a constant (no gradient) and the partial sum is detached:
    the gradients of z, o, the query, the gain and the norm weight must land on those arguments, in place, and
    the op's backward must see needs_input_grad per op argument (a shift by one would hand z's gradient to m)."""
    m = torch.randn(5, 2)
    z, o = leaf(5, 2, scale=0.5, shift=2.0), leaf(5, 8)
    partial = torch.randn(5, 8)
    query, gain, weight = leaf(8), leaf(8, scale=0.3, shift=1.0), leaf(8, scale=0.1, shift=1.0)
    args = (m, z, o, partial, query, gain, weight, EPS, 1e-5, False, 2)
    tensors = [z, o, query, gain, weight]
    assert eager._flatten(args)[1] is None  # the short path
    out_op, grads_op = _grads(lambda: phase2_op(*args), tensors)
    out_eager, grads_eager = _grads(lambda: eager.call(phase2_op, *args), tensors)
    for a, b in zip(out_op + list(grads_op), out_eager + list(grads_eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(g.abs().sum() > 0 for g in grads_eager)
    seen = []
    backward = eager._FUNCTIONS[phase2_op].backward

    def spy(ctx, *grads):
        seen.append(ctx.needs_input_grad)
        return backward(ctx, *grads)

    original = eager._FUNCTIONS[phase2_op].backward
    try:
        eager._FUNCTIONS[phase2_op].backward = staticmethod(spy)
        _grads(lambda: eager.call(phase2_op, *args), tensors)
    finally:
        eager._FUNCTIONS[phase2_op].backward = original
    assert seen == [(False, True, True, False, True, True, True, False, False, False, False)]


def test_a_traced_call_is_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, 8)
    assert eager.traced(([fake], None)) and eager.traced((fake,))
    assert not eager.traced(([torch.empty(2)], torch.nn.Parameter(torch.empty(2)), 1.0, None))


def test_a_profiled_eager_call_is_named_as_the_op(path):
    """tools/profile_step.py finds the mixing on a CPU by the op's name: the eager call records it."""
    sources = sources_of(2, 3, 8)
    query, gain = leaf(8), leaf(8, scale=0.3, shift=1.0)
    with torch.profiler.profile() as prof:
        eager.call(attnres_mix_op, sources, query, gain, EPS, False, 1)[0].sum().backward()
    names = {e.name for e in prof.events()}
    assert "mega_depth::attnres_mix" in names and "mega_depth::attnres_mix_backward" in names, sorted(names)[:20]
