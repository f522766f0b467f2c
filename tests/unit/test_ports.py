"""mega_depth/ports.py: a rendezvous port that an outgoing connection cannot take before the rendezvous binds it."""

import socket

from mega_depth import ports


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
