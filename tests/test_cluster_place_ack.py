"""POST /v1/cluster/place is acknowledged only once a majority of the voters hold the request:
three `join` processes on 127.0.0.x; with one follower killed the other still makes a majority
(200, and it holds the placement when the 200 comes); with the second one frozen too the leader
alone cannot confirm it (503 placement_unconfirmed, within the bound). Every pid is killed at
the end (ProcCluster.close)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.helpers.http_client import call, status_of
from tests.helpers.procs import ProcCluster, loopback_ips_usable

pytestmark = pytest.mark.skipif(not loopback_ips_usable(),
                                reason="needs the 127.0.0.0/8 loopback range (Linux)")


@pytest.mark.cluster
@pytest.mark.slow
def test_place_is_acknowledged_with_two_of_three_and_refused_with_one(tmp_path, tiny_models):
    # A leader lease (the election timeout) longer than the place request's 5 s bound: the
    # lone leader of step 3 still leads when its answer comes, so the answer is about the
    # missing majority, not about a lost leader.
    c = ProcCluster(tmp_path, env={"SKULKP2P_TIMERS": "election=8"})
    try:
        for i in range(3):
            c.start_join(i, str(tiny_models["llama"]), args=["--memory-limit", "2GB"])
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and s["placements"], 90,
               "3 joins to agree on a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90,
               "every node to answer /health with 200")
        assert c.agreed([0, 1, 2])["leader"] == "n0"
        qwen = str(tiny_models["qwen3"])

        # 1. n2 is killed: n0 (leader) and n1 are 2 of 3, a majority. Asked through n1.
        c.signal(2, signal.SIGKILL)
        c.nodes[2].proc.wait(10)
        status, _, body = call(c.nodes[1].http, "POST", "/v1/cluster/place",
                               {"model": qwen, "nodes": ["n1"]})
        assert status == 200, body
        assert body["placement"]["ring"] == ["n1"] and body["leader"] == "n0"
        # Acknowledged means held: both of the majority have it now, not just eventually.
        for i in (0, 1):
            st = c.status(i)
            assert any(p["model"] == "qwen3" and p["ring"] == ["n1"]
                       for p in st["placements"]), (i, st["placements"])
            assert st["plan"]["committed"] is not None, st["plan"]

        # 2. n1 freezes: the leader alone is 1 of 3. Moving qwen3 to n0 is planned, never
        #    confirmed: a clear 503 within the bound, not a hang and not a 200.
        c.signal(1, signal.SIGSTOP)
        t0 = time.monotonic()
        status, headers, body = call(c.nodes[0].http, "POST", "/v1/cluster/place",
                                     {"model": "qwen3", "nodes": ["n0"]}, timeout=30)
        waited = time.monotonic() - t0
        assert status == 503, body
        err = body["error"]
        assert err["code"] == "placement_unconfirmed" and headers.get("retry-after")
        assert "not confirmed by a majority" in err["message"], err
        assert "(1 of 3 hold it)" in err["message"] and "may still take effect" in err["message"]
        assert waited < 20, waited
        # 3. n1 thaws: the majority is back, the same request is acknowledged.
        c.signal(1, signal.SIGCONT)
        status, _, body = call(c.nodes[0].http, "POST", "/v1/cluster/place",
                               {"model": "qwen3", "nodes": ["n0"]}, timeout=30)
        assert status == 200, body
        assert body["placement"]["ring"] == ["n0"]
    finally:
        c.close()
