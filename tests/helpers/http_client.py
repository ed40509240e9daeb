"""HTTP for tests: a strict HTTP/1.1 client (h11) over a real loopback socket, raw socket
exchanges, and one-shot JSON calls (``call``, ``status_of``) with the standard library's
client. Every socket is closed by its user (context managers)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field

import h11


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival time, data)

    def json(self):
        return json.loads(self.body)

    def sse(self) -> list[tuple[str | None, str]]:
        """(event name, data) of each SSE event; comments dropped."""
        out = []
        for block in self.body.decode().split("\n\n"):
            name, data = None, []
            for line in block.split("\n"):
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data.append(line[6:])
            if data:
                out.append((name, "\n".join(data)))
        return out


class H11Client:
    """One keep-alive connection; every byte we receive is parsed strictly by h11."""

    def __init__(self, port: int, timeout: float = 30.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.conn = h11.Connection(h11.CLIENT)

    def __enter__(self) -> H11Client:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, method: str, path: str, body: bytes | dict | None = None,
             headers: list[tuple[str, str]] | None = None) -> None:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        hdrs = [("Host", "127.0.0.1"), *(headers or [])]
        if body is not None:
            hdrs.append(("Content-Length", str(len(body))))
            if not any(k.lower() == "content-type" for k, _ in hdrs):
                hdrs.append(("Content-Type", "application/json"))  # as real clients send it
        data = self.conn.send(h11.Request(method=method, target=path, headers=hdrs))
        if body:
            data += self.conn.send(h11.Data(data=body))
        data += self.conn.send(h11.EndOfMessage())
        self.sock.sendall(data)

    def _event(self):
        while True:
            ev = self.conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            self.conn.receive_data(self.sock.recv(65536))

    def receive(self, stop_after: int | None = None) -> Reply:
        """The response to the last request; `stop_after` bytes of body, then return early."""
        ev = self._event()
        while isinstance(ev, h11.InformationalResponse):
            ev = self._event()
        assert isinstance(ev, h11.Response), ev
        reply = Reply(ev.status_code, {k.decode().lower(): v.decode() for k, v in ev.headers},
                      b"")
        body = bytearray()
        while True:
            ev = self._event()
            if isinstance(ev, h11.Data):
                body += ev.data
                reply.chunks.append((time.monotonic(), bytes(ev.data)))
                if stop_after is not None and len(body) >= stop_after:
                    break
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                raise AssertionError(f"unexpected {ev!r}")
        reply.body = bytes(body)
        if isinstance(ev, h11.EndOfMessage) and self.conn.our_state is h11.DONE \
                and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return reply

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: list[tuple[str, str]] | None = None) -> Reply:
        self.send(method, path, body, headers)
        return self.receive()


def raw_exchange(port: int, data: bytes | list[bytes], timeout: float = 10.0,
                 pause: float = 0.0) -> bytes:
    """Send raw bytes (a list is sent piece by piece, `pause` apart) and read until the server
    closes the connection (or `timeout`)."""
    pieces = data if isinstance(data, list) else [data]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        for i, piece in enumerate(pieces):
            if i and pause:
                time.sleep(pause)
            s.sendall(piece)
        out = bytearray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not got:
                break
            out += got
        return bytes(out)


def parse_responses(raw: bytes) -> list[Reply]:
    """Every response in `raw` (pipelined answers), parsed strictly by h11."""
    out = []
    while raw:
        c = h11.Connection(h11.CLIENT)
        c.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        c.send(h11.EndOfMessage())
        c.receive_data(raw)
        ev = c.next_event()
        while isinstance(ev, h11.InformationalResponse):
            ev = c.next_event()
        assert isinstance(ev, h11.Response), (ev, raw[:200])
        reply = Reply(ev.status_code, {k.decode().lower(): v.decode() for k, v in ev.headers},
                      b"")
        body = bytearray()
        while True:
            ev = c.next_event()
            if isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                c.receive_data(b"")  # close-delimited or truncated
                if isinstance(ev, h11.ConnectionClosed):
                    break
                ev = c.next_event()
                if isinstance(ev, h11.EndOfMessage):
                    break
                raise AssertionError(f"truncated response: {raw[:300]!r}")
        reply.body = bytes(body)
        out.append(reply)
        raw = bytes(c.trailing_data[0])
    return out


def call(addr: str, method: str, path: str, body=None, timeout: float = 60,
         headers: dict[str, str] | None = None):
    """One request to HOST:PORT on a fresh connection (with `headers` besides the JSON
    Content-Type): (status, lower-cased headers, the body parsed as JSON, or the raw bytes when
    it is not JSON)."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        sent = {"Content-Type": "application/json"} if data else {}
        conn.request(method, path, data, {**sent, **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
    finally:
        conn.close()


def status_of(addr: str, path: str = "/health") -> int:
    """The status ``path`` answers on HOST:PORT, or 0 when the connection fails."""
    try:
        return call(addr, "GET", path, timeout=5)[0]
    except OSError:
        return 0
