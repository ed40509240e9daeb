"""Stored responses of the Responses API, for `previous_response_id`: in memory, per node (one
store per process), bounded in count and in bytes, the least recently used going first.

An entry keeps the whole conversation a later request continues: the chat messages the response
was generated from (its own input after its predecessors', without `instructions`, which
OpenAI does not carry over) and the assistant message it produced. A request that names a
response goes to the node serving its model (the cluster forwards it there; of several
replicas, the one that stored it, which gossips the ids it stored), which is the node that
generated and stored it; a response stored on a node that since stopped serving that model
is gone (404), as is one pushed out by the bounds.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from skulkp2p.engine.request import Message
from skulkp2p.formats.chat_messages import message_json

DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    id: str
    messages: tuple[Message, ...]  # the conversation up to and including this response
    size: int


class ResponseStore:
    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_count < 0 or max_bytes < 0:
            raise ValueError("response store bounds must be >= 0")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # the loop only, today; cheap insurance
        # Told (model, response id) of each response stored: a cluster node routes the
        # requests that continue it to this node's replica of the model.
        self.on_put: Callable[[str, str], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, messages: tuple[Message, ...], model: str = "") -> bool:
        """Store a response's conversation; False when it alone exceeds the byte bound (its
        size: as OpenAI chat's messages in JSON)."""
        size = len(orjson.dumps([message_json(m) for m in messages]))
        if size > self.max_bytes or self.max_count == 0:
            return False
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self.bytes -= old.size
            self._entries[response_id] = StoredResponse(response_id, messages, size)
            self.bytes += size
            while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.size
        if self.on_put is not None and model:
            self.on_put(model, response_id)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


_store: ResponseStore | None = None


def node_store() -> ResponseStore:
    """This node's store, made on first use with the bounds from SKULKP2P_RESPONSES_MAX and
    SKULKP2P_RESPONSES_MAX_BYTES (defaults: 1024 responses, 64 MiB)."""
    global _store
    if _store is None:
        _store = ResponseStore(_env_int("SKULKP2P_RESPONSES_MAX", DEFAULT_MAX_COUNT),
                               _env_int("SKULKP2P_RESPONSES_MAX_BYTES", DEFAULT_MAX_BYTES))
    return _store
