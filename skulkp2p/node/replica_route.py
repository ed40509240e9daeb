"""Which replica of a model serves a request: the one whose prefix cache likely holds the
longest prefix of its prompt, unless that one is busier than the least loaded by more than a
bound; otherwise the least loaded.

A router may not hold the model's tokenizer, so the prompt is keyed without it: a chain of
hashes over the request's items (message 1, messages 1..2, ...: `affinity_chain`). Each
replica records the chains of the requests it served (and the ids of the responses it stored,
for `previous_response_id`) in a bounded recent set (`AffinityRecord`) and gossips it with its
load (queued and running requests); `choose_replica` is a pure function of those and the
request's chain. A conversation's next turn shares its first keys with the turn before, so it
lands where that turn's caches are.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from skulkp2p.engine.json_types import JSONValue

# The replica whose cache matches may have at most this many more requests queued or running
# than the least loaded one; past that the request goes to the least loaded.
AFFINITY_SLACK = 1
RECENT_KEYS = 128  # keys a replica gossips per model (12 hex digits each)
KEY_HEX = 12
PROMPT_BLOCK_CHARS = 512  # a plain completion's prompt is keyed per block of this many characters
MAX_CHAIN = 64  # the first this many items key a request (a longer one shares its start)


@dataclass(frozen=True)
class ReplicaView:
    """A replica as a router sees it: the node that runs its decode loop, its load (requests
    queued and running there, and those this router has sent it that are not done) and the
    keys of what it served recently."""

    node: str
    load: int
    keys: frozenset[str] = frozenset()


def choose_replica(chain: Sequence[str], replicas: Sequence[ReplicaView], turn: int = 0,
                   slack: int = AFFINITY_SLACK) -> ReplicaView:
    """The replica for a request keyed by ``chain``: among those no busier than the least
    loaded plus ``slack``, the one holding the longest prefix of the chain (then the less
    loaded); with no prefix held anywhere there, the least loaded. Ties go round by ``turn``
    (a counter of the router's), so equal replicas share sequential requests too."""
    if not replicas:
        raise ValueError("no replica to choose from")
    least = min(r.load for r in replicas)
    near = [r for r in replicas if r.load <= least + slack]
    held = {r.node: _held(chain, r.keys) for r in near}
    best = max(held.values())
    if best > 0:
        pool = [r for r in near if held[r.node] == best]
        low = min(r.load for r in pool)
        pool = [r for r in pool if r.load == low]
    else:
        pool = [r for r in replicas if r.load == least]
    pool.sort(key=lambda r: r.node)
    return pool[turn % len(pool)]


def _held(chain: Sequence[str], keys: frozenset[str]) -> int:
    """How many items of the chain's longest prefix the keys hold (each key covers its whole
    prefix, so the last one held counts)."""
    for i in range(len(chain), 0, -1):
        if chain[i - 1] in keys:
            return i
    return 0


def response_key(model: str, response_id: str) -> str:
    """The key a stored response is known by (a request continuing it starts its chain so)."""
    return _link(_link("", model), "response:" + response_id)


def affinity_chain(model: str, path: str, body: JSONValue) -> list[str]:
    """The request's chain of keys: one per prefix of its items (chat and Anthropic messages,
    the Anthropic system prompt first; Responses input items after the response it continues;
    a plain prompt's blocks of PROMPT_BLOCK_CHARS). Empty for a body it cannot read: such a
    request has no affinity and goes to the least loaded."""
    if not isinstance(body, dict):
        return []
    items: list[JSONValue] = []
    head = _link("", model)
    if path.startswith("/v1/responses"):
        prev = body.get("previous_response_id")
        if isinstance(prev, str):
            head = response_key(model, prev)
        given = body.get("input")
        items = [given] if isinstance(given, str) else list(given) if isinstance(given, list) \
            else []
    elif path.startswith("/v1/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            # cumulative blocks: a longer prompt with the same start shares its first keys
            items = [prompt[i:i + PROMPT_BLOCK_CHARS]
                     for i in range(0, len(prompt), PROMPT_BLOCK_CHARS)]
        elif prompt is not None:
            items = [prompt]
    else:
        system = body.get("system")
        if system is not None:
            items.append({"system": system})
        messages = body.get("messages")
        if isinstance(messages, list):
            items.extend(messages)
    chain: list[str] = [head] if head != _link("", model) else []
    key = head
    for item in items[:MAX_CHAIN]:
        key = _link(key, _canonical(item))
        chain.append(key)
    return chain


def _canonical(item: JSONValue) -> str:
    try:
        return orjson.dumps(item, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # too deep or not JSON: keyed by its repr, still deterministic
        return repr(item)


def _link(prev: str, item: str) -> str:
    h = hashlib.blake2b(digest_size=KEY_HEX // 2)
    h.update(prev.encode())
    h.update(b"\x00")
    h.update(item.encode(errors="replace"))
    return h.hexdigest()


class AffinityRecord:
    """The keys this node's replicas served, per model: at most RECENT_KEYS each, the least
    recently used out first. Touched on the event loop only."""

    def __init__(self, limit: int = RECENT_KEYS):
        self.limit = limit
        self._keys: dict[str, OrderedDict[str, None]] = {}
        self.version = 0  # bumped on every change: the gossip sends it only when it moved

    def record(self, model: str, keys: Sequence[str]) -> None:
        if not keys:
            return
        held = self._keys.setdefault(model, OrderedDict())
        for k in keys:
            held.pop(k, None)
            held[k] = None
        while len(held) > self.limit:
            held.popitem(last=False)
        self.version += 1

    def forget(self, model: str) -> None:
        if self._keys.pop(model, None) is not None:
            self.version += 1

    def keys(self, model: str) -> frozenset[str]:
        return frozenset(self._keys.get(model, ()))

    def gossip(self) -> dict[str, list[str]]:
        """What goes into this node's facts: model -> its recent keys."""
        return {m: list(keys) for m, keys in sorted(self._keys.items()) if keys}
