"""One worker per model: it loads the model's engine on its thread, then runs up to
`engine.max_concurrent` generations at once (1: one at a time, as a FIFO), each off the event
loop (MLX calls block for a whole forward), admitted first come first served.

The loop side submits a `Job` and reads its typed events from an asyncio queue; the threads post
them with `call_soon_threadsafe`. The worker's own thread and max_concurrent - 1 more each run
one job at a time (the MLX engine decodes their generations together in one batched forward per
step: engine/batching/scheduler.py). Cancelling a job
(its client went away) cancels its `Generation`, whose interrupt check the engine calls between
prefill chunks and between decode rounds, so its slot is free for the next job within one
forward; a job cancelled while still queued is dropped from the queue at once. An engine that
`runs_on_loop` (a llama-server proxy only waits on sockets) is the exception to "off the event
loop": the job's thread hands it to the loop and waits (`_relay_on_loop`), so up to
max_concurrent relays run on the loop at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from skulkp2p.engine.protocol import (
    Cancelled,
    Engine,
    Generation,
    LoopEngine,
    RingError,
    TensorError,
)
from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.engine.results import Chunk, GenerationResult
from skulkp2p.telemetry import RequestFinished, RequestStarted, Telemetry

log = logging.getLogger("skulkp2p.worker")


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"{waiting} requests are already waiting for this model")
        self.retry_after = retry_after


class NotReady(Exception):
    """The model is still loading (or failed to load, or its worker stopped)."""


class WorkerStopped(Exception):
    """The worker stopped (its model was re-placed away from this node, or the node is
    stopping) before or while it ran the job: the client may retry, the model is served
    elsewhere or again shortly."""


class RingFailed(Exception):
    """The model's ring of nodes broke under the job (a member died, froze or was re-placed):
    transient, the leader re-places the model, so the client may retry."""

    def __init__(self, model_id: str, cause: RingError):
        super().__init__(f"model {model_id}: its ring of nodes broke ({cause}); the model is "
                         "being re-placed, retry")
        self.model_id = model_id


class TensorGroupFailed(Exception):
    """The model's tensor-parallel group broke under the job (a member died or froze, or the
    group was torn down by a re-placement): transient like a broken ring, the client may
    retry once the leader placed the model again."""

    def __init__(self, model_id: str, cause: TensorError):
        super().__init__(f"model {model_id}: its tensor-parallel group broke ({cause}); the "
                         "model is being re-placed, retry")
        self.model_id = model_id


# ---- a job's events, in order: Started, Produced per chunk, then Finished or Failed ----------

@dataclass(frozen=True)
class Started:
    """Sent with the first chunk (or at the end of an empty generation)."""
    prompt_tokens: int


@dataclass(frozen=True)
class Produced:
    chunk: Chunk


@dataclass(frozen=True)
class Finished:
    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    error: BaseException


JobEvent = Started | Produced | Finished | Failed


class Job:
    _ids = itertools.count(1)

    def __init__(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.id = next(self._ids)
        self.req = req
        self.loop = loop
        self.events: asyncio.Queue[JobEvent] = asyncio.Queue()
        self.generation: Generation | None = None  # set by the worker thread when it starts
        self.cancelled = threading.Event()
        self.finished = False  # set on the loop side when a final event was read
        self._worker: ModelWorker | None = None

    # -- loop side --
    async def next(self, timeout: float | None = None) -> JobEvent | None:
        """The next event, or None when `timeout` passed first."""
        events = self.events
        if not events.empty():
            event = events.get_nowait()
        else:
            # asyncio.timeout, not wait_for: on 3.11 wait_for wraps the get in a new Task, per
            # token of every stream.
            try:
                async with asyncio.timeout(timeout):
                    event = await events.get()
            except TimeoutError:
                return None
        if isinstance(event, Finished | Failed):
            self.finished = True
        return event

    def cancel(self) -> None:
        """Give up on this job (idempotent, safe after it finished)."""
        if self.finished or self.cancelled.is_set():
            return
        self.cancelled.set()
        generation = self.generation
        if generation is not None:
            generation.cancel()
        if self._worker is not None:
            self._worker._dequeue(self)

    # -- thread side --
    def post(self, event: JobEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the node is stopping
            pass


class ModelWorker:
    telemetry: Telemetry | None = None  # records the jobs (dashboard, /metrics)

    def __init__(self, model_id: str, load: Callable[[], Engine], max_queue: int = 16):
        self.model_id = model_id
        self.max_queue = max_queue
        self._load = load
        self.state = "loading"  # loading | ready | failed | stopped
        self.load_error: BaseException | None = None
        self.engine: Engine | None = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.running: list[Job] = []  # admitted, in admission order
        self._job_threads: list[threading.Thread] = []  # the runners beside the worker's own
        self._avg_job_s = 2.0
        self._thread = threading.Thread(target=self._main, name=f"model-{model_id}", daemon=True)
        self._ready: asyncio.Future[Engine] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- loop side -------------------------------------------------------------------------

    def start(self) -> asyncio.Future[Engine]:
        """Start the thread; the future resolves when the model is loaded (or fails)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread.start()
        return self._ready

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def current(self) -> Job | None:
        """The oldest job running now (None: the model is idle)."""
        running = self.running
        return running[0] if running else None

    @property
    def max_concurrent(self) -> int:
        """Jobs run at once: the engine's (1 until it is loaded, and for an engine that does
        not say)."""
        engine = self.engine
        return max(1, int(getattr(engine, "max_concurrent", 1))) if engine is not None else 1

    def submit(self, req: GenerationRequest) -> Job:
        if self.state != "ready":
            raise NotReady(self.state)
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._stopping:  # stopped after the caller looked it up: no runner takes it
                raise WorkerStopped(f"model {self.model_id} stopped on this node (it was "
                                    "re-placed, or the node is stopping); retry")
            if len(self._waiting) >= self.max_queue:
                retry = max(1, round(self._avg_job_s * (len(self._waiting) + 1) / 2))
                raise QueueFull(len(self._waiting), retry)
            job = Job(req, loop)
            job._worker = self
            self._waiting.append(job)
            self._cond.notify()
        return job

    def _dequeue(self, job: Job) -> None:
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                pass  # already running (the interrupt check stops it) or done

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel everything and end the thread; True when it ended within `timeout`. Every
        job it held ends with Failed(WorkerStopped) (unless it finished first): its client
        waits on the job's events, and nobody else would answer them."""
        with self._cond:
            self._stopping = True
            waiting, running = list(self._waiting), list(self.running)
            self._waiting.clear()
            self._cond.notify_all()
        stopped = WorkerStopped(f"model {self.model_id} stopped on this node before the "
                                "request ended (it was re-placed, or the node is stopping); "
                                "retry")
        for job in waiting:  # never started: no runner will post for them
            job.cancelled.set()
            job.post(Failed(stopped))
        for job in running:
            job.cancelled.set()
            if job.generation is not None:
                job.generation.cancel()
        if self.state == "loading":
            timeout = min(timeout, 1.0)  # a load cannot be interrupted: do not wait it out
        deadline = time.monotonic() + timeout
        if self._thread.is_alive():
            self._thread.join(timeout)
        for thread in list(self._job_threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        # A running job's runner posts nothing when its generation ends Cancelled; one still
        # stuck past the timeout has posted nothing either. Either way its client gets this
        # (a job that finished first has its final event read already: this one is never read).
        for job in running:
            job.post(Failed(stopped))
        if self.engine is not None:
            self.engine.close()  # a llama-server child goes with its worker
        return not self._thread.is_alive() and not any(t.is_alive() for t in self._job_threads)

    # ---- thread side -----------------------------------------------------------------------

    def _resolve_ready(self, error: BaseException | None) -> None:
        def done() -> None:
            if self._ready is not None and not self._ready.done():
                if error is None and self.engine is not None:
                    self._ready.set_result(self.engine)
                elif error is not None:
                    self._ready.set_exception(error)
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass

    def _main(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which decides
            self.state = "failed"
            self.load_error = e
            self._resolve_ready(e)
            return
        self.state = "ready"
        self._resolve_ready(None)
        # max_concurrent runners, this thread one of them, for as long as the model is loaded:
        # MLX keeps a native thread for every thread that ran it, so a thread per job would
        # leave one behind per job.
        for n in range(1, self.max_concurrent):
            runner = threading.Thread(target=self._serve, name=f"model-{self.model_id}-{n}",
                                      daemon=True)
            self._job_threads.append(runner)
            runner.start()
        self._serve()
        self.state = "stopped"

    def _serve(self) -> None:
        """Run jobs until the worker stops; each free runner takes the oldest waiting job
        (first come first served)."""
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                self.running.append(job)
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.running.remove(job)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        engine = self.engine
        assert engine is not None
        t0 = time.monotonic()
        tokens = 0
        outcome, result = "error", None  # for telemetry
        try:
            n_prompt = engine.prompt_length(job.req)
            if self.telemetry is not None:
                self.telemetry.start(RequestStarted(self.model_id, job.id, n_prompt),
                                     lambda: tokens)
            generation = job.generation = engine.generate(job.req)
            if job.cancelled.is_set():  # cancelled while we set up: Job.cancel missed it
                generation.cancel()
            if engine.runs_on_loop:
                result = self._relay_on_loop(engine, job, n_prompt)  # type: ignore[arg-type]
            else:
                started = False
                for chunk in generation:
                    if not started:
                        # Started waits for the first token: whatever the engine refuses while
                        # setting up (a drafter the model lacks) still becomes a real 4xx status.
                        job.post(Started(n_prompt))
                        started = True
                    tokens += len(chunk.tokens)
                    job.post(Produced(chunk))
                if not started:
                    job.post(Started(n_prompt))
                result = generation.result
            assert result is not None
            job.post(Finished(result))
            outcome = "ok"
        except Cancelled:
            outcome = "cancelled"
            log.info("job %d cancelled after %d tokens, %.2f s: the model is free", job.id,
                     tokens, time.monotonic() - t0)
        except RequestError as e:
            job.post(Failed(e))
        except RingError as e:
            log.warning("job %d: the ring broke: %s", job.id, e)
            job.post(Failed(RingFailed(self.model_id, e)))
        except TensorError as e:
            log.warning("job %d: the tensor-parallel group broke: %s", job.id, e)
            job.post(Failed(TensorGroupFailed(self.model_id, e)))
        except Exception as e:
            log.exception("job %d failed", job.id)
            job.post(Failed(e))
        finally:
            if self.telemetry is not None:
                self.telemetry.finish(RequestFinished(self.model_id, job.id, outcome,
                                                      result if outcome == "ok" else None))
            # A running average of job length per slot, for the Retry-After of a full queue.
            per_slot = (time.monotonic() - t0) / self.max_concurrent
            self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * per_slot

    def _relay_on_loop(self, engine: LoopEngine, job: Job, n_prompt: int) -> GenerationResult:
        """An engine that only waits on sockets (a llama-server child) streams on the event
        loop itself: its events go straight into the job's queue, with no thread hop and no
        loop wake-up per token (on a machine the child keeps busy, those cost more CPU than the
        proxying). The job's thread waits for the relay here; up to max_concurrent jobs relay
        at once."""
        engine.prepare()  # blocks until the child answers: not on the loop
        generation = job.generation
        assert generation is not None
        events = job.events
        started = False

        def emit(chunk: Chunk) -> None:
            nonlocal started
            if not started:
                events.put_nowait(Started(n_prompt))  # with the first token, as above
                started = True
            events.put_nowait(Produced(chunk))

        async def relay() -> GenerationResult:
            result = await engine.relay(job.req, generation, emit)
            if not started:
                events.put_nowait(Started(n_prompt))
            return result

        try:
            done = asyncio.run_coroutine_threadsafe(relay(), job.loop)
        except RuntimeError:  # the loop is closed: the node is stopping
            raise Cancelled() from None
        try:
            return done.result()
        except concurrent.futures.CancelledError:  # the loop cancelled it: it is stopping
            raise Cancelled() from None
