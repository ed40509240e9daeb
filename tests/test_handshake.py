"""The listeners' handshake, deadlines and caps (cluster/handshake.py), on real sockets on
127.0.0.0/8 against the real listeners in this process: the ring's data plane (RingData) and the
control plane (ClusterNode). Attackers connect from their own loopback addresses, members from
theirs. (tests/test_listener_attacks.py does the same against real `join` processes.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from skulkp2p import wire
from skulkp2p.cluster.config import add_cluster_arguments, config_from_args, split_addr
from skulkp2p.cluster.handshake import connect
from skulkp2p.cluster.node import ClusterNode
from skulkp2p.cluster.ring_link import RingData
from skulkp2p.netfault import loopback_ips_usable

pytestmark = pytest.mark.skipif(not loopback_ips_usable(), reason="needs 127.0.0.0/8")

SECRET = "handshake-test-secret"
KEY = wire.frame_key(SECRET)


def _ips(n: int) -> list[str]:
    """``n`` loopback addresses of a random block (other runs may use others)."""
    base = random.Random().randrange(2, 200)
    return [f"127.0.{base}.{i}" for i in range(1, n + 1)]


async def _open(addr: str, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = split_addr(addr)
    return await asyncio.open_connection(host, port, local_addr=(source, 0))


async def _closed_within(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the listener sent until it closed the connection (fails past ``timeout``)."""
    got = bytearray()
    async with asyncio.timeout(timeout):
        try:
            while data := await reader.read(4096):
                got += data
        except ConnectionError:
            pass
    return bytes(got)


async def _until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def _sockets_on(ips: list[str]) -> int:
    """This process's open TCP sockets with an end on one of ``ips`` (the test's own loopback
    block: other tests' sockets in this process do not count)."""
    return len(_socket_ends(ips))


TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def _socket_ends(ips: list[str]) -> list[str]:
    """``local -> remote STATE`` of each socket :func:`_sockets_on` counts."""
    def hex_ip(ip: str) -> str:
        return "".join(f"{int(b):02X}" for b in reversed(ip.split(".")))

    def end(col: str) -> str:
        ip, port = col.split(":")
        return ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"
    mine = {hex_ip(ip) for ip in ips}
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                ours.add(link[8:-1])
    found = []
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        ends = {cols[1].split(":")[0], cols[2].split(":")[0]}
        if cols[9] in ours and ends & mine:
            found.append(f"{end(cols[1])} -> {end(cols[2])} {TCP_STATES.get(cols[3], cols[3])}")
    return found


def _node(name: str, host: str, *extra: str) -> ClusterNode:
    import argparse

    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    args = p.parse_args(["--name", name, "--host", host, "--port", "0", "--secret", SECRET,
                         "--no-cluster-state", *extra])
    return ClusterNode(config_from_args(args))


def test_oversize_trickle_and_idle_connections_end_at_the_handshake_deadline():
    """A declared 64 MiB frame is refused from its header; a small frame trickled a byte at a
    time and a silent connection are both closed when the handshake's deadline passes, which
    the trickle does not move; nothing past the handshake's cap is ever held for them."""
    src = _ips(3)

    async def main() -> None:
        data = RingData(KEY)
        addr = await data.start("127.0.0.1")
        data.gate.handshake_s = 1.0
        try:
            r, w = await _open(addr, src[0])
            w.write(wire.HEADER.pack(64 << 20))
            assert len(await _closed_within(r, 2)) == wire.HELLO.size  # its hello, then EOF
            assert data.metrics["wire_error_oversize"] == 1

            t0 = time.monotonic()
            idle = await _open(addr, src[1])
            trickler = await _open(addr, src[2])
            trickler[1].write(wire.HEADER.pack(3000))  # within the cap, then a byte at a time
            held = 0

            async def trickle() -> None:
                nonlocal held
                with contextlib.suppress(ConnectionError):
                    while not trickler[1].is_closing():
                        trickler[1].write(b"x")
                        await trickler[1].drain()
                        held = max(held, data.gate.buffered)
                        await asyncio.sleep(0.05)

            task = asyncio.create_task(trickle())
            for r, _ in (idle, trickler):
                await _closed_within(r, 3)
                took = time.monotonic() - t0
                assert 1.0 <= took < 2.5, took
            task.cancel()
            assert 0 < held <= wire.HANDSHAKE_MAX_FRAME
            assert data.metrics["handshake_timeouts"] == 2
            assert data.gate.pending == 0 and data.gate.members == 0
        finally:
            await data.close()

    asyncio.run(main())


def test_caps_refuse_and_evict_strangers_while_a_member_joins_and_rejoins():
    """Strangers fill their pool past every cap and keep refilling it: past the per-address cap
    they are refused, past the strangers' cap the oldest is evicted, and a member still joins;
    a member whose link drops gets back in from the slots of known addresses."""
    ips = _ips(6)
    a_ip, b_ip, strangers = ips[0], ips[1], ips[2:]

    async def main() -> None:
        a = _node("a", a_ip)
        await a.start()
        socks0 = _sockets_on(ips)  # a's own listeners
        a.gate.per_address, a.gate.max_strangers, a.gate.handshake_s = 3, 6, 30

        async def stranger(ip: str) -> None:
            """One stranger's connection, opened again 0.1 s after each close, until the task
            is cancelled. It closes its own end too, whenever it is done with a connection:
            the listener's close leaves our end open (CLOSE_WAIT) until we close it, and a
            connection opened while the test stops the strangers must not outlive them."""
            while True:
                with contextlib.suppress(OSError):
                    reader, writer = await _open(a.addr, ip)
                    try:
                        with contextlib.suppress(OSError, TimeoutError):
                            await _closed_within(reader, 60)
                    finally:
                        writer.transport.abort()
                await asyncio.sleep(0.1)

        b: ClusterNode | None = None
        tasks = [asyncio.create_task(stranger(ip)) for ip in strangers for _ in range(4)]
        try:
            await _until(lambda: a.metrics["inbound_refused"] >= 4
                         and a.metrics["inbound_evicted"] >= 6, 30, "the caps to bite")
            assert a.gate.pending <= 6
            b = _node("b", b_ip, "--peer", a.addr)
            await b.start()
            core_a, core_b = a.started_core, b.started_core

            def both_alive() -> bool:
                st = core_a.status()
                return any(m["name"] == "b" and m["state"] == "alive" for m in st["members"]) \
                    and core_b.leader == "a"

            took = await _until(both_alive, 30, "b to join a")
            print(f"joined in {took:.2f} s; a's metrics {dict(a.metrics)}")
            # b's link to a drops: b reconnects from a known address, however full the pool.
            before = a.metrics["inbound_authenticated"]
            a.gate.max_strangers = 0  # no stranger would get in now
            for peer in b._peers.values():
                peer.close()
            await _until(lambda: a.metrics["inbound_authenticated"] > before, 30,
                         "b to reconnect")
            await _until(both_alive, 30, "b alive again")
            # The strangers and the member go: every descriptor they held here is closed.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            b_peers = b._peers
            await b.close()
            b = None
            try:
                await _until(lambda: a.gate.pending == 0 and a.gate.members == 0
                             and _sockets_on(ips) <= socks0, 30, "every connection closed")
            except AssertionError as e:  # say which part stayed open
                raise AssertionError(f"{e}: pending {a.gate.pending}, members {a.gate.members}, "
                                     f"sockets {_socket_ends(ips)} (at start {socks0}; a is "
                                     f"{a.addr}, b {b_ip}, a's peers {list(a._peers)}, "
                                     f"b's {list(b_peers)})") from None
            assert not b_peers, "b opened a link after it closed"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if b is not None:
                await b.close()
            await a.close()

    asyncio.run(main())


def test_a_replayed_frame_is_refused():
    """Bytes a member sent (its auth frame and a status request), captured and sent again on a
    new connection, get no answer; a frame sent twice on one connection closes it."""

    async def main() -> None:
        a = _node("a", "127.0.0.1")
        await a.start()
        try:
            host, port = split_addr(a.addr)
            r, w = await asyncio.open_connection(host, port)
            side = wire.Connecting(KEY, max_in=wire.DATA_MAX_FRAME)
            assert side.encoder is None
            sent = side.answer(await r.readexactly(wire.HELLO.size))
            assert side.encoder is not None and side.decoder is not None
            status = side.encoder.encode({"t": "status"})
            w.write(sent + status)
            got: list[wire.Message] = []
            while not got:
                got = side.decoder.feed(await r.read(1 << 16))
            assert got[0]["t"] == "status-reply"
            w.write(status)  # the same frame again on its connection
            await _closed_within(r, 2)
            assert a.metrics["wire_error_bad-signature"] == 1

            r, w = await asyncio.open_connection(host, port)
            w.write(sent + status)  # the captured bytes on a new connection
            assert len(await _closed_within(r, 2)) == wire.HELLO.size  # the hello alone
            assert a.metrics["wire_error_handshake"] == 1
            link = await connect(a.addr, wire.frame_key("other"))  # another secret
            link.send({"t": "status"})
            with contextlib.suppress(ConnectionError):
                assert await link.frames() == []  # closed, unanswered
            assert a.metrics["wire_error_bad-signature"] == 2
        finally:
            await a.close()

    asyncio.run(main())



def test_frames_that_come_with_the_auth_frame_cut_anywhere_are_read():
    """A connector writes its auth frame and its first frames at once: the listener's last read
    of the handshake may end inside a frame, which the connection then reads whole."""

    async def main() -> None:
        data = RingData(KEY)
        addr = await data.start("127.0.0.1")
        try:
            host, port = split_addr(addr)
            for cut in (10, 3000, 5000):
                r, w = await asyncio.open_connection(host, port)
                side = wire.Connecting(KEY, max_out=wire.DATA_MAX_FRAME)
                auth = side.answer(await r.readexactly(wire.HELLO.size))
                assert side.encoder is not None
                frame = side.encoder.encode({"t": "ring", "model": f"m{cut}",
                                             "x": b"\1" * 20000})
                w.write(auth + frame[:cut])  # the handshake's read ends inside the frame
                await _until(lambda: data.gate.members == 1, 20, "the handshake")
                w.write(frame[cut:])
                await _until(lambda c=cut: f"m{c}" in data._held, 20, "the frame read")
                w.close()
                await _until(lambda: data.gate.members == 0, 20, "the close")
        finally:
            await data.close()

    asyncio.run(main())
