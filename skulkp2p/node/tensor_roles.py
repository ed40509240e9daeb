"""This node's member of a tensor-parallel placement: its rank process, formed, supervised and
torn down by the control plane.

Forming a group: each member picks a free port on its data-plane host and gossips it in its
`tp` fact ({model: {"ring", "key", "gen", "addr"}}; the key names the placement by its term
and serial); once every member of the placement shows an address for the same placement and
generation, each starts its rank process
(engine/tensor_rank.py) with the same host file, and the ranks meet through `mx.distributed`'s
ring backend. Supervision: a rank process that exits (its group broke: a peer died, or the
member running the decode loop gave up on a frozen peer and killed its rank 0) makes its
member gossip the next generation; every member that sees a higher generation than its own
kills its process and starts over on a fresh port, so the group re-forms with no leader
involved. A re-placement (other members, another kind) retires the role: its process is killed
by pid and the new placement forms a new group.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skulkp2p.cluster.membership import ALIVE, SUSPECT
from skulkp2p.cluster.node import split_addr

log = logging.getLogger("skulkp2p.node")

POLL_S = 0.2


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TensorRole:
    def __init__(self, node: Any, model: str, ring: tuple[str, ...], key: str,
                 model_path: Callable[[], Path], dtype: Callable[[], str],
                 on_ready: Callable[[dict[str, Any]], None] | None = None,
                 prefix_cache_mb: float = 0.0):
        self.node = node
        self.model = model
        self.ring = ring
        self.key = key  # which placement this group is for (its term and serial)
        self.rank = ring.index(node.config.name)
        self.model_path = model_path  # blocking (may pull): called off the loop
        self.dtype = dtype
        self.on_ready = on_ready
        self.prefix_cache_mb = prefix_cache_mb  # each rank's own slice of the prefix cache
        # Run (off the loop) once a generation of the group has formed and before any request
        # may use it: the loop's member measures the group's verify-width costs there.
        self.prepare: Callable[[Any], None] | None = None
        self.gen = 0
        self.addr = ""
        self.proc: Any = None  # engine.tensor.RankProcess, when started
        self.ready = False
        self._task: asyncio.Task | None = None
        self._starting = False
        self.failures = 0

    # ---------------------------------------------------------------- facts

    def _host(self) -> str:
        ring_addr = self.node.facts.get("ring") or self.node.addr
        return split_addr(ring_addr)[0]

    def _publish(self, remove: bool = False) -> None:
        tp = {k: v for k, v in (self.node.facts.get("tp") or {}).items() if k != self.model}
        if not remove:
            tp[self.model] = {"ring": list(self.ring), "key": self.key, "gen": self.gen,
                              "addr": self.addr}
        self.node.update_facts(tp=tp)

    def _peer(self, name: str) -> dict[str, Any] | None:
        if name == self.node.config.name:
            return {"ring": list(self.ring), "key": self.key, "gen": self.gen,
                    "addr": self.addr}
        m = self.node.core.membership.get(name)
        if m is None or m.state not in (ALIVE, SUSPECT):
            return None
        got = (m.facts.get("tp") or {}).get(self.model)
        if (not isinstance(got, dict) or got.get("ring") != list(self.ring)
                or got.get("key") != self.key):  # an earlier placement's group
            return None
        return got

    # ---------------------------------------------------------------- life

    def start(self) -> None:
        self._new_generation(0)
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    def stop(self, publish: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
        self._kill()
        if publish:
            self._publish(remove=True)

    def _kill(self) -> None:
        proc, self.proc, self.ready = self.proc, None, False
        if proc is not None:
            proc.kill()

    def _new_generation(self, gen: int) -> None:
        self._kill()
        self.gen = gen
        self.addr = f"{self._host()}:{free_port(self._host())}"
        self._publish()

    async def _supervise(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not leave the group unsupervised
                log.exception("tensor: %s: supervision step failed", self.model)
            await asyncio.sleep(POLL_S)

    async def _step(self) -> None:
        peers = [self._peer(n) for n in self.ring]
        newest = max((int(p.get("gen") or 0) for p in peers if p), default=self.gen)
        if newest > self.gen:
            log.info("tensor: %s: the group re-forms (generation %d)", self.model, newest)
            self._new_generation(newest)
            return
        if self.proc is not None and not self.proc.alive():
            self.failures += 1
            log.warning("tensor: %s: rank %d: %s; re-forming the group", self.model,
                        self.rank, self.proc.why_dead())
            self._new_generation(self.gen + 1)
            return
        if self.proc is not None or self._starting:
            return
        if not all(p and int(p.get("gen") or 0) == self.gen and p.get("addr") for p in peers):
            return  # not every member has published this generation yet
        addrs = [str(p["addr"]) for p in peers]
        self._starting = True
        try:
            await self._start_process(addrs)
        finally:
            self._starting = False

    async def _start_process(self, addrs: list[str]) -> None:
        from skulkp2p.engine.tensor import RankProcess, TensorError

        loop = asyncio.get_running_loop()
        gen = self.gen
        path = await loop.run_in_executor(None, self.model_path)
        if gen != self.gen:
            return
        proc = RankProcess(path, self.rank, addrs, self.dtype(),
                           label=f"rank {self.rank} of {self.model}",
                           prefix_cache_mb=self.prefix_cache_mb)
        self.proc = proc
        log.info("tensor: %s: rank %d of %d started (pid %d, generation %d, %s)", self.model,
                 self.rank, len(addrs), proc.pid, gen, addrs[self.rank])
        try:
            ready = await loop.run_in_executor(None, proc.wait_ready)
        except TensorError as e:
            log.warning("tensor: %s: rank %d did not form its group: %s", self.model,
                        self.rank, e)
            return  # the next step sees the process dead (or kills it on a new generation)
        prepare = self.prepare
        if prepare is not None and self.proc is proc:
            try:
                await loop.run_in_executor(None, prepare, proc)
            except Exception as e:  # the group still serves, with the costs it had
                log.warning("tensor: %s: preparing the group failed: %s", self.model, e)
        if self.proc is proc:
            self.ready = True
            log.info("tensor: %s: rank %d ready (%.1f MB held)", self.model, self.rank,
                     int(ready.get("param_bytes") or 0) / 1e6)
            if self.on_ready is not None:
                self.on_ready(ready)
