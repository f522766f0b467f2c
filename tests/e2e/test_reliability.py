"""Operator mistakes that must not lose a run or silently change it:

- two runs on one --save folder: the second is refused (every backend, and convert_from_hf), the first's
  checkpoints stay byte-identical; a lock whose holder is gone is taken over; a holder whose lock was deleted,
  overwritten or taken over while it was frozen stops with one line before it writes again;
- a run killed during its first save can be resubmitted;
- a full disk during a save says so and keeps the previous checkpoint;
- a resume with another global batch size continues after the last consumed sample;
- DeepSpeed resumes at another ZeRO stage or data-parallel size with equal losses (universal checkpoint), or
  refuses in one line; ZeRO-0 reports a real grad norm;
- a Megatron run's saves start no process beside the trainer (megatron-core forks a writer a bucket and spawns
  a Manager): a kill -9 leaves nothing behind, and the write itself runs on a thread of the trainer.
"""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from fixtures import ENV, PY, ROOT, SCRIPTS, TRAIN_MODEL, metrics, run, torchrun
from mega_depth.checkpoint import rules
from mega_depth.checkpoint.lock import LOCK
from mega_depth.checkpoint.manifest import verify

MEGATRON = ["-m", "mega_depth.train"]
DEEPSPEED = MEGATRON + ["--deepspeed", "--deepspeed-config"]
PLAIN = ["-m", "mega_depth.xla.train", "--device", "cpu"]


def flags(data, *extra):
    """The training-stack model on the test corpus; `extra` last (argparse keeps the last of a repeated flag)."""
    return TRAIN_MODEL + data["flags"] + ["--no-tensorboard", "--lr-decay-iters", "6"] + list(extra)


def snapshot(folder):
    """Every file under `folder` with the hash of its bytes."""
    out = {}
    for d, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(d, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def plant_lock(folder, pid, host=None):
    """A lock file as a run of `pid` on `host` writes it."""
    os.makedirs(folder, exist_ok=True)
    holder = {"run_id": "holder-run", "host": host or socket.gethostname(), "pid": pid, "purpose": "training",
              "started": time.time(), "token": "planted"}
    with open(os.path.join(folder, LOCK), "w") as f:
        json.dump(holder, f)


def wait_for(predicate, proc, what, timeout=300, output=None):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {(output or proc.stdout.read)()[-3000:]}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_second_run_on_a_held_save_folder_is_refused_and_the_first_runs_checkpoints_stay_byte_identical(
        data, tmp_path):
    """A requeued job overlapping its predecessor: both on --save X --load X."""
    ckpt = tmp_path / "ckpt"
    job = MEGATRON + flags(data, "--train-iters", "500", "--lr-decay-iters", "500", "--save", str(ckpt), "--load",
                           str(ckpt), "--save-interval", "2", "--keep-last", "2")
    first = subprocess.Popen([PY] + job + ["--output-dir", str(tmp_path / "first")], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (ckpt / "latest_checkpointed_iteration.txt").exists(), first, "its first checkpoint")
        first.send_signal(signal.SIGSTOP)  # alive and holding the folder, but writing nothing while we compare
        time.sleep(0.5)
        before = snapshot(ckpt)
        second = run(job + ["--output-dir", str(tmp_path / "second")], expect=2)
        assert "is in use by run" in second.stderr and f"(pid {first.pid} on host {socket.gethostname()}" \
            in second.stderr, second.stderr[-2000:]
        assert "two runs must not save into one folder" in second.stderr and "Traceback" not in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        assert snapshot(ckpt) == before
        assert not (tmp_path / "second" / "metrics.jsonl").exists()
    finally:
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=300)
    assert first.returncode == 0 and "SIGTERM" in out, out[-3000:]
    assert not (ckpt / LOCK).exists()  # released at the end


def test_every_backend_and_the_import_respect_the_lock_and_take_over_a_gone_holder(data, tmp_path):
    # a lock whose process is gone (this host): the plain backend takes it over and trains
    src = tmp_path / "src"
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    plant_lock(src, dead.pid)
    proc = run(PLAIN + flags(data, "--train-iters", "2", "--save", str(src), "--output-dir", str(tmp_path / "run")))
    assert f"took over the lock of run holder-run (pid {dead.pid}" in proc.stdout and "is gone" in proc.stdout
    assert (src / "latest_checkpointed_iteration.txt").read_text() == "2" and not (src / LOCK).exists()
    # a live holder (this test's own process): DeepSpeed, the plain backend and convert_from_hf are refused
    held = tmp_path / "held"
    plant_lock(held, os.getpid())
    for args in (DEEPSPEED + ["launch/ds_configs/zero1.json"] + flags(data, "--train-iters", "2", "--save", str(held)),
                 PLAIN + flags(data, "--train-iters", "2", "--save", str(held)),
                 ["tools/convert_from_hf.py", "--hf", str(src), "--save", str(held), "--force"]):
        proc = run(args + (["--output-dir", str(tmp_path / "refused")] if "--train-iters" in args else []), expect=2)
        assert f"is in use by run holder-run (pid {os.getpid()}" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert os.listdir(held) == [LOCK] and not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_a_holder_that_lost_its_lock_stops_with_one_line_before_it_writes_again(data, tmp_path):
    env = dict(ENV, MEGA_DEPTH_LOCK_HEARTBEAT_S="0.3", MEGA_DEPTH_LOCK_STALE_S="3")

    def start(name, ckpt):
        log = open(tmp_path / f"{name}.txt", "w")
        job = PLAIN + flags(data, "--train-iters", "100000", "--lr-decay-iters", "100000", "--save", str(ckpt),
                            "--load", str(ckpt), "--save-interval", "1", "--output-dir", str(tmp_path / name))
        return subprocess.Popen([PY] + job, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def output(name):
        return (tmp_path / f"{name}.txt").read_text()

    def stopped_without_writing(proc, name, ckpt, reason):
        assert proc.wait(timeout=120) == 2, output(name)[-3000:]
        out = output(name)
        assert "this run no longer holds the folder's lock" in out and reason in out and "Traceback" not in out, \
            out[-3000:]
        assert "is intact" in out
        verify(str(ckpt / f"iter_{rules.read_pointer(str(ckpt)):07d}"))

    for name, damage, reason in (("deleted", lambda lock: lock.unlink(), "was deleted"),
                                 ("garbage", lambda lock: lock.write_text("\x00 not json"), "unreadable")):
        ckpt = tmp_path / name / "ckpt"
        proc = start(name, ckpt)
        wait_for(lambda: (ckpt / "latest_checkpointed_iteration.txt").exists(), proc, "its first checkpoint",
                 output=lambda: output(name))
        damage(ckpt / LOCK)
        stopped_without_writing(proc, name, ckpt, reason)

    # frozen past the stale limit: a requeued run takes the folder over; the old one, resumed, stops
    ckpt = tmp_path / "frozen" / "ckpt"
    first = start("first", ckpt)
    wait_for(lambda: (ckpt / "latest_checkpointed_iteration.txt").exists(), first, "its first checkpoint",
             output=lambda: output("first"))
    first.send_signal(signal.SIGSTOP)
    time.sleep(3.5)  # its heartbeat goes stale
    second = start("second", ckpt)
    try:
        wait_for(lambda: "took over the lock" in output("second") and (tmp_path / "second" / "metrics.jsonl").exists(),
                 second, "the takeover", output=lambda: output("second"))
        first.send_signal(signal.SIGCONT)
        stopped_without_writing(first, "first", ckpt, "now names run")
    finally:
        first.send_signal(signal.SIGCONT)
        second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=120) == 0, output("second")[-3000:]


def test_a_run_killed_during_its_first_save_can_be_resubmitted(data, tmp_path):
    ckpt = tmp_path / "ckpt"
    job = MEGATRON + flags(data, "--train-iters", "4", "--lr-decay-iters", "4", "--save", str(ckpt), "--load",
                           str(ckpt), "--save-interval", "2", "--output-dir", str(tmp_path / "run"))
    run(job, expect=-signal.SIGKILL, env={"MEGA_DEPTH_FAULT_KILL_IN_SAVE": "2"})
    assert sorted(os.listdir(ckpt)) == [LOCK, "iter_0000002.tmp"]  # a dead run's lock and its half save
    proc = run(job)  # the resubmission, unchanged
    assert "took over the lock of run" in proc.stdout
    assert "holds only an interrupted save (iter_0000002.tmp), no checkpoint: starting from scratch (removed it)" \
        in proc.stdout
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert sorted(metrics(tmp_path / "run")) == [1, 2, 3, 4]


def test_a_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(data, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run(MEGATRON + flags(data, "--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                                "--output-dir", str(tmp_path / "run")),
               expect=2, env={"MEGA_DEPTH_FAULT_DISK_FULL_IN_SAVE": "2"})
    assert "mega_depth: the disk is full: saving into" in proc.stderr and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert " free, and the last checkpoint took " in line and "checkpoint iter_0000001 is intact" in line, line
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    verify(str(ckpt / "iter_0000001"))


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs (CI runs as root); skipped where this machine does not allow mounting one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here ({mounted.stderr.decode().strip()[:80]}); the injected "
                    "ENOSPC test covers the same path")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(disk, leave):
    """Fill `disk` until `leave` bytes are free."""
    free = shutil.disk_usage(disk).free
    filler = disk / "filler"
    with open(filler, "ab") as f:
        f.write(b"\0" * max(free - leave, 0))
    return filler


@pytest.mark.parametrize("trainer", ["megatron", "plain"])
def test_a_real_full_disk_is_one_line_and_the_previous_checkpoint_resumes(data, tmp_path, small_disk, trainer):
    entry = MEGATRON if trainer == "megatron" else PLAIN
    ckpt = small_disk / "ckpt"
    job = entry + flags(data, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1", "--overwrite-output-dir",
                        "--output-dir", str(tmp_path / "run"))
    run(job + ["--train-iters", "1"])
    filler = _fill(small_disk, leave=64 * 1024)  # the lock fits; the next checkpoint does not
    proc = run(job + ["--train-iters", "3"], expect=2)
    assert "the disk is full: saving into" in proc.stderr and "checkpoint iter_0000001 is intact" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]  # no .tmp, no lock
    verify(str(ckpt / "iter_0000001"))
    # full before the run starts: the lock cannot be written, and no empty lock is left behind
    _fill(small_disk, leave=0)
    proc = run(job + ["--train-iters", "3"], expect=2)
    assert "its lock file" in proc.stderr and "No space left on device" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (ckpt / LOCK).exists()
    filler.unlink()  # space freed: the run resumes from the checkpoint before the failed save
    proc = run(job + ["--train-iters", "3"])
    assert "resumed from" in proc.stdout and "iter_0000001" in proc.stdout
    assert rules.read_pointer(str(ckpt)) == 3


def test_a_resume_with_a_larger_global_batch_reads_every_sample_once_and_counts_the_tokens_it_trained(data,
                                                                                                     tmp_path):
    """Three steps of 4 samples, then two of 8 from the checkpoint: samples 0..27, each read once; the metrics
    count consumed samples and the tokens trained on (Megatron-LM's consumed-samples rule)."""
    record = str(tmp_path / "samples")
    script = [os.path.join(SCRIPTS, "record_samples.py")]
    common = ["--save", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "run"), "--heatmap-interval", "1000",
              "--lr-decay-iters", "5"]
    run(script + flags(data, "--train-iters", "3", "--global-batch-size", "4", *common), env={"RECORD_SAMPLES": record})
    proc = run(script + flags(data, "--train-iters", "5", "--global-batch-size", "8", "--load", str(tmp_path / "ckpt"),
                              *common), env={"RECORD_SAMPLES": record})
    assert "at step 3 (12 samples consumed)" in proc.stdout
    seen = sorted(int(line) for line in open(record + ".rank0"))
    assert seen == list(range(28)), seen
    m = metrics(tmp_path / "run")
    assert [m[s]["consumed_samples"] for s in range(1, 6)] == [4, 8, 12, 20, 28]
    assert [m[s]["tokens"] for s in range(1, 6)] == [n * 32 for n in (4, 8, 12, 20, 28)]  # --seq-length 32


@pytest.fixture(scope="module")
def dp2(data, tmp_path_factory):
    """dp2(stage): six steps at that ZeRO stage on two data-parallel ranks, saving at steps 3 and 6 (the reference
    and the source; made once per stage)."""
    made = {}

    def source(stage):
        if stage not in made:
            d = tmp_path_factory.mktemp(f"{stage}_dp2")
            torchrun(2, DEEPSPEED + [f"launch/ds_configs/{stage}.json"] + flags(
                data, "--train-iters", "6", "--save", str(d / "ckpt"), "--save-interval", "3",
                "--output-dir", str(d / "run")), str(d / "log"))
            made[stage] = d
        return made[stage]

    return source


@pytest.mark.parametrize("source, target", [("zero1", "zero3"), ("zero1", "zero1"), ("zero3", "zero2")])
def test_deepspeed_resumes_at_another_zero_stage_or_data_parallel_size_with_equal_losses(dp2, data, tmp_path,
                                                                                         source, target):
    """A checkpoint of 2 data-parallel ranks resumed on 1, at another ZeRO stage or the same, through DeepSpeed's
    universal checkpoint: the losses after the resume equal the uninterrupted run's."""
    d = dp2(source)
    proc = run(DEEPSPEED + [f"launch/ds_configs/{target}.json"] + flags(
        data, "--train-iters", "6", "--load", str(d / "ckpt" / "iter_0000003"), "--output-dir", str(tmp_path / "run")))
    moved = f"ZeRO-{source[-1]} at data-parallel size 2 -> ZeRO-{target[-1]} at 1"
    assert f"resharded {d / 'ckpt' / 'iter_0000003'} through DeepSpeed's universal checkpoint ({moved})" in proc.stdout
    ref, resumed = metrics(d / "run"), metrics(tmp_path / "run")
    assert [resumed[s]["loss"] for s in (4, 5, 6)] == [ref[s]["loss"] for s in (4, 5, 6)]
    assert not [n for n in os.listdir(d / "ckpt") if n.startswith(".universal-")]  # the conversion is gone


def test_deepspeed_zero0_resume_of_a_sharded_checkpoint_is_refused_and_its_grad_norm_is_real(dp2, data, tmp_path):
    zero1_dp2 = dp2("zero1")
    zero0 = DEEPSPEED + ["launch/ds_configs/zero0.json"]
    proc = run(zero0 + flags(data, "--train-iters", "6", "--lr-decay-iters", "6", "--load",
                             str(zero1_dp2 / "ckpt" / "iter_0000003"), "--output-dir", str(tmp_path / "refused")),
               expect=2)
    assert "DeepSpeed's universal checkpoint converts between ZeRO stages 1-3 only" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # ZeRO-0 steps a plain optimizer: its grad norm is measured, and equals ZeRO-1's on the same batch
    run(zero0 + flags(data, "--train-iters", "1", "--lr-decay-iters", "6", "--output-dir", str(tmp_path / "run")))
    norm, ref = metrics(tmp_path / "run")[1]["grad_norm"], metrics(zero1_dp2 / "run")[1]["grad_norm"]
    assert norm == pytest.approx(ref, rel=1e-5)


def test_kill_9_of_a_megatron_run_leaves_no_checkpoint_writer_behind(data, tmp_path):
    """Saves every step start no process beside the trainer (megatron-core's own writer forks one a bucket and
    spawns a Manager, which a kill -9 left behind): after a kill -9 nothing of the run is left."""
    psutil = pytest.importorskip("psutil")
    ckpt = tmp_path / "ckpt"
    # Output to a file: a helper that outlived the kill would hold a pipe open and hang the read.
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen([PY] + MEGATRON + flags(data, "--train-iters", "500", "--lr-decay-iters", "500",
                                                        "--save", str(ckpt), "--save-interval", "1",
                                                        "--output-dir", str(tmp_path / "run")),
                                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True)
    pointer = ckpt / "latest_checkpointed_iteration.txt"
    seen = set()
    try:
        wait_for(lambda: pointer.exists() and int(pointer.read_text() or 0) >= 2, proc, "two checkpoints",
                 output=lambda: (tmp_path / "out.txt").read_text())
        trainer = psutil.Process(proc.pid)
        for _ in range(50):  # over further saves: any helper a save started would be a child while it writes
            seen.update(trainer.children(recursive=True))
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert not seen, [_cmdline(h)[:120] for h in seen]


def test_a_dist_checkpoint_write_runs_on_a_thread_of_the_trainer(tmp_path):
    """megatron-core forks a writer a bucket; here the write runs in the trainer, with no process beside it."""
    psutil = pytest.importorskip("psutil")
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen([PY, os.path.join(SCRIPTS, "save_with_a_blocked_writer.py"), str(tmp_path)],
                                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: (tmp_path / "writer.json").exists(), proc, "the write's start",
             output=lambda: (tmp_path / "out.txt").read_text())
    writer = json.loads((tmp_path / "writer.json").read_text())
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait(timeout=60)
    assert writer["pid"] == proc.pid and writer["thread"].startswith("dist-ckpt-writer"), writer
    assert not children, [_cmdline(h)[:120] for h in children]


def _cmdline(process) -> str:
    try:
        return " ".join(process.cmdline())
    except Exception:  # gone meanwhile
        return ""


def test_a_second_run_into_an_output_dir_keeps_the_first_runs_metrics(data, tmp_path):
    out = tmp_path / "run"
    job = PLAIN + flags(data, "--train-iters", "3", "--output-dir", str(out))
    run(job)
    before = (out / "metrics.jsonl").read_text()
    proc = run(job, expect=2)  # a new run (not a resume of the first): refused before it writes anything
    assert f"--output-dir {out} holds the metrics of run " in proc.stderr and "--overwrite-output-dir" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert (out / "metrics.jsonl").read_text() == before
    run(job + ["--overwrite-output-dir"])  # asked for: replaced
    assert sorted(metrics(out)) == [1, 2, 3]
    # the same job resubmitted (same --save) continues in its folder; a resume appends after its step
    ckpt = tmp_path / "ckpt"
    resumable = PLAIN + flags(data, "--save", str(ckpt), "--load", str(ckpt), "--output-dir", str(tmp_path / "job"))
    run(resumable + ["--train-iters", "2"])
    run(resumable + ["--train-iters", "3"])
    assert sorted(metrics(tmp_path / "job")) == [1, 2, 3]


def test_extending_a_run_takes_the_new_schedule_only_when_asked_and_says_when_steps_would_train_at_lr_0(
        data, tmp_path):
    ckpt = tmp_path / "ckpt"
    job = PLAIN + flags(data, "--save", str(ckpt), "--load", str(ckpt), "--overwrite-output-dir", "--output-dir",
                        str(tmp_path / "run"))
    run(job + ["--train-iters", "4", "--lr-decay-iters", "4"])
    proc = run(job + ["--train-iters", "8", "--lr-decay-iters", "8"], expect=2)  # the schedule changed: one line
    assert "the learning-rate schedule of this run differs from checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert "--override-opt-param-scheduler" in proc.stderr and "Traceback" not in proc.stderr
    # the checkpoint's schedule kept: its decay ended at step 4, so the new steps would train at lr 0
    proc = run(job + ["--train-iters", "5", "--lr-decay-iters", "8", "--use-checkpoint-opt_param-scheduler"])
    assert "steps 5..5 train at lr 0" in proc.stdout and metrics(tmp_path / "run")[5]["lr"] == 0.0
    # Megatron-LM's flag: this run's schedule, decaying over the longer run
    run(job + ["--train-iters", "8", "--lr-decay-iters", "8", "--override-opt_param-scheduler"])
    lrs = {s: r["lr"] for s, r in metrics(tmp_path / "run").items()}
    assert sorted(lrs) == list(range(1, 9)) and all(lrs[s] > 0 for s in (6, 7))
