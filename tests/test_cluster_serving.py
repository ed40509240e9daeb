"""`join` in a cluster: real processes on 127.0.0.x serving tiny models. Any node answers any
request (forwarding to the placed node), /v1/cluster and /v1/cluster/place, 503 + Retry-After
without a leader, `pipe --peer`, and failover with requests in flight on a frozen, then killed,
node. Every pid is killed at the end (ProcCluster.close)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.helpers.http_client import call, status_of
from tests.helpers.procs import SECRET, ProcCluster, loopback_ips_usable, run_cli

pytestmark = pytest.mark.skipif(not loopback_ips_usable(),
                                reason="needs the 127.0.0.0/8 loopback range (Linux)")

CHAT = [{"role": "user", "content": "Say something about dogs."}]
HUGE_CARD = """
id = "huge-test"
family = "llama"
format = "mlx"
layers = 80
hidden_size = 8192
kv_heads = 8
context_length = 32768
size_bytes = 140_000_000_000

[source]
kind = "hf"
repo = "nobody/huge-test"
"""


def client(addr: str, retries: int = 0):
    import openai

    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="none", max_retries=retries,
                         timeout=120)


def greedy(addr: str, max_tokens: int = 24) -> str:
    status, _, body = call(addr, "POST", "/v1/chat/completions",
                           {"messages": CHAT, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def _cluster(tmp, tiny_models) -> ProcCluster:
    cards = tmp / "cards"
    cards.mkdir()
    (cards / "huge.toml").write_text(HUGE_CARD)
    return ProcCluster(tmp, env={"SKULKP2P_CARDS_DIR": str(cards)})


def _start_trio(c: ProcCluster, model: str) -> None:
    for i in range(3):
        c.start_join(i, model, args=["--memory-limit", "2GB"])
    c.wait(lambda: (s := c.agreed([0, 1, 2])) and s["placements"], 90,
           "3 joins to agree on a placement")
    c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90,
           "every node to answer /health with 200")


@pytest.fixture(scope="module")
def trio(tiny_models, tmp_path_factory):
    c = _cluster(tmp_path_factory.mktemp("trio"), tiny_models)
    try:
        _start_trio(c, str(tiny_models["llama"]))
        yield c
    finally:
        c.close()


@pytest.mark.cluster
def test_cluster_endpoint(trio):
    status, _, st = call(trio.nodes[2].http, "GET", "/v1/cluster")
    assert status == 200
    assert st["node"] == "n2" and st["leader"] == "n0" and st["term"] >= 1
    assert [m["name"] for m in st["members"]] == ["n0", "n1", "n2"]
    for m in st["members"]:
        assert m["state"] == "alive" and m["memory"] == 2_000_000_000
        assert m["addr"] == trio.nodes[int(m["name"][1:])].addr
        assert m["http"] == trio.nodes[int(m["name"][1:])].http and m["engines"]
    (p,) = st["placements"]
    assert p["model"] == "llama" and p["ring"] == ["n0"] and p["layers"] == [[0, 4]]


@pytest.mark.cluster
def test_any_node_answers_the_same(trio):
    texts = {i: greedy(n.http) for i, n in trio.nodes.items()}
    assert len(set(texts.values())) == 1, texts
    # Streaming through a node that forwards: the same text, piece by piece.
    stream = client(trio.nodes[2].http).chat.completions.create(
        messages=CHAT, max_tokens=24, temperature=0, stream=True, model="llama")
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == texts[0] and len(pieces) > 1
    # Anthropic's route is forwarded too.
    status, _, msg = call(trio.nodes[1].http, "POST", "/v1/messages",
                          {"model": "llama", "max_tokens": 24, "messages": CHAT})
    assert status == 200 and msg["content"][0]["text"] == texts[0]


@pytest.mark.cluster
def test_place_another_model_on_a_named_node(trio, tiny_models):
    status, _, body = call(trio.nodes[1].http, "POST", "/v1/cluster/place",
                           {"model": str(tiny_models["qwen3"]), "nodes": ["n2"]})
    assert status == 200, body
    assert body["placement"]["ring"] == ["n2"] and body["placement"]["model"] == "qwen3"
    trio.wait(lambda: status_of(trio.nodes[0].http, "/v1/models") == 200 and all(
        m.get("ready") is not False for m in call(trio.nodes[2].http, "GET",
                                                  "/v1/models")[2]["data"]), 60,
        "qwen3 to load on n2")
    c = client(trio.nodes[0].http, retries=5)  # forwarded n0 -> n2; 503s while loading
    r = c.chat.completions.create(messages=CHAT, max_tokens=8, temperature=0, model="qwen3")
    assert r.model == "qwen3" and r.choices[0].message.content is not None


@pytest.mark.cluster
def test_place_errors_are_clear(trio):
    status, _, body = call(trio.nodes[0].http, "POST", "/v1/cluster/place",
                           {"model": "huge-test"})
    assert status == 422, body
    msg = body["error"]["message"]
    assert "huge-test does not fit: it needs 385.47 GB" in msg
    assert "GB free over 3 nodes" in msg
    # Requests for it say the same (once the leader's word has reached the node), with a
    # 503 the client may retry later.
    trio.wait(lambda: call(trio.nodes[1].http, "GET", "/v1/cluster")[2]["errors"], 5,
              "the error to reach n1")
    status, headers, body = call(trio.nodes[1].http, "POST", "/v1/chat/completions",
                                 {"model": "huge-test", "messages": CHAT})
    assert status == 503 and "does not fit" in body["error"]["message"]
    assert headers.get("retry-after")
    status, _, body = call(trio.nodes[0].http, "POST", "/v1/cluster/place",
                           {"model": "llama", "nodes": ["nobody"]})
    assert status == 422 and "nobody" in body["error"]["message"]
    status, _, body = call(trio.nodes[0].http, "POST", "/v1/chat/completions",
                           {"model": "not-a-model", "messages": CHAT})
    assert status == 404


@pytest.mark.cluster
def test_pipe_through_the_cluster(trio):
    lines = [json.dumps({"id": 1, "messages": CHAT, "max_tokens": 24}),
             json.dumps({"id": 2, "messages": CHAT, "max_tokens": 4, "bogus": 1}),
             "not json"]
    r = run_cli("pipe", "--peer", trio.nodes[1].addr, input="\n".join(lines) + "\n",
                env={"SKULKP2P_SECRET": SECRET}, timeout=120)
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(out) == 3
    assert out[0]["id"] == 1 and out[0]["model"] == "llama"
    assert out[0]["text"] == greedy(trio.nodes[0].http)
    assert set(out[0]) >= {"tokens", "finish_reason", "usage", "timing"}
    assert out[1]["id"] == 2 and "bogus" in out[1]["error"]["message"]
    assert out[2]["error"]["type"] == "invalid_json"
    bad = run_cli("pipe", "--peer", trio.nodes[1].addr, input="", env={"SKULKP2P_SECRET": "x"},
                  timeout=60)
    assert bad.returncode == 1 and "secret" in bad.stderr


@pytest.mark.cluster
def test_no_leader_means_503_with_retry_after(tmp_path, tiny_models):
    c = ProcCluster(tmp_path)
    try:
        c.start(9, peers=[])  # a peer that will never answer: a cluster control port, frozen
        c.signal(9, signal.SIGSTOP)
        node = c.start_join(0, str(tiny_models["llama"]), peers=[9])
        c.wait(lambda: status_of(node.http, "/v1/cluster") == 200, 60, "the API")
        _, _, st = call(node.http, "GET", "/v1/cluster")
        assert st["leader"] is None and st["placements"] == []
        status, headers, body = call(node.http, "POST", "/v1/chat/completions",
                                     {"messages": CHAT, "max_tokens": 4})
        assert status == 503 and headers.get("retry-after")
        assert "no leader" in body["error"]["message"]
        assert status_of(node.http) == 503
    finally:
        c.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_failover_frozen_node_rejoin_and_killed_leader(tmp_path, tiny_models):
    import openai

    c = _cluster(tmp_path, tiny_models)
    try:
        _start_trio(c, str(tiny_models["llama"]))
        st = c.agreed([0, 1, 2])
        assert st["leader"] == "n0" and st["placements"][0]["ring"] == ["n0"]
        expected = greedy(c.nodes[0].http)
        # 1. A long stream through n1, served by n0, the leader; n0 freezes mid-stream: the
        #    stream ends with a clear error once n0 is declared dead, it does not hang.
        stream = client(c.nodes[1].http).chat.completions.create(
            messages=CHAT, max_tokens=3000, temperature=0, stream=True, model="llama")
        it = iter(stream)
        next(it)
        c.signal(0, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                assert time.monotonic() - t0 < 30, "the stream hung on a frozen node"
        ended = time.monotonic() - t0
        assert "was lost mid-request" in str(e.value.message or e.value)
        # 2. The others elect, place llama again, and serve it.
        survivors = [1, 2]
        c.wait(lambda: (s := c.agreed(survivors)) and s["leader"] != "n0", 30, "a new leader")
        c.wait(lambda: (s := c.agreed(survivors)) and s["placements"]
               and s["placements"][0]["ring"] != ["n0"], 30, "llama placed again")
        assert greedy_retry(c.nodes[2].http) == expected
        st = c.agreed(survivors)
        # 3. n0 wakes up: it rejoins as a follower; the leader keeps its seat and term.
        c.signal(0, signal.SIGCONT)
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and all(m["state"] == "alive"
                                                         for m in s["members"]), 30,
               "n0 to rejoin")
        back = c.agreed([0, 1, 2])
        assert (back["leader"], back["term"]) == (st["leader"], st["term"])
        # 4. kill -9 the leader: a new one, llama on live nodes, requests through a survivor.
        li = int(st["leader"][1:])
        c.signal(li, signal.SIGKILL)
        t1 = time.monotonic()
        survivors = [i for i in (0, 1, 2) if i != li]
        t_leader = c.wait(lambda: (s := c.agreed(survivors)) and s["leader"] != st["leader"],
                          30, "a leader after kill -9")
        c.wait(lambda: (s := c.agreed(survivors)) and s["placements"]
               and set(s["placements"][0]["ring"]) <= {f"n{i}" for i in survivors}, 30,
               "llama placed on live nodes")
        for i in survivors:
            assert greedy_retry(c.nodes[i].http) == expected
        print(f"stream ended {ended:.1f}s after SIGSTOP; leader {t_leader:.1f}s after kill -9; "
              f"served again {time.monotonic() - t1:.1f}s after kill -9")
    finally:
        c.close()


# Loading a model placed again takes seconds on a quiet machine and took more than 26 s on a
# loaded one: the client's own retries (8, with backoff) gave up on the 503s while it loaded.
SERVED_AGAIN_S = 120.0


def greedy_retry(addr: str) -> str:
    """The greedy answer through `addr`, retried (bounded in time) while the model loads: 503
    with Retry-After, as the node says."""
    import openai

    deadline = time.monotonic() + SERVED_AGAIN_S
    while True:
        try:
            r = client(addr).chat.completions.create(messages=CHAT, max_tokens=24,
                                                     temperature=0, model="llama")
            return r.choices[0].message.content
        except openai.APIStatusError as e:
            if e.status_code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)  # 503 while the placement loads
