"""Continuous batching (engine/batching/scheduler.py, engine/cache/batch_cache.py): requests decoded together
give each request exactly what it gives served alone (tokens and text; greedy and seeded
sampling; speculation off, lookup, the MTP head), whatever else is in the batch; rows join and
leave at any step; the prefix cache and the draft memory keep working; the worker admits up to
max_batch jobs first come first served, and a cancelled job's row leaves within one step.

To make requests overlap deterministically, a test holds the model's lock (a FIFO ticket lock)
while every request queues for it: then they take turns in order and each joins the batch while
the others still decode."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from skulkp2p.engine.batching import scheduler
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.runtime.worker import Finished, Produced
from tests.helpers.batch import (
    PROMPTS,
    SAMPLINGS,
    SPECULATION,
    drain,
    loaded,
    requests,
    solo,
    together,
    worker_run,
)
from tests.helpers.loaded import smollm2_float32
from tests.helpers.tiny_model import make_tiny_model

_loaded = loaded


@pytest.fixture(scope="module")
def mtp_llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("batch-mtp") / "llama", seed=0,
                           mtp=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("spec", list(SPECULATION))
def test_batched_requests_match_solo(tiny_models, family, sampling, spec, monkeypatch):
    # every ragged step runs its MLPs packed too (engine/model/packed.py), however little it pads
    monkeypatch.setattr(scheduler, "PACK_MLPS_FROM", 0)
    lm = _loaded(tiny_models[family])
    reqs = requests(SAMPLINGS[sampling], SPECULATION[spec])
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    assert engine.max_concurrent == 4
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
    sched = engine.scheduler
    assert sched.peak == 4  # every request decoded in one batch at some step
    assert list(sched.leaves) and not sched.active  # rows left at their own ends
    if spec == "lookup":
        drafted = sum(r.speculation.drafted for r in batched)
        assert drafted > 0 and sched.ragged > 0  # rows of different widths in one forward
        # ... which ran their MLPs and head on the real tokens only (engine/model/packed.py)
        assert sched.packed_steps > 0 and sched.padding_skipped > 0
        assert [r.speculation.drafted for r in batched] == [
            r.speculation.drafted for r in alone]


def test_a_row_with_nothing_prefilled_joining_first_keeps_the_rows_aligned():
    """A one-token prompt prefills nothing: its row joins before any buffer exists. A row
    joining after it, before a step writes, must be row 1 of the buffer, not row 0."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from skulkp2p.engine.cache.batch_cache import RowLengths, RowsKVCache

    rows = RowLengths()
    layer = RowsKVCache(rows)
    layer.append_row(KVCache(), 0)
    rows.set([0])
    single = KVCache()
    keys = mx.arange(2 * 5 * 4, dtype=mx.float32).reshape(1, 2, 5, 4)
    single.update_and_fetch(keys, keys + 1)
    layer.append_row(single, 5)
    rows.set([0, 5])
    assert layer.keys.shape[0] == 2
    assert mx.array_equal(layer.keys[1:, :, :5], keys).item()
    assert mx.array_equal(layer.values[1:, :, :5], keys + 1).item()


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_batched_mtp_rows_match_solo(mtp_llama, sampling, monkeypatch):
    """Each row drafts with its own MTP head, which reads its row's hidden states (of ragged
    steps run packed too: engine/model/packed.py)."""
    monkeypatch.setattr(scheduler, "PACK_MLPS_FROM", 0)
    lm = _loaded(mtp_llama)
    reqs = requests(SAMPLINGS[sampling], {"drafter": "mtp", "depth": 2})
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
        assert (b.speculation.drafted, b.speculation.accepted) == (
            a.speculation.drafted, a.speculation.accepted)
    assert sum(r.speculation.drafted for r in batched) > 0
    assert engine.scheduler.peak == 4
    assert engine.scheduler.prefill_peak >= 2  # hidden rows of prompts prefilled together
    assert engine.scheduler.packed_steps > 0


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_prompts_prefilled_together_match_solo(tiny_models, sampling, monkeypatch):
    """Requests that arrive together prefill in ONE forward per chunk round (ragged prompts,
    right padding; one of them resumes from a prefix-cache hit, so rows start at different
    lengths) and each decodes exactly what it decodes alone."""
    monkeypatch.setattr(scheduler, "PACK_MLPS_FROM", 0)  # ragged chunks' MLPs packed
    base = _loaded(tiny_models["llama"])
    lm = dataclasses.replace(base, runtime={**base.runtime, "prefill_step": 8})
    prompts = [PROMPTS[0] + " four five six seven eight", " ".join(PROMPTS),
               PROMPTS[2] + " " + PROMPTS[3], PROMPTS[1]]
    reqs = [parse_request({"prompt": p, "max_tokens": 12, **SAMPLINGS[sampling],
                           **({"seed": 3 + i} if SAMPLINGS[sampling] else {})})
            for i, p in enumerate(prompts)]
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 64, memory_tokens=0, max_batch=4)
    # The prefix cache keeps the start of the first prompt: that request restores it first.
    solo(engine, [parse_request({"prompt": PROMPTS[0], "max_tokens": 2})])
    chunks = [-(-(len(lm.tokenizer.encode(p)) - 1) // 8) for p in prompts]
    sched = engine.scheduler
    before = sched.prefills
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
        assert b.text == a.text
    assert batched[0].usage.cached_tokens > 0  # the hit: its row joined the forward at its length
    assert sched.prefill_peak == 4  # the four prompts' first chunks ran as one forward
    assert sched.packed_prefills > 0  # ragged chunks: MLPs on their real tokens (packed.py)
    # Fewer prefill forwards than the chunks the prompts hold (each alone runs one forward per
    # chunk).
    assert sched.prefills - before < sum(chunks)


def test_batch_logits_close_to_solo_not_bitwise(tiny_models):
    """Is the batched forward batch-invariant bit for bit? On float32 OpenBLAS, no: a product
    over a batch of rows may round differently from the same row alone (the same size of
    difference as a verify of k+1 rows against k+1 single steps); what the tests above check is
    what a client sees, the tokens. This records the size of the difference."""
    lm = _loaded(tiny_models["llama"])
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    sched = engine.scheduler
    prompts = [[1, 5, 9, 12, 40, 41, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 2, 2], [8, 9]]
    feeds = [[17], [23, 24, 25], [31, 32]]
    alone = []
    for prompt, feed in zip(prompts, feeds, strict=True):
        forward = LocalForward(lm.model)
        forward.prefill(prompt)
        alone.append(np.array(forward(feed)))
    sched.mixed_chunk = 0  # (rows driven by hand: no prompt may wait for their steps)
    rows = [sched.forward() for _ in prompts]
    with sched.cond:  # three rows in one step, driven by hand (no decode loop here)
        for row, prompt, feed in zip(rows, prompts, feeds, strict=True):
            row.prefill(prompt)
            sched.join(row)
            row.joined = True
            row.submitted = list(feed)
        sched._step()
        results = [np.array(row.result) for row in rows]
        for row in rows:
            row.close()
    assert sched.peak == 3
    for a, b in zip(alone, results, strict=True):
        assert a.shape == b.shape
        assert (a.argmax(-1) == b.argmax(-1)).all()
        assert np.abs(a - b).max() < 1e-4


def test_tensor_groups_serve_one_at_a_time(tiny_models):
    # A tensor-parallel group's loop member (its forward reaches the ranks; it holds no span
    # of layers) is not batched. (A ring's last stage is: test_ring_batch.py.)
    group = dataclasses.replace(_loaded(tiny_models["llama"]),
                                make_forward=lambda req, hidden, interrupt: None)
    assert MlxEngine(group, 0, max_batch=8).max_concurrent == 1


def test_card_max_batch_and_bad_values(tiny_models):
    lm = _loaded(tiny_models["llama"])
    assert MlxEngine(lm, 0, max_batch=3).max_concurrent == 3
    assert MlxEngine(lm, 0, max_batch=1).scheduler is None
    with pytest.raises(ValueError, match="max_batch"):
        MlxEngine(lm, 0, max_batch=0)


def test_prefix_cache_and_memory_in_a_batch(tiny_models):
    """A hit restores into the request's row and the entry is stored from its row at the end:
    the next turn, decoded in a batch, hits and decodes what a cold solo engine decodes."""
    lm = _loaded(tiny_models["llama"])
    cold = MlxEngine(lm, 0, memory_tokens=0, max_batch=1)
    engine = MlxEngine(lm, 64, max_batch=4)
    first = parse_request({"prompt": PROMPTS[0], "max_tokens": 12})
    r1 = together(engine, [first, *requests({}, "off", 2)])[0]
    follow = parse_request({"prompt": PROMPTS[0] + r1.text + " again", "max_tokens": 12})
    others = requests({"temperature": 0.8}, {"drafter": "lookup", "depth": 3}, 3)
    batched = together(engine, [follow, *others])
    assert batched[0].usage.cached_tokens > 0
    assert batched[0].tokens == solo(cold, [follow])[0].tokens
    assert engine.memory.enabled and engine.scheduler.peak == 4


_worker_run, _drain = worker_run, drain  # (tests/helpers/batch.py)


def test_worker_admits_up_to_max_batch_first_come_first_served(tiny_models):
    lm = _loaded(tiny_models["llama"])
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=2)
    reqs = [parse_request({"prompt": PROMPTS[i], "max_tokens": n})
            for i, n in enumerate((8, 40, 8, 8))]
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)

    def native_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    async def body(worker):
        assert worker.max_concurrent == 2
        jobs = [worker.submit(req) for req in reqs]
        done = await asyncio.gather(*[_drain(job) for job in jobs])
        # The same runners serve the next jobs: MLX keeps a native thread per thread that ran
        # it, so a thread per job would grow this by one per job.
        before = native_threads()
        again = await asyncio.gather(*[_drain(worker.submit(req)) for req in reqs])
        assert native_threads() == before
        assert [t for t, _ in again] == [t for t, _ in done]
        return done

    done = _worker_run(engine, body)
    for (tokens, event), a in zip(done, alone, strict=True):
        assert isinstance(event, Finished) and tokens == a.tokens
    assert engine.scheduler.peak == 2  # never more rows than max_batch


def test_worker_cancel_frees_the_row_within_one_step(tiny_models):
    lm = _loaded(tiny_models["llama"])
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=2)
    sched = engine.scheduler
    long = {"max_tokens": 200, "speculation": "off"}

    async def body(worker):
        a = worker.submit(parse_request({"prompt": PROMPTS[0], **long}))
        b = worker.submit(parse_request({"prompt": PROMPTS[1], **long}))
        c = worker.submit(parse_request({"prompt": PROMPTS[2], "max_tokens": 5}))
        seen = 0
        while seen < 3:  # a decodes beside b
            event = await a.next(60)
            assert event is not None
            seen += isinstance(event, Produced)
        assert worker.waiting == 1  # c waits for a free row
        with sched.cond:  # (between two steps)
            at = sched.steps
            a.cancel()
        tokens, event = await _drain(c)  # admitted into the row a left
        assert isinstance(event, Finished) and len(tokens) == 5
        b.cancel()
        return at

    at = _worker_run(engine, body)
    assert sched.leaves[0] - at <= 1
    assert not sched.active


def test_long_prompt_prefills_between_decode_steps(tiny_models):
    """A prompt of several chunks joins while another request decodes: that request takes a
    step between every two chunks, and both decode what they decode alone. (The two prompts'
    first chunks prefill together; the short one has then not joined the batch yet, so the
    long one's second chunk may go without a step before it.)"""
    lm = dataclasses.replace(_loaded(tiny_models["llama"]),
                             runtime={**_loaded(tiny_models["llama"]).runtime,
                                      "prefill_step": 8})
    reqs = [parse_request({"prompt": PROMPTS[1], "max_tokens": 40}),
            parse_request({"prompt": " ".join(PROMPTS), "max_tokens": 10})]
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=2)
    rows: list = []
    make = engine.scheduler.forward
    engine.scheduler.forward = lambda *a: rows.append(make(*a)) or rows[-1]
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
    chunks = -(-len(lm.tokenizer.encode(" ".join(PROMPTS))) // 8)
    assert chunks >= 4 and chunks - 2 <= rows[1].prefill_waits <= chunks - 1
    assert rows[0].prefill_shared == rows[1].prefill_shared == 2


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["off", "auto"])
def test_real_model_batch_matches_solo(spec):
    """SmolLM2-135M (with its MTP head: auto drafts with lookup and the head): four requests,
    greedy and seeded, decoded together give what each gives alone. (16 tokens: one row ends
    at EOS before the others; auto's drafts are accepted and rejected, asserted.)"""
    lm = smollm2_float32()
    questions = ["Write a haiku about rain.", "Explain what a linked list is.",
                 "Rewrite with type hints:\ndef add(a, b):\n    return a + b\n",
                 "Name three rivers in Europe."]
    reqs = [parse_request({"messages": [{"role": "user", "content": q}], "max_tokens": 16,
                           "speculation": spec, **({"temperature": 0.7, "seed": i} if i % 2
                                                   else {})})
            for i, q in enumerate(questions)]
    alone = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs)
    engine = MlxEngine(lm, 0, memory_tokens=0, max_batch=4)
    batched = together(engine, reqs)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens and b.text == a.text
    assert engine.scheduler.peak == 4
    assert engine.scheduler.prefill_peak == 4  # the four chat prompts shared a prefill forward
    assert len({len(b.tokens) for b in batched}) > 1  # rows left at different steps
    if spec == "auto":
        drafted = sum(b.speculation.drafted for b in batched)
        assert 0 < sum(b.speculation.accepted for b in batched) < drafted


def test_drafting_backs_off_among_plain_rows_and_drafts_with_drafting_rows():
    """The measured cost table makes a draft that pays alone (acceptance 0.6) not pay in a
    batch of 8 plain rows (its extra width widens every row's forward for its own gain); it
    pays when the other rows draft too (all widening together), and for free up to the width
    the others already verify. The gate backs off for the round, drafts again once the batch
    says so, and a seeded sampled request's gate ignores the batch."""
    from skulkp2p.engine.batching.batch_view import SOLO, BatchView
    from skulkp2p.engine.batching.row_forward import RowForward
    from skulkp2p.engine.drafting.drafter import InnerDrafter
    from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS, DepthController, GatedDrafter

    costs = DEFAULT_WIDTH_COSTS["float32"]
    controller = DepthController(costs, 4, prior_accept=0.6)
    plain_rows = BatchView((1,) * 7, drafting=0)
    assert controller.best_depth(4, SOLO)[0] > 0
    assert controller.best_depth(4, plain_rows)[0] == 0
    # The same 7 rows at width 1 but drafting rows (they backed off this round): together.
    assert controller.best_depth(4, BatchView((1,) * 7, drafting=7))[0] > 0
    # One plain row already verifies 3 tokens: widening to 3 costs nothing more.
    depth, gain = controller.best_depth(4, BatchView((3,) + (1,) * 6, drafting=0))
    assert depth >= 2 and gain > 1.0
    # A drafter with a cost of its own (a head: a quarter of a trunk step per draft) pays
    # alone, but not in a batch of 4: the batch shares the trunk's forward, not the drafters.
    head = DepthController(costs, 4, prior_accept=0.45, prior_weight=1e6, draft_cost=0.25)
    assert head.best_depth(4, SOLO)[0] > 0
    assert head.best_depth(4, BatchView((1,) * 3, drafting=3))[0] == 0
    # A low acceptance does not pay even when free: nothing gained, the drafting costs.
    poor = DepthController(costs, 4, prior_accept=0.05, draft_cost=0.2)
    assert poor.best_depth(4, BatchView((3,) * 7, drafting=7))[0] == 0

    class Lookup(InnerDrafter):
        name = "lookup"

        def propose(self, history, k):
            return [7] * k, None

    class Row(RowForward):  # what a batch row shows a drafter: the other rows of its forward
        view = plain_rows

        def __init__(self):
            self.drafts = False

        def batch_view(self):
            return self.view

    row = Row()
    gated = GatedDrafter(Lookup(), costs, 4, prior_accept=0.6)
    gated.begin([1, 2], row)
    assert row.drafts  # the gate told the row it drafts (the other rows' gates count it)
    assert gated.propose([1, 2], 4) == ([], None) and gated.on and not gated.events
    row.view = SOLO
    assert gated.propose([1, 2], 4)[0]
    fixed = GatedDrafter(Lookup(), costs, 4, prior_accept=0.6, weigh_batch=False)
    row.view = plain_rows
    fixed.begin([1, 2], row)
    assert fixed.propose([1, 2], 4)[0]


def test_ticket_lock_hands_over_in_arrival_order():
    """The model's lock goes to its waiters in the order they asked (a release hands it to the
    oldest waiter), works under a Condition, and refuses a release by a thread not holding it."""
    from skulkp2p.engine.batching.scheduler import TicketLock
    lock = TicketLock()
    cond = threading.Condition(lock)
    order: list[int] = []

    def take(i: int) -> None:
        with cond:
            order.append(i)
            cond.notify_all()

    threads = [threading.Thread(target=take, args=(i,)) for i in range(6)]
    with lock:
        for n, thread in enumerate(threads, start=2):
            thread.start()
            assert lock.wait_queued(n, timeout=30)
        assert lock.queued == 7
        errors: list[BaseException] = []
        other = threading.Thread(target=_record, args=(errors, lock.release))
        other.start()
        other.join(30)
        assert len(errors) == 1 and "does not hold" in str(errors[0])
    with cond:
        assert cond.wait_for(lambda: len(order) == 6, timeout=30)
    for thread in threads:
        thread.join(30)
    assert order == list(range(6)) and lock.queued == 0
    assert lock.acquire(blocking=False) and lock.queued == 1
    lock.release()


def _record(errors: list[BaseException], call) -> None:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the test reads it
        errors.append(e)


def test_prefill_chunks_pack_by_width():
    """Chunks that arrive together share a forward only while padding them to the widest costs
    at most PREFILL_PADDING_BOUND of their tokens; the narrowest go first."""
    from skulkp2p.engine.batching.scheduler import PrefillChunk, _packed
    chunks = [PrefillChunk(None, [0] * w) for w in (8, 2, 8, 3, 8, 512)]  # type: ignore[arg-type]
    assert [[len(c.tokens) for c in g] for g in _packed(chunks)] == [[2, 3], [8, 8, 8], [512]]
    assert _packed([]) == []
