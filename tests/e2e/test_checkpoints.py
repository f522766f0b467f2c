"""Checkpoints that cannot lose a run: real corruption (truncation, random bytes, missing files) is named and the
load falls back to the newest intact checkpoint of the run, which then resumes with identical losses; a named
iteration never falls back; in the run's own folder the damaged checkpoint is quarantined and pruning keeps the
intact one; a fresh run into another run's folder is refused with nothing deleted; pruning only
touches the run's own checkpoints; --load of a folder that does not exist yet starts from scratch."""

import os
import shutil

import pytest

from fixtures import TRAIN_MODEL, metrics, run

FLAGS = TRAIN_MODEL + ["--train-iters", "4", "--lr-decay-iters", "4", "--no-tensorboard"]


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """Four steps with checkpoints at steps 2 and 4; the reference losses."""
    d = tmp_path_factory.mktemp("saved")
    run(["-m", "mega_depth.train"] + FLAGS + data["flags"] + ["--save", str(d / "ckpt"), "--save-interval", "2",
                                                              "--output-dir", str(d / "run")])
    return d


def _shard(ckpt):
    return sorted(p for p in os.listdir(ckpt) if p.endswith(".distcp"))[0]


CORRUPTIONS = {
    "truncated-shard": lambda c: open(c / _shard(c), "r+b").truncate(os.path.getsize(c / _shard(c)) // 2),
    "random-bytes-in-shard": lambda c: _overwrite(c / _shard(c), 4096),
    "missing-metadata": lambda c: os.remove(c / ".metadata"),
    "empty-common": lambda c: open(c / "common.pt", "w").close(),
    "truncated-mega-depth-json": lambda c: open(c / "mega_depth.json", "r+").truncate(40),
    "missing-manifest": lambda c: os.remove(c / "manifest.json"),  # the files cannot be verified: damage
}


def _overwrite(path, count):
    """4 KB of random bytes in the middle of a file (its size unchanged: only the checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(max(0, os.path.getsize(path) // 2 - count // 2))
        f.write(os.urandom(count))


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_the_intact_one(saved, data, tmp_path, damage):
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    CORRUPTIONS[damage](tmp_path / "ckpt" / "iter_0000004")
    proc = run(["-m", "mega_depth.train"] + FLAGS + data["flags"] + ["--load", str(tmp_path / "ckpt"),
                                                                    "--output-dir", str(tmp_path / "run")])
    assert f"checkpoint {tmp_path / 'ckpt' / 'iter_0000004'} is damaged:" in proc.stdout, proc.stdout
    assert f"falling back to {tmp_path / 'ckpt' / 'iter_0000002'}" in proc.stdout
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    ref, resumed = metrics(saved / "run"), metrics(tmp_path / "run")
    assert [resumed[s]["loss"] for s in (3, 4)] == [ref[s]["loss"] for s in (3, 4)]
    named = {"truncated-shard": "truncated", "random-bytes-in-shard": "checksum", "missing-metadata": ".metadata",
             "empty-common": "common.pt", "truncated-mega-depth-json": "mega_depth.json",
             "missing-manifest": "manifest.json is missing"}[damage]
    assert named in proc.stdout.split("is damaged:")[1].splitlines()[0]


def test_fallback_then_prune_keeps_the_intact_checkpoint_and_quarantines_the_damaged_one(saved, data, tmp_path):
    """The run's own folder (--load == --save) with a damaged newest checkpoint, then --keep-last 2: the damaged
    one is renamed aside (it never counts as kept), and the intact one the run resumed from stays."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    _overwrite(ckpt / "iter_0000004" / _shard(ckpt / "iter_0000004"), 4096)
    proc = run(["-m", "mega_depth.train"] + FLAGS + data["flags"] + [
        "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1", "--keep-last", "2", "--train-iters", "3",
        "--output-dir", str(tmp_path / "run")])
    aside = [n for n in os.listdir(ckpt) if n.startswith("iter_0000004.damaged-")]
    assert len(aside) == 1 and f"quarantined the damaged checkpoint as {ckpt / aside[0]}" in proc.stdout
    assert sorted(set(os.listdir(ckpt)) - set(aside)) == ["iter_0000002", "iter_0000003",
                                                          "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert metrics(tmp_path / "run")[3]["loss"] == metrics(saved / "run")[3]["loss"]


def test_a_named_damaged_checkpoint_is_an_error_without_fallback(saved, data, tmp_path):
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    _overwrite(tmp_path / "ckpt" / "iter_0000004" / "common.pt", 16)
    proc = run(["-m", "mega_depth.train"] + FLAGS + data["flags"] + [
        "--load", str(tmp_path / "ckpt" / "iter_0000004"), "--output-dir", str(tmp_path / "run")], expect=2)
    assert "is damaged: common.pt does not match its checksum" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_fresh_run_into_another_runs_folder_is_refused_and_deletes_nothing(saved, data, tmp_path):
    """The everyday mistake: rerunning a job script into an uncleaned --save folder."""
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    before = sorted(os.listdir(tmp_path / "ckpt"))
    args = ["-m", "mega_depth.train"] + FLAGS + data["flags"] + ["--save", str(tmp_path / "ckpt"),
                                                                "--save-interval", "1", "--keep-last", "1",
                                                                "--output-dir", str(tmp_path / "run")]
    proc = run(args, expect=2)
    assert "already holds checkpoints of another run" in proc.stderr and "--overwrite-save" in proc.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == before
    # with --overwrite-save it writes beside them, but never over them: a run whose saves would reach the other
    # run's steps (here 2, of its 2 and 4) is refused before its first step ...
    proc = run(args + ["--overwrite-save", "--train-iters", "3", "--lr-decay-iters", "4"], expect=2)
    assert "holds checkpoints of another run at steps this run may save (iter_0000002; this run saves steps 1-3)" \
        in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == before
    # ... and one whose steps are free writes beside them; pruning (--keep-last 1) removes only its own older
    # checkpoints
    run(args + ["--overwrite-save", "--train-iters", "1", "--lr-decay-iters", "4", "--overwrite-output-dir"])
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["iter_0000001", "iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"], names
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_load_of_a_folder_that_does_not_exist_yet_starts_from_scratch(data, tmp_path):
    """`--save X --load X` on a job's first submission (Megatron-LM's rule)."""
    ckpt = tmp_path / "ckpt"
    proc = run(["-m", "mega_depth.train"] + FLAGS + data["flags"] + ["--load", str(ckpt), "--save", str(ckpt),
                                                                    "--output-dir", str(tmp_path / "run")])
    # the run's lock creates the folder before the load looks into it
    assert f"--load {ckpt} holds nothing yet: starting from scratch" in proc.stdout
    assert sorted(metrics(tmp_path / "run")) == [1, 2, 3, 4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_an_overridden_schedule_takes_this_runs_lr_and_min_lr_on_the_megatron_optimizer(saved, data, tmp_path):
    """--override-opt-param-scheduler: Megatron's param groups carry max_lr / min_lr, which its scheduler reads
    before its own and the checkpoint's optimizer state would bring back (Megatron-LM #1138); this run's stand."""
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    resume = ["-m", "mega_depth.train"] + FLAGS + data["flags"] + [
        "--load", str(tmp_path / "ckpt"), "--override-opt-param-scheduler", "--overwrite-output-dir"]
    # a constant schedule at a new peak: every new step at this run's --lr (the checkpoint's is 3e-3)
    run(resume + ["--train-iters", "6", "--lr-decay-style", "constant", "--lr", "0.0123", "--output-dir",
                  str(tmp_path / "peak")])
    lrs = {s: r["lr"] for s, r in metrics(tmp_path / "peak").items()}
    assert lrs[5] == pytest.approx(0.0123) and lrs[6] == pytest.approx(0.0123), lrs
    # past the decay's end: this run's --min-lr (the checkpoint's is 0)
    run(resume + ["--train-iters", "6", "--lr-decay-iters", "4", "--min-lr", "0.00045", "--output-dir",
                  str(tmp_path / "floor")])
    lrs = {s: r["lr"] for s, r in metrics(tmp_path / "floor").items()}
    assert lrs[6] == pytest.approx(0.00045), lrs
