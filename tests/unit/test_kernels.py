"""The fused mixing kernels' tests (tests/kernels/test_fused_kernels.py), in their own process: the Triton
interpreter must be switched on before triton is first imported, and that setting must not reach other tests."""

import pytest

from fixtures import run


def test_fused_kernels_equal_the_eager_math_under_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (tools/setup.sh installs it with the test extra)")
    proc = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"],
               env={"TRITON_INTERPRET": "1", "MEGA_DEPTH_KERNELS_FORCE_TRITON": "1"})
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, proc.stdout[-3000:]
