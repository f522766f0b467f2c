"""mega_depth/ports.py: a rendezvous port that an outgoing connection cannot take before the rendezvous binds it."""

import os
import socket
import subprocess
import sys

import pytest

from mega_depth import ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_free_port_is_below_the_ephemeral_range_and_bindable(monkeypatch):
    monkeypatch.delenv(ports.RANGE_ENV, raising=False)  # the suite's worker share (tests/fixtures.py)
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
        monkeypatch.delenv(ports.RANGE_ENV, raising=False)
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: taken + 2)  # the range holds `taken` and one more
        assert {ports.free_port() for _ in range(10)} == {taken + 1}


def test_no_room_below_the_ephemeral_range_falls_back_to_any_free_port(monkeypatch):
    monkeypatch.delenv(ports.RANGE_ENV, raising=False)
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports.LOWEST)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("", port))


JOB_IDS = [str(i) for i in range(1, 19)] + ["7.pbs-server", "job-xyz"]


def _master_ports(job_ids, **env_overrides):
    """What launch/common.sh's master_port prints for each job id: (its ports, its stderr, its status)."""
    script = 'source launch/common.sh; for id in "$@"; do SLURM_JOB_ID=$id master_port || exit; done'
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "PBS_JOBID", "LSB_JOBID", "JOB_ID", ports.RANGE_ENV)}
    env.update(env_overrides)
    proc = subprocess.run(["bash", "-c", script, "master_port", *job_ids], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    return [int(p) for p in proc.stdout.split()], proc.stderr, proc.returncode


def test_a_port_derived_from_a_job_id_is_below_the_ephemeral_range_and_alike_for_one_job(monkeypatch):
    """launch/common.sh: every node of a job derives one port from the scheduler's job id, below the ephemeral
    range (a port inside it can be given to an outgoing connection before torchrun binds it)."""
    monkeypatch.delenv(ports.RANGE_ENV, raising=False)
    derived = [ports.job_port(str(i)) for i in range(1, 301)]
    assert all(ports.LOWEST <= p < ports._ephemeral_start() for p in derived)
    assert len(set(derived)) > 250  # spread over the jobs
    shell_ports, stderr, status = _master_ports(JOB_IDS)
    assert status == 0, stderr
    assert shell_ports == [ports.job_port(job) for job in JOB_IDS]  # the same on every node: a function of the id


def test_a_port_derived_from_a_job_id_keeps_to_the_port_range(monkeypatch):
    """A cluster whose firewall opens one range: the job's port lies in it, on every node alike; a range that is
    not one stops the launch with the one line that says how to write it, before any rendezvous."""
    monkeypatch.setenv(ports.RANGE_ENV, "41000-41015")
    assert {ports.job_port(str(i)) for i in range(200)} == set(range(41000, 41016))
    shell_ports, stderr, status = _master_ports(JOB_IDS, **{ports.RANGE_ENV: "41000-41015"})
    assert status == 0, stderr
    assert shell_ports == [ports.job_port(job) for job in JOB_IDS]
    shell_ports, stderr, status = _master_ports(["4242"], **{ports.RANGE_ENV: "41000"})
    assert status == 1 and shell_ports == []
    assert stderr.strip().splitlines() == [f"mega_depth.ports: {ports.RANGE_ENV}='41000' is not a port range: give "
                                           f"LOW-HIGH with 1024 <= LOW <= HIGH <= 65535 (e.g. 20000-20999), or "
                                           f"unset it"]


def test_a_slurm_job_whose_port_cannot_be_derived_stops_before_srun(tmp_path):
    """launch/slurm.sbatch: `export MASTER_PORT=$(master_port)` had export's status, so set -e went on and srun
    started every node's torchrun on an empty port. The good launch reads its address from a long node list (the
    first node), whose reader must not end the list's writer early."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun_ran = tmp_path / "srun-ran"
    # a long node list, written as scontrol writes one (more than a pipe holds): the first node is the address
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node0\ni=1; while [ $i -le 20000 ]; do echo node$i; "
                                      "i=$((i+1)); done\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\ntouch {srun_ran}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[0-1]",
                "SLURM_SUBMIT_DIR": ROOT, "PY": sys.executable, ports.RANGE_ENV: "not-a-range"})
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch/slurm.sbatch"), "--mock-data"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and not srun_ran.exists(), proc.stderr[-2000:]
    assert f"{ports.RANGE_ENV}='not-a-range' is not a port range" in proc.stderr
    env[ports.RANGE_ENV] = "41000-41015"  # the same launch with a good range reaches srun, with the job's port
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$MASTER_ADDR:$MASTER_PORT" > {srun_ran}\n')
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch/slurm.sbatch"), "--mock-data"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with_range = {**os.environ, ports.RANGE_ENV: "41000-41015"}
    expected = subprocess.run([sys.executable, "-m", "mega_depth.ports", "--job", "4242"], env=with_range,
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert srun_ran.read_text().strip() == f"node0:{expected}"


def test_a_port_range_in_the_environment_confines_the_draw(monkeypatch):
    with socket.socket() as held:
        taken = ports.free_port()
        held.bind(("", taken))
        held.listen()
        monkeypatch.setenv(ports.RANGE_ENV, f"{taken}-{taken + 1}")
        assert {ports.free_port() for _ in range(10)} == {taken + 1}
        monkeypatch.setenv(ports.RANGE_ENV, f"{taken}-{taken}")  # its one port taken: an error, not a port outside
        with pytest.raises(ports.PortRangeError, match=f"no free port in {ports.RANGE_ENV}={taken}-{taken} .*widen"):
            ports.free_port()


@pytest.mark.parametrize("value", ["30000", "abc-def", "30000-20000", "80-90", "30000-70000", "-1-5"])
def test_a_malformed_port_range_is_one_line_that_says_how_to_write_it(monkeypatch, value):
    monkeypatch.setenv(ports.RANGE_ENV, value)
    with pytest.raises(ports.PortRangeError, match=f"{ports.RANGE_ENV}='{value}' is not a port range: give LOW-HIGH"):
        ports.free_port()
    proc = subprocess.run([sys.executable, "-m", "mega_depth.ports"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **{ports.RANGE_ENV: value}))  # what launch/common.sh runs
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"mega_depth.ports: {ports.RANGE_ENV}='{value}' is not a port "
                                                f"range: give LOW-HIGH with 1024 <= LOW <= HIGH <= 65535 (e.g. "
                                                f"20000-20999), or unset it"]


def test_the_test_workers_draw_from_disjoint_shares_below_the_ephemeral_range():
    start = ports._ephemeral_start()
    for count in (1, 2, 3, 8):
        shares = [ports.worker_share(i, count) for i in range(count)]
        assert all(ports.LOWEST <= low <= high < start and high - low + 1 >= ports.TRIES for low, high in shares)
        assert all(shares[i][1] < shares[i + 1][0] for i in range(count - 1))  # disjoint, in order
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # this suite's worker was given its share (tests/fixtures.py), and its launches inherit it
        share = ports.worker_share(int(worker[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        assert os.environ[ports.RANGE_ENV] == f"{share[0]}-{share[1]}"
        from fixtures import ENV

        assert ENV[ports.RANGE_ENV] == os.environ[ports.RANGE_ENV]


def test_no_share_where_the_range_below_the_ephemeral_one_is_too_small(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports.LOWEST + 2 * ports.TRIES - 1)
    assert ports.worker_share(0, 1) is not None and ports.worker_share(0, 2) is None


def test_a_process_group_without_a_launchers_port_draws_one_and_a_bad_range_is_a_config_error(monkeypatch):
    """mega_depth/training/distributed.py: one plain process draws its rendezvous port (a launcher's is kept, with
    no draw beside it, so a range it never needs cannot fail it); a range that gives none is the one-line config
    error that `mega_depth.train` prints, not a traceback."""
    import torch

    from mega_depth.config import ConfigError
    from mega_depth.training import distributed

    started = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda **kwargs: started.append(os.environ["MASTER_PORT"]))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(ports.RANGE_ENV, "not-a-range")
    monkeypatch.setenv("MASTER_PORT", "29417")
    assert distributed.init_process_group() == 1 and started == ["29417"]
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ConfigError, match=f"{ports.RANGE_ENV}='not-a-range' is not a port range"):
        distributed.init_process_group()
    assert started == ["29417"] and "MASTER_PORT" not in os.environ
    monkeypatch.delenv(ports.RANGE_ENV)
    with socket.socket() as held:  # a drawn port comes from the range
        taken = ports.free_port()
        held.bind(("", taken))
        monkeypatch.setenv(ports.RANGE_ENV, f"{taken}-{taken + 1}")
        assert distributed.init_process_group() == 1 and started == ["29417", str(taken + 1)]
