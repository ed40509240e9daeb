"""The node's own page and metrics over HTTP: GET / (the dashboard), its assets, GET /metrics
(Prometheus' text format) and GET /v1/stats (this node's requests as JSON; `?scope=cluster`
gathers every live member's).

Nothing here measures: skulkp2p/telemetry.py does; this module only serves what it holds. The
page (api/static/) is plain HTML, CSS and JavaScript written for this project, served from the
package, and fetches nothing but this node's own routes (its Content-Security-Policy says so).
The page and its assets load without a key; its data routes (/v1/cluster, /v1/stats,
/v1/models, /metrics) ask for one like every other route, and the page asks the user for it
once per tab (api/static/dashboard.js). Wiring is one call: `add_routes(router, telemetry,
cluster_status, workers)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from urllib.parse import parse_qs

import orjson

from skulkp2p.api.auth import NODE_AUTH_HEADER, OPEN, READ, NodeAuth
from skulkp2p.api.errors import ApiError
from skulkp2p.api.server import HttpRequest, Response, Router
from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.engine.protocol import EngineInfo, VerifyCosts
from skulkp2p.metrics import CONTENT_TYPE
from skulkp2p.runtime.worker import ModelWorker
from skulkp2p.telemetry import Telemetry

PEER_TIMEOUT_S = 1.5
MAX_PEER_BODY = 4 << 20
ASSETS = {
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
# Only this node's own routes: no script, style, font or connection anywhere else.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

ClusterStatus = Callable[[], Mapping[str, object] | None]
Workers = Callable[[], Mapping[str, ModelWorker]]


def _asset(name: str) -> bytes:
    return resources.files("skulkp2p.api").joinpath("static", name).read_bytes()


def worker_info(worker: ModelWorker) -> JSONObject:
    """What the page and /metrics show of a model's worker."""
    return {"state": worker.state, "waiting": worker.waiting,
            "busy": worker.current is not None}


def engine_verify_costs(workers: Mapping[str, ModelWorker]) -> dict[str, VerifyCosts]:
    """The measured verify-cost table of each ready model whose engine reports one on the seam
    (`EngineInfo.verify_costs`: today a tensor-parallel group's, on the member that runs its
    loop); the others are left out, as /v1/models leaves them out."""
    return {model: info.verify_costs for model, info in _ready_infos(workers)
            if info.verify_costs is not None}


def engine_draft_memory(workers: Mapping[str, ModelWorker]) -> dict[str, JSONObject]:
    """The draft memory's stats of each ready model whose engine has one on the seam
    (`EngineInfo.draft_memory`: the MLX engine's, unless turned off)."""
    return {model: info.draft_memory.stats() for model, info in _ready_infos(workers)
            if info.draft_memory is not None}


def _ready_infos(workers: Mapping[str, ModelWorker]) -> Iterator[tuple[str, EngineInfo]]:
    """(model, its engine's info) for each ready model."""
    for model, worker in workers.items():
        if worker.engine is not None and worker.state == "ready":
            yield model, worker.engine.info()


def add_routes(router: Router, telemetry: Telemetry, cluster_status: ClusterStatus,
               workers: Workers, node_auth: NodeAuth | None = None) -> None:
    """GET /, its assets, /metrics and /v1/stats on `router`. `cluster_status()` returns the
    node's cluster status (or None on a node outside any cluster); `workers()` the
    {model: ModelWorker} this node runs; `node_auth` signs the stats requests to the other
    members (the cluster secret's)."""
    telemetry.watch_models(lambda: {m: worker_info(w) for m, w in workers().items()})
    telemetry.watch_cluster(cluster_status)
    telemetry.watch_verify_costs(lambda: engine_verify_costs(workers()))
    telemetry.watch_draft_memory(lambda: engine_draft_memory(workers()))

    def status() -> Mapping[str, object] | None:
        try:
            return cluster_status()
        except Exception:
            return None

    def node_name() -> str:
        st = status()
        return str(st["node"]) if st and st.get("node") else socket.gethostname()

    for path, (name, ctype) in ASSETS.items():
        body = _asset(name)  # read once: a missing asset fails at start, not per request

        async def asset(req: HttpRequest, body: bytes = body, ctype: str = ctype) -> Response:
            return Response(200, body, [("Content-Type", ctype), ("Cache-Control", "no-cache"),
                                        ("Content-Security-Policy", CSP),
                                        ("X-Content-Type-Options", "nosniff")])

        router.add("GET", path, asset, OPEN)

    async def metrics(req: HttpRequest) -> Response:
        return Response(200, telemetry.registry.render().encode(),
                        [("Content-Type", CONTENT_TYPE), ("Cache-Control", "no-cache")])

    async def stats(req: HttpRequest) -> Response:
        scope = parse_qs(req.query).get("scope", ["node"])[0]
        own = {"node": node_name(), **telemetry.stats()}
        if scope == "node":
            return Response.json(200, own)
        if scope != "cluster":
            raise ApiError(400, f"scope is 'node' or 'cluster', not {scope[:40]!r}",
                           param="scope")
        return Response.json(200, {"node": own["node"],
                                   "nodes": await cluster_stats(own, status(), node_auth)})

    router.add("GET", "/metrics", metrics, READ)
    router.add("GET", "/v1/stats", stats, READ)


async def cluster_stats(own: JSONObject, st: Mapping[str, object] | None,
                        node_auth: NodeAuth | None = None) -> list[JSONValue]:
    """This node's stats and every other live member's (asked over HTTP at once, each within
    PEER_TIMEOUT_S, signed with `node_auth`; one that does not answer is listed with its
    error)."""
    peers = []
    members = st.get("members") if st else None
    for m in members if isinstance(members, list) else ():
        if not isinstance(m, dict) or m.get("name") == own["node"] or m.get("state") not in (
                "alive", "suspect"):
            continue
        peers.append((str(m.get("name")), m.get("http")))

    async def ask(name: str, http: object) -> JSONObject:
        if not http:
            return {"node": name, "error": "no HTTP address"}
        try:
            got = await asyncio.wait_for(get_json(str(http), "/v1/stats", node_auth),
                                         PEER_TIMEOUT_S)
        except Exception as e:
            return {"node": name, "error": f"{type(e).__name__}: {e}"[:200]}
        got["node"] = name
        return got

    others = await asyncio.gather(*(ask(n, h) for n, h in peers))
    return [own, *sorted(others, key=lambda d: str(d["node"]))]


async def get_json(addr: str, path: str, node_auth: NodeAuth | None = None) -> JSONObject:
    """GET http://ADDR/PATH with one request on its own connection, signed with `node_auth`
    when given; the JSON body or an error. Our own server answers with Content-Length, so no
    chunked decoding is needed."""
    host, _, port = addr.rpartition(":")
    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    signed = (f"{NODE_AUTH_HEADER}: {node_auth.sign('GET', path, addr, b'')}\r\n"
              if node_auth is not None else "")
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n"
                     f"{signed}Connection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read(MAX_PEER_BODY + 65536)
        while True:
            more = await reader.read(65536)
            if not more:
                break
            raw += more
            if len(raw) > MAX_PEER_BODY + 65536:
                raise ValueError("answer too large")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("no complete HTTP head")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or parts[1] != "200":
        raise ValueError(f"answered {status_line[:80]!r}")
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        if k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
            raise ValueError("chunked answer")
    got = orjson.loads(body)
    if not isinstance(got, dict):
        raise ValueError("not a JSON object")
    return got
