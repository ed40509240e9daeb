"""The control plane's outbound side: frames for one destination, written in order over one
persistent TCP connection (opened on demand, re-opened after failures with a short back-off). The
protocol tolerates loss, so a full queue, a failed connect or a slow peer simply drops frames
(counted in the node's metrics)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from skulkp2p.cluster.config import split_addr

log = logging.getLogger("skulkp2p.cluster")

CONNECT_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 2.0
MAX_QUEUE = 512  # frames waiting for one peer; more are dropped (the protocol tolerates loss)


class PeerLink:
    """Frames for one destination, written in order over one connection."""

    def __init__(self, addr: str, metrics: collections.Counter[str], bind_source: str | None):
        self.addr = addr
        self.metrics = metrics  # the node's: frames out and dropped, connects
        # Connections leave from the node's own address (see ClusterNode.start).
        self.bind_source = bind_source
        self.queue: collections.deque[bytes] = collections.deque()
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.failures = 0
        self.backoff_until = 0.0

    def send(self, frame: bytes) -> None:
        if time.monotonic() < self.backoff_until or len(self.queue) >= MAX_QUEUE:
            self.metrics["frames_dropped"] += 1
            return
        self.queue.append(frame)
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
                writer = self.writer if self.writer is not None else await self._connect()
                while self.queue:
                    writer.write(self.queue.popleft())
                    self.metrics["frames_out"] += 1
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
                self.failures = 0
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                self._fail(e)

    async def _connect(self) -> asyncio.StreamWriter:
        host, port = split_addr(self.addr)
        bind = self.bind_source
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, local_addr=(bind, 0) if bind else None),
            CONNECT_TIMEOUT_S)
        self.writer = writer
        self.metrics["connects"] += 1
        asyncio.get_running_loop().create_task(self._watch(reader, writer))
        return writer

    async def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Nothing comes back on this connection; EOF means the peer closed it (it restarted,
        or found our bytes wrong): drop it now rather than lose the next frame to it."""
        try:
            while await reader.read(1 << 12):
                pass
        except OSError:
            pass
        if self.writer is writer:
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
        if self.writer is not None:
            self.writer.transport.abort()
            self.writer = None

    def cancel(self) -> None:
        self.close()
        if self.task is not None:
            self.task.cancel()
