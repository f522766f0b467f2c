"""One writer per save folder: a lock file with the holder's run id, host, pid and a heartbeat.

A requeued job can overlap its predecessor; two runs saving into one folder would replace each other's
checkpoints. The lock is a file created with O_CREAT | O_EXCL, which is atomic on local disks and on the shared file
systems of clusters (NFS v3+, Lustre), where flock may not be; a thread refreshes its modification time (the
heartbeat) while the run lives.

- A second run finds the lock and is refused with one line that names the holder.
- A lock whose holder is gone is taken over, with a line that says so: its pid is dead on this host (in this
  pid namespace), or its heartbeat is older than STALE_S (another host: a crashed node stops beating). The
  takeover renames the stale file aside first, so two runs that find it stale at once cannot both take it.
- A holder on another host (or in another pid namespace of this one: a container) whose heartbeat is still fresh
  is watched, not refused at once: a job requeued right after its node crashed would otherwise fail. It is refused
  when its heartbeat advances (it is alive), and taken over when the heartbeat goes stale; a lock released or
  replaced meanwhile is judged afresh, never taken over on the old one's verdict.
- The holder removes the lock when it stops (only its own: a lock file taken over meanwhile is left alone).
- The holder verifies that the file still holds its token at every heartbeat and before every save; if it does not
  (deleted, overwritten, taken over while this process was frozen past the stale limit), the run stops with one line
  instead of writing beside whoever holds the folder now.
- A takeover renames the stale file aside and checks that what it moved is the very file it judged (inode,
  modification time and token); if another taker got there first, it puts the file back and is refused.
- MEGA_DEPTH_LOCK_HEARTBEAT_S (15) and MEGA_DEPTH_LOCK_STALE_S (120) are read once, and the stale limit must exceed
  two heartbeats (or a live run's lock would be taken over).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional, Tuple

from mega_depth.config import ConfigError

LOCK = ".mega_depth.lock"
HEARTBEAT_VAR, STALE_VAR = "MEGA_DEPTH_LOCK_HEARTBEAT_S", "MEGA_DEPTH_LOCK_STALE_S"
HEARTBEAT_S: Optional[float] = None  # from the environment on first use (timing()); tests set them directly
STALE_S: Optional[float] = None


class SaveFolderLocked(ConfigError):
    """The folder's lock cannot be had or kept: another live run holds it, it was lost, or it cannot be written
    (the message names which)."""


def _seconds(var: str, default: float) -> float:
    text = os.environ.get(var)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise SaveFolderLocked(f"{var}={text!r} is not a positive number of seconds; unset it (default "
                               f"{default:.0f}) or give one, e.g. {var}={default:.0f}")
    return value


def timing() -> Tuple[float, float]:
    """(heartbeat, stale limit) in seconds, read from the environment once per process."""
    global HEARTBEAT_S, STALE_S
    if HEARTBEAT_S is None:
        HEARTBEAT_S = _seconds(HEARTBEAT_VAR, 15.0)
    if STALE_S is None:
        STALE_S = _seconds(STALE_VAR, 120.0)
    if STALE_S <= 2 * HEARTBEAT_S:
        stale, heartbeat = STALE_S, HEARTBEAT_S
        STALE_S = None  # refused: read again (and refused again) by the next lock
        raise SaveFolderLocked(f"{STALE_VAR}={stale:g} is at or below two heartbeats ({HEARTBEAT_VAR}={heartbeat:g}):"
                               f" a live run's lock would be taken over; give more than {2 * heartbeat:g} s, or "
                               "unset it (default 120)")
    return HEARTBEAT_S, STALE_S


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_namespace() -> Optional[int]:
    """The inode of this process's pid namespace (Linux), or None where there is none to read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _inspect(path: str) -> Tuple[Optional[dict], Optional[tuple]]:
    """(holder, identity) of the lock file, both from one open file: holder None if there is no file, {} if it is
    being written or garbage; identity (inode, mtime in ns)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            text = f.read()
    except FileNotFoundError:
        return None, None
    except OSError:
        return {}, None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return (holder if isinstance(holder, dict) else {}), (st.st_ino, st.st_mtime_ns)


def _read(path: str) -> Optional[dict]:
    return _inspect(path)[0]


def _describe(holder: dict) -> str:
    return (f"run {holder.get('run_id', '?')} (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))})")


class SaveLock:
    """with SaveLock(folder, run_id, purpose, say): the folder is this process's to write into."""

    def __init__(self, folder: str, run_id: str, purpose: str, say: Callable[[str], None] = print):
        self.folder, self.path = folder, os.path.join(folder, LOCK)
        self.purpose, self.say = purpose, say
        self.holder = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "pid_ns": _pid_namespace(),
                       "purpose": purpose, "started": time.time(), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None  # set by the heartbeat when the file stops holding this run's token

    # --- taking and releasing ---------------------------------------------------------------------------------------
    def acquire(self) -> "SaveLock":
        heartbeat, stale_s = timing()
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:  # (raised on rank 0 alone, the other ranks would wait at the broadcast of its answer)
            raise SaveFolderLocked(f"--save {self.folder} cannot be created ({e.strerror or e}); pick a --save "
                                   "folder this run can write, or fix the path's permissions") from None
        for _ in range(4):  # (a watch, a takeover and a create can take one round each)
            if self._create():
                self._start_heartbeat(heartbeat)
                return self
            holder, identity = _inspect(self.path)
            if holder is None:  # released between our attempt and the read: try again
                continue
            stale = self._stale_reason(holder, identity, stale_s)
            if stale is None and not self._same_processes(holder):
                if self._watch(holder, heartbeat, stale_s) is not None:
                    continue  # released or gone stale: judged afresh (a new holder may have taken it meanwhile)
                holder, identity = _inspect(self.path)
                if holder is None:
                    continue
            if stale is None:
                raise SaveFolderLocked(
                    f"--save {self.folder} is in use by {_describe(holder)}, whose heartbeat is "
                    f"{self._age(identity):.0f} s old: two runs must not save into one folder. Wait for it to end, "
                    f"or save this run elsewhere; if that run is gone, its lock is taken over {stale_s:.0f} s after "
                    f"its last heartbeat (or delete {self.path})")
            if self._take(holder, identity):
                self.say(f"--save {self.folder}: took over the lock of {_describe(holder)}: {stale}")
        raise SaveFolderLocked(f"--save {self.folder}: could not take its lock {self.path} (another run keeps "
                               "taking it); save this run elsewhere")

    def _before_takeover(self) -> None:
        """Between judging a lock stale and moving it aside (a test widens this window)."""

    def _take(self, holder: dict, identity: Optional[tuple]) -> bool:
        """Move the judged lock file aside and delete it, if what moved is that very file; otherwise put it back
        (another taker was first and this is its fresh lock). True if the judged file is gone."""
        self._before_takeover()
        aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved, moved_identity = _inspect(aside)
        if identity is not None and moved_identity == identity and moved.get("token") == holder.get("token"):
            os.remove(aside)
            return True
        try:
            os.link(aside, self.path)  # put back, unless a newer lock stands there already
        except FileExistsError:
            pass
        os.remove(aside)
        return False

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

    def verify(self) -> Optional[str]:
        """None while the lock file holds this run's token; else why it does not (what the run must stop for)."""
        for attempt in range(2):
            holder = _read(self.path)
            if holder and holder.get("token") == self.holder["token"]:
                return None
            if attempt == 0:
                time.sleep(0.2)  # a taker that moved our file aside by mistake puts it back at once
        if holder is None:
            return f"its lock file {self.path} was deleted"
        if not holder:
            return f"its lock file {self.path} was overwritten with something unreadable"
        return f"its lock file {self.path} now names {_describe(holder)}"

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
        except OSError as e:
            raise SaveFolderLocked(f"--save {self.folder}: cannot create its lock file {self.path} ({e.strerror}); "
                                   "free space there or fix its permissions, or pick another --save") from None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.holder, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a full disk: leave no empty lock that the next run would have to wait out
            os.remove(self.path)
            raise SaveFolderLocked(f"--save {self.folder}: cannot write its lock file {self.path} ({e.strerror}); "
                                   "free space there, or pick another --save") from None
        return True

    def _age(self, identity: Optional[tuple]) -> float:
        return 0.0 if identity is None else time.time() - identity[1] / 1e9

    def _same_processes(self, holder: dict) -> bool:
        """Whether the holder's pid can be looked up here: the same host and pid namespace (containers that share a
        host name, e.g. with the host's network, do not share their pids; a holder from before pid_ns was recorded
        counts by its host)."""
        return holder.get("host") == socket.gethostname() and holder.get("pid_ns", self.holder["pid_ns"]) == \
            self.holder["pid_ns"]

    def _stale_reason(self, holder: dict, identity: Optional[tuple], stale_s: float) -> Optional[str]:
        pid = holder.get("pid")
        if self._same_processes(holder) and isinstance(pid, int) and not _pid_alive(pid):
            return f"its process {pid} is gone"
        age = self._age(identity)
        if age > stale_s:
            return f"its heartbeat stopped {age:.0f} s ago"
        return None

    def _watch(self, holder: dict, heartbeat: float, stale_s: float) -> Optional[str]:
        """Another host's holder: None once its heartbeat advances, the stale reason once it stops long enough."""
        _, identity = _inspect(self.path)
        if identity is None:
            return "it released the lock"
        self.say(f"--save {self.folder} is locked by {_describe(holder)}; watching its heartbeat (up to "
                 f"{max(stale_s - self._age(identity), 0):.0f} s) to tell a live run from a crashed node")
        while True:
            time.sleep(min(1.0, heartbeat / 4))
            _, now = _inspect(self.path)
            if now is None:
                return "it released the lock"
            if now != identity:
                return None
            stale = self._stale_reason(holder, now, stale_s)
            if stale is not None:
                return stale

    def _start_heartbeat(self, heartbeat: float) -> None:
        def beat():
            while not self._stop.wait(heartbeat):
                lost = self.verify()
                if lost is not None:  # stop touching it; the run stops at its next step (trainer)
                    self.lost = lost
                    return
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="save-lock-heartbeat", daemon=True)
        self._thread.start()
