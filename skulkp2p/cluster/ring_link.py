"""The ring's data plane: ring frames over TCP between ring neighbours.

Each node runs one `RingData`: a listener for ring frames (signed like control frames, with the
64 MiB data-frame cap), the stages it runs for models placed on multi-node rings, and the replies
awaited by the RingForwards it runs as a last stage. Connections to it prove the secret first, as
on the control plane (cluster/handshake.py: nothing past the small auth frame is read before,
with its deadline, caps and slots); an authenticated connection may stay idle between frames,
but a frame begun must be whole within FRAME_TIMEOUT_S. A frame for a stage is computed on that
model's own thread (MLX work never blocks the event loop) and passed to the next stage's data
address; a frame for a request this node awaits is handed to the waiting RingForward.

Failures stay bounded: a connection that cannot be made fails the traversal at once; a stage that
dies or freezes mid-request is noticed by the waiting side, which gives up when the cluster
declares a ring member dead or restarted, or after a timeout (SKULKP2P_RING_TIMEOUT, default 30
s per traversal), whichever comes first. The protocol logic is in engine/parallel/ring/traversal.py.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from skulkp2p import wire
from skulkp2p.cluster.handshake import HELLO_TIMEOUT_S, Gate, Link, connect
from skulkp2p.cluster.peer_link import CONNECT_TIMEOUT_S, WRITE_TIMEOUT_S
from skulkp2p.engine.parallel.ring.traversal import RingError, StageWorker
from skulkp2p.wire import Message

log = logging.getLogger("skulkp2p.ring")

# A data frame begun must be whole this soon (64 MiB at about 1 MB/s); a traversal waiting on
# it has given up long before (SKULKP2P_RING_TIMEOUT).
FRAME_TIMEOUT_S = 60.0
DRAFT_MEMORY = "draft_memory"  # the type of a frame carrying a replica's finished sequences


def ring_timeout() -> float:
    return float(os.environ.get("SKULKP2P_RING_TIMEOUT", "30"))


class RingData:
    def __init__(self, key: bytes, max_frame: int = wire.DATA_MAX_FRAME):
        self.key = key
        self.max_frame = max_frame
        self.addr = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        # model -> (worker, the next stage's data address, looked up per frame)
        self.stages: dict[str, tuple[StageWorker, Callable[[], str | None]]] = {}
        self._executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._waiting: dict[str, queue.Queue[Message]] = {}
        self._lock = threading.Lock()
        self._links: dict[str, Link] = {}  # outbound, by address
        self._connecting: dict[str, asyncio.Lock] = {}
        self._server: asyncio.base_events.Server | None = None
        self._held: dict[str, collections.deque[Message]] = {}  # for a stage not loaded yet
        self.dropped = 0
        # frames and connections refused (wire_error_*, inbound_refused, ...)
        self.metrics: collections.Counter[str] = collections.Counter()
        self.gate = Gate("ring", self.metrics, log)
        self.bytes_out = 0
        # Frames of type DRAFT_MEMORY (a replica's finished prompts and outputs for the model's
        # other replicas) go here: (model, token sequences), on the event loop.
        self.on_draft_memory: Callable[[str, list[list[int]]], None] | None = None

    async def start(self, host: str, bind_source: str | None = None, port: int = 0) -> str:
        self.loop = asyncio.get_running_loop()
        self.bind_source = bind_source
        self._server = await asyncio.start_server(self._serve, host, port)
        port = self._server.sockets[0].getsockname()[1]
        self.addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.addr

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.gate.close()
        for link in self._links.values():
            link.close()
        for ex in self._executors.values():
            ex.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- stages

    def set_stage(self, model: str, worker: StageWorker | None,
                  next_addr: Callable[[], str | None] = lambda: None) -> None:
        if worker is None:
            self.stages.pop(model, None)
            return
        self.stages[model] = (worker, next_addr)
        if model not in self._executors:
            self._executors[model] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"stage-{model}")
        for msg in self._held.pop(model, ()):
            self._dispatch(msg)

    # ---------------------------------------------------------------- awaiting replies

    def expect(self, request: str) -> queue.Queue[Message]:
        with self._lock:
            return self._waiting.setdefault(request, queue.Queue())

    def forget(self, request: str) -> None:
        with self._lock:
            self._waiting.pop(request, None)

    # ---------------------------------------------------------------- I/O

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = await self.gate.admit(reader, writer, self.key, self.max_frame)
        if link is None:
            return
        try:
            while msgs := await link.frames(frame_s=FRAME_TIMEOUT_S, read_size=1 << 20):
                for msg in msgs:
                    self._dispatch(msg)
        except wire.WireError as e:
            self.gate.failed(link.host, e)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            self.gate.release(link)

    def _dispatch(self, msg: Message) -> None:
        if msg.get("t") == DRAFT_MEMORY:
            self._draft_memory(msg)
            return
        request, model = msg.get("request"), msg.get("model")
        with self._lock:
            waiting = self._waiting.get(request) if isinstance(request, str) else None
        if waiting is not None and msg.get("op") != "end" and msg.get("last") == self.addr:
            waiting.put(msg)
            return
        if not isinstance(model, str) or (stage := self.stages.get(model)) is None:
            # The stage may still be loading, or its placement not seen here yet: hold a few
            # frames for it (the sender's timeout bounds the wait).
            held = self._held.setdefault(str(msg.get("model")), collections.deque(maxlen=16))
            held.append(msg)
            return
        worker, next_addr = stage

        def compute() -> None:
            out = worker.handle(msg)
            addr = next_addr()
            if out is not None and not addr:
                log.warning("ring: %s: no address for the next stage; frame dropped",
                            msg["model"])
            if out is not None and addr:
                out.update(model=msg["model"], last=msg.get("last"))
                self.send_threadsafe(addr, out)

        def failed(f: concurrent.futures.Future[None]) -> None:
            if f.exception():
                log.error("ring: %s: stage failed on a frame: %r", model, f.exception())

        self._executors[model].submit(compute).add_done_callback(failed)

    def _draft_memory(self, msg: Message) -> None:
        model, seqs = msg.get("model"), msg.get("sequences")
        if self.on_draft_memory is None or not isinstance(model, str) or not isinstance(
                seqs, list):
            return
        sequences = [[t for t in s if isinstance(t, int)] for s in seqs if isinstance(s, list)]
        self.on_draft_memory(model, sequences)

    def send_threadsafe(self, addr: str, msg: Message) -> concurrent.futures.Future[None]:
        body = wire.pack_body(msg, self.max_frame)  # here, off the event loop; signed there
        if self.loop is None:
            raise RuntimeError("the ring's data plane is not started")
        return asyncio.run_coroutine_threadsafe(self._send(addr, body), self.loop)

    async def _link(self, addr: str) -> Link:
        link = self._links.get(addr)
        if link is not None and not link.writer.is_closing():
            return link
        # One connection per address, whoever asks first: frames keep their order on it.
        async with self._connecting.setdefault(addr, asyncio.Lock()):
            link = self._links.get(addr)
            if link is None or link.writer.is_closing():
                link = await connect(addr, self.key, max_out=self.max_frame,
                                     bind=self.bind_source, connect_timeout=CONNECT_TIMEOUT_S)
                self._links[addr] = link
                asyncio.get_running_loop().create_task(self._watch(addr, link))
        return link

    async def _watch(self, addr: str, link: Link) -> None:
        """Nothing comes back on a data connection: EOF means the other end closed it (it
        restarted, or refused our bytes); forget it so the next frame opens a new one."""
        try:
            while await link.reader.read(1 << 12):
                pass
        except OSError:
            pass
        if self._links.get(addr) is link:
            del self._links[addr]
        link.close()

    async def _send(self, addr: str, body: bytes) -> None:
        link: Link | None = None
        try:
            link = await self._link(addr)
            frame = link.encoder.sign(body)  # in the order written: the tag covers its number
            link.writer.write(frame)
            self.bytes_out += len(frame)
            await asyncio.wait_for(link.writer.drain(), WRITE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            if link is not None and self._links.get(addr) is link:
                link.close()
                self._links.pop(addr, None)
            raise RingError(f"cannot send to ring member at {addr}: {e}") from e


class TcpRingLink:
    """A RingForward's link from the last stage: frames go to the first stage, the last hop
    comes back here. `check` says why the ring is broken (a member dead or restarted), or None."""

    def __init__(self, data: RingData, model: str, first_addr: str,
                 check: Callable[[], str | None], timeout: float | None = None):
        self.data = data
        self.model = model
        self.first_addr = first_addr
        self.check = check
        self.timeout = timeout or ring_timeout()
        self.link_s = 0.0  # wall time spent waiting on the other stages

    def traverse(self, msg: Message) -> Message:
        t0 = time.perf_counter()
        request = str(msg["request"])
        replies = self.data.expect(request)
        try:
            self.data.send_threadsafe(self.first_addr, {**msg, "model": self.model,
                                                        "last": self.data.addr}).result(
                CONNECT_TIMEOUT_S + HELLO_TIMEOUT_S + WRITE_TIMEOUT_S + 1)
        except (RingError, concurrent.futures.TimeoutError) as e:
            raise RingError(f"ring of {self.model}: the first stage is unreachable: {e}") from e
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                reply = replies.get(timeout=0.1)
            except queue.Empty:
                reply = None
            if reply is not None and reply.get("step") == msg["step"]:
                self.link_s += time.perf_counter() - t0
                return reply
            # Nothing yet, or an old step's answer (after an earlier failure; dropped): the
            # checks run on both, so a stream of stale answers cannot outlast the timeout.
            broken = self.check()
            if broken:
                raise RingError(f"ring of {self.model} broke mid-request: {broken}")
            if time.monotonic() > deadline:
                raise RingError(f"ring of {self.model}: no answer from the other stages "
                                f"within {self.timeout:.0f} s")

    def send(self, msg: Message) -> None:
        self.data.send_threadsafe(self.first_addr, {**msg, "model": self.model,
                                                    "last": self.data.addr})
        self.data.forget(str(msg["request"]))
