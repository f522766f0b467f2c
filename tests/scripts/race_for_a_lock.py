"""One taker in tests/unit/test_checkpoint_rules.py's race for a stale lock, as its own process (a fork of a
test worker, which runs threads, can hang or crash before it reports).

    python race_for_a_lock.py FOLDER NAME TRIALS

For each trial t it waits for FOLDER/go-t, tries to take the lock and writes FOLDER/won-t-NAME (1 or 0); a winner
holds the lock 0.3 s, while the other taker decides, and releases it before it reports."""

import os
import sys
import time

from mega_depth.checkpoint.lock import SaveFolderLocked, SaveLock


def main(folder: str, name: str, trials: int) -> None:
    for trial in range(trials):
        go = os.path.join(folder, f"go-{trial}")
        deadline = time.monotonic() + 60
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: no {go} within 60 s")
            time.sleep(0.001)
        try:
            lock = SaveLock(folder, name, "training", lambda msg: None).acquire()
            time.sleep(0.3)
            lock.release()
            won = 1
        except SaveFolderLocked:
            won = 0
        with open(os.path.join(folder, f"won-{trial}-{name}.tmp"), "w") as f:
            f.write(str(won))
        os.replace(os.path.join(folder, f"won-{trial}-{name}.tmp"), os.path.join(folder, f"won-{trial}-{name}"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
