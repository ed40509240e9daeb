"""Restarts converge: a node that knew other members wins a real election after a restart (it
never founds a cluster of its own again, so a term never has two leaders), followers take the
plan of their term's leader, and a placement pinned to nodes that are away is placed
automatically until they are back. Deterministic tests on the simulated network
(tests/helpers/cluster_sim.py), one in-process node on its real state file, and one real-process
test: three `join` agents, the leader killed, all stopped and started again, all serving."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time

import pytest

from skulkp2p.cluster import durable
from skulkp2p.cluster.core import COMMITTED
from skulkp2p.cluster.durable import DurableState, KnownMember, load_state, save_state, state_path
from skulkp2p.cluster.election import LEADER
from tests.helpers.cluster_sim import MEMORY, SimNet, small_spec
from tests.helpers.http_client import call
from tests.helpers.procs import ProcCluster, loopback_ips_usable

WANTED = small_spec("w")  # every node's --model


def _failover_then_full_stop(stop: str, seed: int = 21):
    """The reported cluster: c1 founds it, c2 and c3 join through c1, every node asks for w.
    c1 is killed and c3 (the highest priority) leads term 2; then c2 and c3 stop too (killed,
    or leaving gracefully). Returns the net, the three stopped nodes and c3's term."""
    net = SimNet(seed=seed, durable=True)
    facts = {**MEMORY, "wants": [WANTED.to_dict()]}
    c1 = net.add("c1", 1, [], facts)
    c2 = net.add("c2", 2, [SimNet.addr(1)], facts)
    c3 = net.add("c3", 3, [SimNet.addr(1)], facts, priority=5)
    assert net.run(15, lambda: net.agreed_leader() == "c1" and net.views_agree()
                   and all("w" in c.placements() for c in (c1, c2, c3)))
    assert c1.term == 1
    net.crash(c1)
    assert net.run(15, lambda: net.agreed_leader([c2, c3]) == "c3"
                   and c2.plan_id == c3.plan_id)
    term = c3.term
    assert term >= 2 and c3.plan_id[0] == term
    for c in (c2, c3):
        if stop == "leave":
            net.send(c.addr, c.leave(net.now))
            net.run(0.5)
        net.crash(c)
    return net, c1, c2, c3, term


@pytest.mark.parametrize("stop, moved", [("kill", False), ("leave", False), ("kill", True)])
def test_a_full_restart_after_a_failover_has_one_leader_per_term_and_serves(stop, moved):
    """The founder c1, restarted without --peer, used to take its saved term + 1 alone: a term
    c3 had already won, so two leaders held one term and c2 and c3 ignored c1's (lower
    versioned) plan for good. It now knows c2 and c3 from its file and must win a real
    election, for a term above every term anyone saved. (``moved``: every node comes back on
    another port, the others' --peer naming c1's new one, so every saved address is stale.)"""
    net, c1, c2, c3, term = _failover_then_full_stop(stop)
    c1 = net.restart(c1, port=52500 if moved else None)
    assert c1.membership.voters() == ["c1", "c2", "c3"]
    net.run(3)
    assert not c1.is_leader and c1.leader is None  # alone, no quorum: it waits
    if moved:
        c2 = net.restart(c2, port=52500, seeds=[c1.addr])
        c3 = net.restart(c3, port=52500, seeds=[c1.addr])
    else:
        c2, c3 = net.restart(c2), net.restart(c3)
    nodes = [c1, c2, c3]
    assert net.run(20, lambda: net.agreed_leader(nodes) is not None and net.views_agree(nodes)
                   and len({c.plan_id for c in nodes}) == 1
                   and all("w" in c.placements() for c in nodes))
    assert not net.safety_violations(), net.safety_violations()
    assert not net.double_votes()
    assert all(c.term > term for c in nodes)
    assert len({c.placements()["w"] for c in nodes}) == 1


def test_a_node_that_knew_others_does_not_lead_alone_after_a_restart():
    net, c1, c2, c3, _ = _failover_then_full_stop("kill", seed=22)
    c2 = net.restart(c2)
    assert not c2.is_leader
    net.run(10)
    assert c2.leader is None and not c2.placements()
    assert c2.election.quorum == 2
    c3 = net.restart(c3)  # a majority of what they knew: they elect without c1
    assert net.run(15, lambda: net.agreed_leader([c2, c3]) is not None
                   and all("w" in c.placements() for c in (c2, c3)))
    assert not net.safety_violations()


def test_a_follower_takes_its_leaders_plan_of_the_term_whatever_its_version():
    """Plans are ordered within one leader's history. A follower restarted with a plan of the
    current term that another node made, with a higher version (the files the two-leader bug
    left behind), takes the leader's plan anyway: it used to ignore it for good."""
    net = SimNet(seed=23, durable=True)
    a = net.add("a", 0, [], {**MEMORY, "wants": [WANTED.to_dict()]})
    b = net.add("b", 1, [SimNet.addr(0)], MEMORY)
    assert net.run(15, lambda: net.agreed_leader() == "a" and b.plan_id == a.plan_id
                   and "w" in b.placements())
    term, version = a.plan_id
    net.crash(b)
    net.saved["b"] = dataclasses.replace(net.saved["b"], plan_leader="x",
                                            plan_version=version + 5, placements=())
    b = net.restart(b)
    assert b.plan_id == (term, version + 5) and b.term == term
    assert net.run(5, lambda: b.leader == "a" and b.plan_id == a.plan_id
                   and "w" in b.placements())
    assert a.term == term


# --------------------------------------------------------------------------------------------
# A pinned placement whose nodes are away


def _note(core, model: str) -> str | None:
    """The note of a model's placement in the node's /v1/cluster status."""
    return next(p for p in core.status()["placements"] if p["model"] == model).get("note")


def test_a_pinned_placement_falls_back_while_a_node_is_dead_and_returns():
    net = SimNet(seed=24, durable=True)
    n0 = net.add("n0", 0, [], MEMORY)
    n1 = net.add("n1", 1, [SimNet.addr(0)], MEMORY)
    n2 = net.add("n2", 2, [SimNet.addr(0)], MEMORY)
    assert net.run(15, lambda: net.agreed_leader() == "n0" and net.views_agree())
    m = small_spec("m", "tensor")
    net.send(n1.addr, n1.request_placement(m, ["n1", "n2"], now=net.now))
    assert net.run(5, lambda: n1.request_state(m, ["n1", "n2"]) == COMMITTED
                   and n1.placements().get("m") is not None)
    p = n0.placements()["m"]
    assert p.ring == ("n1", "n2") and p.parallel == "tensor" and p.explicit and not p.note
    net.crash(n2)
    assert net.run(10, lambda: all("n2" not in c.placements()["m"].ring for c in (n0, n1)))
    p = n0.placements()["m"]
    assert p.ring == ("n0", "n1") or p.ring == ("n1", "n0")
    assert p.parallel == "tensor" and p.pinned == ("n1", "n2") and not p.explicit
    note = _note(n1, "m")
    assert note == (f"model m is pinned to n1, n2, but n2 is not alive: placed automatically "
                    f"on {', '.join(p.ring)} until it is back"), note
    assert not n0.placement_errors()
    # The request itself is unchanged: still the one acknowledged, pinned to n1, n2.
    assert n0.holds_request(m, ["n1", "n2"])
    n2 = net.restart(n2)
    assert net.run(15, lambda: all(c.placements()["m"].ring == ("n1", "n2")
                                   for c in (n0, n1, n2)))
    assert n0.placements()["m"].explicit and not _note(n0, "m")


def test_a_node_restarted_alone_serves_its_pinned_tensor_model_and_gives_it_back():
    """The reported case: t1 and t2 hold a tensor-parallel model pinned to them; t2 stops
    (gracefully), then t1 restarts alone. t1 leads (its only other member left) and, instead of
    'cannot place on t2: not alive members', serves the model by itself as a pipeline ring, and
    says so; when t2 comes back the model is a tensor group on t1, t2 again."""
    net = SimNet(seed=25, durable=True)
    t1 = net.add("t1", 1, [], MEMORY)
    t2 = net.add("t2", 2, [SimNet.addr(1)], MEMORY)
    assert net.run(15, lambda: net.agreed_leader() == "t1" and net.views_agree())
    m = small_spec("m", "tensor")
    net.send(t1.addr, t1.request_placement(m, ["t1", "t2"], now=net.now))
    assert net.run(5, lambda: t1.request_state(m, ["t1", "t2"]) == COMMITTED)
    assert t1.placements()["m"].ring == ("t1", "t2")
    net.send(t2.addr, t2.leave(net.now))
    net.run(0.5)
    net.crash(t2)
    net.crash(t1)
    t1 = net.restart(t1)
    assert t1.membership.roster() == (KnownMember("t2", t2.addr, left=True),)
    assert net.run(2, lambda: t1.is_leader and t1.placements()["m"].ring == ("t1",))
    p = t1.placements()["m"]
    assert p.parallel == "pipeline" and p.pinned == ("t1", "t2") and not t1.placement_errors()
    assert _note(t1, "m") == (
        "model m is pinned to t1, t2, but t2 is not alive: placed automatically on t1 as a "
        "pipeline ring (a tensor-parallel group does not fit the nodes alive) until it is back")
    t2 = net.restart(t2)
    assert net.run(15, lambda: all(c.placements().get("m") is not None
                                   and c.placements()["m"].ring == ("t1", "t2")
                                   for c in (t1, t2)))
    assert t1.placements()["m"].parallel == "tensor" and not _note(t1, "m")
    assert not net.safety_violations()


def test_a_pinned_request_naming_a_node_the_cluster_never_knew_stays_an_error():
    net = SimNet(seed=26)
    solo = net.add("solo", 0, [], MEMORY)
    assert net.run(2, lambda: solo.is_leader)
    m = small_spec("m")
    net.send(solo.addr, solo.request_placement(m, ["nobody"], now=net.now))
    net.run(0.5)
    assert "m" not in solo.placements()
    assert "cannot place on nobody: not alive members" in solo.placement_errors()["m"]["error"]


def test_the_state_file_keeps_the_members_and_the_plans_leader(tmp_path):
    path = state_path(tmp_path, "n0")
    st = DurableState("n0", term=3, voted_for="n1", plan_term=3, plan_version=4, committed=4,
                      plan_leader="n1", members=(KnownMember("n1", "10.0.0.1:1"),
                                                 KnownMember("n2", "10.0.0.2:1", left=True)))
    save_state(path, st, "c1")
    assert load_state(path, "n0", "c1") == st
    # A file written before members were saved: a node that knew nobody.
    old = durable.to_json(DurableState("n0", term=3), "c1").replace(b'"members": [],', b"")
    assert b"members" not in old
    assert durable.from_json(old).members == ()


def test_a_restored_node_logs_the_fallback_of_its_pinned_placement(tmp_path, caplog):
    """One real node on its state file (the reported case through the node's I/O): its only
    other member left, so it leads at once, and its log says why the pinned model is where it
    is."""
    from skulkp2p.cluster.config import NodeConfig
    from skulkp2p.cluster.node import ClusterNode
    from tests.helpers.procs import free_port

    m = small_spec("m", "tensor")
    node_cfg = NodeConfig("t1", port=free_port(), memory_limit=4_000_000_000,
                          state_file=state_path(tmp_path, "t1"))
    node = ClusterNode(node_cfg)
    save_state(node_cfg.state_file, DurableState(
        "t1", term=4, voted_for="t1", plan_term=4, plan_version=2, committed=2,
        plan_leader="t1", requests=({"spec": m.to_dict(), "nodes": ["t1", "t2"]},),
        members=(KnownMember("t2", "127.0.0.1:9", left=True),)), durable.cluster_id(node.key))

    async def run() -> None:
        await node.start()
        try:
            deadline = time.monotonic() + 10
            while not (node.core.is_leader and "m" in node.core.placements()):
                assert time.monotonic() < deadline, node.core.status()
                await asyncio.sleep(0.02)
            assert node.core.term == 5 and node.core.election.role == LEADER
            await asyncio.sleep(0.1)  # (the node logs after its step)
        finally:
            await node.close(leave=False)

    with caplog.at_level(logging.INFO, logger="skulkp2p.cluster"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert any("model m is pinned to t1, t2, but t2 is not alive: placed automatically on t1"
               in line for line in lines), lines
    assert any("1 other member" in line for line in lines), lines


# --------------------------------------------------------------------------------------------
# Real processes


def _chat(c: ProcCluster, i: int) -> int:
    try:
        status, _, _ = call(c.nodes[i].http, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2, "temperature": 0}, timeout=20)
    except OSError:
        return 0
    return status


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.skipif(not loopback_ips_usable(),
                    reason="needs the 127.0.0.0/8 loopback range (Linux)")
def test_three_joins_restarted_after_a_failover_all_serve_again(tmp_path, tiny_models):
    """The reported cluster with real agents: c1 (n0) founds it, n1 and n2 join through it,
    each with its own data dir; n0 is killed -9 and a new leader is elected; n1 and n2 are
    stopped; all three start again with the same flags. Within a bound every node answers a
    chat request with 200 (before the fix n0 took the new leader's term again and the other two
    answered 503 for good)."""
    c = ProcCluster(tmp_path)
    model = str(tiny_models["llama"])

    def start(i: int) -> None:
        c.start_join(i, model, args=["--memory-limit", "2GB",
                                     "--data-dir", str(tmp_path / f"data-n{i}")])

    try:
        for i in range(3):
            start(i)
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and s["leader"] == "n0" and s["placements"],
               90, "3 joins to agree on n0 and a placement")
        assert c.status(1)["state_file"] == str(tmp_path / "data-n1" / "cluster" / "n1.json")
        c.signal(0, signal.SIGKILL)
        c.nodes[0].proc.wait(10)
        c.wait(lambda: (s := c.agreed([1, 2])) and s["leader"] in ("n1", "n2"), 60,
               "n1 and n2 to elect a new leader")
        term = max(c.status(i)["term"] for i in (1, 2))
        for i in (1, 2):
            c.signal(i, signal.SIGTERM)
            c.nodes[i].proc.wait(30)
        for i in range(3):
            start(i)
        took = c.wait(lambda: all(_chat(c, i) == 200 for i in range(3)), 120,
                      "every restarted node to answer a chat request with 200")
        sts = [c.status(i) for i in range(3)]
        assert len({(s["leader"], s["term"]) for s in sts}) == 1, sts
        assert sts[0]["term"] > term, "a node took a term that was won before the restart"
        print(f"all three serve {took:.1f} s after the restart")
    finally:
        c.close()
