"""The launchers' exit statuses, without launching: a worker killed by a signal ends the launch with 128 + the
signal, as the shell reports it (a scheduler's requeue rules read it), whichever launcher ran it."""

import signal
import sys
import types

import pytest


@pytest.mark.parametrize("worker_exit, status", [(-signal.SIGKILL, 137), (-signal.SIGSEGV, 139), (3, 3), (0, 1)])
def test_a_failed_deepspeed_worker_ends_the_node_launch_with_the_shells_status(monkeypatch, worker_exit, status):
    """DeepSpeed's node launcher exits with the failed worker's returncode: -9 for a SIGKILL, which Python's exit
    turned into 247. (0 is no failure DeepSpeed reports; a failure branch never exits 0.)"""
    from mega_depth import ds_launcher

    def failed():
        sys.exit(worker_exit)

    fake = types.SimpleNamespace(main=failed, signal=signal, terminate_process_tree=None)
    monkeypatch.setitem(sys.modules, "deepspeed.launcher.launch", fake)
    import deepspeed.launcher

    monkeypatch.setattr(deepspeed.launcher, "launch", fake, raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert ds_launcher.run_node(["--world_info", "x"]) == status


def test_the_shells_status_of_a_child():
    from mega_depth.launcher import shell_status

    assert [shell_status(c) for c in (0, 1, -signal.SIGTERM, -signal.SIGKILL)] == [0, 1, 143, 137]
