"""The composition root's heart: a cluster node's models, engines and HTTP routes wired together.

The API routes of skulkp2p.api (OpenAI, Anthropic) run unchanged; this module is their
`ModelResolver`: it looks each request's model up in the cluster's placements:

- placed on a ring of this node alone: served here, by this node's worker for that model
  (started when the placement arrives, node/stages.py; 503 + Retry-After while it loads);
- placed on another node: forwarded to that node's HTTP address, the answer streamed back
  (see api/relay.py: a dead or frozen node ends the request with a clear error, never a hang);
- placed as several replicas: the one node/replica_route.py chooses (where the prompt's prefix
  was served before, else the least loaded); a replica whose relay just broke is avoided;
- no leader (an election, or a partition's minority side) or no placement yet: 503 with
  Retry-After, which the openai client retries; a model that fits nowhere: 503 naming the
  memory it needs and what the cluster has.

A ring of several nodes (a model split by layers): every member loads only its layers (node/
stages.py); requests go to the ring's last stage, whose worker runs the decode loop over a
RingForward (engine/parallel/ring/traversal.py, cluster/ring_link.py). `serve_cluster` runs the HTTP server, the
cluster node and the ring's data plane together. Routes of the cluster itself: GET /v1/cluster,
POST /v1/cluster/place, and POST /v1/cluster/generate (the JSONL pipe's request and result
format, used by ``pipe --peer``).

Who may ask (api/auth.py): each route declares its access here; the API keys come from the
command line, and the cluster secret signs what this node sends the others over HTTP (a
forwarded request, a stats gather) and checks what they send it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from skulkp2p import wire
from skulkp2p.api import dashboard
from skulkp2p.api.app import Remote, add_model_routes, routed
from skulkp2p.api.auth import OPEN, READ, AuthPolicy, NodeAuth
from skulkp2p.api.endpoint import ModelEndpoint
from skulkp2p.api.errors import ApiError
from skulkp2p.api.pipe_route import pipe_generate
from skulkp2p.api.relay import is_forwarded
from skulkp2p.api.response_store import node_store
from skulkp2p.api.server import HttpRequest, HttpServer, Response, Router, ServerConfig
from skulkp2p.cluster.config import NodeConfig, parse_addr, split_addr
from skulkp2p.cluster.core import ClusterCore
from skulkp2p.cluster.membership import ALIVE, SUSPECT
from skulkp2p.cluster.node import ClusterNode
from skulkp2p.cluster.placement import Placement
from skulkp2p.engine.json_types import JSONValue
from skulkp2p.formats.body_fields import FormatError, check_fields
from skulkp2p.node.place_route import PlaceRoute
from skulkp2p.node.place_route import unavailable as _unavailable
from skulkp2p.node.replica_route import (
    AffinityRecord,
    ReplicaView,
    affinity_chain,
    choose_replica,
    response_key,
)
from skulkp2p.node.stages import LocalPlacements, member_check

log = logging.getLogger("skulkp2p.node")

NOT_FITTING_RETRY_AFTER = "10"  # only new nodes can make room
LOST_HOLD_S = 10.0  # a replica whose relay broke gets no requests for this long (or till dead)
LOAD_GOSSIP_S = 0.25  # how often this node's load and recent keys go into its facts


class ClusterServing:
    """The API's `ModelResolver` and the node's routes; what this node itself runs of the
    placements is `local` (node/stages.py)."""

    def __init__(self, local: LocalPlacements):
        self.local = local
        self.store = local.store
        self.own_model = local.own_model  # as given on the command line (card id or path)
        self.own_id = local.own_id
        self.telemetry = local.telemetry  # the dashboard and /metrics (api/dashboard.py)
        # Signs and checks the HTTP requests between this cluster's nodes (set by
        # serve_cluster from the cluster secret; None without one).
        self.node_auth: NodeAuth | None = None
        # Routing among replicas: the keys of what this node's replicas served (gossiped),
        # the requests this node relayed to each node and not yet done, the nodes whose relay
        # broke (when), and the round for ties.
        self.affinity = AffinityRecord()
        # the keys this node relayed to each replica itself (node -> model -> keys): a
        # conversation through this node stays put before the replica's gossip arrives
        self.sent: dict[str, AffinityRecord] = {}
        self.relayed: dict[str, int] = {}
        self.lost_at: dict[str, float] = {}
        self._turn = 0

    @property
    def node(self) -> ClusterNode | None:
        return self.local.node

    def _node(self) -> ClusterNode:
        """The cluster node; 503 in the moment between the HTTP port opening and the cluster
        node starting (a health check polls from the first open port)."""
        if self.node is None or self.node.core is None:
            raise _unavailable("this node is starting: it has not joined the cluster yet",
                               "node_starting")
        return self.node

    @property
    def name(self) -> str:
        return self._node().config.name

    # ---------------------------------------------------------------- routing

    def router(self) -> Router:
        r = Router()
        r.add("GET", "/health", self.health, OPEN)
        r.add("GET", "/v1/models", self.models, READ)
        add_model_routes(r, self)
        # Generating and placing always ask for a key (when the node has keys), open reads
        # or not: a placement changes the cluster.
        r.add("POST", "/v1/cluster/generate", routed(pipe_generate, self))
        r.add("GET", "/v1/cluster", self.cluster, READ)
        r.add("POST", "/v1/cluster/place", self.place)
        dashboard.add_routes(r, self.telemetry, self.cluster_view, lambda: self.local.workers,
                             self.node_auth)
        return r

    def cluster_view(self) -> wire.Message | None:
        """What the dashboard and /metrics read of the cluster: the node's status (as GET
        /v1/cluster shows it) plus the data plane's counters; None before the node started."""
        if self.node is None or self.node.core is None:
            return None
        st = self.node.status()
        st["data_metrics"] = dict(self.local.ring.metrics)
        return st

    def _core(self) -> ClusterCore:
        """The cluster's state; 503 while the node starts (`_node`)."""
        core = self._node().core
        assert core is not None
        return core

    def _model_id(self, name: JSONValue) -> str:
        """The cluster-wide id of the model a request names: an id the cluster knows (placed,
        being placed, failing to place, or this node's own), this node's --model as given, a
        card id (`_target` says whether it is placed), or a local path that resolves to an id
        the cluster knows. Any other name gets `_not_placed`'s 404, the same whether or not it
        is a path on this node's disk: the API tells no one what the filesystem holds."""
        if name is None:
            return self.own_id
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", param="model")
        core = self._core()
        known = {*core.placements(), *core.placement_errors(), *core.requested(), self.own_id}
        if name in known:
            return name
        if name == self.own_model:
            return self.own_id
        try:
            card = name in self.store.cards
            model = self.store.resolve(name).id
        except Exception:
            card, model = False, None
        if model is None or not (card or model in known):
            raise self._not_placed(name)
        return model

    def _not_placed(self, name: str) -> ApiError:
        """The 404 of a model the cluster does not serve, the same for any name."""
        placed = ", ".join(sorted(self._core().placements())) or "none"
        return ApiError(404, f"model {name[:200]!r} is not placed in this cluster (placed: "
                             f"{placed}); ask for it with POST /v1/cluster/place",
                        param="model", code="model_not_found")

    def _target(self, model: str, chain: list[str] | None = None) -> tuple[str, str | None]:
        """Where ``model`` is served: ("local", None) or (node name, its HTTP address); of
        several replicas, the one `choose_replica` picks for a request keyed by ``chain``."""
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
                raise _unavailable(str(err["error"]), "model_not_placed",
                                   NOT_FITTING_RETRY_AFTER)
            if model in core.requested():
                raise _unavailable(f"model {model} is being placed; retry shortly",
                                   "model_not_placed")
            raise self._not_placed(model)
        # a ring's last stage, a tensor group's first member: the loop runs there
        entry = p.entry if len(p.replicas) == 0 else self._replica(model, p, chain or [])
        if entry == self.name:
            return "local", None
        m = core.membership.get(entry)
        http = m.facts.get("http") if m is not None else None
        if m is None or m.state not in (ALIVE, SUSPECT) or not http:
            state = m.state if m is not None else "unknown"
            raise _unavailable(f"node {entry}, which serves model {model}, is {state}; the "
                               "cluster will place it again", "node_lost")
        return entry, str(http)

    def _replica(self, model: str, p: Placement, chain: list[str]) -> str:
        """The entry of the replica to serve a request of ``model`` keyed by ``chain``: among
        the live ones (not lost by a relay in the last LOST_HOLD_S, alive before suspect),
        `choose_replica` on their gossiped load and keys (this node's own read live, and
        what this node relayed counted at once)."""
        core = self._core()
        now = time.monotonic()
        up: list[str] = []
        doubtful: list[str] = []
        for entry in p.entries:
            m = core.membership.get(entry)
            if m is None or m.state not in (ALIVE, SUSPECT) or not m.facts.get("http"):
                continue
            recent = now - self.lost_at.get(entry, -LOST_HOLD_S) < LOST_HOLD_S
            (doubtful if recent or m.state == SUSPECT else up).append(entry)
        pool = up or doubtful
        if not pool:
            return p.entry  # none alive: _target names the first replica's node as lost
        views = []
        for entry in pool:
            if entry == self.name:
                worker = self.local.workers.get(model)
                load = worker.waiting + len(worker.running) if worker is not None else 0
                keys = self.affinity.keys(model)
            else:
                m = core.membership.get(entry)
                facts = m.facts if m is not None else {}
                loads = facts.get("load")
                told = loads.get(model) if isinstance(loads, dict) else None
                load = max(told if isinstance(told, int) else 0, self.relayed.get(entry, 0))
                held = facts.get("affinity")
                listed = held.get(model) if isinstance(held, dict) else None
                keys = frozenset(str(k) for k in listed) if isinstance(listed, list) \
                    else frozenset()
                sent = self.sent.get(entry)
                if sent is not None:
                    keys |= sent.keys(model)
            views.append(ReplicaView(entry, load, keys))
        self._turn += 1
        return choose_replica(chain, views, self._turn).node

    def _relay_end(self, node: str, model: str, chain: list[str]) -> Callable[[bool], None]:
        """Count a request relayed to ``node`` until it ends, and remember its keys there."""
        self.relayed[node] = self.relayed.get(node, 0) + 1
        self.sent.setdefault(node, AffinityRecord()).record(model, chain)

        def ended(lost: bool) -> None:
            self.relayed[node] = max(0, self.relayed.get(node, 0) - 1)
            if lost:
                self.lost_at[node] = time.monotonic()
                self.sent.pop(node, None)  # its caches are gone with it
        return ended

    def record_response(self, model: str, response_id: str) -> None:
        """A response stored here: a request continuing it is routed here."""
        self.affinity.record(model, [response_key(model, response_id)])

    def load_facts(self) -> tuple[dict[str, wire.WireValue], dict[str, wire.WireValue]]:
        """What this node gossips for routing among replicas: model -> requests queued and
        running here, and model -> the recent keys of what it served."""
        load: dict[str, wire.WireValue] = {
            model: w.waiting + len(w.running) for model, w in sorted(self.local.workers.items())}
        keys: dict[str, wire.WireValue] = {m: list(k) for m, k in self.affinity.gossip().items()}
        return load, keys

    def resolve(self, req: HttpRequest) -> tuple[HttpRequest, ModelEndpoint | Remote]:
        """The API's ModelResolver: this node's endpoint for the model, or the node to forward
        to. The body is read here, once: the route reads the same value (`HttpRequest.json`)."""
        body = req.json()
        name = body.get("model") if isinstance(body, dict) else None
        model = self._model_id(name)
        if isinstance(body, dict) and name is not None and name != model:
            # Name the model by its cluster-wide id: the serving node may not know this
            # node's alias for it (a local path, say). (A body nested too deep to write again
            # is refused first, naming its field, as the route would.)
            try:
                check_fields(body)
            except FormatError as e:
                raise ApiError.from_request_error(e) from None
            req = req.with_json({**body, "model": model})
        core = self.node.core if self.node is not None else None  # (a forwarded request
        placed = core.placements().get(model) if core is not None else None  # needs none)
        replicated = placed is not None and len(placed.replicas) > 0
        chain = affinity_chain(model, req.path, body) if replicated else []
        if is_forwarded(req):
            api = self.local.apis.get(model)
            if api is None:  # the placement moved while the request travelled
                raise _unavailable(f"model {model} is not served by node {self.name} "
                                   "(its placement changed); retry", "model_moved")
            self.affinity.record(model, chain)
            return req, api
        where, http = self._target(model, chain)
        if where == "local":
            api = self.local.apis.get(model)
            if api is None:
                raise _unavailable(f"model {model} is loading", "model_loading")
            self.affinity.record(model, chain)
            return req, api
        assert http is not None
        return req, Remote(where, http, member_check(self._node(), where), self.node_auth,
                           self._relay_end(where, model, chain) if replicated else None)

    # ---------------------------------------------------------------- plain routes

    async def health(self, req: HttpRequest) -> Response:
        where, _http = self._target(self.own_id)
        if where == "local":
            api = self.local.apis.get(self.own_id)
            if api is None:
                raise _unavailable(f"model {self.own_id} is loading", "model_loading")
            if api.worker.state != "ready":
                raise api.unavailable()
            return Response.json(200, {"status": "ok", "model": self.own_id,
                                       "waiting": api.worker.waiting,
                                       "busy": api.worker.current is not None,
                                       "node": self.name, "leader": self._core().leader,
                                       "served_by": self.name})
        return Response.json(200, {"status": "ok", "model": self.own_id, "node": self.name,
                                   "leader": self._core().leader, "served_by": where})

    async def models(self, req: HttpRequest) -> Response:
        core = self._core()
        data = []
        for model, p in sorted(core.placements().items()):
            worker = self.local.workers.get(model)
            entry = {"id": model, "object": "model", "owned_by": "skulkp2p",
                     "created": int(time.time()), "ring": list(p.ring),
                     "parallel": p.parallel or "pipeline",
                     "ready": worker.state == "ready" if worker else None,
                     "replicas": [{"ring": list(r.ring), "entry": r.entry}
                                  for r in p.copies()]}
            if p.spec is not None:  # which engine serves it, and why where a node chose
                entry["engine"] = p.spec.engine or "mlx"
                if p.spec.engine_reason:
                    entry["engine_reason"] = p.spec.engine_reason
            costs = self._verify_costs(model, p)
            if costs is not None:
                entry["verify_costs"] = costs
            engine = worker.engine if worker is not None else None
            memory = engine.info().draft_memory if engine is not None else None
            if memory is not None and p.replicas:  # what this replica's draft memory holds
                entry["draft_memory"] = memory.stats()
            data.append(entry)
        return Response.json(200, {"object": "list", "data": data})

    def _verify_costs(self, model: str, p: Placement) -> object:
        """The verify costs measured where `model` runs: its engine's here, else what the
        member that runs its loop reported (a tensor group's first member: /v1/cluster)."""
        worker = self.local.workers.get(model)
        engine = worker.engine if worker is not None else None
        if engine is not None:
            costs = engine.info().verify_costs
            return costs.to_json() if costs is not None else None
        m = self._core().membership.get(p.entry)
        stages = m.facts.get("stages") if m is not None else None
        report = stages.get(model) if isinstance(stages, dict) else None
        return report.get("verify_costs") if isinstance(report, dict) else None

    async def place(self, req: HttpRequest) -> Response:
        core = self._core()
        return await PlaceRoute(core, self._node(), self.store, self.name)(req)

    async def cluster(self, req: HttpRequest) -> Response:
        st = self._node().status()
        for m in wire.as_list(st["members"]):
            if isinstance(m, dict):
                if m.pop("self", None):  # its own recent keys as they are now, not as gossiped
                    m["affinity"] = {k: len(v) for k, v in self.affinity.gossip().items()}
        return Response.json(200, st)


async def _gossip_load(serving: ClusterServing, node: ClusterNode) -> None:
    """Put this node's load and recent keys into its facts whenever they change, at most every
    LOAD_GOSSIP_S (the other nodes route among replicas on them), and offer what its replicas
    finished to the others' draft memory."""
    sent: tuple[object, object] | None = None
    while True:
        try:
            serving.local.share_draft_memory()
        except Exception:  # a bug here must not stop the load gossip
            log.exception("draft memory: sharing failed")
        load, keys = serving.load_facts()
        if (load, keys) != sent:
            node.update_facts(load=load, affinity=keys)
            sent = (load, keys)
        await asyncio.sleep(LOAD_GOSSIP_S)


async def serve_cluster(config: NodeConfig, serving: ClusterServing, want: wire.Message,
                        http_host: str, http_port: int, stop: asyncio.Event, *,
                        http_config: ServerConfig | None = None,
                        facts: Mapping[str, wire.WireValue] | None = None,
                        on_listening: Callable[[str, int], None] | None = None,
                        ) -> tuple[bool, BaseException | None]:
    """Run the HTTP API and the cluster node until ``stop``. Returns (workers ended cleanly,
    the load error of this node's own model if it failed here). The HTTP requests between
    nodes are signed with the cluster secret (none without one)."""
    serving.node_auth = NodeAuth(config.secret) if config.secret else None
    http_config = http_config or ServerConfig()
    http_config = dataclasses.replace(http_config, auth=dataclasses.replace(
        http_config.auth or AuthPolicy(), node=serving.node_auth))
    server = HttpServer(serving.router(), http_config)
    host, port = await server.start(http_host, http_port)
    if on_listening:
        on_listening(host, port)
    http_fact_host = host if host not in ("0.0.0.0", "::", "") else None
    announced: wire.Message = {**(facts or {}), "wants": [want]}
    if http_fact_host is not None:
        announced["http"] = parse_addr(f"{http_fact_host}:{port}")
    serving.local.ring.key = wire.frame_key(config.secret)
    ring_host = config.host if config.host not in ("0.0.0.0", "::", "") else "0.0.0.0"
    ring_addr = await serving.local.ring.start(ring_host, config.host if ring_host != "0.0.0.0"
                                         else None)
    node = ClusterNode(config, {**announced, "ring": ring_addr},
                       on_change=serving.local.on_cluster_change)
    serving.local.node = node
    own_failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    serving.local.own_failed = own_failed
    try:
        await node.start()
        if http_fact_host is None:  # reachable where the cluster reaches us
            http_fact_host = split_addr(node.addr)[0]
            node.update_facts(http=parse_addr(f"{http_fact_host}:{port}"),
                              ring=parse_addr(f"{http_fact_host}:{split_addr(ring_addr)[1]}"))
            # The other nodes relay requests here with that address as the Host (it may be an
            # advertised name, or an address translated on the way).
            server.allow_host_names(http_fact_host)
        stopper = asyncio.ensure_future(stop.wait())
        gossip = asyncio.ensure_future(_gossip_load(serving, node))
        node_store().on_put = serving.record_response
        try:
            waiting: set[asyncio.Future[Any]] = {stopper, own_failed}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            gossip.cancel()
    finally:
        await server.close()
        await node.close(leave=True)
        await serving.local.ring.close()
        clean = await serving.local.stop_workers()
    error = own_failed.result() if own_failed.done() else None
    return clean, error
