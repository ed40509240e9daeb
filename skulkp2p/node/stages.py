"""What this node runs of the cluster's placements, from the moment a placement arrives until it
moves away: the worker of a model placed on this node alone, this node's stage of a pipeline ring
(the last stage's worker runs the decode loop over a RingForward; the others answer ring frames),
and this node's rank of a tensor-parallel group (node/tensor_roles.py; the group's first member
also runs the decode loop, over a TensorForward). A re-placement retires what was held for the
model; the stages' reports (layers, parameter bytes, verify costs) go into the node's facts, which
GET /v1/cluster shows. The HTTP side (node/serving.py) reads `workers` and `apis`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.cluster.membership import ALIVE, SUSPECT
from skulkp2p.cluster.node import ClusterNode
from skulkp2p.cluster.placement import ModelSpec, Placement
from skulkp2p.cluster.ring_link import DRAFT_MEMORY, RingData, TcpRingLink
from skulkp2p.engine.cpu import blas_threads
from skulkp2p.engine.protocol import (
    DEFAULT_PREFIX_CACHE_MB,
    Engine,
    PrefixDiskSettings,
    VerifyCosts,
)
from skulkp2p.runtime.worker import ModelWorker
from skulkp2p.telemetry import Telemetry
from skulkp2p.wire import PROTOCOL_VERSION, Message, WireValue

if TYPE_CHECKING:
    from skulkp2p.engine.cache.prefix_cache import PrefixCache
    from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
    from skulkp2p.engine.json_types import JSONValue
    from skulkp2p.engine.model.loaded import LoadedModel
    from skulkp2p.engine.model.stage import StageSpan
    from skulkp2p.engine.parallel.ring.traversal import RingForward
    from skulkp2p.engine.parallel.tensor.group import RankProcess, TensorForward
    from skulkp2p.engine.request import GenerationRequest
    from skulkp2p.models.store import ModelStore
    from skulkp2p.node.tensor_roles import TensorRole

log = logging.getLogger("skulkp2p.node")

# A tensor group's live width table is re-reported (/v1/cluster) at most this often.
LIVE_REPORT_S = 1.0
# A finished sequence offered to the model's other replicas: at most its last this many tokens.
SHARE_TOKENS = 8192

# What this node holds of a model: (ring, layers), and for a tensor group also (term, serial)
_Role: TypeAlias = (tuple[tuple[str, ...], tuple[tuple[int, int], ...]]
                    | tuple[tuple[str, ...], tuple[tuple[int, int], ...], int, int])


class LocalPlacements:
    """This node's share of the placements: its workers (model -> ModelWorker) and their HTTP
    endpoints, its ring stages (`ring`, the data plane) and its tensor ranks."""

    def __init__(self, store: ModelStore, own_model: str, own_id: str,
                 load_model: Callable[[str], Engine], *, max_queue: int = 16,
                 keepalive_s: float = 10.0, on_ready: Callable[[Engine], None] | None = None,
                 load_stage: Callable[[str, StageSpan], LoadedModel] | None = None,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 max_batch: int | None = None, prefix_disk: PrefixDiskSettings | None = None):
        self.store = store
        self.own_model = own_model  # as given on the command line (card id or path)
        self.own_id = own_id
        self.load_model = load_model
        self.max_queue = max_queue
        self.keepalive_s = keepalive_s
        self.on_ready = on_ready
        self.node: ClusterNode | None = None  # set once the cluster node exists (serve_cluster)
        self.workers: dict[str, ModelWorker] = {}
        self.apis: dict[str, ModelEndpoint] = {}
        self.own_failed: asyncio.Future[BaseException] | None = None
        self._told: set[tuple[str, tuple[str, ...]]] = set()
        self._roles: dict[str, _Role] = {}  # model -> what is held here
        self.ring = RingData(b"")  # the data plane; its key is set in serve_cluster
        self.ring.on_draft_memory = self._took_draft_memory
        self.instance = uuid.uuid4().hex  # this process's incarnation, on ring frames
        self.load_stage = load_stage or (lambda spec, span: _open_stage(store, spec, span))
        self._stage_reports: dict[str, Message] = {}  # set on a worker thread
        self.telemetry = Telemetry()  # the dashboard and /metrics (api/dashboard.py)
        # The process's OpenBLAS thread policy, which every engine here shares.
        self.telemetry.watch_blas_threads(blas_threads.counts)
        self.prefix_cache_mb = prefix_cache_mb  # each model's, and each ring stage's own
        # where a ring stage's entries are also kept on disk (None: memory only); a whole
        # model's engine gets it from load_model
        self.prefix_disk = prefix_disk
        self.max_batch = max_batch  # a ring's last stage's (None: the card's, else default)
        self.tensor_roles: dict[str, TensorRole] = {}  # model -> this node's rank of its group

    @property
    def _cluster(self) -> ClusterNode:
        """The cluster node, set (by serve_cluster) before it starts and calls back here."""
        if self.node is None:
            raise RuntimeError("this node's placements have no cluster node yet")
        return self.node

    @property
    def name(self) -> str:
        return self._cluster.config.name

    def on_cluster_change(self, node: ClusterNode) -> None:
        """Placements changed: start a worker for every model placed on this node alone, and a
        stage for every ring this node is a member of (the last stage runs the decode loop)."""
        for model, placed in sorted(node.placements().items()):
            p = self._copy_here(placed) or placed  # this node's replica of it, if any
            sig: _Role = ((p.ring, p.layers, p.term, p.serial) if p.parallel == "tensor"
                          else (p.ring, p.layers))
            if model in self._roles and self._roles[model] != sig:
                self._retire(model)  # re-placed: what this node held for it is stale
            if p.ring == (self.name,):
                self._roles[model] = sig
                self._ensure_worker(model, p.spec.source if p.spec else "")
                if p.spec is not None and model in self.apis:
                    self.apis[model].engine_reason = p.spec.engine_reason
            elif len(p.ring) > 1 and self.name in p.ring and p.spec is not None:
                if model not in self._roles:
                    self._roles[model] = sig
                    if p.parallel == "tensor":
                        self._start_tensor(model, p, p.spec)
                    else:
                        self._start_stage(model, p, p.spec)
                stage = self.ring.stages.get(model)
                if stage is not None:
                    stage[0].term = p.term
            elif (model, p.ring) not in self._told:
                self._told.add((model, p.ring))
                if model == self.own_id and len(p.ring) == 1:
                    log.info("cluster: model %s is served by node %s; requests here are "
                             "forwarded to it", model, p.ring[0])

    def share_draft_memory(self) -> int:
        """Offer what this node's replicas finished (prompts and outputs, in their engines'
        draft memory) to each other replica of their models, over the data plane; how many
        sequences went out. An engine without a draft memory (turned off) shares nothing."""
        node = self.node
        if node is None or node.core is None:
            return 0
        placements = node.placements()
        sent = 0
        for model, worker in list(self.workers.items()):
            engine = worker.engine
            port = engine.info().draft_memory if engine is not None else None
            if port is None:
                continue
            seqs = port.take_finished()  # drained whether or not there is anyone to tell
            p = placements.get(model)
            if not seqs or p is None or not p.replicas:
                continue
            msg: Message = {"t": DRAFT_MEMORY, "v": PROTOCOL_VERSION, "model": model,
                            "sequences": [list(s[-SHARE_TOKENS:]) for s in seqs]}
            for entry in p.entries:
                addr = self._ring_addr(entry) if entry != self.name else None
                if addr:
                    self.ring.send_threadsafe(addr, msg).add_done_callback(_unsent)
                    sent += len(seqs)
        return sent

    def _took_draft_memory(self, model: str, sequences: list[list[int]]) -> None:
        worker = self.workers.get(model)
        engine = worker.engine if worker is not None else None
        port = engine.info().draft_memory if engine is not None else None
        if port is not None:
            port.offer(sequences)

    def _copy_here(self, p: Placement) -> Placement | None:
        """The replica of ``p`` this node is a member of (with the model's spec), else None."""
        held = p.replica_for(self.name)
        return dataclasses.replace(held, spec=p.spec) if held is not None else None

    def _held(self, model: str) -> Placement | None:
        """This node's replica of ``model`` as the cluster places it now (None: none)."""
        p = self._cluster.started_core.placements().get(model)
        return self._copy_here(p) if p is not None else None

    def _retire(self, model: str) -> None:
        self._roles.pop(model, None)
        stage = self.ring.stages.get(model)
        self.ring.set_stage(model, None)
        if stage is not None and stage[0].prefix_cache is not None:
            # its disk writer writes what is queued and lets go of the folder, off the loop
            asyncio.get_running_loop().run_in_executor(None, stage[0].prefix_cache.close)
        role = self.tensor_roles.pop(model, None)
        if role is not None:
            role.stop()  # its rank process, by pid: the new placement forms a new group
        self.apis.pop(model, None)
        worker = self.workers.pop(model, None)
        if worker is not None:
            asyncio.get_running_loop().run_in_executor(None, worker.stop, 5.0)
        node = self._cluster
        node.update_facts(stages={k: v for k, v in _stages(node).items() if k != model})

    def _source(self, model: str, source: str) -> str:
        # Its own model by the name it was given, unless placed as another card (its GGUF form:
        # node/engines.py, choose_engine).
        other_card = source != model and source in self.store.cards
        return self.own_model if model == self.own_id and not other_card else (source or model)

    def _start_stage(self, model: str, p: Placement, placed: ModelSpec) -> None:
        """Load this node's slice of a ring. The last stage serves the model's requests (its
        worker runs the decode loop over a RingForward); the others answer ring frames."""
        from skulkp2p.engine.model.stage import StageSpan

        idx = p.ring.index(self.name)
        span = StageSpan(p.layers[idx][0], p.layers[idx][1], placed.layers)
        spec = self._source(model, placed.source)
        log.info("cluster: model %s: this node is stage %d of %d (layers %d-%d): loading them",
                 model, idx + 1, len(p.ring), span.start, span.end - 1)
        if span.last:
            def load() -> Engine:
                from skulkp2p.engine.model.stage import param_bytes
                from skulkp2p.node.engines import mlx_engine

                loaded = self.load_stage(spec, span)
                loaded.make_forward = self._ring_forward_factory(model, p.ring, loaded)
                self._stage_reports[model] = {"layers": [span.start, span.end],
                                              "param_bytes": param_bytes(loaded.model)}
                return mlx_engine(loaded, self.prefix_cache_mb, max_batch=self.max_batch,
                                  prefix_disk=self.prefix_disk)
            self._ensure_worker(model, placed.source, load)
            return
        loop = asyncio.get_running_loop()
        nxt = p.ring[idx + 1]

        def load_with_cache() -> tuple[LoadedModel, PrefixCache | None]:
            # (off the loop: the cache's folder on disk is indexed from its files' headers)
            from skulkp2p.engine.cache.prefix_cache import MB, PrefixCache
            from skulkp2p.engine.runner.mlx_engine import prefix_disk_store

            loaded = self.load_stage(spec, span)
            mb = self.prefix_cache_mb
            return loaded, PrefixCache(int(mb * MB), prefix_disk_store(
                loaded, self.prefix_disk)) if mb > 0 else None

        def loaded_stage(fut: asyncio.Future[tuple[LoadedModel, PrefixCache | None]]) -> None:
            if fut.cancelled():
                return
            if fut.exception() is not None:
                log.error("model %s: stage failed to load: %s", model, fut.exception())
                return
            loaded, cache = fut.result()
            if self._roles.get(model) != (p.ring, p.layers):
                if cache is not None:  # re-placed while it loaded
                    loop.run_in_executor(None, cache.close)
                return
            from skulkp2p.engine.model.stage import StageModel, param_bytes
            from skulkp2p.engine.parallel.ring.traversal import StageWorker

            worker = StageWorker(StageModel(loaded.model, span), p.term, cache)
            self.ring.set_stage(model, worker, lambda: self._ring_addr(nxt))
            log.info("cluster: model %s: stage %d of %d ready (layers %d-%d, %.1f MB held)",
                     model, idx + 1, len(p.ring), span.start, span.end - 1,
                     param_bytes(loaded.model) / 1e6)
            self._report_stage(model, {"layers": [span.start, span.end],
                                       "param_bytes": param_bytes(loaded.model)})

        loop.run_in_executor(None, load_with_cache).add_done_callback(loaded_stage)

    def _start_tensor(self, model: str, p: Placement, placed: ModelSpec) -> None:
        """This node's rank of a tensor-parallel group (node/tensor_roles.py); on the group's
        first member also the worker that runs the decode loop over a TensorForward."""
        from skulkp2p.engine.runner.loader import serving_dtype
        from skulkp2p.node.tensor_roles import TensorRole

        spec = self._source(model, placed.source)
        rank = p.ring.index(self.name)
        log.info("cluster: model %s: this node is rank %d of a tensor-parallel group of %d "
                 "(%s)", model, rank, len(p.ring), ", ".join(p.ring))

        def ready(info: Message) -> None:
            if self.tensor_roles.get(model) is role:
                report: Message = {"layers": [0, placed.layers], "parallel": "tensor",
                                   "rank": rank, "pid": info.get("pid"),
                                   "param_bytes": info.get("param_bytes")}
                costs = measured.get("costs")  # (measured before the group was ready)
                if costs is not None:
                    report["verify_costs"] = _from_json(costs.to_json())
                self._report_stage(model, report)

        # This generation's measured verify costs, kept for the report above (the first member).
        measured: dict[str, VerifyCosts | None] = {}
        loop = asyncio.get_running_loop()

        def prepare(loaded: LoadedModel, proc: RankProcess) -> None:
            from skulkp2p.engine.drafting.call_costs import LiveWidthCosts

            costs = self._measure_group_widths(model, loaded, proc, p.ring)
            live = loaded.width_costs  # the live table seeded by this probe, from now on
            if costs is not None and isinstance(live, LiveWidthCosts):
                costs = self._watch_live_costs(model, role, live, loop)
            measured["costs"] = costs
            if costs is not None:  # shown in /v1/cluster (the stage's report) at once
                loop.call_soon_threadsafe(self._report_costs, model, role, costs)

        def formation_error(error: str | None) -> None:
            # (from supervision, on the loop) why the group cannot form: /v1/cluster shows it
            # under this member's stages.MODEL.error until a new generation starts
            if self.tensor_roles.get(model) is role:
                report: Message = {"layers": [0, placed.layers], "parallel": "tensor",
                                   "rank": rank}
                self._report_stage(model, {**report, "error": error} if error else report)

        role = TensorRole(self._cluster, model, p.ring, f"{p.term}.{p.serial}",
                          lambda: self.store.pull(spec),
                          serving_dtype, on_ready=ready,
                          prefix_cache_mb=self.prefix_cache_mb, on_error=formation_error,
                          prefix_disk=self.prefix_disk)
        self.tensor_roles[model] = role
        role.start()
        if p.entry != self.name:
            return

        def load() -> Engine:
            from skulkp2p.engine.runner.loader import open_model
            from skulkp2p.engine.runner.mlx_engine import MlxEngine

            loaded = open_model(self.store, spec, head_only=True)
            loaded.make_forward = self._tensor_forward_factory(model, p.ring, loaded, role)
            # The group's own width costs, measured each time a generation of it forms (before
            # requests may use it); also now if it formed while the head was loading.
            role.prepare = lambda proc: prepare(loaded, proc)
            if role.ready and role.proc is not None:
                prepare(loaded, role.proc)
            # The prefix cache's index here; each rank keeps its own slice of every entry (on
            # its disk too, as this index does).
            return MlxEngine(loaded, self.prefix_cache_mb, prefix_disk=self.prefix_disk)
        self._ensure_worker(model, placed.source, load)

    @staticmethod
    def _measure_group_widths(model: str, loaded: LoadedModel, proc: RankProcess,
                              ring: tuple[str, ...]) -> VerifyCosts | None:
        """The group's verify costs, measured now (None when that failed: the costs from
        before stay the controller's, and nothing is shown for this generation)."""
        from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
        from skulkp2p.engine.parallel.tensor.group import TensorError, measure_group_widths

        loaded.verify_costs = None
        try:
            seconds = measure_group_widths(loaded.model, loaded.tokenizer, proc)
        except TensorError as e:
            log.warning("tensor: %s: measuring the group's widths failed: %s", model, e)
            return None
        where = f"tensor-parallel group {', '.join(ring)}"
        # Seeded by the probe, then following the group's own verify calls (every request's
        # TensorForward times its calls into it: engine/drafting/call_costs.py).
        loaded.width_costs = LiveWidthCosts(seconds, where=where)
        loaded.verify_costs = VerifyCosts(seconds, time.time(), where)
        log.info("tensor: %s: the group's verify costs (relative to one row): %s", model,
                 ", ".join(f"w{w}={c:.2f}" for w, c in sorted(loaded.width_costs.items())))
        return loaded.verify_costs

    def _watch_live_costs(self, model: str, role: TensorRole, live: LiveWidthCosts,
                          loop: asyncio.AbstractEventLoop) -> VerifyCosts:
        """Have this member's stage report (what /v1/cluster and other nodes' /v1/models show)
        follow the group's live width table: after a call changed it, the report is refreshed
        within LIVE_REPORT_S (at most that often: a request makes a call per token)."""
        pending = threading.Event()

        def flush() -> None:
            pending.clear()
            self._report_costs(model, role, live.snapshot())

        def changed() -> None:  # on the decode loop's thread
            if not pending.is_set():
                pending.set()
                loop.call_soon_threadsafe(loop.call_later, LIVE_REPORT_S, flush)

        live.on_change = changed
        return live.snapshot()

    def _report_costs(self, model: str, role: TensorRole, costs: VerifyCosts) -> None:
        """Add a group's verify costs to this member's stage report, once it made one."""
        report = _stages(self._cluster).get(model)
        if self.tensor_roles.get(model) is role and isinstance(report, dict) and report.get(
                "parallel") == "tensor":
            self._report_stage(model, {**report, "verify_costs": _from_json(costs.to_json())})

    def _tensor_forward_factory(
            self, model: str, ring: tuple[str, ...], loaded: LoadedModel, role: TensorRole
    ) -> Callable[[GenerationRequest, str | None, Callable[[], None] | None], TensorForward]:
        from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
        from skulkp2p.engine.parallel.tensor.group import TensorError, TensorForward
        from skulkp2p.engine.protocol import EngineUnavailable

        others = [n for n in ring if n != self.name]
        node = self._cluster
        checks = [member_check(node, n) for n in others]

        def make(req: GenerationRequest, hidden: str | None,
                 interrupt: Callable[[], None] | None) -> TensorForward:
            p = self._held(model)
            if p is None or p.ring != ring:
                raise TensorError(f"model {model} was re-placed; retry")
            proc, gen = role.proc, role.gen
            if role.error is not None:
                raise EngineUnavailable(f"model {model}: its tensor-parallel group "
                                        f"({', '.join(ring)}) cannot form: {role.error}")
            if proc is None or not role.ready:
                raise EngineUnavailable(f"model {model}: its tensor-parallel group "
                                        f"({', '.join(ring)}) is forming; retry shortly")

            def broken() -> str | None:
                for name, check in zip(others, checks, strict=True):
                    why = check()
                    if why:
                        return f"node {name} {why}"
                now = self._held(model)
                if now is None or now.ring != ring:
                    return f"model {model} was re-placed; retry"
                if role.gen != gen or role.proc is not proc:
                    return "the group re-formed; retry"
                return None

            live = loaded.width_costs  # this generation's table, when it measured one
            return TensorForward(loaded.model, proc,
                                 prefill_step=int(loaded.runtime.get("prefill_step", 2048)),
                                 hidden=hidden, interrupt=interrupt, check=broken,
                                 label=f"{model} ({', '.join(ring)})",
                                 call_costs=live if isinstance(live, LiveWidthCosts) else None)

        return make

    def _report_stage(self, model: str, report: Message) -> None:
        # What the stage really holds, from its parameters (not the card): /v1/cluster shows it.
        node = self._cluster
        stages = _stages(node)
        stages[model] = report
        node.update_facts(stages=stages)

    def _ring_addr(self, name: str) -> str | None:
        m = self._cluster.started_core.membership.get(name)
        addr = m.facts.get("ring") if m is not None else None
        return addr if isinstance(addr, str) else None

    def _ring_forward_factory(
            self, model: str, ring: tuple[str, ...], loaded: LoadedModel
    ) -> Callable[[GenerationRequest, str | None, Callable[[], None] | None], RingForward]:
        from skulkp2p.engine.model.stage import StageModel
        from skulkp2p.engine.parallel.ring.traversal import RingError, RingForward

        node = self._cluster
        checks = [member_check(node, n) for n in ring if n != self.name]
        span = loaded.span
        assert span is not None, "a ring's last stage is loaded with its span"
        stage = StageModel(loaded.model, span)

        def broken() -> str | None:
            # A lost member first: the re-placement it causes may reach this node before
            # the news of the member itself, so that case names the lost members too.
            for name, check in zip([n for n in ring if n != self.name], checks, strict=True):
                why = check()
                if why:
                    return f"node {name} {why}"
            now = self._held(model)
            if now is None or now.ring != ring:
                # Named from the whole new placement: it may hold no replica on this node (a
                # model that fits one node goes to one), and then this node is among them.
                placed = node.started_core.placements().get(model)
                gone = [n for n in ring if placed is not None and n not in placed.holders]
                without = f" without node {', '.join(gone)}" if gone else ""
                return f"model {model} was re-placed{without}; retry"
            return None

        def make(req: GenerationRequest, hidden: str | None,
                 interrupt: Callable[[], None] | None) -> RingForward:
            p = self._held(model)
            if p is None or p.ring != ring:
                raise RingError(f"model {model} was re-placed; retry")
            first = self._ring_addr(ring[0])
            if not first:
                raise RingError(f"node {ring[0]} has no ring address yet; retry")
            link = TcpRingLink(self.ring, model, first, broken)
            return RingForward(stage, link, term=p.term, instance=self.instance,
                               request=uuid.uuid4().hex,
                               prefill_step=int(loaded.runtime.get("prefill_step", 2048)),
                               hidden=hidden, interrupt=interrupt)

        return make

    def _ensure_worker(self, model: str, source: str = "",
                       load: Callable[[], Engine] | None = None) -> None:
        if model in self.workers:
            return
        spec = self._source(model, source)
        aliases = (self.own_model,) if model == self.own_id else ()
        worker = ModelWorker(model, load or (lambda: self.load_model(spec)),
                             max_queue=self.max_queue)
        worker.telemetry = self.telemetry
        self.workers[model] = worker
        self.apis[model] = ModelEndpoint(model, worker, aliases, self.keepalive_s)
        log.info("cluster: model %s is placed here: loading it", model)
        worker.start().add_done_callback(lambda fut: self._loaded(model, fut))

    def _loaded(self, model: str, fut: asyncio.Future[Engine]) -> None:
        if fut.cancelled():
            return
        error = fut.exception()
        if error is None:
            report = self._stage_reports.pop(model, None)
            if report is not None and self.node is not None:
                self._report_stage(model, report)
            if self.on_ready is not None:
                self.on_ready(fut.result())
            return
        log.error("model %s failed to load: %s: %s", model, type(error).__name__, error)
        if model == self.own_id and self.own_failed is not None and not self.own_failed.done():
            self.own_failed.set_result(error)

    async def stop_workers(self, timeout: float = 10.0) -> bool:
        for role in self.tensor_roles.values():
            role.stop(publish=False)  # rank processes end by pid with the node
        loop = asyncio.get_running_loop()
        # a ring stage's prefix cache writes what it queued for the disk (bounded, like the
        # workers' engines)
        caches = [c for w, _ in self.ring.stages.values() if (c := w.prefix_cache) is not None]
        closed = asyncio.gather(*(loop.run_in_executor(None, c.close, timeout) for c in caches))
        results = await asyncio.gather(*(loop.run_in_executor(None, w.stop, timeout)
                                         for w in self.workers.values()))
        await closed
        return all(results)


def _unsent(f: object) -> None:
    """A draft-memory frame that could not go out: the other replica drafts without it."""
    import concurrent.futures

    if isinstance(f, concurrent.futures.Future) and not f.cancelled() and f.exception():
        log.debug("draft memory: not shared: %r", f.exception())


def member_check(node: ClusterNode, name: str) -> Callable[[], str | None]:
    """Why member `name` can no longer serve its part (declared dead or gone, or restarted
    since this was made), or None while it can."""
    core = node.started_core
    m0 = core.membership.get(name)
    instance = m0.instance if m0 is not None else ""

    def check() -> str | None:
        m = core.membership.get(name)
        if m is None or m.state not in (ALIVE, SUSPECT):
            return f"declared {m.state if m else 'gone'} by the cluster"
        if m.instance != instance:
            return "restarted"
        return None

    return check


def _open_stage(store: ModelStore, spec: str, span: StageSpan) -> LoadedModel:
    from skulkp2p.engine.runner.loader import open_model
    return open_model(store, spec, span=span)


def _stages(node: ClusterNode) -> Message:
    """A copy of the stage reports in this node's facts ({model: report})."""
    stages = node.facts.get("stages")
    return dict(stages) if isinstance(stages, dict) else {}


def _from_json(value: JSONValue) -> WireValue:
    """A JSON value as a fact (the same value; a JSON list or map is a wire one too, but its
    type says otherwise)."""
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value
