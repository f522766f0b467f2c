"""Helpers for tests/xla, which run under tools/test_xla.sh: torch 2.9.0 + torch-xla 2.9.0 in .venv-xla, PJRT_DEVICE=CPU.

Every XLA run is its own process (an eager backward before the XLA device starts breaks later XLA backward calls,
and CPU_NUM_DEVICES is read once per process). The main environment (.venv) exports and loads the Hugging Face
folder, as a user's machine would.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_PY = os.path.join(ROOT, ".venv", "bin", "python")
RUN_PLAIN = os.path.join(ROOT, "tests", "scripts", "run_plain.py")


def run(args, env=None, python=sys.executable, timeout=1800):
    full_env = dict(os.environ, PYTHONPATH=ROOT, PJRT_DEVICE="CPU", **(env or {}))
    proc = subprocess.run([python] + args, capture_output=True, text=True, cwd=ROOT, env=full_env, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc
