"""Helpers for tests/xla, which run under tools/test_xla.sh: torch 2.9.0 + torch-xla 2.9.0 in .venv-xla, PJRT_DEVICE=CPU.

Every XLA run is its own process (an eager backward before the XLA device starts breaks later XLA backward calls,
and CPU_NUM_DEVICES is read once per process). The main environment (.venv) exports and loads the Hugging Face
folder, as a user's machine would.
"""

import os
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_PY = os.path.join(ROOT, ".venv", "bin", "python")
RUN_PLAIN = os.path.join(ROOT, "tests", "scripts", "run_plain.py")


# XLA's CPU compiler at LLVM -O0: these tests compare numbers, not CPU code speed, and compiling is most of their time
# (a setting's run: 55 s -> 24 s, bitwise the same losses). A TPU run never sees it: the flag is set here only.
XLA_FLAGS = "--xla_backend_optimization_level=0"


def _env(env):
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS"), XLA_FLAGS) if f)
    return dict(os.environ, PYTHONPATH=ROOT, PJRT_DEVICE="CPU", XLA_FLAGS=flags, **(env or {}))


def _check(args, returncode, stdout, stderr):
    if returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {returncode}:\n{stdout[-3000:]}\n{stderr[-5000:]}")


def run(args, env=None, python=sys.executable, timeout=1800):
    proc = subprocess.run([python] + args, capture_output=True, text=True, cwd=ROOT, env=_env(env), timeout=timeout)
    _check(args, proc.returncode, proc.stdout, proc.stderr)
    return proc


def run_together(jobs, timeout=1800):
    """Independent runs [(args, env), ...] at once: each is one process that spends most of its time in XLA's
    compiler on one core, so two or more share the machine's cores. Fails with the first failed run's output."""
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in jobs]  # pipes would fill and stall
    procs = [subprocess.Popen([sys.executable] + args, stdout=out, stderr=err, text=True, cwd=ROOT, env=_env(env))
             for (args, env), (out, err) in zip(jobs, logs)]
    try:
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            proc.kill()
    for (args, _), proc, (out, err) in zip(jobs, procs, logs):
        out.seek(0), err.seek(0)
        _check(args, proc.returncode, out.read(), err.read())
