import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script_and_args, log_path: str, env=None, timeout=600) -> None:
    """Run `torchrun --nproc-per-node nproc script args...` (gloo on CPU); fail with the log on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port())] + list(script_and_args)
    full_env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-6000:]
        pytest.fail(f"{' '.join(cmd)} failed with {proc.returncode}:\n{tail}")
