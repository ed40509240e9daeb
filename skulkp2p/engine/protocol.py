"""The engine seam: what every engine (MLX here, a llama-server child in served/) offers the
front ends (HTTP worker, pipe, bench), and the errors it may raise.

No mlx here. The front ends never look inside an engine: they start a `Generation`, read its
chunks, cancel it, and read its typed result. Which engine serves a model is decided once, from
its card, by the composition root's factory (skulkp2p/node/engines.py).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.engine.results import Chunk, GenerationResult

__all__ = ["Cancelled", "Chunk", "DraftMemoryShare", "Engine", "EngineFailed", "EngineInfo",
           "EngineUnavailable",
           "Generation", "GenerationResult", "RequestError", "RingError", "TensorError",
           "VerifyCosts"]


# The MLX engine's prefix cache per model, in MB (`--prefix-cache-mb`; 0 turns it off). Here,
# without mlx, so that the CLI and the factory can name it before mlx loads.
DEFAULT_PREFIX_CACHE_MB = 512

# The prefix cache's entries on disk per model, in GB (`--prefix-cache-disk-gb`; 0 turns it
# off): a few long conversations of a large model (a 4,000-token entry of an 8B model in
# bfloat16 is about 0.5 GB).
DEFAULT_PREFIX_CACHE_DISK_GB = 4.0


@dataclass(frozen=True)
class PrefixDiskSettings:
    """Where the MLX engine keeps its prefix cache's entries on disk: under `directory` (the
    node's data dir's prefix-cache/), a folder per model and fingerprint of its weights, at most
    `max_bytes` each."""
    directory: Path
    max_bytes: int


class Cancelled(Exception):
    """Raised inside an engine by its interrupt check once its generation was cancelled."""


class EngineUnavailable(Exception):
    """The engine cannot serve right now (a child process starting or restarting): retry."""

    def __init__(self, message: str, retry_after: int | None = 2):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class RingError(RuntimeError):
    """The ring could not complete a traversal (a stage died, froze, or dropped the frame)."""


class TensorError(RuntimeError):
    """The tensor-parallel group could not complete a call (a member died, froze, or the
    placement moved): the request ends with this message."""


class EngineFailed(Exception):
    """The engine's backend failed the request (a child's 5xx): not the client's fault."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class VerifyCosts:
    """What one verify call of w rows costs where this model runs, measured there: a
    tensor-parallel group measures its own when it forms (engine/parallel/tensor/group.py,
    measure_group_widths), and the depth controller prices drafts with `relative`."""
    seconds: dict[int, float]  # seconds of one call of w rows, by w
    measured_at: float  # Unix time of the measurement (a live table: of its last call)
    where: str  # what was measured, e.g. "tensor-parallel group n0, n1"
    # "probe" (measured once, when the group formed) or "live" (following the group's own
    # verify calls since: engine/drafting/call_costs.py), with the calls observed per width and the
    # probe's seconds it was seeded with
    source: str = "probe"
    calls: dict[int, int] = field(default_factory=dict)
    probe_seconds: dict[int, float] | None = None

    @property
    def relative(self) -> dict[int, float]:
        """Each width's cost relative to the narrowest's (1.0)."""
        base = self.seconds[min(self.seconds)]
        return {w: round(s / base, 4) for w, s in sorted(self.seconds.items())}

    def to_json(self) -> JSONObject:
        """As /v1/models and /v1/cluster show it."""
        rel = self.relative
        out: JSONObject = {
            "where": self.where, "measured_at": round(self.measured_at, 3),
            "source": self.source,
            "widths": [{"width": w, "seconds": round(s, 6), "relative": rel[w],
                        **({"calls": self.calls.get(w, 0)} if self.source == "live" else {})}
                       for w, s in sorted(self.seconds.items())]}
        if self.probe_seconds is not None:
            out["probe"] = [{"width": w, "seconds": round(s, 6)}
                            for w, s in sorted(self.probe_seconds.items())]
        return out


@dataclass(frozen=True)
class EngineInfo:
    """What an engine tells about itself (logs, /v1/cluster, the bench's document)."""
    model: str
    engine: str  # "mlx" | "llama_server"
    dtype: str
    context_length: int
    detail: JSONObject = field(default_factory=dict)  # layers held, child pid, ...
    verify_costs: VerifyCosts | None = None  # measured where it runs (a tensor group's)
    # Its draft memory, shared with the model's other replicas (None: it has none, or it is
    # turned off).
    draft_memory: DraftMemoryShare | None = None


class DraftMemoryShare(Protocol):
    """An engine's draft memory as the model's replicas share it: what this one finished (its
    requests' prompts and outputs, as tokens) goes to the others, and what they finished comes
    in. Both are called from any thread; what comes in is taken into the memory by the engine
    itself, at its next request."""

    def take_finished(self) -> list[list[int]]:
        """The sequences finished here since the last call (bounded: the oldest dropped)."""
        ...

    def offer(self, sequences: list[list[int]]) -> None:
        """Sequences another replica finished (bounded: the oldest dropped)."""
        ...

    def stats(self) -> JSONObject:
        """What it holds, received and handed out, and the tokens drafted from it
        ({"sequences", "tokens", "received", "shared", "to_share": finished here, not yet
        handed out, "drafted_tokens", "drafted_received_tokens": of those drafted, from what
        other replicas sent})."""
        ...


class Generation:
    """One request running on an engine: iterate it for chunks (blocking), `cancel()` it from
    any thread, read `result` once the iteration ended. An engine builds it from a generator
    function that receives the interrupt check and returns the GenerationResult."""

    def __init__(self, run: Callable[[Callable[[], None]],
                                     Generator[Chunk, None, GenerationResult]]):
        self._run = run
        self._cancelled = threading.Event()
        self.result: GenerationResult | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def interrupt(self) -> None:
        """The engine calls this between forwards: raises Cancelled once cancelled."""
        if self._cancelled.is_set():
            raise Cancelled()

    def __iter__(self) -> Iterator[Chunk]:
        self.result = yield from self._run(self.interrupt)


class Engine(Protocol):
    """A loaded model that generates. Implemented by engine.mlx_engine.MlxEngine and
    served.engine.ServedEngine."""

    id: str
    context_length: int
    runs_on_loop: bool  # True: a LoopEngine, the worker relays it on the event loop
    # Generations it runs at once (the worker admits up to this many; 1: one at a time, FIFO).
    # The MLX engine decodes them together in one batched forward per step.
    max_concurrent: int

    def info(self) -> EngineInfo: ...

    def prompt_length(self, req: GenerationRequest) -> int:
        """Tokens of the request's prompt (0 where unknown before generating); raises
        RequestError for a prompt the model cannot take."""
        ...

    def generate(self, req: GenerationRequest) -> Generation:
        """Start a generation; nothing runs until it is iterated."""
        ...

    def close(self) -> None: ...


class LoopEngine(Engine, Protocol):
    """An engine whose generation only waits on sockets (llama-server's proxy): it runs on the
    event loop itself, with no thread between the child's socket and the client's."""

    def prepare(self) -> None:
        """Blocking wait until the engine can take a request (called off the loop)."""
        ...

    def relay(self, req: GenerationRequest, generation: Generation,
              emit: Callable[[Chunk], None]) -> Awaitable[GenerationResult]: ...
