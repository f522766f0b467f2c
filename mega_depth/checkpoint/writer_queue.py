"""megatron-core's checkpoint writer, with helper processes that die with the trainer.

dist_checkpointing's FileSystemWriterAsync (used by every save, synchronous ones included) sends its write results
through a queue served by a Manager process it spawns on first use; spawning also starts multiprocessing's resource
tracker. Neither watches its parent: after a kill -9 of the trainer both live on (about 275 MB per rank), and a
cluster node collects them with every requeue. We hand megatron-core the same kind of queue, served by a Manager
that Linux kills when its parent dies (PR_SET_PDEATHSIG); the resource tracker then sees its last pipe close and
exits too.
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


def die_with_parent(parent_pid: int) -> None:
    """Runs in the Manager process before it serves: SIGKILL when the process that started it ends."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(0)


def install() -> None:
    """Give megatron-core's writer its results queue (idempotent; call before the first dist_checkpointing.save)."""
    global _manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    _manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # spawn, as megatron-core's own
    _manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = _manager.Queue()
