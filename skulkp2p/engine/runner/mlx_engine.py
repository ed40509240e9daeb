"""The MLX engine behind the Engine protocol: a loaded model (all its layers, or the last stage
of a pipeline ring) that generates with the one speculative decode loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from pathlib import Path

from skulkp2p.engine.batching.scheduler import BatchScheduler, batchable
from skulkp2p.engine.cache.disk_store import (
    PrefixDiskStore,
    StoreInUse,
    cache_identity,
    store_folder,
    weights_fingerprint,
)
from skulkp2p.engine.cache.prefix_cache import DEFAULT_PREFIX_CACHE_MB, MB, PrefixCache, RawEntry
from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
from skulkp2p.engine.drafting.suffix import SuffixMemory
from skulkp2p.engine.model.forward import Forward
from skulkp2p.engine.model.loaded import LoadedModel
from skulkp2p.engine.protocol import EngineInfo, Generation, PrefixDiskSettings, VerifyCosts
from skulkp2p.engine.request import GenerationRequest
from skulkp2p.engine.results import Chunk, GenerationResult
from skulkp2p.engine.runner.generate import max_token_chars, prompt_tokens, stream

log = logging.getLogger("skulkp2p.prefix")

# Default bound of the draft memory (earlier requests' prompts and outputs, for the suffix
# drafter), in tokens: about 660 bytes each in the automaton (docs/architecture.md).
DEFAULT_MEMORY_TOKENS = 65536

# Requests decoded together when neither the caller nor the card (`[runtime] max_batch`) says
# (8 rows cost 1.46x one row: docs/measurements/concurrency.md, "Batching in one process").
DEFAULT_MAX_BATCH = 8

# The forward a request decodes on, given the trunk hidden state its drafter reads and its
# interrupt (a row of the model's batch).
MakeForward = Callable[[str | None, Callable[[], None] | None], Forward]


class MlxEngine:
    """`prefix_cache_mb`: the model's prefix cache (engine/cache/prefix_cache.py), in memory, bounded
    in MB; 0 turns it off. Up to `max_concurrent` generations run at once, each on its caller's
    thread, decoded together by the model's BatchScheduler (engine/batching/scheduler.py), whose lock
    every request holds while its own code runs: the prefix cache and the draft memory are used
    by one request at a time, without locks of their own. With max_concurrent 1 a generation
    runs alone on its thread, exactly as without batching (the pipelined plain path included).
    Each running generation must be iterated on a thread of its own (the worker's runners do):
    a row waits in its forward until every other row has handed in its tokens, so one thread
    taking turns between two generations would wait on itself."""

    runs_on_loop = False

    def __init__(self, loaded: LoadedModel, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 memory_tokens: int | None = None, max_batch: int | None = None,
                 prefix_disk: PrefixDiskSettings | None = None):
        """`prefix_cache_mb`: the prefix cache's bound (0 = off). `memory_tokens`: bound of the
        draft memory of earlier requests (0 = off); None takes the card's
        `[speculation.lookup] memory_tokens`, else DEFAULT_MEMORY_TOKENS. `max_batch`: requests
        decoded together; None takes the card's `[runtime] max_batch`, else DEFAULT_MAX_BATCH.
        A ring's last stage batches its requests' rows through the ring (engine/parallel/ring/batch_rows.py);
        a tensor-parallel group and a model with recurrent or sliding-window layers serve one
        request at a time whatever it says (engine/batching/scheduler.py: batchable).
        `prefix_disk`: where the prefix cache's entries are also kept on disk (None: memory
        only)."""
        if max_batch is None:
            max_batch = int(loaded.runtime.get("max_batch", DEFAULT_MAX_BATCH))
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        # A ring's last stage (a span past the first layer, its forward a RingForward).
        self.ring = loaded.make_forward is not None and loaded.span is not None \
            and not loaded.span.first
        if (loaded.make_forward is not None and not self.ring) or not batchable(loaded.model):
            max_batch = 1
        if self.ring and not loaded.caches_trim:
            # The other stages' layers may hold recurrent or sliding-window state even when
            # this stage's do not (a hybrid model cut so that only attention layers are here).
            max_batch = 1
        self.max_concurrent = max_batch
        self.scheduler: BatchScheduler | None = None
        if max_batch > 1:
            stage, through = None, None
            if self.ring:
                from skulkp2p.engine.model.stage import StageModel
                from skulkp2p.engine.parallel.ring.batch_rows import RingRows
                assert loaded.span is not None  # (a ring's last stage)
                stage, through = StageModel(loaded.model, loaded.span), RingRows()
            self.scheduler = BatchScheduler(loaded.model, max_batch, int(loaded.runtime.get(
                "prefill_step", 2048)), stage=stage, through=through)
        self.loaded = loaded
        self.id = loaded.id
        self.context_length = loaded.context_length
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * MB), prefix_disk_store(
            loaded, prefix_disk)) if prefix_cache_mb > 0 else None
        if memory_tokens is None:
            memory_tokens = int(loaded.speculation.get("lookup", {}).get(
                "memory_tokens", DEFAULT_MEMORY_TOKENS))
        # Both live as long as the model is loaded; one worker thread runs its requests in turn.
        self.memory = SuffixMemory(memory_tokens)
        max_token_chars(loaded)  # (read from the vocabulary now, not by the first request)
        # The prompts prompt_length rendered, by request, until its generation takes them: the
        # worker asks for the length, then generates, and the chat template renders once.
        self._rendered: dict[int, tuple[GenerationRequest, list[int]]] = {}
        self._rendered_lock = threading.Lock()

    def info(self) -> EngineInfo:
        loaded = self.loaded
        detail: dict = {"layers_here": len(loaded.model.layers)}
        if loaded.span is not None:
            detail["layers"] = [loaded.span.start, loaded.span.end]
        if loaded.mtp is not None:
            detail["mtp_head"] = loaded.mtp.conventions.style
        if loaded.draft is not None:
            detail["draft_model"] = loaded.draft.id
        if self.prefix_cache is not None:
            detail["prefix_cache"] = self.prefix_cache.stats()
        detail["max_batch"] = self.max_concurrent
        return EngineInfo(loaded.id, "mlx", loaded.dtype, loaded.context_length, detail,
                          self._verify_costs(),
                          draft_memory=self.memory if self.memory.enabled else None)

    def _verify_costs(self) -> VerifyCosts | None:
        """The table the depth controller prices drafts with now: a tensor group's live one
        (call_costs.py) once it measured, else the probe's (or none)."""
        live = self.loaded.width_costs
        if isinstance(live, LiveWidthCosts) and self.loaded.verify_costs is not None:
            return live.snapshot()
        return self.loaded.verify_costs

    def prompt_length(self, req: GenerationRequest) -> int:
        """Tokenise up front so the client learns the prompt size, and an over-long prompt is
        refused before a stream commits to a 200 (one too long by its characters alone before
        it is tokenised: generate.prompt_tokens); the generation of `req` reuses the tokens,
        for its stream and for the draft memory."""
        prompt = prompt_tokens(self.loaded, req)
        n = len(prompt)
        with self._rendered_lock:
            self._rendered[id(req)] = (req, prompt)  # holds req: its id is not reused
            while len(self._rendered) > 4 * self.max_concurrent:  # lengths never generated
                del self._rendered[next(iter(self._rendered))]
        return n

    def _prompt(self, req: GenerationRequest) -> list[int]:
        """The prompt's tokens: those prompt_length rendered for this request, else rendered
        now."""
        with self._rendered_lock:
            kept = self._rendered.pop(id(req), None)
        if kept is not None and kept[0] is req:
            return kept[1]
        return prompt_tokens(self.loaded, req)

    def generate(self, req: GenerationRequest) -> Generation:
        if self.scheduler is None:
            return Generation(lambda interrupt: self._remembered(req, interrupt))
        return Generation(lambda interrupt: self._in_batch(req, interrupt))

    def _remembered(self, req: GenerationRequest, interrupt: Callable[[], None],
                    make_forward: MakeForward | None = None, prompt: list[int] | None = None,
                    prefix_read: RawEntry | None = None
                    ) -> Generator[Chunk, None, GenerationResult]:
        """The stream, and its prompt and output into the draft memory when it ends.
        `prompt`: its tokens when the caller has them; `prefix_read`: the prefix cache's entry
        on disk for them, read ahead off the model's lock."""
        memory = self.memory if self.memory.enabled else None
        if memory is not None:
            memory.absorb()  # what the model's other replicas finished meanwhile
        if prompt is None:
            prompt = self._prompt(req)  # once: the stream and the memory share it
        result = yield from stream(self.loaded, req, interrupt, self.prefix_cache, prompt,
                                   memory=memory, make_forward=make_forward,
                                   prefix_read=prefix_read)
        if memory is not None:
            memory.add(prompt + list(result.tokens))
        return result

    def _in_batch(self, req: GenerationRequest, interrupt: Callable[[], None]
                  ) -> Generator[Chunk, None, GenerationResult]:
        """The stream as a row of the batch: its code runs with the model's lock held, let go
        while it waits for a batched step and while its chunks go out."""
        sched = self.scheduler
        assert sched is not None
        lock = sched.cond
        prompt = self._prompt(req)
        # The prompt's entry on disk is read, checked and parsed now, before this row joins
        # the batch: the other rows decode meanwhile, and under the lock it is only installed.
        read = self.prefix_cache.read_ahead(prompt) if self.prefix_cache is not None else None
        sched.arrive()  # (before the lock: a lone row sees it at its next step)
        make: MakeForward = sched.forward
        if self.ring:  # each row over its own RingForward (its prefill, its frames' ids)
            ring_forward = self.loaded.make_forward
            assert ring_forward is not None

            def ring_row(hidden: str | None, interrupt: Callable[[], None] | None) -> Forward:
                return sched.forward(hidden, interrupt, ring_forward(req, hidden, interrupt))
            make = ring_row
        steps = self._remembered(req, interrupt, make, prompt, read)
        try:
            with lock:
                sched.wait_settled()  # a lone row running ahead stops first
            while True:
                with lock:
                    try:
                        chunk = next(steps)
                    except StopIteration as done:
                        return done.value
                yield chunk
        finally:
            with lock:
                steps.close()  # a consumer that stopped early: the row leaves the batch
            sched.depart()

    def close(self) -> None:
        """MLX frees the weights with the last reference; the prefix cache's disk writer
        writes what is queued (for a few seconds at most) and stops."""
        if self.prefix_cache is not None:
            self.prefix_cache.close()


def prefix_disk_store(loaded: LoadedModel, settings: PrefixDiskSettings | None
                      ) -> PrefixDiskStore | None:
    """The entries on disk of a model, of a ring stage's layers, or of the index a tensor
    group's loop member keeps (the ranks keep their slices on their own disks: rank.py): a
    folder per model id and part (a stage's layer range, "tensor-index") and fingerprint of its
    weights and of what computes its caches (the part included), or None (off, or in use by
    another process)."""
    if settings is None or settings.max_bytes <= 0:
        return None
    span = loaded.span
    part = f"layers{span.start}-{span.end}of{span.total}" if span is not None else (
        "tensor-index" if loaded.make_forward is not None else "")
    fingerprint = weights_fingerprint(loaded.path, cache_identity(loaded.id, loaded.dtype, part))
    folder = store_folder(Path(settings.directory), loaded.id, fingerprint, part)
    try:
        return PrefixDiskStore(folder, settings.max_bytes, fingerprint)
    except StoreInUse as e:
        log.warning("prefix cache: %s; this one keeps its entries in memory only", e)
    except OSError as e:
        log.warning("prefix cache: cannot use %s (%s); entries in memory only", folder,
                    e.strerror or e)
    return None
