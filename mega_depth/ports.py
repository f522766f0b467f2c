"""A free TCP port for a rendezvous (torchrun's, a test's process group), below the kernel's ephemeral range.

A port from bind(0) is ephemeral: between its release and the rendezvous's own bind, any process's outgoing
connection (gloo opens many) can be given it, and the launch fails with EADDRINUSE. A free port below that range is
never handed out that way; only another explicit bind to the same number could take it. No torch import: the launch
scripts ask for a port before anything starts.

MEGA_DEPTH_PORT_RANGE=LOW-HIGH confines the draw to those ports: a firewall's open range, or one test worker's share
(tests/fixtures.py), so that two workers cannot both draw a port before either's rendezvous binds it. A port derived
from a scheduler's job id (`job_port`, what every node of a multi-node launch computes alike) keeps to it too."""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import zlib
from typing import Optional, Tuple

LOWEST = 20000  # above the registered services most hosts run
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
RANGE_ENV = "MEGA_DEPTH_PORT_RANGE"
TRIES = 64


class PortRangeError(ValueError):
    """RANGE_ENV cannot give a port: malformed, or every try in it taken. The message says what to change."""


def _ephemeral_start() -> int:
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _range_from_env() -> Optional[Tuple[int, int]]:
    """RANGE_ENV's (low, high), both included; None where it is unset or empty."""
    value = os.environ.get(RANGE_ENV, "").strip()
    if not value:
        return None
    low, _, high = value.partition("-")
    if low.strip().isdigit() and high.strip().isdigit() and 1024 <= int(low) <= int(high) <= 65535:
        return int(low), int(high)
    raise PortRangeError(f"{RANGE_ENV}={value!r} is not a port range: give LOW-HIGH with 1024 <= LOW <= HIGH <= "
                         f"65535 (e.g. 20000-20999), or unset it")


def worker_share(index: int, count: int) -> Optional[Tuple[int, int]]:
    """Worker `index` of `count`'s slice of the ports between LOWEST and the ephemeral range, the slices disjoint;
    None where the range leaves fewer than TRIES ports a worker."""
    span = (_ephemeral_start() - LOWEST) // count
    if span < TRIES:
        return None
    low = LOWEST + index * span
    return low, low + span - 1


def free_port() -> int:
    """A port no process listens on: in RANGE_ENV where it is set, else between LOWEST and the ephemeral range
    (bind(0)'s, where that range leaves no room or every try is taken)."""
    confined = _range_from_env()
    if confined is not None:
        for _ in range(TRIES):
            port = random.randint(*confined)
            if _free(port):
                return port
        raise PortRangeError(f"no free port in {RANGE_ENV}={confined[0]}-{confined[1]} after {TRIES} tries: "
                             f"widen the range, or unset it")
    top = _ephemeral_start() - 1
    for _ in range(TRIES):
        if top <= LOWEST:
            break
        port = random.randint(LOWEST, top)
        if _free(port):
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def job_port(job_id: str) -> int:
    """The port every node of job `job_id` derives alike, without talking to the others: a hash of the id into
    RANGE_ENV where it is set, else into LOWEST up to the ephemeral range (Linux's default where this host's leaves
    too little room, so that nodes with different ranges still agree). Not checked free: it is on another node
    that the rendezvous binds it."""
    confined = _range_from_env()
    if confined is None:
        top = _ephemeral_start() - 1
        confined = (LOWEST, top if top - LOWEST >= TRIES else 32767)
    low, high = confined
    return low + zlib.crc32(job_id.encode()) % (high - low + 1)


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mega_depth.ports", description=__doc__.splitlines()[0])
    parser.add_argument("--job", metavar="ID", help="derive the port from this scheduler job id (the same on "
                        "every node) instead of drawing a free one")
    args = parser.parse_args(argv)
    try:
        print(job_port(args.job) if args.job else free_port())
    except PortRangeError as error:  # launch/common.sh: one line, not a traceback
        sys.exit(f"mega_depth.ports: {error}")


if __name__ == "__main__":
    main()
