"""Membership, election and placement state machines on a simulated network and clock."""

from __future__ import annotations

import os
import time

import pytest

from skulkp2p.cluster.election import Election
from skulkp2p.cluster.membership import ALIVE, DEAD, SUSPECT, Membership
from skulkp2p.cluster.placement import ModelSpec
from tests.helpers.cluster_sim import SimFailure, SimNet, chaos, seeds_from_env

GB = 1_000_000_000


def _states(core, name):
    m = core.membership.get(name)
    return m.state if m else None


def test_five_nodes_converge_to_one_view_and_one_leader():
    net = SimNet(seed=1)
    nodes = net.cluster(5)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    for c in nodes:
        assert sorted(c.membership.names(ALIVE)) == [f"n{i}" for i in range(5)]
    assert not net.safety_violations()


def test_convergence_with_loss_and_delays():
    net = SimNet(seed=2, loss=0.15, delay=(0.001, 0.15))
    net.cluster(5)
    assert net.run(40, lambda: net.agreed_leader() and net.views_agree())
    assert not net.safety_violations()


def test_single_node_without_seeds_leads_itself():
    net = SimNet(seed=3)
    solo = net.add("solo", 0)
    assert net.run(5, lambda: solo.is_leader)


def test_node_with_unreachable_seeds_never_elects_itself():
    net = SimNet(seed=4)
    lonely = net.add("lonely", 0, seeds=[SimNet.addr(9)])
    net.run(10)
    assert lonely.leader is None and not lonely.membership.bootstrapped
    # A second node that joins through it does not make a cluster of their own either.
    friend = net.add("friend", 1, seeds=[lonely.addr])
    net.run(10)
    assert lonely.leader is None and friend.leader is None
    assert friend.membership.names(ALIVE) == ["friend", "lonely"]


def test_crashed_node_is_suspected_then_declared_dead():
    net = SimNet(seed=5)
    nodes = net.cluster(5)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    victim = next(c for c in nodes if not c.is_leader)
    net.crash(victim)
    t0 = net.now
    others = [c for c in nodes if c is not victim]
    assert net.run(5, lambda: any(_states(c, victim.name) == SUSPECT for c in others))
    t_suspect = net.now - t0
    assert net.run(10, lambda: all(_states(c, victim.name) == DEAD for c in others))
    t_dead = net.now - t0
    # Suspected within a few probe periods, dead one suspect timeout or so later.
    assert t_suspect < 3.0 and t_dead < 3.0 + net.timers.suspect_timeout + 1.0
    # The leader does not lose its seat over one dead follower (4 of 5 still answer).
    assert net.agreed_leader(others)


def test_one_bad_link_does_not_condemn_a_node():
    """Indirect probes: a cannot reach b directly, but others can, so nobody suspects b."""
    net = SimNet(seed=6)
    nodes = net.cluster(4)
    assert net.run(15, lambda: net.views_agree())
    a, b = nodes[1], nodes[2]
    net.cut(a, b)
    net.run(15)
    for c in nodes:
        assert _states(c, b.name) == ALIVE and _states(c, a.name) == ALIVE


def test_paused_node_refutes_suspicion_with_a_higher_incarnation():
    net = SimNet(seed=7)
    nodes = net.cluster(4)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    victim = next(c for c in nodes if not c.is_leader)
    inc0 = victim.membership.me.inc
    net.pause(victim)
    others = [c for c in nodes if c is not victim]
    assert net.run(6, lambda: any(_states(c, victim.name) == SUSPECT for c in others))
    net.resume(victim)  # back before the suspect timeout runs out
    assert net.run(5, lambda: all(_states(c, victim.name) == ALIVE for c in others))
    assert victim.membership.me.inc > inc0


def test_paused_node_declared_dead_comes_back_alive():
    net = SimNet(seed=8)
    nodes = net.cluster(4)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    victim = next(c for c in nodes if not c.is_leader)
    net.pause(victim)
    others = [c for c in nodes if c is not victim]
    assert net.run(15, lambda: all(_states(c, victim.name) == DEAD for c in others))
    net.resume(victim)
    assert net.run(10, lambda: all(_states(c, victim.name) == ALIVE for c in others)
                   and net.views_agree())


def test_leader_crash_elects_a_new_leader_quickly():
    net = SimNet(seed=9)
    nodes = net.cluster(5)
    assert net.run(15, lambda: net.agreed_leader())
    old = next(c for c in nodes if c.is_leader)
    term = old.term
    net.crash(old)
    t0 = net.now
    assert net.run(10, lambda: net.agreed_leader() not in (None, old.name))
    elapsed = net.now - net.now + (net.now - t0)
    t = net.timers
    assert elapsed < t.election_timeout + 4 * t.election_rank_step + t.election_jitter + 1.0
    assert all(c.term > term for c in net.live())
    assert not net.safety_violations()


def test_highest_priority_survivor_usually_wins():
    net = SimNet(seed=10)
    nodes = [net.add(f"n{i}", i, [SimNet.addr(0)] if i else [SimNet.addr(1)],
                     priority=(5 if i == 3 else 0)) for i in range(5)]
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    leader = next(c for c in nodes if c.is_leader)
    if leader.name != "n3":
        net.crash(leader)
        assert net.run(10, lambda: net.agreed_leader() not in (None, leader.name))
    assert net.agreed_leader() == "n3"


def test_returning_paused_follower_does_not_unseat_the_leader():
    net = SimNet(seed=11)
    nodes = net.cluster(5)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    leader = next(c for c in nodes if c.is_leader)
    term = leader.term
    victim = next(c for c in nodes if not c.is_leader)
    net.pause(victim)
    net.run(8)  # far past its election timeout
    net.resume(victim)
    assert net.run(10, lambda: victim.leader == leader.name and net.views_agree())
    net.run(3)
    assert leader.is_leader and leader.term == term
    assert all(c.term == term for c in nodes)


def test_returning_paused_leader_follows_the_new_one():
    net = SimNet(seed=12)
    nodes = net.cluster(3)
    assert net.run(15, lambda: net.agreed_leader())
    old = next(c for c in nodes if c.is_leader)
    net.pause(old)
    others = [c for c in nodes if c is not old]
    assert net.run(10, lambda: net.agreed_leader(others) not in (None, old.name))
    new = net.agreed_leader(others)
    net.resume(old)
    assert net.run(5, lambda: net.agreed_leader() == new)
    assert not net.safety_violations()


def test_minority_partition_has_no_leader_and_healing_restores_one():
    net = SimNet(seed=13)
    nodes = net.cluster(5)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    leader = next(c for c in nodes if c.is_leader)
    # Put the leader in the minority: it must step down; the majority elects.
    minority = [leader] + [c for c in nodes if c is not leader][:1]
    majority = [c for c in nodes if c not in minority]
    net.partition(minority, majority)
    assert net.run(10, lambda: net.agreed_leader(majority) is not None
                   and all(c.leader is None for c in minority))
    net.run(10)  # a long partition: still nothing on the minority side
    assert all(c.leader is None and not c.placements() for c in minority)
    assert net.agreed_leader(majority) is not None
    net.heal()
    assert net.run(15, lambda: net.agreed_leader() is not None and net.views_agree())
    assert not net.safety_violations()


def test_even_split_elects_nobody():
    net = SimNet(seed=14)
    nodes = net.cluster(4)
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    net.partition(nodes[:2], nodes[2:])
    net.run(12)
    assert all(c.leader is None for c in nodes)
    net.heal()
    assert net.run(15, lambda: net.agreed_leader() is not None)


@pytest.mark.parametrize("seed", range(8))
def test_election_safety_under_chaos(seed):
    """Random partitions, crashes, pauses and loss: never two leaders in one term, and one
    leader again once the faults stop."""
    net = SimNet(seed=100 + seed, loss=0.05, delay=(0.001, 0.1))
    nodes = net.cluster(5)
    net.run(8)
    rng = net.rng
    for _ in range(12):
        fault = rng.choice(["partition", "crash", "pause", "heal", "loss", "join"])
        if fault == "partition":
            net.random_partition(nodes)
        elif fault == "crash" and len(net.crashed) < 1:
            net.crash(rng.choice(nodes))
        elif fault == "pause":
            victim = rng.choice(nodes)
            net.pause(victim)
            net.run(rng.uniform(0.5, 5))
            net.resume(victim)
        elif fault == "heal":
            net.heal()
        elif fault == "join":  # through any node, even a crashed or isolated one
            i = len(nodes)
            nodes.append(net.add(f"n{i}", i, [SimNet.addr(rng.randrange(i))]))
        else:
            net.loss = rng.choice([0.0, 0.1, 0.3])
        net.run(rng.uniform(1, 6))
    assert not net.safety_violations()
    net.heal()
    net.loss = 0.0
    for c in nodes:
        if c.addr in net.paused:
            net.resume(c)
    # Those in the cluster: a node that joined through a node that never joined itself (a
    # crashed or isolated newcomer) forms a leaderless island with it, by design (see
    # test_node_with_unreachable_seeds_never_elects_itself); nobody in the cluster knows it.
    known = {n for c in nodes[:5] if c.addr not in net.crashed for n in c.membership.members}
    joined = [c for c in nodes if c.membership.bootstrapped and c.addr not in net.crashed
              and c.name in known]
    assert net.run(30, lambda: net.agreed_leader(joined) is not None)
    assert not net.safety_violations()


def test_leader_places_wanted_models_and_replaces_after_failover():
    spec = ModelSpec("m", layers=30, size_bytes=200_000_000, context_length=1024,
                     hidden_size=576, kv_heads=3)
    net = SimNet(seed=15)
    nodes = []
    for i in range(5):
        facts = {"memory": 300_000_000 + i * 1000}
        if i == 0:
            facts["wants"] = [spec.to_dict()]
        nodes.append(net.add(f"n{i}", i, [SimNet.addr(0)] if i else [SimNet.addr(1)], facts))

    def placed():
        p = [c.placements().get("m") for c in net.live()]
        return all(x is not None for x in p) and len({x.ring for x in p}) == 1

    assert net.run(15, placed)
    ring = nodes[0].placements()["m"].ring
    assert len(ring) == 1 and ring[0] == "n4"  # fits on one; the most free memory wins
    # Kill the node holding it and the leader (3 of 5 remain): placed again elsewhere.
    holder = next(c for c in nodes if c.name == ring[0])
    net.crash(holder)
    leader = next((c for c in nodes if c.is_leader), None)
    if leader is not None and leader is not holder:
        net.crash(leader)
    assert net.run(20, lambda: placed() and holder.name not in
                   net.live()[0].placements()["m"].ring)
    assert net.live()[0].placements()["m"].ring in (("n3",), ("n2",))
    assert not net.safety_violations()


def test_place_request_and_not_fitting_error_reach_every_node():
    net = SimNet(seed=16)
    nodes = net.cluster(3, facts={"memory": 100_000_000})
    assert net.run(15, lambda: net.agreed_leader() and net.views_agree())
    follower = next(c for c in nodes if not c.is_leader)
    big = ModelSpec("big", layers=10, size_bytes=1_000_000_000, context_length=512,
                    hidden_size=64, kv_heads=1)
    small = ModelSpec("small", layers=8, size_bytes=60_000_000, context_length=512,
                      hidden_size=64, kv_heads=1)
    # One after the other: the error counts the memory free when it was planned (with
    # "small" placed first it would say 221 MB).
    net.send(follower.addr, follower.request_placement(big, now=net.now))
    assert net.run(5, lambda: all("big" in c.placement_errors() for c in nodes))
    err = follower.placement_errors()["big"]["error"]
    assert "needs 1.30 GB" in err and "300 MB" in err
    net.send(follower.addr, follower.request_placement(small, ["n2", "n1"], now=net.now))
    assert net.run(5, lambda: all("big" in c.placement_errors() and "small" in c.placements()
                                  for c in nodes))
    assert follower.placements()["small"].ring == ("n2", "n1")


def test_membership_ignores_malformed_messages():
    m = Membership("a", "1.1.1.1:1")
    for msg in ({}, {"t": "ping"}, {"t": "ping", "from": 3, "addr": "x"},
                {"t": "sync", "from": "b", "addr": "x", "members": [1, {"n": ""}, None]},
                {"t": "ack", "from": "b", "addr": "x", "seq": "no", "g": [{"n": "c"}]}):
        m.on_message(msg, 1.0)
    assert m.names(ALIVE, SUSPECT, DEAD) == ["a"]
    e = Election("a", "1.1.1.1:1")
    for msg in ({}, {"t": "vote", "from": "b", "term": True}, {"t": "lead", "from": "b"}):
        assert e.on_message(msg, 1.0) == []


@pytest.mark.parametrize("seed", range(4))
def test_founder_keeps_the_lead_as_nodes_join(seed):
    """A node without seeds leads a cluster of one at once; nodes that join later learn its
    term before they may stand, so no term ever has two leaders, and the founder keeps the
    lead while the quorum grows under it."""
    net = SimNet(seed=200 + seed, delay=(0.001, 0.05))
    founder = net.add("n0", 0)
    assert net.run(1, lambda: founder.is_leader)
    net.run(3)  # alone for longer than a lease
    for i in range(1, 5):
        net.add(f"n{i}", i, [SimNet.addr(0)])
        net.run(net.rng.uniform(0, 3))
    assert net.run(15, lambda: net.agreed_leader() == "n0" and net.views_agree())
    assert founder.term == 1 and not net.safety_violations()


def test_a_leader_elected_again_never_publishes_its_old_placements():
    """A node that led, followed another leader meanwhile, and wins again: its first heartbeats
    carry what it plans in the new term, not the placements of its previous leadership
    (followers once adopted those for a heartbeat, and a tensor group's member stopped its rank
    for a placement from terms ago)."""
    small = ModelSpec("small", layers=8, size_bytes=60_000_000, context_length=512,
                      hidden_size=64, kv_heads=1)
    net = SimNet(seed=26)  # (a seed where n1, not n2, wins the last election)
    facts = {"memory": 100_000_000}
    # n1 founds the cluster (no seed answers before it stands); priorities then make n0 win
    # while n1 is away, and n1 (above n2) win when n0 is away.
    n0 = net.add("n0", 0, [SimNet.addr(1)], facts, priority=10)
    first = net.add("n1", 1, [SimNet.addr(0)], facts, priority=5)
    n2 = net.add("n2", 2, [SimNet.addr(0)], facts)
    nodes, others = [n0, first, n2], [n0, n2]
    assert net.run(15, lambda: net.agreed_leader() == "n1" and net.views_agree())
    # n1 pauses; another leads and places "small" (n1's own payload never had it).
    net.pause(first)
    assert net.run(15, lambda: net.agreed_leader(others) in ("n0", "n2"))
    second = next(c for c in others if c.is_leader)
    follower = next(c for c in others if c is not second)
    net.send(follower.addr, follower.request_placement(small, ["n2"], now=net.now))
    assert net.run(5, lambda: all("small" in c.placements() for c in others))
    net.resume(first)
    assert net.run(10, lambda: all("small" in c.placements() for c in nodes)
                   and net.agreed_leader() == second.name)
    # The second leader pauses: n1 (above n2) wins again. From here on, no live node that
    # follows a leader may lose "small" for a moment.
    net.pause(second)
    lost: list[tuple[float, str]] = []

    def watch() -> bool:
        lost.extend((net.now, c.name) for c in net.live()  # (no leader: no placements at all)
                    if c.leader is not None and "small" not in c.placements())
        return False

    net.run(10, watch)
    assert first.is_leader, (first.leader, first.term)
    assert not lost, lost[:5]
    assert first.placements()["small"].ring == ("n2",)


# --------------------------------------------------------------------------------------------
# Seeded chaos (tests/helpers/cluster_sim.py: chaos): a cluster of 3-5 nodes that save their
# state, under crashes and restarts (one node, a majority, all at once), partitions, pauses,
# loss, duplication, reordering and slow disks, with place requests coming through random
# nodes. Every step checks that no term has two leaders, no voter votes twice in a term and no
# leader lacks an acknowledged placement; once the faults stop, every live node must hold the
# same plan with every model placed on live nodes within SETTLE_S. A failure prints its seed and
# the command that replays it (SKULKP2P_SIM_SEED=...).

QUICK_SEEDS = range(30)
# 500 seeds in the full tier (SKULKP2P_SIM_SEEDS=N runs N, for a longer hunt). Measured: seeds
# 0-2999 all pass, and with an earlier fault emulated 18 of 100 seeds failed. A fault that
# breaks 1 seed in 100 fails 500 of them 99.3% of the time (1 - 0.99**500), one of that earlier
# kind certainly; 2,000 seeds cost 4x the time for the rarer faults only.
FULL_SEEDS = range(1000, 1000 + int(os.environ.get("SKULKP2P_SIM_SEEDS", "500")))


@pytest.mark.parametrize("seed", QUICK_SEEDS)
def test_chaos(seed):
    report = chaos(seed)
    assert report.steps > 0


def test_chaos_replay():
    """The seeds in SKULKP2P_SIM_SEED (``=123`` or ``=1,2,3``), as a failure message says;
    without it, a seed run twice must do exactly the same (so any failure replays)."""
    seeds = seeds_from_env(range(0))
    for seed in seeds:
        chaos(seed)
    if not seeds:
        assert chaos(7) == chaos(7)


@pytest.mark.slow
def test_chaos_many_seeds():
    failures: list[str] = []
    t0 = time.monotonic()
    for seed in FULL_SEEDS:
        try:
            chaos(seed)
        except SimFailure as e:
            failures.append(str(e))
            if len(failures) == 3:
                break
    took = time.monotonic() - t0
    assert not failures, f"{len(failures)} seeds failed:\n\n" + "\n\n".join(failures)
    print(f"{len(FULL_SEEDS)} chaos seeds in {took:.1f} s")
