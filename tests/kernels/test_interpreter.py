"""kernels/common.py's patches of Triton's interpreter (TRITON_INTERPRET only): a @jit helper called inside a
kernel leaves the language as the launch patched it, instead of patching it again at every call."""

import kernel_checks  # noqa: F401  (first: TRITON_INTERPRET before triton is imported)
import pytest
import torch
import triton
import triton.language as tl

from mega_depth.kernels import common  # applies the patches under the interpreter

pytestmark = pytest.mark.skipif(not common.interpreting(), reason="patches of the interpreter: TRITON_INTERPRET=1")


@triton.jit
def _doubled(v):
    return v * 2


@triton.jit
def _double_rows_kernel(x_ptr, out_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    for step in range(STEPS):  # the helper called at every step of every program
        cols = (row * STEPS + step) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + cols, _doubled(tl.load(x_ptr + cols)))


def test_a_helpers_calls_inside_a_kernel_patch_the_language_once(monkeypatch):
    from triton.runtime import interpreter

    patched = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: (patched.append(pkg), original(pkg, *a))[1])
    x = torch.arange(24.0)
    out = torch.empty_like(x)
    _double_rows_kernel[(3,)](x, out, STEPS=4, BLOCK=2)
    assert torch.equal(out, 2 * x)
    # the launch patches tl, tl.tensor, tl.math and the tensor descriptors once; the 12 helper calls nothing
    assert len(patched) == 4, patched
    # and the launch's patch was restored: the language is Triton's own again outside the kernel
    assert tl.core.is_builtin(tl.load)
