"""`python -m mega_depth.launcher`: torchrun, with a pre-emption that ends cleanly.

    python -m mega_depth.launcher --nproc-per-node 8 --nnodes 2 --node-rank 0 ... -m mega_depth.train ...

Every argument goes to torchrun (torch.distributed.run) unchanged. What differs is the end of a SIGTERM (a
scheduler's pre-emption notice): torchrun forwards it to the workers, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds
(launch/*.sh set it from SAVE_GRACE_S; torchrun's default is 30) for them to save and exit, then kills the rest,
and finally raises a SignalException traceback with exit status 1 whatever the workers did. This launcher instead
prints one line and exits:
    0    every worker exited 0 (the trainer saved a checkpoint and stopped: resubmit with --load)
    143  (128 + SIGTERM) some worker had to be killed or failed: the newest complete checkpoint is the one before
Other signals end with 128 + the signal number.

A worker that fails (a configuration error, a refused --save folder, a crash) has printed its own message; the
launcher adds one line per failed worker, "worker N exited with code X", in place of torchrun's ChildFailedError
traceback, and exits with the first failed worker's code (128 + the signal for a killed one).
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import List, Optional

PREEMPTED = 128 + signal.SIGTERM


class _DropWorkerFailureLog(logging.Filter):
    """torchrun logs each failed worker before raising; the launcher says it once, in its own line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed (exitcode")


def shell_status(code: int) -> int:
    """A child's exit status as the shell reports it: a signal (-N) as 128 + N."""
    return 128 - code if code < 0 else code


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logging.getLogger(api.__name__).addFilter(_DropWorkerFailureLog())

    exit_codes: List[Optional[int]] = []
    close = api.SubprocessContext._close

    def close_and_record(self, death_sig, timeout=30):  # the workers' own statuses, which torchrun discards
        close(self, death_sig, timeout)
        exit_codes.extend(h.proc.returncode for h in self.subprocess_handlers.values())

    api.SubprocessContext._close = close_and_record
    try:
        torchrun(argv)
    except ChildFailedError as e:
        first, failure = e.get_first_failure()  # the root cause; torchrun then stops the others (SIGTERM)
        print(f"mega_depth.launcher: worker {first} exited with code {failure.exitcode}", file=sys.stderr)
        others = [rank for rank, f in sorted(e.failures.items()) if rank != first]
        if others:
            print(f"mega_depth.launcher: worker(s) {', '.join(map(str, others))} stopped with it", file=sys.stderr)
        return shell_status(failure.exitcode) or 1
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        clean = sig == signal.SIGTERM and exit_codes and all(code == 0 for code in exit_codes)
        code = 0 if clean else 128 + int(sig)
        outcome = "the workers saved and stopped" if clean else f"worker exit statuses {exit_codes or 'unknown'}"
        print(f"mega_depth.launcher: {sig.name} received; {outcome}; exit {code}", file=sys.stderr)
        return code
    finally:
        api.SubprocessContext._close = close
    return 0


if __name__ == "__main__":
    sys.exit(main())
