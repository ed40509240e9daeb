"""SWIM-style membership as a pure state machine (no sockets, no clock of its own).

Drive it with ``tick(now)`` and ``on_message(msg, now)``; both return ``[(addr, msg), ...]`` to
send. Delivery is best effort: the protocol tolerates loss, so the I/O layer may drop anything.

- Failure detection: each probe interval one member (round-robin over a shuffled list) gets a
  ``ping``; without an ``ack`` by ``ping_timeout``, ``indirect_k`` other members are asked to
  ping it for us (``ping-req``), so one bad link does not condemn a healthy node; without any ack
  by ``probe_timeout`` the member becomes *suspect*, and *dead* after ``suspect_timeout``.
- Refutation: a node that hears itself suspected (or dead) at incarnation i re-announces itself
  alive at i+1; a higher incarnation always wins, so a false suspicion dies out.
- Dissemination: state changes ride as rumours on pings and acks (each a bounded number of
  times); a periodic full-state ``sync`` with a random member repairs whatever gossip lost, and a
  sync with a random *dead* member lets partitions heal and restarted nodes come back.
- Facts: each member's entry carries the facts it announces (memory, engines, models, HTTP
  address); a node bumps its incarnation when its facts change.
- Restarts: the members a node knew are saved (``roster``) and restored (``restore``) at
  incarnation -1, so whatever a live member says about itself wins; those that did not leave
  come back *suspect* (they keep what they hold and count towards the quorum; one that stays
  away is declared dead as usual), and a node that knew any is part of a cluster already.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict, TypeGuard

from skulkp2p.cluster.durable import KnownMember
from skulkp2p.cluster.timers import Timers
from skulkp2p.wire import Message, WireValue, as_list

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)
# At equal incarnation the worse news wins; a higher incarnation always wins.
_RANK = {ALIVE: 0, SUSPECT: 1, DEAD: 2, LEFT: 3}

Out = tuple[str, Message]  # (destination address "host:port", message)


class _Entry(TypedDict):
    """A member's entry as gossip carries it (see Member.entry), once _valid_entry passed."""

    n: str  # name
    a: str  # address
    i: int  # incarnation
    s: str  # state
    x: NotRequired[WireValue]  # instance
    f: NotRequired[Message]  # facts


@dataclass
class Member:
    name: str
    addr: str
    inc: int = 0
    state: str = ALIVE
    facts: Message = field(default_factory=dict)
    instance: str = ""  # random per process start: tells a restarted node from its old self
    since: float = 0.0  # local time of the last state change
    suspect_deadline: float | None = None

    def entry(self) -> Message:
        return {"n": self.name, "a": self.addr, "i": self.inc, "s": self.state,
                "x": self.instance, "f": self.facts}


@dataclass
class _Probe:
    target: str
    inc: int
    seq: int
    sent: float
    indirect: bool = False
    acked: bool = False


@dataclass
class _Relay:
    reply_to: str
    seq: int
    target: str
    expires: float


def _valid_entry(e: WireValue) -> TypeGuard[_Entry]:
    return (isinstance(e, dict) and isinstance(e.get("n"), str) and bool(e["n"])
            and isinstance(e.get("a"), str) and isinstance(e.get("i"), int)
            and not isinstance(e.get("i"), bool) and e.get("s") in _RANK
            and isinstance(e.get("f", {}), dict))


class Membership:
    """One node's view of the cluster."""

    def __init__(self, name: str, addr: str, facts: Mapping[str, WireValue] | None = None, *,
                 seeds: Iterable[str] = (), timers: Timers | None = None,
                 rng: random.Random | None = None, instance: str | None = None,
                 now: float = 0.0):
        self.timers = timers or Timers()
        self.rng = rng or random.Random()
        self.me = Member(name, addr, 0, ALIVE, dict(facts or {}),
                         instance or uuid.uuid4().hex[:12], now)
        self.members: dict[str, Member] = {name: self.me}
        self.seeds = [s for s in dict.fromkeys(seeds) if s != addr]
        # A node given seeds has joined nothing until one of them answers (or until it hears an
        # established cluster's election traffic, see core.py): until then it neither stands
        # nor votes, so nodes that only know each other cannot crown a cluster of their own.
        self.bootstrapped = not self.seeds
        # Whether a seed answered (or there is none). A node restored with members it knew is
        # bootstrapped at once, but their saved addresses may be stale (a node restarted on
        # another port): it keeps knocking on its seeds too until one answers.
        self.seed_answered = not self.seeds
        self.events: list[tuple[str, str | None, str]] = []  # (name, old state, new state)
        self._rumours: dict[str, int] = {}  # member name -> transmissions left
        self._probe: _Probe | None = None
        self._order: list[str] = []
        self._next_probe = now
        self._next_sync = now
        self._seq = 0
        self._relays: dict[int, _Relay] = {}
        self._roster: tuple[KnownMember, ...] | None = None  # cache of roster()
        # Bumped whenever a member's entry changes (state, address, facts) or a member is
        # added: what depends only on the member list need not be recomputed while it stays.
        self.version = 0

    # ---------------------------------------------------------------- queries

    @property
    def name(self) -> str:
        return self.me.name

    def get(self, name: str) -> Member | None:
        return self.members.get(name)

    def names(self, *states: str) -> list[str]:
        """Member names (self included) in the given states, sorted."""
        return sorted(n for n, m in self.members.items() if m.state in states)

    def voters(self) -> list[str]:
        """Everyone who counts for a quorum: all known members except those that left
        gracefully. Dead members count, so a partition's minority can never elect."""
        return self.names(ALIVE, SUSPECT, DEAD)

    def drain_events(self) -> list[tuple[str, str | None, str]]:
        events, self.events = self.events, []
        return events

    def roster(self) -> tuple[KnownMember, ...]:
        """The other members, sorted by name: what a restart must remember of them."""
        if self._roster is None:
            self._roster = tuple(KnownMember(m.name, m.addr, m.state == LEFT)
                                 for _, m in sorted(self.members.items()) if m is not self.me)
        return self._roster

    def restore(self, known: Iterable[KnownMember], now: float) -> None:
        """Take back the members saved before a restart, at incarnation -1 (anything a live
        member says about itself wins): the ones that left stay left; the others are suspect, so
        they count towards the quorum and keep what they hold while they come back, and are
        declared dead if they do not. A node that knew any other voter has joined a cluster:
        it may vote and stand (with a quorum of them) without a seed answering first."""
        for k in known:
            if k.name == self.name or k.name in self.members:
                continue
            state = LEFT if k.left else SUSPECT
            m = Member(k.name, k.addr, -1, state, {}, "", now)
            if state == SUSPECT:
                m.suspect_deadline = now + self.timers.suspect_timeout
                self.bootstrapped = True
            self.members[k.name] = m
            self.events.append((k.name, None, state))
        self._roster = None
        self.version += 1

    # ---------------------------------------------------------------- local changes

    def update_facts(self, facts: Mapping[str, WireValue]) -> None:
        """New facts about this node: a new incarnation carries them."""
        if dict(facts) == self.me.facts:
            return
        self.me.facts = dict(facts)
        self.me.inc += 1
        self.version += 1
        self._rumour(self.me.name)

    def leave(self, now: float) -> list[Out]:
        """Graceful exit: tell everyone we left, so we stop counting towards quorum."""
        self.me.inc += 1
        self.me.state = LEFT
        self.version += 1
        msg: Message = {"t": "sync", "members": [self.me.entry()], "reply": False}
        return [(m.addr, self._stamp(dict(msg))) for m in self.members.values()
                if m is not self.me and m.state != LEFT]

    def add_seed(self, addr: str) -> list[Out]:
        """A node found after the start (LAN discovery): a seed from now on, as a --peer, and
        sent our member list at once unless it is a live member already, so that a node still
        joining, or a founder and a cluster that find each other, merge."""
        if addr == self.me.addr or self.me.state == LEFT:
            return []
        if addr not in self.seeds:
            self.seeds.append(addr)
        if any(m.addr == addr and m.state in (ALIVE, SUSPECT) for m in self.members.values()):
            return []
        return [(addr, {**self._sync_msg(reply=True), "seed": addr})]

    # ---------------------------------------------------------------- driving

    def tick(self, now: float) -> list[Out]:
        out: list[Out] = []
        if self.me.state == LEFT:
            return out
        t = self.timers
        for m in self.members.values():
            if m.state == SUSPECT and m.suspect_deadline is not None and now >= m.suspect_deadline:
                self._set(m, m.inc, DEAD, now)
        for seq in [s for s, r in self._relays.items() if now >= r.expires]:
            del self._relays[seq]

        p = self._probe
        if p is not None:
            if p.acked:
                self._probe = None
            elif not p.indirect and now >= p.sent + t.ping_timeout:
                p.indirect = True
                target = self.members.get(p.target)
                helpers = [n for n in self.names(ALIVE) if n not in (self.name, p.target)]
                self.rng.shuffle(helpers)
                if target is not None:
                    for h in helpers[:t.indirect_k]:
                        out.append((self.members[h].addr, self._with_gossip(
                            {"t": "ping-req", "seq": p.seq, "target": p.target,
                             "target_addr": target.addr}, h)))
            elif now >= p.sent + t.probe_timeout:
                self._probe = None
                silent = self.members.get(p.target)
                if silent is not None and silent.state == ALIVE and silent.inc == p.inc:
                    self._set(silent, silent.inc, SUSPECT, now)
        if self._probe is None and now >= self._next_probe:
            self._next_probe = now + t.probe_interval
            target = self._next_target()
            if target is not None:
                self._seq += 1
                self._probe = _Probe(target.name, target.inc, self._seq, now)
                out.append((target.addr, self._with_gossip(
                    {"t": "ping", "seq": self._seq}, target.name)))

        if now >= self._next_sync:
            # Until a seed answers, knock more often: seeds often start a moment later.
            self._next_sync = now + (t.sync_interval if self.seed_answered
                                     else min(t.sync_interval, t.probe_interval))
            out.extend(self._syncs())
        return out

    def on_message(self, msg: Mapping[str, WireValue], now: float) -> list[Out]:
        """Handle one membership message (types ping, ack, ping-req, sync); anything malformed
        is ignored: the sender was authenticated, but may run a different version."""
        out: list[Out] = []
        if self.me.state == LEFT:
            return out
        sender = msg.get("from")
        reply_to = msg.get("addr")
        if not isinstance(sender, str) or not isinstance(reply_to, str):
            return out
        if reply_to in self.seeds or msg.get("seed") in self.seeds:
            self.bootstrapped = True
            self.seed_answered = True
        me = msg.get("me")
        if _valid_entry(me):
            self._apply(me, now)
        for e in as_list(msg.get("g")):
            if _valid_entry(e):
                self._apply(e, now)
        kind = msg.get("t")
        seq = msg.get("seq")
        if kind == "ping" and isinstance(seq, int):
            out.append((reply_to, self._with_gossip({"t": "ack", "seq": seq}, sender)))
        elif kind == "ack" and isinstance(seq, int):
            p = self._probe
            about = msg.get("target", sender)
            if p is not None and p.seq == seq and about == p.target:
                p.acked = True
            relay = self._relays.pop(seq, None)
            if relay is not None and sender == relay.target:
                out.append((relay.reply_to, self._with_gossip(
                    {"t": "ack", "seq": relay.seq, "target": relay.target}, None)))
        elif kind == "ping-req" and isinstance(seq, int):
            target, addr = msg.get("target"), msg.get("target_addr")
            if isinstance(target, str) and isinstance(addr, str) and target != self.name:
                self._seq += 1
                self._relays[self._seq] = _Relay(reply_to, seq, target,
                                                 now + self.timers.probe_timeout)
                out.append((addr, self._with_gossip({"t": "ping", "seq": self._seq}, target)))
        elif kind == "sync":
            for e in as_list(msg.get("members")):
                if _valid_entry(e):
                    self._apply(e, now)
            if msg.get("reply"):
                reply = self._sync_msg(reply=False)
                if isinstance(msg.get("seed"), str):  # lets the asker know its seed answered
                    reply["seed"] = msg["seed"]
                out.append((reply_to, reply))
        return out

    # ---------------------------------------------------------------- internals

    def _stamp(self, msg: Message) -> Message:
        msg["from"] = self.name
        msg["addr"] = self.me.addr
        return msg

    def _sync_msg(self, reply: bool) -> Message:
        return self._stamp({"t": "sync", "members": [m.entry() for m in self.members.values()],
                            "reply": reply})

    def _seed_syncs(self) -> list[Out]:
        return [(s, {**self._sync_msg(reply=True), "seed": s}) for s in self.seeds]

    def _syncs(self) -> list[Out]:
        if not self.bootstrapped:
            return self._seed_syncs()
        out: list[Out] = []
        others = [m for m in self.members.values() if m is not self.me]
        alive = [m for m in others if m.state in (ALIVE, SUSPECT)]
        dead = [m for m in others if m.state == DEAD]
        if alive:
            out.append((self.rng.choice(alive).addr, self._sync_msg(reply=True)))
        if dead:  # how a healed partition or a restarted node finds its way back
            out.append((self.rng.choice(dead).addr, self._sync_msg(reply=True)))
        if not self.seed_answered or not (alive or dead):
            # restored with members that may have moved, or everyone we knew is gone
            out.extend(self._seed_syncs())
        return out

    def _next_target(self) -> Member | None:
        for _ in range(2):
            while self._order:
                m = self.members.get(self._order.pop())
                if m is not None and m is not self.me and m.state in (ALIVE, SUSPECT):
                    return m
            self._order = [n for n, m in self.members.items()
                           if m is not self.me and m.state in (ALIVE, SUSPECT)]
            self.rng.shuffle(self._order)
        return None

    def _with_gossip(self, msg: Message, dest: str | None) -> Message:
        """Stamp ``msg`` and let it carry our own entry plus the freshest rumours; what we
        believe about ``dest`` goes first when it is bad news, so it can refute at once."""
        self._stamp(msg)
        msg["me"] = self.me.entry()
        gossip: list[WireValue] = []
        if dest is not None:
            d = self.members.get(dest)
            if d is not None and d.state != ALIVE:
                gossip.append(d.entry())
        ranked = sorted(self._rumours.items(), key=lambda kv: -kv[1])
        for name, _left in ranked[:self.timers.max_piggyback]:
            m = self.members.get(name)
            if m is None or m is self.me:  # our own entry always rides as "me"
                del self._rumours[name]
                continue
            if name == dest:
                continue
            gossip.append(m.entry())
            self._rumours[name] -= 1
            if self._rumours[name] <= 0:
                del self._rumours[name]
        if gossip:
            msg["g"] = gossip
        return msg

    def _rumour(self, name: str) -> None:
        n = len(self.members)
        self._rumours[name] = self.timers.retransmit_mult * max(1, math.ceil(math.log2(n + 1)))

    def _set(self, m: Member, inc: int, state: str, now: float) -> None:
        old = m.state
        m.inc = inc
        self.version += 1
        if state != old:
            m.state = state
            m.since = now
            self.events.append((m.name, old, state))
            self._roster = None
        m.suspect_deadline = now + self.timers.suspect_timeout if state == SUSPECT else None
        self._rumour(m.name)

    def _apply(self, e: _Entry, now: float) -> None:
        name, inc, state = e["n"], e["i"], e["s"]
        if name == self.name:
            # Someone has news about us. If it is not "alive, this incarnation, this process",
            # outbid it: whoever hears the new incarnation drops the old news.
            me = self.me
            if me.state == LEFT:
                return
            if inc > me.inc or (inc == me.inc and (state != ALIVE
                                                   or e.get("x", me.instance) != me.instance)):
                me.inc = inc + 1
                self._rumour(name)
            return
        m = self.members.get(name)
        if m is None:
            m = Member(name, e["a"], inc, state, dict(e.get("f") or {}), str(e.get("x", "")),
                       now)
            self.members[name] = m
            self._roster = None
            self.version += 1
            self.events.append((name, None, state))
            if state == SUSPECT:
                m.suspect_deadline = now + self.timers.suspect_timeout
            self._rumour(name)
            return
        if (inc, _RANK[state]) <= (m.inc, _RANK[m.state]):
            return
        if m.addr != e["a"]:
            m.addr = e["a"]
            self._roster = None
        if "f" in e:
            m.facts = dict(e["f"])
        if "x" in e:
            m.instance = str(e["x"])
        self._set(m, inc, state, now)

