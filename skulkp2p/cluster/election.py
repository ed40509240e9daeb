"""Leader election with terms, pre-votes and leader leases, as a pure state machine.

Raft's election without its log:

- A follower that has not heard a leader for its election timeout first asks for *pre-votes*
  ("would you vote for me in term t+1?") without touching any term. A voter says yes only if it
  has not heard a live leader within the lease itself, so a node coming back from a pause or a
  partition cannot bump the term and unseat a stable leader.
- With pre-votes from a quorum it stands for real: term+1, votes for itself, asks for votes.
  Each node votes at most once per term, so a term has at most one leader.
- Quorum is a majority of all known members except those that left gracefully; dead members
  count. A partition's minority therefore never elects, and a leader that has not heard acks
  from a majority within its lease steps down.
- Timeouts grow with a node's rank (priority, then name, highest first) plus jitter: when a
  leader dies, the best-ranked survivor usually stands first and wins. Should two leaders ever
  meet (possible only while the member list itself is changing), the higher (term, priority,
  name) keeps the lead.
- A voter also refuses a candidate that does not know every voter it knows: a node that joined
  a moment ago cannot win with a quorum computed over a stale, smaller member list.
- Raft's commit, over the owner's state instead of a log: the owner says which version of its
  state it holds (``held``: the term of the leader that made it, and its version), followers
  report theirs in heartbeat acks, and the leader's ``committed()`` is the newest version of
  its term that a majority of voters hold; heartbeats carry it to followers
  (``leader_commit``). A voter refuses (pre-)votes to a candidate whose held state is older than
  its own, so whatever a majority held is held by every future leader.

Drive it with ``set_view``, ``tick(now)`` and ``on_message(msg, now)``; the latter two return
``[(addr, msg), ...]`` to send.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from skulkp2p.cluster.timers import Timers
from skulkp2p.wire import Message, WireValue, as_int

FOLLOWER, PRECANDIDATE, CANDIDATE, LEADER = "follower", "precandidate", "candidate", "leader"
ELECTION_TYPES = frozenset({"vote", "vote-reply", "lead", "lead-ack"})

Out = tuple[str, Message]


class Election:
    def __init__(self, name: str, addr: str, priority: int = 0, *,
                 timers: Timers | None = None, rng: random.Random | None = None,
                 now: float = 0.0):
        self.name = name
        self.addr = addr
        self.priority = priority
        self.timers = timers or Timers()
        self.rng = rng or random.Random()
        self.term = 0
        self.voted_for: str | None = None
        self.role = FOLLOWER
        self.leader: str | None = None
        self.joined = True  # False: not part of a cluster yet, neither stands nor votes
        # What the leader attaches to every heartbeat (placements), and what we last received.
        self.payload: Message = {}
        self.leader_payload: Message = {}
        # The state this node holds, (term of the leader that made it, version): the owner keeps
        # it current. Votes carry it; heartbeat acks carry it (the owner stamps them).
        self.held: tuple[int, int] = (-1, 0)
        self.leader_commit = 0  # follower: the committed version its leader last announced
        self._match: dict[str, int] = {}  # leader: version of this term each voter holds
        self._commit = 0  # leader: the newest version of this term a majority holds
        self.events: list[tuple[str, int, str | None]] = []  # (role, term, leader)
        self._voters: dict[str, str] = {name: addr}  # name -> addr; quorum is over these
        self._priority: dict[str, int] = {name: priority}
        self._reachable: set[str] = {name}
        self._last_heard: float | None = None  # last heartbeat from a leader
        self._deadline = now + self._timeout()
        self._granted: set[str] = set()
        self._acks: dict[str, float] = {}
        self._leader_since = 0.0
        self._next_heartbeat = 0.0

    # ---------------------------------------------------------------- view

    def set_view(self, voters: Mapping[str, str], reachable: Iterable[str] = (),
                 priorities: Mapping[str, int] | None = None, joined: bool = True) -> None:
        """Voters (name -> address, self included), which of them look alive, their
        priorities, and whether this node has joined a cluster (before that it neither stands
        nor votes)."""
        self._voters = dict(voters)
        self._voters[self.name] = self.addr
        self._reachable = set(reachable) | {self.name}
        self._priority = {**(priorities or {}), self.name: self.priority}
        self.joined = joined

    def stand_at(self, when: float) -> None:
        """Move this node's election timeout (a founder stands at once)."""
        if self.role != LEADER:
            self._deadline = when

    @property
    def quorum(self) -> int:
        return len(self._voters) // 2 + 1

    def rank_key(self, name: str) -> tuple[int, str]:
        return (self._priority.get(name, 0), name)

    def drain_events(self) -> list[tuple[str, int, str | None]]:
        events, self.events = self.events, []
        return events

    # ---------------------------------------------------------------- driving

    def tick(self, now: float) -> list[Out]:
        if self.role == LEADER:
            return self._lead_tick(now)
        if now < self._deadline:
            return []
        self._deadline = now + self._timeout()
        if self.leader is not None:
            self.leader = None  # silent too long: we no longer know a leader
            self._event()
        if not self.joined:
            self.role = FOLLOWER
            return []
        # Pre-vote round: asks, changes nothing.
        self.role = PRECANDIDATE
        self._granted = {self.name}
        out = self._broadcast({"t": "vote", "pre": True, "term": self.term + 1})
        return out + self._maybe_advance(now)

    def on_message(self, msg: Mapping[str, WireValue], now: float) -> list[Out]:
        sender, term, kind = msg.get("from"), msg.get("term"), msg.get("t")
        if not isinstance(sender, str) or not isinstance(term, int) or isinstance(term, bool):
            return []
        reply_to = self._voters.get(sender) or msg.get("addr")
        if not isinstance(reply_to, str):
            return []
        if kind == "vote":
            return self._on_vote(msg, sender, term, reply_to, now)
        if kind == "vote-reply":
            return self._on_vote_reply(msg, sender, term, now)
        if kind == "lead":
            return self._on_lead(msg, sender, term, reply_to, now)
        if kind == "lead-ack":
            if term > self.term:
                self._adopt(term, now)
            elif self.role == LEADER and term == self.term:
                if msg.get("ok"):
                    self._acks[sender] = now
                    have = _held_of(msg.get("have"))
                    if have is not None and have[0] == self.term:
                        self._match[sender] = max(self._match.get(sender, 0), have[1])
                elif msg.get("conflict"):
                    self._step_down(now)
        return []

    def committed(self) -> int:
        """Leader: the newest version of this term's state that a majority of voters (itself
        included) hold; it never goes back within the term. 0 when not leading."""
        if self.role != LEADER:
            return 0
        if self.held[0] == self.term:
            versions = sorted([self.held[1]] + [self._match.get(n, 0) for n in self._voters
                                                if n != self.name], reverse=True)
            self._commit = max(self._commit, versions[self.quorum - 1])
        return self._commit

    def holders(self, version: int) -> int:
        """Leader: how many voters (itself included) are known to hold ``version`` of this
        term."""
        mine = 1 if self.held[0] == self.term and self.held[1] >= version else 0
        return mine + sum(1 for n in self._voters
                          if n != self.name and self._match.get(n, 0) >= version)

    def heartbeat_now(self) -> None:
        """Leader: send the next heartbeat at the next tick (new state to publish)."""
        if self.role == LEADER:
            self._next_heartbeat = 0.0

    # ---------------------------------------------------------------- internals

    def _timeout(self) -> float:
        t = self.timers
        ranked = sorted((n for n in self._reachable if n in self._voters), key=self.rank_key,
                        reverse=True)
        rank = ranked.index(self.name) if self.name in ranked else len(ranked)
        return t.election_timeout + rank * t.election_rank_step + self.rng.uniform(
            0, t.election_jitter)

    def _event(self) -> None:
        self.events.append((self.role, self.term, self.leader))

    def _broadcast(self, msg: Message) -> list[Out]:
        msg.update({"from": self.name, "addr": self.addr, "prio": self.priority})
        if msg["t"] == "vote":
            msg["voters"] = [*sorted(self._voters)]
            msg["held"] = list(self.held)
        return [(addr, dict(msg)) for name, addr in sorted(self._voters.items())
                if name != self.name]

    def _reply(self, addr: str, msg: Message) -> list[Out]:
        msg.update({"from": self.name, "addr": self.addr})
        return [(addr, msg)]

    def _leader_recent(self, now: float) -> bool:
        if self.role == LEADER:
            return True
        return (self.leader is not None and self._last_heard is not None
                and now - self._last_heard < self.timers.leader_lease)

    def _adopt(self, term: int, now: float) -> None:
        """A higher term exists: follow it (we do not know its leader yet)."""
        was = (self.role, self.leader)
        self.term = term
        self.voted_for = None
        self.role = FOLLOWER
        self.leader = None
        self.leader_commit = 0
        if was != (FOLLOWER, None):
            self._deadline = now + self._timeout()
        self._event()

    def _step_down(self, now: float) -> None:
        self.role = FOLLOWER
        self.leader = None
        self._deadline = now + self._timeout()
        self._event()

    def _view_ok(self, msg: Mapping[str, WireValue]) -> bool:
        theirs = msg.get("voters")
        return isinstance(theirs, list) and set(self._voters) <= set(theirs)

    def _held_ok(self, msg: Mapping[str, WireValue]) -> bool:
        """Raft's up-to-date check: the candidate holds state at least as new as ours (a
        candidate that says nothing holds nothing)."""
        theirs = _held_of(msg.get("held")) or (-1, 0)
        return theirs >= self.held

    def _on_vote(self, msg: Mapping[str, WireValue], cand: str, term: int, reply_to: str,
                 now: float) -> list[Out]:
        pre = bool(msg.get("pre"))
        if not self.joined:
            return self._reply(reply_to, {"t": "vote-reply", "pre": pre, "term": self.term,
                                          "for_term": term, "granted": False})
        if pre:
            granted = (term > self.term and not self._leader_recent(now)
                       and self._view_ok(msg) and self._held_ok(msg))
            return self._reply(reply_to, {"t": "vote-reply", "pre": True, "term": self.term,
                                          "for_term": term, "granted": granted})
        if self._leader_recent(now) and self.leader != cand:
            # Leader stickiness: a live leader's followers (and the leader itself) ignore
            # candidates outright, term included; pre-votes normally stop them earlier.
            return self._reply(reply_to, {"t": "vote-reply", "pre": False, "term": self.term,
                                          "for_term": term, "granted": False})
        if term > self.term:
            self._adopt(term, now)
        granted = (term == self.term and self.voted_for in (None, cand)
                   and self._view_ok(msg) and self._held_ok(msg))
        if granted:
            self.voted_for = cand
            self._deadline = now + self._timeout()
        return self._reply(reply_to, {"t": "vote-reply", "pre": False, "term": self.term,
                                      "for_term": term, "granted": granted})

    def _on_vote_reply(self, msg: Mapping[str, WireValue], voter: str, term: int,
                       now: float) -> list[Out]:
        pre, granted, for_term = bool(msg.get("pre")), bool(msg.get("granted")), msg.get("for_term")
        if term > self.term and not (pre and granted):
            self._adopt(term, now)
            return []
        if voter not in self._voters or not granted:
            return []
        if pre and self.role == PRECANDIDATE and for_term == self.term + 1:
            self._granted.add(voter)
        elif not pre and self.role == CANDIDATE and for_term == self.term:
            self._granted.add(voter)
        else:
            return []
        return self._maybe_advance(now)

    def _maybe_advance(self, now: float) -> list[Out]:
        if len(self._granted & set(self._voters)) < self.quorum:
            return []
        if self.role == PRECANDIDATE:
            self.role = CANDIDATE
            self.term += 1
            self.voted_for = self.name
            self._granted = {self.name}
            self._deadline = now + self._timeout()
            self._event()
            out = self._broadcast({"t": "vote", "pre": False, "term": self.term})
            return out + self._maybe_advance(now)
        if self.role == CANDIDATE:
            self.role = LEADER
            self.leader = self.name
            # What this node published when it last led is stale now: its first heartbeats
            # carry what it plans in this term (the owner fills it in), never that.
            self.payload = {}
            self._leader_since = now
            self._acks = {}
            self._match = {}
            self._commit = 0
            self._next_heartbeat = now
            self._event()
            return self._lead_tick(now)
        return []

    def observe_term(self, term: int, now: float) -> None:
        """A term seen outside elections (membership traffic carries it): a node that joins
        learns the cluster's term before it may stand, so it cannot win a term already won."""
        if term > self.term:
            self._adopt(term, now)

    def _lead_tick(self, now: float) -> list[Out]:
        lease = self.timers.leader_lease
        for name in self._voters:  # a voter that just joined gets one lease to answer
            if name != self.name and name not in self._acks:
                self._acks[name] = now
        contacts = 1 + sum(1 for n, t in self._acks.items()
                           if n in self._voters and n != self.name and now - t < lease)
        if contacts < self.quorum and now - self._leader_since >= lease:
            self._step_down(now)
            return []
        if now < self._next_heartbeat:
            return []
        self._next_heartbeat = now + self.timers.heartbeat
        return self._broadcast({"t": "lead", "term": self.term, "leader": self.name,
                                "payload": self.payload, "commit": self.committed()})

    def _on_lead(self, msg: Mapping[str, WireValue], sender: str, term: int, reply_to: str,
                 now: float) -> list[Out]:
        if term < self.term:
            return self._reply(reply_to, {"t": "lead-ack", "term": self.term, "ok": False})
        if term > self.term:
            self._adopt(term, now)
        if self.role == LEADER and sender != self.name:
            # Two leaders in one term: only possible while the member list changes.
            # (priority, name) settles it; the loser steps down.
            if self.rank_key(self.name) > (as_int(msg.get("prio") or 0), sender):
                return self._reply(reply_to, {"t": "lead-ack", "term": self.term,
                                              "ok": False, "conflict": True})
            self._step_down(now)
        changed = self.role != FOLLOWER or self.leader != sender
        self.role = FOLLOWER
        self.leader = sender
        self._last_heard = now
        self._deadline = now + self._timeout()
        payload = msg.get("payload")
        self.leader_payload = dict(payload) if isinstance(payload, dict) else {}
        commit = msg.get("commit")
        if isinstance(commit, int) and not isinstance(commit, bool):
            # A late heartbeat must not take the commit back.
            self.leader_commit = commit if changed else max(self.leader_commit, commit)
        if changed:
            self._event()
        return self._reply(reply_to, {"t": "lead-ack", "term": self.term, "ok": True})


def _held_of(value: WireValue) -> tuple[int, int] | None:
    """A ``[term, version]`` pair off the wire, or None when it is not one."""
    if isinstance(value, list | tuple) and len(value) == 2:
        term, version = value
        if (isinstance(term, int) and not isinstance(term, bool)
                and isinstance(version, int) and not isinstance(version, bool)):
            return (term, version)
    return None

