"""Ports to give a child process before it binds them.

Asking the kernel for port 0 and closing the socket hands back an ephemeral port that the kernel
hands to the very next `bind(0)` or outgoing connection as readily: two agents started one after
the other were seen to get the same port, one as its HTTP port, the other as its cluster port.
So the ports handed out here come from below the kernel's ephemeral range (which `bind(0)` and
outgoing connections never use), at random, never the same twice in one process, and each is
checked free by binding it.
"""

from __future__ import annotations

import random
import socket
import threading

_LOW = 10_000
_FALLBACK_EPHEMERAL_LOW = 32_768  # Linux's default when /proc cannot be read
_TRIES = 200

_given: set[tuple[str, int]] = set()
_lock = threading.Lock()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, never handed out before by this process, and outside the
    range the kernel picks from for `bind(0)`."""
    high = _ephemeral_low() - 1
    with _lock:
        if high > _LOW:
            for _ in range(_TRIES):
                port = _rng.randint(_LOW, high)
                if (host, port) not in _given and _bindable(host, port):
                    _given.add((host, port))
                    return port
        # A host whose whole low range is taken: the kernel's pick, still never repeated here.
        for _ in range(_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if (host, port) not in _given:
                _given.add((host, port))
                return port
    raise OSError(f"no free port on {host}")
