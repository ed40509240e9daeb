"""The HTTP face of one model's worker: submitting a request, and reading its job's typed events
as a whole result or as a stream. Shared by the OpenAI, Anthropic and pipe-format routes.

What runs concurrently: HTTP parsing, health, model listing and the streaming of every open
response run on the event loop, all at once. Generation runs on one worker thread per model, one
request at a time, first in first out; up to `max_queue` more wait their turn, and one more gets
429. (Plain requests are not batched together yet.)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.api.server import HttpRequest, Response
from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.request import GenerationRequest
from skulkp2p.engine.results import GenerationResult
from skulkp2p.runtime.worker import (
    Failed,
    Finished,
    Job,
    JobEvent,
    ModelWorker,
    NotReady,
    QueueFull,
    Started,
    WorkerStopped,
)

LOADING_RETRY_AFTER = "2"


@dataclass(frozen=True)
class KeepAlive:
    """A stream was silent for one keep-alive interval."""


class ModelEndpoint:
    def __init__(self, model_id: str, worker: ModelWorker, aliases: tuple[str, ...] = (),
                 keepalive_s: float = 10.0):
        self.model_id = model_id
        self.names = {model_id, *aliases}
        self.worker = worker
        self.keepalive_s = keepalive_s
        self.created = int(time.time())
        self.engine_reason = ""  # why its engine serves it (a model with both forms), set by
        # the node when it is placed here

    async def health(self, req: HttpRequest) -> Response:
        state = self.worker.state
        if state == "ready":
            return Response.json(200, {"status": "ok", "model": self.model_id,
                                       "waiting": self.worker.waiting,
                                       "busy": self.worker.current is not None})
        raise self.unavailable()

    def unavailable(self) -> ApiError:
        """503 for a model that is not ready: loading (retry soon) or failed (and why)."""
        if self.worker.state == "loading":
            return ApiError(503, f"model {self.model_id} is loading", code="model_loading",
                            headers=[("Retry-After", LOADING_RETRY_AFTER)])
        err = self.worker.load_error
        why = f": {err}" if err is not None else ""
        return ApiError(503, f"model {self.model_id} is not available ({self.worker.state})"
                             f"{why}", code="model_unavailable")

    def listing(self) -> JSONObject:
        """Its /v1/models entry; `engine` ("mlx" | "llama_server") once loaded, and
        `engine_reason` where the node chose between the model's forms."""
        entry: JSONObject = {"id": self.model_id, "object": "model", "created": self.created,
                             "owned_by": "skulkp2p", "ready": self.worker.state == "ready"}
        engine = self.worker.engine
        if engine is not None:
            entry["engine"] = engine.info().engine
        if self.engine_reason:
            entry["engine_reason"] = self.engine_reason
        return entry

    def check_model(self, name: object) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if name not in self.names:
            raise ApiError(404, f"model {name!r} is not served here (this node serves "
                                f"{self.model_id!r})", param="model", code="model_not_found")

    def submit(self, req: GenerationRequest) -> Job:
        try:
            return self.worker.submit(req)
        except QueueFull as e:
            raise ApiError(429, f"{e}; retry later", code="queue_full",
                           headers=[("Retry-After", str(e.retry_after))]) from None
        except NotReady:
            raise self.unavailable() from None
        except WorkerStopped as e:
            raise engine_error(e) from None

    async def run_to_end(self, req: GenerationRequest, rename: dict[str, str] | None = None
                         ) -> tuple[int, GenerationResult]:
        """A non-streaming request: (prompt tokens, result). Fails as a whole or not at all, so
        the client gets a real error status, never a 200 with half a body."""
        job = self.submit(req)
        n_prompt = 0
        try:
            while True:
                event = await job.next()
                if isinstance(event, Started):
                    n_prompt = event.prompt_tokens
                elif isinstance(event, Finished):
                    return n_prompt, event.result
                elif isinstance(event, Failed):
                    raise engine_error(event.error, rename)
        finally:
            job.cancel()  # no-op when it finished; frees the model when the client went away

    async def open_stream(self, req: GenerationRequest, rename: dict[str, str] | None = None
                          ) -> tuple[Job, JobEvent | None]:
        """Submit, and wait up to one keep-alive interval for the job to start, so that what
        fails early (queue full, bad prompt) still gets a real status before the 200 head."""
        job = self.submit(req)
        try:
            first = await job.next(self.keepalive_s)
        except BaseException:
            job.cancel()
            raise
        if isinstance(first, Failed):
            job.cancel()
            raise engine_error(first.error, rename)
        return job, first

    async def events(self, job: Job, first: JobEvent | None
                     ) -> AsyncIterator[JobEvent | KeepAlive]:
        """The job's events, with KeepAlive whenever it was silent for an interval."""
        event = first
        while True:
            if event is None:
                yield KeepAlive()
            else:
                yield event
                if isinstance(event, Finished | Failed):
                    return
            event = await job.next(self.keepalive_s)
