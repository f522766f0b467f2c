"""A free TCP port for a rendezvous (torchrun's, a test's process group), below the kernel's ephemeral range.

A port from bind(0) is ephemeral: between its release and the rendezvous's own bind, any process's outgoing
connection (gloo opens many) can be given it, and the launch fails with EADDRINUSE. A free port below that range is
never handed out that way; only another explicit bind to the same number could take it. No torch import: the launch
scripts ask for a port before anything starts."""

from __future__ import annotations

import random
import socket

LOWEST = 20000  # above the registered services most hosts run
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


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


def free_port() -> int:
    """A port no process listens on, between LOWEST and the ephemeral range (bind(0)'s, where that range leaves no
    room or every try is taken)."""
    top = _ephemeral_start() - 1
    for _ in range(64):
        if top <= LOWEST:
            break
        port = random.randint(LOWEST, top)
        if _free(port):
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    print(free_port())
