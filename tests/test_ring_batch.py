"""Batched pipeline rings (engine/parallel/ring/batch_rows.py): the rows of several requests cross the ring in
ONE frame per step, each stage runs them as one forward over its rows' caches, and every
request decodes exactly what it decodes alone on the ring and on one node (greedy and seeded;
speculation off, lookup, MTP). A finished or cancelled request's row is freed on every stage at
once; a stage that drops the batch's frame ends every request of the batch with a clear error.

Stages run in this process behind an InProcessLink (every frame through the wire codec), as in
test_rings.py; the requests overlap deterministically as in test_batch.py (the model's lock is
held while they all queue)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from skulkp2p.engine.model.stage import StageModel
from skulkp2p.engine.parallel.ring.traversal import RingError, StageWorker
from skulkp2p.engine.protocol import Cancelled
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.batch import requests, solo, together
from tests.helpers.rings import Ring, full, stages

SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.8, "top_p": 0.95}}
SPECULATION = {"off": "off", "lookup": {"drafter": "lookup", "depth": 3},
               "mtp": {"drafter": "mtp", "depth": 2}}


@pytest.fixture(scope="module")
def llama(tiny_model) -> Path:
    return tiny_model("llama", seed=0, mtp=True)


def _same(got, want) -> None:
    for a, b in zip(want, got, strict=True):
        assert b.tokens == a.tokens
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("spec", list(SPECULATION))
def test_batched_ring_matches_solo_ring_and_one_node(llama, n, sampling, spec):
    reqs = requests(SAMPLINGS[sampling], SPECULATION[spec])
    node = solo(MlxEngine(full(llama), 0, memory_tokens=0, max_batch=1), reqs)
    ring = Ring(stages(llama, n))
    alone = ring.engine(1)
    assert alone.scheduler is None
    _same(solo(alone, reqs), node)
    engine = ring.engine(4)
    assert engine.max_concurrent == 4
    batched = together(engine, reqs)
    _same(batched, node)
    sched = engine.scheduler
    through = sched.through
    assert sched.peak == 4 and through.peak == 4  # every row crossed the ring in one frame
    assert through.traversals == sched.steps  # one traversal per batched step, not per row
    assert not sched.active and ring.held() == [0] * (n - 1)  # every row freed everywhere
    if spec != "off":
        drafted = [r.speculation.drafted for r in batched]
        assert sum(drafted) > 0 and sched.ragged > 0  # rows of different widths in a frame
        assert drafted == [r.speculation.drafted for r in node]


def test_prefix_cache_restores_on_every_stage_in_a_batch(llama):
    """Rows store their caches on every stage when they end (their rows extracted from the
    stages' batches); later requests on the same prompts restore them, all stages, in a batch."""
    reqs = requests({}, {"drafter": "lookup", "depth": 3})
    node = solo(MlxEngine(full(llama), 0, memory_tokens=0, max_batch=1), reqs)
    ring = Ring(stages(llama, 3), prefix_mb=64)
    engine = ring.engine(4, prefix_mb=64)
    _same(together(engine, reqs), node)
    again = together(engine, reqs)
    _same(again, node)
    assert all(r.usage.cached_tokens > 0 for r in again)  # every stage restored its entry
    assert ring.held() == [0, 0]


def test_a_cancelled_row_is_freed_on_every_stage_within_a_step(llama):
    ring = Ring(stages(llama, 3))
    engine = ring.engine(2)
    sched = engine.scheduler
    long = parse_request({"prompt": "one two three one two", "max_tokens": 200,
                          "speculation": "off"})
    short = parse_request({"prompt": "the river the bird", "max_tokens": 30,
                           "speculation": {"drafter": "lookup", "depth": 3}})
    reference = solo(MlxEngine(full(llama), 0, memory_tokens=0, max_batch=1), [short])[0]
    a = engine.generate(long)
    seen = []

    def other() -> None:
        gen = engine.generate(short)
        list(gen)
        seen.append(gen.result)

    thread = threading.Thread(target=other)
    stream = iter(a)
    next(stream)  # a decodes
    thread.start()
    for _ in range(200):  # bounded: until both rows are in the stages' batch
        next(stream)
        if ring.workers[0].rows is not None and len(ring.workers[0].rows.requests) == 2:
            break
    assert all(len(w.rows.requests) == 2 for w in ring.workers)
    gone = ring.forwards[0].request
    with sched.cond:  # between two steps
        at = sched.steps
        a.cancel()
    with pytest.raises(Cancelled):
        for _ in range(10):  # (the check comes before the row's next token)
            next(stream)
    # The row left here, and its end frame freed it on every stage, before another step.
    assert all(gone not in w.rows.requests and gone not in w.sessions for w in ring.workers)
    assert sched.leaves[0] - at <= 1  # (a step already under way when it was cancelled)
    thread.join(60)
    assert not thread.is_alive()
    assert seen[0].tokens == reference.tokens  # the other row went on undisturbed
    assert sched.leaves[0] - at <= 1
    assert ring.held() == [0, 0]


def test_a_stage_dropping_the_frame_ends_every_row_with_a_clear_error(llama):
    ring = Ring(stages(llama, 2))
    engine = ring.engine(4)
    reqs = requests({}, "off", n=3)
    ring.workers[0].term = 4  # the stage moved on to another placement: frames dropped
    errors: list[BaseException] = []

    def go(req) -> None:
        try:
            list(engine.generate(req))
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a request hung on a broken ring"
    assert len(errors) == 3
    assert all("dropped the frame" in str(e) for e in errors), errors
    # Typed, so the API answers 503 ring_failed (retry), not a 500 as for a bug.
    assert all(isinstance(e, RingError) for e in errors), errors
    # The ring recovers: the stage back on the term, the next batch starts afresh.
    ring.workers[0].term = 3
    node = solo(MlxEngine(full(llama), 0, memory_tokens=0, max_batch=1), reqs)
    _same(together(engine, reqs), node)


def test_hybrid_models_stay_one_request_at_a_time_on_rings(tiny_model):
    """qwen3_5 cut so that the last stage holds only attention layers: its engine still serves
    one request at a time (the first stage's layers hold recurrent state), and a batch frame
    sent to that first stage anyway is dropped."""
    from skulkp2p.engine.parallel.ring.traversal import header

    path = tiny_model("qwen3_5", seed=0)
    parts = stages(path, 3)
    from mlx_lm.models.cache import KVCache, make_prompt_cache
    assert all(type(c) is KVCache for c in make_prompt_cache(parts[-1].model))
    ring = Ring(parts)
    engine = ring.engine(4)
    assert engine.max_concurrent == 1 and engine.scheduler is None
    first = ring.workers[0]
    row = {"request": "a", "instance": "i", "step": 0, "w": 1, "rollback": None,
           "store": None}
    assert first.handle({**header(3, "i", "b", 0, "batch"), "at": 0, "rows": [row],
                         "x": [[1]]}) is None
    assert first.dropped == 1


def test_bad_batch_frames_are_dropped(llama):
    from skulkp2p.engine.parallel.ring.traversal import header

    parts = stages(llama, 3)
    first = StageWorker(StageModel(parts[0].model, parts[0].span), term=4)
    row = {"request": "a", "instance": "i", "step": 0, "w": 2, "rollback": None,
           "store": None}
    ok = {**header(4, "i", "b1", 0, "batch"), "at": 0, "rows": [row], "x": [[1, 2]]}
    bad = [
        {**ok, "step": 1},  # a batch this stage never started, mid-way
        {**ok, "rows": []},  # no rows
        {**ok, "x": [[1]]},  # a row narrower than it says
        {**ok, "rows": [row, row], "x": [[1, 2], [1, 2]]},  # one request twice
        {**ok, "rows": [{**row, "step": 3}]},  # a request this stage does not know, mid-way
    ]
    for msg in bad:
        assert first.handle(msg) is None
    assert first.dropped == len(bad)
    out = first.handle(ok)
    assert out is not None and out["x"]["shape"][:2] == [1, 2]
    assert first.handle(ok) is None  # replayed step
    assert first.handle({**ok, "step": 1, "rows": [{**row, "step": 1, "instance": "x"}]}) \
        is None  # another sender's request under the same id
    middle = StageWorker(StageModel(parts[1].model, parts[1].span), term=4)
    assert middle.handle({**out, "x": "junk"}) is None  # bad hidden rows
    assert middle.handle(out)["x"]["shape"][:2] == [1, 2]


# ------------------------------------------------------------------------------------------
# Real processes: two `join` nodes on 127.0.0.x with --max-batch 4, the ring placed with
# POST /v1/cluster/place; four requests at once through it decode what each decodes alone on
# one node.

ARMS = [{"speculation": "off"},
        {"speculation": {"drafter": "lookup", "depth": 4}},
        {"speculation": {"drafter": "mtp", "depth": 2}},
        {"temperature": 0.8, "top_p": 0.95, "seed": 11,
         "speculation": {"drafter": "lookup", "depth": 3}}]


def _generate(addr: str, i: int) -> dict:
    """Request i (prompt i, arm i) on the model "llama"; retried while a placement loads."""
    import time

    from tests.helpers.batch import PROMPTS
    from tests.helpers.http_client import call

    body = {"model": "llama", "prompt": PROMPTS[i], "max_tokens": 24 + 4 * i, **ARMS[i]}
    # Bounded in time, not in tries (503 while the placement loads): on a loaded box one model
    # load took 26 s, and 60 tries (~30 s) could end before the stages loaded.
    deadline = time.monotonic() + 120
    status, out = 0, None
    while time.monotonic() < deadline:
        try:
            status, _, out = call(addr, "POST", "/v1/cluster/generate", body, timeout=60)
        except OSError:
            status, out = 0, None
        if status == 200 and "re-placed" not in str(out.get("error")):
            return out
        time.sleep(0.1)  # 503 while a placement loads
    raise AssertionError(f"no answer from {addr}: {status} {out}")


@pytest.mark.cluster
@pytest.mark.slow
def test_ring_of_processes_batches_requests_exactly(llama, tmp_path):
    from tests.helpers.batch import PROMPTS
    from tests.helpers.http_client import call, status_of
    from tests.helpers.procs import ProcCluster, loopback_ips_usable

    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    c = ProcCluster(tmp_path, env={"SKULKP2P_RING_TIMEOUT": "20"})
    try:
        for i in range(2):
            c.start_join(i, str(llama), args=["--memory-limit", "2GB", "--max-batch", "4",
                                              "--timers", "probe=0.2,suspect=1,election=1"])
        c.wait(lambda: (s := c.agreed([0, 1])) and s["placements"], 90, "a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90, "health")
        http = c.nodes[0].http

        def place(ring: list[str]) -> None:
            status, _, out = call(http, "POST", "/v1/cluster/place",
                                  {"model": "llama", "nodes": ring})
            assert status == 200, out
            c.wait(lambda: (s := c.agreed([0, 1])) and any(
                p["model"] == "llama" and p["ring"] == ring for p in s["placements"]), 30,
                f"llama on {ring}")

        place(["n1"])
        alone = [_generate(http, i) for i in range(len(ARMS))]
        assert alone[2]["speculation"]["drafted"] > 0  # the MTP head drafts
        place(["n0", "n1"])
        _generate(http, 0)  # the ring is loaded and serving
        got: list = [None] * len(ARMS)

        def go(i: int) -> None:
            got[i] = _generate(http, i)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(ARMS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a request hung on the ring"
        for i, (a, b) in enumerate(zip(alone, got, strict=True)):
            assert b["tokens"] == a["tokens"], (i, b)
            assert b["text"] == a["text"]
        # The first stage dies under three long requests streaming together from the last
        # stage: every one of them ends with the ring's error, none hangs.
        import http.client
        import json
        import signal

        host, port = c.nodes[1].http.rsplit(":", 1)
        started = [threading.Event() for _ in range(3)]
        ended: list = [None] * 3

        def long(i: int) -> None:
            body = {"model": "llama", "prompt": PROMPTS[i], "max_tokens": 3000,
                    "speculation": "off", "stream": True}
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                conn.request("POST", "/v1/completions", json.dumps(body),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                first = resp.readline()  # the first event: the request is decoding
                started[i].set()
                ended[i] = first + resp.read()
            except OSError as e:
                ended[i] = f"client: {e}".encode()
            finally:
                started[i].set()
                conn.close()

        threads = [threading.Thread(target=long, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        c.wait(lambda: all(e.is_set() for e in started), 60, "three requests streaming")
        assert not any(ended), ended  # all three were still decoding
        c.signal(0, signal.SIGKILL)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a request hung on a dead stage"
        for out in ended:
            assert b'"error"' in out and b"ring of llama" in out, out[-500:]
    finally:
        c.close()

