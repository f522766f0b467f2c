"""The launchers as far as one machine allows: two simulated nodes on 127.0.0.1 for launch/torchrun.sh,
launch/deepspeed.sh (per-node, no ssh) and launch/slurm.sbatch (with stand-ins for scontrol and srun), each
equal to the one-node run; a SIGTERM to the launcher ends with a saved checkpoint and exit status 0, also after
periodic saves (whose writer helpers receive the same signal), and the run resumes from it exactly; through
launch/deepspeed.sh a save longer than DeepSpeed's 30 s kill timeout completes too."""

import os
import signal
import subprocess
import time

import pytest

from fixtures import ENV, ROOT, free_port, metrics
from mega_depth.checkpoint.manifest import verify

MODEL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
         "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3",
         "--no-tensorboard"]


def launch(script, args, env, timeout=600):
    return subprocess.Popen(["bash", script] + args, cwd=ROOT, env=dict(ENV, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=600):
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def two_nodes(script, args, node_env, tmp_path, name):
    port = str(free_port())
    procs = [launch(script, args + ["--output-dir", str(tmp_path / name)],
                    dict(node_env, NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in (0, 1)]
    finish(procs)
    return metrics(tmp_path / name)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """metrics of the one-node run (torchrun.sh, 2 processes) of MODEL + a layout, run once for the module's tests."""
    runs = {}

    def metrics_of(layout):
        if tuple(layout) not in runs:
            out = tmp_path_factory.mktemp("one-node")
            finish([launch("launch/torchrun.sh", MODEL + layout + ["--output-dir", str(out)], {"NPROC": "2"})])
            runs[tuple(layout)] = metrics(out)
        return runs[tuple(layout)]
    return metrics_of


PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("layout", [PP2, []])
def test_torchrun_two_nodes_equal_one_node(tmp_path, layout, one_node):
    two = two_nodes("launch/torchrun.sh", MODEL + layout, {"NPROC": "1"}, tmp_path, "two")
    ref = one_node(layout)
    assert sorted(two) == [1, 2, 3] and [two[s]["loss"] for s in two] == pytest.approx([ref[s]["loss"] for s in ref],
                                                                                       rel=1e-6)


def test_deepspeed_per_node_without_ssh_equals_one_node(tmp_path):
    flags = MODEL + ["--deepspeed-config", "launch/ds_configs/zero2.json"]
    one = launch("launch/deepspeed.sh", flags + ["--output-dir", str(tmp_path / "one")], {"NGPUS": "2"})
    finish([one])
    two = two_nodes("launch/deepspeed.sh", flags, {"NGPUS": "1", "NO_SSH": "1"}, tmp_path, "two")
    ref = metrics(tmp_path / "one")
    assert sorted(two) == [1, 2, 3] and [two[s]["loss"] for s in two] == pytest.approx([ref[s]["loss"] for s in ref],
                                                                                       rel=1e-6)


STUB_SCONTROL = """#!/usr/bin/env bash
# stand-in for `scontrol show hostnames LIST`: one host per simulated node
for ((i = 0; i < SLURM_NNODES; i++)); do echo 127.0.0.1; done
"""
STUB_SRUN = """#!/usr/bin/env bash
# stand-in for srun: the task once per simulated node (SLURM_NODEID), signals forwarded as srun does
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
  while true; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done
  [ "$rc" -ne 0 ] && status=$rc
done
exit $status
"""


@pytest.fixture
def slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", STUB_SCONTROL), ("srun", STUB_SRUN)):
        (bin_dir / name).write_text(text)
        os.chmod(bin_dir / name, 0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[0-1]",
            "SLURM_JOB_ID": str(100000 + os.getpid() % 50000), "SLURM_GPUS_ON_NODE": "1", "SLURM_SUBMIT_DIR": ROOT,
            "SAVE_GRACE_S": "120"}


def test_slurm_two_nodes_train_and_a_preemption_saves_and_exits_zero(tmp_path, slurm, one_node):
    job = launch("launch/slurm.sbatch", MODEL + PP2 + ["--output-dir", str(tmp_path / "two")], slurm)
    finish([job])
    ref, two = one_node(PP2), metrics(tmp_path / "two")
    assert [two[s]["loss"] for s in two] == pytest.approx([ref[s]["loss"] for s in ref], rel=1e-6)

    # pre-emption: SIGTERM to the job step; the workers finish their step, save, and the step ends with 0
    long = [a if a != "3" else "100000" for a in MODEL] + ["--pipeline-model-parallel-size", "2", "--save",
                                                            str(tmp_path / "ckpt"), "--output-dir",
                                                            str(tmp_path / "pre")]
    job = launch("launch/slurm.sbatch", long, slurm)
    path = tmp_path / "pre" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (path.exists() and len(path.read_text().splitlines()) >= 2):
        assert job.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.2)
    import psutil

    # SLURM signals the job step (srun), which forwards to its tasks: not the batch script itself
    (step,) = [p for p in psutil.Process(job.pid).children(recursive=True) if "srun" in " ".join(p.cmdline())]
    step.send_signal(signal.SIGTERM)
    out = job.communicate(timeout=300)[0]
    assert job.returncode == 0, out[-4000:]
    assert "SIGTERM received; the workers saved and stopped; exit 0" in out and "Traceback" not in out
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and os.path.isdir(tmp_path / "ckpt" / f"iter_{saved:07d}")


def test_arguments_with_spaces_reach_the_trainer_intact(tmp_path, slurm):
    out_dir = tmp_path / "a folder with spaces"
    job = launch("launch/slurm.sbatch", MODEL + ["--pipeline-model-parallel-size", "2", "--output-dir",
                                                 str(out_dir)], slurm)
    finish([job])
    assert sorted(metrics(out_dir)) == [1, 2, 3]


def iters(n):
    """MODEL trained for n steps."""
    return [a if a != "3" else str(n) for a in MODEL]


def test_a_preemption_of_the_launcher_after_periodic_saves_saves_a_verified_checkpoint_that_resumes_exactly(
        tmp_path):
    """torchrun stops its workers with killpg: the signal reaches every process of the group, and a helper that a
    save needs and dies with it breaks the pre-emption save (megatron-core's own writer spawns a Manager for its
    results: BrokenPipeError, a .tmp left, exit 143; ours writes on the trainer's threads). Periodic saves first, so
    that anything a save starts exists when the signal comes."""
    ckpt, steps = tmp_path / "ckpt", 40
    job = launch("launch/torchrun.sh", iters(steps) + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval",
                                                       "1", "--output-dir", str(tmp_path / "pre")], {"NPROC": "2"})
    pointer = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while not (pointer.exists() and int(pointer.read_text() or 0) >= 2):
        assert job.poll() is None and time.time() < deadline, "no two periodic saves: " + job.stdout.read()[-3000:]
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)  # the launcher itself (torchrun.sh execs it), as a scheduler signals it
    out = job.communicate(timeout=300)[0]
    assert job.returncode == 0, out[-4000:]
    assert "SIGTERM received; the workers saved and stopped; exit 0" in out and "Traceback" not in out, out[-4000:]
    saved = int(pointer.read_text())
    assert 2 < saved < steps, out[-4000:]  # the pre-emption's own save, after the periodic ones
    verify(str(ckpt / f"iter_{saved:07d}"))
    assert not [p for p in os.listdir(ckpt) if p.endswith(".tmp")], os.listdir(ckpt)

    finish([launch("launch/torchrun.sh", iters(steps) + ["--load", str(ckpt), "--output-dir", str(tmp_path / "resumed")],
                   {"NPROC": "2"})])
    finish([launch("launch/torchrun.sh", iters(steps) + ["--output-dir", str(tmp_path / "straight")], {"NPROC": "2"})])
    resumed, straight = metrics(tmp_path / "resumed"), metrics(tmp_path / "straight")
    assert sorted(resumed) == list(range(saved + 1, steps + 1))
    assert [resumed[s]["loss"] for s in resumed] == pytest.approx([straight[s]["loss"] for s in resumed], rel=1e-6)


def test_a_preemption_of_deepspeed_sh_gives_a_slow_save_its_grace_and_exits_zero(tmp_path):
    """DeepSpeed's own node launcher kills the workers 30 s after a SIGTERM and exits 1: a save that takes longer
    is lost. Through mega_depth.ds_launcher the workers get SAVE_GRACE_S (100 s) and the launch exits 0. The
    signal goes to the whole process group, as a scheduler's does; the save takes 35 s."""
    ckpt = tmp_path / "ckpt"
    env = dict(ENV, NGPUS="2", MEGA_DEPTH_FAULT_SLOW_SAVE_S="35")
    job = subprocess.Popen(["bash", "launch/deepspeed.sh", "--deepspeed-config", "launch/ds_configs/zero1.json"]
                           + iters(1000) + ["--log-interval", "1", "--save", str(ckpt), "--output-dir",
                                            str(tmp_path / "run")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    path = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (path.exists() and len(path.read_text().splitlines()) >= 2):
        assert job.poll() is None and time.time() < deadline, "training did not start: " + job.stdout.read()[-3000:]
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGTERM)
    out = job.communicate(timeout=300)[0]
    assert job.returncode == 0, out[-4000:]
    assert "SIGTERM received; the workers saved and stopped; exit 0" in out and "Traceback" not in out, out[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2, out[-4000:]
    verify(str(ckpt / f"iter_{saved:07d}"))
