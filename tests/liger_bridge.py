"""Liger's kernels as a GPU runs them, under Triton's interpreter on a CPU. Import it only once TRITON_INTERPRET is
set (it imports triton: kernel_checks, or the environment of a launch)."""

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

from mega_depth.kernels import common


@common.jit
def _rsqrt(x):
    return tl.math.rsqrt(x)


def bridge_liger_for_the_interpreter(set_attr=setattr) -> None:
    """Two gaps of the interpreter, bridged: a float argument becomes an fp32 scalar (the compiler's specialisation;
    the interpreter passes a Python float, which Liger's kernels cast with .to), and libdevice's rsqrt, which the
    interpreter does not implement, is tl.math's. `set_attr`: pytest's monkeypatch.setattr, to undo it after a
    test."""
    from liger_kernel.ops import rms_norm as liger

    convert = interpreter._implicit_cvt

    def float_as_fp32(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    set_attr(interpreter, "_implicit_cvt", float_as_fp32)
    set_attr(liger, "rsqrt", _rsqrt)
