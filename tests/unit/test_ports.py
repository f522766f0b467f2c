"""mega_depth/ports.py: a rendezvous port that an outgoing connection cannot take before the rendezvous binds it."""

import os
import socket
import subprocess

from mega_depth import ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    start = ports._ephemeral_start()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < start
        with socket.socket() as s:
            s.bind(("", port))  # nobody holds it


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as held:
        taken = ports.free_port()  # below the ephemeral range, where the next port is as unlikely to be in use
        held.bind(("", taken))
        held.listen()
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: taken + 2)  # the range holds `taken` and one more
        assert {ports.free_port() for _ in range(10)} == {taken + 1}


def test_no_room_below_the_ephemeral_range_falls_back_to_any_free_port(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports.LOWEST)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("", port))


def test_a_port_derived_from_a_job_id_is_below_the_ephemeral_range_and_alike_for_one_job():
    """launch/common.sh: every node of a job derives one port from the scheduler's job id, below the ephemeral
    range (a port inside it can be given to an outgoing connection before torchrun binds it)."""
    script = ('source launch/common.sh; for id in $(seq 1 300) 7.pbs-server job-xyz; do SLURM_JOB_ID=$id '
              'master_port; done')
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "PBS_JOBID", "LSB_JOBID", "JOB_ID")}
    derived = lambda: [int(p) for p in subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, check=True,
                                                      capture_output=True, text=True).stdout.split()]
    ports_now = derived()
    assert len(ports_now) == 302 and all(ports.LOWEST <= p < ports._ephemeral_start() for p in ports_now)
    assert derived() == ports_now and len(set(ports_now)) > 250  # the same on every node; spread over the jobs
