"""Cluster nodes as real processes on 127.0.0.x: convergence, crash and hang detection,
failover, partitions through a fault-injecting proxy, garbage on the wire, secrets.

Every test is bounded in time and kills every pid it started (ProcCluster.close)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from skulkp2p import wire
from tests.helpers import ROOT
from tests.helpers.procs import SECRET, ProcCluster, loopback_ips_usable

pytestmark = pytest.mark.skipif(not loopback_ips_usable(),
                                reason="needs the 127.0.0.0/8 loopback range (Linux)")


@pytest.fixture
def cluster(tmp_path):
    c = ProcCluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def proxied(tmp_path):
    c = ProcCluster(tmp_path, proxy=True)
    try:
        yield c
    finally:
        c.close()


def _member_state(st, name):
    return next((m["state"] for m in st["members"] if m["name"] == name), None) if st else None


@pytest.mark.cluster
def test_three_nodes_converge_and_memory_limit_splits_a_model(cluster):
    # smollm2-135m needs about 540 MB (bf16 weights x 1.3 + KV for 8k tokens): with 300 MB
    # each, the smallest ring is two nodes, layers split in proportion.
    cluster.start_many(3, args=["--memory-limit", "300MB", "--model", "smollm2-135m"])
    cluster.wait(lambda: cluster.agreed([0, 1, 2]), 20, "3 nodes to agree")
    st = cluster.agreed([0, 1, 2])
    assert [m["name"] for m in st["members"]] == ["n0", "n1", "n2"]
    assert all(m["state"] == "alive" and m["memory"] == 300_000_000 for m in st["members"])
    assert all("mlx-cpu" in m["engines"] or sys.platform != "linux" for m in st["members"])
    cluster.wait(lambda: all((s or {}).get("placements") for s in cluster.statuses().values()),
                 10, "a placement everywhere")
    places = {str(s["placements"]) for s in cluster.statuses().values()}
    assert len(places) == 1
    (p,) = cluster.status(0)["placements"]
    assert p["model"] == "smollm2-135m" and len(p["ring"]) == 2
    assert p["layers"] == [[0, 15], [15, 30]]


@pytest.mark.cluster
@pytest.mark.slow
def test_five_nodes_converge_then_leader_kill_elects_and_replaces(cluster):
    nodes = cluster.start_many(5, args=["--memory-limit", "700MB"])
    cluster.wait(lambda: cluster.agreed(list(range(5))), 25, "5 nodes to agree")
    extra = cluster.start(5, args=["--memory-limit", "700MB", "--model", "smollm2-135m"])
    everyone = list(range(6))
    cluster.wait(lambda: (st := cluster.agreed(everyone)) and st["placements"], 20,
                 "6 nodes to agree on a placement")
    st = cluster.agreed(everyone)
    leader = st["leader"]
    term = st["term"]
    li = next(n.index for n in nodes + [extra] if n.name == leader)
    # The leader's placement or not, it must end up on a live node.
    cluster.signal(li, signal.SIGKILL)
    survivors = [i for i in everyone if i != li]
    elected = cluster.wait(lambda: (s := cluster.agreed(survivors)) and s["leader"] != leader
                           and s["term"] > term, 15, "a new leader")
    dead = cluster.wait(lambda: all(_member_state(cluster.status(i), leader) == "dead"
                                    for i in survivors), 15, "the old leader declared dead")
    cluster.wait(lambda: (s := cluster.agreed(survivors)) and s["placements"]
                 and leader not in s["placements"][0]["ring"], 10, "a placement on live nodes")
    print(f"new leader {elected:.1f}s after kill -9; old one dead {elected + dead:.1f}s after")
    assert elected < 10


@pytest.mark.cluster
def test_sigstop_suspect_then_dead_and_sigcont_rejoins_without_unseating(cluster):
    cluster.start_many(4)
    everyone = [0, 1, 2, 3]
    cluster.wait(lambda: cluster.agreed(everyone), 20, "4 nodes to agree")
    st = cluster.agreed(everyone)
    leader, term = st["leader"], st["term"]
    victim = next(i for i in everyone if f"n{i}" != leader)
    others = [i for i in everyone if i != victim]
    cluster.signal(victim, signal.SIGSTOP)
    try:
        t_suspect = cluster.wait(lambda: any(_member_state(cluster.status(i), f"n{victim}")
                                             == "suspect" for i in others), 10, "suspicion")
        t_dead = cluster.wait(lambda: all(_member_state(cluster.status(i), f"n{victim}")
                                          == "dead" for i in others), 15, "declared dead")
        time.sleep(2)  # well past its own election timeout, frozen
    finally:
        cluster.signal(victim, signal.SIGCONT)
    cluster.wait(lambda: cluster.agreed(everyone), 15, "the paused node to rejoin")
    st = cluster.agreed(everyone)
    assert st["leader"] == leader and st["term"] == term
    assert all(m["state"] == "alive" for m in st["members"])
    print(f"SIGSTOP: suspect after {t_suspect:.1f}s, dead after {t_suspect + t_dead:.1f}s")


@pytest.mark.cluster
@pytest.mark.slow
def test_partition_minority_has_no_leader_and_healing_restores_one(proxied):
    c = proxied
    c.start_many(5, args=["--memory-limit", "700MB", "--model", "smollm2-135m"])
    everyone = list(range(5))
    c.wait(lambda: (s := c.agreed(everyone)) and s["placements"], 25, "5 nodes to agree")
    st = c.agreed(everyone)
    leader = int(st["leader"][1:])
    # The leader and one more on the small side.
    minority = [leader, next(i for i in everyone if i != leader)]
    majority = [i for i in everyone if i not in minority]
    c.proxy.partition([c.ip(i) for i in minority], [c.ip(i) for i in majority])
    c.wait(lambda: all((s := c.status(i)) and s["leader"] is None for i in minority), 10,
           "the minority to lose its leader")
    c.wait(lambda: (s := c.agreed(majority)) is not None and s["term"] > st["term"], 15,
           "the majority to elect")
    time.sleep(3)  # a long partition: the minority still has no leader and no placements
    for i in minority:
        s = c.status(i)
        assert s["leader"] is None and s["placements"] == []
    c.proxy.heal()
    c.wait(lambda: (s := c.agreed(everyone)) and all(m["state"] == "alive"
                                                     for m in s["members"]), 30,
           "one leader again after healing")


@pytest.mark.cluster
def test_live_node_survives_garbage_and_counts_it(cluster):
    node = cluster.start(0)
    cluster.wait(lambda: cluster.status(0), 10, "the node to answer")
    rng = random.Random(7)
    key = wire.frame_key(SECRET)
    good = wire.encode_frame({"t": "ping", "seq": 1, "from": "x", "addr": "127.0.0.1:9"}, key)
    payloads = [
        rng.randbytes(5000),  # noise
        wire.encode_frame({"t": "sync", "from": "evil", "addr": "1.2.3.4:5", "members": []},
                          wire.frame_key("wrong")),  # a stranger
        wire.HEADER.pack(1 << 31),  # an oversize header
        good[:len(good) // 2],  # a frame cut short, then EOF
        good[:4] + b"\0" * 32 + good[36:],  # unsigned (zeroed tag)
    ]
    for data in payloads:
        with socket.create_connection((node.ip, node.port), timeout=2) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(2)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
    st = cluster.status(0)
    assert st is not None and node.proc.poll() is None
    assert st["metrics"]["wire_errors"] >= len(payloads)
    assert st["members"] == [m for m in st["members"] if m["name"] == "n0"]  # nobody joined


@pytest.mark.process
def test_no_secret_refuses_a_non_loopback_listener(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SKULKP2P_SECRET"}
    r = subprocess.run([sys.executable, "-m", "skulkp2p.cluster.node", "--host", "0.0.0.0",
                        "--port", "0", "--data-dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 1
    assert "refusing to listen on 0.0.0.0 without a cluster secret" in r.stderr
    assert "SKULKP2P_SECRET" in r.stderr


@pytest.mark.cluster
def test_no_secret_on_loopback_works(tmp_path):
    c = ProcCluster(tmp_path, env={"SKULKP2P_SECRET": ""})
    try:
        c.start_many(2)
        from skulkp2p.cluster.status_client import fetch_status

        def agreed():
            try:
                sts = [fetch_status(f"{n.ip}:{n.port}", None, 1) for n in c.nodes.values()]
            except (OSError, TimeoutError, ValueError):
                return False
            return len({s["leader"] for s in sts}) == 1 and sts[0]["leader"] and \
                all(len(s["members"]) == 2 for s in sts)

        c.wait(agreed, 20, "2 nodes without a secret to agree")
    finally:
        c.close()


@pytest.mark.cluster
def test_graceful_leave_stops_counting_towards_quorum(cluster):
    """Two of three nodes stop with SIGTERM (they say goodbye): the last one still leads,
    because members that left do not count; a kill -9 would have left it without quorum."""
    cluster.start_many(3)
    cluster.wait(lambda: cluster.agreed([0, 1, 2]), 20, "3 nodes to agree")
    for i in (1, 2):
        cluster.signal(i, signal.SIGTERM)
        assert cluster.nodes[i].proc.wait(10) == 0
    cluster.wait(lambda: (s := cluster.status(0)) and s["leader"] == "n0"
                 and [m["state"] for m in s["members"]] == ["alive", "left", "left"], 15,
                 "n0 to lead alone")
