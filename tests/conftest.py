import importlib.util
import os
import socket
import subprocess
import sys

import pytest

# tests/xla needs torch-xla (tools/test_xla.sh builds its environment); the main suite leaves it alone.
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "corpus", "python-docs-3.11.jsonl.gz")
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def run(args, expect=0, timeout=600, env=None):
    """`python args...` from the repository root; fail with its output unless it exits with `expect`."""
    proc = subprocess.run([PY] + args, capture_output=True, text=True, cwd=ROOT, env=dict(ENV, **(env or {})),
                          timeout=timeout)
    if expect is not None and proc.returncode != expect:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode} (expected {expect}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-5000:]}")
    return proc


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


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A 1000-piece tokenizer trained on the embedded corpus, and the corpus preprocessed with it."""
    d = tmp_path_factory.mktemp("data")
    run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "1000", "--output-prefix", str(d / "spm")])
    run(["tools/preprocess_data.py", "--input", CORPUS, "--output-prefix", str(d / "docs"), "--tokenizer-model",
         str(d / "spm.model"), "--workers", "2", "--append-eod"])
    return {"dir": d, "flags": ["--data-path", str(d / "docs"), "--tokenizer-model", str(d / "spm.model"),
                                "--split", "90,10,0"]}
