"""The same behaviour on every backend (Megatron-core, DeepSpeed, plain/XLA-eager): the one training loop's rules.

- exact resume after --exit-interval, and keep-last pruning (only this run's newest checkpoints stay);
- SIGTERM saves, exits 0 and resumes exactly; one during a periodic save stops on that save, one during the
  start-up before the first step;
- a NaN loss stops the run (exit 3) or skips the update: the weights after the skipped step are the weights
  before it, bit for bit, and the next step updates again.
"""

import os
import signal
import subprocess
import time

import pytest
import torch

from fixtures import ENV, PY, ROOT, TRAIN_MODEL, metrics, run

BACKENDS = {
    "megatron": ["-m", "mega_depth.train"],
    # ZeRO-1: DeepSpeed's own overflow check skips the update; ZeRO-0 in fp32 has none (the backend skips it)
    "deepspeed": ["-m", "mega_depth.train", "--deepspeed", "--deepspeed-config", "launch/ds_configs/zero1.json"],
    "deepspeed-zero0": ["-m", "mega_depth.train", "--deepspeed", "--deepspeed-config", "launch/ds_configs/zero0.json"],
    "plain": ["-m", "mega_depth.xla.train", "--device", "cpu"],
}
# with dropout on both the hidden states and the attention probabilities, so that an exact resume needs every
# generator a backend draws from (the default one, and Megatron's model-parallel tracker) saved and restored
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
STEPS = ["--train-iters", "12", "--lr-decay-iters", "12", "--no-tensorboard"] + DROPOUT


def command(backend, data, *extra):
    return BACKENDS[backend] + TRAIN_MODEL + data["flags"] + list(extra)


def weights(ckpt_dir):
    from mega_depth.checkpoint.rules import read_meta
    from mega_depth.checkpoint.weights import canonical_weights

    return canonical_weights(str(ckpt_dir), read_meta(str(ckpt_dir)))[0]


@pytest.fixture(scope="module", params=["megatron", "deepspeed", "plain"])
def reference(request, data, tmp_path_factory):
    """Twelve uninterrupted steps, saving every step with --keep-last 2."""
    d = tmp_path_factory.mktemp(request.param)
    run(command(request.param, data, *STEPS, "--save", str(d / "ckpt"), "--save-interval", "1", "--keep-last", "2",
                "--output-dir", str(d / "run")))
    return request.param, d


def test_keep_last_keeps_this_runs_newest_checkpoints(reference):
    _, d = reference
    assert sorted(os.listdir(d / "ckpt")) == ["iter_0000011", "iter_0000012", "latest_checkpointed_iteration.txt"]
    assert (d / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert sorted(metrics(d / "run")) == list(range(1, 13))


def test_exact_resume_after_exit_interval(reference, data, tmp_path):
    backend, d = reference
    out = run(command(backend, data, *STEPS, "--save", str(tmp_path / "ckpt"), "--exit-interval", "3",
                      "--output-dir", str(tmp_path / "run"))).stdout
    assert "exiting after step 3 (--exit-interval)" in out
    out = run(command(backend, data, *STEPS, "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt"),
                      "--output-dir", str(tmp_path / "run"))).stdout
    assert "at step 3" in out
    ref, resumed = metrics(d / "run"), metrics(tmp_path / "run")
    assert sorted(resumed) == list(range(1, 13))  # one record per step: the resumed run does not duplicate steps
    assert [resumed[s]["loss"] for s in range(1, 13)] == [ref[s]["loss"] for s in range(1, 13)]  # bitwise on CPU


def test_sigterm_saves_exits_zero_and_resumes_exactly(reference, data, tmp_path):
    backend, d = reference
    cmd = [PY] + command(backend, data, "--train-iters", "500", "--lr-decay-iters", "12", "--no-tensorboard", *DROPOUT,
                         "--save", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "run"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (path.exists() and len(path.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM" in out and "Traceback" not in out
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 12, saved
    run(command(backend, data, *STEPS, "--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "run")))
    ref, resumed = metrics(d / "run"), metrics(tmp_path / "run")
    assert [resumed[s]["loss"] for s in range(saved + 1, 13)] == [ref[s]["loss"] for s in range(saved + 1, 13)]


def test_a_sigterm_during_a_periodic_save_stops_on_that_save(data, tmp_path):
    """The one loop's rule, shown on the cheapest backend: a pre-emption that lands while step 4 saves stops there,
    rather than training step 5 and saving again inside the scheduler's grace period."""
    proc = run(command("plain", data, *STEPS, "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                       "--output-dir", str(tmp_path / "run")), env={"MEGA_DEPTH_FAULT_SIGTERM_IN_SAVE": "4"})
    assert "exiting after step 4 (SIGTERM)" in proc.stdout, proc.stdout[-3000:]
    assert sorted(metrics(tmp_path / "run")) == [1, 2, 3, 4]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000002", "iter_0000004",
                                                     "latest_checkpointed_iteration.txt"]


def test_a_sigterm_during_start_up_exits_before_the_first_step(data, tmp_path):
    """A pre-emption while the model builds: nothing is trained yet, so the run stops at once (exit 0) rather than
    spend the grace period on a step and a save; the --save folder's lock is released for the resubmission."""
    proc = run(command("plain", data, *STEPS, "--save", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "run")),
               env={"MEGA_DEPTH_FAULT_SIGTERM_IN_BUILD": "1"})
    assert "exiting before step 1 (SIGTERM during start-up): nothing trained, nothing saved" in proc.stdout, \
        proc.stdout[-3000:]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl") or not metrics(tmp_path / "run")
    assert os.listdir(tmp_path / "ckpt") == []  # no checkpoint, and no lock left behind


@pytest.mark.parametrize("backend", ["megatron", "deepspeed", "deepspeed-zero0", "plain"])
def test_nan_skip_really_skips_the_update_and_stop_stops(backend, data, tmp_path):
    fault = {"MEGA_DEPTH_FAULT_NAN_AT_STEP": "3"}
    proc = run(command(backend, data, "--lr-decay-iters", "12", "--train-iters", "4", "--on-nan", "skip", "--save",
                       str(tmp_path / "ckpt"), "--save-interval", "1", "--keep-last", "4", "--output-dir",
                       str(tmp_path / "skip")), env=fault)
    m = metrics(tmp_path / "skip")  # strict JSON: the NaN loss is null, and "nonfinite" says so
    assert sorted(m) == [1, 2, 3, 4] and m[3].get("skipped") and not m[4].get("skipped")
    assert m[3]["loss"] is None and m[3]["nonfinite"]["loss"] == "nan" and "nonfinite" not in m[4]
    assert "skipped (non-finite loss)" in proc.stdout
    before, after, later = (weights(tmp_path / "ckpt" / f"iter_000000{s}") for s in (2, 3, 4))
    assert all(torch.equal(before[k], after[k]) for k in before), "the skipped step changed the weights"
    assert any(not torch.equal(after[k], later[k]) for k in after), "the step after the skip did not update"
    assert m[4]["lr"] == m[3]["lr"]  # the schedule did not advance on the skipped step either
    proc = run(command(backend, data, *STEPS, "--on-nan", "stop", "--output-dir", str(tmp_path / "stop")),
               expect=3, env=fault)
    assert "loss is nan at step 3; stopping (--on-nan stop)" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(metrics(tmp_path / "stop")) == [1, 2]


def test_deepspeed_trains_the_compiled_layers_like_eager(data, tmp_path):
    """--compile-layers is applied where the model is built, so the DeepSpeed engine wraps the compiled layers:
    its losses equal the eager run's (inductor reassociates fp32 sums: ~1e-7)."""
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile-layers"])):
        out = run(command("deepspeed", data, "--train-iters", "3", "--log-interval", "1", "--no-tensorboard",
                          "--output-dir", str(tmp_path / name), *extra)).stdout
        # TRAIN_MODEL has 2 layers, each compiled whole
        assert ("--compile-layers: the 2 layers of rank 0 run compiled" in out) == bool(extra), out[-2000:]
        losses[name] = [metrics(tmp_path / name)[step]["loss"] for step in (1, 2, 3)]
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=1e-5, atol=1e-6)
    assert losses["eager"][-1] < losses["eager"][0]


def test_deepspeed_zero_trains_an_moe_model_like_megatron(data, tmp_path):
    """ZeRO data parallelism over an MoE model (Megatron's MoE layers in the DeepSpeed engine): with the
    load-balancing loss at its micro-batch scale and DeepSeek's expert-bias step, the losses are the Megatron
    backend's (two micro-batches per step). Step 2 is a skipped NaN step: its routed tokens still move the expert
    bias once, as Megatron's step does, and are not counted again by step 3's."""
    moe = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid",
           "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--micro-batch-size", "1",
           "--train-iters", "4", "--log-interval", "1", "--no-tensorboard", "--on-nan", "skip"]
    losses = {}
    for backend in ("megatron", "deepspeed"):
        run(command(backend, data, *moe, "--output-dir", str(tmp_path / backend)),
            env={"MEGA_DEPTH_FAULT_NAN_AT_STEP": "2"})
        assert metrics(tmp_path / backend)[2].get("skipped")
        losses[backend] = [metrics(tmp_path / backend)[step]["loss"] for step in (1, 3, 4)]
    torch.testing.assert_close(torch.tensor(losses["deepspeed"]), torch.tensor(losses["megatron"]), rtol=1e-5,
                               atol=1e-6)
    assert metrics(tmp_path / "deepspeed")[4]["moe_load_balancing_loss"] > 0
