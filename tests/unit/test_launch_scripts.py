"""launch/torchrun.sh refuses a multi-node launch it cannot rendezvous, in one line, instead of hanging: each node
defaulting to 127.0.0.1 waits on itself, and every node defaulting to rank 0 leaves the rendezvous short."""

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
