"""A small client of the control protocol: ask any node for its status (the one request
answered on the connection it came on)."""

from __future__ import annotations

import asyncio

from skulkp2p import wire
from skulkp2p.cluster.handshake import connect
from skulkp2p.wire import Message


async def query_status(addr: str, secret: str | None, timeout: float = 2.0) -> Message:
    """The status of the node at ``addr`` (raises OSError/TimeoutError/WireError)."""
    key = wire.frame_key(secret)

    async def ask() -> Message:
        link = await connect(addr, key, max_in=wire.DATA_MAX_FRAME, connect_timeout=timeout,
                             hello_timeout=timeout)
        try:
            link.send({"t": "status"})
            while msgs := await link.frames():
                for msg in msgs:
                    if msg["t"] == "status-reply":
                        status = msg.get("status")
                        if not isinstance(status, dict):
                            raise wire.WireError("not-a-map", "a status reply without a status")
                        return status
            raise ConnectionError(f"{addr} closed the connection")
        finally:
            link.close()

    return await asyncio.wait_for(ask(), timeout)


def fetch_status(addr: str, secret: str | None, timeout: float = 2.0) -> Message:
    return asyncio.run(query_status(addr, secret, timeout))
