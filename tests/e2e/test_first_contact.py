"""What a new user meets first, as a Megatron-LM / Hugging Face / W&B user expects it:

- the console of a short run: the start-up summary, the interval averages with % done and ETA, the evaluation at
  the last step, and the resolved config.yaml (which --config reads back);
- --dry-run: the summary and the per-rank memory estimate, nothing written;
- --help: every flag has a line of help; an unknown flag gets a few lines with the nearest flag;
- launch/torchrun.sh: a failing worker ends with its own message and "worker N exited with code X", no traceback;
- W&B offline files hold the loss and a heatmap;
- --use-checkpoint-args fine-tunes a checkpoint without its --config;
- the quickstart's training, export and sample steps print no warning.
"""

import glob
import json
import os
import struct
import subprocess

import pytest

from fixtures import ENV, PY, ROOT, TRAIN_MODEL, metrics, run

TRAIN = ["-m", "mega_depth.train"]


def flags(data, *extra):
    return TRAIN_MODEL + data["flags"] + ["--no-tensorboard", "--lr-decay-iters", "6"] + list(extra)


def test_a_short_runs_console_summary_interval_averages_final_evaluation_and_resolved_config(data, tmp_path):
    from mega_depth.config import parse_args, to_dict

    out = tmp_path / "run"
    proc = run(TRAIN + flags(data, "--train-iters", "4", "--log-interval", "2", "--eval-iters", "2",
                             "--output-dir", str(out)))
    lines = proc.stdout.splitlines()
    summary = "\n".join(lines[:8])
    for expected in ("model: --residual attnres (attnres_num_blocks=2", "parameters ", "of which the depth mixing",
                     "MFLOPs per token", "layout: world 1 = TP 1 x PP 1 x DP 1",
                     "micro-batch 2 x 2 micro-batches x DP 1 = global batch 4 (128 tokens per step)",
                     "training split", "epochs", "evaluation: at the last step (2 batches)",
                     f"outputs: {out}/ (metrics.jsonl, config.yaml", "checkpoints: none (no --save)"):
        assert expected in summary, (expected, summary)
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split("|")[0].strip() for line in steps] == ["step      2/4 ( 50.0%)", "step      4/4 (100.0%)"]
    for line in steps:
        assert " ms/step | " in line and " tokens/s | " in line and "| ETA 0:" in line and "| mem " in line, line
    assert "| val loss " in steps[-1] and "val loss" not in steps[0]
    m = metrics(out)
    assert "val_loss" in m[4] and "val_loss" not in m[2]
    # the interval's loss is the mean of its steps'
    shown = float(steps[0].split("| loss ")[1].split(" ")[0])
    assert shown == pytest.approx((m[1]["loss"] + m[2]["loss"]) / 2, abs=2e-6)
    # the resolved config reads back as the same configuration
    again = parse_args(["--config", str(out / "config.yaml")])
    ran = parse_args(flags(data, "--train-iters", "4", "--log-interval", "2", "--eval-iters", "2", "--output-dir",
                           str(out)))
    ran.model.vocab_size = 1000  # set from the tokenizer at start-up (the YAML records the resolved value)
    assert to_dict(again) == to_dict(ran)


def test_dry_run_prints_the_summary_and_the_memory_estimate_and_writes_nothing(data, tmp_path):
    proc = run(TRAIN + flags(data, "--dry-run", "--save", str(tmp_path / "ckpt"), "--output-dir",
                             str(tmp_path / "run")))
    assert "model: --residual attnres" in proc.stdout and "parameters " in proc.stdout
    assert "memory per rank (estimate): " in proc.stdout and "weights " in proc.stdout
    assert "activations " in proc.stdout and "--dry-run: sized on the meta device (nothing allocated); no step taken, nothing written" in proc.stdout
    assert os.listdir(tmp_path) == []
    # the 7B config at its real layout (TP 4 x PP 2 with virtual stages), in one process, on the meta device
    proc = run(TRAIN + ["--config", "launch/configs/7b-attnres.yaml", "--mock-data", "--dry-run", "--output-dir",
                        str(tmp_path / "7b")], timeout=120)
    assert "layout: world 8 = TP 4 x PP 2 x DP 1" in proc.stdout and "parameters 5.67B" in proc.stdout
    assert "memory per rank (estimate): " in proc.stdout and "[pipeline stage " in proc.stdout
    assert os.listdir(tmp_path) == []


def test_help_describes_every_flag_and_an_unknown_flag_gets_a_short_answer():
    from mega_depth.config import build_parser

    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.help != "==SUPPRESS=="]
    silent = [a.option_strings[0] for a in flags if not (a.help or "").strip() or a.help.startswith(" (")]
    assert silent == [], silent
    text = subprocess.run([PY] + TRAIN + ["--help"], capture_output=True, text=True, cwd=ROOT, env=ENV).stdout
    assert "%(" not in text and "{'" not in text  # argparse's internals never leak into the help
    assert "--lr-decay-style {constant,linear,cosine,inverse-square-root,WSD}" in text
    assert "--on-nan {stop,skip}" in text and "--mixing-impl {eager,compiled,triton}" in text
    assert "--recompute-granularity {full,selective}" in text
    proc = subprocess.run([PY] + TRAIN + ["--hiden-size", "64"], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) < 10, proc.stderr
    assert "unrecognized arguments: --hiden-size 64" in proc.stderr and "did you mean --hidden-size" in proc.stderr


@pytest.mark.parametrize("case", ["bad-flag", "stale-save-folder"])
def test_the_launcher_reports_a_failed_worker_without_a_traceback(data, tmp_path, case):
    extra = ["--lr", "-1"]
    expected = "--lr -1.0 must be positive"
    if case == "stale-save-folder":  # another run's checkpoints in --save, and this run starts from scratch
        (tmp_path / "ckpt" / "iter_0000004").mkdir(parents=True)
        extra = ["--save", str(tmp_path / "ckpt")]
        expected = "already holds checkpoints of another run"
    proc = subprocess.run(["bash", "launch/torchrun.sh"] + flags(data, "--train-iters", "2", "--output-dir",
                                                                 str(tmp_path / "run"), *extra),
                          capture_output=True, text=True, cwd=ROOT, env=dict(ENV, NPROC="2", PY=PY), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert expected in out and "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert "mega_depth.launcher: worker " in out and " exited with code 2" in out


def _wandb_history(run_file):
    """The history rows of a W&B run file: a LevelDB-style log (a 7-byte file header, 32 KiB blocks of records,
    each chunk with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) of protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in record.history.item})
    return rows


def test_wandb_offline_files_hold_the_loss_and_a_heatmap(data, tmp_path):
    pytest.importorskip("wandb")
    run(TRAIN + flags(data, "--train-iters", "3", "--wandb-project", "mega-depth-test", "--wandb-exp-name", "short",
                      "--wandb-save-dir", str(tmp_path / "wandb"), "--output-dir", str(tmp_path / "run")),
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    run_dir = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*"))[0]
    rows = _wandb_history(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0])
    losses = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    m = metrics(tmp_path / "run")
    assert losses == {s: pytest.approx(m[s]["loss"]) for s in (1, 2, 3)}
    images = [row["depth_weights/attnres/path"] for row in rows if "depth_weights/attnres/path" in row]
    assert images and os.path.getsize(os.path.join(run_dir, "files", images[0])) > 1000


def test_use_checkpoint_args_fine_tunes_an_imported_model_without_its_config(data, tmp_path):
    """An imported model (2 layers of Block AttnRes, imported from a checkpoint as from an HF folder) fine-tuned
    by naming neither, and with another width on the command line: the checkpoint's model and mechanism win, as
    with Megatron-LM's --use-checkpoint-args."""
    run(TRAIN + flags(data, "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--output-dir",
                      str(tmp_path / "a")))
    run(["tools/convert_from_hf.py", "--hf", str(tmp_path / "ckpt"), "--save", str(tmp_path / "imported")])
    proc = run(TRAIN + data["flags"] + ["--no-tensorboard", "--train-iters", "3", "--hidden-size", "64",
                                        "--seq-length", "32", "--load", str(tmp_path / "imported"),
                                        "--use-checkpoint-args", "--output-dir", str(tmp_path / "b")])
    said = proc.stdout.split("--use-checkpoint-args: model and mechanism from ")[1].splitlines()[0]
    assert "(set: num_layers, hidden_size, vocab_size, mechanism, attnres_num_blocks)" in said, said
    assert "weights-only checkpoint" in proc.stdout and sorted(metrics(tmp_path / "b")) == [1, 2, 3]
    assert "model: --residual attnres (attnres_num_blocks=2" in proc.stdout and "hidden 32" in proc.stdout


@pytest.mark.parametrize("mech", ["attnres", "attnres-moe"])
def test_the_quickstart_steps_print_no_warning(data, tmp_path, mech):
    """README command 1's train, export and sample steps (the shipped tiny config, shortened, on the test corpus;
    MECH=attnres-moe: Block AttnRes on MoE layers)."""
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    steps = [
        TRAIN + ["--config", f"launch/configs/tiny-{mech}.yaml", "--train-iters", "2", "--eval-interval", "2",
                 "--eval-iters", "1", "--lr-warmup-iters", "1", "--save", str(ckpt), "--output-dir",
                 str(tmp_path / "run")] + data["flags"],
        ["tools/convert_to_hf.py", "--load", str(ckpt), "--out", str(hf), "--force"],
        ["tools/generate.py", str(hf), "--prompt", "The Python tutorial", "--max-new-tokens", "4"],
    ]
    for args in steps:
        proc = run(args)
        text = proc.stdout + proc.stderr
        assert "warn" not in text.lower(), text[-3000:]
    assert "MegaDepthForCausalLM (model_type mega_depth_lm; load with AutoModelForCausalLM, trust_remote_code=True)" \
        in run(steps[1]).stdout
