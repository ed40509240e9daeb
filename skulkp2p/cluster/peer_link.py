"""The control plane's outbound side: frames for one destination, written in order over one
persistent TCP connection (opened on demand with the handshake of cluster/handshake.py, re-opened
after failures with a short back-off). Bodies are queued packed and signed as they are written,
with the connection's key and sequence number. The protocol tolerates loss, so a full queue, a
failed connect or a slow peer simply drops frames (counted in the node's metrics)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from skulkp2p import wire
from skulkp2p.cluster.handshake import Link, connect

log = logging.getLogger("skulkp2p.cluster")

CONNECT_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 2.0
MAX_QUEUE = 512  # frames waiting for one peer; more are dropped (the protocol tolerates loss)


class PeerLink:
    """Frames for one destination, written in order over one connection."""

    def __init__(self, addr: str, metrics: collections.Counter[str], bind_source: str | None,
                 key: bytes, max_frame: int = wire.CONTROL_MAX_FRAME):
        self.addr = addr
        self.metrics = metrics  # the node's: frames out and dropped, connects
        # Connections leave from the node's own address (see ClusterNode.start).
        self.bind_source = bind_source
        self.key = key
        self.max_frame = max_frame
        self.queue: collections.deque[bytes] = collections.deque()  # bodies (wire.pack_body)
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.link: Link | None = None
        self.failures = 0
        self.backoff_until = 0.0

    def send(self, body: bytes) -> None:
        """Queue a frame's body (wire.pack_body)."""
        if time.monotonic() < self.backoff_until or len(self.queue) >= MAX_QUEUE:
            self.metrics["frames_dropped"] += 1
            return
        self.queue.append(body)
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if not self.queue:
                continue
            try:
                link = self.link if self.link is not None else await self._connect()
                while self.queue:
                    # Signed in the order written: the tag covers the sequence number.
                    link.writer.write(link.encoder.sign(self.queue.popleft()))
                    self.metrics["frames_out"] += 1
                await asyncio.wait_for(link.writer.drain(), WRITE_TIMEOUT_S)
                self.failures = 0
            except (OSError, TimeoutError, asyncio.IncompleteReadError, wire.WireError) as e:
                self._fail(e)

    async def _connect(self) -> Link:
        link = await connect(self.addr, self.key, max_out=self.max_frame, bind=self.bind_source,
                             connect_timeout=CONNECT_TIMEOUT_S)
        self.link = link
        self.metrics["connects"] += 1
        asyncio.get_running_loop().create_task(self._watch(link))
        return link

    async def _watch(self, link: Link) -> None:
        """Nothing comes back on this connection; EOF means the peer closed it (it restarted,
        or found our bytes wrong): drop it now rather than lose the next frame to it."""
        try:
            while await link.reader.read(1 << 12):
                pass
        except OSError:
            pass
        if self.link is link:
            self.close()

    def _fail(self, e: BaseException) -> None:
        self.metrics["frames_dropped"] += len(self.queue)
        self.queue.clear()
        self.close()
        self.failures += 1
        # Back off a little so a dead node costs us nothing; short enough to notice its return.
        self.backoff_until = time.monotonic() + min(2.0, 0.1 * 2 ** min(self.failures, 5))
        log.debug("send to %s failed (%s): %s", self.addr, type(e).__name__, e)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def cancel(self) -> None:
        self.close()
        if self.task is not None:
            self.task.cancel()
