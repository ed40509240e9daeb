"""``pipe --peer``: the JSONL pipe, answered by a cluster instead of a model in this process.

The peer is a node's cluster address (HOST:PORT, as for ``join --peer``); its status, asked over
the signed control protocol, names its HTTP address. Each line then goes to POST
/v1/cluster/generate there, which any node answers (forwarding to the node that serves the
model). Request and result lines are exactly the local pipe's. While the cluster cannot answer
(no leader, model loading or being placed again after a failure, its ring or tensor group
broken under the request) the line is retried as the 503's Retry-After says, for up to
``retry_s`` seconds (`--retry-for`, default two minutes); then the line gets an error result
whose `type` is the 503's code (`ring_failed`, `tensor_group_failed`, `model_unavailable`...)
and the pipe goes on.
"""

from __future__ import annotations

import http.client
import logging
import time
from typing import IO, TypeAlias

import orjson

from skulkp2p.cluster.config import parse_addr, split_addr
from skulkp2p.cluster.status_client import fetch_status
from skulkp2p.wire import as_list

log = logging.getLogger("skulkp2p.pipe")

DEFAULT_RETRY_S = 120.0  # how long a line the cluster answers 503 is retried

# What a line of the pipe holds (the engine's JSON types are not this layer's to import).
JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"
JSONObject: TypeAlias = "dict[str, JSONValue]"


class PeerError(Exception):
    """The peer cannot be asked at all (unreachable, wrong secret, no HTTP API)."""


def http_address(peer: str, secret: str | None, timeout: float = 5.0) -> str:
    """The HTTP address of the node at cluster address ``peer`` (or ``peer`` itself when it is
    given as http://HOST:PORT)."""
    if peer.startswith("http://"):
        return parse_addr(peer[len("http://"):].rstrip("/"))
    try:
        st = fetch_status(parse_addr(peer), secret, timeout)
    except Exception as e:
        raise PeerError(f"cannot ask the cluster node at {peer} for its status "
                        f"({type(e).__name__}: {e}); is it running, and is the secret "
                        "(--secret or SKULKP2P_SECRET) the cluster's?") from None
    me = next((m for m in as_list(st.get("members")) if isinstance(m, dict) and m.get("self")),
              None)
    if not me or not me.get("http"):
        raise PeerError(f"node {st.get('node')!s} at {peer} announces no HTTP API")
    return str(me["http"])


def _error(req_id: JSONValue, type_: str, message: str) -> JSONObject:
    out: JSONObject = {"error": {"type": type_, "message": message, "param": None}}
    return {"id": req_id, **out} if req_id is not None else out


def _post(addr: str, body: bytes, timeout: float, api_key: str | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    host, port = split_addr(addr)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:  # the HTTP API's key, when its nodes ask for one
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", "/v1/cluster/generate", body, headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def ask(addr: str, obj: JSONValue, retry_s: float = DEFAULT_RETRY_S,
        timeout: float = 600.0, api_key: str | None = None) -> JSONObject:
    """One request object -> one result object (retrying what the cluster says to retry)."""
    req_id = obj.get("id") if isinstance(obj, dict) else None
    body = orjson.dumps(obj)
    deadline = time.monotonic() + retry_s
    while True:
        try:
            status, headers, data = _post(addr, body, timeout, api_key)
        except OSError as e:
            status, headers, data = 0, {}, str(e).encode()
        if status == 200:
            return orjson.loads(data)
        try:
            err = orjson.loads(data).get("error", {})
            message = err.get("message") or data.decode(errors="replace")
            code = err.get("code") or err.get("type") or "unavailable"
        except (orjson.JSONDecodeError, AttributeError):
            message, code = data.decode(errors="replace") or f"HTTP {status}", "unavailable"
        retryable = status in (0, 429, 502, 503)
        if not retryable or time.monotonic() >= deadline:
            return _error(req_id, code if status else "unreachable",
                          message if status else f"cannot reach {addr}: {message}")
        wait = float(headers.get("retry-after") or 1)
        log.info("cluster busy (%s): %s; retrying in %.0f s", code, message, wait)
        time.sleep(min(wait, max(0.1, deadline - time.monotonic())))


def run_pipe_remote(peer: str, secret: str | None, model: str | None, stdin: IO[str],
                    stdout: IO[str], retry_s: float = DEFAULT_RETRY_S,
                    api_key: str | None = None) -> int:
    addr = http_address(peer, secret)
    for line in stdin:
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            result = _error(None, "invalid_json", f"line is not valid JSON: {e}")
        else:
            if isinstance(obj, dict) and model and "model" not in obj:
                obj["model"] = model
            result = ask(addr, obj, retry_s, api_key=api_key)
        stdout.write(orjson.dumps(result).decode() + "\n")
        stdout.flush()
    return 0
