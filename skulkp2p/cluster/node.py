"""The control plane's I/O: asyncio TCP around the ClusterCore state machine.

Every control message is a one-way datagram carried over a persistent TCP connection per
destination (cluster/peer_link.py: opened on demand, re-opened after failures with a short
back-off); replies travel on the replier's own connection to the sender's advertised address. The
protocol tolerates loss, so a full queue, a failed connect or a slow peer simply drops frames.
Every inbound connection proves the secret first (cluster/handshake.py: the handshake, its
deadline, the caps and the slots kept for members); bad bytes on an inbound connection (wrong
secret, oversize, undecodable, replayed) close that connection and are counted in ``metrics``;
nothing a peer sends can stop the node.

One exception to one-way: a ``status`` request is answered on the connection it came on (tests,
``pipe --peer`` and operators use it: cluster/status_client.py). The flags and addresses are
cluster/config.py's, the facts a node announces cluster/facts.py's.

Run one node without a model (for tests and for looking at a cluster)::

    python -m skulkp2p.cluster.node --name a --port 52416 --peer 10.0.0.2:52416 --secret S
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeAlias

from skulkp2p import wire
from skulkp2p.cluster.config import (
    ClusterConfigError,
    NodeConfig,
    add_cluster_arguments,
    check_bind_allowed,
    config_from_args,
    parse_addr,
    split_addr,
)
from skulkp2p.cluster.core import ClusterCore
from skulkp2p.cluster.discovery import Discovery, start_discovery
from skulkp2p.cluster.durable import (
    DurableKey,
    StateInUse,
    cluster_id,
    load_state,
    lock_state,
    renamed_state_path,
    save_state,
)
from skulkp2p.cluster.election import ELECTION_TYPES
from skulkp2p.cluster.facts import model_spec, offered_memory
from skulkp2p.cluster.handshake import Gate, Link
from skulkp2p.cluster.membership import Out
from skulkp2p.cluster.peer_link import PeerLink
from skulkp2p.cluster.placement import ModelSpec, Placement
from skulkp2p.wire import Message, WireValue, as_int, as_list

log = logging.getLogger("skulkp2p.cluster")

TICK_S = 0.05
# An authenticated inbound connection that brings no whole frame for this long is closed (its
# sender reconnects); bytes of a frame do not restart the clock, whole frames do.
IDLE_TIMEOUT_S = 120.0

# (leader, term, plan version, placements): a change is logged and handed to on_change
_View: TypeAlias = tuple[str | None, int, int, tuple[tuple[str, Placement], ...]]


class ClusterNode:
    """One node's control plane on the running event loop."""

    def __init__(self, config: NodeConfig, facts: Mapping[str, WireValue] | None = None,
                 on_change: Callable[[ClusterNode], None] | None = None):
        self.config = config
        self.key = wire.frame_key(config.secret)
        # "engines" (which ones this node runs) comes from the composition root's facts.
        self.facts: Message = {"memory": offered_memory(config.memory_limit), "engines": [],
                               **(facts or {})}
        self.metrics: collections.Counter[str] = collections.Counter()
        self.on_change = on_change
        self.core: ClusterCore | None = None  # set by start(); see started_core
        self.addr = ""
        self.bind_source: str | None = None
        self._peers: dict[str, PeerLink] = {}
        self._closed = False  # close() ran: nothing is sent any more
        self._server: asyncio.base_events.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.gate = Gate("cluster", self.metrics, log)  # the listener's connections
        self._last_view: _View | None = None
        self._leader_seen: tuple[str, int] | None = None  # metrics["leader_changes"]
        self._clock0 = time.monotonic()
        self._cluster_id = cluster_id(self.key)
        # the durable state last written (ClusterCore.durable_key)
        self._saved_key: DurableKey | None = None
        self._save_error: str | None = None
        self._state_lock: int | None = None  # durable.lock_state's descriptor
        self.discovery: Discovery | None = None  # LAN discovery (cluster/discovery.py)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.config
        check_bind_allowed(cfg.host, cfg.secret)
        try:
            self._server = await asyncio.start_server(self._serve, cfg.host, cfg.port,
                                                      reuse_address=True)
        except OSError as e:
            if not cfg.port_fallback:
                raise ClusterConfigError(f"cannot listen for the cluster on {cfg.host}:"
                                         f"{cfg.port}: {e.strerror or e}") from None
            log.warning("cluster: port %d is busy (%s): listening on a free port instead; "
                        "pass --port to choose one", cfg.port, e.strerror or e)
            self._server = await asyncio.start_server(self._serve, cfg.host, 0,
                                                      reuse_address=True)
        port = self._server.sockets[0].getsockname()[1]
        if cfg.name_from_port and port != cfg.port:  # --port 0, or the default port was busy
            name = f"{cfg.name.rpartition(':')[0] or cfg.name}:{port}"
            # A model only this node has (a local folder) was asked for under the old name.
            self.facts["wants"] = [
                {**w, "only": [name if n == cfg.name else n for n in only]}
                if isinstance(w, dict) and isinstance(only := w.get("only"), list) else w
                for w in as_list(self.facts.get("wants"))]
            self.config = cfg = dataclasses.replace(
                cfg, name=name, state_file=None if cfg.state_file is None
                else renamed_state_path(cfg.state_file, name))
        if cfg.state_file is not None:
            try:
                self._state_lock = lock_state(cfg.state_file, cfg.name)
            except StateInUse as e:
                self._server.close()
                raise ClusterConfigError(str(e)) from None
        if cfg.advertise:
            self.addr = cfg.advertise
        elif cfg.host in ("0.0.0.0", "::", ""):
            self.addr = parse_addr(f"{_primary_ip()}:{port}")
        else:
            self.addr = parse_addr(f"{cfg.host}:{port}")
        seeds = list(cfg.peers)
        self.discovery = await start_discovery(cfg, self.addr, self._discovered, self.metrics)
        if self.discovery is not None:
            self.addr = self.discovery.addr  # a wildcard bind: an address on the LAN it found
            if not seeds:  # a founder only if nobody of this cluster answers in time
                seeds = await self.discovery.first_peers(cfg.discovery_wait)
                if seeds:
                    log.info("cluster: joining through %s, found on the LAN", ", ".join(seeds))
                else:
                    log.info("cluster: no node of this cluster found on the LAN within %g s: "
                             "founding one", cfg.discovery_wait)
        # Outbound connections leave from our own address, so peers (and the tests' fault
        # proxy) see which node a connection comes from.
        self.bind_source = cfg.host if cfg.host not in ("0.0.0.0", "::", "", "localhost") \
            else None
        restored = None
        if cfg.state_file is not None:
            restored = load_state(cfg.state_file, cfg.name, self._cluster_id)
            if restored is not None:
                voters = [m.name for m in restored.members if not m.left]
                log.info("cluster: restored term %d, plan %d.%d (%d place requests) and %d "
                         "other member%s from %s%s", restored.term, restored.plan_term,
                         restored.plan_version, len(restored.requests), len(restored.members),
                         "" if len(restored.members) == 1 else "s", cfg.state_file,
                         f": it leads only with votes from a majority of {len(voters) + 1} "
                         f"({', '.join(voters)} and itself)" if voters else "")
        core = self.core = ClusterCore(cfg.name, self.addr, facts=self.facts, seeds=seeds,
                                       priority=cfg.priority, timers=cfg.timers,
                                       rng=random.Random(), now=self._now(), restored=restored)
        self._saved_key = core.durable_key() if restored is not None else None
        log.info("cluster: node %s listening on %s:%d (advertised %s), %s, offers %.0f MB, "
                 "engines %s%s", cfg.name, cfg.host, port, self.addr,
                 "secret set" if cfg.secret else "no secret (loopback only)",
                 as_int(self.facts["memory"]) / 1e6,
                 ", ".join(str(e) for e in as_list(self.facts["engines"])) or "none",
                 f", peers {', '.join(cfg.peers)}" if cfg.peers else "")
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    async def close(self, leave: bool = True) -> None:
        """Stop; with ``leave`` tell the others first, so we stop counting towards quorum."""
        if self._ticker is not None:
            self._ticker.cancel()
        if leave and self.core is not None:
            self._send(self.core.leave(self._now()))  # membership only: nothing to save
            deadline = time.monotonic() + 0.5
            while any(p.queue for p in self._peers.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.05)
        if self.discovery is not None:
            await self.discovery.close()  # its goodbye: the others drop it from their lists
        if self._server is not None:
            self._server.close()
        self.gate.close()
        # A frame read before the gate closed its connection may still be dispatched: its
        # answer must not open a new PeerLink that nothing would ever close.
        self._closed = True
        for p in self._peers.values():
            p.cancel()
        self._peers.clear()
        if self._state_lock is not None:
            os.close(self._state_lock)  # (the process ending lets it go too)
            self._state_lock = None

    # ---------------------------------------------------------------- queries and requests

    @property
    def port(self) -> int:
        return split_addr(self.addr)[1]

    @property
    def started_core(self) -> ClusterCore:
        """The control plane's state machine, which start() creates (RuntimeError before)."""
        if self.core is None:
            raise RuntimeError(f"cluster node {self.config.name} is not started")
        return self.core

    def status(self) -> Message:
        st: Message = self.core.status() if self.core else {"node": self.config.name}
        st["addr"] = self.addr
        st["state_file"] = str(self.config.state_file) if self.config.state_file else None
        st["discovered"] = self.discovery.view() if self.discovery is not None else []
        metrics: Message = dict(self.metrics)
        st["metrics"] = metrics
        return st

    def placements(self) -> dict[str, Placement]:
        return self.core.placements() if self.core else {}

    @property
    def state_saved(self) -> bool:
        """Whether what this node holds is on disk (always, for a node without a state file).
        A single node commits without sending anything, so a place request is acknowledged
        only while this holds."""
        return self._save_error is None

    def request_placement(self, spec: ModelSpec, nodes: Iterable[str] = ()) -> None:
        self._send(self._saved(self.started_core.request_placement(spec, list(nodes),
                                                                   self._now())))

    def update_facts(self, **facts: WireValue) -> None:
        self.facts.update(facts)
        self.started_core.update_facts(self.facts)

    # ---------------------------------------------------------------- internals

    def _now(self) -> float:
        return time.monotonic() - self._clock0

    async def _tick_loop(self) -> None:
        while True:
            try:
                self._send(self._saved(self.started_core.tick(self._now())))
                self._after()
            except Exception:  # a bug must not silence the node's heartbeat for good
                log.exception("cluster tick failed")
            await asyncio.sleep(TICK_S)

    def _after(self) -> None:
        core = self.started_core
        for line in core.drain_events():
            log.info("cluster: %s", line)
        leader, term = core.leader, core.term
        if leader is not None and (leader, term) != self._leader_seen:  # new leader or term
            self._leader_seen = (leader, term)
            self.metrics["leader_changes"] += 1
        view = (core.leader, core.term, core.placement_version,
                tuple(sorted(core.placements().items())))
        if view != self._last_view:
            if self._last_view is None or view[3] != self._last_view[3]:
                for model, p in sorted(core.placements().items()):
                    log.info("cluster: placement of %s: ring %s, layers %s (term %d)", model,
                             " -> ".join(p.ring), p.layers, p.term)
                    if p.note:  # pinned to nodes that are away: placed elsewhere meanwhile
                        log.warning("cluster: %s", p.note)
                for _model, e in sorted(core.placement_errors().items()):
                    log.warning("cluster: %s", e["error"])
            self._last_view = view
            if self.on_change is not None:
                try:
                    self.on_change(self)
                except Exception:
                    log.exception("cluster: change handler failed")

    def _saved(self, outs: list[Out]) -> list[Out]:
        """Write the durable state if this step changed it, before its messages leave: a
        vote, an ack of a plan version or a heartbeat carrying a plan must never be sent by a
        node that could forget it in a power cut. Synchronous on purpose: a write is a small
        file and an fsync (about a millisecond; only when the term, vote, plan or commit
        changes), and sending before it is on disk is exactly what must not happen."""
        path = self.config.state_file
        if path is None:
            return outs
        core = self.started_core
        key = core.durable_key()
        if key == self._saved_key:
            return outs
        try:
            save_state(path, core.durable_state(), self._cluster_id)
        except OSError as e:
            if str(e) != self._save_error:
                log.error("cluster: cannot save the cluster state to %s (%s): not voting or "
                          "acknowledging plans until it can", path, e.strerror or e)
            self._save_error = str(e)
            self.metrics["state_save_errors"] += 1
            # Membership traffic does not depend on it; everything electoral waits.
            return [(a, m) for a, m in outs if m.get("t") not in ELECTION_TYPES]
        if self._save_error is not None:
            log.info("cluster: saving the cluster state to %s works again", path)
            self._save_error = None
        self._saved_key = key
        self.metrics["state_saves"] += 1
        return outs

    def _send(self, outs: list[Out]) -> None:
        if self._closed:
            return
        for addr, msg in outs:
            if addr == self.addr:
                continue
            try:
                body = wire.pack_body(msg, self.config.max_control_frame)
            except wire.WireError as e:
                log.warning("cluster: not sending %s to %s: %s", msg.get("t"), addr, e)
                continue
            peer = self._peers.get(addr)
            if peer is None:
                peer = self._peers[addr] = PeerLink(addr, self.metrics, self.bind_source,
                                                    self.key, self.config.max_control_frame)
            peer.send(body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = await self.gate.admit(reader, writer, self.key, self.config.max_control_frame,
                                      self.config.max_data_frame)
        if link is None:
            return
        try:
            while msgs := await link.frames(idle_s=IDLE_TIMEOUT_S):
                for msg in msgs:
                    self.metrics["frames_in"] += 1
                    self._dispatch(msg, link)
        except wire.WireError as e:
            self.gate.failed(link.host, e)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            self.gate.release(link)

    def _dispatch(self, msg: Message, link: Link) -> None:
        if self.core is None and msg["t"] != "status":
            return  # still looking for peers on the LAN (start): dropped, as if lost
        if msg["t"] == "status":
            link.send({"t": "status-reply", "status": self.status()})
            return
        try:
            self._send(self._saved(self.started_core.on_message(msg, self._now())))
            self._after()
        except Exception:  # a message our state machine chokes on must not kill the reader
            self.metrics["bad_messages"] += 1
            log.exception("cluster: failed to handle %s from %s", msg.get("t"), msg.get("from"))

    def _discovered(self, addr: str) -> None:
        """A node of this cluster found on the LAN after the start: joined through as a
        --peer seed (before the start, ``first_peers`` hands them to the core)."""
        if self.core is not None:
            self._send(self.core.membership.add_seed(addr))


def _primary_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def main(argv: list[str] | None = None) -> int:
    import signal

    p = argparse.ArgumentParser(prog="python -m skulkp2p.cluster.node",
                                description="Run one cluster node (control plane only).")
    add_cluster_arguments(p)
    p.add_argument("--model", action="append", default=[],
                   help="a model this node asks the cluster to place (card id or path)")
    p.add_argument("--data-dir", help="model store (for the models on disk it announces)")
    p.add_argument("--dtype", default="bfloat16", help="dtype it claims to run models in")
    p.add_argument("--engine", action="append", default=None,
                   help="an engine it claims to run (default mlx-cpu; repeat for more)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        from skulkp2p.models.store import ModelStore

        store = ModelStore(Path(args.data_dir) if args.data_dir else None)
        wants: list[WireValue] = [model_spec(store, m).to_dict() for m in args.model]
        pulled = [row["id"] for row in store.list() if row["pulled"]]
    except Exception as e:  # configuration errors end the program with one line
        print(f"skulkp2p: error: {e}", file=sys.stderr)
        return 1

    async def run() -> None:
        node = ClusterNode(config, {"wants": wants, "models": pulled, "dtype": args.dtype,
                                    "engines": args.engine or ["mlx-cpu"]})
        await node.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await node.close(leave=True)

    try:
        asyncio.run(run())
    except ClusterConfigError as e:
        print(f"skulkp2p: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
