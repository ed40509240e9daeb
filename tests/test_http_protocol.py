"""The HTTP/1.1 state machine on its own: bytes in, events and bytes out, no sockets."""

import h11
import pytest

from skulkp2p.api import http
from skulkp2p.api.http import (
    NEED_DATA,
    PAUSED,
    ConnectionClosed,
    Data,
    EndOfMessage,
    ProtocolError,
    Request,
    ServerConnection,
)


def events(conn: ServerConnection) -> list:
    """Every event available now, up to NEED_DATA or PAUSED (included)."""
    out = []
    while True:
        ev = conn.next_event()
        out.append(ev)
        if ev is NEED_DATA or ev is PAUSED or isinstance(ev, ConnectionClosed):
            return out


def read_request(conn: ServerConnection) -> tuple[Request, bytes]:
    evs = events(conn)
    assert isinstance(evs[0], Request), evs
    assert evs[-1] is PAUSED and isinstance(evs[-2], EndOfMessage), evs
    return evs[0], b"".join(e.data for e in evs if isinstance(e, Data))


def error_status(data: bytes, **kw) -> int:
    conn = ServerConnection(**kw)
    conn.receive_data(data)
    with pytest.raises(ProtocolError) as info:
        for _ in range(100):
            ev = conn.next_event()
            if ev is PAUSED:
                break
            if ev is NEED_DATA:
                conn.receive_data(b"")
    return info.value.status


def client_parse(raw: bytes, method: bytes = b"GET") -> list:
    """Parse our bytes strictly with h11 acting as the client."""
    c = h11.Connection(h11.CLIENT)
    c.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
    c.send(h11.EndOfMessage())
    c.receive_data(raw)
    out = []
    while True:
        ev = c.next_event()
        if ev is h11.NEED_DATA or isinstance(ev, h11.ConnectionClosed):
            break
        out.append(ev)
        if isinstance(ev, h11.EndOfMessage):
            break
    return out


def test_simple_get_and_keep_alive_response():
    conn = ServerConnection()
    conn.receive_data(b"GET /health HTTP/1.1\r\nHost: a\r\nX-Thing:  v  \r\n\r\n")
    req, body = read_request(conn)
    assert (req.method, req.target, req.http_version) == ("GET", "/health", "1.1")
    assert req.headers.get("x-thing") == "v" and req.headers.get("HOST") == "a"
    assert body == b""
    raw = conn.send_response(200, [("Content-Type", "application/json")], b"{}")
    assert not conn.must_close and conn.keep_alive
    evs = client_parse(raw)
    assert evs[0].status_code == 200 and evs[1].data == b"{}"
    assert (b"content-length", b"2") in evs[0].headers
    assert events(conn) == [NEED_DATA]  # ready for the next request


def test_byte_by_byte_and_content_length_body():
    raw = b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\nhello world"
    conn = ServerConnection()
    got = []
    for i in range(len(raw)):
        conn.receive_data(raw[i:i + 1])
        while (ev := conn.next_event()) not in (NEED_DATA, PAUSED):
            got.append(ev)
    assert isinstance(got[0], Request)
    assert b"".join(e.data for e in got if isinstance(e, Data)) == b"hello world"
    assert isinstance(got[-1], EndOfMessage)


def test_chunked_body_with_extensions_and_trailers():
    raw = (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n")
    conn = ServerConnection()
    conn.receive_data(raw)
    _, body = read_request(conn)
    assert body == b"hello world"


def test_chunked_split_everywhere():
    raw = (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"A\r\n0123456789\r\n3\r\nabc\r\n0\r\n\r\n")
    for cut in range(1, len(raw)):  # (an empty feed would mean end of file)
        conn = ServerConnection()
        conn.receive_data(raw[:cut])
        evs = events(conn)
        conn.receive_data(raw[cut:])
        evs += events(conn)
        body = b"".join(e.data for e in evs if isinstance(e, Data))
        assert body == b"0123456789abc", cut


def test_transfer_encoding_wins_over_content_length_and_closes():
    raw = (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    conn = ServerConnection()
    conn.receive_data(raw)
    _, body = read_request(conn)
    assert body == b"abc"
    raw = conn.send_response(200, [], b"ok")
    assert conn.must_close and b"Connection: close" in raw


def test_pipelined_requests_answered_in_order():
    conn = ServerConnection()
    conn.receive_data(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nxyz"
                      b"GET /c HTTP/1.1\r\nHost: x\r\n\r\n")
    seen = []
    for _ in range(3):
        req, body = read_request(conn)
        assert conn.next_event() is PAUSED  # nothing of the next request before we answer
        seen.append((req.target, body))
        conn.send_response(200, [], req.target.encode())
    assert seen == [("/a", b""), ("/b", b"xyz"), ("/c", b"")]
    assert events(conn) == [NEED_DATA]


def test_leading_blank_lines_are_ignored_and_eof_between_requests():
    conn = ServerConnection()
    conn.receive_data(b"\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n")
    read_request(conn)
    conn.send_response(204, [])
    conn.receive_data(b"")
    assert isinstance(conn.next_event(), ConnectionClosed)


def test_connection_close_and_http10():
    conn = ServerConnection()
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    read_request(conn)
    assert b"Connection: close" in conn.send_response(200, [], b"")
    assert conn.must_close
    conn = ServerConnection()
    conn.receive_data(b"GET / HTTP/1.0\r\n\r\n")  # no Host needed in 1.0
    read_request(conn)
    conn.send_response(200, [], b"")
    assert conn.must_close


def test_expect_100_continue():
    conn = ServerConnection()
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
                      b"Expect: 100-continue\r\n\r\n")
    assert isinstance(conn.next_event(), Request)
    assert conn.waiting_for_100_continue
    assert conn.next_event() is NEED_DATA
    assert conn.send_continue() == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert conn.send_continue() == b""  # only once
    conn.receive_data(b"abcd")
    assert conn.next_event() == Data(b"abcd")
    assert isinstance(conn.next_event(), EndOfMessage)


def test_answer_before_body_closes_the_connection():
    conn = ServerConnection()
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
                      b"Expect: 100-continue\r\n\r\n")
    assert isinstance(conn.next_event(), Request)
    raw = conn.send_response(404, [], b"no")
    assert conn.must_close and b"Connection: close" in raw


def test_head_response_has_no_body():
    conn = ServerConnection()
    conn.receive_data(b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n")
    read_request(conn)
    raw = conn.send_response(405, [("Allow", "GET")], b"body")
    assert raw.endswith(b"\r\n\r\n") and b"Content-Length: 4" in raw
    assert client_parse(raw, b"HEAD")[0].status_code == 405


def test_streaming_response_is_valid_chunked():
    conn = ServerConnection()
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    read_request(conn)
    raw = conn.start_stream(200, [("Content-Type", "text/event-stream")])
    raw += conn.stream_data(b"data: 1\n\n") + conn.stream_data(b"") + conn.stream_data(b"x" * 300)
    raw += conn.end_stream()
    evs = client_parse(raw)
    assert evs[0].status_code == 200 and (b"transfer-encoding", b"chunked") in evs[0].headers
    assert b"".join(e.data for e in evs if isinstance(e, h11.Data)) == b"data: 1\n\n" + b"x" * 300
    assert isinstance(evs[-1], h11.EndOfMessage) and not conn.must_close


def test_streaming_to_http10_is_close_delimited():
    conn = ServerConnection()
    conn.receive_data(b"GET / HTTP/1.0\r\n\r\n")
    read_request(conn)
    raw = conn.start_stream(200, []) + conn.stream_data(b"abc")
    assert b"chunked" not in raw and raw.endswith(b"abc")
    assert conn.end_stream() == b"" and conn.must_close


def test_response_header_injection_is_refused():
    conn = ServerConnection()
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    read_request(conn)
    with pytest.raises(ValueError):
        conn.send_response(200, [("X-Evil", "a\r\nSet-Cookie: b")], b"")


BIG = http.MAX_HEADER_BYTES


@pytest.mark.parametrize("raw,status", [
    (b"GET /\r\n\r\n", 400),  # HTTP/0.9 style
    (b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400),  # two spaces
    (b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400),  # not a token
    (b"GET / HTTP/1.1 extra\r\nHost: a\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # a TLS hello
    (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a\r\nBad Name: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a\r\nNoColon\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: 1\r\n folded\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"v" * BIG + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"v" * BIG, 431),  # never ends
    (b"GET /" + b"a" * BIG, 414),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 4\r\n\r\nabcd", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x10\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n", 413),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcd\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000, 400),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nffffffffff\r\n", 413),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n" + b"a" * 64
     + b"\r\n", 413),
    (b"POST / HTTP/1.1\r\nHost: a\r\nExpect: telepathy\r\nContent-Length: 1\r\n\r\n", 417),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc", 400),  # EOF mid-body
    (b"GET / HTTP/1.1\r\nHost: a\r\n", 400),  # EOF mid-head
])
def test_bad_requests(raw, status):
    assert error_status(raw, max_body_bytes=50) == status


def test_after_an_error_the_connection_only_answers_and_closes():
    conn = ServerConnection()
    conn.receive_data(b"BROKEN\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n")
    with pytest.raises(ProtocolError):
        conn.next_event()
    raw = conn.send_response(400, [], b"bad")
    assert conn.must_close and b"Connection: close" in raw
    assert client_parse(raw)[0].status_code == 400


def test_partial_request_flag_for_the_slow_header_clock():
    conn = ServerConnection()
    assert not conn.has_partial_request
    conn.receive_data(b"\r\n")
    assert conn.next_event() is NEED_DATA and not conn.has_partial_request
    conn.receive_data(b"GE")
    assert conn.next_event() is NEED_DATA and conn.has_partial_request


# ---- the chunk-size line limit, however the line arrives ------------------------------------

def _chunked_with_extension(ext_len: int) -> bytes:
    return (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;" + b"e" * ext_len + b"\r\nhello\r\n0\r\n\r\n")


@pytest.mark.parametrize("feed", ["whole", "byte by byte"])
def test_chunk_size_line_limit_holds_however_the_line_arrives(feed):
    too_long = _chunked_with_extension(http.MAX_CHUNK_LINE)  # "5;" + ext + CR: over the limit
    pieces = [too_long] if feed == "whole" else [too_long[i:i + 1]
                                                 for i in range(len(too_long))]
    conn = ServerConnection()
    with pytest.raises(ProtocolError) as info:
        for piece in pieces:
            conn.receive_data(piece)
            while conn.next_event() not in (NEED_DATA, PAUSED):
                pass
    assert info.value.status == 400 and "chunk size line too long" in info.value.message
    # A line of exactly the limit (with its CR) is a client's right, in one piece or many.
    fits = _chunked_with_extension(http.MAX_CHUNK_LINE - 3)
    pieces = [fits] if feed == "whole" else [fits[i:i + 1] for i in range(len(fits))]
    conn = ServerConnection()
    got = []
    for piece in pieces:
        conn.receive_data(piece)
        while (ev := conn.next_event()) not in (NEED_DATA, PAUSED):
            got.append(ev)
    assert b"".join(e.data for e in got if isinstance(e, Data)) == b"hello"
    assert isinstance(got[-1], EndOfMessage)


# ---- HEAD --------------------------------------------------------------------------------

def test_head_streaming_response_is_a_head_only_and_keeps_the_connection():
    conn = ServerConnection()
    conn.receive_data(b"HEAD /s HTTP/1.1\r\nHost: a\r\n\r\nGET /s HTTP/1.1\r\nHost: a\r\n\r\n")
    read_request(conn)
    raw = conn.start_stream(200, [("Content-Type", "text/event-stream")])
    assert not conn.stream_has_body
    assert conn.stream_data(b"data: 1\n\n") == b"" and conn.end_stream() == b""
    assert raw.endswith(b"\r\n\r\n") and b"Transfer-Encoding: chunked" in raw
    evs = client_parse(raw, b"HEAD")
    assert evs[0].status_code == 200 and isinstance(evs[-1], h11.EndOfMessage)
    assert not conn.must_close
    req, _ = read_request(conn)  # the next request on the same connection: a body again
    assert req.method == "GET"
    raw = conn.start_stream(200, []) + conn.stream_data(b"x") + conn.end_stream()
    assert conn.stream_has_body and raw.endswith(b"1\r\nx\r\n0\r\n\r\n")


# ---- Host --------------------------------------------------------------------------------

LOOPBACK = http.HostPolicy.serving("127.0.0.1", 8000)


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000",
                                  "LocalHost.:8000", "127.0.0.1", "localhost"])
def test_host_of_a_loopback_server_accepted(host):
    assert LOOPBACK.allows(*http.split_authority(host), "127.0.0.1")


@pytest.mark.parametrize("host", [
    "evil.example:8000",  # a DNS name pointed at 127.0.0.1 (rebinding)
    "evil.example",
    "127.0.0.1:8001",  # another port
    "sub.localhost:8000",
    "127.000.000.001:8000",
    "2130706433:8000",
    "192.168.1.5:8000",
])
def test_host_of_a_loopback_server_refused(host):
    assert not LOOPBACK.allows(*http.split_authority(host), "127.0.0.1")


def test_host_of_a_server_on_every_address():
    policy = http.HostPolicy.serving("0.0.0.0", 8000, own_names=("MyBox",))

    def ok(host: str, local: str) -> bool:
        return policy.allows(*http.split_authority(host), local)

    assert ok("192.168.1.5:8000", "192.168.1.5")  # the address the connection came to
    assert ok("mybox:8000", "192.168.1.5")  # the machine's name
    assert ok("localhost:8000", "127.0.0.1") and ok("localhost:8000", "::ffff:127.0.0.1")
    assert not ok("localhost:8000", "192.168.1.5")  # loopback names on loopback only
    assert not ok("10.0.0.9:8000", "192.168.1.5")
    assert not ok("evil.example:8000", "192.168.1.5")
    assert ok("[fe80::1]:8000", "fe80::1") and not ok("[fe80::2]:8000", "fe80::1")
    named = policy.with_names("node-a.lan")  # e.g. the address a cluster announces
    assert named.allows("node-a.lan", 8000, "10.1.1.1") and not named.allows("node-a.lan", 1, "")


def test_host_configured_entries():
    policy = http.HostPolicy.serving("127.0.0.1", 8000, ("api.example", "proxy.lan:8080"))
    assert policy.allows("api.example", 443, "127.0.0.1")  # no port given: any port
    assert policy.allows("api.example", None, "127.0.0.1")
    assert policy.allows("proxy.lan", 8080, "127.0.0.1")
    assert not policy.allows("proxy.lan", 8000, "127.0.0.1")
    assert not policy.allows("other.example", 8000, "127.0.0.1")
    assert http.HostPolicy.serving("127.0.0.1", 8000, ("*",)).allows("x", 1, "")
    for bad in ("a b", "a:b", "[::1", "a:99999", "a:0", "[nonsense]:1", "a/b", ""):
        with pytest.raises(ValueError):
            http.parse_allowed_host(bad)
    with pytest.raises(ValueError):
        http.HostPolicy.serving("127.0.0.1", 8000, ("a b",))


def _head(conn: ServerConnection, raw: bytes) -> Request:
    conn.receive_data(raw)
    ev = conn.next_event()
    assert isinstance(ev, Request)
    return ev


def test_the_parser_refuses_a_host_it_does_not_serve_with_421():
    policy = http.HostPolicy.serving("127.0.0.1", 8000)
    ok = ServerConnection(hosts=policy, local_address="127.0.0.1")
    assert _head(ok, b"GET / HTTP/1.1\r\nHost: localhost:8000\r\n\r\n").target == "/"
    cases = [
        (b"GET / HTTP/1.1\r\nHost: evil.example:8000\r\n\r\n", 421),
        (b"GET / HTTP/1.0\r\nHost: evil.example\r\n\r\n", 421),
        # absolute form: its authority is the one that counts (RFC 9112 3.2.2)
        (b"GET http://evil.example:8000/ HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\r\n", 421),
        (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: \r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: 127.0.0.1:80x\r\n\r\n", 400),
    ]
    for raw, status in cases:
        assert error_status(raw, hosts=policy, local_address="127.0.0.1") == status, raw
    absolute = ServerConnection(hosts=policy, local_address="127.0.0.1")
    assert _head(absolute, b"GET http://localhost:8000/x HTTP/1.1\r\nHost: evil\r\n\r\n"
                 ).target == "http://localhost:8000/x"
    http10 = ServerConnection(hosts=policy, local_address="127.0.0.1")  # 1.0: Host optional
    assert _head(http10, b"GET / HTTP/1.0\r\n\r\n").http_version == "1.0"
    # After a 421 the connection answers and closes.
    conn = ServerConnection(hosts=policy, local_address="127.0.0.1")
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: evil.example:8000\r\n\r\n")
    with pytest.raises(ProtocolError):
        conn.next_event()
    assert b"Connection: close" in conn.send_response(421, [], b"") and conn.must_close


# ---- Content-Type ------------------------------------------------------------------------

@pytest.mark.parametrize("value,ok", [
    ("application/json", True),
    ("application/json; charset=utf-8", True),
    ("Application/JSON;charset=UTF-8", True),
    ("application/vnd.api+json", True),
    ("text/plain", False),
    ("text/plain; charset=utf-8", False),
    ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False),
    ("application/jsonx", False),
    ("application/+json", False),
    ("json", False),
    ("", False),
    (None, False),
])
def test_json_media_type(value, ok):
    assert http.is_json_media_type(value) is ok
