"""HTTP/1.1 for the API plane, as a pure state machine: no sockets, no clocks, no asyncio.

The I/O layer (`server.py`) feeds received bytes with `receive_data`, pulls events with
`next_event` and writes whatever bytes the `send_*` methods return. Keeping the protocol here
lets the tests drive every corner (framing, limits, pipelining, 100-continue) without a socket.

One connection serves one request at a time: once a request has been read to its end,
`next_event` answers PAUSED until its response is complete, and only then parses the next one
from the bytes already buffered. That is what answers pipelined requests in order.

Every protocol violation raises `ProtocolError` carrying the status the client should get; after
one, the connection only sends that error response and closes. So does a request for a host the
server does not serve (`HostPolicy`: 421), which is how a web page's DNS name pointed at a node
on its user's machine is refused.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from http import HTTPStatus

MAX_HEADER_BYTES = 16 * 1024
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions; longer is an attack, not a client

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
_HEADER_NAME = re.compile(_TOKEN)
_BAD_VALUE_CHAR = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # CTLs but HTAB
_BLANK_LINE = re.compile(rb"\r?\n\r?\n")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(r"[0-9]{1,18}")
_PORT = re.compile(r"[0-9]{1,5}")
# A host name: letters, digits, '-', '_' and dots (what a Host header may name besides an IP).
_HOST_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]{0,252}[a-z0-9_])?")

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class ProtocolError(Exception):
    """The client broke HTTP/1.1 (or one of our limits); `status` is what it should be told."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Headers:
    """Request headers in arrival order, names lower-cased (they are case-insensitive)."""

    def __init__(self, items: list[tuple[str, str]]):
        self.items = items

    def get(self, name: str, default: str | None = None) -> str | None:
        name = name.lower()
        for k, v in self.items:
            if k == name:
                return v
        return default

    def get_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self.items if k == name]

    def tokens(self, name: str) -> list[str]:
        """A comma-separated header (possibly repeated) as lower-cased tokens."""
        return [t.strip().lower() for v in self.get_all(name) for t in v.split(",") if t.strip()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __repr__(self) -> str:
        return f"Headers({self.items!r})"


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    http_version: str  # "1.1" or "1.0"
    headers: Headers


@dataclass(frozen=True)
class Data:
    data: bytes


@dataclass(frozen=True)
class EndOfMessage:
    pass


@dataclass(frozen=True)
class ConnectionClosed:
    """The client closed its side cleanly between requests."""


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA = _Sentinel("NEED_DATA")  # feed more bytes, then ask again
PAUSED = _Sentinel("PAUSED")  # a request is complete: answer it before the next one is parsed

Event = Request | Data | EndOfMessage | ConnectionClosed


class _ContentLengthBody:
    def __init__(self, length: int):
        self.remaining = length

    def read(self, buf: bytearray, eof: bool) -> Data | EndOfMessage | _Sentinel:
        if self.remaining == 0:
            return EndOfMessage()
        if not buf:
            if eof:
                raise ProtocolError(400, "connection closed before the end of the body")
            return NEED_DATA
        n = min(len(buf), self.remaining)
        data = bytes(buf[:n])
        del buf[:n]
        self.remaining -= n
        return Data(data)


class _ChunkedBody:
    """chunk = hex-size [;ext] CRLF data CRLF; a zero size, then trailer lines, then CRLF."""

    def __init__(self, max_body: int, max_trailer: int):
        self.state = "size"
        self.remaining = 0
        self.total = 0
        self.max_body = max_body
        self.max_trailer = max_trailer
        self.trailer_bytes = 0

    @staticmethod
    def _line(buf: bytearray, limit: int, what: str) -> bytes | None:
        # The limit holds however the line arrives: whole in one read or in pieces.
        i = buf.find(b"\n", 0, limit + 1)
        if i < 0:
            if len(buf) > limit:
                raise ProtocolError(400, f"{what} line too long")
            return None
        line = bytes(buf[:i]).removesuffix(b"\r")
        del buf[:i + 1]
        return line

    def read(self, buf: bytearray, eof: bool) -> Data | EndOfMessage | _Sentinel:
        while True:
            if self.state == "size":
                line = self._line(buf, MAX_CHUNK_LINE, "chunk size")
                if line is None:
                    break
                size = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(size):
                    raise ProtocolError(400, f"bad chunk size {line[:40]!r}")
                self.remaining = int(size, 16)
                if self.total + self.remaining > self.max_body:
                    raise ProtocolError(413, f"request body is over {self.max_body} bytes")
                self.total += self.remaining
                self.state = "data" if self.remaining else "trailer"
            elif self.state == "data":
                if not buf:
                    break
                n = min(len(buf), self.remaining)
                data = bytes(buf[:n])
                del buf[:n]
                self.remaining -= n
                if self.remaining == 0:
                    self.state = "crlf"
                return Data(data)
            elif self.state == "crlf":
                if buf[:2] == b"\r\n":
                    del buf[:2]
                elif buf[:1] == b"\n":
                    del buf[:1]
                elif buf == b"\r" or not buf:
                    break
                else:
                    raise ProtocolError(400, "chunk data is not followed by CRLF")
                self.state = "size"
            elif self.state == "trailer":
                line = self._line(buf, self.max_trailer, "trailer")
                if line is None:
                    break
                self.trailer_bytes += len(line) + 2
                if self.trailer_bytes > self.max_trailer:
                    raise ProtocolError(431, "trailer section too large")
                if not line:
                    self.state = "done"
                    return EndOfMessage()
                # Trailer fields carry nothing we use; they are read and dropped.
            else:
                return EndOfMessage()
        if eof:
            raise ProtocolError(400, "connection closed in the middle of a chunked body")
        return NEED_DATA


def normal_host(host: str) -> str:
    """A host as Host headers are compared: lower-case, no trailing dot, an IP address in its
    canonical form (an IPv6 address without brackets, an IPv4-mapped one as IPv4)."""
    host = host.strip().lower().removesuffix(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def split_authority(value: str) -> tuple[str, int | None]:
    """A Host header's (or an absolute target's) host, normalised (`normal_host`), and port
    (None when it names none); ValueError when it is no host[:port]."""
    value = value.strip()
    if value.startswith("["):  # an IPv6 literal
        inside, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"malformed host {value[:100]!r}")
        host, port = inside, rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"malformed host {value[:100]!r}") from None
    else:
        host, _, port = value.partition(":")
        if not _HOST_NAME.fullmatch(host.lower().removesuffix(".")):
            raise ValueError(f"malformed host {value[:100]!r}")
    if port and not (_PORT.fullmatch(port) and 0 < int(port) < 65536):
        raise ValueError(f"malformed port in host {value[:100]!r}")
    return normal_host(host), int(port) if port else None


def parse_allowed_host(text: str) -> tuple[str, int | None]:
    """An allowed-host entry: "name" (any port) or "name:port" (that port only); "*" is
    `HostPolicy.any_host`, not an entry."""
    return split_authority(text)


@dataclass(frozen=True)
class HostPolicy:
    """Which `Host` a server answers, so that a web page cannot reach it through a DNS name it
    controls (DNS rebinding): the page's own name arrives as the Host.

    Accepted: the address the connection arrived on; on a loopback address also localhost,
    127.0.0.1 and ::1; the server's own `names` (its bind address when that is a name, its host
    name when it listens on every address); each with `port` or with no port. Then `allowed`,
    the configured entries: a host with one port, or with any (None). `any_host` accepts
    every Host."""
    port: int
    names: frozenset[str] = frozenset()
    allowed: frozenset[tuple[str, int | None]] = frozenset()
    any_host: bool = False

    @classmethod
    def serving(cls, bind_host: str, port: int, allowed: tuple[str, ...] = (),
                own_names: tuple[str, ...] = ()) -> HostPolicy:
        """The policy of a server bound to `bind_host`:`port`; `allowed` as configured ("*",
        "name", "name:port"), `own_names` what else names this machine. ValueError on a bad
        entry."""
        entries = [a.strip() for a in allowed if a.strip()]
        names = set(own_names)
        if bind_host not in WILDCARD_HOSTS:
            names.add(bind_host)
        return cls(port, frozenset(normal_host(n) for n in names if n),
                   frozenset(parse_allowed_host(a) for a in entries if a != "*"),
                   "*" in entries)

    def with_names(self, *names: str) -> HostPolicy:
        return HostPolicy(self.port, self.names | {normal_host(n) for n in names if n},
                          self.allowed, self.any_host)

    def allows(self, host: str, port: int | None, local_address: str) -> bool:
        """Whether a request for `host`:`port` (normalised, `split_authority`) that arrived on
        `local_address` is this server's to answer."""
        if self.any_host or (host, port) in self.allowed or (host, None) in self.allowed:
            return True
        if port is not None and port != self.port:
            return False
        local = normal_host(local_address) if local_address else ""
        if host in self.names or (local and host == local):
            return True
        return host in LOOPBACK_NAMES and _is_loopback(local)

    def check(self, target: str, headers: Headers, local_address: str) -> None:
        """Raise ProtocolError unless the request's authority (an absolute target's, else its
        Host header's) is one this server answers; 400 when it is malformed, 421 when it names
        another server."""
        if target.startswith(("http://", "https://")):
            authority = target.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
        else:
            value = headers.get("host")
            if value is None:
                return  # HTTP/1.0 without a Host: no name to check (browsers always send one)
            authority = value
        try:
            host, port = split_authority(authority)
        except ValueError as e:
            raise ProtocolError(400, str(e)) from None
        if not self.allows(host, port, local_address):
            raise ProtocolError(421, f"this server does not answer for host "
                                     f"{authority.strip()[:100]!r} (a name that is meant to "
                                     "reach it must be allowed: --allowed-host)")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def is_json_media_type(value: str | None) -> bool:
    """Whether a Content-Type says JSON: application/json or application/*+json, with any
    parameters (charset=utf-8, ...)."""
    if value is None:
        return False
    media = value.split(";", 1)[0].strip().lower()
    kind, _, sub = media.partition("/")
    return kind == "application" and (sub == "json" or (sub.endswith("+json") and len(sub) > 5))


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _check_header_value(name: str, value: str) -> None:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"header {name!r} would break the response framing")


class ServerConnection:
    """The server side of one HTTP/1.1 connection."""

    def __init__(self, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, hosts: HostPolicy | None = None,
                 local_address: str = ""):
        """`hosts`: which Host headers this connection answers (None: any); `local_address`:
        the address the connection arrived on (what `hosts` compares with)."""
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.hosts = hosts
        self.local_address = local_address
        self._buf = bytearray()
        self._eof = False
        self._scan_from = 0
        self._their_state = "idle"  # idle | body | done | error | closed
        self._our_state = "idle"  # idle | streaming | done
        self._body: _ContentLengthBody | _ChunkedBody | None = None
        self._request: Request | None = None
        self._keep_alive = True
        self._stream_chunked = False
        self._stream_body = True  # False for a HEAD request: its response has a head only
        self.waiting_for_100_continue = False
        self.requests_seen = 0

    # ---- receiving -------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the socket; b"" means the client closed its sending side."""
        if data:
            self._buf += data
        else:
            self._eof = True

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def has_partial_request(self) -> bool:
        """Bytes of a request that is not yet parsed (a slow-header clock should be running)."""
        return self._their_state == "idle" and bool(self._buf.lstrip(b"\r\n"))

    @property
    def request_complete(self) -> bool:
        return self._their_state == "done"

    def next_event(self) -> Event | _Sentinel:
        try:
            return self._next_event()
        except ProtocolError:
            self._their_state = "error"
            self._keep_alive = False
            raise

    def _next_event(self) -> Event | _Sentinel:
        state = self._their_state
        if state == "done":
            return PAUSED
        if state in ("error", "closed"):
            raise ProtocolError(400, "connection is no longer usable")
        if state == "body":
            assert self._body is not None
            event = self._body.read(self._buf, self._eof)
            if isinstance(event, Data):
                self.waiting_for_100_continue = False  # the client chose to send the body
            elif isinstance(event, EndOfMessage):
                self._their_state = "done"
                self.waiting_for_100_continue = False
            return event
        return self._read_head()

    def _read_head(self) -> Request | ConnectionClosed | _Sentinel:
        # RFC 9112 2.2: ignore empty lines before a request line (some clients send a CRLF
        # after a POST body).
        while self._buf[:2] == b"\r\n" or self._buf[:1] == b"\n":
            del self._buf[:2 if self._buf[:1] == b"\r" else 1]
            self._scan_from = 0
        m = _BLANK_LINE.search(self._buf, max(0, self._scan_from - 3))
        if m is None:
            self._scan_from = len(self._buf)
            if len(self._buf) > self.max_header_bytes:
                if b"\n" not in self._buf:
                    raise ProtocolError(414, "request line too long")
                raise ProtocolError(431, f"request header block is over "
                                         f"{self.max_header_bytes} bytes")
            if self._eof:
                if self._buf in (b"", b"\r"):
                    self._their_state = "closed"
                    return ConnectionClosed()
                raise ProtocolError(400, "connection closed in the middle of a request head")
            return NEED_DATA
        if m.end() > self.max_header_bytes:
            raise ProtocolError(431, f"request header block is over {self.max_header_bytes} bytes")
        head = bytes(self._buf[:m.start()])
        del self._buf[:m.end()]
        self._scan_from = 0
        request = self._parse_head(head)
        self.requests_seen += 1
        self._request = request
        return request

    def _parse_head(self, head: bytes) -> Request:
        lines = [line.removesuffix(b"\r") for line in head.split(b"\n")]
        m = _REQUEST_LINE.fullmatch(lines[0])
        if m is None:
            raise ProtocolError(400, "malformed request line")
        method = m.group(1).decode("ascii")
        target = m.group(2).decode("ascii")
        major, minor = int(m.group(3)), int(m.group(4))
        if major != 1:
            raise ProtocolError(505, f"HTTP/{major}.{minor} is not supported; speak HTTP/1.1")
        version = "1.0" if minor == 0 else "1.1"
        items: list[tuple[str, str]] = []
        for n, line in enumerate(lines[1:], 2):
            if line[:1] in (b" ", b"\t"):
                raise ProtocolError(400, "obsolete header line folding")
            name, sep, value = line.partition(b":")
            if not sep or not _HEADER_NAME.fullmatch(name):
                # (its text is not repeated: the answer and the log line may not show a key)
                raise ProtocolError(400, f"malformed header line (line {n} of the request head)")
            value = value.strip(b" \t")
            if _BAD_VALUE_CHAR.search(value):
                raise ProtocolError(400, f"control character in header {name.decode()!r}")
            items.append((name.decode("ascii").lower(), value.decode("latin-1")))
        headers = Headers(items)
        self._setup_framing(version, headers)
        if self.hosts is not None:
            self.hosts.check(target, headers, self.local_address)
        return Request(method, target, version, headers)

    def _setup_framing(self, version: str, headers: Headers) -> None:
        if version == "1.1":
            hosts = headers.get_all("host")
            if len(hosts) != 1:
                raise ProtocolError(400, "an HTTP/1.1 request needs exactly one Host header")
        connection = headers.tokens("connection")
        self._keep_alive = version == "1.1" and "close" not in connection
        te = headers.get_all("transfer-encoding")
        lengths = headers.get_all("content-length")
        if te:
            codings = headers.tokens("transfer-encoding")
            if version == "1.0":
                raise ProtocolError(400, "Transfer-Encoding in an HTTP/1.0 request")
            if not codings:
                raise ProtocolError(400, "empty Transfer-Encoding")
            if codings[-1] != "chunked":
                if "chunked" in codings:
                    raise ProtocolError(400, "chunked must be the last transfer coding")
                raise ProtocolError(501, f"transfer coding {codings[-1]!r} is not supported")
            if codings != ["chunked"]:
                raise ProtocolError(501, "only the chunked transfer coding is supported")
            self._body = _ChunkedBody(self.max_body_bytes, self.max_header_bytes)
            body_expected = True
            if lengths:
                # Transfer-Encoding wins (RFC 9112 6.3), but a message carrying both is a
                # smuggling attempt or a broken proxy: answer it, then close.
                self._keep_alive = False
        elif lengths:
            values = {v.strip() for raw in lengths for v in raw.split(",")}
            if len(values) != 1:
                raise ProtocolError(400, "conflicting Content-Length values")
            (value,) = values
            if not _DIGITS.fullmatch(value):
                raise ProtocolError(400, f"bad Content-Length {value[:20]!r}")
            length = int(value)
            if length > self.max_body_bytes:
                raise ProtocolError(413, f"request body of {length} bytes is over the limit of "
                                         f"{self.max_body_bytes}")
            self._body = _ContentLengthBody(length)
            body_expected = length > 0
        else:
            self._body = _ContentLengthBody(0)
            body_expected = False
        expect = headers.get("expect")
        if expect is not None and version == "1.1":
            if expect.strip().lower() != "100-continue":
                raise ProtocolError(417, f"unsupported expectation {expect[:40]!r}")
            self.waiting_for_100_continue = body_expected
        self._their_state = "body"

    # ---- sending ---------------------------------------------------------------------------

    @property
    def keep_alive(self) -> bool:
        """Whether the connection may serve another request after the current response."""
        return self._keep_alive

    @property
    def must_close(self) -> bool:
        """The current (finished) response was the last: close after writing it."""
        return self._our_state == "closed"

    def send_continue(self) -> bytes:
        """The interim `100 Continue`, sent when we start reading a body the client holds back."""
        if not self.waiting_for_100_continue:
            return b""
        self.waiting_for_100_continue = False
        return b"HTTP/1.1 100 Continue\r\n\r\n"

    def _head(self, status: int, headers: list[tuple[str, str]], framing: list[tuple[str, str]]
              ) -> bytes:
        if self._our_state != "idle":
            raise RuntimeError(f"cannot start a response in state {self._our_state}")
        # Answering before the request was read to its end leaves unread bytes on the wire:
        # the only safe way on is to close.
        if self._their_state != "done":
            self._keep_alive = False
        names = {k.lower() for k, _ in headers}
        if "connection" in names and any(
                k.lower() == "connection" and "close" in v.lower() for k, v in headers):
            self._keep_alive = False
        out = [f"HTTP/1.1 {status} {reason(status)}"]
        for k, v in headers:
            if k.lower() in ("content-length", "transfer-encoding", "connection"):
                continue  # framing is ours to decide
            _check_header_value(k, v)
            out.append(f"{k}: {v}")
        out.extend(f"{k}: {v}" for k, v in framing)
        if not self._keep_alive:
            out.append("Connection: close")
        return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")

    def send_response(self, status: int, headers: list[tuple[str, str]], body: bytes = b""
                      ) -> bytes:
        """A whole response with a Content-Length."""
        head = self._head(status, headers, [("Content-Length", str(len(body)))])
        if self._request is not None and self._request.method == "HEAD":
            body = b""  # a HEAD response announces the length but carries no body
        self._finish()
        return head + body

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        """The head of a response whose body follows piece by piece (chunked on HTTP/1.1;
        on HTTP/1.0 the body ends when we close)."""
        http10 = self._request is not None and self._request.http_version == "1.0"
        if http10:
            self._keep_alive = False
            framing: list[tuple[str, str]] = []
        else:
            framing = [("Transfer-Encoding", "chunked")]
        head = self._head(status, headers, framing)
        self._stream_chunked = not http10
        # A HEAD response announces the GET's framing but carries no body.
        self._stream_body = self._request is None or self._request.method != "HEAD"
        self._our_state = "streaming"
        return head

    @property
    def stream_has_body(self) -> bool:
        """Whether the streaming response in progress carries a body (not for HEAD)."""
        return self._stream_body

    def stream_data(self, data: bytes) -> bytes:
        if self._our_state != "streaming":
            raise RuntimeError("no streaming response in progress")
        if not data or not self._stream_body:
            return b""  # an empty chunk would end the body
        if not self._stream_chunked:
            return data
        return b"%x\r\n%b\r\n" % (len(data), data)

    def end_stream(self) -> bytes:
        if self._our_state != "streaming":
            raise RuntimeError("no streaming response in progress")
        self._finish()
        return b"0\r\n\r\n" if self._stream_chunked and self._stream_body else b""

    def _finish(self) -> None:
        """The response is complete: start the next request cycle, or mark the connection done."""
        if self._keep_alive and self._their_state == "done":
            self._their_state = "idle"
            self._our_state = "idle"
            self._body = None
            self._request = None
            self.waiting_for_100_continue = False
        else:
            self._our_state = "closed"
