"""The training stack end to end on CPU: tokenizer -> preprocess -> train -> checkpoint, exact resume, SIGTERM,
a kill during a save, resharding between layouts, the DeepSpeed launcher, and clear errors on bad input."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import CORPUS, ENV, PY, ROOT, free_port, run, torchrun
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--residual", "attnres", "--attnres-num-blocks", "2", "--log-interval", "5"]


def metrics(path):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def baseline(data, tmp_path_factory):
    """20 uninterrupted steps with checkpoints at 10 and 20, evaluation and TensorBoard."""
    d = tmp_path_factory.mktemp("baseline")
    run(["-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "20", "--save", str(d / "ckpt"), "--save-interval", "10", "--eval-interval", "10",
        "--eval-iters", "2", "--output-dir", str(d / "run")])
    return d


def test_end_to_end_tokenizer_preprocess_train_checkpoint(data, baseline):
    assert os.path.getsize(str(data["dir"] / "docs.bin")) > 1_000_000
    m = metrics(baseline / "run")
    assert sorted(m) == list(range(1, 21))
    assert m[20]["loss"] < m[1]["loss"] - 0.2
    assert {"val_loss", "val_ppl"} <= set(m[10]) and m[20]["val_loss"] < m[10]["val_loss"]
    assert sorted(os.listdir(baseline / "ckpt")) == ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt"]
    assert open(baseline / "ckpt" / "latest_checkpointed_iteration.txt").read() == "20"
    meta = json.load(open(baseline / "ckpt" / "iter_0000020" / "mega_depth.json"))
    assert meta["step"] == 20 and meta["config"]["residual"]["residual"] == "attnres"
    assert glob.glob(str(baseline / "run" / "heatmaps" / "*.png"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(baseline / "run" / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/perplexity", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                "perf/memory_gb", "val/loss"):
        assert tag in events.Tags()["scalars"], tag
    assert len(events.Scalars("train/loss")) == 20


def test_exact_resume_after_stopping_at_step_10(data, baseline, tmp_path):
    run(["-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "20", "--save", str(tmp_path / "ckpt"), "--exit-interval", "10",
        "--output-dir", str(tmp_path / "first")])
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read() == "10"
    run(["-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "20", "--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "second")])
    ref, resumed = metrics(baseline / "run"), metrics(tmp_path / "second")
    assert sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        assert resumed[step]["loss"] == ref[step]["loss"], step  # bitwise on CPU


def test_sigterm_saves_and_exits_then_resumes_exactly(data, baseline, tmp_path):
    cmd = [PY, "-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "200", "--lr-decay-iters", "20", "--save", str(tmp_path / "ckpt"),
        "--output-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (path.exists() and len(path.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "exiting after step" in out and "SIGTERM" in out
    saved = int(open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read())
    assert 3 <= saved < 20
    run(["-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "20", "--lr-decay-iters", "20", "--load", str(tmp_path / "ckpt"),
        "--output-dir", str(tmp_path / "resumed")])
    ref, resumed = metrics(baseline / "run"), metrics(tmp_path / "resumed")
    assert [resumed[s]["loss"] for s in range(saved + 1, 21)] == [ref[s]["loss"] for s in range(saved + 1, 21)]


def test_kill_during_save_keeps_the_previous_checkpoint(data, tmp_path):
    proc = run(["-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "10", "--save", str(tmp_path / "ckpt"), "--save-interval", "5",
        "--output-dir", str(tmp_path / "run")], expect=None, env={"MEGA_DEPTH_FAULT_KILL_IN_SAVE": "10"})
    assert proc.returncode == -signal.SIGKILL
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read() == "5"
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000010.tmp")  # the partial save, never named by the pointer
    out = run(["-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "10", "--exit-interval", "6", "--load", str(tmp_path / "ckpt"),
        "--output-dir", str(tmp_path / "again")]).stdout
    assert "at step 5" in out and sorted(metrics(tmp_path / "again")) == [6]


def test_checkpoints_reshard_between_tp2xpp2_and_one_process(data, tmp_path):
    flags = MODEL + data["flags"] + ["--residual", "dca", "--dca-last-k", "1", "--num-layers", "4",
                                     "--train-iters", "11"]
    big = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    # TP2 x PP2 -> 1 process
    torchrun(4, ["-m", "mega_depth.train"] + flags + big + ["--save", str(tmp_path / "a"), "--save-interval", "10",
                                                            "--output-dir", str(tmp_path / "a-run")],
             str(tmp_path / "a.log"))
    shutil.rmtree(tmp_path / "a" / "iter_0000011")
    run(["-m", "mega_depth.train"] + flags + ["--load", str(tmp_path / "a" / "iter_0000010"),
                                              "--output-dir", str(tmp_path / "a-resumed")])
    assert metrics(tmp_path / "a-resumed")[11]["loss"] == pytest.approx(metrics(tmp_path / "a-run")[11]["loss"],
                                                                        rel=1e-5)
    # 1 process -> TP2 x PP2
    run(["-m", "mega_depth.train"] + flags + ["--save", str(tmp_path / "b"), "--save-interval", "10",
                                              "--output-dir", str(tmp_path / "b-run")])
    torchrun(4, ["-m", "mega_depth.train"] + flags + big + ["--load", str(tmp_path / "b" / "iter_0000010"),
                                                            "--output-dir", str(tmp_path / "b-resumed")],
             str(tmp_path / "b.log"))
    assert metrics(tmp_path / "b-resumed")[11]["loss"] == pytest.approx(metrics(tmp_path / "b-run")[11]["loss"],
                                                                        rel=1e-5)


def test_deepspeed_launcher_trains_two_processes_and_resumes(tmp_path):
    ds = os.path.join(os.path.dirname(PY), "deepspeed")
    common = ["--master_port", "0", "--num_gpus", "2", "--module", "mega_depth.train", "--deepspeed",
              "--deepspeed-config", os.path.join(ROOT, "launch", "ds_configs", "zero2.json"), "--mock-data",
              "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
              "--save-interval", "2"]
    env = dict(ENV, DS_ACCELERATOR="cpu")

    def launch(extra):
        cmd = [ds] + common + extra
        cmd[2] = str(free_port())
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    launch(["--save", str(tmp_path / "full"), "--output-dir", str(tmp_path / "full-run")])
    launch(["--save", str(tmp_path / "ckpt"), "--exit-interval", "2", "--output-dir", str(tmp_path / "first")])
    launch(["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "second")])
    ref, first, second = (metrics(tmp_path / n) for n in ("full-run", "first", "second"))
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    assert [second[s]["loss"] for s in (3, 4)] == pytest.approx([ref[s]["loss"] for s in (3, 4)], rel=1e-6)


@pytest.mark.parametrize("case", ["missing-idx", "corrupt-idx", "truncated-bin", "tokenizer-mismatch",
                                  "other-mechanism", "other-shape", "unknown-config-key", "missing-checkpoint"])
def test_bad_input_gets_a_clear_error(data, baseline, tmp_path, case):
    d = data["dir"]
    flags = MODEL + data["flags"] + ["--train-iters", "4", "--output-dir", str(tmp_path / "run")]
    expected = {
        "missing-idx": "does not exist; build",
        "corrupt-idx": "is not a Megatron indexed-dataset index",
        "truncated-bin": "truncated or mismatched",
        "tokenizer-mismatch": "the data was made with another tokenizer",
        "other-mechanism": "--residual: checkpoint 'attnres', this run 'dca'",
        "other-shape": "--hidden-size: checkpoint 32, this run 64",
        "unknown-config-key": "unknown key model.num_layer",
        "missing-checkpoint": "holds no checkpoint",
    }[case]
    if case in ("missing-idx", "corrupt-idx", "truncated-bin"):
        prefix = tmp_path / "copy"
        shutil.copy(d / "docs.bin", str(prefix) + ".bin")
        shutil.copy(d / "docs.idx", str(prefix) + ".idx")
        if case == "missing-idx":
            os.remove(str(prefix) + ".idx")
        elif case == "corrupt-idx":
            with open(str(prefix) + ".idx", "r+b") as f:
                f.write(b"GARBAGE!!")
        else:
            with open(str(prefix) + ".bin", "r+b") as f:
                f.truncate(os.path.getsize(str(prefix) + ".bin") - 10)
        flags += ["--data-path", str(prefix)]
    elif case == "tokenizer-mismatch":
        run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "700", "--output-prefix",
             str(tmp_path / "small")])
        flags += ["--tokenizer-model", str(tmp_path / "small.model")]
    elif case == "other-mechanism":
        flags += ["--residual", "dca", "--load", str(baseline / "ckpt")]
    elif case == "other-shape":
        flags += ["--hidden-size", "64", "--load", str(baseline / "ckpt")]
    elif case == "unknown-config-key":
        (tmp_path / "c.yaml").write_text("model:\n  num_layer: 4\n")
        flags += ["--config", str(tmp_path / "c.yaml")]
    else:
        os.makedirs(tmp_path / "empty")
        flags += ["--load", str(tmp_path / "empty")]
    proc = run(["-m", "mega_depth.train"] + flags, expect=2)
    assert expected in proc.stderr, proc.stderr[-3000:]
    if case == "unknown-config-key":
        assert "did you mean model.num_layers?" in proc.stderr


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss_is_handled_as_configured(data, tmp_path, policy):
    args = ["-m", "mega_depth.train"] + MODEL + data["flags"] + [
        "--train-iters", "5", "--on-nan", policy, "--output-dir", str(tmp_path / "run")]
    proc = run(args, expect=3 if policy == "stop" else 0, env={"MEGA_DEPTH_FAULT_NAN_AT_STEP": "3"})
    m = metrics(tmp_path / "run")
    if policy == "stop":
        assert "loss is nan at step 3; stopping (--on-nan stop)" in proc.stderr
        assert sorted(m) == [1, 2]
    else:
        assert sorted(m) == [1, 2, 3, 4, 5] and m[3].get("skipped") and not m[4].get("skipped")
        assert "skipped (non-finite loss)" in proc.stdout


def test_every_shipped_config_validates(data):
    from mega_depth.config import parse_args

    for path in sorted(glob.glob(os.path.join(ROOT, "launch", "configs", "*.yaml"))):
        cfg = parse_args(["--config", path, "--tokenizer-model", str(data["dir"] / "spm.model")]
                         + ([] if "tiny" in path else ["--data-path", "x"]))
        cfg.model.vocab_size = 32000
        p = cfg.parallel
        cfg.validate(p.tensor_model_parallel_size * p.pipeline_model_parallel_size * 2)


def test_smoke_test_tool_passes_on_cpu(tmp_path):
    out = run(["tools/smoke_test.py", "--steps", "4", "--hidden-size", "32", "--seq-length", "32",
               "--num-layers", "2", "--out", str(tmp_path / "smoke.json")]).stdout
    results = json.load(open(tmp_path / "smoke.json"))["results"]
    assert [r["mechanism"] for r in results] == ["standard", "attnres-full", "attnres-block", "dca", "dca-2",
                                                 "depth-attention"]
    assert all(r["ok"] for r in results) and "peak MiB" in out
