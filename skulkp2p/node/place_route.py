"""POST /v1/cluster/place: a place request checked, sent to the leader, and answered only once
a majority of the cluster's voters hold it (cluster/core.py: the plan's commit), so a leader that
fails right after a 200 cannot lose the placement; past PLACE_WAIT_S a 503 says whether it may
still take effect. Apart from serving.py (which routes model requests) because acknowledging a
placement is the control plane's promise, with its own waiting and wording."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

from skulkp2p.api.errors import ApiError
from skulkp2p.api.server import HttpRequest, Response
from skulkp2p.cluster.core import ABSENT, COMMITTED, ClusterCore
from skulkp2p.cluster.facts import model_spec
from skulkp2p.cluster.node import ClusterNode
from skulkp2p.cluster.placement import PARALLEL, ModelSpec, parse_replicas

if TYPE_CHECKING:
    from skulkp2p.models.store import ModelStore

RETRY_AFTER = "2"
PLACE_WAIT_S = 5.0  # a place request waits at most this long for a majority to hold it
PLACE_RESEND_S = 1.0  # asked the leader again this often while it has not shown the request
PLACE_POLL_S = 0.05


def unavailable(message: str, code: str, retry_after: str = RETRY_AFTER) -> ApiError:
    """A 503 with Retry-After (the openai client retries it)."""
    return ApiError(503, message, code=code, headers=[("Retry-After", retry_after)])


class PlaceRoute:
    """The place endpoint of one node: `core` and `node` are its cluster state machine and its
    I/O (the same node), `store` resolves model ids, `name` is this node's name."""

    def __init__(self, core: ClusterCore, node: ClusterNode, store: ModelStore, name: str):
        self.core = core
        self.node = node
        self.store = store
        self.name = name

    async def __call__(self, req: HttpRequest) -> Response:
        body = req.json()
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(model, str):
            raise ApiError(400, "send {\"model\": ID, \"nodes\": [NAME, ...]?, \"parallel\": "
                                "\"auto\"|\"pipeline\"|\"tensor\"?, \"replicas\": N|\"auto\"?}",
                           param="model")
        extra = set(body) - {"model", "nodes", "parallel", "replicas"}
        if extra:
            raise ApiError(400, f"unknown field {sorted(extra)[0]!r}", param=sorted(extra)[0])
        given = body.get("nodes") or []
        nodes = [n for n in given if isinstance(n, str)] if isinstance(given, list) else []
        if not isinstance(given, list) or len(nodes) != len(given):
            raise ApiError(400, "'nodes' must be a list of node names", param="nodes")
        parallel = body.get("parallel")
        if parallel is not None and (not isinstance(parallel, str) or parallel not in PARALLEL):
            raise ApiError(400, f"'parallel' must be one of {', '.join(PARALLEL)}",
                           param="parallel")
        replicas: int | None = None
        if body.get("replicas") is not None:
            try:
                replicas = parse_replicas(body["replicas"])
            except ValueError as e:
                raise ApiError(400, str(e), param="replicas") from None
        core = self.core
        known = core.placements().get(model)
        if known is not None and known.spec is not None:
            spec = known.spec  # a model the cluster already serves: move it
        else:
            try:  # a repository id may ask the hub (fetch): off the event loop
                resolved = await asyncio.to_thread(self.store.resolve, model, fetch=True)
                spec = model_spec(self.store, model)
            except Exception as e:
                raise ApiError(404, str(e), param="model", code="model_not_found") from None
            if resolved.card is None and not nodes:
                nodes = [self.name]  # a local folder: this node's disk
        if parallel is not None:
            spec = dataclasses.replace(spec, parallel="" if parallel == "auto" else parallel)
        if replicas is not None:
            spec = dataclasses.replace(spec, replicas=0 if replicas == 1 else replicas)
        if core.leader is None:
            raise unavailable("the cluster has no leader right now; retry shortly",
                               "no_leader")
        if known is not None:
            err = core.check_request(spec, nodes)
            if err is not None:  # refused here: the placement that works stays
                raise ApiError(422, str(err), param="nodes" if nodes else "model",
                               code="model_does_not_fit")
        return await self._place_durably(spec, nodes)

    async def _place_durably(self, spec: ModelSpec, nodes: list[str]) -> Response:
        """Ask the leader, then answer 200 only once a majority of the voters hold a plan with
        the request (a leader that fails right after cannot lose it); 422 as soon as the plan
        says it cannot fit; past PLACE_WAIT_S a 503 saying whether it may still take effect."""
        core = self.core
        self.node.request_placement(spec, nodes)
        start = time.monotonic()
        resend_at = start + PLACE_RESEND_S
        while True:
            state = core.request_state(spec, nodes)
            if state != ABSENT:
                err = core.placement_errors().get(spec.id)
                if err is not None:  # it fits nowhere: no need to wait for a majority to say so
                    raise ApiError(422, str(err["error"]), param="model",
                                   code="model_does_not_fit")
                if state == COMMITTED and self.node.state_saved:
                    got = self._placement_of(spec, nodes)
                    if got is not None:
                        return got
            now = time.monotonic()
            if now - start >= PLACE_WAIT_S:
                break
            if state == ABSENT and now >= resend_at:
                # The request frame may be lost, or the leader changed: asking again is safe
                # (the same request to the same leader changes nothing).
                self.node.request_placement(spec, nodes)
                resend_at = now + PLACE_RESEND_S
            await asyncio.sleep(PLACE_POLL_S)
        raise unavailable(self._unconfirmed(spec, nodes, state), "placement_unconfirmed")

    def _unconfirmed(self, spec: ModelSpec, nodes: list[str], state: str) -> str:
        core = self.core
        within = f"within {PLACE_WAIT_S:g} s"
        if not self.node.state_saved:
            return (f"the placement of {spec.id} was not confirmed {within}: this node cannot "
                    "save its cluster state (see its log), and a placement it may forget in a "
                    "restart is not acknowledged; repeating the request once it can is safe")
        if state == ABSENT:
            who = "no leader is known" if core.leader is None else \
                f"the plan of leader {core.leader} does not show it here"
            return (f"the placement of {spec.id} was not confirmed {within} ({who}): it may not "
                    "have taken effect, or may still; repeating the same request is safe")
        if state == COMMITTED:  # held by a majority, but its ring is not (yet) the one asked
            return (f"the request to place {spec.id} is held by a majority of the cluster's "
                    f"voters, but its placement did not become the one asked for {within} (a "
                    "node it names may be dead); see GET /v1/cluster")
        held, voters, majority = core.request_holders(spec, nodes)
        known = f" ({held} of {voters} hold it)" if core.is_leader else ""
        term, version = core.plan_id
        return (f"the placement of {spec.id} was planned (term {term}, plan version {version}) "
                f"but not confirmed by a majority of the cluster's voters ({majority} of "
                f"{voters}) {within}{known}: it may still take effect, or be lost if the leader "
                "fails now; repeating the same request is safe")

    def _placement_of(self, spec: ModelSpec, nodes: list[str]) -> Response | None:
        core = self.core
        p = core.placements().get(spec.id)
        if p is not None and (not nodes or list(p.ring) == nodes) and (
                p.parallel == "tensor") == spec.tensor and p.spec is not None and (
                p.spec.replicas == spec.replicas):
            d = p.to_dict()
            d.pop("spec", None)
            return Response.json(200, {"placement": d, "term": core.term,
                                        "leader": core.leader})
        err = core.placement_errors().get(spec.id)
        if err is not None:
            raise ApiError(422, str(err["error"]), param="model", code="model_does_not_fit")
        return None
