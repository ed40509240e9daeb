"""A node keeps its term, its vote and the plan it holds across a restart (cluster/durable.py):
an acknowledged placement survives a majority restarting at once, a restarted voter never votes
twice in one term, and a file that cannot be used is a warning and a fresh start. Deterministic
tests on the simulated network (each node's disk simulated, the real file encoding), the file
functions on real files, and one real-process test: three `join` agents SIGKILLed together and
started again on the same data dir."""

from __future__ import annotations

import logging
import signal

import pytest

from skulkp2p.cluster import durable
from skulkp2p.cluster.core import COMMITTED, ClusterCore
from skulkp2p.cluster.durable import DurableState, load_state, save_state, state_path
from tests.helpers.cluster_sim import MEMORY, AckLedger, SimNet, holders
from tests.helpers.cluster_sim import small_spec as spec
from tests.helpers.http_client import call
from tests.helpers.procs import ProcCluster, loopback_ips_usable


def _power_cut_after_a_commit(durable: bool):
    """n0 (leader) and n2 commit m on the ring (n2,) while n1, the highest-priority node, is cut
    off from n0 and misses it; then n0 and n2 lose power together and come back (with or
    without their disk). Returns the net, the three nodes, m and n0's term before the cut."""
    net = SimNet(seed=11, durable=durable)
    n0 = net.add("n0", 0, [], MEMORY)
    n1 = net.add("n1", 1, [SimNet.addr(0)], MEMORY, priority=10)
    n2 = net.add("n2", 2, [SimNet.addr(0)], MEMORY)
    assert net.run(15, lambda: net.agreed_leader() == "n0" and net.views_agree())
    m = spec("m")
    net.cut(n0, n1)
    net.send(n0.addr, n0.request_placement(m, ["n2"], now=net.now))
    assert net.run(1, lambda: n0.request_state(m, ["n2"]) == COMMITTED)
    assert holders(net, m, ["n2"]) == ["n0", "n2"]
    term_before = n0.term
    net.crash(n0)
    net.crash(n2)
    net.heal()
    return net, net.restart(n0), n1, net.restart(n2), m, term_before


def test_a_majority_restarting_at_once_keeps_an_acknowledged_placement():
    """m is committed by n0 (leader) and n2 while n1, the highest-priority node, missed it.
    n0 and n2 lose power together and come back. Had they forgotten their plan, n1's (older,
    without m) would be the newest left and m would be gone for good; they remember it, so
    every leader after the restart holds m."""
    net, n0, n1, n2, m, term_before = _power_cut_after_a_commit(durable=True)
    # Back from disk before they hear anyone: the term, the plan and its commit.
    assert n0.term == term_before and n0.holds_request(m, ["n2"])
    assert n2.holds_request(m, ["n2"]) and n2.status()["plan"]["committed"] is not None
    assert not n1.holds_request(m, ["n2"])
    assert net.run(20, lambda: net.agreed_leader() is not None and net.views_agree()
                   and all("m" in c.placements() for c in (n0, n1, n2)))
    assert all(c.placements()["m"].ring == ("n2",) for c in (n0, n1, n2))
    assert net.agreed_leader() in ("n0", "n2") and n0.term > term_before
    assert not net.safety_violations() and not net.double_votes()


def test_a_majority_restarting_without_its_disk_loses_the_placement():
    """The same power cut with the state kept in memory only (the behaviour before): the test
    above is about the disk, not about luck."""
    net, n0, n1, n2, m, _ = _power_cut_after_a_commit(durable=False)
    assert net.run(20, lambda: net.agreed_leader() is not None and net.views_agree())
    net.run(2)
    assert not any(c.holds_request(m, ["n2"]) for c in (n0, n1, n2))


def test_a_restarted_voter_does_not_vote_twice_in_a_term():
    """n2 grants its vote in term t to n0, then restarts. Rejoining through n1, it must not
    grant n1 a vote in that same term t (without its saved vote it did: two leaders could win
    one term)."""
    net = SimNet(seed=12, durable=True)
    n0 = net.add("n0", 0, [], MEMORY)
    n1 = net.add("n1", 1, [SimNet.addr(0)], MEMORY)
    n2 = net.add("n2", 2, [SimNet.addr(1)], MEMORY)
    assert net.run(15, lambda: net.agreed_leader() == "n0" and net.views_agree())
    # n0 goes; n1 and n2 cannot reach each other: nobody elects, leases run out.
    net.crash(n0)
    net.cut(n1, n2)
    net.run(net.timers.leader_lease + 0.5)
    assert net.agreed_leader([n1, n2]) is None
    t = n2.term + 1
    vote = {"t": "vote", "pre": False, "term": t, "from": "n0", "addr": n0.addr, "prio": 0,
            "voters": ["n0", "n1", "n2"], "held": list(n2.election.held)}
    outs = n2.on_message(vote, net.now)
    assert [m["granted"] for _, m in outs] == [True]
    net.send(n2.addr, outs)  # saved before it leaves, as node.py does
    assert net.votes[("n2", t)] == {n0.addr}

    net.crash(n2)
    net.heal()
    n2 = net.restart(n2)
    assert n2.term == t and n2.election.voted_for == "n0"
    assert net.run(30, lambda: net.agreed_leader([n1, n2]) is not None)
    assert not net.double_votes(), net.double_votes()
    assert not net.safety_violations()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_acknowledged_requests_survive_power_cuts_chaos(seed):
    """Requests keep coming through random nodes while a majority (or all) of five nodes lose
    power at once and come back from their disks, single nodes crash and restart, partitions
    come and go and frames are lost: every request any node ever reported committed is in the
    final leader's plan, no term has two leaders and no node granted two votes in one term."""
    net = SimNet(seed=700 + seed, loss=0.05, delay=(0.001, 0.1), durable=True)
    nodes = net.cluster(5, facts=MEMORY)
    assert net.run(15, lambda: net.agreed_leader() is not None)
    rng = net.rng
    ledger = AckLedger(net)
    cuts = 0

    def restart(victims: list[ClusterCore]) -> None:
        for v in victims:
            i = nodes.index(v)
            nodes[i] = net.restart(v)

    for i in range(12):
        ledger.ask(f"m{i}")
        fault = "power_cut" if i == 1 else rng.choice(["power_cut", "power_cut", "crash_one",
                                                       "partition", "heal", "loss"])
        if fault == "power_cut":
            victims = rng.sample(nodes, rng.choice([3, 4, 5]))
            for v in victims:
                net.crash(v)
            cuts += 1
            net.run(rng.uniform(0.1, 2), ledger.watch)
            restart(victims)
        elif fault == "crash_one":
            victim = rng.choice(nodes)
            net.crash(victim)
            net.run(rng.uniform(0.5, 3), ledger.watch)
            restart([victim])
        elif fault == "partition":
            net.random_partition(nodes)
        elif fault == "heal":
            net.heal()
        elif fault == "loss":
            net.loss = rng.choice([0.0, 0.1, 0.3])
        net.run(rng.uniform(0.5, 3), ledger.watch)
    net.heal()
    net.loss = 0.0
    assert net.run(40, lambda: net.agreed_leader(nodes) is not None
                   and len({c.plan_id for c in nodes}) == 1)
    leader = next(c for c in nodes if c.is_leader)
    assert ledger.acked and cuts, "no request acknowledged or no power cut: the test proves nothing"
    lost = ledger.lost(leader)
    assert not lost, (lost, sorted(ledger.acked))
    assert not net.safety_violations()
    assert not net.double_votes(), net.double_votes()


def test_the_state_file_round_trips_and_is_written_atomically(tmp_path):
    path = state_path(tmp_path, "host:52416")
    assert path == tmp_path / "cluster" / "host_52416.json"
    st = DurableState("host:52416", term=7, voted_for="b", plan_term=6, plan_version=3,
                      committed=3, requests=({"spec": spec("m").to_dict(), "nodes": ["b"]},))
    save_state(path, st, "c1")
    assert load_state(path, "host:52416", "c1") == st
    save_state(path, DurableState("host:52416", term=8), "c1")
    assert load_state(path, "host:52416", "c1").term == 8
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left


@pytest.mark.parametrize("content, why", [
    (b"{\"format\": 1, \"term\": ", "corrupt"),
    (b"\x00\xff garbage", "corrupt"),
    (b"[]", "corrupt"),
    (b"{\"format\": 1, \"cluster\": \"c1\", \"node\": \"n0\", \"term\": \"7\", \"plan\": {}}",
     "corrupt"),
])
def test_a_corrupt_state_file_is_a_warning_and_a_fresh_start(tmp_path, caplog, content, why):
    path = state_path(tmp_path, "n0")
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="skulkp2p.cluster"):
        assert load_state(path, "n0", "c1") is None
    (rec,) = caplog.records
    assert why in rec.getMessage() and "fresh" in rec.getMessage()
    assert "\n" not in rec.getMessage()


def test_a_state_file_of_another_node_or_cluster_is_ignored(tmp_path, caplog):
    path = state_path(tmp_path, "n0")
    save_state(path, DurableState("n0", term=5), "c1")
    with caplog.at_level(logging.WARNING, logger="skulkp2p.cluster"):
        assert load_state(path, "n1", "c1") is None
        assert load_state(path, "n0", "c2") is None
        assert load_state(tmp_path / "nothing.json", "n0", "c1") is None  # first start: quiet
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2
    assert "belongs to node 'n0', not 'n1'" in msgs[0]
    assert "another cluster" in msgs[1]
    assert durable.cluster_id(b"secret-a") != durable.cluster_id(b"secret-b")


def test_a_restored_node_drops_the_plans_member_wants_but_keeps_place_requests():
    """Only what a place request asked for comes back from disk; a model that was placed
    because some member's --model asked for it is asked for again by its member (a node
    restarted with another --model does not load its old one)."""
    net = SimNet(seed=13, durable=True)
    wanted = spec("w")
    solo = net.add("solo", 0, [], {**MEMORY, "wants": [wanted.to_dict()]})
    assert net.run(2, lambda: solo.is_leader and "w" in solo.placements())
    m = spec("m")
    net.send(solo.addr, solo.request_placement(m, now=net.now))
    assert net.run(1, lambda: "m" in solo.placements())
    net.run(0.1)
    restored = durable.from_json(net.disk[solo.addr])
    assert {p["model"] for p in restored.placements} == {"m", "w"}
    again = ClusterCore("solo", solo.addr, facts=MEMORY, timers=net.timers, restored=restored)
    assert again.requested() == {"m"}
    assert again.plan_id == solo.plan_id


def test_a_restored_placement_on_a_node_that_never_comes_back_is_placed_again():
    """After a full restart the node a placement was on stays away: the restarted cluster does
    not know it at all, and the existing re-placement (a placement on a node that is not a live
    member is not kept) puts the model on a node that is there."""
    net = SimNet(seed=14, durable=True)
    a = [SimNet.addr(i) for i in range(3)]
    cores = [net.add("n0", 0, [], MEMORY), net.add("n1", 1, [a[0], a[2]], MEMORY),
             net.add("n2", 2, [a[0], a[1]], MEMORY)]
    assert net.run(15, lambda: net.agreed_leader() == "n0" and net.views_agree())
    m = spec("m")
    net.send(cores[0].addr, cores[0].request_placement(m, now=net.now))
    assert net.run(2, lambda: all(c.request_state(m) == COMMITTED for c in cores))
    (gone,) = cores[0].placements()["m"].ring
    for c in cores:
        net.crash(c)
    back = [net.restart(c) for c in cores if c.name != gone]
    assert all(c.holds_request(m) for c in back)
    assert net.run(20, lambda: net.agreed_leader(back) is not None
                   and all("m" in c.placements() for c in back)
                   and all(gone not in c.placements()["m"].ring for c in back))
    assert not net.double_votes()


def test_a_node_that_cannot_save_its_state_does_not_ack_plans_until_it_can(tmp_path, caplog):
    """Three real nodes on loopback sockets in this process; b's state file cannot be written
    (its directory is a file). b adopts a's plans but never acks them: a commits with c alone
    and counts 2 holders, heartbeat after heartbeat; once b's disk works again b's ack counts
    (3 holders) and its file holds the plan."""
    import asyncio
    import time

    from skulkp2p.cluster.config import NodeConfig
    from skulkp2p.cluster.node import ClusterNode
    from skulkp2p.cluster.timers import Timers
    from tests.helpers.procs import free_port

    blocker = tmp_path / "b-data"
    blocker.write_text("a file where the cluster dir should be")

    async def until(pred, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)

    async def run() -> None:
        timers = Timers()
        pa = free_port()
        mem = 4_000_000_000
        a = ClusterNode(NodeConfig("a", port=pa, timers=timers, memory_limit=mem,
                                   state_file=state_path(tmp_path / "a-data", "a")))
        await a.start()
        b = ClusterNode(NodeConfig("b", port=free_port(), peers=[f"127.0.0.1:{pa}"],
                                   timers=timers, memory_limit=mem,
                                   state_file=state_path(blocker, "b")))
        c = ClusterNode(NodeConfig("c", port=free_port(), peers=[f"127.0.0.1:{pa}"],
                                   timers=timers, memory_limit=mem,
                                   state_file=state_path(tmp_path / "c-data", "c")))
        try:
            await until(lambda: a.core.is_leader, 10, "a to lead")
            await b.start()
            await c.start()
            await until(lambda: b.core.leader == "a" and c.core.leader == "a"
                        and len(a.core.membership.voters()) == 3, 20, "b and c to follow a")
            await until(lambda: b.metrics["state_save_errors"] > 0, 10, "b to fail a save")
            assert not b.state_saved and a.state_saved and c.state_saved
            m = spec("m")
            a.request_placement(m)
            await until(lambda: a.core.request_state(m) == "committed"
                        and b.core.holds_request(m), 10, "a commit with c, b holding the plan")
            beats = a.metrics["frames_out"] + 20  # a few heartbeat rounds: b never says so
            await until(lambda: a.metrics["frames_out"] > beats, 10, "more heartbeats")
            assert a.core.is_leader and a.core.request_holders(m) == (2, 3, 2)
            blocker.unlink()  # the disk works again
            await until(lambda: a.core.request_holders(m)[0] == 3, 10, "b's ack")
            assert b.state_saved
            saved = load_state(state_path(blocker, "b"), "b", durable.cluster_id(b.key))
            assert saved is not None and (saved.plan_term, saved.plan_version) == b.core.plan_id
        finally:
            for n in (c, b, a):
                await n.close(leave=False)

    with caplog.at_level(logging.ERROR, logger="skulkp2p.cluster"):
        asyncio.run(run())
    errors = [r.getMessage() for r in caplog.records
              if r.levelno == logging.ERROR and r.name == "skulkp2p.cluster"]
    assert len(errors) == 1 and "cannot save the cluster state" in errors[0], errors


# --------------------------------------------------------------------------------------------
# Real processes


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.skipif(not loopback_ips_usable(),
                    reason="needs the 127.0.0.0/8 loopback range (Linux)")
def test_three_joins_killed_together_come_back_with_the_acknowledged_placement(tmp_path,
                                                                               tiny_models):
    c = ProcCluster(tmp_path)
    try:
        for i in range(3):
            c.start_join(i, str(tiny_models["llama"]), args=["--memory-limit", "2GB"])
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and s["placements"], 90,
               "3 joins to agree on a placement")
        qwen = str(tiny_models["qwen3"])
        status, _, body = call(c.nodes[2].http, "POST", "/v1/cluster/place",
                               {"model": qwen, "nodes": ["n1"]}, timeout=30)
        assert status == 200, body
        term_before = c.status(0)["term"]
        files = {i: c.status(i)["state_file"] for i in range(3)}
        assert all(files[i] == str(c.data_dir / "cluster" / f"n{i}.json") for i in range(3))

        for i in range(3):  # a power cut: nobody leaves, nobody writes a last word
            c.signal(i, signal.SIGKILL)
        for i in range(3):
            c.nodes[i].proc.wait(10)
        for i in range(3):
            c.start_join(i, str(tiny_models["llama"]), args=["--memory-limit", "2GB"])

        def placed_again() -> bool:
            s = c.agreed([0, 1, 2])
            return bool(s) and any(p["model"] == "qwen3" and p["ring"] == ["n1"]
                                   for p in s["placements"])

        c.wait(placed_again, 90, "the restarted joins to hold the placed qwen3 on n1 again")
        st = c.status(0)
        assert st["term"] > term_before
        assert "restored term" in c.nodes[0].log.read_text(errors="replace")
    finally:
        c.close()
