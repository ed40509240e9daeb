"""A small client of the control protocol: ask any node for its status (the one request
answered on the connection it came on)."""

from __future__ import annotations

import asyncio

from skulkp2p import wire
from skulkp2p.cluster.config import split_addr
from skulkp2p.wire import Message


async def query_status(addr: str, secret: str | None, timeout: float = 2.0) -> Message:
    """The status of the node at ``addr`` (raises OSError/TimeoutError/WireError)."""
    key = wire.frame_key(secret)
    host, port = split_addr(addr)

    async def ask() -> Message:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(wire.encode_frame({"t": "status"}, key))
            decoder = wire.FrameDecoder(key, wire.DATA_MAX_FRAME)
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError(f"{addr} closed the connection")
                for msg in decoder.feed(data):
                    if msg["t"] == "status-reply":
                        status = msg.get("status")
                        if not isinstance(status, dict):
                            raise wire.WireError("not-a-map", "a status reply without a status")
                        return status
        finally:
            writer.transport.abort()

    return await asyncio.wait_for(ask(), timeout)


def fetch_status(addr: str, secret: str | None, timeout: float = 2.0) -> Message:
    return asyncio.run(query_status(addr, secret, timeout))
