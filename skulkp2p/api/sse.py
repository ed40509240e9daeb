"""Server-Sent Events framing (https://html.spec.whatwg.org/multipage/server-sent-events.html).

Each event is written and flushed on its own, so a client sees every token as it is decoded.
JSON payloads are single-line (orjson never emits a newline), so one `data:` line is enough.
"""

from __future__ import annotations

import orjson

HEADERS = [
    ("Content-Type", "text/event-stream; charset=utf-8"),
    ("Cache-Control", "no-cache"),
    ("X-Accel-Buffering", "no"),  # tell reverse proxies not to buffer the stream
]

# A comment line: ignored by every SSE parser, but it keeps proxies and clients from timing out
# while a long prefill (or a queue) produces nothing, and a write that fails tells us the client
# is gone.
KEEPALIVE = b": keep-alive\n\n"

DONE = b"data: [DONE]\n\n"


def event(data: object, name: str | None = None) -> bytes:
    """One event: `event: name` (when named) and one `data:` line of JSON."""
    payload = orjson.dumps(data)
    if name is None:
        return b"data: " + payload + b"\n\n"
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"
