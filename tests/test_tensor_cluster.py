"""Tensor-parallel placements in a cluster of real `join` processes on 127.0.0.x: placed with
`POST /v1/cluster/place {"parallel": "tensor"}`, shown in `/v1/cluster`, each member's rank
process started and ended by its node; speculative output equals plain output on the group;
a member killed or frozen mid-request ends the request in bounded time with a 503
tensor_group_failed to retry (as a broken ring's ring_failed), the model is placed again and
the next request succeeds (the ring failure tests, for groups)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from skulkp2p.engine.parallel.tensor.group import READY_TIMEOUT_S
from tests.helpers import ROOT
from tests.helpers.http_client import call, status_of
from tests.helpers.procs import SECRET, ProcCluster, loopback_ips_usable

ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"
ARMS = {
    "plain": {"speculation": "off"},
    "lookup": {"speculation": {"drafter": "lookup", "depth": 4}},
    "mtp": {"speculation": {"drafter": "mtp", "depth": 2}},
}


@pytest.fixture(scope="module")
def llama(tiny_model) -> Path:
    return tiny_model("llama", seed=0, mtp=True)


@pytest.fixture(scope="module")
def cluster(llama, tmp_path_factory):
    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    c = ProcCluster(tmp_path_factory.mktemp("tensor"), env={"SKULKP2P_RING_TIMEOUT": "20"})
    try:
        for i in range(3):
            c.start_join(i, str(llama), args=[
                "--memory-limit", "2GB", "--timers", "probe=0.2,suspect=1,election=1"])
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and s["placements"], 90, "a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90, "health")
        yield c
    finally:
        c.close()


# A group answers 503 while it forms, for as long as the code allows forming to take (each rank
# loads, connects and the first measures the verify costs): wait that long plus a margin. A count
# of tries (~75 s) gave up on a starved box while the group was still forming inside its bound.
FORMS_WITHIN_S = READY_TIMEOUT_S + 60


def _pipe(addr: str, arm: str, max_tokens: int = 32, bound_s: float = FORMS_WITHIN_S) -> dict:
    body = {"model": "llama", "prompt": ECHO, "max_tokens": max_tokens, **ARMS[arm]}
    status, out = 0, None
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            status, _, out = call(addr, "POST", "/v1/cluster/generate", body, timeout=60)
        except OSError:
            status, out = 0, None
        if status == 200 and "error" not in out:
            return out
        time.sleep(0.1)  # 503 while a group forms; an error right after a re-placement
    raise AssertionError(f"no answer from {addr} within {bound_s:.0f} s: {status} {out}")


def _place_tensor(c, nodes: list[str]) -> dict:
    status, _, out = call(c.nodes[0].http, "POST", "/v1/cluster/place",
                          {"model": "llama", "nodes": nodes, "parallel": "tensor"})
    assert status == 200, out
    assert out["placement"]["ring"] == nodes and out["placement"]["parallel"] == "tensor"
    return out["placement"]


def _grouped(c, among: list[int], pred) -> None:
    c.wait(lambda: all((s := c.status(i)) and any(
        p["model"] == "llama" and p["parallel"] == "tensor" and pred(p["ring"])
        for p in s["placements"]) for i in among), 30, "a tensor placement everyone sees")


def _rank_pids(c, http: str) -> dict[str, int]:
    st = call(http, "GET", "/v1/cluster")[2]
    return {m["name"]: (m.get("stages") or {}).get("llama", {}).get("pid")
            for m in st["members"]}


@pytest.mark.cluster
@pytest.mark.slow
def test_group_of_processes_speculative_equals_plain(cluster):
    c = cluster
    http = c.nodes[2].http  # not a member: forwarded to the group's first member
    single = _pipe(http, "plain")
    _place_tensor(c, ["n0", "n1"])
    _grouped(c, [0, 1, 2], lambda ring: ring == ["n0", "n1"])
    got = {arm: _pipe(http, arm) for arm in ARMS}
    for arm in ARMS:
        assert got[arm]["tokens"] == got["plain"]["tokens"], arm
        assert got[arm]["text"] == got["plain"]["text"]
    assert got["lookup"]["speculation"]["drafted"] > 0
    assert got["mtp"]["speculation"]["drafted"] > 0
    # The prefix cache: the same prompt again restores its caches on every rank.
    again = _pipe(http, "plain")
    assert again["tokens"] == got["plain"]["tokens"]
    assert again["usage"]["cached_tokens"] > 0, again["usage"]
    # The group measured its own verify costs when it formed, for the depth controller.
    assert "the group's verify costs" in c.nodes[0].log.read_text(errors="replace")
    print(f"\ntensor group of 2 equals one node's greedy text: "
          f"{got['plain']['tokens'] == single['tokens']}")
    # /v1/cluster shows the kind, and each member's rank (its pid, what it holds).
    st = call(http, "GET", "/v1/cluster")[2]
    (p,) = [p for p in st["placements"] if p["model"] == "llama"]
    assert p["parallel"] == "tensor" and p["layers"] == [[0, 4], [0, 4]]
    c.wait(lambda: all(_rank_pids(c, http).get(n) for n in ("n0", "n1")), 10, "ranks reported")
    stages = {m["name"]: m["stages"]["llama"] for m in st["members"] if "llama" in
              (m.get("stages") or {})}
    assert {s.get("rank") for n, s in stages.items() if n in ("n0", "n1")} <= {0, 1, None}
    # The measured table is where a user looks for the model's state: GET /v1/models on the
    # member that runs the loop (its engine's) and on any other node (the member's report), and
    # that member's stage in /v1/cluster.
    c.wait(lambda: all(_verify_costs(c, i) for i in (0, 2)), 30, "verify costs shown")
    for i in (0, 2):
        costs = _verify_costs(c, i)
        assert costs["where"] == "tensor-parallel group n0, n1"
        widths = [row["width"] for row in costs["widths"]]
        assert widths == sorted(widths) and len(widths) > 1 and widths[0] == 1
        assert costs["widths"][0]["relative"] == 1.0
        assert all(row["seconds"] > 0 for row in costs["widths"])
        # (capped by the wider widths': never cheaper for more rows)
        seconds = [row["seconds"] for row in costs["widths"]]
        assert seconds == sorted(seconds)
    # What is shown is the live table the controller prices drafts with (engine/drafting/call_costs.py):
    # the probe it was seeded with, and the calls of the requests above behind each width.
    live = _verify_costs(c, 0)
    assert live["source"] == "live"
    assert [row["width"] for row in live["probe"]][0] == 1
    calls = {row["width"]: row["calls"] for row in live["widths"]}
    # the plain requests alone (two, each token after the prefill's one call) made one-row
    # verify calls; the speculative ones called wider widths
    assert calls[1] >= 2 * (len(got["plain"]["tokens"]) - 1), calls
    assert sum(n for w, n in calls.items() if w > 1) > 0, calls
    # Other nodes see the same through the member's stage report, which follows the table.
    c.wait(lambda: _verify_costs(c, 2) == _verify_costs(c, 0), 30, "the live table everywhere")
    st = call(http, "GET", "/v1/cluster")[2]
    (n0,) = [m for m in st["members"] if m["name"] == "n0"]
    assert n0["stages"]["llama"]["verify_costs"] == _verify_costs(c, 0)
    (n1,) = [m for m in st["members"] if m["name"] == "n1"]
    assert "verify_costs" not in n1["stages"]["llama"]  # (rank 1 does not run the loop)
    # /metrics of that member: the same seconds and the calls behind them.
    text = call(c.nodes[0].http, "GET", "/metrics")[2].decode()
    shown = {}
    for line in text.splitlines():
        if line.startswith("skulkp2p_verify_cost_calls{") and 'model="llama"' in line:
            width = int(line.split('width="', 1)[1].split('"', 1)[0])
            shown[width] = int(float(line.rsplit(" ", 1)[1]))
    assert shown == calls, (shown, calls)


def _verify_costs(c, i: int) -> dict | None:
    models = call(c.nodes[i].http, "GET", "/v1/models")[2]["data"]
    (llama,) = [m for m in models if m["id"] == "llama"]
    assert llama["parallel"] == "tensor" and llama["ring"] == ["n0", "n1"]
    return llama.get("verify_costs")


def _long_request(c, i: int, result: dict) -> threading.Thread:
    """A long non-streamed completion on node i (forwarded to the member that runs the loop),
    as an OpenAI client sends it: its reply is (status, headers, body)."""
    def run() -> None:
        body = {"model": "llama", "prompt": ECHO, "max_tokens": 3000, "speculation": "off"}
        try:
            result["reply"] = call(c.nodes[i].http, "POST", "/v1/completions", body,
                                   timeout=60)
        except OSError as e:
            result["reply"] = (0, {}, {"error": {"message": f"client: {e}"}})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _mid_request_on_a_group(c) -> tuple[dict, threading.Thread, dict, int]:
    """llama tensor-parallel on n0 (runs the loop) + n1, a long request under way (16 tokens in):
    (reference output, the request's thread, its reply, n1's rank pid)."""
    _place_tensor(c, ["n0", "n1"])
    _grouped(c, [0, 1, 2], lambda ring: ring == ["n0", "n1"])
    reference = _pipe(c.nodes[2].http, "plain")
    c.wait(lambda: _rank_pids(c, c.nodes[0].http).get("n1"), 10, "n1's rank reported")
    pid = _rank_pids(c, c.nodes[0].http)["n1"]
    result: dict = {}
    t = _long_request(c, 2, result)
    c.wait_decoding("llama", 16)  # the group is mid-request, not queued or prefilling
    return reference, t, result, pid


def _group_failed(reply: tuple) -> str:
    """A broken group is transient, like a broken ring: 503 tensor_group_failed with
    Retry-After, the message naming the model and what broke and saying to retry (through the
    node that forwarded it); never a 500 "generation failed". Returns the message."""
    status, headers, out = reply
    assert status == 503, reply
    assert headers.get("retry-after") == "1", headers
    err = out["error"]
    assert err["code"] == "tensor_group_failed" and err["type"] == "service_unavailable", out
    message = err["message"]
    assert message.startswith("model llama: its tensor-parallel group broke"), message
    assert "broke mid-request" in message and message.endswith("retry"), message
    return message


def _thaw(c, rank_pid: int) -> None:
    """SIGCONT to n1 and its rank process (either may have gone meanwhile)."""
    for p in (rank_pid, c.nodes[1].pid):
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _n1_back(c) -> None:
    c.wait(lambda: (s := c.agreed([0, 1, 2])) and all(
        m["state"] == "alive" for m in s["members"]), 30, "n1 back after SIGCONT")


def _replaced_without_n1(c) -> None:
    _grouped(c, [0, 2], lambda ring: "n1" not in ring)


@pytest.mark.cluster
@pytest.mark.slow
def test_member_frozen_mid_request(cluster):
    """The member's agent and its rank process stop (SIGSTOP: a frozen machine): the request
    ends with a clear error in bounded time, the group is placed again without it, the next
    request succeeds; woken, the member rejoins."""
    c = cluster
    reference, t, result, pid = _mid_request_on_a_group(c)
    c.signal(1, signal.SIGSTOP)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        t.join(30)
        took = time.monotonic() - t0
        assert not t.is_alive(), "the request hung on a frozen member"
        message = _group_failed(result["reply"])
        assert "n1" in message, message
        assert took < 15, took  # the member declared dead: seconds, not the 20 s timeout
        print(f"\nfrozen member: the request ended {took:.1f} s after SIGSTOP: {message}")
        _replaced_without_n1(c)
        assert _pipe(c.nodes[2].http, "plain")["tokens"] == reference["tokens"]
    finally:
        _thaw(c, pid)
    _n1_back(c)


@pytest.mark.cluster
@pytest.mark.slow
def test_pipe_peer_line_is_retried_across_a_frozen_member(cluster):
    """A `pipe --peer` line under way on the group when a member freezes: the group's failure
    reaches the pipe as a 503 tensor_group_failed (not an internal_error result), the pipe
    retries the line as Retry-After says, and the line is answered once the model is placed
    again without the member."""
    c = cluster
    _place_tensor(c, ["n0", "n1"])
    _grouped(c, [0, 1, 2], lambda ring: ring == ["n0", "n1"])
    _pipe(c.nodes[2].http, "plain")  # the group formed and serves
    c.wait(lambda: _rank_pids(c, c.nodes[0].http).get("n1"), 10, "n1's rank reported")
    pid = _rank_pids(c, c.nodes[0].http)["n1"]
    # Long enough to be mid-decode for seconds when the member freezes 16 tokens in (a group
    # decodes this tiny model at tens of tokens a second), short enough that the retry, which
    # decodes the whole line again on the new group, takes seconds too.
    line = {"id": "long", "model": "llama", "prompt": ECHO, "max_tokens": 400,
            "speculation": "off"}
    pipe = subprocess.Popen([sys.executable, "-m", "skulkp2p", "pipe", "--peer", c.nodes[2].addr],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "SKULKP2P_SECRET": SECRET}, text=True)
    got: dict = {}
    talk = threading.Thread(target=lambda: got.update(zip(
        ("out", "err"), pipe.communicate(json.dumps(line) + "\n"), strict=True)), daemon=True)
    talk.start()
    try:
        c.wait_decoding("llama", 16)
        c.signal(1, signal.SIGSTOP)
        os.kill(pid, signal.SIGSTOP)
        try:
            talk.join(150)
            assert not talk.is_alive(), "the pipe line was never answered"
        finally:
            _thaw(c, pid)
    finally:
        if pipe.poll() is None:
            pipe.kill()
            pipe.wait()
    out, err = got["out"], got["err"]
    assert pipe.returncode == 0, err
    (result,) = [json.loads(row) for row in out.splitlines()]
    assert result["id"] == "long" and "error" not in result, result
    assert result["usage"]["completion_tokens"] > 0
    assert "cluster busy (tensor_group_failed)" in err, err[-3000:]  # it was under way
    assert "internal_error" not in err
    _n1_back(c)


@pytest.mark.cluster
@pytest.mark.slow
def test_member_killed_mid_request(cluster):
    c = cluster
    reference, t, result, _pid = _mid_request_on_a_group(c)
    c.signal(1, signal.SIGKILL)  # its rank process dies with it (PR_SET_PDEATHSIG)
    t0 = time.monotonic()
    t.join(30)
    assert not t.is_alive(), "the request hung on a dead member"
    _group_failed(result["reply"])
    assert time.monotonic() - t0 < 15
    _replaced_without_n1(c)
    assert _pipe(c.nodes[2].http, "plain")["tokens"] == reference["tokens"]


@pytest.mark.cluster
@pytest.mark.slow
def test_members_that_disagree_on_dtype_do_not_form_a_group(llama, tmp_path):
    """Two members serving the model in different dtypes (float32 and bfloat16: an all-sum of
    their rows crashed a rank with SIGSEGV) end formation with a clear error before any
    collective of model data: /v1/cluster shows it on both members' stages, the logs say it,
    a request gets a 503 naming it, and no process crashed."""
    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    c = ProcCluster(tmp_path, env={"SKULKP2P_DTYPE": "float32"})
    try:
        c.start_join(0, str(llama), args=["--memory-limit", "2GB"])
        c.env = {**c.env, "SKULKP2P_DTYPE": "bfloat16"}
        c.start_join(1, str(llama), args=["--memory-limit", "2GB"])
        c.wait(lambda: (s := c.agreed([0, 1])) and s["placements"], 90, "a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90, "health")
        _place_tensor(c, ["n0", "n1"])
        want = "serving dtype differs (rank 0 float32, rank 1 bfloat16)"

        def errors() -> dict[str, str]:
            st = call(c.nodes[0].http, "GET", "/v1/cluster")[2]
            return {m["name"]: ((m.get("stages") or {}).get("llama") or {}).get("error", "")
                    for m in st["members"]}
        c.wait(lambda: all(want in e for e in errors().values()), FORMS_WITHIN_S,
               "the disagreement shown on both members")
        for i in (0, 1):
            assert "the group cannot form" in c.nodes[i].log.read_text(errors="replace")
            assert c.nodes[i].proc.poll() is None  # the agents live on
        body = {"model": "llama", "prompt": ECHO, "max_tokens": 4}
        status, _, out = call(c.nodes[1].http, "POST", "/v1/completions", body, timeout=60)
        assert status == 503, (status, out)
        assert "cannot form" in out["error"]["message"] and want in out["error"]["message"]
        for i in (0, 1):  # no rank crashed (a signal), no rank left running
            text = c.nodes[i].log.read_text(errors="replace")
            assert "status -11" not in text and "SIGSEGV" not in text
        assert not any(s.get("pid") for s in [
            ((m.get("stages") or {}).get("llama") or {}) for m in
            call(c.nodes[0].http, "GET", "/v1/cluster")[2]["members"]])
    finally:
        c.close()
