"""The composition root's heart: a cluster node's models, engines and HTTP routes wired together.

The API routes of skulkp2p.api (OpenAI, Anthropic) run unchanged; this module is their
`ModelResolver`: it looks each request's model up in the cluster's placements:

- placed on a ring of this node alone: served here, by this node's worker for that model
  (started when the placement arrives; 503 + Retry-After while it loads);
- placed on another node: forwarded to that node's HTTP address, the answer streamed back
  (see api/forward.py: a dead or frozen node ends the request with a clear error, never a hang);
- no leader (an election, or a partition's minority side) or no placement yet: 503 with
  Retry-After, which the openai client retries; a model that fits nowhere: 503 naming the
  memory it needs and what the cluster has.

A ring of several nodes (a model split by layers): every member loads only its layers; requests
go to the ring's last stage, whose worker runs the decode loop over a RingForward (engine/ring.py,
cluster/ring_link.py). Routes of the cluster itself: GET /v1/cluster, POST /v1/cluster/place, and POST
/v1/cluster/generate (the JSONL pipe's request and result format, used by ``pipe --peer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from skulkp2p import wire
from skulkp2p.api import dashboard
from skulkp2p.api.app import Remote, add_model_routes, routed
from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.errors import ApiError
from skulkp2p.api.forward import is_forwarded
from skulkp2p.api.pipe_route import pipe_generate
from skulkp2p.api.server import HttpRequest, HttpServer, Response, Router
from skulkp2p.api.worker import ModelWorker
from skulkp2p.cluster.core import ClusterCore
from skulkp2p.cluster.membership import ALIVE, SUSPECT
from skulkp2p.cluster.node import ClusterNode, NodeConfig, model_spec, parse_addr, split_addr
from skulkp2p.cluster.placement import Placement
from skulkp2p.cluster.ring_link import RingData, TcpRingLink
from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB, Engine, VerifyCosts
from skulkp2p.node.place_route import PlaceRoute
from skulkp2p.node.place_route import unavailable as _unavailable
from skulkp2p.telemetry import Telemetry

if TYPE_CHECKING:
    from skulkp2p.engine.model import LoadedModel
    from skulkp2p.engine.stage import StageSpan
    from skulkp2p.node.tensor_roles import TensorRole

log = logging.getLogger("skulkp2p.node")

# A tensor group's live width table is re-reported (/v1/cluster) at most this often.
LIVE_REPORT_S = 1.0
NOT_FITTING_RETRY_AFTER = "10"  # only new nodes can make room


class ClusterServing:
    def __init__(self, store: Any, own_model: str, own_id: str,
                 load_model: Callable[[str], Engine], *, max_queue: int = 16,
                 keepalive_s: float = 10.0, on_ready: Callable[[Engine], None] | None = None,
                 load_stage: Callable[[str, StageSpan], LoadedModel] | None = None,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 max_batch: int | None = None):
        self.store = store
        self.own_model = own_model  # as given on the command line (card id or path)
        self.own_id = own_id
        self.load_model = load_model
        self.max_queue = max_queue
        self.keepalive_s = keepalive_s
        self.on_ready = on_ready
        self.node: ClusterNode | None = None
        self.workers: dict[str, ModelWorker] = {}
        self.apis: dict[str, ModelEndpoint] = {}
        self.own_failed: asyncio.Future | None = None
        self._told: set[tuple[str, tuple[str, ...]]] = set()
        self._roles: dict[str, tuple[Any, Any]] = {}  # model -> (ring, layers) held here
        self.ring = RingData(b"")  # the data plane; its key is set in serve_cluster
        self.instance = uuid.uuid4().hex  # this process's incarnation, on ring frames
        self.load_stage = load_stage or (lambda spec, span: _open_stage(store, spec, span))
        self._stage_reports: dict[str, dict[str, Any]] = {}  # set on a worker thread
        self.telemetry = Telemetry()  # the dashboard and /metrics (api/dashboard.py)
        self.prefix_cache_mb = prefix_cache_mb  # each model's, and each ring stage's own
        self.max_batch = max_batch  # a ring's last stage's (None: the card's, else default)
        self.tensor_roles: dict[str, TensorRole] = {}  # model -> this node's rank of its group

    @property
    def name(self) -> str:
        return self.node.config.name

    # ---------------------------------------------------------------- cluster events

    def on_cluster_change(self, node: ClusterNode) -> None:
        """Placements changed: start a worker for every model placed on this node alone, and a
        stage for every ring this node is a member of (the last stage runs the decode loop)."""
        for model, p in sorted(node.placements().items()):
            sig = (p.ring, p.layers) + ((p.term, p.serial) if p.parallel == "tensor" else ())
            if model in self._roles and self._roles[model] != sig:
                self._retire(model)  # re-placed: what this node held for it is stale
            if p.ring == (self.name,):
                self._roles[model] = sig
                self._ensure_worker(model, p.spec.source if p.spec else "")
            elif len(p.ring) > 1 and self.name in p.ring and p.spec is not None:
                if model not in self._roles:
                    self._roles[model] = sig
                    if p.parallel == "tensor":
                        self._start_tensor(model, p)
                    else:
                        self._start_stage(model, p)
                stage = self.ring.stages.get(model)
                if stage is not None:
                    stage[0].term = p.term
            elif (model, p.ring) not in self._told:
                self._told.add((model, p.ring))
                if model == self.own_id and len(p.ring) == 1:
                    log.info("cluster: model %s is served by node %s; requests here are "
                             "forwarded to it", model, p.ring[0])

    def _retire(self, model: str) -> None:
        self._roles.pop(model, None)
        self.ring.set_stage(model, None)
        role = self.tensor_roles.pop(model, None)
        if role is not None:
            role.stop()  # its rank process, by pid: the new placement forms a new group
        self.apis.pop(model, None)
        worker = self.workers.pop(model, None)
        if worker is not None:
            asyncio.get_running_loop().run_in_executor(None, worker.stop, 5.0)
        self.node.update_facts(stages={k: v for k, v in self.node.facts.get(
            "stages", {}).items() if k != model})

    def _source(self, model: str, source: str) -> str:
        return self.own_model if model == self.own_id else (source or model)

    def _start_stage(self, model: str, p: Placement) -> None:
        """Load this node's slice of a ring. The last stage serves the model's requests (its
        worker runs the decode loop over a RingForward); the others answer ring frames."""
        from skulkp2p.engine.stage import StageSpan

        idx = p.ring.index(self.name)
        span = StageSpan(p.layers[idx][0], p.layers[idx][1], p.spec.layers)
        spec = self._source(model, p.spec.source)
        log.info("cluster: model %s: this node is stage %d of %d (layers %d-%d): loading them",
                 model, idx + 1, len(p.ring), span.start, span.end - 1)
        if span.last:
            def load() -> Engine:
                from skulkp2p.engine.stage import param_bytes
                from skulkp2p.node.engines import mlx_engine

                loaded = self.load_stage(spec, span)
                loaded.make_forward = self._ring_forward_factory(model, p.ring, loaded)
                self._stage_reports[model] = {"layers": [span.start, span.end],
                                              "param_bytes": param_bytes(loaded.model)}
                return mlx_engine(loaded, self.prefix_cache_mb, max_batch=self.max_batch)
            self._ensure_worker(model, p.spec.source, load)
            return
        loop = asyncio.get_running_loop()
        nxt = p.ring[idx + 1]

        def loaded_stage(fut: asyncio.Future) -> None:
            if fut.cancelled() or self._roles.get(model) != (p.ring, p.layers):
                return
            if fut.exception() is not None:
                log.error("model %s: stage failed to load: %s", model, fut.exception())
                return
            from skulkp2p.engine.prefix_cache import MB, PrefixCache
            from skulkp2p.engine.ring import StageWorker
            from skulkp2p.engine.stage import StageModel, param_bytes

            loaded = fut.result()
            mb = self.prefix_cache_mb
            worker = StageWorker(StageModel(loaded.model, span), p.term,
                                 PrefixCache(int(mb * MB)) if mb > 0 else None)
            self.ring.set_stage(model, worker, lambda: self._ring_addr(nxt))
            log.info("cluster: model %s: stage %d of %d ready (layers %d-%d, %.1f MB held)",
                     model, idx + 1, len(p.ring), span.start, span.end - 1,
                     param_bytes(loaded.model) / 1e6)
            self._report_stage(model, {"layers": [span.start, span.end],
                                       "param_bytes": param_bytes(loaded.model)})

        loop.run_in_executor(None, self.load_stage, spec, span).add_done_callback(loaded_stage)

    def _start_tensor(self, model: str, p: Placement) -> None:
        """This node's rank of a tensor-parallel group (node/tensor_roles.py); on the group's
        first member also the worker that runs the decode loop over a TensorForward."""
        from skulkp2p.engine.loader import serving_dtype
        from skulkp2p.node.tensor_roles import TensorRole

        spec = self._source(model, p.spec.source)
        rank = p.ring.index(self.name)
        log.info("cluster: model %s: this node is rank %d of a tensor-parallel group of %d "
                 "(%s)", model, rank, len(p.ring), ", ".join(p.ring))

        def ready(info: dict[str, Any]) -> None:
            if self.tensor_roles.get(model) is role:
                report = {"layers": [0, p.spec.layers], "parallel": "tensor", "rank": rank,
                          "pid": info.get("pid"), "param_bytes": info.get("param_bytes")}
                costs = measured.get("costs")  # (measured before the group was ready)
                if costs is not None:
                    report["verify_costs"] = costs.to_json()
                self._report_stage(model, report)

        # This generation's measured verify costs, kept for the report above (the first member).
        measured: dict[str, Any] = {}
        loop = asyncio.get_running_loop()

        def prepare(loaded: LoadedModel, proc: Any) -> None:
            costs = self._measure_group_widths(model, loaded, proc, p.ring)
            if costs is not None:  # the live table seeded by this probe, from now on
                costs = self._watch_live_costs(model, role, loaded.width_costs, loop)
            measured["costs"] = costs
            if costs is not None:  # shown in /v1/cluster (the stage's report) at once
                loop.call_soon_threadsafe(self._report_costs, model, role, costs)

        def formation_error(error: str | None) -> None:
            # (from supervision, on the loop) why the group cannot form: /v1/cluster shows it
            # under this member's stages.MODEL.error until a new generation starts
            if self.tensor_roles.get(model) is role:
                report = {"layers": [0, p.spec.layers], "parallel": "tensor", "rank": rank}
                self._report_stage(model, {**report, "error": error} if error else report)

        role = TensorRole(self.node, model, p.ring, f"{p.term}.{p.serial}",
                          lambda: self.store.pull(spec),
                          serving_dtype, on_ready=ready,
                          prefix_cache_mb=self.prefix_cache_mb, on_error=formation_error)
        self.tensor_roles[model] = role
        role.start()
        if p.entry != self.name:
            return

        def load() -> Engine:
            from skulkp2p.engine.loader import open_model
            from skulkp2p.engine.mlx_engine import MlxEngine

            loaded = open_model(self.store, spec, head_only=True)
            loaded.make_forward = self._tensor_forward_factory(model, p.ring, loaded, role)
            # The group's own width costs, measured each time a generation of it forms (before
            # requests may use it); also now if it formed while the head was loading.
            role.prepare = lambda proc: prepare(loaded, proc)
            if role.ready and role.proc is not None:
                prepare(loaded, role.proc)
            # The prefix cache's index here; each rank keeps its own slice of every entry.
            return MlxEngine(loaded, self.prefix_cache_mb)
        self._ensure_worker(model, p.spec.source, load)

    @staticmethod
    def _measure_group_widths(model: str, loaded: LoadedModel, proc: Any,
                              ring: tuple[str, ...]) -> VerifyCosts | None:
        """The group's verify costs, measured now (None when that failed: the costs from
        before stay the controller's, and nothing is shown for this generation)."""
        from skulkp2p.engine.call_costs import LiveWidthCosts
        from skulkp2p.engine.tensor import TensorError, measure_group_widths

        loaded.verify_costs = None
        try:
            seconds = measure_group_widths(loaded.model, loaded.tokenizer, proc)
        except TensorError as e:
            log.warning("tensor: %s: measuring the group's widths failed: %s", model, e)
            return None
        where = f"tensor-parallel group {', '.join(ring)}"
        # Seeded by the probe, then following the group's own verify calls (every request's
        # TensorForward times its calls into it: engine/call_costs.py).
        loaded.width_costs = LiveWidthCosts(seconds, where=where)
        loaded.verify_costs = VerifyCosts(seconds, time.time(), where)
        log.info("tensor: %s: the group's verify costs (relative to one row): %s", model,
                 ", ".join(f"w{w}={c:.2f}" for w, c in sorted(loaded.width_costs.items())))
        return loaded.verify_costs

    def _watch_live_costs(self, model: str, role: Any, live: Any,
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

    def _report_costs(self, model: str, role: Any, costs: VerifyCosts) -> None:
        """Add a group's verify costs to this member's stage report, once it made one."""
        report = (self.node.facts.get("stages") or {}).get(model)
        if self.tensor_roles.get(model) is role and report and report.get("parallel") == \
                "tensor":
            self._report_stage(model, {**report, "verify_costs": costs.to_json()})

    def _tensor_forward_factory(self, model: str, ring: tuple[str, ...], loaded: LoadedModel,
                                role: Any):
        from skulkp2p.engine.call_costs import LiveWidthCosts
        from skulkp2p.engine.protocol import EngineUnavailable
        from skulkp2p.engine.tensor import TensorError, TensorForward

        others = [n for n in ring if n != self.name]
        checks = [self._alive(n) for n in others]

        def make(req: Any, hidden: str | None, interrupt: Any) -> TensorForward:
            p = self.node.core.placements().get(model)
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
                now = self.node.core.placements().get(model)
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

    def _report_stage(self, model: str, report: dict[str, Any]) -> None:
        # What the stage really holds, from its parameters (not the card): /v1/cluster shows it.
        stages = dict(self.node.facts.get("stages", {}))
        stages[model] = report
        self.node.update_facts(stages=stages)

    def _ring_addr(self, name: str) -> str | None:
        m = self.node.core.membership.get(name)
        return m.facts.get("ring") if m is not None else None

    def _ring_forward_factory(self, model: str, ring: tuple[str, ...], loaded: LoadedModel):
        from skulkp2p.engine.ring import RingError, RingForward
        from skulkp2p.engine.stage import StageModel

        checks = [self._alive(n) for n in ring if n != self.name]
        stage = StageModel(loaded.model, loaded.span)

        def broken() -> str | None:
            # A lost member first: the re-placement it causes may reach this node before
            # the news of the member itself, so that case names the lost members too.
            for name, check in zip([n for n in ring if n != self.name], checks, strict=True):
                why = check()
                if why:
                    return f"node {name} {why}"
            now = self.node.core.placements().get(model)
            if now is None or now.ring != ring:
                gone = [n for n in ring if now is None or n not in now.ring]
                without = f" without node {', '.join(gone)}" if gone and now else ""
                return f"model {model} was re-placed{without}; retry"
            return None

        def make(req: Any, hidden: str | None, interrupt: Any) -> RingForward:
            p = self.node.core.placements().get(model)
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

    def _loaded(self, model: str, fut: asyncio.Future) -> None:
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
        results = await asyncio.gather(*(loop.run_in_executor(None, w.stop, timeout)
                                         for w in self.workers.values()))
        return all(results)

    # ---------------------------------------------------------------- routing

    def router(self) -> Router:
        r = Router()
        r.add("GET", "/health", self.health)
        r.add("GET", "/v1/models", self.models)
        add_model_routes(r, self)
        r.add("POST", "/v1/cluster/generate", routed(pipe_generate, self))
        r.add("GET", "/v1/cluster", self.cluster)
        r.add("POST", "/v1/cluster/place", self.place)
        dashboard.add_routes(r, self.telemetry, self.cluster_view, lambda: self.workers)
        return r

    def cluster_view(self) -> dict[str, Any] | None:
        """What the dashboard and /metrics read of the cluster: the node's status (as GET
        /v1/cluster shows it) plus the data plane's counters; None before the node started."""
        if self.node is None or self.node.core is None:
            return None
        st = self.node.status()
        st["data_metrics"] = dict(self.ring.metrics)
        return st

    def _core(self) -> ClusterCore:
        """The cluster's state; 503 in the moment between the HTTP port opening and the
        cluster node starting (a health check polls from the first open port)."""
        if self.node is None or self.node.core is None:
            raise _unavailable("this node is starting: it has not joined the cluster yet",
                               "node_starting")
        return self.node.core

    def _model_id(self, name: Any) -> str:
        if name is None:
            return self.own_id
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", param="model")
        core = self._core()
        if name in core.placements() or name in core.placement_errors() or name == self.own_id:
            return name
        if name == self.own_model:
            return self.own_id
        try:
            return self.store.resolve(name).id
        except Exception:
            placed = ", ".join(sorted(core.placements())) or "none"
            raise ApiError(404, f"model {name!r} is not known here (placed in the cluster: "
                                f"{placed})", param="model", code="model_not_found") from None

    def _target(self, model: str) -> tuple[str, str | None]:
        """Where ``model`` is served: ("local", None) or (node name, its HTTP address)."""
        core = self._core()
        if core.leader is None:
            voters = len(core.membership.voters())
            raise _unavailable(
                f"the cluster has no leader right now (an election is under way, or this node "
                f"cannot reach a majority of the {voters} known members); retry shortly",
                "no_leader")
        p = core.placements().get(model)
        if p is None:
            err = core.placement_errors().get(model)
            if err is not None:
                raise _unavailable(err["error"], "model_not_placed", NOT_FITTING_RETRY_AFTER)
            if model in core.requested():
                raise _unavailable(f"model {model} is being placed; retry shortly",
                                   "model_not_placed")
            placed = ", ".join(sorted(core.placements())) or "none"
            raise ApiError(404, f"model {model!r} is not placed in this cluster (placed: "
                                f"{placed}); ask for it with POST /v1/cluster/place",
                           param="model", code="model_not_found")
        entry = p.entry  # a ring's last stage, a tensor group's first member: the loop runs there
        if entry == self.name:
            return "local", None
        m = core.membership.get(entry)
        http = m.facts.get("http") if m is not None else None
        if m is None or m.state not in (ALIVE, SUSPECT) or not http:
            state = m.state if m is not None else "unknown"
            raise _unavailable(f"node {entry}, which serves model {model}, is {state}; the "
                               "cluster will place it again", "node_lost")
        return entry, str(http)

    def _alive(self, name: str) -> Callable[[], str | None]:
        core = self.node.core
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

    def resolve(self, req: HttpRequest) -> tuple[HttpRequest, ModelEndpoint | Remote]:
        """The API's ModelResolver: this node's endpoint for the model, or the node to forward
        to."""
        body = req.json()
        name = body.get("model") if isinstance(body, dict) else None
        model = self._model_id(name)
        if isinstance(body, dict) and name is not None and name != model:
            # Name the model by its cluster-wide id: the serving node may not know this
            # node's alias for it (a local path, say).
            req = dataclasses.replace(req, body=orjson.dumps({**body, "model": model}))
        if is_forwarded(req):
            api = self.apis.get(model)
            if api is None:  # the placement moved while the request travelled
                raise _unavailable(f"model {model} is not served by node {self.name} "
                                   "(its placement changed); retry", "model_moved")
            return req, api
        where, http = self._target(model)
        if where == "local":
            api = self.apis.get(model)
            if api is None:
                raise _unavailable(f"model {model} is loading", "model_loading")
            return req, api
        assert http is not None
        return req, Remote(where, http, self._alive(where))

    # ---------------------------------------------------------------- plain routes

    async def health(self, req: HttpRequest) -> Response:
        where, _http = self._target(self.own_id)
        if where == "local":
            api = self.apis.get(self.own_id)
            if api is None:
                raise _unavailable(f"model {self.own_id} is loading", "model_loading")
            if api.worker.state != "ready":
                raise api.unavailable()
            return Response.json(200, {"status": "ok", "model": self.own_id,
                                       "waiting": api.worker.waiting,
                                       "busy": api.worker.current is not None,
                                       "node": self.name, "leader": self.node.core.leader,
                                       "served_by": self.name})
        return Response.json(200, {"status": "ok", "model": self.own_id, "node": self.name,
                                   "leader": self.node.core.leader, "served_by": where})

    async def models(self, req: HttpRequest) -> Response:
        core = self._core()
        data = []
        for model, p in sorted(core.placements().items()):
            worker = self.workers.get(model)
            entry = {"id": model, "object": "model", "owned_by": "skulkp2p",
                     "created": int(time.time()), "ring": list(p.ring),
                     "parallel": p.parallel or "pipeline",
                     "ready": worker.state == "ready" if worker else None}
            costs = self._verify_costs(model, p)
            if costs is not None:
                entry["verify_costs"] = costs
            data.append(entry)
        return Response.json(200, {"object": "list", "data": data})

    def _verify_costs(self, model: str, p: Placement) -> dict[str, Any] | None:
        """The verify costs measured where `model` runs: its engine's here, else what the
        member that runs its loop reported (a tensor group's first member: /v1/cluster)."""
        worker = self.workers.get(model)
        engine = worker.engine if worker is not None else None
        if engine is not None:
            costs = engine.info().verify_costs
            return costs.to_json() if costs is not None else None
        m = self._core().membership.get(p.entry)
        report = ((m.facts.get("stages") or {}).get(model) or {}) if m is not None else {}
        return report.get("verify_costs")

    async def place(self, req: HttpRequest) -> Response:
        core = self._core()
        return await PlaceRoute(core, self.node, self.store, self.name)(req)

    async def cluster(self, req: HttpRequest) -> Response:
        self._core()
        st = self.node.status()
        for m in st["members"]:
            m.pop("self", None)
        return Response.json(200, st)

def _open_stage(store: Any, spec: str, span: StageSpan) -> LoadedModel:
    from skulkp2p.engine.loader import open_model
    return open_model(store, spec, span=span)


# --------------------------------------------------------------------------------------------


def own_want(store: Any, model: str, node_name: str) -> dict[str, Any]:
    """What this node asks the cluster to place: its --model. A model from a local folder or
    file can only be placed on nodes that have it (those that ask for it)."""
    resolved = store.resolve(model)
    want = model_spec(store, model).to_dict()
    if resolved.card is None or resolved.card.source.kind == "local":
        want["only"] = [node_name]
    return want


def detect_engines() -> list[str]:
    """Engines this node can run, without importing them (mlx import is slow)."""
    engines = []
    if importlib.util.find_spec("mlx") is not None:
        if sys.platform == "darwin":
            engines.append("mlx-metal")
        elif importlib.util.find_spec("mlx_cuda") is not None or \
                os.environ.get("SKULKP2P_DEVICE", "").lower() == "cuda":
            engines.append("mlx-cuda")
        else:
            engines.append("mlx-cpu")
    from skulkp2p.served.binary import engines as served_engines
    engines.extend(served_engines())  # llama_server, llama_server-<cuda|rocm|vulkan|cpu>
    return engines


def node_facts(store: Any) -> dict[str, Any]:
    """Facts for the cluster beyond memory: engines, models on disk, the dtype we run."""
    facts: dict[str, Any] = {"engines": detect_engines()}
    try:
        facts["models"] = [row["id"] for row in store.list() if row["pulled"]]
    except Exception:  # a broken card must not keep the node out of the cluster
        facts["models"] = []
    try:
        from skulkp2p.engine import blas

        facts["dtype"] = blas.fast_path_report()["dtype"]
    except Exception:
        facts["dtype"] = "bfloat16"
    return facts


async def serve_cluster(config: NodeConfig, serving: ClusterServing, want: dict[str, Any],
                        http_host: str, http_port: int, stop: asyncio.Event, *,
                        http_config: Any = None, facts: dict[str, Any] | None = None,
                        on_listening: Callable[[str, int], None] | None = None,
                        ) -> tuple[bool, BaseException | None]:
    """Run the HTTP API and the cluster node until ``stop``. Returns (workers ended cleanly,
    the load error of this node's own model if it failed here)."""
    server = HttpServer(serving.router(), http_config)
    host, port = await server.start(http_host, http_port)
    if on_listening:
        on_listening(host, port)
    http_fact_host = host if host not in ("0.0.0.0", "::", "") else None
    facts = {**(facts or {}), "wants": [want]}
    if http_fact_host is not None:
        facts["http"] = parse_addr(f"{http_fact_host}:{port}")
    serving.ring.key = wire.frame_key(config.secret)
    ring_host = config.host if config.host not in ("0.0.0.0", "::", "") else "0.0.0.0"
    ring_addr = await serving.ring.start(ring_host, config.host if ring_host != "0.0.0.0"
                                         else None)
    node = ClusterNode(config, {**facts, "ring": ring_addr},
                       on_change=serving.on_cluster_change)
    serving.node = node
    serving.own_failed = asyncio.get_running_loop().create_future()
    try:
        await node.start()
        if http_fact_host is None:  # reachable where the cluster reaches us
            http_fact_host = split_addr(node.addr)[0]
            node.update_facts(http=parse_addr(f"{http_fact_host}:{port}"),
                              ring=parse_addr(f"{http_fact_host}:{split_addr(ring_addr)[1]}"))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({stopper, serving.own_failed},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
    finally:
        await server.close()
        await node.close(leave=True)
        await serving.ring.close()
        clean = await serving.stop_workers()
    error = serving.own_failed.result() if serving.own_failed.done() else None
    return clean, error
