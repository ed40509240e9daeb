"""This node's member of a tensor-parallel placement: its rank process, formed, supervised and
torn down by the control plane.

Forming a group: each member picks a free port on its data-plane host and gossips it in its
`tp` fact ({model: {"ring", "key", "gen", "addr"}}; the key names the placement by its term
and serial); once every member of the placement shows an address for the same placement and
generation, each starts its rank process
(engine/parallel/tensor/rank.py) with the same host file, and the ranks meet through `mx.distributed`'s
ring backend. Supervision: a rank process that exits (its group broke: a peer died, or the
member running the decode loop gave up on a frozen peer and killed its rank 0) makes its
member gossip the next generation; every member that sees a higher generation than its own
kills its process and starts over on a fresh port, so the group re-forms with no leader
involved. A re-placement (other members, another kind) retires the role: its process is killed
by pid and the new placement forms a new group.

A formation is (key, generation, every member's address): a rank process belongs to the
formation its host file names. A member that started its process and then sees a peer of the
same placement publish another address at that generation, or a lower generation (the peer's
role started over: its agent restarted, or it retired and took up the same placement again
while leadership moved), knows the peer will never join that formation: it moves everyone to
the next generation at once instead of waiting out its rank's formation timeout (a rank whose
peer never connects waits for ever in `mx.distributed.init`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from skulkp2p.cluster.config import split_addr
from skulkp2p.cluster.membership import ALIVE, SUSPECT
from skulkp2p.ports import free_port
from skulkp2p.wire import Message, as_int

if TYPE_CHECKING:
    from skulkp2p.cluster.node import ClusterNode
    from skulkp2p.engine.parallel.tensor.group import RankProcess
    from skulkp2p.engine.protocol import PrefixDiskSettings

log = logging.getLogger("skulkp2p.node")

POLL_S = 0.2



class TensorRole:
    def __init__(self, node: ClusterNode, model: str, ring: tuple[str, ...], key: str,
                 model_path: Callable[[], Path], dtype: Callable[[], str],
                 on_ready: Callable[[Message], None] | None = None,
                 prefix_cache_mb: float = 0.0,
                 on_error: Callable[[str | None], None] | None = None,
                 prefix_disk: PrefixDiskSettings | None = None):
        self.node = node
        self.model = model
        self.ring = ring
        self.key = key  # which placement this group is for (its term and serial)
        self.rank = ring.index(node.config.name)
        self.model_path = model_path  # blocking (may pull): called off the loop
        self.dtype = dtype
        self.on_ready = on_ready
        # Why this generation cannot form (its ranks disagree on dtype or model files), shown
        # by the node (on_error; None again once a new generation starts); not retried until
        # a member starts over.
        self.error: str | None = None
        self.on_error = on_error
        self.prefix_cache_mb = prefix_cache_mb  # each rank's own slice of the prefix cache
        self.prefix_disk = prefix_disk  # where each rank keeps its slices on disk too (or None)
        # Run (off the loop) once a generation of the group has formed and before any request
        # may use it: the loop's member measures the group's verify-width costs there.
        self.prepare: Callable[[RankProcess], None] | None = None
        self.gen = 0
        self.addr = ""
        self.proc: RankProcess | None = None  # when started
        # The formation this member's process (starting or started) joined: every member's
        # address at this generation, in rank order.
        self.formed_with: list[str] | None = None
        self.ready = False
        self._task: asyncio.Task[None] | None = None
        # Starting a rank and waiting for its group (up to READY_TIMEOUT_S) runs as its own
        # task: supervision keeps stepping meanwhile, so a formation that can no longer
        # complete is seen and abandoned at once, not when its rank gives up.
        self._forming: asyncio.Task[None] | None = None
        self.failures = 0

    # ---------------------------------------------------------------- facts

    def _host(self) -> str:
        ring_addr = self.node.facts.get("ring") or self.node.addr
        return split_addr(str(ring_addr))[0]

    def _publish(self, remove: bool = False) -> None:
        held = self.node.facts.get("tp")
        tp: Message = {k: v for k, v in held.items()
                       if k != self.model} if isinstance(held, dict) else {}
        if not remove:
            tp[self.model] = {"ring": list(self.ring), "key": self.key, "gen": self.gen,
                              "addr": self.addr}
        self.node.update_facts(tp=tp)

    def _peer(self, name: str) -> Message | None:
        if name == self.node.config.name:
            return {"ring": list(self.ring), "key": self.key, "gen": self.gen,
                    "addr": self.addr}
        m = self.node.started_core.membership.get(name)
        if m is None or m.state not in (ALIVE, SUSPECT):
            return None
        tp = m.facts.get("tp")
        got = tp.get(self.model) if isinstance(tp, dict) else None
        if (not isinstance(got, dict) or got.get("ring") != list(self.ring)
                or got.get("key") != self.key):  # an earlier placement's group
            return None
        return got

    # ---------------------------------------------------------------- life

    def start(self) -> None:
        self._new_generation(0)
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    def stop(self, publish: bool = True) -> None:
        for task in (self._task, self._forming):
            if task is not None:
                task.cancel()
        self._kill()
        if publish:
            self._publish(remove=True)

    def _kill(self) -> None:
        proc, self.proc, self.ready = self.proc, None, False
        self.formed_with = None
        if proc is not None:
            proc.kill()

    def _new_generation(self, gen: int) -> None:
        self._kill()
        if self.error is not None:
            self.error = None
            if self.on_error is not None:
                self.on_error(None)
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
        newest = max((as_int(p.get("gen") or 0) for p in peers if p), default=self.gen)
        if newest > self.gen:
            log.info("tensor: %s: the group re-forms (generation %d)", self.model, newest)
            self._new_generation(newest)
            return
        if self.error is not None:  # forming again would fail the same way
            left = self._left_formation(peers)
            if left is not None:
                log.info("tensor: %s: %s; forming the group again (generation %d)", self.model,
                         left, self.gen + 1)
                self._new_generation(self.gen + 1)
            return
        if self.proc is not None and not self.proc.alive():
            self.failures += 1
            log.warning("tensor: %s: rank %d: %s; re-forming the group", self.model,
                        self.rank, self.proc.why_dead())
            self._new_generation(self.gen + 1)
            return
        left = self._left_formation(peers)
        if left is not None:
            log.info("tensor: %s: %s; re-forming the group (generation %d)", self.model, left,
                     self.gen + 1)
            self._new_generation(self.gen + 1)
            return
        if self.proc is not None or (self._forming is not None and not self._forming.done()):
            return
        addrs = self._formation(peers)
        if addrs is None:
            return  # not every member has published this generation yet
        self.formed_with = addrs
        self._forming = asyncio.get_running_loop().create_task(self._start_process(addrs))

    def _formation(self, peers: list[Message | None]) -> list[str] | None:
        """Every member's address at this generation, once every member published one."""
        if not all(p and as_int(p.get("gen") or 0) == self.gen and p.get("addr") for p in peers):
            return None
        return [str(p["addr"]) for p in peers if p]

    def _left_formation(self, peers: list[Message | None]) -> str | None:
        """Why the formation this member's process joined can no longer complete (a peer of
        the same placement now shows another address at this generation, or an earlier
        generation: its role started over), or None. A peer not heard from (suspect, dead,
        or on another placement already) is membership's and placement's business."""
        formed = self.formed_with
        if formed is None:
            return None
        for name, p, addr in zip(self.ring, peers, formed, strict=True):
            if p is None or name == self.node.config.name:
                continue
            gen = as_int(p.get("gen") or 0)
            if gen < self.gen or (gen == self.gen and p.get("addr") != addr):
                return (f"member {name} started over (generation {gen} at {p.get('addr')!s}, "
                        f"this formation had {addr})")
        return None

    async def _start_process(self, addrs: list[str]) -> None:
        try:
            await self._form(addrs)
        except asyncio.CancelledError:
            raise
        except Exception:  # (a task's error would otherwise go unseen)
            log.exception("tensor: %s: forming the group failed", self.model)

    async def _form(self, addrs: list[str]) -> None:
        from skulkp2p.engine.parallel.tensor.group import (
            RankProcess,
            TensorAgreementError,
            TensorError,
        )

        loop = asyncio.get_running_loop()
        gen = self.gen
        path = await loop.run_in_executor(None, self.model_path)
        if gen != self.gen or self.formed_with != addrs:
            return  # the formation moved on while the model was pulled
        proc = RankProcess(path, self.rank, addrs, self.dtype(),
                           label=f"rank {self.rank} of {self.model}",
                           prefix_cache_mb=self.prefix_cache_mb,
                           prefix_disk=self.prefix_disk, model_id=self.model)
        self.proc = proc
        log.info("tensor: %s: rank %d of %d started (pid %d, generation %d, %s)", self.model,
                 self.rank, len(addrs), proc.pid, gen, addrs[self.rank])
        try:
            ready = await loop.run_in_executor(None, proc.wait_ready)
        except TensorAgreementError as e:
            if self.proc is not proc:
                return
            # Every rank found the same disagreement and ended before any collective of model
            # data: say so and wait for a member to start over (not a new generation each
            # poll, which would fail the same way).
            proc.kill()
            self.proc = None
            self.error = str(e)
            log.error("tensor: %s: the group cannot form: %s", self.model, e)
            if self.on_error is not None:
                self.on_error(self.error)
            return
        except TensorError as e:
            if self.proc is not proc:  # abandoned by supervision (a new generation)
                log.info("tensor: %s: rank %d left generation %d unformed", self.model,
                         self.rank, gen)
                return
            log.warning("tensor: %s: rank %d did not form its group: %s", self.model,
                        self.rank, e)
            # Timed out, the process may still wait in the collective's set-up: end it, so
            # the next step sees it dead and moves the group to the next generation.
            proc.kill()
            return
        prepare = self.prepare
        if prepare is not None and self.proc is proc:
            try:
                await loop.run_in_executor(None, prepare, proc)
            except Exception as e:  # the group still serves, with the costs it had
                log.warning("tensor: %s: preparing the group failed: %s", self.model, e)
        if self.proc is proc:
            self.ready = True
            log.info("tensor: %s: rank %d ready (%.1f MB held)", self.model, self.rank,
                     as_int(ready.get("param_bytes") or 0) / 1e6)
            if self.on_ready is not None:
                self.on_ready(ready)
