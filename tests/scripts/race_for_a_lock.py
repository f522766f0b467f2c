"""One taker in tests/unit/test_checkpoint_rules.py's race for a stale lock, as its own process (a fork of a
test worker, which runs threads, can hang or crash before it reports).

    python race_for_a_lock.py FOLDER NAME TRIALS TAKERS

For each trial t it waits for FOLDER/go-t, tries to take the lock and writes FOLDER/decided-t-NAME (1 or 0). A
winner holds the lock until all TAKERS have decided, then releases it: a taker that came late (slow imports, a
loaded machine) finds it held, as it would in a real overlap, and is not counted as a second winner for taking a
lock the first had already let go. Then it writes FOLDER/won-t-NAME (1 or 0)."""

import glob
import os
import sys
import time

from mega_depth.checkpoint.lock import SaveFolderLocked, SaveLock


def _write(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, f"{name}.tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(folder, f"{name}.tmp"), os.path.join(folder, name))


def _wait(what: str, ready, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {seconds:.0f} s")
        time.sleep(0.001)


def main(folder: str, name: str, trials: int, takers: int) -> None:
    for trial in range(trials):
        go = os.path.join(folder, f"go-{trial}")
        _wait(go, lambda: os.path.exists(go))
        try:
            lock = SaveLock(folder, name, "training", lambda msg: None).acquire()
        except SaveFolderLocked:
            lock = None
        _write(folder, f"decided-{trial}-{name}", "1" if lock else "0")
        if lock is not None:  # held until every taker has decided
            _wait(f"decisions of trial {trial}",  # (not the .tmp files that _write renames)
                  lambda: len(glob.glob(os.path.join(folder, f"decided-{trial}-*[!p]"))) >= takers)
            lock.release()
        _write(folder, f"won-{trial}-{name}", "1" if lock else "0")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
