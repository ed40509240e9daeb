"""A model on two replicas: three real `join` nodes on 127.0.0.x, the tiny llama placed with
`replicas: 2` on n1 and n2, every request sent through n0, the leader, which has no room
for the model (so killing a replica costs no election). Concurrent clients reach both
replicas; a conversation's turns land on one and hit its prefix cache, and what it finished
reaches the other's draft memory, which drafts a retry of it (served there through the node's
own relay entry, as a router node sends it) with plain decoding's output; a replica killed
(SIGKILL) mid-stream ends that stream with a clear error and the next request is served by the
other. Every pid is killed at the end (ProcCluster.close)."""

from __future__ import annotations

import re
import signal
import threading

import pytest

from tests.helpers.http_client import call, status_of
from tests.helpers.procs import SECRET, ProcCluster, loopback_ips_usable

pytestmark = pytest.mark.skipif(not loopback_ips_usable(),
                                reason="needs the 127.0.0.0/8 loopback range (Linux)")

ROUTER, A, B = 0, 1, 2
_SERVED = re.compile(r'^skulkp2p_requests_total\{[^}]*model="llama"[^}]*\} (\d+)', re.M)


def client(addr: str):
    import openai

    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="none", max_retries=0,
                         timeout=120)


def served(c: ProcCluster, i: int) -> int:
    """Requests the node's own worker finished (its /metrics)."""
    status, _, body = call(c.nodes[i].http, "GET", "/metrics")
    assert status == 200
    text = body.decode() if isinstance(body, bytes) else str(body)
    return sum(int(n) for n in _SERVED.findall(text))


def served_both(c: ProcCluster, total: int) -> list[int]:
    """Both replicas' counts, once they add up to ``total`` (a request is counted just after
    its answer went out)."""
    got: list[int] = []

    def counted() -> bool:
        got[:] = [served(c, i) for i in (A, B)]
        return sum(got) >= total
    c.wait(counted, 10, f"{total} requests counted")
    return got


def wait_heard(c: ProcCluster) -> None:
    """Until the router has heard every recent prompt key each replica holds now."""
    def heard() -> bool:
        members = call(c.nodes[ROUTER].http, "GET", "/v1/cluster")[2]["members"]
        for i in (A, B):
            own = call(c.nodes[i].http, "GET", "/v1/cluster")[2]["members"][i]["affinity"]
            if members[i]["affinity"] != own:
                return False
        return True
    c.wait(heard, 10, "the router to hear the replicas' keys")


def wait_idle(c: ProcCluster) -> None:
    """Until the router has heard both replicas are idle (the load they gossip lags a little
    behind; the routing bound reads it)."""
    def idle() -> bool:
        members = call(c.nodes[ROUTER].http, "GET", "/v1/cluster")[2]["members"]
        return all(members[i]["load"].get("llama", 0) == 0 for i in (A, B))
    c.wait(idle, 10, "both replicas idle, as the router hears it")


def replicas_of(c: ProcCluster) -> list[list[str]] | None:
    st = c.agreed([0, 1, 2])
    if not st or not st["placements"]:
        return None
    p = st["placements"][0]
    return [p["ring"], *[r["ring"] for r in p.get("replicas", [])]]


@pytest.fixture(scope="module")
def replicated(tiny_models, tmp_path_factory):
    c = ProcCluster(tmp_path_factory.mktemp("replicas"))
    try:
        for i in range(3):
            c.start_join(i, str(tiny_models["llama"]),
                         args=["--memory-limit", "1MB" if i == ROUTER else "2GB"])
        c.wait(lambda: replicas_of(c), 90, "3 joins to agree on a placement")
        status, _, body = call(c.nodes[ROUTER].http, "POST", "/v1/cluster/place",
                               {"model": "llama", "replicas": 2})
        assert status == 200, body
        c.wait(lambda: (r := replicas_of(c)) and len(r) == 2, 30, "two replicas")
        rings = replicas_of(c)
        assert sorted(rings) == [["n1"], ["n2"]]  # (which first: the one with more memory)
        c.wait(lambda: all(m.get("ready") for i in (A, B) for m in
                           call(c.nodes[i].http, "GET", "/v1/models")[2]["data"]), 90,
               "both replicas to load")
        assert status_of(c.nodes[ROUTER].http) == 200
        yield c
    finally:
        c.close()


@pytest.mark.cluster
def test_listings_show_each_replica(replicated):
    first, second = replicas_of(replicated)
    _, _, models = call(replicated.nodes[ROUTER].http, "GET", "/v1/models")
    (m,) = models["data"]
    assert m["replicas"] == [{"ring": first, "entry": first[0]},
                             {"ring": second, "entry": second[0]}]
    _, _, st = call(replicated.nodes[ROUTER].http, "GET", "/v1/cluster")
    (p,) = st["placements"]
    assert p["ring"] == first and [r["ring"] for r in p["replicas"]] == [second]
    status, _, err = call(replicated.nodes[ROUTER].http, "POST", "/v1/cluster/place",
                          {"model": "llama", "replicas": 0})
    assert status == 400 and err["error"]["param"] == "replicas"


@pytest.mark.cluster
def test_concurrent_clients_reach_both_replicas(replicated):
    before = [served(replicated, i) for i in (A, B)]
    oai = client(replicated.nodes[ROUTER].http)
    texts: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            r = oai.chat.completions.create(
                model="llama", max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": f"Client {i}: name a colour."}])
            texts[i] = r.choices[0].message.content or ""
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(texts) == 4
    after = served_both(replicated, sum(before) + 4)
    gained = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(gained) == 4 and min(gained) >= 1, gained


@pytest.mark.cluster
def test_a_conversation_stays_where_its_cache_is(replicated):
    oai = client(replicated.nodes[ROUTER].http)
    first = [{"role": "user", "content": "Remember the word lantern, then count to three."}]
    wait_idle(replicated)
    before = [served(replicated, i) for i in (A, B)]
    r1 = oai.chat.completions.create(model="llama", max_tokens=8, temperature=0, messages=first)
    mid = served_both(replicated, sum(before) + 1)
    home = 0 if mid[0] > before[0] else 1  # index into (A, B)
    turns = [*first, {"role": "assistant", "content": r1.choices[0].message.content or "ok"}]
    for question in ("And the word?", "Once more?"):
        turns.append({"role": "user", "content": question})
        r = oai.chat.completions.create(model="llama", max_tokens=8, temperature=0,
                                        messages=turns)
        # the whole first turn's prompt, at least, comes from the cache
        assert r.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1, \
            r.usage
        turns.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})
    after = served_both(replicated, sum(mid) + 2)
    assert after[home] - mid[home] == 2 and after[1 - home] == mid[1 - home]
    # What the home replica finished went into the other's draft memory (the data plane)
    other = (A, B)[1 - home]
    replicated.wait(lambda: draft_memory(replicated, other)["received"] >= 3, 10,
                    "the other replica to receive the conversation's turns")


def draft_memory(c: ProcCluster, i: int) -> dict:
    (m,) = call(c.nodes[i].http, "GET", "/v1/models")[2]["data"]
    return m["draft_memory"]


def as_node(c: ProcCluster, i: int, body: dict) -> dict:
    """A chat request served by node ``i``'s own replica: signed with the cluster secret and
    marked forwarded, as a router node relays it (a relayed request is never routed again)."""
    import http.client
    import json

    from skulkp2p.api.auth import FORWARDED_HEADER, NODE_AUTH_HEADER, NodeAuth

    addr, path = c.nodes[i].http, "/v1/chat/completions"
    data = json.dumps(body).encode()
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, data, {
            "Content-Type": "application/json", FORWARDED_HEADER: "1",
            NODE_AUTH_HEADER: NodeAuth(SECRET).sign("POST", path, addr, data)})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        assert resp.status == 200, out
        return out
    finally:
        conn.close()


@pytest.mark.cluster
def test_what_one_replica_finished_the_other_drafts_from(replicated):
    """A request decoded plain on replica A reaches B's draft memory over the data plane; the
    same request served on B then drafts from what it received, with plain decoding's
    output."""
    ask = {"model": "llama", "max_tokens": 24, "temperature": 0,
           "messages": [{"role": "user", "content": "Recite the lighthouse keeper's log."}]}

    def settled() -> bool:  # everything each replica finished has reached the other
        a, b = draft_memory(replicated, A), draft_memory(replicated, B)
        return (a["to_share"] == b["to_share"] == 0 and a["shared"] == b["received"]
                and b["shared"] == a["received"])
    replicated.wait(settled, 10, "the replicas' draft memories to settle")
    before = draft_memory(replicated, B)
    plain = as_node(replicated, A, {**ask, "speculation": "off"})
    replicated.wait(lambda: draft_memory(replicated, B)["received"] == before["received"] + 1,
                    10, "B to receive what A finished")
    retried = as_node(replicated, B, {**ask, "speculation": {"drafter": "lookup", "depth": 6}})
    assert retried["choices"][0]["message"] == plain["choices"][0]["message"]
    after = draft_memory(replicated, B)
    assert after["drafted_received_tokens"] > before["drafted_received_tokens"], after
    assert retried["speculation"]["accepted"] > 0, retried["speculation"]
    metrics = call(replicated.nodes[B].http, "GET", "/metrics")[2].decode()
    assert (f'skulkp2p_draft_memory_drafted_received_tokens_total{{model="llama"}} '
            f'{after["drafted_received_tokens"]}') in metrics


@pytest.mark.cluster
def test_a_stored_response_is_continued_where_it_is(replicated):
    oai = client(replicated.nodes[ROUTER].http)
    for _ in range(3):  # each time on whichever replica: the next turn must find it there
        wait_idle(replicated)
        first = oai.responses.create(model="llama", input="Name a fruit.", max_output_tokens=8)
        wait_heard(replicated)  # the id of the response, stored where it ran
        nxt = oai.responses.create(model="llama", input="And another?", max_output_tokens=8,
                                   previous_response_id=first.id)
        # (found there: a 404 otherwise; "incomplete" when it stopped at max_output_tokens)
        assert nxt.usage.input_tokens > first.usage.input_tokens


@pytest.mark.cluster
def test_a_replica_killed_mid_stream_errors_clearly_and_the_other_serves(replicated):
    import openai

    oai = client(replicated.nodes[ROUTER].http)
    stream = oai.chat.completions.create(
        model="llama", max_tokens=3000, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Tell a very long story about a lantern."}])
    it = iter(stream)
    next(it)
    serving = [i for i in (A, B)
               if (call(replicated.nodes[i].http, "GET", "/v1/stats")[2].get("models", {})
                   .get("llama", {}).get("in_flight"))]
    assert len(serving) == 1, serving
    victim = serving[0]
    replicated.signal(victim, signal.SIGKILL)
    with pytest.raises(openai.APIError) as e:
        for _ in it:
            pass
    assert "was lost mid-request" in str(e.value.message or e.value)
    other = A if victim == B else B
    before = served(replicated, other)
    r = oai.chat.completions.create(model="llama", max_tokens=8, temperature=0,
                                    messages=[{"role": "user", "content": "Still there?"}])
    assert r.choices[0].message.content is not None
    replicated.wait(lambda: served(replicated, other) == before + 1, 10, "the other replica")
