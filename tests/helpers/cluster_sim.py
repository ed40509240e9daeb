"""A simulated network, clock and disk for the cluster's state machines, and a seeded chaos run.

Every message goes through the real wire encoding (its msgpack body: it must be msgpack-able
and under the control cap; the signature is left to the wire's own tests), then waits in a queue for a random delay; it can be lost, duplicated, delayed far
longer than the rest (so it overtakes nothing but is overtaken: reordering), cut by a partition,
or held while its receiver is paused (as a TCP buffer would). Nodes can crash (everything in
flight to them is lost: a new process gets new connections), pause (SIGSTOP: no ticks, messages
wait) and resume. With ``durable=True`` each node has a simulated disk: its durable state is
saved whenever it changed (and read back through the real file encoding on restart), before the messages of that step
leave (as node.py does), and ``restart`` brings a crashed node back from it. A node may have a
slow disk: a save then completes late, and until it does the node is stalled (node.py writes
synchronously: no ticks, no messages in or out); a crash before the save completes leaves the
old file and sends nothing.

``chaos(seed)`` builds a cluster, throws every one of those faults at it for a while, stops
them, and checks the invariants in every step (see ``Invariants``); a failure names the seed and
the command that replays it exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import os
import random
from collections import defaultdict
from collections.abc import Callable

import msgpack

from skulkp2p import wire
from skulkp2p.cluster import durable
from skulkp2p.cluster.core import COMMITTED, ClusterCore
from skulkp2p.cluster.election import LEADER
from skulkp2p.cluster.membership import ALIVE, DEAD
from skulkp2p.cluster.placement import ModelSpec
from skulkp2p.cluster.timers import Timers

SEED_ENV = "SKULKP2P_SIM_SEED"
REPLAY = (f"{SEED_ENV}={{seed}} .venv/bin/python -m pytest -q "
          "tests/test_cluster_sim.py::test_chaos_replay")


class SimNet:
    def __init__(self, seed: int = 0, loss: float = 0.0, delay: tuple[float, float] = (0.001, 0.02),
                 timers: Timers | None = None, step: float = 0.01, durable: bool = False):
        self.seed = seed
        self.rng = random.Random(seed)
        self.loss = loss
        self.delay = delay
        self.dup = 0.0  # chance that a frame arrives twice
        self.spike = 0.0  # chance that a frame takes spike_delay instead (others overtake it)
        self.spike_delay = (0.2, 1.5)
        self.timers = timers or Timers()
        self.step = step
        self.now = 0.0
        self.nodes: dict[str, ClusterCore] = {}  # addr -> core
        self.crashed: set[str] = set()
        self.paused: set[str] = set()
        self.blocked: set[tuple[str, str]] = set()  # (src addr, dst addr)
        # (due, order, src, dst, dst's process, frame)
        self._queue: list[tuple[float, int, str, str, int, bytes]] = []
        self._held: list[tuple[str, str, int, bytes]] = []
        self._counter = itertools.count()
        self.process: dict[str, int] = defaultdict(int)  # addr -> how many times it started
        # Safety record: every (term -> leaders) ever observed.
        self.leaders_by_term: dict[int, set[str]] = defaultdict(set)
        self.sent = 0
        self.durable = durable
        self.saved: dict[str, durable.DurableState] = {}  # node name -> what its disk holds
        self._saved_key: dict[str, durable.DurableKey | None] = {}
        # Slow disks: addr -> (min, max) seconds a save takes; a stalled node's pending save:
        # addr -> [when it completes, the file, the messages waiting for it].
        self.disk_delay: dict[str, tuple[float, float]] = {}
        self.stalled: dict[str, list] = {}
        self._made: dict[str, dict] = {}  # addr -> how its node was made (for restart)
        # Safety record: every real vote granted, (voter, term) -> candidates (restarts included).
        self.votes: dict[tuple[str, int], set[str]] = defaultdict(set)
        self.votes_cast = 0
        # Called after every step (the invariants); an exception ends the run.
        self.watchers: list[Callable[[], None]] = []

    # ---------------------------------------------------------------- building

    @staticmethod
    def addr(i: int, port: int = 52416) -> str:
        return f"10.0.0.{i}:{port}"

    def add(self, name: str, i: int, seeds: list[str] | None = None, facts: dict | None = None,
            priority: int = 0, port: int = 52416) -> ClusterCore:
        addr = self.addr(i, port)
        restored = None
        if self.durable and name in self.saved:  # (read back through the real file encoding)
            restored = durable.from_json(durable.to_json(self.saved[name], "sim"))
        self.process[addr] += 1
        core = ClusterCore(name, addr, facts=facts or {}, seeds=seeds or [], priority=priority,
                           timers=self.timers, rng=random.Random(self.rng.random()), now=self.now,
                           instance=f"{name}.{self.process[addr]}", restored=restored)
        self._made[addr] = {"name": name, "i": i, "seeds": seeds, "facts": facts,
                            "priority": priority, "port": port}
        self._saved_key[addr] = core.durable_key() if restored is not None else None
        self.nodes[addr] = core
        self.crashed.discard(addr)
        self._record(core)
        return core

    def cluster(self, n: int, facts: dict | None = None) -> list[ClusterCore]:
        """n nodes n0..n{n-1}; each knows node 0 as its seed (node 0 knows node 1)."""
        return [self.add(f"n{i}", i, [self.addr(0)] if i else [self.addr(1)], facts)
                for i in range(n)]

    # ---------------------------------------------------------------- faults

    def random_partition(self, nodes: list[ClusterCore]) -> None:
        """Split the nodes in two at random (1-4 of them on one side, the rest on the other)."""
        shuffled = nodes[:]
        self.rng.shuffle(shuffled)
        cut = self.rng.randint(1, min(4, len(nodes) - 1))
        self.partition(shuffled[:cut], shuffled[cut:])

    def partition(self, *groups: list[ClusterCore]) -> None:
        """Cut every link between different groups."""
        self.blocked.clear()
        for ga, gb in itertools.permutations(groups, 2):
            for a in ga:
                for b in gb:
                    self.blocked.add((a.addr, b.addr))

    def cut(self, a: ClusterCore, b: ClusterCore) -> None:
        self.blocked |= {(a.addr, b.addr), (b.addr, a.addr)}

    def heal(self) -> None:
        self.blocked.clear()

    def crash(self, core: ClusterCore) -> None:
        """The process dies: what it had not written is gone (a save in progress included),
        and so is everything in flight to it."""
        self.crashed.add(core.addr)
        self.paused.discard(core.addr)
        self.stalled.pop(core.addr, None)
        self._held = [h for h in self._held if h[1] != core.addr]

    def restart(self, core: ClusterCore, port: int | None = None,
                seeds: list[str] | None = None) -> ClusterCore:
        """A crashed node starts again as a new process: memory gone, its disk (when the net
        is durable) kept. With ``port`` it listens on another port (its old address is gone),
        with ``seeds`` it is given other seeds (--peer) than before."""
        assert core.addr in self.crashed, "restart a crashed node"
        made = dict(self._made[core.addr])
        if seeds is not None:
            made["seeds"] = seeds
        if port is not None and port != made["port"]:
            old = core.addr
            made["port"] = port
            del self.nodes[old], self._made[old]
            self.crashed.discard(old)
            self._saved_key.pop(old, None)
            if old in self.disk_delay:
                self.disk_delay[self.addr(made["i"], port)] = self.disk_delay.pop(old)
        return self.add(**made)

    def pause(self, core: ClusterCore) -> None:
        self.paused.add(core.addr)

    def resume(self, core: ClusterCore) -> None:
        self.paused.discard(core.addr)
        self._release(core.addr)

    def _release(self, addr: str) -> None:
        """Frames held for ``addr`` (paused or stalled) go on their way again."""
        if addr in self.paused or addr in self.stalled:
            return
        held, self._held = self._held, []
        for src, dst, process, frame in held:
            if dst == addr:
                self._push(src, dst, process, frame)
            else:
                self._held.append((src, dst, process, frame))

    # ---------------------------------------------------------------- running

    def live(self) -> list[ClusterCore]:
        return [c for a, c in self.nodes.items() if a not in self.crashed and a not in self.paused]

    def responsive(self) -> list[ClusterCore]:
        """Live nodes that are not stalled on a save: the ones an HTTP request would reach."""
        return [c for c in self.live() if c.addr not in self.stalled]

    @property
    def disk(self) -> dict[str, bytes]:
        """addr -> the node's state file, in the real file encoding."""
        return {c.addr: durable.to_json(self.saved[c.name], "sim")
                for c in self.nodes.values() if c.name in self.saved}

    def save(self, core: ClusterCore) -> None:
        """What node.py does before sending: write the durable state (here, to the simulated
        disk)."""
        self.saved[core.name] = core.durable_state()
        self._saved_key[core.addr] = core.durable_key()

    def send(self, src: str, outs) -> None:
        """A node's messages of one step: its state is saved first if it changed (on a slow
        disk the node stalls, and the messages leave once the save completes)."""
        core = self.nodes.get(src)
        if core is None or src in self.crashed:
            return
        self._record(core)
        pending = self.stalled.get(src)
        if pending is not None:  # (a test drove a stalled node directly)
            pending[1] = core.durable_state()
            self._saved_key[src] = core.durable_key()
            pending[2].extend(outs)
            return
        if self.durable and core.durable_key() != self._saved_key.get(src):
            slow = self.disk_delay.get(src)
            if slow is not None:
                self._saved_key[src] = core.durable_key()
                self.stalled[src] = [self.now + self.rng.uniform(*slow), core.durable_state(),
                                     list(outs)]
                return
            self.save(core)
        self._emit(src, outs)

    def _emit(self, src: str, outs) -> None:
        for dst, msg in outs:
            if msg.get("t") == "vote-reply" and msg.get("granted") and not msg.get("pre"):
                self.votes[(msg["from"], msg["for_term"])].add(dst)
                self.votes_cast += 1
            frame = wire.pack_body(msg)  # must survive the real encoding
            self.sent += 1
            if (src, dst) in self.blocked or self.rng.random() < self.loss:
                continue
            process = self.process[dst]
            self._push(src, dst, process, frame)
            if self.dup and self.rng.random() < self.dup:
                self._push(src, dst, process, frame)

    def _push(self, src: str, dst: str, process: int, frame: bytes) -> None:
        spike = self.spike and self.rng.random() < self.spike
        at = self.now + self.rng.uniform(*(self.spike_delay if spike else self.delay))
        heapq.heappush(self._queue, (at, next(self._counter), src, dst, process, frame))

    def _record(self, core: ClusterCore) -> None:
        """Every leadership a node took, however briefly (its election's events)."""
        el = core.election
        for role, term, _leader in el.events:
            if role == LEADER:
                self.leaders_by_term[term].add(core.name)
        el.events.clear()
        core.membership.events.clear()
        if el.role == LEADER:
            self.leaders_by_term[el.term].add(core.name)

    def run(self, seconds: float, until=None) -> bool:
        """Advance time; stop early (True) when ``until()`` holds."""
        end = self.now + seconds
        while self.now < end:
            self.now = round(self.now + self.step, 6)
            for addr, (done, data, outs) in list(self.stalled.items()):
                if done <= self.now:  # the slow save completed: the file, then the messages
                    del self.stalled[addr]
                    self.saved[self.nodes[addr].name] = data
                    self._emit(addr, outs)
                    self._release(addr)
            while self._queue and self._queue[0][0] <= self.now:
                _, _, src, dst, process, frame = heapq.heappop(self._queue)
                if (dst in self.crashed or dst not in self.nodes or (src, dst) in self.blocked
                        or process != self.process[dst]):
                    continue
                if dst in self.paused or dst in self.stalled:
                    self._held.append((src, dst, process, frame))
                    continue
                msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
                self.send(dst, self.nodes[dst].on_message(msg, self.now))
            for addr, core in list(self.nodes.items()):
                if addr in self.crashed or addr in self.paused or addr in self.stalled:
                    continue
                self.send(addr, core.tick(self.now))
            for watch in self.watchers:
                watch()
            if until is not None and until():
                return True
        return until() if until is not None else True

    # ---------------------------------------------------------------- observations

    def leaders(self, among: list[ClusterCore] | None = None) -> set[str]:
        return {c.name for c in (among or self.live()) if c.is_leader}

    def agreed_leader(self, among: list[ClusterCore] | None = None) -> str | None:
        """The one leader every node of ``among`` (default: the live ones) follows, or None."""
        among = among or self.live()
        seen = {(c.leader, c.term) for c in among}
        if len(seen) != 1:
            return None
        (leader, _term), = seen
        return leader if leader is not None and len(self.leaders(among)) == 1 else None

    def views_agree(self, among: list[ClusterCore] | None = None) -> bool:
        among = among or self.live()
        views = {tuple(sorted((n, m.state) for n, m in c.membership.members.items()))
                 for c in among}
        return len(views) == 1

    def double_votes(self) -> dict[tuple[str, int], set[str]]:
        """(voter, term) -> candidates, where a voter granted more than one in a term."""
        return {k: v for k, v in self.votes.items() if len(v) > 1}

    def safety_violations(self) -> dict[int, set[str]]:
        return {t: ls for t, ls in self.leaders_by_term.items() if len(ls) > 1}


# Every simulated node's facts in the placement tests: room for several small models.
MEMORY = {"memory": 4_000_000_000}


def small_spec(model: str, parallel: str = "", replicas: int = 0) -> ModelSpec:
    """A model of 10 MB and 8 layers: fits any one node of MEMORY (two KV heads: a tensor group
    of two when ``parallel="tensor"``), on ``replicas`` copies."""
    return ModelSpec(model, layers=8, size_bytes=10_000_000, context_length=512, hidden_size=64,
                     kv_heads=2 if parallel else 1, parallel=parallel, replicas=replicas)


def holders(net: SimNet, s: ModelSpec, nodes=()) -> list[str]:
    """Every node, crashed or paused ones included, whose plan holds the place request."""
    return sorted(c.name for c in net.nodes.values() if c.holds_request(s, nodes))


class AckLedger:
    """The chaos tests' bookkeeping: place requests asked through random live nodes, and every
    one that any live node ever reported committed (acknowledged)."""

    def __init__(self, net: SimNet):
        self.net = net
        self.asked: list[ModelSpec] = []
        self.acked: set[str] = set()

    def watch(self) -> bool:
        """A `net.run` condition that records acknowledgements and never ends the run."""
        for c in self.net.responsive():
            self.acked.update(s.id for s in self.asked if c.request_state(s) == COMMITTED)
        return False

    def ask(self, model: str) -> None:
        """Ask for `model` through a random live node, then let 0.05-0.6 s pass, watching."""
        s = small_spec(model)
        self.asked.append(s)
        via = self.net.rng.choice(self.net.responsive())
        self.net.send(via.addr, via.request_placement(s, now=self.net.now))
        self.net.run(self.net.rng.uniform(0.05, 0.6), self.watch)

    def lost(self, leader: ClusterCore) -> list[str]:
        """The acknowledged requests the leader's plan does not hold."""
        return sorted(m for m in self.acked if not leader.holds_request(small_spec(m)))


# ------------------------------------------------------------------------------------------------
# The seeded chaos run


class SimFailure(AssertionError):
    pass


@dataclasses.dataclass
class Asked:
    spec: ModelSpec
    nodes: tuple[str, ...]  # pinned ring, or () for automatic placement
    acked_term: int | None = None  # the plan term in which a node first reported it committed


class Invariants:
    """What must hold in every step of a run, checked by ``net.watchers``:

    - election safety: no term ever had two leaders (every leadership counts, however short,
      and a node's leaderships before a restart too), and no voter granted two candidates a
      vote in one term;
    - acknowledged placements are never lost: a place request that a responsive node reported
      committed (what makes the HTTP route answer 200) in plan term T is held by every leader of
      term T or later, from the moment it leads.
    """

    def __init__(self, net: SimNet, log: list[str]):
        self.net = net
        self.log = log
        self.asked: dict[str, Asked] = {}
        self._pending: list[Asked] = []  # asked, not acknowledged yet
        self._votes_seen = 0

    def ask(self, spec: ModelSpec, nodes: tuple[str, ...] = ()) -> None:
        net = self.net
        via = net.rng.choice(net.responsive())
        a = Asked(spec, nodes)
        self.asked[spec.id] = a
        self._pending.append(a)
        self.log.append(f"{net.now:7.2f} ask {spec.id} {spec.parallel or 'auto'} "
                        f"on {list(nodes) or 'any'} via {via.name}")
        net.send(via.addr, via.request_placement(spec, nodes, now=net.now))

    def fail(self, what: str) -> None:
        raise SimFailure(failure_text(self.net.seed, f"t={self.net.now:.2f}: {what}", self.log))

    def __call__(self) -> None:
        net = self.net
        bad = {t: ls for t, ls in net.leaders_by_term.items() if len(ls) > 1}
        if bad:
            self.fail(f"two leaders in one term: {bad}")
        if net.votes_cast != self._votes_seen:  # (a vote was granted: look again)
            self._votes_seen = net.votes_cast
            double = net.double_votes()
            if double:
                self.fail(f"a voter granted two votes in one term: {double}")
        if self._pending:
            for c in net.responsive():
                for a in list(self._pending):
                    if c.request_state(a.spec, a.nodes) == COMMITTED:
                        a.acked_term = c.committed()[0]
                        self._pending.remove(a)
                        self.log.append(f"{net.now:7.2f} {c.name} acknowledges {a.spec.id} "
                                        f"(term {a.acked_term})")
        for c in net.nodes.values():
            if c.addr in net.crashed or c.election.role != LEADER:
                continue
            for a in self.asked.values():
                if a.acked_term is not None and a.acked_term <= c.term \
                        and not c.holds_request(a.spec, a.nodes):
                    self.fail(f"leader {c.name} of term {c.term} lost {a.spec.id}, acknowledged "
                              f"in term {a.acked_term}")


def failure_text(seed: int, what: str, log: list[str]) -> str:
    tail = "\n".join(log[-40:])
    return (f"chaos seed {seed}: {what}\nreplay: {REPLAY.format(seed=seed)}\n"
            f"last events:\n{tail}")


@dataclasses.dataclass
class ChaosReport:
    seed: int
    nodes: int
    faults: int
    asked: int
    acked: int
    settled_after: float  # seconds of simulated time from the end of the faults
    steps: int
    fingerprint: str  # of everything that happened: the same seed must give the same one


# After the faults stop, every live node must hold the same plan and serve every model within
# this much simulated time (steps: SETTLE_S / STEP): an election (1.5 s + 0.25 s per rank + up
# to 0.5 s of jitter), a node that stays away declared dead (about 3 s), and a few heartbeats.
STEP = 0.05  # as node.py's tick
SETTLE_S = 20.0


def chaos(seed: int, fault_s: tuple[float, float] = (4.0, 10.0)) -> ChaosReport:
    """One seeded run: form a cluster of 3-5 nodes (a founder without seeds, the others joining
    through earlier ones; every node saves its state), then for a while crash and restart nodes
    (one, a majority, or all at once), partition, pause, lose, duplicate and delay frames, slow
    disks down and ask for placements (automatic, pinned, tensor-parallel) through random
    nodes; then stop the faults and restart the crashed nodes (one may stay away for good).
    Raises SimFailure, naming the seed, when an invariant breaks or the cluster does not settle
    within SETTLE_S: one leader, one plan on every live node, every model placed on live nodes
    (a pinned one on its nodes when they are all back) and the plan stable afterwards."""
    rng = random.Random(seed)
    net = SimNet(seed=seed, delay=(0.001, 0.03), step=STEP, durable=True)
    log: list[str] = []
    inv = Invariants(net, log)
    net.watchers.append(inv)
    n = rng.choice((3, 3, 4, 5))
    names = [f"n{i}" for i in range(n)]
    wanted = small_spec("w")
    nodes: list[ClusterCore] = []
    seed_of: dict[int, int] = {}
    for i in range(n):
        facts = dict(MEMORY)
        if i == n - 1:
            facts["wants"] = [wanted.to_dict()]  # a member's --model
        if i:
            seed_of[i] = rng.randrange(i)
        seeds = [SimNet.addr(seed_of[i])] if i else []
        nodes.append(net.add(names[i], i, seeds, facts, priority=rng.choice((0, 0, 5))))
        log.append(f"{net.now:7.2f} start {names[i]} seeds {seeds}")
        net.run(rng.uniform(0, 1))
    if not net.run(30, lambda: net.agreed_leader() is not None and net.views_agree()
                   and all(len(c.membership.members) == n for c in nodes)):
        inv.fail("the cluster did not form")

    ports = itertools.count(52417)
    # One node may stay away for good once the faults stop (the rest is still a majority).
    gone = rng.randrange(n) if rng.random() < 0.3 else None

    def restart(i: int) -> None:
        # A node that is nobody's seed, and whose own seed will be there in the end, may come
        # back on another port (the others' --peer stay right): its saved members and the
        # others' view of it are stale until gossip mends them.
        port = (next(ports) if i not in seed_of.values() and seed_of.get(i) != gone
                and rng.random() < 0.3 else None)
        nodes[i] = net.restart(nodes[i], port=port)
        log.append(f"{net.now:7.2f} restart {names[i]}{f' on port {port}' if port else ''} "
                   f"(term {nodes[i].term}, plan {nodes[i].plan_id})")

    faults = 0
    models = itertools.count()
    end = net.now + rng.uniform(*fault_s)
    while net.now < end:
        faults += 1
        up = [i for i in range(n) if nodes[i].addr not in net.crashed]
        down = [i for i in range(n) if nodes[i].addr in net.crashed]
        if rng.random() < 0.5 and net.responsive():  # a place request, through any node
            kind = rng.choice(("auto", "auto", "pinned", "tensor"))
            index = next(models)
            m = f"m{index}"
            if kind == "auto":  # every third on two replicas (no draw: the same seeds' runs)
                inv.ask(small_spec(m, replicas=2 if index % 3 == 0 else 0))
            elif kind == "pinned":
                inv.ask(small_spec(m), tuple(rng.sample(names, rng.choice((1, 2)))))
            else:
                inv.ask(small_spec(m, "tensor"), tuple(rng.sample(names, 2)))
        fault = rng.choice(("none", "crash", "restart", "restart", "power_cut", "partition",
                            "heal", "pause", "slow_disk", "network"))
        if fault == "crash" and up:
            i = rng.choice(up)
            net.crash(nodes[i])
            log.append(f"{net.now:7.2f} crash {names[i]}")
        elif fault == "restart" and down:
            restart(rng.choice(down))
        elif fault == "power_cut":
            victims = rng.sample(range(n), rng.randint(n // 2 + 1, n))
            for i in victims:
                net.crash(nodes[i])
            log.append(f"{net.now:7.2f} power cut {[names[i] for i in victims]}")
            net.run(rng.uniform(0, 2))
            for i in victims:
                if rng.random() < 0.8:
                    restart(i)
        elif fault == "partition":
            net.random_partition(nodes)
            log.append(f"{net.now:7.2f} partition {sorted(net.blocked)}")
        elif fault == "heal":
            net.heal()
            log.append(f"{net.now:7.2f} heal")
        elif fault == "pause" and up:
            i = rng.choice(up)
            net.pause(nodes[i])
            log.append(f"{net.now:7.2f} pause {names[i]}")
            net.run(rng.uniform(0.2, 4))
            net.resume(nodes[i])
            log.append(f"{net.now:7.2f} resume {names[i]}")
        elif fault == "slow_disk":
            i = rng.randrange(n)
            if nodes[i].addr in net.disk_delay:
                del net.disk_delay[nodes[i].addr]
            else:
                net.disk_delay[nodes[i].addr] = (0.02, rng.choice((0.2, 1.0)))
            log.append(f"{net.now:7.2f} disk of {names[i]}: "
                       f"{net.disk_delay.get(nodes[i].addr, 'fast')}")
        elif fault == "network":
            net.loss = rng.choice((0.0, 0.05, 0.2, 0.5))
            net.dup = rng.choice((0.0, 0.05, 0.2))
            net.spike = rng.choice((0.0, 0.02, 0.1))
            log.append(f"{net.now:7.2f} loss {net.loss} dup {net.dup} spike {net.spike}")
        net.run(rng.uniform(0.1, 1.0))

    # The faults stop.
    net.heal()
    net.loss = net.dup = net.spike = 0.0
    net.disk_delay.clear()
    for c in nodes:
        if c.addr in net.paused:
            net.resume(c)
    down = [i for i in range(n) if nodes[i].addr in net.crashed]
    if gone is not None and nodes[gone].addr not in net.crashed:
        net.crash(nodes[gone])
    for i in down:
        if i != gone:
            restart(i)
    log.append(f"{net.now:7.2f} faults stop" + (f"; {names[gone]} stays away" if gone is not None
                                                 else ""))
    t0 = net.now
    live = [c for c in nodes if c.addr not in net.crashed]
    present = {c.name for c in live}

    def settled() -> bool:
        leader_name = net.agreed_leader(live)
        if leader_name is None or not net.views_agree(live) or any(
                m.state != (ALIVE if name in present else DEAD)
                for name, m in live[0].membership.members.items()):
            return False  # (a stale rumour of a partition may still move a placement)
        leader = next(c for c in live if c.name == leader_name)
        if len({c.plan_id for c in live}) != 1 or leader.placement_errors():
            return False
        placed = leader.placements()
        if set(placed) != leader.requested():
            return False
        for model, p in placed.items():
            if not set(p.holders) <= present or any(c.placements().get(model) != p for c in live):
                return False
            if len(set(p.holders)) != len(p.holders):
                raise SimFailure(f"seed {seed}: replicas of {model} share a node: {p.holders}")
            want = max(1, p.spec.replicas) if p.spec is not None else 1
            if len(p.copies()) != min(want, len(present)):
                return False  # each replica placed while there are nodes for it
            if any(leader.membership.get(r) is None or leader.membership.get(r).state != ALIVE
                   for r in p.holders):
                return False
            a = inv.asked.get(model)
            if a is not None and a.nodes and set(a.nodes) <= present and p.ring != a.nodes:
                return False  # back on its pinned nodes once they are all back
        return True

    # (Frames sent during the faults may still arrive for spike_delay: they count as faults.)
    if not net.run(SETTLE_S, lambda: net.now >= t0 + net.spike_delay[1] and settled()):
        leader = next((c for c in live if c.is_leader), None)
        inv.fail(f"not settled {SETTLE_S:g} s after the faults stopped: leaders "
                 f"{[(c.name, c.leader, c.term, c.plan_id) for c in live]}, errors "
                 f"{leader.placement_errors() if leader else None}, placed "
                 f"{ {m: p.ring for m, p in leader.placements().items()} if leader else None}")
    settled_after = net.now - t0
    plan, before = live[0].plan_id, live[0].status()["placements"]
    net.run(2.0)
    if not settled() or live[0].plan_id != plan:
        inv.fail(f"the plan moved after it settled: {plan} -> {live[0].plan_id}: {before} -> "
                 f"{live[0].status()['placements']}")
    acked = sum(1 for a in inv.asked.values() if a.acked_term is not None)
    trace = "\n".join(log) + repr((net.sent, sorted(net.disk.items()),
                                   [(c.name, c.term, c.plan_id, c.leader) for c in nodes]))
    return ChaosReport(seed, n, faults, len(inv.asked), acked, settled_after,
                       round(net.now / net.step), hashlib.sha256(trace.encode()).hexdigest()[:16])


def seeds_from_env(default: range) -> list[int]:
    """``SKULKP2P_SIM_SEED=123`` (or ``=1,2,3``) runs those seeds instead of ``default``."""
    given = os.environ.get(SEED_ENV, "").strip()
    return [int(s) for s in given.split(",") if s.strip()] if given else list(default)


if __name__ == "__main__":  # python -m tests.helpers.cluster_sim SEED...: one line per seed
    import sys

    for arg in sys.argv[1:]:
        print(chaos(int(arg)))
