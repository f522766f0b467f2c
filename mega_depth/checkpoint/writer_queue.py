"""megatron-core's checkpoint writer, with helper processes that die with the trainer.

dist_checkpointing's FileSystemWriterAsync (used by every save, synchronous ones included) sends its write results
through a queue served by a Manager process it spawns on first use; spawning also starts multiprocessing's resource
tracker. Neither watches its parent: after a kill -9 of the trainer both live on (about 275 MB per rank), and a
cluster node collects them with every requeue. We hand megatron-core the same kind of queue, served by a Manager
that Linux kills when its parent dies (PR_SET_PDEATHSIG); the resource tracker then sees its last pipe close and
exits too.

Each save also forks one writer process per bucket (`write_preloaded_data_multiproc`). A writer that outlives a
kill -9 of the trainer waits forever on the trainer's side of their completion queue, and keeps the trainer's
stdout open, so whatever reads that output (a launcher, a test) hangs with it. Those writers get the same
parent-death signal.

A pre-emption reaches the whole process group, not the trainer alone: torchrun stops its workers with
`os.killpg(SIGTERM)`, and so does a scheduler that signals a job's processes. The trainer answers SIGTERM by saving
(training/trainer.py), and that save needs these helpers, so they ignore SIGTERM and SIGINT: they end with the
trainer instead (above), never before it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_manager = None
_forking_pid = 0  # the process that forks the bucket writers; a forked writer inherits the value


def die_with_parent(parent_pid: int) -> None:
    """Runs in a helper (the Manager before it serves, a bucket writer before it writes): SIGKILL when the process
    that started it ends, and deaf to the pre-emption signals its process group receives (module doc)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(0)


def _writers_die_with_parent(writer_class) -> None:
    """Wrap the writer's fork-side and worker-side static methods: the worker asks for SIGKILL when the forker ends."""
    if getattr(writer_class, "_mega_depth_writers_die_with_parent", False):
        return
    fork_writers = writer_class.write_preloaded_data_multiproc
    write_bucket = writer_class.write_preloaded_data

    def fork_writers_recording_pid(*args, **kwargs):
        global _forking_pid
        _forking_pid = os.getpid()
        return fork_writers(*args, **kwargs)

    def write_bucket_dying_with_parent(*args, **kwargs):
        die_with_parent(_forking_pid)
        return write_bucket(*args, **kwargs)

    writer_class.write_preloaded_data_multiproc = staticmethod(fork_writers_recording_pid)
    writer_class.write_preloaded_data = staticmethod(write_bucket_dying_with_parent)
    writer_class._mega_depth_writers_die_with_parent = True


def install() -> None:
    """Make megatron-core's writer helpers die with this process (idempotent; call before the first save)."""
    global _manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _writers_die_with_parent(filesystem_async.FileSystemWriterAsync)
    if filesystem_async._results_queue is not None:
        return
    _manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # spawn, as megatron-core's own
    _manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = _manager.Queue()
