"""What the per-op kernel tests share (one test file per op in mega_depth/kernels, this module beside them).

Both inner paths of every op run: the Triton kernels (on CPU tensors under the Triton interpreter, TRITON_INTERPRET=1
set before triton is imported; on a GPU for real) and the torch twins (the Triton switch forced off). Values and
the gradients w.r.t. every tensor input are compared with the eager reference (mixing.py) in fp32 at ~1e-5
relative; tiny shapes keep it fast. Each op is also checked as a custom op (torch.library.opcheck: schema, fake
implementation, autograd registration, AOT dispatch) and its CPU kernel by fp64 gradcheck at input scales 1, 3
and 10. The suite runs in its own process (tests/unit/test_kernels.py starts it with the environment it needs, so
that the interpreter setting never leaks into other tests); on a GPU: `pytest tests/kernels`.
"""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton (and of the kernels)
os.environ.setdefault("MEGA_DEPTH_KERNELS_FORCE_TRITON", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

GPU = torch.cuda.is_available()
if GPU:  # the tests' tensors on the GPU: the ops run their compiled Triton kernels
    torch.set_default_device("cuda")

from mega_depth.kernels import common  # noqa: E402

EPS = 1e-6
SCALES = (1.0, 3.0, 10.0)


def interpreted() -> bool:
    """The kernels run under the interpreter only if nothing imported triton before TRITON_INTERPRET was set."""
    if not common.triton_available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from mega_depth.kernels import attnres_mix

    return isinstance(attnres_mix._fwd_kernel, InterpretedFunction) or torch.cuda.is_available()


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Run the test once through the Triton kernels (interpreted) and once through the torch twins."""
    if request.param == "torch" and GPU:
        pytest.skip("the torch twins are the ops' CPU kernels; a GPU runs the Triton kernels")
    if request.param == "triton":
        if not interpreted():
            pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 (or triton is missing)")
        monkeypatch.setattr(common, "FORCE_TRITON", True)
    else:
        monkeypatch.setattr(common, "FORCE_TRITON", False)
    assert common.uses_triton(torch.zeros(1)) == (request.param == "triton")  # on the default device
    return request.param


@pytest.fixture
def twin(monkeypatch):
    """The ops' CPU kernels (the torch twins), as opcheck and gradcheck see them."""
    monkeypatch.setattr(common, "FORCE_TRITON", False)


def rms_normed(x, weight, eps):
    """The host's eager RMSNorm (megatron/norm.py: normalised in fp32, cast back, then scaled), never fused."""
    from mega_depth.megatron.norm import eager_rms_norm

    return eager_rms_norm(x, weight, eps)


def leaf(*shape, scale=1.0, shift=0.0, dtype=torch.float32):
    return (torch.randn(*shape, dtype=dtype) * scale + shift).requires_grad_()


def sources_of(k, *shape, dtype=torch.float32):
    """K sources of clearly different magnitudes (a non-uniform depth softmax)."""
    return [leaf(*shape, scale=0.5 + i, dtype=dtype) for i in range(k)]


def close(actual, expected, what, rtol=1e-5, exact=None):
    """actual ~ expected to rtol of expected's largest entry. Given `exact` (the reference in fp64), the tolerance is
    at least 4x the fp32 reference's own rounding error: a gradient summed over cancelling terms (a softmax's) can
    lose more than rtol of its largest entry in fp32 on either side, and the kernel is held to what fp32 can do."""
    scale = max(float(expected.detach().abs().max()), 1e-6) if expected.numel() else 1.0
    atol = rtol * scale
    if exact is not None and expected.numel():
        atol = max(atol, 4 * float((expected.detach().double() - exact.detach()).abs().max()))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def in_fp64(inputs):
    """Leaf copies of the inputs in fp64 (other arguments as they are), for the reference's exact values."""
    return [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t for t in inputs]


def check(fast, reference, inputs, label):
    """Values of every output, then the gradients of a random projection of the outputs w.r.t. every input
    tensor that requires grad (None on one side only passes if the other side is all zeros). The fp32 reference
    is also evaluated in fp64, which sets the floor of the tolerance (see `close`)."""
    torch.manual_seed(1234)
    out_f, out_r = fast(*inputs), reference(*inputs)
    inputs_64 = in_fp64(inputs)
    out_64 = reference(*inputs_64)
    outs_f, outs_r, outs_64 = (o if isinstance(o, tuple) else (o,) for o in (out_f, out_r, out_64))
    assert len(outs_f) == len(outs_r)
    for i, (a, b, e) in enumerate(zip(outs_f, outs_r, outs_64)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), f"{label} output {i}: {a.shape} {a.dtype} vs {b.dtype}"
        assert a.requires_grad == b.requires_grad, f"{label} output {i}: requires_grad differs"
        close(a, b, f"{label} output {i}", exact=e)
    weights = [torch.randn_like(b) for b in outs_r]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves_64 = [t for t in inputs_64 if isinstance(t, torch.Tensor) and t.requires_grad]
    loss_f = sum((a * w).sum() for a, w in zip(outs_f, weights) if a.requires_grad)
    loss_r = sum((b * w).sum() for b, w in zip(outs_r, weights) if b.requires_grad)
    loss_64 = sum((e * w.double()).sum() for e, w in zip(outs_64, weights) if e.requires_grad)
    grads_f = torch.autograd.grad(loss_f, leaves, allow_unused=True)
    grads_r = torch.autograd.grad(loss_r, leaves, allow_unused=True)
    grads_64 = torch.autograd.grad(loss_64, leaves_64, allow_unused=True)
    for i, (a, b, e) in enumerate(zip(grads_f, grads_r, grads_64)):
        if a is None or b is None:
            other = a if b is None else b
            assert other is None or not other.abs().any(), f"{label} grad {i}: None vs nonzero"
            continue
        close(a, b, f"{label} grad of input {i}", exact=e)


def gradcheck(fn, inputs, label):
    """fp64 torch.autograd.gradcheck of fn over its tensor inputs (the ones that require grad)."""
    assert all(t.dtype == torch.float64 for t in inputs if isinstance(t, torch.Tensor))
    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-6, rtol=1e-4), label


def opcheck(op, args, eager_only=False):
    """torch.library.opcheck: schema, fake implementation, autograd registration and AOT dispatch all pass. An
    eager-only op (one that adds into a list of buffers, kernels/grad_sink.py: never traced, and functionalization
    does not take a mutated tensor list) is checked without AOT dispatch."""
    tests = ("test_schema", "test_autograd_registration", "test_faketensor") if eager_only else \
        torch.library._OPCHECK_DEFAULT_UTILS
    results = torch.library.opcheck(op, args, test_utils=tests)
    assert all(v == "SUCCESS" for v in results.values()), results


def detached(tensors):
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in tensors]


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


def saves_only_inputs(fn, inputs, small=0):
    """fn(*inputs) saves for backward references to its inputs and at most `small`-element extras."""
    saved, _ = saved_storages(lambda: fn(*inputs))
    given = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    extra = {ptr: size for ptr, size in saved.items() if ptr not in given}
    assert all(size <= small for size in extra.values()), extra


def bf16_matches_fp32(fast, reference, *tensors):
    """bf16 in, bf16 out; the depth weights are fp32 inside, so the result is within bf16 rounding of the
    reference evaluated in fp32 on the same (bf16-representable) values; so are the gradients."""
    torch.manual_seed(0)
    b16 = torch.bfloat16
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


class SourceGradAdds(TorchDispatchMode):
    """Counts the aten adds of whole tensors of one shape: autograd's sum of a source's gradients from its readers,
    which kernels/grad_sink.py moves into the backward kernels."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor) and args[0].shape == self.shape:
            self.count += 1
        return func(*args, **(kwargs or {}))
