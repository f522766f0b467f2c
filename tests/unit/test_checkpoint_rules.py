"""The checkpoint rules on files alone (a fake format whose 'shard' is one file): atomic save with metadata and
manifest, pruning by run and recency, verification and fall-back, a stale folder refused, quarantine of damaged
checkpoints, the checkpoint a run resumed from kept until a newer one is verified, a missing manifest as damage,
a run killed in its first save, a full disk, and the save folder's lock."""

import json
import os
import re
import socket
import time

import pytest

from mega_depth.checkpoint import rules
from mega_depth.checkpoint.manifest import CorruptCheckpoint, verify
from mega_depth.checkpoint.plain import SingleProcess


def save(root, step, run_id, keep_last=3, payload=b"weights", protect=None):
    def fill(tmp):
        with open(os.path.join(tmp, "shard.bin"), "wb") as f:
            f.write(payload * 100)

    path, _ = rules.save(str(root), step, fill, {"format": "fake", "run_id": run_id, "config": {}}, keep_last,
                         SingleProcess(), protect=protect)
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
    # a named step that is not there (a typo, a pruned step) is refused with what is there, never a fresh start
    with pytest.raises(rules.CheckpointError, match=r"iter_0000009 does not exist \(.*holds iter_0000002, "
                                                    r"iter_0000003, iter_0000004\); name an existing iter_N"):
        rules.find_checkpoint(str(tmp_path / "c" / "iter_0000009"), said.append)
    with pytest.raises(rules.CheckpointError, match="holds no checkpoint\\); name an existing"):
        rules.find_checkpoint(str(tmp_path / "nothing" / "iter_0000001"), said.append)


def test_a_damaged_newest_checkpoint_that_names_no_run_never_falls_back_into_another_run(tmp_path):
    def unreadable(path):  # both files that name the run
        for name in ("mega_depth.json", "manifest.json"):
            with open(os.path.join(path, name), "w") as f:
                f.write("{")

    def listing(folder):
        return sorted(os.listdir(folder))

    said = []
    # two runs' checkpoints: refused by the search and by every rank's peek, and in the run's own folder nothing is
    # renamed (a restart meets the same refusal, not another run's checkpoint)
    for step, run in ((1, "a"), (2, "b"), (3, "a")):
        save(tmp_path / "mixed", step, run)
    unreadable(save(tmp_path / "mixed", 4, "a"))
    before = listing(tmp_path / "mixed")
    for find in (lambda: rules.find_checkpoint(str(tmp_path / "mixed"), said.append),
                 lambda: rules.find_checkpoint(str(tmp_path / "mixed"), said.append, own=True),
                 lambda: rules.peek_metadata(str(tmp_path / "mixed"))):
        with pytest.raises(rules.CheckpointError, match=r"iter_0000004 is damaged and names no run, and .* holds "
                           r"checkpoints of 2 runs \(run a \(newest iter_0000003\), run b \(newest iter_0000002\)\)"
                           r".*--load .*iter_N"):
            find()
        assert listing(tmp_path / "mixed") == before
    # one run, but a checkpoint at a later step (a rewound run, or a fresh one's first save beside an older run's):
    # the steps do not say which timeline the damaged one is of
    for step in (1, 3):
        save(tmp_path / "later", step, "a")
    unreadable(save(tmp_path / "later", 2, "a"))
    rules.write_pointer(str(tmp_path / "later"), 2)
    with pytest.raises(rules.CheckpointError, match=r"iter_0000002 is damaged and names no run, and .* holds "
                       r"checkpoints at later steps \(iter_0000003\)"):
        rules.find_checkpoint(str(tmp_path / "later"), said.append, own=True)
    assert os.path.isdir(tmp_path / "later" / "iter_0000002")
    # one run, all of it earlier: the fallback goes on, says whose checkpoint it took, and quarantines in its folder
    for step in (1, 2):
        save(tmp_path / "one", step, "a")
    unreadable(save(tmp_path / "one", 3, "a"))
    assert rules.peek_metadata(str(tmp_path / "one"))[0].endswith("iter_0000002")
    path, meta = rules.find_checkpoint(str(tmp_path / "one"), said.append, own=True)
    assert path.endswith("iter_0000002") and meta["run_id"] == "a"
    assert "(of run a, the folder's only run, all of it at earlier steps: the damaged iter_0000003 names none)" \
        in said[-1]
    assert any(n.startswith("iter_0000003.damaged-") for n in os.listdir(tmp_path / "one"))


def test_in_its_own_folder_a_damaged_checkpoint_of_a_named_run_falls_back_within_it(tmp_path):
    """The resume of a run's own folder (--load == --save) quarantines the damaged checkpoint as it falls back: the
    run it falls back within is read before that rename (the other runs' checkpoints beside it are never taken)."""
    for step, run in ((1, "a"), (2, "b"), (3, "a"), (4, "a")):
        save(tmp_path, step, run)
    _damage(tmp_path / "iter_0000004")
    said = []
    path, meta = rules.find_checkpoint(str(tmp_path), said.append, own=True)
    assert path.endswith("iter_0000003") and meta["run_id"] == "a"
    assert said[-1].endswith("the newest intact checkpoint of this run") and rules.read_pointer(str(tmp_path)) == 3


def test_manifest_records_the_run_and_the_config_hash(tmp_path):
    from mega_depth.config import parse_args

    cfg = parse_args(["--mock-data", "--residual", "attnres"])
    path, _ = rules.save(str(tmp_path), 1, lambda tmp: None, {"format": "fake", "run_id": "r",
                                                              "config_hash": rules.config_hash(cfg), "config": {}},
                         1, SingleProcess())
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["run_id"] == "r" and manifest["config_hash"] == rules.config_hash(cfg)
    other = parse_args(["--mock-data", "--residual", "attnres", "--attnres-num-blocks", "2"])
    assert rules.config_hash(other) != rules.config_hash(cfg)
    assert rules.config_hash(parse_args(["--mock-data", "--residual", "attnres", "--lr", "1"])) == \
        rules.config_hash(cfg)  # the schedule is not the model


def _damage(path):
    os.remove(os.path.join(path, "shard.bin"))


def test_in_its_own_folder_a_damaged_checkpoint_is_quarantined_and_the_fallback_is_kept(tmp_path, monkeypatch):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, "a", keep_last=2)
    _damage(tmp_path / "iter_0000004")
    said = []
    # another run's --load of this folder reads it, and changes nothing in it
    assert rules.find_checkpoint(str(tmp_path), said.append)[0].endswith("iter_0000003")
    assert os.path.isdir(tmp_path / "iter_0000004") and rules.read_pointer(str(tmp_path)) == 4
    # the run's own folder (--load == --save): the damaged one is renamed aside, the pointer names the fallback
    path, _ = rules.find_checkpoint(str(tmp_path), said.append, own=True)
    assert path.endswith("iter_0000003") and rules.read_pointer(str(tmp_path)) == 3
    aside = [n for n in os.listdir(tmp_path) if n.startswith("iter_0000004.damaged-")]
    assert len(aside) == 1 and f"quarantined the damaged checkpoint as {tmp_path / aside[0]}" in said
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [3]  # never counted as kept
    # a new save that reads back wrong: the checkpoint the run resumed from stays beyond --keep-last
    monkeypatch.setattr(rules, "verify", lambda p: (_ for _ in ()).throw(CorruptCheckpoint("bad read-back")))
    save(tmp_path, 4, "a", keep_last=1, protect=path)
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [3, 4]
    monkeypatch.undo()
    # once a newer save verifies, it may go
    save(tmp_path, 5, "a", keep_last=1, protect=path)
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [5]
    assert os.path.isdir(tmp_path / aside[0])  # quarantined checkpoints stay for inspection


def test_a_missing_manifest_is_damage_unless_the_metadata_predates_manifests(tmp_path):
    save(tmp_path, 1, "a")
    save(tmp_path, 2, "a")
    os.remove(tmp_path / "iter_0000002" / "manifest.json")
    said = []
    assert rules.find_checkpoint(str(tmp_path), said.append)[0].endswith("iter_0000001")
    assert any("iter_0000002 is damaged: manifest.json is missing" in s for s in said)
    with pytest.raises(rules.CheckpointError, match="manifest.json is missing"):
        rules.find_checkpoint(str(tmp_path / "iter_0000002"), said.append)
    # metadata written before manifests existed (no config hash, no manifest flag): loads with a warning
    old = tmp_path / "old"
    save(old, 1, "a")
    meta = json.load(open(old / "iter_0000001" / "mega_depth.json"))
    del meta["manifest"]
    json.dump(meta, open(old / "iter_0000001" / "mega_depth.json", "w"))
    os.remove(old / "iter_0000001" / "manifest.json")
    path, meta = rules.find_checkpoint(str(old), said.append)
    assert meta["unverified"] and "predates manifests" in said[-1]


def test_a_run_killed_in_its_first_save_can_be_resubmitted(tmp_path):
    (tmp_path / "iter_0000002.tmp").mkdir()
    (tmp_path / "iter_0000002.tmp" / "shard.bin").write_bytes(b"half")
    said = []
    assert rules.find_checkpoint(str(tmp_path), said.append) is None
    assert "holds only an interrupted save (iter_0000002.tmp), no checkpoint: starting from scratch" in said[-1]
    assert os.path.isdir(tmp_path / "iter_0000002.tmp")  # not this run's folder: left alone
    assert rules.find_checkpoint(str(tmp_path), said.append, own=True) is None and "(removed it)" in said[-1]
    assert os.listdir(tmp_path) == []


def test_a_full_disk_names_itself_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, 1, "a")
    monkeypatch.setenv("MEGA_DEPTH_FAULT_DISK_FULL_IN_SAVE", "2")
    with pytest.raises(rules.CheckpointError) as err:
        save(tmp_path, 2, "a")
    message = str(err.value)
    assert message.startswith(f"the disk is full: saving into {tmp_path} failed (No space left on device) with ")
    assert re.search(r"free, and the last checkpoint took [\d.]+ KB; checkpoint iter_0000001 is intact", message)
    assert "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]  # no partial save
    verify(str(tmp_path / "iter_0000001"))
    assert rules.read_pointer(str(tmp_path)) == 1


def test_the_save_lock_refuses_a_live_holder_and_takes_over_a_gone_one(tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys
    import threading

    from mega_depth.checkpoint import lock as lock_module
    from mega_depth.checkpoint.lock import LOCK, SaveFolderLocked, SaveLock

    monkeypatch.setattr(lock_module, "STALE_S", 3.0)  # seconds instead of minutes
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.4)
    said = []
    first = SaveLock(str(tmp_path), "run-1", "training", said.append).acquire()
    assert rules.folder_contents(str(tmp_path)) == []  # the lock alone is not content
    with pytest.raises(SaveFolderLocked, match=r"is in use by run run-1 \(pid %d on host" % os.getpid()):
        SaveLock(str(tmp_path), "run-2", "training", said.append).acquire()  # same host, live pid: at once
    first.update("run-1b")
    assert json.load(open(tmp_path / LOCK))["run_id"] == "run-1b"
    first.release()
    assert not (tmp_path / LOCK).exists()

    def planted(pid, host, age_s=0.0):
        holder = {"run_id": "gone", "host": host, "pid": pid, "started": time.time(), "token": "t"}
        json.dump(holder, open(tmp_path / LOCK, "w"))
        then = time.time() - age_s
        os.utime(tmp_path / LOCK, (then, then))

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    planted(dead.pid, socket.gethostname())  # a process of this host that is gone: taken over at once
    lock = SaveLock(str(tmp_path), "run-3", "training", said.append).acquire()
    assert f"took over the lock of run gone (pid {dead.pid}" in said[-1] and "is gone" in said[-1]
    lock.release()
    planted(1, "another-host", age_s=60)  # another host, heartbeat long stopped: taken over at once
    lock = SaveLock(str(tmp_path), "run-4", "training", said.append).acquire()
    assert "heartbeat stopped 60 s ago" in said[-1]
    lock.release()
    # another host with a fresh heartbeat that keeps beating: alive, refused
    planted(1, "another-host")
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            os.utime(tmp_path / LOCK)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(SaveFolderLocked, match="on host another-host"):
            SaveLock(str(tmp_path), "run-5", "training", said.append).acquire()
    finally:
        stop.set()
        beating.join()
    assert "watching its heartbeat" in said[-1]
    # ... and one whose fresh heartbeat stops (its node crashed just now): watched until stale, then taken over
    planted(1, "another-host")
    t0 = time.time()
    lock = SaveLock(str(tmp_path), "run-6", "training", said.append).acquire()
    assert "watching its heartbeat" in said[-2] and "heartbeat stopped" in said[-1] and time.time() - t0 >= 2.5
    planted(1, "another-host")  # taken over meanwhile: the release leaves the new holder's lock alone
    lock.release()
    assert json.load(open(tmp_path / LOCK))["run_id"] == "gone"


@pytest.fixture
def fast_lock(monkeypatch):
    """The lock module with a heartbeat of a fraction of a second."""
    from mega_depth.checkpoint import lock as lock_module

    monkeypatch.setattr(lock_module, "STALE_S", 3.0)
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.2)
    return lock_module


def test_a_holder_finds_its_lock_deleted_overwritten_or_taken(tmp_path, fast_lock):
    from mega_depth.checkpoint.lock import LOCK, SaveLock

    lock = SaveLock(str(tmp_path), "run-1", "training", print)
    lock.acquire = lambda: lock._create() and lock  # no heartbeat in this first part
    lock.acquire()
    assert lock.verify() is None
    (tmp_path / LOCK).unlink()
    assert "was deleted" in lock.verify()
    (tmp_path / LOCK).write_text("\x00garbage")
    assert "overwritten with something unreadable" in lock.verify()
    json.dump({"run_id": "other", "pid": 1, "host": "h", "token": "x"}, open(tmp_path / LOCK, "w"))
    assert "now names run other (pid 1 on host h" in lock.verify()
    lock.release()
    assert json.load(open(tmp_path / LOCK))["run_id"] == "other"  # not ours to remove
    # the heartbeat notices on its own, and stops touching the file
    (tmp_path / LOCK).unlink()
    lock = SaveLock(str(tmp_path), "run-2", "training", print).acquire()
    json.dump({"run_id": "other", "pid": 1, "host": "h", "token": "x"}, open(tmp_path / LOCK, "w"))
    deadline = time.time() + 5
    while lock.lost is None and time.time() < deadline:
        time.sleep(0.05)
    assert "now names run other" in lock.lost
    lock.release()


def test_two_takers_of_one_stale_lock_never_both_win(tmp_path, fast_lock):
    """The taker that judged a lock stale but moves aside the other taker's fresh lock puts it back."""
    import subprocess
    import sys
    import threading

    from mega_depth.checkpoint.lock import LOCK, SaveFolderLocked, SaveLock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def plant():
        json.dump({"run_id": "gone", "host": socket.gethostname(), "pid": dead.pid, "token": "t"},
                  open(tmp_path / LOCK, "w"))

    # deterministic: the slow taker judges the lock stale, then waits until the fast one has taken it
    plant()
    judged, taken = threading.Event(), threading.Event()

    class SlowTaker(SaveLock):
        def _before_takeover(self):
            judged.set()
            taken.wait(10)

    errors = []

    def slow():
        try:
            SlowTaker(str(tmp_path), "slow", "training", print).acquire()
        except SaveFolderLocked as e:
            errors.append(str(e))

    slow_thread = threading.Thread(target=slow)
    slow_thread.start()
    judged.wait(10)
    fast = SaveLock(str(tmp_path), "fast", "training", print).acquire()
    taken.set()
    slow_thread.join(10)
    assert errors and "is in use by run fast" in errors[0]
    assert fast.verify() is None
    fast.release()

    # and in a loop of real races between two processes, each started fresh (tests/scripts/race_for_a_lock.py)
    from fixtures import ENV, SCRIPTS

    trials, env = 10, dict(ENV, MEGA_DEPTH_LOCK_HEARTBEAT_S="0.2", MEGA_DEPTH_LOCK_STALE_S="3")
    takers = [subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "race_for_a_lock.py"), str(tmp_path),
                                f"taker-{i}", str(trials), "2"], env=env) for i in range(2)]
    try:
        for trial in range(trials):
            plant()
            (tmp_path / f"go-{trial}").touch()
            results = [tmp_path / f"won-{trial}-taker-{i}" for i in range(2)]
            deadline = time.monotonic() + 60  # the first trial waits for the takers' imports
            while not all(r.exists() for r in results):
                assert all(t.poll() in (None, 0) for t in takers), f"trial {trial}: a taker failed"
                assert time.monotonic() < deadline, f"trial {trial}: no result within 60 s"
                time.sleep(0.01)
            assert sum(int(r.read_text()) for r in results) == 1, f"trial {trial}: both or neither taker won"
    finally:
        for t in takers:
            if t.poll() is None:
                t.kill()
            t.wait()


def test_a_watched_lock_replaced_meanwhile_is_judged_afresh_and_pid_checks_stay_in_their_namespace(tmp_path,
                                                                                                      fast_lock):
    """A watcher whose holder released the lock must not take over the new holder's fresh lock on the old verdict;
    a holder in another pid namespace of this host (a container) is never judged by a pid lookup here."""
    import subprocess
    import sys
    import threading

    from mega_depth.checkpoint.lock import LOCK, SaveFolderLocked, SaveLock

    def planted(run_id, host, pid=1, age_s=0.0, **extra):
        json.dump({"run_id": run_id, "host": host, "pid": pid, "started": time.time(), "token": run_id, **extra},
                  open(tmp_path / LOCK, "w"))
        then = time.time() - age_s
        os.utime(tmp_path / LOCK, (then, then))

    planted("b", "another-host")
    stop = threading.Event()

    class Watcher(SaveLock):
        watched = 0

        def _watch(self, holder, heartbeat, stale_s):
            Watcher.watched += 1
            if Watcher.watched == 1:  # b releases, and c takes the folder within the watch's poll
                planted("c", "another-host")
                threading.Thread(target=lambda: [os.utime(tmp_path / LOCK) for _ in iter(lambda: stop.wait(0.05),
                                                                                           True)]).start()
                return "it released the lock"
            return super()._watch(holder, heartbeat, stale_s)

    try:
        with pytest.raises(SaveFolderLocked, match="in use by run c "):
            Watcher(str(tmp_path), "a", "training", print).acquire()
    finally:
        stop.set()
    assert json.load(open(tmp_path / LOCK))["run_id"] == "c"  # c's lock stands
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = SaveLock(str(tmp_path), "x", "training", print).holder["pid_ns"]
    other_ns = (mine or 0) + 1
    # a dead pid here, but the holder's pids are another namespace's: judged by its heartbeat (old: taken over)
    planted("d", socket.gethostname(), pid=dead.pid, age_s=60, pid_ns=other_ns)
    said = []
    lock = SaveLock(str(tmp_path), "e", "training", said.append).acquire()
    assert "heartbeat stopped 60 s ago" in said[-1]
    lock.release()
    planted("f", socket.gethostname(), pid=dead.pid, pid_ns=other_ns)  # fresh and beating: watched, refused
    stop = threading.Event()
    beating = threading.Thread(target=lambda: [os.utime(tmp_path / LOCK) for _ in iter(lambda: stop.wait(0.05),
                                                                                      True)])
    beating.start()
    try:
        with pytest.raises(SaveFolderLocked, match="in use by run f "):
            SaveLock(str(tmp_path), "g", "training", said.append).acquire()
    finally:
        stop.set()
        beating.join()


def test_a_save_never_replaces_another_runs_checkpoint_and_swaps_its_own(tmp_path):
    save(tmp_path, 5, "b")
    with pytest.raises(rules.CheckpointError, match="already holds iter_0000005 of run b, and this run \\(a\\) "
                       "would replace it"):
        save(tmp_path, 5, "a")
    assert rules.read_meta(str(tmp_path / "iter_0000005"))["run_id"] == "b" and not (tmp_path / "iter_0000005.tmp"
                                                                                     ).exists()
    verify(str(tmp_path / "iter_0000005"))
    # refused before the first step where a run's saves would meet another run's checkpoints
    with pytest.raises(rules.CheckpointError, match="holds checkpoints of another run at steps this run may save "
                       "\\(iter_0000005; this run saves steps 1-10\\)"):
        rules.check_steps_free(str(tmp_path), "a", 1, 10)
    rules.check_steps_free(str(tmp_path), "a", 6, 10)
    rules.check_steps_free(str(tmp_path), "b", 1, 10)
    # the same run saving a step again (rewound): swapped in, the old copy gone
    save(tmp_path / "own", 3, "a")
    save(tmp_path / "own", 3, "a", payload=b"rewound")
    assert sorted(os.listdir(tmp_path / "own")) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "own" / "iter_0000003" / "shard.bin").read_bytes().startswith(b"rewound")
    # a kill between the swap's two renames: the next resume in the run's folder puts the old copy back ...
    own = tmp_path / "own"
    os.rename(own / "iter_0000003", own / "iter_0000003.replaced")
    said = []
    path, _ = rules.find_checkpoint(str(own), said.append, own=True)
    assert path.endswith("iter_0000003") and "put back" in said[0]
    # ... and after the second one, it drops the old copy
    (own / "iter_0000003.replaced").mkdir()
    rules.find_checkpoint(str(own), said.append, own=True)
    assert not (own / "iter_0000003.replaced").exists()
    # a stranded copy (the only one of its step) is a checkpoint to every check of the folder: another run neither
    # starts fresh beside it, nor plans to save its step, nor saves that step (whose resume would then drop it)
    os.rename(own / "iter_0000003", own / "iter_0000003.replaced")
    with pytest.raises(rules.CheckpointError, match=r"already holds checkpoints of another run \(iter_0000003"
                                                    r"\.replaced\)"):
        rules.check_fresh_save(str(own), overwrite=False)
    with pytest.raises(rules.CheckpointError, match=r"at steps this run may save \(iter_0000003\.replaced; this run "
                                                    r"saves steps 1-5\)"):
        rules.check_steps_free(str(own), "b", 1, 5)
    rules.check_steps_free(str(own), "a", 1, 5)  # its own run's
    with pytest.raises(rules.CheckpointError, match="already holds iter_0000003.replaced of run a"):
        save(own, 3, "b")
    assert sorted(os.listdir(own)) == ["iter_0000003.replaced", "latest_checkpointed_iteration.txt"]
    save(own, 3, "a", payload=b"again")  # its own run saving the step again: the new copy stands
    rules.find_checkpoint(str(own), said.append, own=True)
    assert sorted(os.listdir(own)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (own / "iter_0000003" / "shard.bin").read_bytes().startswith(b"again")


def test_a_lagging_pointer_does_not_skip_the_newest_checkpoint(tmp_path, monkeypatch):
    import errno

    for step in (1, 2, 3):
        save(tmp_path, step, "a")
    rules.write_pointer(str(tmp_path), 2)  # killed between the rename of iter_3 and the pointer's write
    said = []
    assert rules.find_checkpoint(str(tmp_path), said.append)[0].endswith("iter_0000003")
    assert "the pointer lagged" in said[-1] and rules.read_pointer(str(tmp_path)) == 2  # (not its folder: unchanged)
    assert rules.peek_metadata(str(tmp_path))[0].endswith("iter_0000003")
    assert rules.find_checkpoint(str(tmp_path), said.append, own=True)[0].endswith("iter_0000003")
    assert rules.read_pointer(str(tmp_path)) == 3
    # the pointer's write fails: one line on every rank, and the checkpoint it could not name is resumed
    real = rules.write_pointer
    monkeypatch.setattr(rules, "write_pointer", lambda root, step: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    with pytest.raises(rules.CheckpointError, match="checkpoint iter_0000004 is complete, but writing "
                       "latest_checkpointed_iteration.txt failed"):
        save(tmp_path, 4, "a")
    monkeypatch.setattr(rules, "write_pointer", real)
    assert rules.find_checkpoint(str(tmp_path), said.append)[0].endswith("iter_0000004")
    # a save folder named iter_something is a folder, not one checkpoint
    save(tmp_path / "iter_sweep", 1, "s")
    assert rules.find_checkpoint(str(tmp_path / "iter_sweep"), said.append)[0].endswith("iter_0000001")
    assert rules.peek_metadata(str(tmp_path / "iter_sweep"))[0].endswith("iter_0000001")


def test_pruning_never_deletes_the_last_verified_checkpoint_before_a_newer_one_verifies(tmp_path, monkeypatch):
    first = save(tmp_path, 1, "a", keep_last=1)
    monkeypatch.setattr(rules, "verify", lambda p: (_ for _ in ()).throw(CorruptCheckpoint("bad read-back")))
    # the resumed-from checkpoint named in another spelling is still the one kept
    save(tmp_path, 2, "a", keep_last=1, protect=os.path.join(str(tmp_path), ".", os.path.basename(first)))
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [1, 2]
    # a run with nothing verified yet (fresh, or resumed from another folder) verifies its save before pruning
    save(tmp_path, 3, "a", keep_last=1)
    save(tmp_path, 4, "a", keep_last=1, protect=str(tmp_path / "elsewhere" / "iter_0000001"))
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [1, 2, 3, 4]
    monkeypatch.undo()
    save(tmp_path, 5, "a", keep_last=1)
    assert [s for s, _ in rules.list_checkpoints(str(tmp_path))] == [5]


def test_bad_lock_settings_and_a_failed_create_are_one_line_each(tmp_path, monkeypatch):
    import errno

    from mega_depth.checkpoint import lock as lock_module
    from mega_depth.checkpoint.lock import LOCK, SaveFolderLocked, SaveLock

    for heartbeat, stale, match in (("abc", None, r"MEGA_DEPTH_LOCK_HEARTBEAT_S='abc' is not a positive number"),
                                    ("15", "120s", r"MEGA_DEPTH_LOCK_STALE_S='120s' is not a positive number"),
                                    ("15", "", r"MEGA_DEPTH_LOCK_STALE_S='' is not a positive number"),
                                    ("15", "-1", r"MEGA_DEPTH_LOCK_STALE_S='-1' is not a positive number"),
                                    ("15", "0", r"MEGA_DEPTH_LOCK_STALE_S='0' is not a positive number"),
                                    ("15", "30", r"STALE_S=30 is at or below two heartbeats .*more than 30 s")):
        monkeypatch.setattr(lock_module, "HEARTBEAT_S", None)
        monkeypatch.setattr(lock_module, "STALE_S", None)
        monkeypatch.setenv("MEGA_DEPTH_LOCK_HEARTBEAT_S", heartbeat)
        if stale is None:
            monkeypatch.delenv("MEGA_DEPTH_LOCK_STALE_S", raising=False)
        else:
            monkeypatch.setenv("MEGA_DEPTH_LOCK_STALE_S", stale)
        with pytest.raises(SaveFolderLocked, match=match):
            SaveLock(str(tmp_path), "run", "training", print).acquire()
        assert not (tmp_path / LOCK).exists()

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 15.0)
    monkeypatch.setattr(lock_module, "STALE_S", 120.0)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock_module.json, "dump", full_disk)
    with pytest.raises(SaveFolderLocked, match="cannot write its lock file .*No space left on device"):
        SaveLock(str(tmp_path), "run", "training", print).acquire()
    assert not (tmp_path / LOCK).exists()  # no empty lock for the next run to wait out
    (tmp_path / "a_file").write_text("x")  # a --save under a file: the folder cannot be made
    with pytest.raises(SaveFolderLocked, match=r"--save .*a_file/ckpt cannot be created \(Not a directory\); pick"):
        SaveLock(str(tmp_path / "a_file" / "ckpt"), "run", "training", print).acquire()


def test_a_resume_compares_every_architecture_field(monkeypatch):
    """Not a hand-kept list: every DecoderConfig field (rotary base and norm epsilon included, which a resume once
    took silently) and every mechanism option."""
    from mega_depth.config import parse_args, to_dict

    base = ["--mock-data", "--residual", "attnres"]
    meta = {"config": to_dict(parse_args(base))}
    rules.check_compatible(meta, parse_args(base + ["--lr", "1", "--hidden-dropout", "0.1"]), "c")  # not the model
    for flags, expected in ((["--rotary-base", "500000"], "--rotary-base: checkpoint 10000, this run 500000"),
                            (["--norm-epsilon", "1e-5"], "--norm-epsilon: checkpoint 1e-06, this run 1e-05"),
                            (["--attnres-num-blocks", "2"], "--attnres-num-blocks: checkpoint None, this run 2")):
        with pytest.raises(rules.CheckpointError, match=re.escape(expected)):
            rules.check_compatible(meta, parse_args(base + flags), "c")


def test_use_checkpoint_args_takes_every_architecture_field_from_an_moe_checkpoint(tmp_path):
    """--use-checkpoint-args took a hand-kept list of ten fields: an MoE checkpoint's experts, top-k, expert width,
    layer pattern and router were left at the flags' defaults. The list is now derived from the architecture record
    (DecoderConfig): the run's record equals the checkpoint's, MoE included."""
    from mega_depth.config import parse_args, to_dict
    from mega_depth.train import apply_checkpoint_args

    saved = parse_args(["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "6", "--num-query-groups",
                        "2", "--vocab-size", "96", "--num-experts", "6", "--moe-router-topk", "3",
                        "--moe-ffn-hidden-size", "40", "--moe-layer-freq", "([0]*1+[1]*2)",
                        "--moe-shared-expert-intermediate-size", "24", "--moe-router-score-function", "sigmoid",
                        "--moe-router-enable-expert-bias", "--rotary-base", "500000", "--residual", "attnres"])
    (tmp_path / rules.META).write_text(json.dumps({"step": 4, "config": to_dict(saved)}))
    cfg = parse_args(["--mock-data", "--load", str(tmp_path), "--use-checkpoint-args"])
    said = []
    apply_checkpoint_args(cfg, said.append)
    assert cfg.decoder_config() == saved.decoder_config() and cfg.model.num_experts == 6, said
    assert "num_experts" in said[0] and "moe_layer_freq" in said[0]
    # the training switches stay this run's
    assert cfg.model.moe_aux_loss_coeff == parse_args([]).model.moe_aux_loss_coeff


_NEW_FIELD = '''
import dataclasses, json, sys
import mega_depth.model.config as record

@dataclasses.dataclass
class WithRopeScaling(record.DecoderConfig):  # a new architecture field, declared as every field is, and nothing else
    rope_scaling: float = record._field("RoPE position scaling", 1.0, "float", default=1.0)

record.DecoderConfig = WithRopeScaling  # before the config layer is built from it

from mega_depth.checkpoint import rules
from mega_depth.checkpoint.plain import SingleProcess
from mega_depth.config import parse_args
from mega_depth.train import apply_checkpoint_args

root = sys.argv[1]
run = parse_args(["--mock-data", "--rope-scaling", "4.0"])
rules.save(root, 1, lambda tmp: None, rules.run_meta(run, "plain", "r"), keep_last=1, comm=SingleProcess())
meta = rules.read_meta(rules.iter_dir(root, 1))
fresh = parse_args(["--mock-data", "--load", root, "--use-checkpoint-args"])
said = []
apply_checkpoint_args(fresh, said.append)
try:
    rules.check_compatible(meta, parse_args(["--mock-data"]), "c")
    refused = ""
except rules.CheckpointError as e:
    refused = str(e)
print(json.dumps({"saved": meta["config"]["model"].get("rope_scaling"), "hash_differs": meta["config_hash"] !=
                  rules.config_hash(parse_args(["--mock-data"])), "taken": fresh.decoder_config().rope_scaling,
                  "said": said[0], "refused": refused}))
'''


def test_a_new_decoder_config_field_is_saved_compared_and_taken_with_no_other_edit(tmp_path):
    """DecoderConfig is the one record of the architecture: a field added to it (here by a subclass put in its
    place before the config layer is built) is a flag, goes into a real checkpoint's metadata and its model hash,
    is compared on resume (named by its flag) and is restored by --use-checkpoint-args, with no other edit."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NEW_FIELD, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["saved"] == 4.0 and found["hash_differs"] and found["taken"] == 4.0, found
    assert "(set: rope_scaling)" in found["said"], found
    assert "--rope-scaling: checkpoint 4.0, this run 1.0" in found["refused"], found
