"""`python -m mega_depth.ds_launcher`: the `deepspeed` launcher, with a pre-emption that ends cleanly.

    python -m mega_depth.ds_launcher --num_gpus 8 --module mega_depth.train --deepspeed ...

Every argument goes to DeepSpeed's runner (deepspeed.launcher.runner) unchanged. What differs, on a local launch
(one node, or --no_ssh on each node), is the end of a SIGTERM (a scheduler's pre-emption notice). DeepSpeed's
node launcher (deepspeed.launcher.launch) forwards it to the workers, kills them 30 s later (a fixed timeout, too
short for a large save), and exits 1 whatever they did; its runner has no handler and dies at once. Here the node
launcher gives the workers SAVE_GRACE_S seconds (default 100, as launch/common.sh sets it) and exits as
mega_depth.launcher does for torchrun:
    0    every worker exited 0 (the trainer saved a checkpoint and stopped: resubmit with --load)
    143  (128 + SIGTERM) some worker had to be killed or failed: the newest complete checkpoint is the one before
and the runner passes the SIGTERM on to it and returns its status. A launch over ssh (pdsh: a hostfile without
--no_ssh) keeps DeepSpeed's own handling: its runner stops the remote workers at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import List, Optional

from mega_depth.launcher import PREEMPTED, shell_status  # one exit status for a pre-emption, whichever launcher

NODE = "--node"  # the runner starts this module with it in place of deepspeed.launcher.launch


def _grace_s() -> float:
    return float(os.environ.get("SAVE_GRACE_S") or 100)


class _RunnerSubprocess:
    """The runner's `subprocess`: its local launch command runs this module's node launcher instead of DeepSpeed's
    (the same arguments); every other call is the real module's."""

    def __init__(self):
        self.started: List[subprocess.Popen] = []

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, cmd, *args, **kwargs):  # noqa: N802 (subprocess's name)
        cmd = list(cmd)
        if cmd[1:4] == ["-u", "-m", "deepspeed.launcher.launch"]:
            cmd[3:4] = ["mega_depth.ds_launcher", NODE]
        proc = subprocess.Popen(cmd, *args, **kwargs)
        self.started.append(proc)
        return proc


def run_runner(argv: List[str]) -> int:
    from deepspeed.launcher import runner

    shim = _RunnerSubprocess()
    runner.subprocess = shim

    def forward(signum, frame):  # the node launcher saves and stops; the runner waits for it (pdsh: its own handler)
        for proc in shim.started:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        runner.main(argv)
    except SystemExit as e:  # the runner exits with a failed child's code
        return shell_status(e.code) if isinstance(e.code, int) else 1
    return 0


def run_node(argv: List[str]) -> int:
    """deepspeed.launcher.launch with the grace period and the exit status above."""
    import psutil
    from deepspeed.launcher import launch

    grace, statuses, received = _grace_s(), [], []

    def stop_workers(pid: int) -> None:
        """launch.terminate_process_tree, which DeepSpeed calls for one worker after another: the first call stops
        every worker at once (they save together: a save is collective) and, after a SIGTERM, waits `grace` for
        them (DeepSpeed's 30 s when a failed worker stops the rest); it records each worker's exit status, or
        "killed"."""
        me = psutil.Process()
        workers = me.children()
        tree = me.children(recursive=True)
        for p in tree:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        gone, alive = psutil.wait_procs(tree, timeout=grace if received else 30)
        for p in alive:
            p.kill()
        ids = {w.pid for w in workers}
        statuses.extend(["killed" if p in alive else p.returncode for p in gone + alive if p.pid in ids])

    class _Signal:  # launch's `signal`: its SIGTERM handler runs once (a job signal can arrive twice: group + runner)
        def __getattr__(self, name):
            return getattr(signal, name)

        @staticmethod
        def signal(signum, handler):
            if signum != signal.SIGTERM:
                return signal.signal(signum, handler)

            def once(sig, frame):
                if not received:
                    received.append(sig)
                    handler(sig, frame)

            return signal.signal(signum, once)

    launch.terminate_process_tree, launch.signal = stop_workers, _Signal()
    sys.argv = ["deepspeed.launcher.launch"] + argv
    try:
        launch.main()
    except SystemExit as e:
        if not received:  # a worker failed: DeepSpeed stopped the others and exits with its code (-N: a signal,
            return (shell_status(e.code) or 1) if isinstance(e.code, int) else 1  # which would exit 256 - N)
        clean = bool(statuses) and all(code == 0 for code in statuses)
        code = 0 if clean else PREEMPTED
        outcome = "the workers saved and stopped" if clean else f"worker exit statuses {statuses}"
        print(f"mega_depth.ds_launcher: SIGTERM received; {outcome}; exit {code}", file=sys.stderr, flush=True)
        return code
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_node(argv[1:]) if argv[:1] == [NODE] else run_runner(argv)


if __name__ == "__main__":
    sys.exit(main())
