"""A place request is acknowledged only once a majority of the voters hold it (Raft's commit over
the placement plan), and every later leader keeps what was acknowledged. Deterministic: the
cluster's state machines on the simulated network and clock (tests/helpers/cluster_sim.py)."""

from __future__ import annotations

import pytest

from skulkp2p.cluster.core import ABSENT, COMMITTED, HELD, ClusterCore
from tests.helpers.cluster_sim import MEMORY, AckLedger, SimNet, holders
from tests.helpers.cluster_sim import small_spec as spec


def trio(seed: int, priority_of_n1: int = 0) -> tuple[SimNet, ClusterCore, ClusterCore,
                                                      ClusterCore]:
    """n0 founds the cluster and leads it; n1 and n2 join it."""
    net = SimNet(seed=seed)
    n0 = net.add("n0", 0, [], MEMORY)
    n1 = net.add("n1", 1, [SimNet.addr(0)], MEMORY, priority=priority_of_n1)
    n2 = net.add("n2", 2, [SimNet.addr(0)], MEMORY)
    assert net.run(15, lambda: net.agreed_leader() == "n0" and net.views_agree())
    return net, n0, n1, n2


def test_a_single_node_commits_at_once():
    net = SimNet(seed=1)
    solo = net.add("solo", 0, [], MEMORY)
    assert net.run(2, lambda: solo.is_leader)
    m = spec("m")
    assert solo.request_state(m) == ABSENT
    assert solo.request_placement(m, now=net.now) == []
    assert solo.request_state(m) == COMMITTED  # a majority of one: itself
    assert "m" in solo.placements()


def test_the_leader_commits_only_once_a_majority_holds_the_plan():
    net, n0, n1, n2 = trio(seed=2)
    m = spec("m")
    net.send(n0.addr, n0.request_placement(m, now=net.now))
    # Planned, held by the leader alone: not acknowledged yet.
    assert n0.request_state(m) == HELD and holders(net, m) == ["n0"]
    assert n0.request_holders(m) == (1, 3, 2)
    seen: list[tuple[str, list[str]]] = []

    def committed_somewhere() -> bool:
        for c in (n0, n1, n2):
            if c.request_state(m) == COMMITTED:
                seen.append((c.name, holders(net, m)))
        return n0.request_state(m) == COMMITTED

    assert net.run(2, committed_somewhere)
    assert n0.request_holders(m)[0] >= 2
    # Whoever said "committed", at that moment a majority held the request.
    assert seen and all(len(h) >= 2 for _, h in seen), seen
    # The followers learn the commit from the next heartbeats.
    assert net.run(2, lambda: all(c.request_state(m) == COMMITTED for c in (n0, n1, n2)))
    # /v1/cluster's "plan": the same plan everywhere, committed up to its version.
    term, version = n0.plan_id
    assert net.run(2, lambda: all(c.status()["plan"] == {"term": term, "version": version,
                                                         "committed": version}
                                  for c in (n0, n1, n2)))


def test_a_request_sent_through_a_follower_commits_there_too():
    net, n0, n1, n2 = trio(seed=3)
    m = spec("m")
    net.send(n2.addr, n2.request_placement(m, ["n1"], now=net.now))
    assert n2.request_state(m, ["n1"]) == ABSENT  # on its way to the leader
    first_commit: list[list[str]] = []

    def follower_committed() -> bool:
        if n2.request_state(m, ["n1"]) == COMMITTED:
            first_commit.append(holders(net, m, ["n1"]))
            return True
        return False

    assert net.run(3, follower_committed)
    assert len(first_commit[0]) >= 2
    assert n2.placements()["m"].ring == ("n1",)
    # A different request for the same model is not the one acknowledged.
    assert n2.request_state(m, ["n2"]) == ABSENT


def test_leader_crash_before_a_majority_held_it_loses_an_unacknowledged_request():
    """The leader planned and died before any heartbeat left: nobody ever said the request
    was committed, so losing it breaks no promise (the HTTP answer was a 503 saying so)."""
    net, n0, n1, n2 = trio(seed=4)
    m = spec("m")
    net.send(n0.addr, n0.request_placement(m, now=net.now))
    assert n0.request_state(m) == HELD
    net.crash(n0)
    assert net.run(10, lambda: net.agreed_leader() in ("n1", "n2"))
    assert n0.request_state(m) == HELD  # it never heard a majority
    assert holders(net, m) == ["n0"]
    assert all("m" not in c.placements() for c in (n1, n2))


def test_leader_crash_after_a_majority_held_it_keeps_the_request():
    """Committed with n0 (leader) and n2 while n1, the highest-priority node, missed the
    heartbeats; n0 dies at once. n1 stands first but n2 refuses it (n1's plan is older), so n2
    wins and the acknowledged placement survives. Without the up-to-date check in votes n1 won
    and the placement was silently lost."""
    net, n0, n1, n2 = trio(seed=5, priority_of_n1=10)
    m = spec("m")
    net.cut(n0, n1)  # n1 hears nothing from the leader for a moment (shorter than a lease)
    net.send(n0.addr, n0.request_placement(m, now=net.now))
    assert net.run(1, lambda: n0.request_state(m) == COMMITTED)
    assert holders(net, m) == ["n0", "n2"]
    net.crash(n0)
    net.heal()
    assert net.run(15, lambda: net.agreed_leader() is not None
                   and all("m" in c.placements() for c in (n1, n2)))
    assert net.agreed_leader() == "n2"
    assert holders(net, m) == ["n0", "n1", "n2"]
    # Committed again in n2's term once n1 acks n2's first plan.
    assert net.run(2, lambda: n1.request_state(m) == COMMITTED
                   and n2.request_state(m) == COMMITTED)
    assert not net.safety_violations()


def test_a_voter_refuses_a_candidate_with_an_older_plan():
    net, n0, n1, n2 = trio(seed=6)
    m = spec("m")
    net.send(n0.addr, n0.request_placement(m, now=net.now))
    assert net.run(2, lambda: all(c.request_state(m) == COMMITTED for c in (n0, n1, n2)))
    stale = ClusterCore("n1", n1.addr, facts=MEMORY, seeds=[n0.addr], timers=net.timers)
    assert stale.election.held < n2.election.held
    net.crash(n0)
    net.run(net.timers.election_timeout + 0.1)  # n2's lease on n0 has run out
    vote = {"t": "vote", "pre": False, "term": n2.term + 1, "from": "n1", "addr": n1.addr,
            "prio": 0, "voters": sorted(n2.election._voters), "held": list(stale.election.held)}
    ((_, reply),) = n2.on_message(vote, net.now)
    assert reply["t"] == "vote-reply" and reply["granted"] is False
    # The same vote from a candidate holding n2's plan is granted.
    vote = {**vote, "term": n2.term + 1, "held": list(n2.election.held)}
    ((_, reply),) = n2.on_message(vote, net.now)
    assert reply["granted"] is True


def test_a_partitioned_minority_leader_cannot_acknowledge():
    net = SimNet(seed=7)
    nodes = net.cluster(5, facts=MEMORY)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    leader = next(c for c in nodes if c.is_leader)
    minority = [leader, next(c for c in nodes if c is not leader)]
    majority = [c for c in nodes if c not in minority]
    net.partition(minority, majority)
    m = spec("m")
    net.send(leader.addr, leader.request_placement(m, now=net.now))
    states: set[str] = set()

    def watch() -> bool:
        states.update(c.request_state(m) for c in minority)
        return False

    net.run(2 * net.timers.election_timeout, watch)  # past its lease: it stepped down
    assert COMMITTED not in states and HELD in states
    assert holders(net, m) == sorted(c.name for c in minority)
    assert not leader.is_leader
    assert net.run(10, lambda: net.agreed_leader(majority) is not None)
    assert all(c.request_state(m) == ABSENT for c in majority)
    # Healed: the majority's plan wins (it is newer); the unacknowledged request is gone.
    net.heal()
    assert net.run(15, lambda: net.agreed_leader() is not None and net.views_agree())
    assert net.run(5, lambda: holders(net, m) == [])
    assert not net.safety_violations()


@pytest.mark.parametrize("seed", range(6))
def test_acknowledged_requests_survive_chaos(seed):
    """Requests keep coming (through random nodes) while leaders crash (two of five at most),
    partitions come and go, nodes pause and frames are lost; every request that any node ever
    reported committed is in the plan of the leader that remains once the faults stop."""
    net = SimNet(seed=300 + seed, loss=0.05, delay=(0.001, 0.1))
    nodes = net.cluster(5, facts=MEMORY)
    assert net.run(15, lambda: net.agreed_leader() is not None)
    rng = net.rng
    ledger = AckLedger(net)

    for i in range(14):
        ledger.ask(f"m{i}")
        fault = rng.choice(["crash_leader", "partition", "pause", "heal", "loss", "none"])
        leader = next((c for c in net.live() if c.is_leader), None)
        if fault == "crash_leader" and leader is not None and len(net.crashed) < 2:
            net.crash(leader)
        elif fault == "partition":
            net.random_partition(nodes)
        elif fault == "pause":
            victim = rng.choice(nodes)
            net.pause(victim)
            net.run(rng.uniform(0.5, 3), ledger.watch)
            net.resume(victim)
        elif fault == "heal":
            net.heal()
        elif fault == "loss":
            net.loss = rng.choice([0.0, 0.1, 0.3])
        net.run(rng.uniform(0.5, 3), ledger.watch)
    net.heal()
    net.loss = 0.0
    survivors = [c for c in nodes if c.addr not in net.crashed]
    assert net.run(30, lambda: net.agreed_leader(survivors) is not None
                   and len({c.plan_id for c in survivors}) == 1)
    leader = next(c for c in survivors if c.is_leader)
    assert ledger.acked, "no request was ever acknowledged: the test proves nothing"
    lost = ledger.lost(leader)
    assert not lost, (lost, sorted(ledger.acked))
    assert not net.safety_violations()
