"""Forwarding an HTTP request to the node that serves its model, streaming the answer back.

A minimal HTTP/1.1 client (one request per connection): the request goes out as it came in
(body, content type, accept), marked with ``X-Skulkp2p-Forwarded`` so the receiver serves it
itself and never forwards it again. The user's API key stays on this node: the request is
signed with the cluster secret instead (``X-Skulkp2p-Node-Auth``, api/auth.py), which the
receiver checks, so a forwarded request is answered only when a node of the cluster sent it.
The response comes back through our own server: a ``Content-Length`` body whole, a chunked body
(SSE streams) piece by piece as it arrives.

A forwarded request must never hang on a node that died or froze: while waiting, the forwarder
asks the cluster every half second whether the serving node is still alive, and ends the
request with a clear error as soon as it is declared dead (or its connection breaks). A stream
that already started ends with an error event in the API's own format.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import orjson

from skulkp2p.api.auth import FORWARDED_HEADER, NodeAuth
from skulkp2p.api.errors import ApiError
from skulkp2p.api.server import HttpRequest, Response, StreamingResponse

POLL_S = 0.5
MAX_HEAD_BYTES = 64 << 10
# Response headers worth passing on (framing headers are our own server's business).
PASS_HEADERS = {"content-type", "retry-after", "cache-control", "x-request-id"}


class UpstreamGone(Exception):
    """The serving node died, froze, or broke the connection."""


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class _Upstream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 alive: Callable[[], str | None]):
        self.reader = reader
        self.writer = writer
        self.alive = alive  # None while the node is fine, else why it is not

    async def read(self, n: int = 1 << 16, exact: bool = False) -> bytes:
        """Bytes from the upstream; raises UpstreamGone if the node is declared dead first."""
        while True:
            why = self.alive()
            if why is not None:
                raise UpstreamGone(why)
            try:
                if exact:
                    return await asyncio.wait_for(self.reader.readexactly(n), POLL_S)
                return await asyncio.wait_for(self.reader.read(n), POLL_S)
            except TimeoutError:
                continue  # readexactly keeps what it has read in the buffer on cancel
            except (asyncio.IncompleteReadError, OSError) as e:
                raise UpstreamGone(f"connection lost ({type(e).__name__})") from None

    async def readline(self) -> bytes:
        while True:
            why = self.alive()
            if why is not None:
                raise UpstreamGone(why)
            try:
                return await asyncio.wait_for(self.reader.readuntil(b"\r\n"), POLL_S)
            except TimeoutError:
                continue
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as e:
                raise UpstreamGone(f"connection lost ({type(e).__name__})") from None

    def close(self) -> None:
        self.writer.transport.abort()


def _error_event(path: str, message: str) -> bytes:
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "node_lost"}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def forward(req: HttpRequest, http_addr: str, node_name: str,
                  alive: Callable[[], str | None], body: bytes | None = None,
                  connect_timeout: float = 3.0, node_auth: NodeAuth | None = None,
                  on_end: Callable[[bool], None] | None = None
                  ) -> Response | StreamingResponse:
    """Send ``req`` (with ``body`` instead of its own, if given) to ``http_addr`` and relay
    the answer. ``alive()`` returns None while the serving node is fine, else why not.
    ``node_auth`` signs it (a node without a cluster secret sends it unsigned). ``on_end`` is
    called once when the relay is over, with whether the serving node was lost on the way."""
    ended = _Once(on_end)
    try:
        got = await _forward(req, http_addr, node_name, alive, body, connect_timeout,
                             node_auth, ended)
    except ApiError as e:
        ended(e.code in ("node_lost", "node_unreachable"))
        raise
    except BaseException:
        ended(False)
        raise
    if not isinstance(got, StreamingResponse):
        ended(False)
    return got


class _Once:
    """``on_end`` called at most once."""

    def __init__(self, on_end: Callable[[bool], None] | None):
        self.on_end = on_end

    def __call__(self, lost: bool) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end(lost)


async def _forward(req: HttpRequest, http_addr: str, node_name: str,
                   alive: Callable[[], str | None], body: bytes | None,
                   connect_timeout: float, node_auth: NodeAuth | None, ended: _Once
                   ) -> Response | StreamingResponse:
    body = req.body if body is None else body
    host, port = _split(http_addr)
    lost = f"node {node_name} ({http_addr}), which serves this model"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                connect_timeout)
    except (OSError, TimeoutError) as e:
        raise ApiError(503, f"cannot reach {lost}: {e}; retry shortly",
                       code="node_unreachable", headers=[("Retry-After", "2")]) from None
    up = _Upstream(reader, writer, alive)
    handed_over = False
    try:
        head = [f"{req.method} {req.target} HTTP/1.1", f"Host: {http_addr}",
                f"Content-Length: {len(body)}", "Connection: close",
                "X-Skulkp2p-Forwarded: 1"]
        if node_auth is not None:
            head.append(f"X-Skulkp2p-Node-Auth: "
                        f"{node_auth.sign(req.method, req.target, http_addr, body)}")
        # (never Authorization or x-api-key: the user's key is for this node only)
        for name in ("content-type", "accept", "anthropic-version", "x-request-id"):
            value = req.headers.get(name)
            if value:
                head.append(f"{name}: {value}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        status, headers = await _read_head(up)
        passed = [(k, v) for k, v in headers if k in PASS_HEADERS]
        te = dict(headers).get("transfer-encoding", "").lower()
        if "chunked" in te:
            handed_over = True
            return StreamingResponse(status, _relay_chunks(up, req.path, lost, ended), passed,
                                     on_close=up.close)
        length = dict(headers).get("content-length")
        data = await up.read(int(length), exact=True) if length else await _read_to_eof(up)
        if status == 401:  # the client's key held here; the serving node refused this node
            raise ApiError(502, f"{lost} refused the request this node forwarded to it: "
                                f"{_message(data)}", code="forward_refused")
        return Response(status, data, passed)
    except UpstreamGone as e:
        raise ApiError(503, f"{lost} was lost before it answered: {e}; retry shortly",
                       code="node_lost", headers=[("Retry-After", "2")]) from None
    finally:
        if not handed_over:
            up.close()


def _message(body: bytes) -> str:
    """An error body's message (either API's shape), else its first bytes."""
    try:
        err = orjson.loads(body).get("error")
        return str(err.get("message"))[:500]
    except (orjson.JSONDecodeError, AttributeError):
        return body[:200].decode(errors="replace")


async def _read_head(up: _Upstream) -> tuple[int, list[tuple[str, str]]]:
    lines: list[bytes] = []
    size = 0
    while True:
        line = await up.readline()
        size += len(line)
        if size > MAX_HEAD_BYTES:
            raise UpstreamGone("response head too large")
        if line == b"\r\n":
            break
        lines.append(line[:-2])
    if not lines:
        raise UpstreamGone("empty response")
    try:
        status = int(lines[0].split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise UpstreamGone(f"bad status line {lines[0][:80]!r}") from None
    headers = []
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip().lower(), value.strip()))
    return status, headers


async def _read_to_eof(up: _Upstream) -> bytes:
    out = bytearray()
    while chunk := await up.read():
        out += chunk
    return bytes(out)


async def _relay_chunks(up: _Upstream, path: str, lost: str, ended: _Once
                        ) -> AsyncIterator[bytes]:
    gone = False
    try:
        while True:
            size_line = await up.readline()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise UpstreamGone("bad chunk framing") from None
            if size == 0:
                return
            data = await up.read(size + 2, exact=True)
            yield data[:-2]
    except UpstreamGone as e:
        gone = True
        ended(True)
        yield _error_event(path, f"{lost} was lost mid-request: {e}. The cluster places the "
                                 "model again; retry the request")
    finally:
        ended(gone)
        with contextlib.suppress(Exception):
            up.close()


def is_forwarded(req: HttpRequest) -> bool:
    return bool(req.headers.get(FORWARDED_HEADER))
