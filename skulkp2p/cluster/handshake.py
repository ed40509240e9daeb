"""Authenticated connections between nodes: the asyncio side of wire.py's handshake, shared by
the control plane (cluster/node.py, cluster/peer_link.py, cluster/status_client.py) and the
ring's data plane (cluster/ring_link.py).

**Connecting** (:func:`connect`): open the connection, read the listener's hello, answer with the
auth frame; the returned :class:`Link` signs and numbers every frame with the connection's key.

**Listening** (:class:`Gate`): what a listener lets in, and for how long.

- A new connection must finish the handshake within HANDSHAKE_TIMEOUT_S of its accept: one
  deadline for the whole handshake, not per read, so trickling a byte now and then does not keep
  it. Until then the listener reads at most wire.HANDSHAKE_MAX_FRAME for it (a larger declared
  frame is refused from its header).
- Connections still in their handshake: at most MAX_PER_ADDRESS from one address (more are
  refused), and at most MAX_STRANGERS in all from addresses that never authenticated (a new one
  past that evicts the oldest of them, so a member's connection always gets in).
- Addresses that authenticated once (the last KNOWN_ADDRESSES of them) are known: their
  connections in handshake count against their own per-address cap only, never against the
  strangers' pool, and past that cap a new one evicts the address's oldest one rather than being
  refused. So a member whose link dropped reconnects however many strangers knock.
- Authenticated connections have MAX_MEMBERS slots of their own, which unauthenticated ones never
  take; past that, the oldest authenticated connection is closed (its sender reconnects).
- Refused, evicted, timed-out and failed connections are counted in the plane's metrics and
  logged at most once per 10 s with counts (ratelog.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

from skulkp2p import wire
from skulkp2p.cluster.config import split_addr
from skulkp2p.ratelog import LogLimiter
from skulkp2p.wire import Message

HANDSHAKE_TIMEOUT_S = 5.0  # from accept to a checked auth frame, however the bytes trickle
HELLO_TIMEOUT_S = 2.0  # a connector waits this long for the listener's hello
MAX_MEMBERS = 256  # authenticated connections a listener holds
MAX_STRANGERS = 64  # connections in their handshake from addresses never authenticated
MAX_PER_ADDRESS = 8  # connections in their handshake from one address
KNOWN_ADDRESSES = 1024  # addresses remembered as having authenticated
HANDSHAKE_READ = 4096  # bytes read at a time before the connection authenticated


class HandshakeError(ConnectionError):
    """The other end is not a node of this cluster (another secret or protocol version), or
    closed the connection during the handshake."""


@dataclass(eq=False)
class Link:
    """An authenticated connection (either side): ``encoder`` signs what goes out, ``frames``
    reads what comes in."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    encoder: wire.FrameEncoder
    decoder: wire.FrameDecoder
    host: str  # the other end's address (without the port)
    peer: str  # the other end's address and port, for log lines
    last_frame: float = field(default_factory=time.monotonic)  # when the last whole frame came
    frame_start: float = field(default_factory=time.monotonic)  # when the frame being read began

    def send(self, msg: Message) -> None:
        self.writer.write(self.encoder.encode(msg))

    async def frames(self, idle_s: float | None = None, frame_s: float | None = None,
                     read_size: int = 1 << 16) -> list[Message]:
        """The next messages; [] at the end of the stream. TimeoutError when no whole frame
        came for ``idle_s``, or a frame begun ``frame_s`` ago is still not whole (deadlines
        that reads of a byte at a time do not move); WireError for bad bytes; OSError."""
        out = self.decoder.feed(b"")
        while not out:
            now = time.monotonic()
            deadline = self.last_frame + idle_s if idle_s is not None else None
            if frame_s is not None and self.decoder.inside_frame:
                ends = self.frame_start + frame_s
                deadline = ends if deadline is None else min(deadline, ends)
            if deadline is None:
                data = await self.reader.read(read_size)
            elif deadline <= now:
                raise TimeoutError
            else:
                data = await asyncio.wait_for(self.reader.read(read_size), deadline - now)
            if not data:
                err = self.decoder.eof_error()
                if err is not None:
                    raise err
                return []
            was_inside = self.decoder.inside_frame
            out = self.decoder.feed(data)
            now = time.monotonic()
            if out:
                self.last_frame = now
            if self.decoder.inside_frame and (out or not was_inside):
                self.frame_start = now
        return out

    def close(self) -> None:
        self.writer.transport.abort()


def _host_port(writer: asyncio.StreamWriter) -> tuple[str, str]:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(peer[0]), f"{peer[0]}:{peer[1]}"
    return str(peer), str(peer)


async def connect(addr: str, key: bytes, *, max_out: int = wire.CONTROL_MAX_FRAME,
                  max_in: int = wire.CONTROL_MAX_FRAME, bind: str | None = None,
                  connect_timeout: float = 1.0, hello_timeout: float = HELLO_TIMEOUT_S) -> Link:
    """An authenticated connection to the listener at ``addr``. Raises OSError (HandshakeError
    when it is not a node of this cluster, or closed the connection) or TimeoutError."""
    host, port = split_addr(addr)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, local_addr=(bind, 0) if bind else None),
        connect_timeout)
    try:
        hello = await asyncio.wait_for(reader.readexactly(wire.HELLO.size), hello_timeout)
        side = wire.Connecting(key, max_out, max_in)
        writer.write(side.answer(hello))
    except asyncio.IncompleteReadError:
        writer.transport.abort()
        raise HandshakeError(f"{addr} closed the connection before its hello") from None
    except wire.WireError as e:
        writer.transport.abort()
        raise HandshakeError(f"{addr}: {e}") from None
    except BaseException:
        writer.transport.abort()
        raise
    assert side.encoder is not None and side.decoder is not None
    them, peer = _host_port(writer)
    return Link(reader, writer, side.encoder, side.decoder, them, peer)


class Gate:
    """Who may hold a listener's connections (the module's docstring says the rules). The
    listener hands each accepted connection to :meth:`admit`, and gives back the Link it gets
    with :meth:`release` when it is done with it."""

    def __init__(self, plane: str, metrics: collections.Counter[str], logger: logging.Logger,
                 *, max_members: int = MAX_MEMBERS, max_strangers: int = MAX_STRANGERS,
                 per_address: int = MAX_PER_ADDRESS,
                 handshake_s: float = HANDSHAKE_TIMEOUT_S):
        self.plane = plane
        self.metrics = metrics
        self.max_members = max_members
        self.max_strangers = max_strangers
        self.per_address = per_address
        self.handshake_s = handshake_s
        self.refusals = LogLimiter(logger, f"{plane}: refused connections")
        # writer -> (its address, its handshake), oldest first
        self._pending: dict[asyncio.StreamWriter, tuple[str, wire.Accepting]] = {}
        self._members: dict[asyncio.StreamWriter, Link] = {}
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._closed = False

    @property
    def pending(self) -> int:
        """Connections in their handshake."""
        return len(self._pending)

    @property
    def members(self) -> int:
        """Authenticated connections."""
        return len(self._members)

    @property
    def buffered(self) -> int:
        """Bytes held for connections in their handshake (each at most HANDSHAKE_MAX_FRAME,
        beside what asyncio's reader holds before it is read)."""
        return sum(side.decoder.buffered for _, side in self._pending.values())

    async def admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    key: bytes, max_in: int, max_out: int = wire.HANDSHAKE_MAX_FRAME
                    ) -> Link | None:
        """The connection once it authenticated, or None (refused, evicted, timed out, failed
        or closed: it is closed, counted and, unless the other end just left, logged)."""
        host, peer = _host_port(writer)
        if self._closed:
            writer.transport.abort()
            return None
        if not self._make_room(host):
            self.metrics["inbound_refused"] += 1
            self.refusals.note(host, f"over {self.per_address} connections in their "
                                     "handshake from this address")
            writer.transport.abort()
            return None
        side = wire.Accepting(key, max_in, max_out)
        self._pending[writer] = (host, side)
        deadline = time.monotonic() + self.handshake_s
        try:
            writer.write(side.hello)
            while not side.authenticated:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                data = await asyncio.wait_for(reader.read(HANDSHAKE_READ), remaining)
                if writer not in self._pending:  # evicted meanwhile
                    break
                if not data:
                    err = side.decoder.eof_error()
                    if err is not None:
                        raise err
                    break  # it left
                side.feed(data)
        except TimeoutError:
            self.metrics["handshake_timeouts"] += 1
            self.refusals.note(host, f"no handshake within {self.handshake_s:g} s")
        except wire.WireError as e:
            self.failed(host, e)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._pending.pop(writer, None)
            if not side.authenticated:  # every way out but one closes it
                writer.transport.abort()
        if not side.authenticated:
            return None
        if self._closed:
            writer.transport.abort()
            return None
        assert side.encoder is not None
        self._known[host] = None
        self._known.move_to_end(host)
        while len(self._known) > KNOWN_ADDRESSES:
            self._known.popitem(last=False)
        while len(self._members) >= self.max_members:
            oldest = next(iter(self._members.values()))
            self.release(oldest)
            self.metrics["members_evicted"] += 1
        link = Link(reader, writer, side.encoder, side.decoder, host, peer)
        self._members[writer] = link
        self.metrics["inbound_authenticated"] += 1
        return link

    def failed(self, host: str, e: wire.WireError) -> None:
        """Count and log (rate-limited) bad bytes from ``host``; the caller closes its
        connection."""
        self.metrics["wire_errors"] += 1
        self.metrics[f"wire_error_{e.reason}"] += 1
        self.refusals.note(host, str(e))

    def release(self, link: Link) -> None:
        self._members.pop(link.writer, None)
        link.close()

    def close(self) -> None:
        self._closed = True
        for w in [*self._pending, *self._members]:
            w.transport.abort()
        self._pending.clear()
        self._members.clear()
        self.refusals.flush()

    def _make_room(self, host: str) -> bool:
        """Whether a new connection from ``host`` may start its handshake, evicting an older
        one where the rules say so."""
        known = host in self._known
        mine = [w for w, (h, _) in self._pending.items() if h == host]
        if len(mine) >= self.per_address:
            if not known:
                return False
            self._evict(mine[0])
            return True
        if not known:
            strangers = [w for w, (h, _) in self._pending.items() if h not in self._known]
            if strangers and len(strangers) >= self.max_strangers:
                self._evict(strangers[0])
        return True

    def _evict(self, writer: asyncio.StreamWriter) -> None:
        host, _ = self._pending.pop(writer)
        writer.transport.abort()
        self.metrics["inbound_evicted"] += 1
        self.refusals.note(host, "evicted in its handshake to make room for a newer connection")
