"""Requests in flight while a model's placement changes: every one ends (completes, or fails
with a clear error) within a bounded time, never hangs.

The hang these tests pin down: when the leader re-places a model (one node -> a 2-node ring as
a second node joins), the node retires its old worker (`ModelWorker.stop`). Before the fix the
worker cancelled what it held without a word: a running job's generation ended `Cancelled`
(the runner posts nothing then) and waiting jobs were dropped from the queue, so their HTTP
handlers waited forever on an event queue nobody answered (and a request that looked the
worker up just before `stop` was queued on a worker no runner served any more).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.errors import ApiError
from skulkp2p.api.worker import (
    Failed,
    Finished,
    ModelWorker,
    NotReady,
    Produced,
    WorkerStopped,
)
from skulkp2p.engine.mlx_engine import MlxEngine
from skulkp2p.engine.request import parse_request
from tests.helpers.batch import PROMPTS, loaded

LONG = {"max_tokens": 4000, "speculation": "off"}


def test_stopped_worker_fails_running_waiting_and_late_jobs(tiny_models):
    """A worker stopped under a running job and a waiting one: both end Failed(WorkerStopped)
    (503 model_moved over HTTP); a request submitted after the stop is refused at once."""
    engine = MlxEngine(loaded(tiny_models["llama"]), 0, memory_tokens=0, max_batch=1)

    async def main():
        loop = asyncio.get_running_loop()
        worker = ModelWorker("m", lambda: engine, max_queue=8)
        await worker.start()
        endpoint = ModelEndpoint("m", worker)
        running = worker.submit(parse_request({"prompt": PROMPTS[0], **LONG}))
        waiting = endpoint.run_to_end(parse_request({"prompt": PROMPTS[1], **LONG}))
        waiting_task = asyncio.ensure_future(waiting)
        first = None
        while not isinstance(first, Produced):  # the long job is decoding
            first = await running.next(60)
            assert first is not None, "no token within 60 s"
        assert worker.waiting == 1
        stopped = loop.run_in_executor(None, worker.stop, 10.0)
        events = []
        while not events or not isinstance(events[-1], Finished | Failed):
            event = await running.next(30)
            assert event is not None, "the running job hung after its worker stopped"
            events.append(event)
        assert isinstance(events[-1], Failed), events[-1]
        assert isinstance(events[-1].error, WorkerStopped)
        with pytest.raises(ApiError) as waited:
            await asyncio.wait_for(waiting_task, 30)
        assert waited.value.status == 503 and waited.value.code == "model_moved"
        assert "re-placed" in waited.value.message
        assert await stopped
        with pytest.raises(ApiError) as late:
            endpoint.submit(parse_request({"prompt": PROMPTS[2], "max_tokens": 4}))
        assert late.value.status == 503

    asyncio.run(main())


def test_stop_racing_submissions_leaves_no_job_unanswered(tiny_models):
    """Submissions racing a stop from another thread: every job that was accepted gets a final
    event (Finished or Failed) within a bound; the rest were refused with WorkerStopped."""
    engine = MlxEngine(loaded(tiny_models["llama"]), 0, memory_tokens=0, max_batch=2)

    async def main():
        loop = asyncio.get_running_loop()
        for before_stop in (0, 3, 10):
            worker = ModelWorker("m", lambda: engine, max_queue=64)
            await worker.start()
            jobs, refused = [], 0
            stopper = threading.Thread(target=worker.stop, args=(10.0,))
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5.0 and len(jobs) + refused < 40:
                if len(jobs) == before_stop and stopper.ident is None:
                    stopper.start()  # stops while the next submissions arrive
                try:
                    jobs.append(worker.submit(parse_request(
                        {"prompt": PROMPTS[len(jobs) % len(PROMPTS)], "max_tokens": 30})))
                except (WorkerStopped, NotReady):  # refused at once: the client gets a 503
                    refused += 1
                await asyncio.sleep(0)
            await loop.run_in_executor(None, stopper.join)
            assert refused > 0 or len(jobs) == 40
            for job in jobs:
                while True:
                    event = await job.next(30)
                    assert event is not None, "a job accepted before the stop hung"
                    if isinstance(event, Finished | Failed):
                        break
            await loop.run_in_executor(None, worker.stop, 1.0)

    asyncio.run(main())
