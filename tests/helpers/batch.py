"""Requests for the batching tests (tests/test_batch*.py): prompts of different lengths, the
same requests served one after another (solo) and all at once (together).

To make requests overlap deterministically, `together` holds the model's lock (a FIFO ticket
lock) while every request queues for it: then they take turns in order and each joins the batch
while the others still decode."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from skulkp2p.engine.batching.scheduler import BatchScheduler
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.runtime.worker import Failed, Finished, ModelWorker, Produced

PROMPTS = ["one two three one two three one two", "the river the river the bird",
           "def f(x):\n    return x\n\ndef g(x):\n    return", "a b c d e f g h a b c d"]
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.8, "top_p": 0.95}}
SPECULATION = {"off": "off", "lookup": {"drafter": "lookup", "depth": 3}}


_models: dict[Path, object] = {}


def loaded(path: Path):
    """A tiny model loaded once per test session (float32), shared by the batching tests."""
    if path not in _models:
        _models[path] = load_model(path, path.name, dtype="float32")
    return _models[path]


def requests(sampling: dict, speculation, n: int = 4) -> list:
    """n requests of different prompts and lengths (rows leave at different steps)."""
    return [parse_request({"id": i, "prompt": PROMPTS[i % len(PROMPTS)],
                           "max_tokens": 10 + 6 * i, "speculation": speculation,
                           **sampling, **({"seed": 5 + i} if sampling else {})})
            for i in range(n)]


def solo(engine: MlxEngine, reqs: list) -> list:
    out = []
    for req in reqs:
        gen = engine.generate(req)
        list(gen)
        out.append(gen.result)
    return out


def together(engine: MlxEngine, reqs: list) -> list:
    """Run `reqs` at once, each on its own thread, every one queued for the model before any
    starts (see the module's docstring)."""
    sched = engine.scheduler
    assert sched is not None
    results: list = [None] * len(reqs)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            gen = engine.generate(reqs[i])
            list(gen)
            results[i] = gen.result
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    run_queued(sched, go, len(reqs))
    assert not errors, errors
    return results


def run_queued(sched, go, n: int) -> None:
    """go(0) .. go(n-1), each in a thread of its own, every one queued on the model's lock
    before any starts (so they join the batch together); each must end within 120 s."""
    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    with sched.lock:
        for k, thread in enumerate(threads, start=2):
            thread.start()
            assert sched.lock.wait_queued(k, timeout=30), "a request never queued"
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a batched request hung"


def worker_run(engine: MlxEngine, body):
    """Start a ModelWorker on `engine` in a fresh event loop and run `body(worker)`."""
    async def main():
        worker = ModelWorker("m", lambda: engine, max_queue=8)
        await worker.start()
        try:
            return await body(worker)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop, 10.0)
    return asyncio.run(main())


async def drain(job) -> tuple[list[int], object]:
    tokens: list[int] = []
    while True:
        event = await job.next(60)
        assert event is not None, "a job hung"
        if isinstance(event, Produced):
            tokens += event.chunk.tokens
        if isinstance(event, Finished | Failed):
            return tokens, event


def rows_joined_by_hand(lm, contexts: list[int]) -> tuple[BatchScheduler, list]:
    """A scheduler with one row per context length, each prefilled with its own tokens and
    joined by hand (no threads: the caller drives the steps with `step_by_hand`)."""
    sched = BatchScheduler(lm.model, len(contexts))
    sched.mixed_chunk = 0  # (rows driven by hand: no prompt may wait for their steps)
    with sched.cond:
        rows = [sched.forward() for _ in contexts]
        for i, (row, n) in enumerate(zip(rows, contexts, strict=True)):
            row.prefill([1 + (7 * i + j) % 200 for j in range(n)])
            sched.join(row)
            row.joined = True
    return sched, rows


def step_by_hand(sched: BatchScheduler, rows: list, tokens: list[list[int]]) -> list:
    """One batched step of `rows` (joined by hand), each submitting its `tokens`: their
    results (logits arrays)."""
    with sched.cond:
        for row, t in zip(rows, tokens, strict=True):
            row.submitted = t
        sched._step()
        out = [row.result for row in rows]
        for row in rows:
            row.result = None
    return out
