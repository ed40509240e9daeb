"""The asyncio side of the HTTP server: sockets, clocks and tasks around `http.ServerConnection`.

Per connection, one task reads a request (header and body deadlines), runs its handler and writes
the response, then waits for the next request (idle keep-alive deadline). While a handler runs, a
watcher task keeps reading the socket: end-of-file there means the client is gone, and the handler
task is cancelled at once, so whatever it started (a generation) is cancelled with it. Any
exception is contained in its connection: nothing a client sends can stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import orjson

from skulkp2p.api import http
from skulkp2p.api.auth import KEY, OPEN, Access, AuthPolicy
from skulkp2p.api.errors import ApiError
from skulkp2p.engine.json_types import JSONObject, JSONValue
from skulkp2p.ratelog import LogLimiter

log = logging.getLogger("skulkp2p.http")
# Anyone can send malformed requests without end: one line at once, then counts every 10 s.
_protocol_errors = LogLimiter(log, "http: protocol errors", logging.INFO)
# So can requests without a valid key (the line names the reason and the path, never a key).
_refused = LogLimiter(log, "http: refused requests (401)", logging.INFO)

JSON = "application/json"


@dataclass
class ServerConfig:
    max_header_bytes: int = http.MAX_HEADER_BYTES
    max_body_bytes: int = http.DEFAULT_MAX_BODY_BYTES
    header_timeout: float = 10.0  # from a request's first byte to the end of its head
    body_timeout: float = 60.0  # from the end of the head to the end of the body
    idle_timeout: float = 30.0  # keep-alive: how long an idle connection is kept open
    write_timeout: float = 60.0  # a client that reads nothing for this long is dropped
    max_connections: int = 1024
    read_size: int = 65536
    # After an error that ends a connection mid-request, the client's bytes still coming are
    # read and dropped for up to this long (and this many bytes) before the close: a socket
    # closed with input unread sends a reset, which can reach the client while it still sends
    # the request and cost it the error response.
    linger_timeout: float = 2.0
    linger_bytes: int = 1 << 20
    # Host headers answered besides the server's own addresses (http.HostPolicy): "name" (any
    # port), "name:port", or "*" (any Host at all).
    allowed_hosts: tuple[str, ...] = ()
    # Who may use which route (api/auth.py): API keys, node signatures. None: no checks at all
    # (a server in a test, or the one-model `serve` without keys).
    auth: AuthPolicy | None = None


@dataclass
class HttpRequest:
    method: str
    target: str
    path: str
    query: str
    headers: http.Headers
    body: bytes
    client: str = ""
    # The body's JSON once read (in a 1-tuple: null is JSON too): the resolver and the route
    # read the same value.
    _json: tuple[JSONValue] | None = field(default=None, init=False, repr=False, compare=False)

    def json(self) -> JSONValue:
        """The body's JSON (parsed on the first call only); 400 when it is not JSON, 415 when
        its Content-Type does not say JSON (a browser sends text/plain or a form across sites
        without asking, never application/json)."""
        if self._json is None:
            if not self.body.strip():
                raise ApiError(400, "the request body is empty; send a JSON object",
                               code="invalid_json")
            ctype = self.headers.get("content-type")
            if not http.is_json_media_type(ctype):
                given = f"not {ctype[:100]!r}" if ctype is not None else "the request has none"
                raise ApiError(415, f"send the JSON body with Content-Type: application/json "
                                    f"({given})", param="Content-Type")
            try:
                self._json = (orjson.loads(self.body),)
            except orjson.JSONDecodeError as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}",
                               code="invalid_json") from None
        return self._json[0]

    def with_json(self, value: JSONValue) -> HttpRequest:
        """This request with another JSON body, already read (what a relay sends on)."""
        out = replace(self, body=orjson.dumps(value))
        out._json = (value,)
        return out


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(cls, status: int, obj: object, headers: list[tuple[str, str]] | None = None
             ) -> Response:
        return cls(status, orjson.dumps(obj), [("Content-Type", JSON), *(headers or [])])

    @classmethod
    def error(cls, e: ApiError, extra: JSONObject | None = None) -> Response:
        body = {**(extra or {}), **e.body()}
        return cls.json(e.status, body, e.headers)


@dataclass
class StreamingResponse:
    """A body written piece by piece, each piece flushed at once. `on_close` runs however the
    response ends (completed, client gone, server stopping), even if the body never started."""
    status: int
    body: AsyncIterator[bytes]
    headers: list[tuple[str, str]] = field(default_factory=list)
    on_close: Callable[[], None] | None = None


Handler = Callable[[HttpRequest], Awaitable[Response | StreamingResponse]]
ErrorShape = Callable[[ApiError], Response]  # an error in a route's own shape


class Router:
    """Routes by path and method, each with its `Access` (api/auth.py: KEY unless declared
    otherwise, so a new route asks for a key) and, per path, the shape of its errors."""

    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}
        self._access: dict[tuple[str, str], Access] = {}
        self._shapes: dict[str, ErrorShape] = {}

    def add(self, method: str, path: str, handler: Handler, access: Access = KEY,
            error_shape: ErrorShape | None = None) -> None:
        self._routes.setdefault(path, {})[method] = handler
        self._access[(method, path)] = access
        if error_shape is not None:
            self._shapes[path] = error_shape

    def access(self, method: str, path: str) -> Access:
        """What `method` on `path` needs (HEAD: its GET's). An unknown route needs a key, so
        that only a client with one learns it is unknown; a wrong method on a path whose
        routes are all open is open (its 405 says what the path takes)."""
        methods = self._routes.get(path)
        if methods is None:
            return KEY
        if method in methods:
            return self._access[(method, path)]
        if method == "HEAD" and "GET" in methods:
            return self._access[("GET", path)]
        if all(self._access[(m, path)] == OPEN for m in methods):
            return OPEN
        return KEY

    def error_response(self, path: str, err: ApiError) -> Response:
        """`err` as the route on `path` answers errors (the default shape unless declared)."""
        shape = self._shapes.get(path)
        return shape(err) if shape is not None else Response.error(err)

    def resolve(self, method: str, path: str) -> Handler:
        """The handler of `method` on `path`; HEAD runs a GET route's handler (the server sends
        its status and headers without the body)."""
        methods = self._routes.get(path)
        if methods is None:
            raise ApiError(404, f"no route {path[:200]!r}")
        handler = methods.get(method)
        if handler is None and method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            allow = ", ".join(sorted({*methods, "HEAD"} if "GET" in methods else methods))
            raise ApiError(405, f"{path} takes {allow}, not {method[:20]}",
                           headers=[("Allow", allow)])
        return handler


class _Gone(Exception):
    """The client closed the connection or stopped reading."""


def _note_refusal(client: str, method: str, path: str, e: ApiError) -> None:
    """A refused request in the log (rate-limited): its code and route, never a key."""
    _refused.note(client.rpartition(":")[0] or client, f"{e.code} on {method[:20]} {path[:100]}")


def _split_target(target: str) -> tuple[str, str]:
    if target.startswith(("http://", "https://")):  # absolute-form: keep only the path
        rest = target.split("://", 1)[1]
        target = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    path, _, query = target.partition("?")
    return path, query


class HttpServer:
    def __init__(self, router: Router, config: ServerConfig | None = None):
        self.router = router
        self.config = config or ServerConfig()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        self.hosts: http.HostPolicy | None = None  # set by `start`, from the bound address

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen; returns the bound (host, port) — port 0 picks a free one. From then on a
        request whose Host is not one of this server's addresses gets 421 (http.HostPolicy)."""
        own = (socket.gethostname(),) if host in http.WILDCARD_HOSTS else ()
        hosts = http.HostPolicy.serving(host, port, self.config.allowed_hosts, own)
        self._server = await asyncio.start_server(self._on_connection, host, port,
                                                  limit=self.config.read_size, reuse_address=True)
        sock = self._server.sockets[0].getsockname()
        self.hosts = replace(hosts, port=sock[1])  # (port 0 picked one)
        return sock[0], sock[1]

    def allow_host_names(self, *names: str) -> None:
        """More names this server answers for (on its port), e.g. the address a cluster
        announces for it, which the other nodes put in the Host of what they relay."""
        if self.hosts is not None:
            self.hosts = self.hosts.with_names(*names)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        local = writer.get_extra_info("sockname")
        local_address = str(local[0]) if isinstance(local, tuple) else ""
        try:
            if len(self._connections) > self.config.max_connections:
                conn = http.ServerConnection()
                err = ApiError(503, "too many open connections", headers=[("Retry-After", "1")])
                writer.write(conn.send_response(503, self._error_headers(err), err.json()))
                await self._drain(writer)
                return
            await self._serve(reader, writer, client, local_address)
        except (_Gone, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:
            # The server is closing. This is the connection task's top level: end it quietly
            # (asyncio's stream callback would log a cancelled task as an error).
            pass
        except Exception:  # a bug of ours: this connection ends, the server goes on
            log.exception("connection %s failed", client)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    @staticmethod
    def _error_headers(err: ApiError) -> list[tuple[str, str]]:
        return [("Content-Type", JSON), *err.headers]

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        if writer.transport.is_closing():
            raise _Gone()
        if not writer.transport.get_write_buffer_size():
            # All sent already: drain cannot block, so no clock (a wait_for makes a Task; this
            # runs once per streamed event).
            await writer.drain()
            return
        try:
            await asyncio.wait_for(writer.drain(), self.config.write_timeout)
        except TimeoutError:
            raise _Gone() from None

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if data:
            if writer.transport.is_closing():
                raise _Gone()
            writer.write(data)
            await self._drain(writer)

    async def _read(self, reader: asyncio.StreamReader, conn: http.ServerConnection,
                    deadline: float) -> bool:
        """Feed the connection one read; False when the deadline passed first."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            data = await asyncio.wait_for(reader.read(self.config.read_size), remaining)
        except TimeoutError:
            return False
        conn.receive_data(data)
        return True

    async def _send_error(self, writer: asyncio.StreamWriter, conn: http.ServerConnection,
                          err: ApiError, path: str | None = None) -> None:
        """`err` in the shape of the route on `path` (the default shape without one)."""
        if path is None:
            await self._write(writer, conn.send_response(err.status, self._error_headers(err),
                                                         err.json()))
            return
        resp = self.router.error_response(path, err)
        await self._write(writer, conn.send_response(resp.status, resp.headers, resp.body))

    def _check_head(self, request: http.Request, path: str, client: str) -> str | None:
        """The auth policy's verdict on a request head: None (go on) or the body hash a
        node-signed request must have; raises its 401."""
        auth = self.config.auth
        if auth is None:
            return None
        try:
            return auth.check_head(request.method, request.target, request.headers,
                                   self.router.access(request.method, path))
        except ApiError as e:
            _note_refusal(client, request.method, path, e)
            raise

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     client: str, local_address: str) -> None:
        cfg = self.config
        conn = http.ServerConnection(cfg.max_header_bytes, cfg.max_body_bytes, self.hosts,
                                     local_address)
        first = True
        while True:
            try:
                request = await self._read_head(reader, conn, first)
                if request is None:
                    return
                first = False
                handler: Handler | None = None
                path, query = _split_target(request.target)
                refusal: ApiError | None = None
                signed: str | None = None
                try:
                    handler = self.router.resolve(request.method, path)
                except ApiError as e:
                    refusal = e
                try:  # (a refusal wins over a route error: no route is told to a stranger)
                    signed = self._check_head(request, path, client)
                except ApiError as e:
                    refusal = e
                if refusal is not None and conn.waiting_for_100_continue:
                    # Refuse before the client sends a body.
                    await self._send_error(writer, conn, refusal, path)
                    return
                # A refused request's body is read (the connection stays usable) but not kept.
                body = await self._read_body(reader, writer, conn, keep=refusal is None)
                if signed is not None and refusal is None and self.config.auth is not None:
                    try:
                        self.config.auth.check_body(signed, body)
                    except ApiError as e:
                        _note_refusal(client, request.method, path, e)
                        refusal = e
            except http.ProtocolError as e:
                _protocol_errors.note(client.rpartition(":")[0] or client,
                                      f"HTTP {e.status}: {e.message}")
                await self._send_error(writer, conn, ApiError(e.status, e.message))
                if e.status != 408:  # (a client too slow to send gets no more time)
                    await self._linger(reader, writer)
                return
            req = HttpRequest(request.method, request.target, path, query, request.headers,
                              body, client)
            await self._handle(reader, writer, conn, req, handler, refusal)
            if conn.must_close:
                return

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then read and drop what the client still sends (bounded) so that the
        close that follows sends no reset ahead of the response (a lingering close)."""
        if writer.can_write_eof():
            writer.write_eof()
        deadline = time.monotonic() + self.config.linger_timeout
        left = self.config.linger_bytes
        while left > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                data = await asyncio.wait_for(reader.read(min(left, self.config.read_size)),
                                              remaining)
            except (TimeoutError, ConnectionError, OSError):
                return
            if not data:
                return
            left -= len(data)

    async def _read_head(self, reader: asyncio.StreamReader, conn: http.ServerConnection,
                         first: bool) -> http.Request | None:
        cfg = self.config
        # A fresh connection gets the header deadline; one between requests the idle one.
        idle_deadline = time.monotonic() + (min(cfg.header_timeout, cfg.idle_timeout) if first
                                            else cfg.idle_timeout)
        head_deadline: float | None = None
        while True:
            event = conn.next_event()
            if isinstance(event, http.Request):
                return event
            if isinstance(event, http.ConnectionClosed):
                return None
            if head_deadline is None and conn.has_partial_request:
                head_deadline = time.monotonic() + cfg.header_timeout  # slowloris clock
            if not await self._read(reader, conn, head_deadline or idle_deadline):
                if head_deadline is None:
                    return None  # idle keep-alive connection: close quietly
                raise http.ProtocolError(408, "request headers took too long")

    async def _read_body(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         conn: http.ServerConnection, keep: bool = True) -> bytes:
        """The request's body (within the body deadline); read and dropped unless `keep`."""
        deadline = time.monotonic() + self.config.body_timeout
        body = bytearray()
        while True:
            event = conn.next_event()
            if isinstance(event, http.Data):
                if keep:
                    body += event.data
            elif isinstance(event, http.EndOfMessage):
                return bytes(body)
            else:
                await self._write(writer, conn.send_continue())
                if not await self._read(reader, conn, deadline):
                    raise http.ProtocolError(408, "request body took too long")

    async def _watch(self, reader: asyncio.StreamReader, conn: http.ServerConnection) -> None:
        """Read on while a handler runs; returns when the client is gone. Pipelined bytes are
        buffered for later (up to a bound; past it we stop reading and stop watching)."""
        limit = self.config.max_header_bytes + self.config.max_body_bytes
        while conn.buffered <= limit:
            try:
                data = await reader.read(self.config.read_size)
            except (ConnectionError, OSError):
                return
            conn.receive_data(data)
            if not data:
                return
        await asyncio.Event().wait()  # buffer full: nothing more to learn until cancelled

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn: http.ServerConnection, req: HttpRequest, handler: Handler | None,
                      refusal: ApiError | None) -> None:
        started = time.monotonic()
        respond = asyncio.ensure_future(self._respond(writer, conn, req, handler, refusal))
        watch = asyncio.ensure_future(self._watch(reader, conn))
        try:
            await asyncio.wait({respond, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not respond.done():
                # The client went away (or we are stopping): cancel its work at once.
                respond.cancel()
                log.info("%s: %s %s: client disconnected after %.2f s; cancelled", req.client,
                         req.method, req.path, time.monotonic() - started)
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            with contextlib.suppress(asyncio.CancelledError, _Gone, ConnectionError):
                await respond
        if respond.cancelled():
            raise _Gone()
        status = respond.result()
        log.debug("%s: %s %s -> %s in %.3f s", req.client, req.method, req.path, status,
                  time.monotonic() - started)

    async def _respond(self, writer: asyncio.StreamWriter, conn: http.ServerConnection,
                       req: HttpRequest, handler: Handler | None, refusal: ApiError | None
                       ) -> int:
        try:
            if refusal is not None:
                raise refusal
            assert handler is not None
            resp = await handler(req)
        except ApiError as e:
            resp = self.router.error_response(req.path, e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("%s %s failed", req.method, req.path)
            resp = Response.error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        if isinstance(resp, Response):
            await self._write(writer, conn.send_response(resp.status, resp.headers, resp.body))
            return resp.status
        try:
            await self._write(writer, conn.start_stream(resp.status, resp.headers))
            if conn.stream_has_body:  # (not for HEAD: the head is the whole answer)
                async for piece in resp.body:
                    await self._write(writer, conn.stream_data(piece))
            await self._write(writer, conn.end_stream())
        except (asyncio.CancelledError, _Gone, ConnectionError):
            raise
        except Exception:
            # The head is out: the only honest signal left is to cut the body short.
            log.exception("%s %s failed mid-stream", req.method, req.path)
            raise _Gone() from None
        finally:
            with contextlib.suppress(Exception):
                await resp.body.aclose()  # type: ignore[attr-defined]
            if resp.on_close is not None:
                resp.on_close()
        return resp.status
