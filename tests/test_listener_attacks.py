"""Strangers against a real `join` node's listeners (cluster/handshake.py), on 127.0.0.0/8: the
ring's data port and the control port read nothing large before a connection proves the secret,
close trickling and idle connections at the handshake's deadline, keep slots for members, refuse
replayed frames and log refusals a line per 10 s; meanwhile the node serves, and afterwards its
memory and descriptors are what they were. Attackers connect from their own loopback addresses
(`-s` prints the measurements)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from skulkp2p import wire
from skulkp2p.cluster.handshake import HANDSHAKE_TIMEOUT_S, MAX_PER_ADDRESS, MAX_STRANGERS
from tests.helpers.http_client import call
from tests.helpers.procs import SECRET, ProcCluster, ProcNode, loopback_ips_usable

pytestmark = pytest.mark.skipif(not loopback_ips_usable(), reason="needs 127.0.0.0/8")

CHAT = [{"role": "user", "content": "Say something."}]
KEY = wire.frame_key(SECRET)


def _rss_mb(pid: int) -> float:
    text = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _sources(n: int) -> list[str]:
    """``n`` loopback addresses outside ProcCluster's 127.0.0.x."""
    block = random.Random().randrange(1, 250)
    return [f"127.{block}.{random.Random().randrange(1, 250)}.{i}" for i in range(1, n + 1)]


def _serves(node: ProcNode) -> None:
    status, _, body = call(node.http, "POST", "/v1/chat/completions",
                           {"messages": CHAT, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert status == 200, body


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


class Attack:
    """Connections from stranger addresses to ``addr``, each opened with ``first`` bytes sent,
    then a byte every 0.5 s (``trickle``) or nothing; with ``refill`` each one is opened again
    0.2 s after the node closes it. Records when each was closed. Stopped with ``stop``."""

    def __init__(self, addr: tuple[str, int], sources: list[str], per_source: int,
                 first: bytes = b"", trickle: bool = False, refill: bool = False,
                 push: int = 0):
        self.addr, self.first, self.trickle, self.refill, self.push = (addr, first, trickle,
                                                                      refill, push)
        self.stopped = threading.Event()
        self.opened = 0
        self.closed_after: list[float] = []  # seconds from connect to the node's close
        self.open_now = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self.threads = [threading.Thread(target=self._one, args=(src,), daemon=True)
                        for src in sources for _ in range(per_source)]
        for t in self.threads:
            t.start()

    def _one(self, src: str) -> None:
        while not self.stopped.is_set():
            try:
                s = socket.create_connection(self.addr, timeout=5, source_address=(src, 0))
            except OSError:
                self.stopped.wait(0.2)
                continue
            t0 = time.monotonic()
            with self._lock:
                self.opened += 1
                self.open_now += 1
                self._socks.add(s)
            try:
                if self._hold(s):
                    with self._lock:
                        self.closed_after.append(time.monotonic() - t0)
            finally:
                with self._lock:
                    self.open_now -= 1
                    self._socks.discard(s)
                s.close()
            if not self.refill:
                return
            self.stopped.wait(0.2)

    def _hold(self, s: socket.socket) -> bool:
        """Until the node closes ``s`` (True) or the attack stops (False)."""
        with contextlib.suppress(OSError):
            s.sendall(self.first)
            if self.push:  # as fast as the node takes it
                s.settimeout(2)
                s.sendall(b"\0" * self.push)
        s.settimeout(0.5)
        while not self.stopped.is_set():
            try:
                if not s.recv(4096):
                    return True
            except TimeoutError:
                if self.trickle:
                    with contextlib.suppress(OSError):
                        s.send(b"x")
            except OSError:
                return True
        return False

    def stop(self) -> None:
        self.stopped.set()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        for t in self.threads:
            t.join(10)


@contextlib.contextmanager
def _attacking(*attacks: Attack) -> Iterator[tuple[Attack, ...]]:
    try:
        yield attacks
    finally:
        for a in attacks:
            a.stop()


@pytest.fixture(scope="module")
def seed(tiny_models, tmp_path_factory):
    c = ProcCluster(tmp_path_factory.mktemp("attacks"))
    try:
        node = c.start_join(0, str(tiny_models["llama"]), args=["--memory-limit", "2GB"])
        c.wait(lambda: (s := c.status(0)) and s["placements"], 90, "the model placed")
        c.wait(lambda: call(node.http, "GET", "/health", timeout=5)[0] == 200, 90, "ready")
        yield c
    finally:
        c.close()


def _control_metrics(c: ProcCluster) -> dict:
    st = c.status(0)
    assert st is not None
    return st["metrics"]


def _ring_rejected(node: ProcNode, reason: str) -> float:
    """The data plane's refused frames of ``reason``, from /metrics."""
    _, _, text = call(node.http, "GET", "/metrics")
    text = text.decode() if isinstance(text, bytes) else str(text)
    for line in text.splitlines():
        if (line.startswith("skulkp2p_wire_frames_rejected_total{") and 'plane="data"' in line
                and f'reason="{reason}"' in line):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no data-plane {reason} sample in /metrics")


def _ring_addr(node: ProcNode) -> tuple[str, int]:
    _, _, st = call(node.http, "GET", "/v1/cluster")
    ring = next(m["ring"] for m in st["members"] if m["name"] == node.name)
    host, port = ring.rsplit(":", 1)
    return host, int(port)


@pytest.mark.process
def test_trickling_idle_and_replayed_connections_cost_a_node_nothing(seed):
    c = seed
    node = c.nodes[0]
    _serves(node)
    rss0, fds0 = _rss_mb(node.pid), _fds(node.pid)
    src = _sources(12)
    big = wire.HEADER.pack(wire.DATA_MAX_FRAME)  # a 64 MiB frame declared ...
    t0 = time.monotonic()
    with _attacking(
        # ... then 4 MiB of it pushed at once, on the ring's port (6 x 8 connections)
        Attack(_ring_addr(node), src[:6], MAX_PER_ADDRESS, big, push=4 << 20),
        # idle, and a small frame trickled a byte every 0.5 s, on the control port
        Attack((node.ip, node.port), src[6:9], MAX_PER_ADDRESS),
        Attack((node.ip, node.port), src[9:], MAX_PER_ADDRESS, wire.HEADER.pack(3000),
               trickle=True),
    ) as (ring, idle, trickle):
        peak_rss, peak_fds = rss0, fds0
        _serves(node)  # during the attack
        everyone = (ring, idle, trickle)
        while any(a.opened < len(a.threads) or a.open_now for a in everyone):
            peak_rss = max(peak_rss, _rss_mb(node.pid))
            peak_fds = max(peak_fds, _fds(node.pid))
            assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 10, \
                [(a.opened, a.open_now) for a in everyone]
            time.sleep(0.1)
        for a in everyone:
            assert len(a.closed_after) == len(a.threads)  # the node closed every one
        assert max(ring.closed_after) < 2.0  # refused from its header
        for a in (idle, trickle):  # at the deadline, however the bytes trickle
            assert HANDSHAKE_TIMEOUT_S - 0.5 < min(a.closed_after), a.closed_after
            assert max(a.closed_after) < HANDSHAKE_TIMEOUT_S + 5, a.closed_after

    # A captured exchange (the auth frame and a status request) sent again is refused.
    with socket.create_connection((node.ip, node.port), timeout=5) as s:
        side = wire.Connecting(KEY, max_in=wire.DATA_MAX_FRAME)
        captured = side.answer(s.recv(wire.HELLO.size))
        assert side.encoder is not None and side.decoder is not None
        captured += side.encoder.encode({"t": "status"})
        s.sendall(captured)
        got: list = []
        while not got:
            got = side.decoder.feed(s.recv(1 << 16))
        assert got[0]["t"] == "status-reply"
    with socket.create_connection((node.ip, node.port), timeout=5) as s:
        s.sendall(captured)
        answer = b""
        with contextlib.suppress(ConnectionError):
            while data := s.recv(1 << 16):
                answer += data
        assert len(answer) == wire.HELLO.size  # its hello, then the close: no status

    _serves(node)  # after
    fds_back = _wait(lambda: _fds(node.pid) <= fds0, 15, "the node's descriptors back")
    rss1 = _rss_mb(node.pid)
    m = {"control": _control_metrics(c), "ring oversize": _ring_rejected(node, "oversize")}
    print(f"\nRSS {rss0:.1f} MB before, {peak_rss:.1f} MB peak, {rss1:.1f} MB after; fds "
          f"{fds0} before, {peak_fds} peak, {_fds(node.pid)} after ({fds_back:.1f} s); "
          f"closed after: ring max {max(ring.closed_after):.2f} s, idle "
          f"{min(idle.closed_after):.2f}-{max(idle.closed_after):.2f} s, trickle "
          f"{min(trickle.closed_after):.2f}-{max(trickle.closed_after):.2f} s; {m}")
    assert peak_rss - rss0 < 25, (rss0, peak_rss)
    assert m["ring oversize"] >= len(ring.threads)
    assert m["control"]["handshake_timeouts"] >= len(idle.threads) + len(trickle.threads)
    assert m["control"]["wire_error_handshake"] >= 1
    lines = node.log.read_text(errors="replace").count("refused connections")
    assert 1 <= lines <= 2 * (1 + (time.monotonic() - t0) / 10), lines  # not one per refusal


@pytest.mark.cluster
def test_a_member_joins_and_rejoins_while_strangers_hold_every_slot(seed):
    c = seed
    node = c.nodes[0]
    _serves(node)
    rss0, fds0 = _rss_mb(node.pid), _fds(node.pid)
    # More strangers than the caps: 12 addresses x 9 connections, each opened again as soon
    # as the node closes it (refused past 8 an address, the oldest evicted past 64 in all).
    sources = _sources(12)
    per = MAX_PER_ADDRESS + 1
    assert len(sources) * MAX_PER_ADDRESS > MAX_STRANGERS
    with _attacking(Attack((node.ip, node.port), sources, per, refill=True)) as (flood,):
        _wait(lambda: flood.opened >= len(flood.threads), 30, "the strangers in")
        before = _control_metrics(c)
        member = c.start(1, peers=[0])
        took = c.wait(lambda: (s := c.agreed([0, 1])) and all(m["state"] == "alive"
                                                            for m in s["members"]),
                      20, "the member to join under the flood")
        _serves(node)
        # Its link drops (the member restarts): it is back from its known address.
        member.proc.kill()
        member.proc.wait(10)
        c.start(1, peers=[0])
        back = c.wait(lambda: (s := c.agreed([0, 1])) and all(m["state"] == "alive"
                                                            for m in s["members"]),
                      20, "the member back under the flood")
        after = _control_metrics(c)
        peak_rss, peak_fds = _rss_mb(node.pid), _fds(node.pid)
    refused = after.get("inbound_refused", 0) - before.get("inbound_refused", 0)
    evicted = after.get("inbound_evicted", 0) - before.get("inbound_evicted", 0)
    print(f"\njoined in {took:.1f} s, back in {back:.1f} s under the flood; meanwhile "
          f"{refused} connections refused, {evicted} evicted; RSS {rss0:.1f} -> "
          f"{peak_rss:.1f} MB")
    assert refused > 0 and evicted > 0
    c.nodes[1].proc.terminate()  # leaves: its connections to the node close
    c.nodes[1].proc.wait(30)
    _serves(node)
    fds_back = _wait(lambda: _fds(node.pid) <= fds0, 15, "the node's descriptors back")
    print(f"fds {fds0} before, {peak_fds} peak, {_fds(node.pid)} after ({fds_back:.1f} s)")
    assert peak_rss - rss0 < 25, (rss0, peak_rss)
