"""LAN discovery (cluster/discovery.py): the cluster tag, which interfaces it uses, when it runs,
its flags, the membership's way in for a found node; and, across network namespaces this test
makes itself (tests/helpers/netns.py), `join` nodes that share a secret finding each other over
real mDNS with no --peer, serving a request, ignoring a node of another secret, and seeing a node
that leaves go. Every pid and namespace is removed at the end, whatever happens."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skulkp2p.cluster.config import (
    ClusterConfigError,
    NodeConfig,
    add_cluster_arguments,
    config_from_args,
)
from skulkp2p.cluster.discovery import (
    SERVICE_TYPE,
    Discovery,
    Interface,
    choose_interfaces,
    cluster_tag,
    discovery_wanted,
    left_out,
    reachable_addr,
)
from skulkp2p.cluster.membership import Membership
from tests.helpers import ROOT
from tests.helpers.netns import Lan, call, netns_unusable

# ---------------------------------------------------------------- the tag


def test_the_tag_is_an_hmac_of_the_secret_and_shows_nothing_of_it():
    secret = "correct horse battery staple"
    tag = cluster_tag(secret)
    want = hmac.new(secret.encode(), b"skulkp2p discovery tag", hashlib.sha256).hexdigest()[:16]
    assert tag == want and len(tag) == 16 and int(tag, 16) >= 0
    assert cluster_tag(secret) == tag  # every node of the cluster computes the same
    assert cluster_tag(secret + "!") != tag and cluster_tag("") != tag
    assert secret not in tag and secret.encode().hex() not in tag


# ---------------------------------------------------------------- interfaces

LAPTOP = [
    Interface("lo", ("127.0.0.1",), loopback=True),
    Interface("eth0", ("192.168.1.20",)),
    Interface("wlan0", ("192.168.1.21",)),
    Interface("eth1", ("10.0.0.5",), up=False),
    Interface("enp3s0", ()),
    Interface("ib0", ("10.9.0.1",), multicast=False),
    Interface("docker0", ("172.17.0.1",)),
    Interface("br-1a2b3c", ("172.18.0.1",)),
    Interface("veth9f8e7d", ("169.254.1.1",)),
    Interface("virbr0", ("192.168.122.1",)),
    Interface("tun0", ("10.8.0.2",)),
    Interface("wg0", ("10.66.0.2",)),
    Interface("tailscale0", ("100.101.102.103",)),
    Interface("utun3", ("10.7.0.1",)),
]


def test_the_default_choice_is_the_lan_interfaces():
    chosen = choose_interfaces(LAPTOP, "0.0.0.0")
    assert [i.name for i in chosen] == ["eth0", "wlan0"]
    why = {i.name: left_out(i) for i in LAPTOP}
    assert why["lo"] == "loopback"
    assert {why[n] for n in ("docker0", "br-1a2b3c", "veth9f8e7d", "virbr0")} == {
        "a container or VM bridge"}
    assert {why[n] for n in ("tun0", "wg0", "tailscale0", "utun3")} == {"a VPN or tunnel link"}
    assert why["eth1"] == "down" and why["ib0"] == "not multicast-capable"
    assert why["enp3s0"] == "no IPv4 address"
    assert why["eth0"] is None and why["wlan0"] is None


def test_a_bound_address_picks_its_interface():
    assert [i.name for i in choose_interfaces(LAPTOP, "192.168.1.21")] == ["wlan0"]
    # Bound where the default would not look (the user chose it): that interface all the same.
    assert [i.name for i in choose_interfaces(LAPTOP, "100.101.102.103")] == ["tailscale0"]
    # An address on no interface (a NAT's, say): the LAN interfaces.
    assert [i.name for i in choose_interfaces(LAPTOP, "203.0.113.9")] == ["eth0", "wlan0"]


def test_named_interfaces_win_and_unknown_ones_fail_clearly():
    assert [i.name for i in choose_interfaces(LAPTOP, "0.0.0.0", ["wg0", "eth0", "wg0"])] == [
        "wg0", "eth0"]
    assert [i.name for i in choose_interfaces(LAPTOP, "0.0.0.0", ["lo"])] == ["lo"]
    with pytest.raises(ClusterConfigError, match="--discovery-interface eth7: no such interface"
                                                 r".*eth0"):
        choose_interfaces(LAPTOP, "0.0.0.0", ["eth7"])
    with pytest.raises(ClusterConfigError, match="enp3s0: it has no IPv4 address"):
        choose_interfaces(LAPTOP, "0.0.0.0", ["enp3s0"])


def test_loopback_only_when_there_is_nothing_else():
    lonely = [Interface("lo", ("127.0.0.1",), loopback=True), Interface("docker0", ("172.17.0.1",))]
    assert [i.name for i in choose_interfaces(lonely, "0.0.0.0")] == ["lo"]
    assert choose_interfaces([Interface("docker0", ("172.17.0.1",))], "0.0.0.0") == []


def test_a_wildcard_bind_is_advertised_on_a_discovery_interface():
    eth0 = [Interface("eth0", ("192.168.1.20",))]
    # The hostname resolved to Debian's 127.0.1.1, or to an address on another link.
    assert reachable_addr("127.0.1.1:52416", "0.0.0.0", eth0) == "192.168.1.20:52416"
    assert reachable_addr("172.17.0.1:52416", "::", eth0) == "192.168.1.20:52416"
    assert reachable_addr("192.168.1.20:52416", "0.0.0.0", eth0) == "192.168.1.20:52416"
    # A bound address is what it is.
    assert reachable_addr("10.0.0.5:52416", "10.0.0.5", eth0) == "10.0.0.5:52416"


# ---------------------------------------------------------------- when it runs, and its flags


def _config(*argv: str) -> NodeConfig:
    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    p.add_argument("--data-dir")
    return config_from_args(p.parse_args(["--no-cluster-state", *argv]))


def test_discovery_runs_only_with_a_secret_off_loopback(monkeypatch):
    monkeypatch.delenv("SKULKP2P_SECRET", raising=False)
    assert not discovery_wanted(_config())  # the default: loopback, no secret
    assert not discovery_wanted(_config("--secret", "s"))  # a secret, still loopback
    assert not discovery_wanted(_config("--secret", "s", "--host", "localhost"))
    on = _config("--secret", "s", "--host", "0.0.0.0")
    assert discovery_wanted(on) and on.discovery_interfaces == [] and on.discovery_wait == 3.0
    assert not discovery_wanted(_config("--secret", "s", "--host", "0.0.0.0", "--no-discovery"))
    picked = _config("--secret", "s", "--host", "10.1.2.3", "--discovery-interface", "eth0",
                     "--discovery-interface", "eth1", "--discovery-wait", "0.5")
    assert discovery_wanted(picked) and picked.discovery_interfaces == ["eth0", "eth1"]
    assert picked.discovery_wait == 0.5
    # A node built in code (tests, benches) does no mDNS unless asked.
    assert not discovery_wanted(NodeConfig("a", host="0.0.0.0", secret="s"))


def test_contradicting_discovery_flags_fail():
    with pytest.raises(ClusterConfigError, match="--no-discovery and --discovery-interface"):
        _config("--secret", "s", "--no-discovery", "--discovery-interface", "eth0")
    with pytest.raises(ClusterConfigError, match="--discovery-wait -1"):
        _config("--secret", "s", "--discovery-wait", "-1")


# ---------------------------------------------------------------- what it makes of a service


def _instance(label: str) -> str:
    return f"{label}.{SERVICE_TYPE}"


def test_found_moved_ignored_and_lost_are_each_said_once(caplog):
    """The browser's events and the records they resolve to (fed to ``resolved`` as zeroconf's
    resolution hands them over): what is logged, counted, listed and handed to the join."""
    from zeroconf import ServiceStateChange

    caplog.set_level(logging.INFO, logger="skulkp2p.cluster")
    tag = cluster_tag("s")

    async def run() -> None:
        joined: list[str] = []
        d = Discovery(name="n0", addr="10.0.0.1:52416", secret="s", interfaces=[],
                      on_found=joined.append)

        def event(label: str, change: ServiceStateChange) -> None:
            d.on_service_change(None, SERVICE_TYPE, _instance(label), change)

        for label in ("n1", "n3", "n4", "twin", "me-old", "nameless"):
            event(label, ServiceStateChange.Added)  # (not started: nothing to resolve)
        assert await d.first_peers(0) == []
        n1 = {"v": "1", "tag": tag, "name": "n1", "addr": "10.0.0.2:52416"}
        d.resolved(_instance("n1"), n1)
        d.resolved(_instance("n1"), n1)  # its records again: nothing new
        assert joined == ["10.0.0.2:52416"] and await d.first_peers(5) == ["10.0.0.2:52416"]
        d.resolved(_instance("n1"), {**n1, "addr": "10.0.0.9:52416"})  # moved
        assert joined == ["10.0.0.2:52416", "10.0.0.9:52416"]
        other = {"v": "1", "tag": cluster_tag("t"), "name": "n3", "addr": "10.0.0.4:52416"}
        d.resolved(_instance("n3"), other)
        d.resolved(_instance("n3"), other)
        d.resolved(_instance("n4"), {"v": "1", "name": "n4", "addr": "10.0.0.5:52416"})  # no tag
        d.resolved(_instance("twin"), {"tag": tag, "name": "n0", "addr": "10.0.0.6:52416"})
        d.resolved(_instance("me-old"), {"tag": tag, "name": "n0", "addr": "10.0.0.1:52416"})
        # No address in the TXT record: the SRV record's; the instance label names it.
        d.resolved(_instance("nameless"), {"tag": tag}, "10.0.0.7:52416")
        d.resolved(_instance("gone"), n1)  # never listed (or removed meanwhile): nothing
        assert joined == ["10.0.0.2:52416", "10.0.0.9:52416", "10.0.0.7:52416"]
        view = d.view()
        assert [(p["name"], p["addr"]) for p in view] == [("n1", "10.0.0.9:52416"),
                                                          ("nameless", "10.0.0.7:52416")]
        assert all(p["last_seen"] >= p["first_seen"] > 0 for p in view)
        event("n1", ServiceStateChange.Removed)
        event("n1", ServiceStateChange.Removed)
        event("n3", ServiceStateChange.Removed)  # an ignored one goes quietly
        assert [p["name"] for p in d.view()] == ["nameless"]
        assert d.metrics == {"discovery_found": 2, "discovery_lost": 1, "discovery_ignored": 3}
        await d.close()

    asyncio.run(run())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("discovery:")]
    assert said == [
        "discovery: found n1 at 10.0.0.2:52416",
        "discovery: n1 is now at 10.0.0.9:52416 (was n1 at 10.0.0.2:52416)",
        "discovery: ignoring n3 at 10.0.0.4:52416: another cluster (another secret)",
        "discovery: ignoring n4 at 10.0.0.5:52416: another cluster (another secret)",
        "discovery: ignoring n0 at 10.0.0.6:52416: it has this node's name",
        "discovery: found nameless at 10.0.0.7:52416",
        "discovery: lost n1 at 10.0.0.9:52416 (it withdrew its service, or its records "
        "expired)",
    ]


# ---------------------------------------------------------------- the way in for a found node


def test_a_found_node_becomes_a_seed_and_is_sent_our_members():
    a = Membership("a", "10.0.0.1:52416")  # a founder: no seeds
    assert a.bootstrapped and a.seeds == []
    ((dest, msg),) = a.add_seed("10.0.0.2:52416")
    assert dest == "10.0.0.2:52416" and a.seeds == ["10.0.0.2:52416"]
    assert msg["t"] == "sync" and msg["reply"] and msg["seed"] == "10.0.0.2:52416"
    assert a.add_seed("10.0.0.1:52416") == []  # itself
    # The found node answers: the two know each other; found again, nothing more is sent.
    b = Membership("b", "10.0.0.2:52416")
    for d, m in b.on_message(msg, 0.0):
        assert d == "10.0.0.1:52416"
        a.on_message(m, 0.0)
    assert a.names("alive") == ["a", "b"] and b.names("alive") == ["a", "b"]
    assert a.add_seed("10.0.0.2:52416") == [] and a.seeds == ["10.0.0.2:52416"]


def test_a_joiner_that_finds_a_seed_later_bootstraps_through_it():
    c = Membership("c", "10.0.0.3:52416", seeds=["10.0.0.9:52416"])  # a dead seed
    assert not c.bootstrapped
    ((dest, msg),) = c.add_seed("10.0.0.1:52416")
    a = Membership("a", "10.0.0.1:52416")
    for _d, m in a.on_message(msg, 0.0):
        c.on_message(m, 0.0)
    assert c.bootstrapped and c.names("alive") == ["a", "c"]


# ---------------------------------------------------------------- real nodes on a LAN of namespaces

SECRET = "discovery-test-secret"
OTHER_SECRET = "another-cluster-secret"
HTTP_PORT = 52415  # each namespace has its own ports
CHAT = [{"role": "user", "content": "Say something about dogs."}]


@pytest.fixture
def lan():
    reason = netns_unusable()
    if reason is not None:
        pytest.skip(f"needs network namespaces: {reason}")
    made = Lan()
    try:
        yield made
    finally:
        made.close()
        assert made.leftovers() == []


class _Nodes:
    """`join` processes, one per namespace host; every pid killed by ``close``."""

    def __init__(self, lan: Lan, tmp: Path, model: str):
        self.lan, self.tmp, self.model = lan, tmp, model
        self.procs: dict[int, subprocess.Popen] = {}
        self.stopped: set[int] = set()  # stopped on purpose: their exit is no failure

    def start(self, i: int, secret: str, *extra: str) -> None:
        host = self.lan.host(i)
        argv = [sys.executable, "-m", "skulkp2p", "join", "--model", self.model,
                "--name", f"n{i}", "--host", "0.0.0.0", "--http-host", host.ip,
                "--http-port", str(HTTP_PORT), "--insecure-http", "--memory-limit", "2GB",
                "--data-dir", str(self.tmp / "data"), *extra]
        env = {**os.environ, "SKULKP2P_SECRET": secret, "PYTHONUNBUFFERED": "1"}
        with open(self.log(i), "ab") as out:
            self.procs[i] = subprocess.Popen(self.lan.exec_argv(i, argv), stdout=out,
                                             stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def log(self, i: int) -> Path:
        return self.tmp / f"n{i}.log"

    def text(self, i: int) -> str:
        return self.log(i).read_text(errors="replace")

    def cluster(self, i: int) -> dict | None:
        try:
            status, body = call(self.lan.hosts[i], HTTP_PORT, "GET", "/v1/cluster", timeout=5)
        except OSError:
            return None
        return body if status == 200 and isinstance(body, dict) else None

    def health(self, i: int) -> int | None:
        try:
            return call(self.lan.hosts[i], HTTP_PORT, "GET", "/health", timeout=5)[0]
        except OSError:
            return None

    def wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, p in self.procs.items():
                assert p.poll() is None or i in self.stopped, \
                    f"n{i} exited with {p.returncode}:\n{self.text(i)[-3000:]}"
            if pred():
                return
            time.sleep(0.2)
        logs = "\n".join(f"--- n{i}\n{self.text(i)[-2500:]}" for i in self.procs)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                pass


def _one_cluster(nodes: _Nodes, among: list[int]) -> list[dict] | None:
    """The statuses of ``among`` when they have formed one cluster of just themselves (every
    one ``_formed``) under one leader in one term; else None."""
    sts = [nodes.cluster(i) for i in among]
    names = [f"n{i}" for i in among]
    formed = [st for st in sts if st is not None and _formed(st, names)]
    if len(formed) < len(among):
        return None
    return formed if len({(st["leader"], st["term"]) for st in formed}) == 1 else None


def _formed(st: dict | None, names: list[str]) -> bool:
    """``st`` shows exactly ``names`` alive, under a leader among them, and has discovered
    every other one of them (and nobody else)."""
    if st is None or st.get("leader") not in names:
        return False
    members = {m["name"]: m["state"] for m in st["members"]}
    found = sorted(d["name"] for d in st.get("discovered", []))
    return members == dict.fromkeys(names, "alive") and found == sorted(
        n for n in names if n != st["node"])


@pytest.mark.cluster
@pytest.mark.slow
def test_nodes_of_one_secret_find_each_other_on_the_lan(lan, tmp_path, tiny_models):
    nodes = _Nodes(lan, tmp_path, str(tiny_models["llama"]))
    try:
        for i in range(3):
            nodes.start(i, SECRET)
        nodes.start(3, OTHER_SECRET)
        # 1. No --peer anywhere: the three form one cluster, each listing all three alive
        #    and the other two as discovered.
        nodes.wait(lambda: _one_cluster(nodes, [0, 1, 2]), 120,
                   "n0, n1 and n2 to form one cluster through discovery")
        sts = _one_cluster(nodes, [0, 1, 2]) or []
        for st in sts:
            for d in st["discovered"]:
                i = int(d["name"][1:])
                assert d["addr"] == f"{lan.hosts[i].ip}:52416"  # advertised on eth0
                assert d["last_seen"] >= d["first_seen"] > time.time() - 600
            member = {m["name"]: m for m in st["members"]}
            assert member[st["node"]]["addr"] == st["addr"]
        # 2. The node of another secret stays apart: a cluster of its own, nobody discovered;
        #    the others ignore it (said once) and never list it.
        nodes.wait(lambda: _formed(nodes.cluster(3), ["n3"]), 60, "n3 to lead a cluster alone")
        assert all("n3" not in {m["name"] for m in nodes.cluster(i)["members"]}
                   for i in range(3))
        nodes.wait(lambda: all("discovery: ignoring n3 at 10.77.0.4:52416: another cluster"
                               in nodes.text(i) for i in range(3)), 30,
                   "the three to say they ignore n3")
        assert nodes.text(0).count("ignoring n3") == 1
        assert "found n1 at 10.77.0.2:52416" in nodes.text(0)
        assert "ignoring n0" in nodes.text(3) and "founding one" in nodes.text(3)
        # 3. The cluster serves a request through any node (forwarded where it is placed).
        nodes.wait(lambda: all(nodes.health(i) == 200 for i in range(3)), 120,
                   "every node to answer /health with 200 (the model loaded where placed)")
        status, body = call(lan.hosts[1], HTTP_PORT, "POST", "/v1/chat/completions",
                            {"messages": CHAT, "max_tokens": 8, "temperature": 0}, timeout=120)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] is not None
        # 4. n2 leaves (SIGTERM): the others see it leave the cluster and the LAN.
        nodes.stopped.add(2)
        nodes.procs[2].send_signal(signal.SIGTERM)
        assert nodes.procs[2].wait(60) == 0

        def n2_gone(i: int) -> bool:
            st = nodes.cluster(i)
            return st is not None and {m["name"]: m["state"] for m in st["members"]}.get(
                "n2") == "left" and "n2" not in {d["name"] for d in st["discovered"]}

        nodes.wait(lambda: n2_gone(0) and n2_gone(1), 30, "n0 and n1 to see n2 leave")
        assert nodes.text(0).count("discovery: lost n2 at 10.77.0.3:52416") == 1
        secret_seen = [i for i in range(4) if SECRET in nodes.text(i) or OTHER_SECRET in
                       nodes.text(i)]
        assert secret_seen == [], "a secret appeared in a log"
    finally:
        nodes.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_founders_that_find_each_other_later_merge(lan, tmp_path, tiny_models):
    """With no time to look before founding (--discovery-wait 0), each node founds a cluster
    of its own and leads it; found a moment later, they merge into one cluster, which serves."""
    nodes = _Nodes(lan, tmp_path, str(tiny_models["llama"]))
    try:
        for i in range(3):
            nodes.start(i, SECRET, "--discovery-wait", "0")
        nodes.wait(lambda: _one_cluster(nodes, [0, 1, 2]), 120,
                   "the three founders to merge into one cluster")
        assert all("founding one" in nodes.text(i) for i in range(3))
        nodes.wait(lambda: all(nodes.health(i) == 200 for i in range(3)), 120,
                   "every node to answer /health with 200")
        status, body = call(lan.hosts[0], HTTP_PORT, "POST", "/v1/chat/completions",
                            {"messages": CHAT, "max_tokens": 8, "temperature": 0}, timeout=120)
        assert status == 200, body
    finally:
        nodes.close()
