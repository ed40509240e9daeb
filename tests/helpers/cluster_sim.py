"""A simulated network and clock for the cluster's state machines.

Every message goes through the real wire encoding (so it must be msgpack-able and under the
control cap), then waits in a queue for a random delay; it can be lost, cut by a partition, or
held while its receiver is paused (as a TCP buffer would). Nodes can crash (lose everything sent
to them), pause (SIGSTOP: no ticks, messages wait) and resume. With ``durable=True`` each node
has a simulated disk: its durable state is saved, through the real file encoding, before each
of its messages leaves (as node.py does), and ``restart`` brings a crashed node back from it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict

from skulkp2p import wire
from skulkp2p.cluster import durable
from skulkp2p.cluster.core import COMMITTED, ClusterCore
from skulkp2p.cluster.election import LEADER
from skulkp2p.cluster.placement import ModelSpec
from skulkp2p.cluster.timers import Timers

KEY = wire.frame_key("sim-secret")


class SimNet:
    def __init__(self, seed: int = 0, loss: float = 0.0, delay: tuple[float, float] = (0.001, 0.02),
                 timers: Timers | None = None, step: float = 0.01, durable: bool = False):
        self.rng = random.Random(seed)
        self.loss = loss
        self.delay = delay
        self.timers = timers or Timers()
        self.step = step
        self.now = 0.0
        self.nodes: dict[str, ClusterCore] = {}  # addr -> core
        self.crashed: set[str] = set()
        self.paused: set[str] = set()
        self.blocked: set[tuple[str, str]] = set()  # (src addr, dst addr)
        self._queue: list[tuple[float, int, str, str, bytes]] = []
        self._held: list[tuple[str, str, bytes]] = []
        self._counter = itertools.count()
        # Safety record: every (term -> leaders) ever observed.
        self.leaders_by_term: dict[int, set[str]] = defaultdict(set)
        self.sent = 0
        self.durable = durable
        self.disk: dict[str, bytes] = {}  # addr -> the node's saved state file
        self._made: dict[str, dict] = {}  # addr -> how its node was made (for restart)
        # Safety record: every real vote granted, (voter, term) -> candidates (restarts included).
        self.votes: dict[tuple[str, int], set[str]] = defaultdict(set)

    # ---------------------------------------------------------------- building

    @staticmethod
    def addr(i: int) -> str:
        return f"10.0.0.{i}:52416"

    def add(self, name: str, i: int, seeds: list[str] | None = None, facts: dict | None = None,
            priority: int = 0) -> ClusterCore:
        addr = self.addr(i)
        restored = None
        if self.durable and addr in self.disk:
            restored = durable.from_json(self.disk[addr])
        core = ClusterCore(name, addr, facts=facts or {}, seeds=seeds or [], priority=priority,
                           timers=self.timers, rng=random.Random(self.rng.random()), now=self.now,
                           restored=restored)
        self._made[addr] = {"name": name, "i": i, "seeds": seeds, "facts": facts,
                            "priority": priority}
        self.nodes[addr] = core
        self.crashed.discard(addr)
        return core

    def cluster(self, n: int, facts: dict | None = None) -> list[ClusterCore]:
        """n nodes n0..n{n-1}; each knows node 0 as its seed (node 0 knows node 1)."""
        return [self.add(f"n{i}", i, [self.addr(0)] if i else [self.addr(1)], facts)
                for i in range(n)]

    # ---------------------------------------------------------------- faults

    def random_partition(self, nodes: list[ClusterCore]) -> None:
        """Split five nodes in two at random (1-4 on one side): the chaos tests' partition."""
        shuffled = nodes[:]
        self.rng.shuffle(shuffled)
        cut = self.rng.randint(1, 4)
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
        self.crashed.add(core.addr)

    def restart(self, core: ClusterCore) -> ClusterCore:
        """A crashed node starts again as a new process: memory gone, its disk (when the net
        is durable) kept."""
        assert core.addr in self.crashed, "restart a crashed node"
        return self.add(**self._made[core.addr])

    def pause(self, core: ClusterCore) -> None:
        self.paused.add(core.addr)

    def resume(self, core: ClusterCore) -> None:
        self.paused.discard(core.addr)
        held, self._held = self._held, []
        for src, dst, frame in held:
            if dst == core.addr:
                self._push(src, dst, frame)
            else:
                self._held.append((src, dst, frame))

    # ---------------------------------------------------------------- running

    def live(self) -> list[ClusterCore]:
        return [c for a, c in self.nodes.items() if a not in self.crashed and a not in self.paused]

    def save(self, core: ClusterCore) -> None:
        """What node.py does before sending: write the durable state (here, to the simulated
        disk, through the real encoding)."""
        self.disk[core.addr] = durable.to_json(core.durable_state(), "sim")

    def send(self, src: str, outs) -> None:
        core = self.nodes.get(src)
        if self.durable and core is not None and src not in self.crashed:
            self.save(core)
        for dst, msg in outs:
            if msg.get("t") == "vote-reply" and msg.get("granted") and not msg.get("pre"):
                self.votes[(msg["from"], msg["for_term"])].add(dst)
            frame = wire.encode_frame(msg, KEY)  # must survive the real encoding
            self.sent += 1
            if (src, dst) in self.blocked or self.rng.random() < self.loss:
                continue
            self._push(src, dst, frame)

    def _push(self, src: str, dst: str, frame: bytes) -> None:
        at = self.now + self.rng.uniform(*self.delay)
        heapq.heappush(self._queue, (at, next(self._counter), src, dst, frame))

    def run(self, seconds: float, until=None) -> bool:
        """Advance time; stop early (True) when ``until()`` holds."""
        end = self.now + seconds
        while self.now < end:
            self.now = round(self.now + self.step, 6)
            while self._queue and self._queue[0][0] <= self.now:
                _, _, src, dst, frame = heapq.heappop(self._queue)
                if dst in self.crashed or dst not in self.nodes or (src, dst) in self.blocked:
                    continue
                if dst in self.paused:
                    self._held.append((src, dst, frame))
                    continue
                (msg,) = wire.FrameDecoder(KEY).feed(frame)
                self.send(dst, self.nodes[dst].on_message(msg, self.now))
            for addr, core in list(self.nodes.items()):
                if addr in self.crashed or addr in self.paused:
                    continue
                self.send(addr, core.tick(self.now))
            for core in self.live():
                if core.election.role == LEADER:
                    self.leaders_by_term[core.term].add(core.name)
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


def small_spec(model: str) -> ModelSpec:
    """A model of 10 MB and 8 layers: fits any one node of MEMORY."""
    return ModelSpec(model, layers=8, size_bytes=10_000_000, context_length=512, hidden_size=64,
                     kv_heads=1)


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
        for c in self.net.live():
            self.acked.update(s.id for s in self.asked if c.request_state(s) == COMMITTED)
        return False

    def ask(self, model: str) -> None:
        """Ask for `model` through a random live node, then let 0.05-0.6 s pass, watching."""
        s = small_spec(model)
        self.asked.append(s)
        via = self.net.rng.choice(self.net.live())
        self.net.send(via.addr, via.request_placement(s, now=self.net.now))
        self.net.run(self.net.rng.uniform(0.05, 0.6), self.watch)

    def lost(self, leader: ClusterCore) -> list[str]:
        """The acknowledged requests the leader's plan does not hold."""
        return sorted(m for m in self.acked if not leader.holds_request(small_spec(m)))
