"""Model flag sets and helpers shared by the tests (one place: a test picks a named set and adds its own flags).

Every set is a tiny Qwen3-style model (q/k-norm, SwiGLU, RoPE, tied embeddings); GQA where TP must split the groups.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List

import pytest

from mega_depth import ports
from mega_depth.training.distributed import free_port  # noqa: F401  (tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
CORPUS = os.path.join(ROOT, "data", "corpus", "python-docs-3.11.jsonl.gz")
PY = sys.executable


def confine_ports_to_this_worker() -> None:
    """Each pytest-xdist worker (and what it launches) draws rendezvous ports from its own share: a rendezvous
    whose free port a test on the other worker took before it bound it was a red run (EADDRINUSE). Loopback
    rendezvous only, so a range of the user's own gives way; a nested pytest (the kernel tests) gets the same share."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count.isdigit():
        share = ports.worker_share(int(worker[2:]), int(count))
        if share is not None:
            os.environ[ports.RANGE_ENV] = f"{share[0]}-{share[1]}"


confine_ports_to_this_worker()  # before ENV copies the environment
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

# 4 layers, 4 query heads in 2 key-value groups (TP=2 splits the groups), mock data, 4 micro-batches of 1.
LAYOUT_MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
                "--seq-length", "16", "--vocab-size", "128", "--train-iters", "3", "--lr", "3e-3", "--seed", "7",
                "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4"]
# The same shape on real data, trained harder so that the mixing parameters move off their initialisation.
SAVE_MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
              "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
              "--lr", "1e-2", "--lr-decay-style", "constant", "--split", "100,0,0", "--no-tensorboard", "--seed", "11"]
# Two layers of Block AttnRes on real data: the training-stack tests (resume, SIGTERM, corruption, ...).
TRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
               "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2",
               "--residual", "attnres", "--attnres-num-blocks", "2", "--log-interval", "5"]
# Three layers on mock data: model identities in one process.
UNIT_MODEL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
              "--seq-length", "16", "--vocab-size", "100", "--seed", "3", "--mock-data"]


# Options beyond the catalogue that the layout, export and XLA tests cover too: the input-dependent query's
# readings, all at once (source = the sum of all sources, 1/sqrt(d) scale, RMSNorm on the projected query).
READINGS = ("attnres-input-query+attnres_query_source=sum+attnres_query_scale=rsqrt_d+attnres_query_norm=true",)


def last_value(flags: List[str], name: str) -> str:
    """The value of the last `name` in an argument list (argparse's rule: a layout's flag overrides the model's)."""
    return flags[len(flags) - flags[::-1].index(name)]


def mechanism_flags(num_layers: int = 4) -> Dict[str, List[str]]:
    """Every catalogue setting (and READINGS) as flags; 3 AttnRes blocks over 4 layers, so that a block straddles
    a stage (2 over 2 layers: Block AttnRes's second block still starts mid-model, at layer 1)."""
    from mega_depth.catalogue import SETTINGS, mechanism_flags as flags

    return {name: flags(name, num_layers, attnres_num_blocks=min(3, num_layers)) for name in SETTINGS + READINGS}


def run(args, expect=0, timeout=900, env=None):
    """`python args...` from the repository root; fail with its output unless it exits with `expect`."""
    proc = subprocess.run([PY] + args, capture_output=True, text=True, cwd=ROOT, env=dict(ENV, **(env or {})),
                          timeout=timeout)
    if expect is not None and proc.returncode != expect:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode} (expected {expect}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-5000:]}")
    return proc


def torchrun(nproc: int, script_and_args, log_path: str, env=None, timeout=900) -> None:
    """`torchrun --nproc-per-node nproc script args...` (gloo on CPU); fail with the log on error."""
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port())] + list(script_and_args)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(ENV, **(env or {})),
                              timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-6000:]
        pytest.fail(f"{' '.join(cmd)} failed with {proc.returncode}:\n{tail}")


def metrics(run_dir) -> Dict[int, dict]:
    """metrics.jsonl of a run, by step, read as strict JSON (NaN or Infinity in the file fails the test)."""
    import json

    def strict(name):
        raise ValueError(f"metrics.jsonl holds {name}, which strict JSON parsers reject")

    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        return {r["step"]: r for r in (json.loads(line, parse_constant=strict) for line in f)}
