"""A fault-injecting TCP proxy on loopback: cuts, black holes and per-hop delay between nodes.

Used by the cluster tests (tc netem is not available here) and by `bench --nodes N
--link-delay-ms D`, whose ring links run through it to stand in for a LAN.

Each node listens on its real port; the address it advertises is a proxy port on the same
loopback IP. Nodes bind their outgoing connections to their own IP, so the proxy knows both ends
of every connection (source IP -> the listener's IP) and can cut, black-hole or delay traffic
between any pair of nodes. It runs its own event loop on a thread; callers drive it with plain
calls.

Cut links black-hole (bytes vanish, no reset: what a real partition looks like); when a rule
changes, the connections it touches are reset so that no frame is ever delivered half. A delay
is latency, not a bandwidth cap: every chunk read is delivered `delay` seconds after it arrived,
in order, while later chunks keep arriving (a large frame in many chunks is late by one delay,
not one per chunk). Bytes forwarded are counted per direction (`bytes`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import selectors
import socket
import statistics
import threading
import time
from dataclasses import dataclass

from skulkp2p.ports import free_port


def loopback_ips_usable(ip: str = "127.0.0.42") -> bool:
    """Whether this host answers on the whole 127.0.0.0/8 range (Linux does; macOS does not
    without aliases), so that nodes can each have their own loopback IP."""
    try:
        free_port(ip)
        return True
    except OSError:
        return False


@dataclass
class _Conn:
    src: str
    dst: str
    writers: tuple[asyncio.StreamWriter, ...]
    state: tuple[bool, float]  # (blocked, delay) when the rules last touched it


def _timer_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers fire within microseconds, not milliseconds: Python's epoll
    (and poll) selector rounds every wait up to a whole millisecond, so a 0.2 ms delay would be
    delivered after about 1.2 ms (docs/measurements/tensor-parallel.md, "the delay honoured
    below a millisecond"); select() takes its timeout in microseconds. select() cannot watch
    a descriptor numbered 1024 or more: the proxy runs in benches and tests, whose processes
    hold far fewer open files."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


class FaultProxy:
    def __init__(self):
        self.loop = _timer_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[asyncio.base_events.Server] = []
        self._conns: list[_Conn] = []
        self._blocked: set[tuple[str, str]] = set()  # (src ip, dst ip), one direction each
        self._delay: dict[tuple[str, str], float] = {}
        self.bytes: collections.Counter[tuple[str, str]] = collections.Counter()

    def _call(self, coro_or_fn, *args):
        if asyncio.iscoroutinefunction(coro_or_fn):
            return asyncio.run_coroutine_threadsafe(coro_or_fn(*args), self.loop).result(10)

        async def wrap():
            return coro_or_fn(*args)

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(10)

    # ---------------------------------------------------------------- set-up

    def listen(self, host: str, port: int, target_port: int) -> None:
        """Forward host:port to host:target_port."""
        self._call(self._listen, host, port, target_port)

    async def _listen(self, host: str, port: int, target_port: int) -> None:
        async def handle(reader, writer):
            src = writer.get_extra_info("peername")[0]
            try:
                up_reader, up_writer = await asyncio.open_connection(host, target_port)
            except OSError:
                writer.transport.abort()
                return
            conn = _Conn(src, host, (writer, up_writer), self._rule(src, host))
            self._conns.append(conn)
            try:
                await asyncio.gather(self._pump(reader, up_writer, src, host),
                                     self._pump(up_reader, writer, host, src))
            finally:
                for w in conn.writers:
                    w.transport.abort()
                if conn in self._conns:
                    self._conns.remove(conn)

        self._servers.append(await asyncio.start_server(handle, host, port, reuse_address=True))

    async def _pump(self, reader, writer, src: str, dst: str) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()  # (due time, bytes or None at the end)

        async def deliver() -> None:
            while (item := await queue.get())[1] is not None:
                due, data = item
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(1 << 16):
                if (src, dst) in self._blocked:
                    continue  # black hole
                self.bytes[(src, dst)] += len(data)
                queue.put_nowait((loop.time() + self._delay.get((src, dst), 0.0), data))
                if sender.done():
                    break
            queue.put_nowait((0.0, None))
            await sender
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            writer.transport.abort()

    # ---------------------------------------------------------------- faults

    def _rule(self, a: str, b: str) -> tuple[bool, float]:
        return ((a, b) in self._blocked or (b, a) in self._blocked,
                max(self._delay.get((a, b), 0.0), self._delay.get((b, a), 0.0)))

    def _apply(self, blocked: set[tuple[str, str]], delay: dict[tuple[str, str], float]) -> None:
        self._blocked, self._delay = blocked, delay
        for conn in list(self._conns):
            state = self._rule(conn.src, conn.dst)
            if state != conn.state:  # reset: no half frame ever gets through
                for w in conn.writers:
                    w.transport.abort()
                conn.state = state

    def partition(self, *groups: list[str]) -> None:
        """Cut every link between IPs of different groups (both directions)."""
        blocked = set()
        for ga, gb in itertools.permutations(groups, 2):
            blocked |= {(a, b) for a in ga for b in gb}
        self._call(self._apply, blocked, dict(self._delay))

    def block(self, a: str, b: str) -> None:
        self._call(self._apply, self._blocked | {(a, b), (b, a)}, dict(self._delay))

    def delay(self, a: str, b: str, seconds: float) -> None:
        self._call(self._apply, set(self._blocked),
                   {**self._delay, (a, b): seconds, (b, a): seconds})

    def heal(self) -> None:
        self._call(self._apply, set(), {})

    def close(self) -> None:
        async def shutdown():
            for s in self._servers:
                s.close()
            for conn in self._conns:
                for w in conn.writers:
                    w.transport.abort()

        try:
            self._call(shutdown)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


def round_trip_seconds(proxy: FaultProxy, src: str, dst: str, count: int = 50,
                       timeout_s: float = 5.0) -> float:
    """The median round trip of one byte from `src` to an echo listener on `dst` through
    `proxy` under its current rules: what a delayed link really costs per exchange (the
    delay twice, plus the proxy's own hops). Its sockets are closed before it returns (the
    proxy's listener for it stays until the proxy closes); a link that does not answer within
    `timeout_s` raises OSError."""
    server = socket.create_server((dst, 0))
    server.settimeout(timeout_s)
    via = free_port(dst)

    def echo() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while data := conn.recv(64):
                    conn.sendall(data)
            except OSError:
                pass

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        proxy.listen(dst, via, server.getsockname()[1])
        with socket.socket() as client:
            client.settimeout(timeout_s)
            client.bind((src, 0))
            client.connect((dst, via))
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(max(1, count)):
                t = time.perf_counter()
                client.sendall(b"x")
                if not client.recv(1):
                    raise OSError(f"the link {src} -> {dst} closed during the round trip")
                times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        server.close()
        thread.join(5)


def link_round_trip_ms(proxy: FaultProxy, ips: list[str]) -> float | None:
    """A bench's record of what a hop really costs through `proxy` (its own hops and timers
    included): the round trip between the first two distinct nodes' IPs, in ms to the
    microsecond; None when the nodes share one IP (no rule tells their links apart)."""
    distinct = list(dict.fromkeys(ips))
    if len(distinct) < 2:
        return None
    return round(round_trip_seconds(proxy, distinct[0], distinct[1]) * 1e3, 3)
