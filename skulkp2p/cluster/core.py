"""The control plane of one node as a pure state machine: membership + election + placement.

``ClusterCore`` routes each message to the machine that owns its type, keeps the election's
view of voters in step with membership, and, on the leader, keeps placements up to date and
attaches them to its heartbeats. It does no I/O and reads no clock: node.py (asyncio TCP) and
the tests' simulated network both drive it the same way, with ``tick(now)`` and
``on_message(msg, now)``, each returning ``[(addr, msg), ...]`` to send.

Restarts converge because of three rules:

- A node takes a term only with a quorum of the voters it knows, and the voters it knew are
  saved with its term and vote: only a node that knows no other voter (a first start, or one
  whose every other member left gracefully) founds a cluster and leads it at once; any other
  wins a real election, for a term above every term it saved.
- Plans are ordered by (term, version) within one leader's history: a follower ignores only an
  older version from the very leader whose plan it holds, and takes the plan of any other
  leader of its term whatever its version (a plan restored from disk, or of another history).
- A request pinned to named nodes (a place request's ``nodes``) whose members are not all
  alive is placed automatically while they are away, with a note in its placement, and moves
  back once they are all alive. (A name the cluster never knew stays an error.)
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

from skulkp2p.cluster.durable import DurableKey, DurableState
from skulkp2p.cluster.election import ELECTION_TYPES, LEADER, Election
from skulkp2p.cluster.membership import ALIVE, DEAD, LEFT, SUSPECT, Membership, Out
from skulkp2p.cluster.placement import (
    ModelSpec,
    NodeOffer,
    Placement,
    PlacementError,
    Request,
    plan,
)
from skulkp2p.cluster.timers import Timers
from skulkp2p.wire import Message, WireValue, as_int, as_list

MEMBERSHIP_TYPES = frozenset({"ping", "ack", "ping-req", "sync"})

# Where a place request stands on this node (``request_state``).
ABSENT = "absent"  # this node's plan lacks it (not asked yet, not arrived, or no leader known)
HELD = "held"  # the plan holds it; a majority of voters is not known to hold it yet
COMMITTED = "committed"  # a plan holding it is held by a majority: any future leader keeps it

# What a plan was made from (offers, eligible nodes, requests, term): unchanged, no re-plan.
_PlanInputs: TypeAlias = tuple[tuple[tuple[str, int, str], ...], tuple[str, ...],
                               tuple[tuple[str, ModelSpec, tuple[str, ...], tuple[str, ...],
                                           tuple[str, ...], tuple[str, ...]], ...],
                               int]


def _error_dict(e: PlacementError) -> Message:
    return {"model": e.model, "error": str(e), "needs": e.needs, "available": e.available}


def _key_counts(value: WireValue) -> Message:
    """model -> how many keys, of a member's gossiped recent prompt keys."""
    if not isinstance(value, dict):
        return {}
    return {str(k): len(v) for k, v in value.items() if isinstance(v, list)}


def _names(value: WireValue) -> tuple[str, ...]:
    """Node names off the wire (absent: none); TypeError when it is not a list of names."""
    if not value:
        return ()
    names = tuple(n for n in as_list(value) if isinstance(n, str))
    if not isinstance(value, list) or len(names) != len(value):
        raise TypeError(f"expected a list of node names, got {value!r}")
    return names


class ClusterCore:
    def __init__(self, name: str, addr: str, *, facts: Mapping[str, WireValue] | None = None,
                 seeds: Iterable[str] = (), priority: int = 0, timers: Timers | None = None,
                 rng: random.Random | None = None, now: float = 0.0,
                 instance: str | None = None, restored: DurableState | None = None):
        self.timers = timers or Timers()
        rng = rng or random.Random()
        facts = {**(facts or {}), "priority": priority}
        self.membership = Membership(name, addr, facts, seeds=seeds, timers=self.timers,
                                     rng=rng, instance=instance, now=now)
        self.election = Election(name, addr, priority, timers=self.timers, rng=rng, now=now)
        self.name = name
        self.addr = addr
        # Models asked for (by members' --model, or by place requests); the leader places them.
        self._explicit: dict[str, Request] = {}
        self._placements: dict[str, Placement] = {}
        self._errors: dict[str, Message] = {}
        self._plan_inputs: _PlanInputs | None = None
        # Bumped whenever the requests, placements or errors this node holds are replaced: with
        # the member list's version and the term, what _plan's inputs depend on.
        self._held_gen = 0
        self._plan_checked: tuple[int, int, int] | None = None
        self._view_of: tuple[int, bool] | None = None  # (member list version, joined) synced
        self._plan_term = -1
        self._plan_leader: str | None = None  # the leader that made the plan this node holds
        self.placement_version = 0
        # model -> (its explicit request, the plan (term, version) that first held it)
        self._held_since: dict[str, tuple[Request, tuple[int, int]]] = {}
        # (plan term, version) of the newest commit this node has seen of the plan it holds:
        # saved with the plan, so a restart still knows how much of it a majority held.
        self._commit_seen: tuple[int, int] | None = None
        # A restored plan keeps only its place requests: the leader's copy of that same version
        # must still be adopted in full (see _adopt_payload).
        self._partial_plan = False
        if restored is not None:
            self._restore(restored, now)
        self._sync_view()
        if not self.membership.seeds and self.membership.voters() == [name]:
            # A founder (no seeds, no other voter known: not even from before a restart) has
            # nobody to wait for: lead at once, so a single node serves without an election
            # timeout's delay. A node that knew others waits for a quorum of them.
            self.election.stand_at(now)

    # ---------------------------------------------------------------- queries

    @property
    def leader(self) -> str | None:
        return self.election.leader

    @property
    def term(self) -> int:
        return self.election.term

    @property
    def is_leader(self) -> bool:
        return self.election.role == LEADER

    def placements(self) -> dict[str, Placement]:
        """Current placements; empty while there is no leader (a minority serves nothing)."""
        return dict(self._placements) if self.leader is not None else {}

    def placement_errors(self) -> dict[str, Message]:
        return dict(self._errors) if self.leader is not None else {}

    def requested(self) -> set[str]:
        """Every model asked for (placed, failed to place, or waiting for a leader)."""
        return set(self._requests())

    @property
    def plan_id(self) -> tuple[int, int]:
        """The plan this node holds: (term of the leader that made it, its version)."""
        return (self._plan_term, self.placement_version)

    def committed(self) -> tuple[int, int]:
        """The newest plan (term, version) this node knows a majority of voters hold: the
        leader counts its followers' acks, a follower has its leader's word; (-1, 0) when no
        leader is known."""
        el = self.election
        if el.role == LEADER:
            return (el.term, el.committed())
        if el.leader is not None:
            return (el.term, el.leader_commit)
        return (-1, 0)

    def request_state(self, spec: ModelSpec, nodes: Sequence[str] = ()) -> str:
        """ABSENT, HELD or COMMITTED: whether this node's plan holds this place request, and
        whether a majority of the voters is known to hold a plan with it."""
        if self.leader is None or not self.holds_request(spec, nodes):
            return ABSENT
        got = self._held_since[spec.id]
        term, version = got[1]
        c_term, c_version = self.committed()
        return COMMITTED if c_term == term and c_version >= version else HELD

    def holds_request(self, spec: ModelSpec, nodes: Sequence[str] = ()) -> bool:
        """Whether the plan this node holds (led or adopted) has this place request."""
        got = self._held_since.get(spec.id)
        return got is not None and got[0] == Request(spec, tuple(nodes))

    def request_holders(self, spec: ModelSpec, nodes: Sequence[str] = ()) -> tuple[int, int, int]:
        """(voters known to hold a plan with this request, voters, the majority). Only the
        leader knows who holds what; elsewhere the first number is 0."""
        el = self.election
        voters = len(self.membership.voters()) or 1
        got = self._held_since.get(spec.id)
        held = 0
        if (el.role == LEADER and got is not None and self.holds_request(spec, nodes)
                and got[1][0] == el.term):
            held = el.holders(got[1][1])
        return held, voters, el.quorum

    def member_addr(self, name: str) -> str | None:
        m = self.membership.get(name)
        return m.addr if m is not None else None

    def status(self) -> Message:
        members: list[WireValue] = []
        for n in sorted(self.membership.members):
            m = self.membership.members[n]
            f = m.facts
            members.append({
                "name": m.name, "addr": m.addr, "state": m.state, "incarnation": m.inc,
                "memory": f.get("memory"), "engines": f.get("engines", []),
                "models": f.get("models", []), "http": f.get("http"), "dtype": f.get("dtype"),
                "priority": f.get("priority", 0), "self": m is self.membership.me,
                # ring stages held here: {model: {"layers": [a, b], "param_bytes": n}}
                "stages": f.get("stages", {}), "ring": f.get("ring"),
                # routing among replicas: requests queued and running per model, and how
                # many recent prompt keys it gossips per model
                "load": f.get("load", {}),
                "affinity": _key_counts(f.get("affinity")),
            })
        return {
            "node": self.name, "leader": self.leader, "term": self.term,
            "role": self.election.role, "members": members,
            "placements": [self._placement_view(p) for _, p in sorted(self.placements().items())],
            "errors": [e for _, e in sorted(self.placement_errors().items())],
            # The plan this node holds and how much of it a majority is known to hold.
            "plan": {"term": self._plan_term, "version": self.placement_version,
                     "committed": self._committed_of_held()},
        }

    def _committed_of_held(self) -> int | None:
        c_term, c_version = self.committed()
        if c_term == self._plan_term:
            return c_version
        seen = self._commit_seen  # no leader now: what was last known (saved across restarts)
        return seen[1] if seen is not None and seen[0] == self._plan_term else None

    # ---------------------------------------------------------------- durable state

    def durable_state(self) -> DurableState:
        """What a restart must keep (see cluster/durable.py): saved before anything that
        depends on it is sent."""
        el = self.election
        requests: list[Message] = [{"spec": r.spec.to_dict(), "nodes": list(r.nodes)}
                                   for _, r in sorted(self._explicit.items())]
        return DurableState(self.name, el.term, el.voted_for, self._plan_term,
                            self.placement_version, self._committed_of_held(), tuple(requests),
                            tuple(p.to_dict() for _, p in sorted(self._placements.items())),
                            tuple(e for _, e in sorted(self._errors.items())),
                            self._plan_leader, self.membership.roster())

    def durable_key(self) -> DurableKey:
        """Cheap stand-in for ``durable_state().key()``: compared after every step, the full
        state is built and written only when this changes."""
        el = self.election
        return (el.term, el.voted_for, self._plan_term, self.placement_version,
                self._committed_of_held(), self._plan_leader, self.membership.roster())

    def _restore(self, st: DurableState, now: float) -> None:
        """Take back the term, the vote, the members and the plan saved before a restart. Only
        the plan's place requests (what POST /v1/cluster/place acknowledged) and their
        placements come back: models asked for by a member's --model are asked for again by the
        members as they rejoin, so a node restarted with another --model does not bring its old
        one back."""
        el = self.election
        el.term = max(0, st.term)
        el.voted_for = st.voted_for
        self.membership.restore(st.members, now)
        explicit: dict[str, Request] = {}
        for d in st.requests:
            spec_d = d.get("spec")
            if not isinstance(spec_d, dict):
                continue
            try:
                spec = ModelSpec.from_dict(spec_d)
                explicit[spec.id] = Request(spec, _names(d.get("nodes")))
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
        placements: dict[str, Placement] = {}
        for d in st.placements:
            try:
                p = Placement.from_dict(d)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
            if p.model in explicit:
                placements[p.model] = p
        self._held_gen += 1
        self._explicit = explicit
        self._placements = placements
        self._errors = {model: dict(e) for e in st.errors
                        if isinstance(model := e.get("model"), str) and model in explicit}
        self._plan_term = st.plan_term
        self._plan_leader = st.plan_leader
        self.placement_version = max(0, st.plan_version)
        if st.committed is not None:
            self._commit_seen = (st.plan_term, st.committed)
        self._partial_plan = True
        el.held = self.plan_id
        self._note_held()

    def _placement_view(self, p: Placement) -> Message:
        d = p.to_dict()
        d.pop("spec", None)
        return d

    def drain_events(self) -> list[str]:
        """Human-readable lines about what changed (for the node's log)."""
        lines = []
        for name, old, new in self.membership.drain_events():
            lines.append(f"member {name}: {old or 'new'} -> {new}")
        for role, term, leader in self.election.drain_events():
            lines.append(f"election: {role}, term {term}, leader {leader or 'none'}")
        return lines

    # ---------------------------------------------------------------- driving

    def tick(self, now: float) -> list[Out]:
        out = self._stamp_term(self.membership.tick(now))
        self._sync_view()
        out += self.election.tick(now)
        self._after(now)
        return self._fresh_heartbeats(out)

    def _fresh_heartbeats(self, outs: list[Out]) -> list[Out]:
        """A node elected within this call sent its first heartbeats before it planned: they
        carry the plan made just now. (Else they would carry the payload of its previous
        leadership, and followers would briefly adopt placements from terms ago.)"""
        for _addr, msg in outs:
            if msg.get("t") == "lead" and msg.get("term") == self.election.term \
                    and self.election.role == LEADER:
                msg["payload"] = self.election.payload
        return outs

    def _stamp_term(self, outs: list[Out]) -> list[Out]:
        for _addr, msg in outs:
            msg["et"] = self.election.term
        return outs

    def on_message(self, msg: Mapping[str, WireValue], now: float) -> list[Out]:
        kind = msg.get("t")
        out: list[Out] = []
        if kind in MEMBERSHIP_TYPES:
            out = self._stamp_term(self.membership.on_message(msg, now))
            self._sync_view()
            term = msg.get("et")
            if (isinstance(term, int) and not isinstance(term, bool)
                    and self.membership.bootstrapped):
                self.election.observe_term(term, now)
        elif kind in ELECTION_TYPES:
            if kind == "lead" and not self.membership.seed_answered:
                # A leader's heartbeat: we belong to an established cluster even if our seeds
                # are gone (a node restarted with a dead seed), and it knows where we are.
                self.membership.bootstrapped = self.membership.seed_answered = True
                self._sync_view()
            out = self.election.on_message(msg, now)
        elif kind == "place":
            out = self._on_place(msg, now)
        self._after(now)
        return self._stamp_held(self._fresh_heartbeats(out))

    def _stamp_held(self, outs: list[Out]) -> list[Out]:
        """A heartbeat's ack says which plan this node holds once it has taken the heartbeat's
        (the election replied before the payload was adopted): the leader counts it towards
        the commit."""
        for _addr, msg in outs:
            if msg.get("t") == "lead-ack" and msg.get("ok"):
                msg["have"] = list(self.plan_id)
        return outs

    def request_placement(self, spec: ModelSpec, nodes: Sequence[str] = (),
                          now: float = 0.0) -> list[Out]:
        """Ask for a model to be placed (on a follower: forwarded to the leader, if any).
        The outcome shows in ``placements()``/``placement_errors()`` once the leader has it."""
        if self.is_leader:
            if spec.id in self._placements and self.check_request(spec, nodes) is not None:
                return []  # it would not fit: keep the placement that works
            self._explicit[spec.id] = Request(spec, tuple(nodes))
            self._held_gen += 1
            self._errors.pop(spec.id, None)
            self._plan_inputs = None  # re-plan now
            self._after(now)
            return []
        addr = self.member_addr(self.leader) if self.leader else None
        if addr is None:
            return []
        return [(addr, {"t": "place", "from": self.name, "addr": self.addr,
                        "spec": spec.to_dict(), "nodes": list(nodes)})]

    def leave(self, now: float) -> list[Out]:
        return self._stamp_term(self.membership.leave(now))

    def update_facts(self, facts: Mapping[str, WireValue]) -> None:
        self.membership.update_facts({**facts, "priority": self.election.priority})

    # ---------------------------------------------------------------- internals

    def _sync_view(self) -> None:
        ms = self.membership
        if self._view_of == (ms.version, ms.bootstrapped):
            return
        self._view_of = (ms.version, ms.bootstrapped)
        voters = {n: ms.members[n].addr for n in ms.voters()}
        prios = {n: as_int(m.facts.get("priority") or 0) for n, m in ms.members.items()}
        self.election.set_view(voters, ms.names(ALIVE), prios, joined=ms.bootstrapped)

    def _on_place(self, msg: Mapping[str, WireValue], now: float) -> list[Out]:
        spec_d = msg.get("spec") or {}
        if not isinstance(spec_d, dict):
            return []
        try:
            spec = ModelSpec.from_dict(spec_d)
            nodes = _names(msg.get("nodes"))
        except (ValueError, TypeError, KeyError):
            return []
        if not self.is_leader:
            return []  # it was sent to an old leader; the asker retries against the new one
        return self.request_placement(spec, nodes, now)

    def _requests(self) -> dict[str, Request]:
        reqs: dict[str, Request] = {}
        only: dict[str, set[str] | None] = {}  # None: any node may hold it
        askers: dict[str, list[str]] = {}  # model -> the nodes whose --model it is
        for name in sorted(self.membership.members):
            m = self.membership.members[name]
            if m.state == LEFT:
                continue
            for w in as_list(m.facts.get("wants")):
                if not isinstance(w, dict):
                    continue
                try:
                    spec = ModelSpec.from_dict(w)
                except (ValueError, TypeError, KeyError, AttributeError):
                    continue
                reqs.setdefault(spec.id, Request(spec))
                askers.setdefault(spec.id, []).append(name)
                # A model from a local folder (no card) lives on the disks that named it.
                local = w.get("only")
                if spec.id not in only or only[spec.id] is not None:
                    only[spec.id] = (set(only.get(spec.id) or ()) | {str(n) for n in local}
                                     if isinstance(local, list) else None)
        for model, nodes in only.items():
            if nodes:
                reqs[model] = Request(reqs[model].spec, (), tuple(sorted(nodes)))
        for model, p in self._placements.items():  # placed once, placed for good
            if p.spec is not None:
                reqs.setdefault(model, Request(p.spec, p.ring if p.explicit else ()))
        reqs.update(self._explicit)
        for model, r in list(reqs.items()):
            # A named ring with a member away (suspect, dead, left, or known only from before
            # a restart) is placed automatically meanwhile: its requests must keep being
            # served. It is pinned again once they are all alive. A name the cluster never
            # knew stays an error ("not alive members").
            if r.nodes and any((held := self.membership.get(n)) is not None and
                               held.state != ALIVE for n in r.nodes):
                reqs[model] = Request(r.spec, (), r.only, pinned=r.nodes)
        for model, names in askers.items():
            if model in reqs:
                reqs[model] = dataclasses.replace(reqs[model], askers=tuple(names))
        return reqs

    def _after(self, now: float) -> None:
        """Keep placements in step: the leader plans; followers take the leader's."""
        el = self.election
        if el.role == LEADER:
            before = self.plan_id
            self._plan(now)
            if self.plan_id != before:
                el.heartbeat_now()  # a new plan: to the followers at once, to commit it
        elif el.leader is not None and el.leader_payload:
            self._adopt_payload(el.leader_payload)
        el.held = self.plan_id
        committed = self._committed_of_held()
        if committed is not None:
            self._commit_seen = (self._plan_term, committed)

    def _note_held(self) -> None:
        """Remember the plan each explicit request first appeared in (in this plan's term)."""
        since: dict[str, tuple[Request, tuple[int, int]]] = {}
        for model, r in self._explicit.items():
            old = self._held_since.get(model)
            keep = old is not None and old[0] == r and old[1][0] == self._plan_term
            since[model] = old if old is not None and keep else (r, self.plan_id)
        self._held_since = since

    def _adopt_payload(self, payload: Mapping[str, WireValue]) -> None:
        version = payload.get("version")
        if (self._plan_term == self.term and self._plan_leader == self.leader
                and isinstance(version, int)
                and (version < self.placement_version
                     or (version == self.placement_version and not self._partial_plan))):
            # This leader's plan, not newer: a repeat, or an older heartbeat of this leader
            # arriving late (held while this node was paused); adopting it would undo newer
            # placements. A plan of this term made by anyone else (restored from disk without
            # its maker, or another history of the term) gives way whatever its version.
            return
        placements: dict[str, Placement] = {}
        for d in as_list(payload.get("placements")):
            if not isinstance(d, dict):
                continue
            try:
                p = Placement.from_dict(d)
            except (ValueError, TypeError, KeyError):
                continue
            placements[p.model] = p
        self._placements = placements
        self._errors = {model: dict(e) for e in as_list(payload.get("errors"))
                        if isinstance(e, dict) and isinstance(model := e.get("model"), str)}
        explicit = {}
        for d in as_list(payload.get("requests")):
            spec_d = d.get("spec") if isinstance(d, dict) else None
            if not isinstance(d, dict) or not isinstance(spec_d, dict):
                continue
            try:
                spec = ModelSpec.from_dict(spec_d)
                explicit[spec.id] = Request(spec, _names(d.get("nodes")))
            except (ValueError, TypeError, KeyError):
                continue
        self._explicit = explicit  # a future leader keeps honouring them
        self._held_gen += 1
        self._partial_plan = False
        self.placement_version = as_int(payload.get("version") or 0)
        self._plan_term = self.term
        self._plan_leader = self.leader
        self._note_held()

    def check_request(self, spec: ModelSpec, nodes: Sequence[str] = ()) -> PlacementError | None:
        """Why a placement request would fail on the current state (None: it would not)."""
        reqs = self._requests()
        asked = reqs.get(spec.id)
        reqs[spec.id] = Request(spec, tuple(nodes), askers=asked.askers if asked else ())
        offers, eligible = self._offers()
        previous = {k: p for k, p in self._live_placements().items() if k != spec.id}
        got = plan(list(reqs.values()), offers, previous, eligible).get(spec.id)
        return got if isinstance(got, PlacementError) else None

    def _offers(self) -> tuple[list[NodeOffer], list[str]]:
        holders = [m for m in self.membership.members.values() if m.state in (ALIVE, SUSPECT)]
        offers = [NodeOffer(m.name, as_int(m.facts.get("memory") or 0),
                            str(m.facts.get("dtype") or "bfloat16"),
                            tuple(str(e) for e in as_list(m.facts.get("engines"))))
                  for m in holders]
        return offers, [m.name for m in holders if m.state == ALIVE]

    def _live_placements(self) -> dict[str, Placement]:
        ms = self.membership
        live: dict[str, Placement] = {}
        for k, p in self._placements.items():
            kept = p.surviving(lambda n: (m := ms.get(n)) is None or m.state in (DEAD, LEFT))
            if kept is not None:
                live[k] = kept
        return live

    def _plan(self, now: float) -> None:
        checked = (self.membership.version, self.term, self._held_gen)
        if checked == self._plan_checked and self._plan_inputs is not None:
            return  # nothing it is made from changed
        self._plan_checked = checked
        offers, eligible = self._offers()
        reqs = self._requests()
        inputs = (tuple(sorted((o.name, o.memory, o.dtype) for o in offers)), tuple(eligible),
                  tuple(sorted((k, r.spec, r.nodes, r.only, r.pinned, r.askers)
                               for k, r in reqs.items())),
                  self.term)
        if inputs == self._plan_inputs:
            return
        self._plan_inputs = inputs
        previous = self._live_placements()
        result = plan(list(reqs.values()), offers, previous, eligible)
        placements: dict[str, Placement] = {}
        errors: dict[str, Message] = {}
        for model, got in result.items():
            if isinstance(got, PlacementError):
                errors[model] = _error_dict(got)
            else:
                if got.term == 0 or model not in previous:
                    got = dataclasses.replace(got, term=self.term,
                                              serial=self.placement_version + 1)
                if any(r.term == 0 for r in got.replicas):  # replicas placed just now
                    got = dataclasses.replace(got, replicas=tuple(
                        dataclasses.replace(r, term=self.term, serial=self.placement_version + 1)
                        if r.term == 0 else r for r in got.replicas))
                placements[model] = got
        requests: list[WireValue] = [{"spec": r.spec.to_dict(), "nodes": list(r.nodes)}
                                     for _, r in sorted(self._explicit.items())]
        # A new request is a new version even when the placements come out the same: the
        # version is what followers ack, and an ack must mean they hold the request too.
        if (placements != self._placements or errors != self._errors
                or self._plan_term != self.term
                or requests != self.election.payload.get("requests")):
            self.placement_version += 1
        self._partial_plan = False
        if placements != self._placements or errors != self._errors:
            self._held_gen += 1
        self._placements, self._errors, self._plan_term = placements, errors, self.term
        self._plan_leader = self.name
        self.election.payload = {
            "version": self.placement_version,
            "placements": [p.to_dict() for _, p in sorted(placements.items())],
            "errors": [e for _, e in sorted(errors.items())],
            "requests": requests,
        }
        self._note_held()
