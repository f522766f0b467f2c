"""The launch scripts refuse, in one line each: a Python without mega_depth, and (launch/torchrun.sh) a multi-node
launch it cannot rendezvous, instead of hanging: each node defaulting to 127.0.0.1 waits on itself, and every node
defaulting to rank 0 leaves the rendezvous short."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "NODE_RANK"])
def test_a_multi_node_torchrun_launch_without_its_rendezvous_settings_stops_and_says_which(missing):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "NODE_RANK")}
    env.update({"NNODES": "2", "NPROC": "1", "MASTER_PORT": "29400", "MASTER_ADDR": "node0", "NODE_RANK": "1"})
    del env[missing]
    proc = subprocess.run(["bash", "launch/torchrun.sh", "--mock-data"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and f"needs {missing} set to" in proc.stderr


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/deepspeed.sh"])
def test_a_launch_with_a_python_that_lacks_mega_depth_stops_and_says_how_to_fix_it(script, tmp_path):
    env = dict(os.environ, PY=str(tmp_path / "no-such-python"), NPROC="1")
    proc = subprocess.run(["bash", script, "--mock-data"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert f"PY={tmp_path / 'no-such-python'} cannot import mega_depth" in proc.stderr, proc.stderr
    assert "tools/setup.sh" in proc.stderr


def test_the_launch_takes_its_python_from_py_not_from_the_setups_python(tmp_path):
    """tools/setup.sh's PYTHON (the interpreter it builds .venv from, python3.11: its own error message suggests
    exporting it) is not the launch's: a launch in that shell still runs .venv's Python. The launch stops on the
    missing MASTER_PORT of a two-node launch, after its Python has run, before any rendezvous."""
    called = tmp_path / "setup-python-was-run"
    setup_python = tmp_path / "python3.11"
    setup_python.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    setup_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PY", "NPROC", "MASTER_PORT", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID")}
    env.update({"PYTHON": str(setup_python), "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    proc = subprocess.run(["bash", "launch/torchrun.sh", "--mock-data"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert not called.exists(), "the launch ran PYTHON"
    assert proc.returncode == 2 and "set MASTER_PORT" in proc.stderr, proc.stderr[-2000:]
