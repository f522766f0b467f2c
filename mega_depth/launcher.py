"""`python -m mega_depth.launcher`: torchrun, with a pre-emption that ends cleanly.

    python -m mega_depth.launcher --nproc-per-node 8 --nnodes 2 --node-rank 0 ... -m mega_depth.train ...

Every argument goes to torchrun (torch.distributed.run) unchanged. What differs is the end of a SIGTERM (a
scheduler's pre-emption notice): torchrun forwards it to the workers, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds
(launch/*.sh set it from SAVE_GRACE_S; torchrun's default is 30) for them to save and exit, then kills the rest,
and finally raises a SignalException traceback with exit status 1 whatever the workers did. This launcher instead
prints one line and exits:
    0    every worker exited 0 (the trainer saved a checkpoint and stopped: resubmit with --load)
    143  (128 + SIGTERM) some worker had to be killed or failed: the newest complete checkpoint is the one before
Other signals end with 128 + the signal number. A run that is not signalled ends with torchrun's own status.
"""

from __future__ import annotations

import signal
import sys
from typing import List, Optional

PREEMPTED = 128 + signal.SIGTERM


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    exit_codes: List[Optional[int]] = []
    close = api.SubprocessContext._close

    def close_and_record(self, death_sig, timeout=30):  # the workers' own statuses, which torchrun discards
        close(self, death_sig, timeout)
        exit_codes.extend(h.proc.returncode for h in self.subprocess_handlers.values())

    api.SubprocessContext._close = close_and_record
    try:
        torchrun(argv)
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
