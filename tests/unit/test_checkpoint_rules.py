"""The checkpoint rules on files alone (a fake format whose 'shard' is one file): atomic save with metadata and
manifest, pruning by run and recency, verification and fall-back, a stale folder refused."""

import json
import os
import time

import pytest

from mega_depth.checkpoint import rules
from mega_depth.checkpoint.manifest import CorruptCheckpoint, verify
from mega_depth.checkpoint.plain import SingleProcess


def save(root, step, run_id, keep_last=3, payload=b"weights"):
    def fill(tmp):
        with open(os.path.join(tmp, "shard.bin"), "wb") as f:
            f.write(payload * 100)

    path = rules.save(str(root), step, fill, {"format": "fake", "run_id": run_id, "config": {}}, keep_last,
                      SingleProcess())
    time.sleep(0.01)  # distinct save times
    return path


def test_save_is_complete_and_verifiable(tmp_path):
    path = save(tmp_path, 7, "a")
    assert sorted(os.listdir(path)) == ["manifest.json", "mega_depth.json", "shard.bin"]
    assert rules.read_pointer(str(tmp_path)) == 7 and rules.read_meta(path)["run_id"] == "a"
    verify(path)
    with open(os.path.join(path, "shard.bin"), "r+b") as f:
        f.write(b"X")
    with pytest.raises(CorruptCheckpoint, match="shard.bin does not match its checksum"):
        verify(path)


def test_pruning_keeps_this_runs_most_recent_and_never_touches_another_run(tmp_path):
    for step in (10, 11, 12):
        save(tmp_path, step, "old")
    for step in (1, 2, 3):  # a new run writing beside them (--overwrite-save)
        save(tmp_path, step, "new", keep_last=2)
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [2, 3, 10, 11, 12]
    assert rules.read_pointer(str(tmp_path)) == 3
    # a rewound run: recency, not the step number, decides what goes
    save(tmp_path, 11, "old", keep_last=2)
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [2, 3, 11, 12]


def test_a_fresh_run_is_refused_where_checkpoints_exist(tmp_path):
    rules.check_fresh_save(str(tmp_path / "missing"), overwrite=False)  # nothing there: fine
    save(tmp_path, 4, "a")
    with pytest.raises(rules.CheckpointError, match="already holds checkpoints of another run.*--overwrite-save"):
        rules.check_fresh_save(str(tmp_path), overwrite=False)
    rules.check_fresh_save(str(tmp_path), overwrite=True)


def test_find_falls_back_within_the_run_and_never_for_a_named_checkpoint(tmp_path):
    said = []
    assert rules.find_checkpoint(str(tmp_path / "nothing"), said.append) is None
    assert "does not exist yet: starting from scratch" in said[-1]
    (tmp_path / "empty").mkdir()
    assert rules.find_checkpoint(str(tmp_path / "empty"), said.append) is None
    save(tmp_path / "c", 1, "a")
    save(tmp_path / "c", 2, "b")  # another run's, older than the pointer's run and never a fall-back for it
    save(tmp_path / "c", 3, "a")
    save(tmp_path / "c", 4, "a")
    os.remove(tmp_path / "c" / "iter_0000004" / "shard.bin")
    with open(tmp_path / "c" / "iter_0000003" / "mega_depth.json", "w") as f:
        f.write("{")
    path, meta = rules.find_checkpoint(str(tmp_path / "c"), said.append)
    assert path.endswith("iter_0000001") and meta["run_id"] == "a"
    assert any("iter_0000004 is damaged: shard.bin is missing" in s for s in said)
    assert any("iter_0000003 is damaged: mega_depth.json is unreadable" in s for s in said)
    with pytest.raises(rules.CheckpointError, match="is damaged: shard.bin is missing"):
        rules.find_checkpoint(str(tmp_path / "c" / "iter_0000004"), said.append)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    with pytest.raises(rules.CheckpointError, match="holds no checkpoint"):
        rules.find_checkpoint(str(tmp_path / "junk"), said.append)


def test_manifest_records_the_run_and_the_config_hash(tmp_path):
    from mega_depth.config import parse_args

    cfg = parse_args(["--mock-data", "--residual", "attnres"])
    path = rules.save(str(tmp_path), 1, lambda tmp: None, {"format": "fake", "run_id": "r",
                                                           "config_hash": rules.config_hash(cfg), "config": {}},
                      1, SingleProcess())
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["run_id"] == "r" and manifest["config_hash"] == rules.config_hash(cfg)
    other = parse_args(["--mock-data", "--residual", "attnres", "--attnres-num-blocks", "2"])
    assert rules.config_hash(other) != rules.config_hash(cfg)
    assert rules.config_hash(parse_args(["--mock-data", "--residual", "attnres", "--lr", "1"])) == \
        rules.config_hash(cfg)  # the schedule is not the model
