"""The training stack end to end on CPU: tokenizer -> preprocess -> train -> checkpoint with evaluation,
TensorBoard and heatmaps; a kill during a save; resharding between layouts (TP x PP, CP); the DeepSpeed launcher; the smoke test;
the shipped configs; and a plain run's console output (no third-party warnings a user cannot act on)."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess

import pytest

from fixtures import ENV, PY, ROOT, TRAIN_MODEL, free_port, metrics, run, torchrun


@pytest.fixture(scope="module")
def baseline(data, tmp_path_factory):
    """20 uninterrupted steps with checkpoints at 10 and 20, evaluation and TensorBoard."""
    d = tmp_path_factory.mktemp("baseline")
    proc = run(["-m", "mega_depth.train"] + TRAIN_MODEL + data["flags"] + [
        "--train-iters", "20", "--save", str(d / "ckpt"), "--save-interval", "10", "--eval-interval", "10",
        "--eval-iters", "2", "--output-dir", str(d / "run")])
    (d / "stdout.txt").write_text(proc.stdout)
    (d / "stderr.txt").write_text(proc.stderr)
    return d


def test_end_to_end_tokenizer_preprocess_train_checkpoint(data, baseline):
    assert os.path.getsize(str(data["dir"] / "docs.bin")) > 1_000_000
    m = metrics(baseline / "run")
    assert sorted(m) == list(range(1, 21))
    assert m[20]["loss"] < m[1]["loss"] - 0.2
    assert {"val_loss", "val_ppl"} <= set(m[10]) and m[20]["val_loss"] < m[10]["val_loss"]
    assert sorted(os.listdir(baseline / "ckpt")) == ["iter_0000010", "iter_0000020",
                                                     "latest_checkpointed_iteration.txt"]
    assert open(baseline / "ckpt" / "latest_checkpointed_iteration.txt").read() == "20"
    meta = json.load(open(baseline / "ckpt" / "iter_0000020" / "mega_depth.json"))
    assert meta["step"] == 20 and meta["config"]["residual"]["mechanism"] == "attnres" and meta["format"] == "megatron"
    manifest = json.load(open(baseline / "ckpt" / "iter_0000020" / "manifest.json"))
    assert manifest["run_id"] == meta["run_id"] and "mega_depth.json" in manifest["files"]
    assert glob.glob(str(baseline / "run" / "heatmaps" / "attnres_step*.png"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(baseline / "run" / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/perplexity", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                "perf/memory_gb", "val/loss"):
        assert tag in events.Tags()["scalars"], tag
    assert len(events.Scalars("train/loss")) == 20


def test_a_plain_run_prints_only_what_a_user_can_act_on(baseline):
    """No third-party warnings or log noise: only the trainer's own lines on stdout and nothing on stderr."""
    stderr = (baseline / "stderr.txt").read_text()
    assert stderr.strip() == "", stderr[-3000:]
    lines = (baseline / "stdout.txt").read_text().splitlines()
    own = re.compile(r"step |saved checkpoint|depth-weight heatmaps|"  # and the start-up summary:
                     r"model: |  \d+ layers, hidden |  parameters |layout: |data: |evaluation: |outputs: |"
                     r"checkpoints: ")
    assert all(own.match(line) for line in lines), [line for line in lines if not own.match(line)]


def test_kill_during_save_keeps_the_previous_checkpoint(data, tmp_path):
    proc = run(["-m", "mega_depth.train"] + TRAIN_MODEL + data["flags"] + [
        "--train-iters", "10", "--save", str(tmp_path / "ckpt"), "--save-interval", "5",
        "--output-dir", str(tmp_path / "run")], expect=None, env={"MEGA_DEPTH_FAULT_KILL_IN_SAVE": "10"})
    assert proc.returncode == -signal.SIGKILL
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read() == "5"
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000010.tmp")  # the partial save, never named by the pointer
    out = run(["-m", "mega_depth.train"] + TRAIN_MODEL + data["flags"] + [
        "--train-iters", "10", "--exit-interval", "6", "--load", str(tmp_path / "ckpt"),
        "--output-dir", str(tmp_path / "again")]).stdout
    assert "at step 5" in out and sorted(metrics(tmp_path / "again")) == [6]


def resume_elsewhere(flags, tmp_path, name, saved_at=(1, []), resumed_at=(1, []), resumed_flags=None):
    """Train `flags` to step 11 at the layout `saved_at` = (processes, extra flags), saving at step 10, then resume
    that checkpoint at the layout `resumed_at` (with `resumed_flags` if given). Both runs' step-11 losses agree.
    Returns both runs' metrics."""
    def train(layout, extra, out, run_flags=flags):
        nproc, layout_flags = layout
        cmd = ["-m", "mega_depth.train"] + run_flags + layout_flags + extra + ["--output-dir", str(out)]
        if nproc > 1:
            torchrun(nproc, cmd, str(out) + ".log")
        else:
            run(cmd)

    ckpt = tmp_path / name
    train(saved_at, ["--save", str(ckpt), "--save-interval", "10"], tmp_path / f"{name}-run")
    train(resumed_at, ["--load", str(ckpt / "iter_0000010")], tmp_path / f"{name}-resumed", resumed_flags or flags)
    original, resumed = metrics(tmp_path / f"{name}-run"), metrics(tmp_path / f"{name}-resumed")
    assert min(resumed) == 11
    assert resumed[11]["loss"] == pytest.approx(original[11]["loss"], rel=1e-5)
    return original, resumed


def test_a_distributed_optimizer_resumes_exactly_reshards_over_dp_and_refuses_a_toggle(data, tmp_path):
    """--use-distributed-optimizer (every shipped config sets it) in bf16, without TE or apex: a run stopped after
    step 3 resumes with the uninterrupted run's losses bit for bit (the fp32 master weights, the Adam moments and
    each parameter's own step count came back: a step shared by all parameters would be counted once per parameter
    and move the losses from step 5 on); its checkpoint resumes at DP 2 with the same losses to rounding; a resume
    without the flag is refused in one line."""
    flags = ["-m", "mega_depth.train"] + TRAIN_MODEL + data["flags"] + [
        "--train-iters", "6", "--lr-decay-iters", "6", "--no-tensorboard", "--bf16", "--use-distributed-optimizer"]
    run(flags + ["--output-dir", str(tmp_path / "full")])
    run(flags + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "3", "--output-dir", str(tmp_path / "part")])
    run(flags + ["--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "resumed")])
    full, resumed = metrics(tmp_path / "full"), metrics(tmp_path / "resumed")
    assert min(resumed) == 4
    assert [resumed[s]["loss"] for s in (4, 5, 6)] == [full[s]["loss"] for s in (4, 5, 6)]
    torchrun(2, flags + ["--load", str(tmp_path / "ckpt" / "iter_0000003"), "--output-dir", str(tmp_path / "dp2")],
             str(tmp_path / "dp2.log"))
    dp2 = metrics(tmp_path / "dp2")
    assert [dp2[s]["loss"] for s in (4, 5, 6)] == pytest.approx([full[s]["loss"] for s in (4, 5, 6)], rel=1e-6)
    proc = run([f for f in flags if f != "--use-distributed-optimizer"] + [
        "--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "plain")], expect=2)
    assert "was saved with --use-distributed-optimizer, and this run's optimizer cannot read" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_checkpoints_reshard_between_tp2xpp2_and_one_process(data, tmp_path):
    flags = TRAIN_MODEL + data["flags"] + ["--residual", "dca", "--dca-last-k", "1", "--num-layers", "4",
                                           "--train-iters", "11"]
    big = (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    resume_elsewhere(flags, tmp_path, "a", saved_at=big)  # TP2 x PP2 -> 1 process
    resume_elsewhere(flags, tmp_path, "b", resumed_at=big)  # 1 process -> TP2 x PP2


def test_a_cp2_checkpoint_resumes_in_one_process_with_the_same_losses(data, tmp_path):
    """Checkpoints do not depend on context parallelism: a CP2 run's step-10 checkpoint, resumed by one process,
    gives the CP2 run's own step-11 loss (Depth-Attention: it gathers its mixed values)."""
    flags = TRAIN_MODEL + data["flags"] + ["--residual", "depth-attention", "--train-iters", "11"]
    resume_elsewhere(flags, tmp_path, "a", saved_at=(2, ["--context-parallel-size", "2"]))


def test_an_ep2xpp2_moe_run_logs_its_routing_and_resumes_in_one_process_with_the_same_losses(data, tmp_path):
    """Experts saved by 4 ranks (each stage's experts split over EP2 x DP2) resume at EP1 x PP1 in one process with
    the 4-rank run's step-11 loss; Block AttnRes with a dense first layer and the load-balancing loss on. The
    one-process run gives no model flags: --use-checkpoint-args builds the MoE model from the checkpoint alone. The run
    logs the routing at each log interval: the load-balancing loss and the load imbalance in metrics.jsonl, per
    layer in TensorBoard with a tokens-per-expert histogram that counts every routed token once (tokens x top-k),
    and the expert-load heatmap."""
    flags = TRAIN_MODEL + data["flags"] + ["--num-layers", "4", "--train-iters", "11", "--num-experts", "4",
                                           "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-aux-loss-coeff", "0.01"]
    big = (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    from_checkpoint = TRAIN_MODEL + data["flags"] + ["--train-iters", "11", "--moe-aux-loss-coeff", "0.01",
                                                     "--use-checkpoint-args"]  # 2 dense layers, the flags say
    original, resumed = resume_elsewhere(flags, tmp_path, "a", saved_at=big, resumed_flags=from_checkpoint)
    for step in (5, 10, 11):
        assert original[step]["moe_load_balancing_loss"] > 0 and original[step]["moe_load_max_over_mean"] >= 1
        assert resumed.get(step, {}).get("moe_load_balancing_loss", 1.0) > 0
    assert "moe_load_max_over_mean" not in original[4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "a-run" / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert {f"moe/load_balancing_loss/layer_{i}" for i in (1, 2, 3)} <= set(tags["scalars"])
    assert "moe/load_balancing_loss/layer_0" not in tags["scalars"]  # the dense first layer
    assert "moe/expert_load" in tags["images"]
    for layer in (1, 2, 3):
        routed = {e.step: e.histogram_value.num for e in events.Histograms(f"moe/tokens_per_expert/layer_{layer}")}
        assert routed == {5: 4 * 32 * 5 * 2, 10: 4 * 32 * 5 * 2, 11: 4 * 32 * 2}, routed  # batch x seq x steps x k
    assert glob.glob(str(tmp_path / "a-run" / "heatmaps" / "expert_load_step*.png"))
    # the integrity manifest covers every shard of the EP2 x PP2 checkpoint, the experts' included
    ckpt = tmp_path / "a" / "iter_0000010"
    listed = set(json.loads((ckpt / "manifest.json").read_text())["files"])
    shards = {os.path.relpath(os.path.join(folder, name), ckpt) for folder, _, names in os.walk(ckpt)
              for name in names if name != "manifest.json"}
    assert shards == listed and sum(name.endswith(".distcp") for name in listed) >= 4  # every rank wrote


def test_deepspeed_launcher_trains_two_processes_and_resumes(tmp_path):
    ds = os.path.join(os.path.dirname(PY), "deepspeed")
    common = ["--master_port", "0", "--num_gpus", "2", "--module", "mega_depth.train", "--deepspeed",
              "--deepspeed-config", os.path.join(ROOT, "launch", "ds_configs", "zero2.json"), "--mock-data",
              "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--save-interval", "2",
              "--no-tensorboard"]
    env = dict(ENV, DS_ACCELERATOR="cpu")

    def launch(extra):
        cmd = [ds] + common + extra
        cmd[2] = str(free_port())
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    launch(["--save", str(tmp_path / "full"), "--output-dir", str(tmp_path / "full-run")])
    launch(["--save", str(tmp_path / "ckpt"), "--exit-interval", "2", "--output-dir", str(tmp_path / "first")])
    launch(["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--output-dir",
            str(tmp_path / "second")])
    ref, first, second = (metrics(tmp_path / n) for n in ("full-run", "first", "second"))
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]  # separate output folders
    assert [second[s]["loss"] for s in (3, 4)] == pytest.approx([ref[s]["loss"] for s in (3, 4)], rel=1e-6)
    # DeepSpeed checkpoints follow the shared convention: manifest, metadata, and canonical weights for export
    ckpt = tmp_path / "ckpt" / "iter_0000004"
    assert {"mega_depth.json", "manifest.json", "model.safetensors", "deepspeed"} <= set(os.listdir(ckpt))
    assert json.load(open(ckpt / "mega_depth.json"))["format"] == "deepspeed"


def test_every_shipped_config_validates(data):
    from mega_depth.config import parse_args

    for path in sorted(glob.glob(os.path.join(ROOT, "launch", "configs", "*.yaml"))):
        cfg = parse_args(["--config", path, "--tokenizer-model", str(data["dir"] / "spm.model")]
                         + ([] if "tiny" in path else ["--data-path", "x"]))
        cfg.model.vocab_size = 32000
        p = cfg.parallel
        etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
        cfg.validate(p.pipeline_model_parallel_size * max(p.tensor_model_parallel_size * p.context_parallel_size * 2,
                                                          p.expert_model_parallel_size * etp))


def test_smoke_test_tool_passes_on_cpu(tmp_path):
    from mega_depth.catalogue import SETTINGS

    out = run(["tools/smoke_test.py", "--steps", "4", "--hidden-size", "32", "--seq-length", "32",
               "--num-layers", "2", "--out", str(tmp_path / "smoke.json")]).stdout
    results = json.load(open(tmp_path / "smoke.json"))["results"]
    assert [r["mechanism"] for r in results] == list(SETTINGS)
    assert all(r["ok"] for r in results) and "peak MiB" in out


def test_metrics_of_an_interrupted_run_are_rewritten_not_duplicated(data, baseline, tmp_path):
    """Resuming at step 10 after a run that logged 20 steps: metrics.jsonl and TensorBoard keep one record per
    step (the resumed run's from 11 on)."""
    shutil.copytree(baseline / "run", tmp_path / "run")
    run(["-m", "mega_depth.train"] + TRAIN_MODEL + data["flags"] + [
        "--train-iters", "12", "--lr-decay-iters", "20", "--load", str(baseline / "ckpt" / "iter_0000010"),
        "--output-dir", str(tmp_path / "run")])
    lines = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == list(range(1, 13))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))
