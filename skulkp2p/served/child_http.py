"""HTTP/1.1 to the llama-server child on asyncio streams, for the proxy's `relay`: the request
head (what http.client sends for the same request), the response head and the body's framing
(chunked, by length, or to the close)."""

from __future__ import annotations

import asyncio

# What a lost or broken child looks like on the loop side (http.client's errors on the other).
LOST = (ConnectionError, OSError, EOFError, ValueError, asyncio.LimitOverrunError)


def request_head(path: str, host: str, port: int, length: int) -> bytes:
    # The head http.client sends for the same request.
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept-Encoding: identity\r\n"
            f"Content-Length: {length}\r\nContent-Type: application/json\r\n\r\n").encode()


async def response_head(reader: asyncio.StreamReader) -> tuple[int, tuple[str, int]]:
    """The status and the body's framing: ("chunked", 0), ("length", n) or ("close", 0)."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, status_text = lines[0].split(" ", 2)[:2]
        if not version.startswith("HTTP/"):
            raise ValueError(f"bad status line {lines[0][:60]!r}")
        status = int(status_text)
        if status != 100:
            break  # (a 100 Continue is followed by the real response)
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, ("chunked", 0)
    if "content-length" in headers:
        return status, ("length", int(headers["content-length"]))
    return status, ("close", 0)


class BodyReader:
    """A response body read piece by piece from an asyncio stream; b"" at its end."""

    def __init__(self, framing: tuple[str, int]):
        self.kind, self.left = framing
        self.done = False

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        if self.done:
            return b""
        if self.kind == "chunked":
            line = await reader.readuntil(b"\n")
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\n")).strip():
                    pass  # trailer fields: nothing we use
                self.done = True
                return b""
            data = await reader.readexactly(size)
            await reader.readuntil(b"\n")  # the CRLF after the chunk
            return data
        if self.kind == "length":
            if self.left <= 0:
                self.done = True
                return b""
            data = await reader.read(min(self.left, 65536))
            if not data:
                raise asyncio.IncompleteReadError(b"", self.left)
            self.left -= len(data)
            return data
        data = await reader.read(65536)
        if not data:
            self.done = True
        return data

    async def read_all(self, reader: asyncio.StreamReader) -> bytes:
        parts = []
        while data := await self.read(reader):
            parts.append(data)
        return b"".join(parts)
