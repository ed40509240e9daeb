"""Ports handed to child processes: never twice, never from the kernel's ephemeral range."""

import socket

from skulkp2p import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)
    assert all(ports._LOW <= p < low for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))


def test_a_port_the_kernel_just_released_is_not_handed_out():
    # What collided before: bind(0), close, and the same port handed to the next child.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        kernel = s.getsockname()[1]
    assert kernel not in {ports.free_port() for _ in range(50)}


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken, *range(2000, 2200)])
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65535)
        monkeypatch.setattr(ports._rng, "randint", lambda a, b: next(picks))
        monkeypatch.setattr(ports, "_LOW", 1024)
        port = ports.free_port()
        assert port != taken
