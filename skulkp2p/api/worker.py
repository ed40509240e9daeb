"""One worker thread per model: it loads the model, then runs generations one at a time, first in
first out, off the event loop (MLX calls block for a whole forward).

The loop side submits a `Job` and reads its events from an asyncio queue; the thread posts them
with `call_soon_threadsafe`. Cancelling a job (its client went away) sets a flag that the engine
checks between prefill chunks and between decode rounds, so the model is free for the next job
within one forward; a job cancelled while still queued is dropped from the queue at once.
A served model (a llama-server child) is the exception to "off the event loop": its proxy only
waits on sockets, so the thread hands it to the loop and waits (`_relay_on_loop`).
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
from typing import Any

from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.telemetry import RequestFinished, RequestStarted, result_from_dict

log = logging.getLogger("skulkp2p.worker")


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"{waiting} requests are already waiting for this model")
        self.retry_after = retry_after


class NotReady(Exception):
    """The model is still loading (or failed to load)."""


class Cancelled(Exception):
    """Raised inside the worker thread by the engine's interrupt check."""


class Job:
    _ids = itertools.count(1)

    def __init__(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.id = next(self._ids)
        self.req = req
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False  # set on the loop side when a final event was read
        self._worker: ModelWorker | None = None

    # -- loop side --
    async def next(self, timeout: float | None = None) -> tuple[str, Any] | None:
        """The next event: ("start", prompt_tokens) with the first token, then ("chunk", Chunk)
        per token, then ("done", result); or ("error", exception) at any point. None when
        `timeout` passed first."""
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
        if event[0] in ("done", "error"):
            self.finished = True
        return event

    def cancel(self) -> None:
        """Give up on this job (idempotent, safe after it finished)."""
        if self.finished or self.cancelled.is_set():
            return
        self.cancelled.set()
        if self._worker is not None:
            self._worker._dequeue(self)

    # -- thread side --
    def post(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the node is stopping
            pass

    def interrupt(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled()


Runner = Callable[[Any, GenerationRequest, dict[str, Any], Callable[[], None]], Any]


def _default_runner(loaded: Any, req: GenerationRequest, result: dict[str, Any],
                    interrupt: Callable[[], None]):
    if getattr(loaded, "served", False):  # a llama-server child: the proxy streams (served/)
        return loaded.stream(req, result, interrupt)
    from skulkp2p.engine.generate import stream
    return stream(loaded, req, result, interrupt=interrupt)


def _prompt_length(loaded: Any, req: GenerationRequest) -> int:
    """Tokenise once more up front (cheap next to a forward) so the client learns the prompt
    size, and an over-long prompt is refused with a 400, before the stream commits to a 200."""
    if getattr(loaded, "served", False):
        return loaded.prompt_length(req)
    from skulkp2p.engine.generate import prompt_tokens
    n = len(prompt_tokens(loaded, req))
    if n >= loaded.context_length:
        raise RequestError(f"prompt is {n} tokens; model {loaded.id} takes at most "
                           f"{loaded.context_length - 1}", "messages" if req.messages else "prompt")
    return n


def _stop_sequence(loaded: Any, req: GenerationRequest, result: dict[str, Any]) -> str | None:
    """Which stop string ended the text, if one did (Anthropic reports it)."""
    if result.get("finish_reason") != "stop" or not req.stop or "stop_sequence" in result:
        return result.get("stop_sequence")
    full = loaded.tokenizer.decode(result.get("tokens", []))
    rest = full[len(result.get("text", "")):] if full.startswith(result.get("text", "")) else full
    return next((s for s in req.stop if rest.startswith(s)), None) or next(
        (s for s in req.stop if s in rest), None)


class ModelWorker:
    telemetry: Any = None  # a skulkp2p.telemetry.Telemetry records the jobs (dashboard, /metrics)

    def __init__(self, model_id: str, load: Callable[[], Any], max_queue: int = 16,
                 runner: Runner = _default_runner,
                 prompt_length: Callable[[Any, GenerationRequest], int] = _prompt_length):
        self.model_id = model_id
        self.max_queue = max_queue
        self._load = load
        self._runner = runner
        self._prompt_length = prompt_length
        self.state = "loading"  # loading | ready | failed | stopped
        self.load_error: BaseException | None = None
        self.loaded: Any = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.current: Job | None = None
        self._avg_job_s = 2.0
        self._thread = threading.Thread(target=self._main, name=f"model-{model_id}", daemon=True)
        self._ready: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- loop side -------------------------------------------------------------------------

    def start(self) -> asyncio.Future:
        """Start the thread; the future resolves when the model is loaded (or fails)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread.start()
        return self._ready

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, req: GenerationRequest) -> Job:
        if self.state != "ready":
            raise NotReady(self.state)
        loop = asyncio.get_running_loop()
        with self._cond:
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
        """Cancel everything and end the thread; True when it ended within `timeout`."""
        with self._cond:
            self._stopping = True
            jobs = list(self._waiting)
            self._waiting.clear()
            if self.current is not None:
                jobs.append(self.current)
            self._cond.notify_all()
        for job in jobs:
            job.cancelled.set()
        if self.state == "loading":
            timeout = min(timeout, 1.0)  # a load cannot be interrupted: do not wait it out
        if self._thread.is_alive():
            self._thread.join(timeout)
        if getattr(self.loaded, "served", False):
            self.loaded.close()  # a llama-server child goes with its worker
        return not self._thread.is_alive()

    # ---- thread side -----------------------------------------------------------------------

    def _resolve_ready(self, error: BaseException | None) -> None:
        def done() -> None:
            if self._ready is not None and not self._ready.done():
                if error is None:
                    self._ready.set_result(self.loaded)
                else:
                    self._ready.set_exception(error)
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass

    def _main(self) -> None:
        try:
            self.loaded = self._load()
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which decides
            self.state = "failed"
            self.load_error = e
            self._resolve_ready(e)
            return
        self.state = "ready"
        self._resolve_ready(None)
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    self.state = "stopped"
                    return
                job = self._waiting.popleft()
                self.current = job
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.current = None

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        t0 = time.monotonic()
        result: dict[str, Any] = {}
        tokens = 0
        outcome = "error"  # telemetry
        try:
            n_prompt = self._prompt_length(self.loaded, job.req)
            if self.telemetry is not None:
                self.telemetry.start(RequestStarted(self.model_id, job.id, n_prompt),
                                     lambda: tokens)
            if self._runner is _default_runner and hasattr(self.loaded, "relay"):
                self._relay_on_loop(job, n_prompt, result)
            else:
                started = False
                for chunk in self._runner(self.loaded, job.req, result, job.interrupt):
                    if not started:
                        # "start" waits for the first token: whatever the engine refuses while
                        # setting up (a drafter the model lacks) still becomes a real 4xx status.
                        job.post("start", n_prompt)
                        started = True
                    tokens += len(chunk.tokens)
                    job.post("chunk", chunk)
                if not started:
                    job.post("start", n_prompt)
            result["stop_sequence"] = _stop_sequence(self.loaded, job.req, result)
            job.post("done", result)
            outcome = "ok"  # telemetry
        except Cancelled:
            outcome = "cancelled"  # telemetry
            log.info("job %d cancelled after %d tokens, %.2f s: the model is free", job.id,
                     tokens, time.monotonic() - t0)
        except RequestError as e:
            job.post("error", e)
        except Exception as e:
            log.exception("job %d failed", job.id)
            job.post("error", e)
        finally:
            if self.telemetry is not None:
                done = result_from_dict(result) if outcome == "ok" else None
                self.telemetry.finish(RequestFinished(self.model_id, job.id, outcome, done))
            # A running average of job length, for the Retry-After of a full queue.
            self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * (time.monotonic() - t0)

    def _relay_on_loop(self, job: Job, n_prompt: int, result: dict[str, Any]) -> None:
        """A served model (a llama-server child) streams on the event loop itself: its events
        go straight into the job's queue, with no thread hop and no loop wake-up per token (on
        a machine the child keeps busy, those cost more CPU than the proxying). This thread
        still runs the jobs one at a time, first in first out: it waits for the relay here."""
        self.loaded.await_child()  # blocks until the child answers: not on the loop
        events = job.events
        started = False

        def emit(chunk: Any) -> None:
            nonlocal started
            if not started:
                events.put_nowait(("start", n_prompt))  # with the first token, as above
                started = True
            events.put_nowait(("chunk", chunk))

        async def relay() -> None:
            await self.loaded.relay(job.req, result, job.interrupt, emit)
            if not started:
                events.put_nowait(("start", n_prompt))

        try:
            done = asyncio.run_coroutine_threadsafe(relay(), job.loop)
        except RuntimeError:  # the loop is closed: the node is stopping
            raise Cancelled() from None
        try:
            done.result()
        except concurrent.futures.CancelledError:  # the loop cancelled it: it is stopping
            raise Cancelled() from None
