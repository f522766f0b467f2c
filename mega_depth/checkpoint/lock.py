"""One writer per save folder: a lock file with the holder's run id, host, pid and a heartbeat.

A requeued job can overlap its predecessor; two runs saving into one folder would replace each other's
checkpoints. The lock is a file created with O_CREAT | O_EXCL, which is atomic on local disks and on the shared file
systems of clusters (NFS v3+, Lustre), where flock may not be; a thread refreshes its modification time (the
heartbeat) while the run lives.

- A second run finds the lock and is refused with one line that names the holder.
- A lock whose holder is gone is taken over, with a line that says so: its pid is dead on this host, or its
  heartbeat is older than STALE_S (another host: a crashed node stops beating). The takeover renames the stale
  file aside first, so two runs that find it stale at once cannot both take it.
- A holder on another host whose heartbeat is still fresh is watched, not refused at once: a job requeued right
  after its node crashed would otherwise fail. It is refused when its heartbeat advances (it is alive), and taken
  over when the heartbeat goes stale.
- The holder removes the lock when it stops (only its own: a lock file taken over meanwhile is left alone).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

LOCK = ".mega_depth.lock"
HEARTBEAT_S = float(os.environ.get("MEGA_DEPTH_LOCK_HEARTBEAT_S", "15"))
STALE_S = float(os.environ.get("MEGA_DEPTH_LOCK_STALE_S", "120"))


class SaveFolderLocked(Exception):
    """Another live run holds the folder (the message names it)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written, or garbage: judged by its age alone


def _describe(holder: dict) -> str:
    return (f"run {holder.get('run_id', '?')} (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))})")


class SaveLock:
    """with SaveLock(folder, run_id, purpose, say): the folder is this process's to write into."""

    def __init__(self, folder: str, run_id: str, purpose: str, say: Callable[[str], None] = print):
        self.folder, self.path = folder, os.path.join(folder, LOCK)
        self.purpose, self.say = purpose, say
        self.holder = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose,
                       "started": time.time(), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # --- taking and releasing ---------------------------------------------------------------------------------------
    def acquire(self) -> "SaveLock":
        os.makedirs(self.folder, exist_ok=True)
        for _ in range(3):
            if self._create():
                self._start_heartbeat()
                return self
            holder = _read(self.path)
            if holder is None:  # released between our attempt and the read: try again
                continue
            stale = self._stale_reason(holder)
            if stale is None and holder.get("host") != socket.gethostname():
                stale = self._watch(holder)
            if stale is None:
                raise SaveFolderLocked(
                    f"--save {self.folder} is in use by {_describe(holder)}, whose heartbeat is "
                    f"{self._age():.0f} s old: two runs must not save into one folder. Wait for it to end, or "
                    f"save this run elsewhere; if that run is gone, its lock is taken over {STALE_S:.0f} s after its "
                    f"last heartbeat (or delete {self.path})")
            aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(self.path, aside)  # one taker wins; the others find the new lock
            except FileNotFoundError:
                continue
            os.remove(aside)
            self.say(f"--save {self.folder}: took over the lock of {_describe(holder)}: {stale}")
        raise SaveFolderLocked(f"--save {self.folder}: could not take its lock {self.path} (another run keeps "
                               "taking it); save this run elsewhere")

    def update(self, run_id: str) -> None:
        """Record the run id once it is known (a resumed run inherits its checkpoint's)."""
        self.holder["run_id"] = run_id
        holder = _read(self.path)
        if not holder or holder.get("token") != self.holder["token"]:
            return
        tmp = f"{self.path}.{self.holder['token']}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.holder, f)
        os.replace(tmp, self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        holder = _read(self.path)
        if holder and holder.get("token") == self.holder["token"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SaveLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # --- internals --------------------------------------------------------------------------------------------------
    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.holder, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _age(self) -> float:
        try:
            return time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return 0.0

    def _stale_reason(self, holder: dict) -> Optional[str]:
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            return f"its process {pid} is gone"
        age = self._age()
        if age > STALE_S:
            return f"its heartbeat stopped {age:.0f} s ago"
        return None

    def _watch(self, holder: dict) -> Optional[str]:
        """Another host's holder: None once its heartbeat advances, the stale reason once it stops long enough."""
        try:
            last = os.path.getmtime(self.path)
        except FileNotFoundError:
            return "it released the lock"
        self.say(f"--save {self.folder} is locked by {_describe(holder)}; watching its heartbeat (up to "
                 f"{max(STALE_S - self._age(), 0):.0f} s) to tell a live run from a crashed node")
        while True:
            time.sleep(min(1.0, HEARTBEAT_S / 4))
            try:
                now = os.path.getmtime(self.path)
            except FileNotFoundError:
                return "it released the lock"
            if now != last:
                return None
            stale = self._stale_reason(holder)
            if stale is not None:
                return stale

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                holder = _read(self.path)
                if not holder or holder.get("token") != self.holder["token"]:
                    return  # taken over (this run was judged gone): stop touching it
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="save-lock-heartbeat", daemon=True)
        self._thread.start()
