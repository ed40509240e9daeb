"""The dashboard, /metrics and /v1/stats on real `join` processes (two nodes on 127.0.0.x, the
tiny model split into a ring of both), read by prometheus_client's parser and by a real headless
Chromium; and the single-node app's routes with the worker's outcomes (ok, error, cancelled).
Every pid started here is killed at the end (ProcCluster.close, Browser.close)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.browser import Browser, chromium_binary
from tests.helpers.http_client import H11Client, call, status_of
from tests.helpers.procs import ProcCluster, loopback_ips_usable

ECHO = ("Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox "
        "jumps over the lazy dog, the quick brown fox jumps over the lazy dog.")
LOOKUP = {"drafter": "lookup", "depth": 4}
# Where the browser test also saves its screenshot (the README's docs/dashboard.png is made so).
SCREENSHOT_ENV = "SKULKP2P_DASHBOARD_SCREENSHOT"

# A tensor group forms in seconds; on a loaded machine the tests' short timers can move the
# leadership while it forms, and its members then re-form it within a few gossip rounds
# (node/tensor_roles.py; tests/test_tensor_formation.py): the bound for a group to form and
# measure its verify costs.
GROUP_FORMS_S = 60

cluster_only = pytest.mark.skipif(not loopback_ips_usable(),
                                  reason="needs the 127.0.0.0/8 loopback range (Linux)")


def metrics(addr: str) -> dict[str, dict]:
    status, headers, body = call(addr, "GET", "/metrics", timeout=10)
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode() if isinstance(body, bytes) else json.dumps(body)
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {"type": fam.type, "samples": [(s.name, s.labels, s.value)
                                                        for s in fam.samples]}
    return out


def sample(fams: dict, family: str, sample: str | None = None, **labels) -> float | None:
    for name, got, value in fams.get(family, {}).get("samples", []):
        if name == (sample or family) and all(got.get(k) == str(v) for k, v in labels.items()):
            return value
    return None


def chat(addr: str, content: str = ECHO, retries: int = 120, **kw) -> dict:
    """A chat request, retried while the ring loads (503) or was just re-placed."""
    body = {"model": "llama", "messages": [{"role": "user", "content": content}],
            "max_tokens": 48, "speculation": LOOKUP, **kw}
    out = None
    for _ in range(retries):
        try:
            status, _, out = call(addr, "POST", "/v1/chat/completions", body, timeout=60)
        except OSError:
            status = 0
        if status == 200:
            return out
        time.sleep(0.25)
    raise AssertionError(f"no answer from {addr}: {out}")


@pytest.fixture(scope="module")
def duo(tiny_models, tmp_path_factory):
    """n0 and n1, both asking for the tiny llama, which is then placed on the ring n0 -> n1
    (n1, the last stage, runs the decode loop); one lookup request sent to n0 beforehand."""
    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    c = ProcCluster(tmp_path_factory.mktemp("dash"), env={"SKULKP2P_RING_TIMEOUT": "20"})
    try:
        for i in range(2):
            c.start_join(i, str(tiny_models["llama"]),
                         args=["--timers", "probe=0.2,suspect=1,election=1"])
        c.wait(lambda: (s := c.agreed([0, 1])) and s["placements"], 90, "a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90, "health")
        status, _, out = call(c.nodes[0].http, "POST", "/v1/cluster/place",
                              {"model": "llama", "nodes": ["n0", "n1"]})
        assert status == 200 and out["placement"]["ring"] == ["n0", "n1"], out
        c.wait(lambda: (s := c.agreed([0, 1])) and any(
            p["ring"] == ["n0", "n1"] for p in s["placements"]), 30, "the ring n0 -> n1")
        c.first = chat(c.nodes[0].http)  # forwarded to n1
        assert c.first["speculation"]["drafted"] > 0, c.first
        yield c
    finally:
        c.close()


@pytest.mark.cluster
@cluster_only
def test_metrics_scrape(duo):
    first = duo.first["speculation"]
    m1 = metrics(duo.nodes[1].http)  # the ring's last stage: the node that ran the request
    assert sample(m1, "skulkp2p_requests", "skulkp2p_requests_total", model="llama",
                  outcome="ok") >= 1
    assert sample(m1, "skulkp2p_generation_tokens", "skulkp2p_generation_tokens_total",
                  model="llama") >= duo.first["usage"]["completion_tokens"]
    sp = "skulkp2p_spec_decode_"
    drafted = sample(m1, sp + "num_draft_tokens", sp + "num_draft_tokens_total",
                     model="llama", drafter="lookup")
    accepted = sample(m1, sp + "num_accepted_tokens", sp + "num_accepted_tokens_total",
                      model="llama", drafter="lookup")
    assert drafted >= first["drafted"] > 0 and accepted >= first["accepted"]
    per_pos = [v for name, labels, v in m1[sp + "num_accepted_tokens_per_pos"]["samples"]
               if labels["drafter"] == "lookup"]
    # depth 4: positions 0..3 at most (the suffix drafter caps a draft at its match length)
    assert 1 <= len(per_pos) <= 4 and sum(per_pos) == accepted
    assert sample(m1, sp + "num_drafts", sp + "num_drafts_total", model="llama",
                  drafter="lookup") >= first["rounds"]
    ttft = "skulkp2p_time_to_first_token_seconds"
    assert m1[ttft]["type"] == "histogram"
    assert sample(m1, ttft, ttft + "_count", model="llama") >= 1
    assert sample(m1, ttft, ttft + "_bucket", model="llama", le="+Inf") >= 1
    assert sample(m1, "skulkp2p_requests_waiting", model="llama") == 0
    # A ring's engine reports no measured verify-cost table (nor does /v1/models show one):
    # the family is there, without samples.
    assert m1["skulkp2p_verify_cost_seconds"] == {"type": "gauge", "samples": []}
    (llama,) = call(duo.nodes[1].http, "GET", "/v1/models")[2]["data"]
    assert "verify_costs" not in llama
    for fams in (m1, metrics(duo.nodes[0].http)):
        assert sample(fams, "skulkp2p_cluster_members", state="alive") == 2
        assert sample(fams, "skulkp2p_cluster_members", state="dead") == 0
        assert sample(fams, "skulkp2p_cluster_has_leader") == 1
        assert sample(fams, "skulkp2p_cluster_placements") == 1
        assert sample(fams, "skulkp2p_cluster_placement_errors") == 0
        assert sample(fams, "skulkp2p_cluster_leader_changes",
                      "skulkp2p_cluster_leader_changes_total") >= 1
    leaders = [sample(metrics(n.http), "skulkp2p_cluster_is_leader")
               for n in duo.nodes.values()]
    assert sorted(leaders) == [0, 1]


@pytest.mark.cluster
@cluster_only
def test_rejected_frames_are_counted(duo):
    """Frames signed with another secret, on the control plane and on the data plane, are
    refused and show in /metrics by plane and reason."""
    n0 = duo.nodes[0]
    rej = "skulkp2p_wire_frames_rejected"

    def rejected(plane: str) -> float:
        return sample(metrics(n0.http), rej, rej + "_total", plane=plane,
                      reason="bad-signature")

    before = {p: rejected(p) for p in ("control", "data")}
    body = b"\x81\xa1t\xa4ping"  # msgpack {"t": "ping"}
    frame = struct.pack(">I", 32 + len(body)) + b"\x00" * 32 + body
    ring = next(m["ring"] for m in call(n0.http, "GET", "/v1/cluster")[2]["members"]
                if m["name"] == "n0")
    for addr in (f"{n0.ip}:{n0.port}", ring):
        host, port = addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(frame)
            s.settimeout(5)
            try:
                while s.recv(4096):  # the node's hello; then the node closes the connection...
                    pass
            except ConnectionResetError:
                pass  # ...or aborts it
    duo.wait(lambda: all(rejected(p) == before[p] + 1 for p in before), 10,
             "both refusals in /metrics")
    assert status_of(n0.http) == 200  # and goes on serving


@pytest.mark.cluster
@cluster_only
def test_stats_json(duo):
    status, _, own = call(duo.nodes[1].http, "GET", "/v1/stats")
    assert status == 200 and own["node"] == "n1"
    llama = own["models"]["llama"]
    assert llama["state"] == "ready" and llama["waiting"] == 0
    first = next(r for r in llama["recent"] if r["id"] == min(r["id"] for r in llama["recent"]))
    assert first["speculation"]["acceptance"] == duo.first["speculation"]["acceptance"]
    assert first["speculation"]["by_drafter"]["lookup"]["drafted"] == \
        duo.first["speculation"]["drafted"]
    assert first["completion_tokens"] == duo.first["usage"]["completion_tokens"]
    assert llama["series"] and llama["series"][-1]["acceptance"] is not None
    # n0 serves nothing itself but shows the whole cluster's requests.
    status, _, both = call(duo.nodes[0].http, "GET", "/v1/stats?scope=cluster")
    assert status == 200 and both["node"] == "n0"
    assert [n["node"] for n in both["nodes"]] == ["n0", "n1"]
    assert both["nodes"][0]["models"] == {}
    assert both["nodes"][1]["models"]["llama"]["totals"]["requests"] >= 1
    status, _, err = call(duo.nodes[0].http, "GET", "/v1/stats?scope=galaxy")
    assert status == 400 and err["error"]["param"] == "scope"


@pytest.mark.cluster
@cluster_only
def test_page_and_assets(duo):
    addr = duo.nodes[0].http
    assets = {}
    for path, ctype in (("/", "text/html"), ("/dashboard.js", "text/javascript"),
                        ("/dashboard.css", "text/css")):
        status, headers, body = call(addr, "GET", path)
        assert status == 200 and headers["content-type"].startswith(ctype), (path, headers)
        assert "default-src 'none'" in headers["content-security-policy"]
        assets[path] = body.decode()
    assert '<script src="/dashboard.js">' in assets["/"]
    for path, text in assets.items():  # nothing fetched from outside
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, path
    assert call(addr, "POST", "/", {})[0] == 405
    assert call(addr, "GET", "/nope")[0] == 404


@pytest.mark.cluster
@pytest.mark.browser
@cluster_only
def test_browser_shows_cluster_model_and_acceptance(duo, tmp_path):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set SKULKP2P_CHROMIUM)")
    n0 = duo.nodes[0]
    acceptance = duo.first["speculation"]["acceptance"]
    with Browser(binary, width=1400, height=1000) as browser:
        page = browser.open(f"http://{n0.http}/")
        page.wait("document.getElementById('node-name').textContent === 'n0'", 30,
                  "the node's name")
        page.wait("[...document.querySelectorAll('#members tr[data-member]')].map(r => "
                  "r.dataset.member + ':' + r.querySelector('[data-state]').dataset.state)"
                  ".join(',') === 'n0:alive,n1:alive'", 15, "both members alive")
        spans = page.wait("[...document.querySelectorAll('[data-placement=\"llama\"] .span')]"
                          ".map(s => s.textContent)", 15, "the ring's layer spans")
        assert spans == ["n0 · 0–1", "n1 · 2–3"]
        assert page.eval("document.querySelector('[data-placement=\"llama\"] "
                         "[data-served-by]').dataset.servedBy") == "n1"
        card = "[data-model=\"llama\"][data-node=\"n1\"]"
        shown = page.wait(f"[...document.querySelectorAll('{card} .recent [data-acceptance]')]"
                          ".map(td => [td.dataset.acceptance, td.textContent])", 15,
                          "the request's acceptance")
        assert [str(acceptance), f"{100 * acceptance:.1f}%"] in [
            [a, text.split(" ")[0]] for a, text in shown], shown
        rows_before = len(shown)
        drafter = page.wait(f"(r => r && [r.dataset.drafter, r.querySelector('.acceptance')"
                            f".dataset.acceptance])(document.querySelector('{card} "
                            f"tr[data-drafter]'))", 5, "the acceptance by drafter")
        assert drafter == ["lookup", str(acceptance)]

        # The try form: a streamed lookup request from the page itself.
        page.wait("document.querySelectorAll('#try-model option').length > 0", 15,
                  "the model list")
        page.eval("document.getElementById('try-model').value = 'llama';"
                  "document.getElementById('try-spec').value = 'lookup:4';"
                  "document.getElementById('try-max').value = '40';"
                  "document.getElementById('try-send').click(); true")
        info = page.wait("(t => t.includes('acceptance') && t)(document.getElementById("
                         "'try-stats').textContent)", 60, "the try form's result")
        assert "lookup: acceptance" in info and "→ 40 tokens" in info, info
        assert page.eval("document.getElementById('try-output').textContent.length") > 0
        page.wait(f"document.querySelectorAll('{card} .recent tbody tr').length > "
                  f"{rows_before}", 15, "the new request in the recent table")
        page.wait(f"document.querySelector('{card} .acceptance-total .v').textContent"
                  ".endsWith('%')", 5, "the model's acceptance")
        png = page.screenshot(tmp_path / "dashboard.png")

        # Placed again as a tensor-parallel group: every member a slice of every layer, served
        # by its first member (a ring's is its last).
        status, _, out = call(n0.http, "POST", "/v1/cluster/place",
                              {"model": "llama", "nodes": ["n0", "n1"], "parallel": "tensor"})
        assert status == 200 and out["placement"]["parallel"] == "tensor", out
        shown = page.wait("(p => p && p.textContent.includes('tensor group of 2') && "
                          "[[...p.querySelectorAll('.span')].map(s => s.textContent), "
                          "p.querySelector('[data-served-by]').dataset.servedBy])("
                          "document.querySelector('[data-placement=\"llama\"]'))", 30,
                          "the tensor group")
        assert shown == [["n0 · 1/2", "n1 · 1/2"], "n0"], shown
        # (waited for: while the model is re-placed a poll may briefly list no placement)
        holds = page.wait("(h => h && h.textContent.includes('rank') && h.textContent)("
                          "document.querySelector('#members tr[data-member=\"n1\"] "
                          "[data-holds=\"llama\"]'))", 30, "n1's rank in the group")
        assert holds.startswith("llama: rank 2/2, 1/2 of layers 0–"), holds
        # The group's measured verify costs, in the card of the member that runs its loop:
        # the table /v1/models shows, row for row.
        duo.wait(lambda: _verify_costs(n0.http), GROUP_FORMS_S, "the group's verify costs")
        costs = _verify_costs(n0.http)
        rows = page.wait("(t => t && [t.dataset.where, [...t.querySelectorAll('tr[data-width]')]"
                         ".map(r => [Number(r.dataset.width), Number(r.querySelector("
                         "'[data-seconds]').dataset.seconds), Number(r.querySelector("
                         "'[data-relative]').dataset.relative)])])(document.querySelector("
                         "'[data-model=\"llama\"][data-node=\"n0\"] .verify-costs'))", 30,
                         "the verify-cost table")
        assert rows == [costs["where"], [[w["width"], w["seconds"], w["relative"]]
                                         for w in costs["widths"]]], rows
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width == 1400 and height >= 800, (width, height)
    target = os.environ.get(SCREENSHOT_ENV)
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "dashboard.png", target)


def _verify_costs(http: str) -> dict | None:
    """The llama's verify costs as GET /v1/models shows them on that node, once placed as a
    tensor group n0, n1 (None before: while it is re-placed the listing may lack it)."""
    listed = [m for m in call(http, "GET", "/v1/models")[2]["data"] if m["id"] == "llama"]
    if not listed or listed[0]["parallel"] != "tensor":
        return None
    return listed[0].get("verify_costs")


@pytest.mark.cluster
@cluster_only
def test_tensor_group_verify_costs_on_metrics(duo):
    """Placed as a tensor-parallel group (as the browser test leaves it), the group measures
    its verify costs; /metrics of the member that runs its loop has one gauge per width, the
    same seconds and relative costs /v1/models shows, labelled with where they were measured;
    the other member's /metrics has none (its node runs no engine of the model)."""
    n0, n1 = duo.nodes[0], duo.nodes[1]
    status, _, out = call(n0.http, "POST", "/v1/cluster/place",
                          {"model": "llama", "nodes": ["n0", "n1"], "parallel": "tensor"})
    assert status == 200 and out["placement"]["parallel"] == "tensor", out
    duo.wait(lambda: _verify_costs(n0.http), GROUP_FORMS_S, "the group's verify costs")
    costs = _verify_costs(n0.http)
    assert costs["where"] == "tensor-parallel group n0, n1"
    m0 = metrics(n0.http)
    seconds = {int(labels["width"]): v for _, labels, v in
               m0["skulkp2p_verify_cost_seconds"]["samples"]
               if labels["model"] == "llama" and labels["where"] == costs["where"]}
    relative = {int(labels["width"]): v for _, labels, v in
                m0["skulkp2p_verify_cost_relative"]["samples"] if labels["model"] == "llama"}
    # (/v1/models rounds the seconds to the microsecond; the gauges keep them whole)
    assert seconds == {w["width"]: pytest.approx(w["seconds"], abs=1e-6)
                       for w in costs["widths"]}
    assert relative == {w["width"]: w["relative"] for w in costs["widths"]}
    assert len(seconds) > 1 and relative[1] == 1.0
    assert sample(m0, "skulkp2p_verify_costs_measured_timestamp_seconds", model="llama",
                  where=costs["where"]) == costs["measured_at"]
    assert metrics(n1.http)["skulkp2p_verify_cost_seconds"]["samples"] == []
    text = call(n0.http, "GET", "/metrics")[2].decode()
    print("\n" + "\n".join(line for line in text.splitlines() if "verify_cost" in line))


def test_single_node_app_counts_outcomes():
    """api/app.py's serve() (one model, no cluster) serves the same routes; the worker's
    outcomes are counted: ok, error (the engine broke), cancelled (the client left)."""
    from tests.helpers.fake_engine import LiveNode, Script, wait_until
    from tests.helpers.fake_engine import chat as script_chat

    node = LiveNode(Script())
    try:
        node.wait_ready()
        with H11Client(node.port) as c:
            assert c.request("POST", "/v1/chat/completions", script_chat("tokens=3")).status \
                == 200
            assert c.request("POST", "/v1/chat/completions",
                             script_chat("tokens=5 fail=2")).status == 500
        s = socket.create_connection(("127.0.0.1", node.port))
        body = json.dumps(script_chat("prefill=30 tokens=1")).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                  b"\r\n%b" % (len(body), body))
        wait_until(lambda: "prefill=30 tokens=1" in node.script.started)
        s.close()

        def outcomes() -> dict:
            with H11Client(node.port) as c:
                r = c.request("GET", "/metrics")
            assert r.status == 200
            fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
            return {s.labels["outcome"]: s.value for s in fams["skulkp2p_requests"].samples}

        wait_until(lambda: outcomes() == {"ok": 1, "error": 1, "cancelled": 1}, timeout=10)
        with H11Client(node.port) as c:
            stats = c.request("GET", "/v1/stats").json()
            page = c.request("GET", "/")
            cluster = c.request("GET", "/v1/stats?scope=cluster").json()
        fake = stats["models"]["fake"]
        assert [r["outcome"] for r in fake["recent"]] == ["cancelled", "error", "ok"]
        assert fake["recent"][2]["completion_tokens"] == 3 and fake["state"] == "ready"
        assert page.status == 200 and b"skulkp2p" in page.body
        assert [n["node"] for n in cluster["nodes"]] == [stats["node"]]  # no cluster: itself
    finally:
        node.close()


def test_single_node_app_shows_its_engines_verify_costs():
    """What the engine reports on the seam (EngineInfo.verify_costs) is on /metrics and in
    /v1/stats (the page's model card), through the app's real routes; an engine that reports
    none has no samples."""
    from skulkp2p.engine.protocol import EngineInfo, VerifyCosts
    from tests.helpers.fake_engine import FakeEngine, LiveNode, Script

    costs = VerifyCosts({1: 0.01, 2: 0.011, 4: 0.015}, time.time(), "tensor-parallel group a, b")

    class Measured(FakeEngine):
        def info(self) -> EngineInfo:
            return EngineInfo(self.id, "fake", "none", self.context_length,
                              verify_costs=costs)

    for engine, shown in ((Measured(Script()), True), (FakeEngine(Script()), False)):
        node = LiveNode(engine=engine)
        try:
            node.wait_ready()
            with H11Client(node.port) as c:
                r = c.request("GET", "/metrics")
                stats = c.request("GET", "/v1/stats").json()
            assert r.status == 200
            fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
            got = {(s.labels["model"], int(s.labels["width"]), s.labels["where"]): s.value
                   for s in fams["skulkp2p_verify_cost_seconds"].samples}
            fake = stats["models"]["fake"]
            if shown:
                assert got == {("fake", w, costs.where): s for w, s in costs.seconds.items()}
                assert fake["verify_costs"] == json.loads(json.dumps(costs.to_json()))
            else:
                assert got == {} and "verify_costs" not in fake
        finally:
            node.close()


def _blas_policy(port: int) -> dict:
    """The OpenBLAS thread policy's families on a node's /metrics: forwards per thread count,
    narrowed forwards per reason, switches, trips and the bounds."""
    with H11Client(port) as c:
        r = c.request("GET", "/metrics")
    assert r.status == 200
    fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
    p = "skulkp2p_blas_"
    assert {fams[p + n].type for n in ("forwards", "narrowed", "thread_switches",
                                       "guard_trips", "light_loads")} == {"counter"}
    return {"forwards": {int(s.labels["threads"]): s.value
                         for s in fams[p + "forwards"].samples},
            "narrowed": {s.labels["reason"]: s.value for s in fams[p + "narrowed"].samples},
            "switches": fams[p + "thread_switches"].samples[0].value,
            "trips": fams[p + "guard_trips"].samples[0].value,
            "bounds": {(s.labels["bound"], s.labels["mode"]): s.value
                       for s in fams[p + "threads"].samples}}


@pytest.mark.process
@pytest.mark.parametrize("setting", ["auto", "1"])
def test_agents_metrics_show_its_blas_thread_policy(tiny_models, tmp_path, monkeypatch,
                                                    setting):
    """A real `join` agent's /metrics counts what its OpenBLAS thread policy
    (engine/cpu/blas_threads.py) did: forwards per thread count (they grow with each request), the
    forwards it kept narrow by reason, switches and trips. SKULKP2P_BLAS_THREADS=1: every
    forward on one thread, nothing narrowed or switched."""
    from tests.helpers.procs import JoinNode

    monkeypatch.setenv("SKULKP2P_BLAS_THREADS", setting)
    node = JoinNode(str(tiny_models["llama"]), tmp_path, "--data-dir", str(tmp_path))
    try:
        body = {"model": "llama", "messages": [{"role": "user", "content": ECHO}],
                "max_tokens": 16, "temperature": 0, "speculation": "off"}
        seen = []
        for _ in range(2):
            with H11Client(node.port, timeout=60) as c:
                r = c.request("POST", "/v1/chat/completions", body)
            assert r.status == 200, r.body[:500]
            seen.append(_blas_policy(node.port))
        first, second = seen
        assert set(first["narrowed"]) == {"busy", "shared", "tripped"}
        assert sum(first["forwards"].values()) > 0
        assert sum(second["forwards"].values()) > sum(first["forwards"].values())
        if setting == "1":
            assert first["bounds"] == {("narrow", "fixed"): 1, ("wide", "fixed"): 1}
            assert set(second["forwards"]) == {1}
            assert second["narrowed"] == {"busy": 0, "shared": 0, "tripped": 0}
            assert second["switches"] == 0 and second["trips"] == 0
        else:
            narrow, wide = (first["bounds"][("narrow", "auto")],
                            first["bounds"][("wide", "auto")])
            assert 1 <= narrow <= wide and set(second["forwards"]) == {narrow, wide}
            # the first forwards of each width class are the narrow reference (BASELINE)
            assert second["forwards"][narrow] > 0
    finally:
        assert node.stop() == 0, node.text()[-3000:]
