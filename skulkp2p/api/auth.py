"""Who may use the HTTP API: API keys for clients, the cluster secret between nodes.

- `ApiKeys`: the keys a client may present, as `Authorization: Bearer KEY` (what the openai
  client sends) or `x-api-key: KEY` (the anthropic client's). A presented key is compared with
  every configured key, each in constant time (SHA-256 digests through `hmac.compare_digest`,
  so neither a key's bytes nor its length show in the timing). Keys are never logged and never
  echoed in an answer.
- `NodeAuth`: what a node's request to another node of its cluster carries instead of a user's
  key (a request relayed to the node that serves its model, a dashboard's stats gathered from
  every member): an HMAC-SHA256, keyed with a key derived from the cluster secret, over the
  method, the target, the Host, a timestamp, a random nonce and the body's SHA-256. The receiver
  checks it within a clock window (`WINDOW_S` either way) and refuses a nonce it has seen, so a
  signed request captured on the network cannot be replayed, changed, or sent to another node.
- `AuthPolicy`: which requests need what. Each route declares its `Access`: `OPEN` (never a key:
  /health, the dashboard's page and assets), `READ` (a key unless `open_reads`), `KEY` (always a
  key: generation, and every route that changes the cluster). With no keys configured every
  route is open, as on a node that listens on loopback only (the CLI refuses a non-loopback
  address without a key unless told it is meant: `--insecure-http`).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from skulkp2p.api.errors import ApiError
from skulkp2p.api.http import Headers

Access = Literal["open", "read", "key"]
OPEN: Access = "open"
READ: Access = "read"
KEY: Access = "key"

ENV_API_KEY = "SKULKP2P_API_KEY"
FORWARDED_HEADER = "x-skulkp2p-forwarded"  # set by a node that relays a request (api/relay.py)
NODE_AUTH_HEADER = "x-skulkp2p-node-auth"
WINDOW_S = 60.0  # how far a signed request's timestamp may be from the receiver's clock
MAX_NONCES = 100_000  # nonces remembered within the window (only valid signatures add one)
MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 4096
_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: what a header carries
_NODE_AUTH = re.compile(r"ts=([0-9]{1,12}),nonce=([0-9a-f]{32}),body=([0-9a-f]{64}),"
                        r"sig=([0-9a-f]{64})")
_DERIVE = b"skulkp2p http node auth"  # the HMAC key is derived, never the secret itself
_SIGNED = "skulkp2p-node-auth-1"

UNAUTHORIZED_HEADERS = [("WWW-Authenticate", "Bearer")]


def check_key(key: str) -> str:
    """`key` if it can be an API key: 16 to 4096 printable ASCII characters without spaces (what
    an HTTP header carries unchanged); ValueError otherwise, which never quotes the key."""
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS or not _KEY.fullmatch(key):
        raise ValueError(f"an API key must be {MIN_KEY_CHARS} to {MAX_KEY_CHARS} printable "
                         "ASCII characters without spaces (make one with: python -c 'import "
                         "secrets; print(secrets.token_urlsafe(32))')")
    return key


def _digest(text: str) -> bytes:
    # Headers are decoded as latin-1 (api/http.py), keys are ASCII: the same bytes either way.
    return hashlib.sha256(text.encode("latin-1", errors="replace")).digest()


class ApiKeys:
    """The keys this node accepts (held as SHA-256 digests only)."""

    def __init__(self, keys: Iterable[str] = ()):
        self._digests = tuple(_digest(k) for k in keys)

    def __len__(self) -> int:
        return len(self._digests)

    def matches(self, presented: str) -> bool:
        """Whether `presented` is one of the keys: compared with every one of them, each in
        constant time, without stopping at a match."""
        d = _digest(presented)
        found = False
        for k in self._digests:
            found |= hmac.compare_digest(k, d)
        return found


def presented_keys(headers: Headers) -> list[str]:
    """The keys a request presents: `Authorization: Bearer KEY` and `x-api-key: KEY`."""
    out = []
    for value in headers.get_all("authorization"):
        scheme, _, credentials = value.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            out.append(credentials.strip())
    out += [v.strip() for v in headers.get_all("x-api-key") if v.strip()]
    return out


class NodeAuthError(Exception):
    """A node signature that does not hold; the message says why (never what was signed)."""


def _body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class NodeAuth:
    """Signs and checks the requests nodes of one cluster send each other over HTTP, with a key
    derived from the cluster secret. `clock` is wall-clock time (the signer's and the
    receiver's must agree within `window_s`)."""

    def __init__(self, secret: str, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.time, max_nonces: int = MAX_NONCES):
        if not secret:
            raise ValueError("node signatures need a cluster secret")
        self._key = hmac.new(secret.encode(), _DERIVE, hashlib.sha256).digest()
        self.window_s = window_s
        self.clock = clock
        self.max_nonces = max_nonces
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def _mac(self, method: str, target: str, host: str, ts: str, nonce: str, body: str) -> str:
        msg = "\n".join((_SIGNED, method.upper(), target, host.strip().lower(), ts, nonce, body))
        return hmac.new(self._key, msg.encode("latin-1", errors="replace"),
                        hashlib.sha256).hexdigest()

    def sign(self, method: str, target: str, host: str, body: bytes) -> str:
        """The NODE_AUTH_HEADER value for a request sent with this method, target, Host and
        body."""
        ts, nonce, digest = str(int(self.clock())), secrets.token_hex(16), _body_hash(body)
        sig = self._mac(method, target, host, ts, nonce, digest)
        return f"ts={ts},nonce={nonce},body={digest},sig={sig}"

    def verify(self, method: str, target: str, host: str, value: str) -> str:
        """Check a NODE_AUTH_HEADER value against the request's head; returns the body hash it
        signed (`body_matches` checks the body once read). Raises NodeAuthError."""
        m = _NODE_AUTH.fullmatch(value.strip())
        if m is None:
            raise NodeAuthError("its signature header is malformed")
        ts, nonce, digest, sig = m.groups()
        now = self.clock()
        off = now - int(ts)
        if abs(off) > self.window_s:
            raise NodeAuthError(f"it was signed {abs(off):.0f} s {'ago' if off > 0 else 'ahead'}"
                                f" by the sender's clock, outside the {self.window_s:g} s window "
                                "(keep the nodes' clocks in sync)")
        if not hmac.compare_digest(self._mac(method, target, host, ts, nonce, digest), sig):
            raise NodeAuthError("its signature does not match (another cluster secret, or the "
                                "request was changed on the way)")
        self._forget(now)
        if nonce in self._seen:
            raise NodeAuthError("it was already received once (a replay)")
        if len(self._seen) >= self.max_nonces:
            raise NodeAuthError("this node holds too many recent signed requests; retry")
        self._seen[nonce] = int(ts) + self.window_s
        return digest

    def _forget(self, now: float) -> None:
        """Drop the nonces whose requests are out of the window anyway (oldest first; the
        window is short next to any clock step, so the order is nearly by expiry)."""
        while self._seen:
            nonce, expires = next(iter(self._seen.items()))
            if expires >= now:
                break
            del self._seen[nonce]

    @staticmethod
    def body_matches(digest: str, body: bytes) -> bool:
        return hmac.compare_digest(_body_hash(body), digest)


def _unauthorized(message: str, code: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", None, code, UNAUTHORIZED_HEADERS)


@dataclass(frozen=True)
class AuthPolicy:
    """What the server asks of each request (`check_head`, then `check_body` for a signed one).
    `keys`: the API keys (none: every route open); `node`: the cluster's node signatures (None
    on a node without a secret); `open_reads`: READ routes without a key."""
    keys: ApiKeys = field(default_factory=ApiKeys)
    node: NodeAuth | None = None
    open_reads: bool = False

    def check_head(self, method: str, target: str, headers: Headers, access: Access
                   ) -> str | None:
        """None when the request may go on; the body hash it must have when it is signed by
        a node (`check_body`); raises a 401 ApiError when it is refused."""
        if access == OPEN:
            return None
        signed = headers.get(NODE_AUTH_HEADER)
        forwarded = headers.get(FORWARDED_HEADER) is not None
        if self.node is not None and (signed is not None or forwarded):
            # A request that says it comes from a node of this cluster must prove it, whatever
            # else it carries: a relayed request is served as it is, never forwarded again.
            if signed is None:
                raise _unauthorized("a request marked as forwarded by a node of this cluster "
                                    "must carry that node's signature", "invalid_node_auth")
            host = headers.get("host") or ""
            try:
                return self.node.verify(method, target, host, signed)
            except NodeAuthError as e:
                raise _unauthorized(f"the node signature of this request does not hold: {e}",
                                    "invalid_node_auth") from None
        if not len(self.keys) or (access == READ and self.open_reads):
            return None
        presented = presented_keys(headers)
        if any([self.keys.matches(k) for k in presented]):  # (every key tried: no early exit)
            return None
        if presented:
            raise _unauthorized("the API key sent is not one this node accepts",
                                "invalid_api_key")
        why = ("this node asks for an API key: send it as 'Authorization: Bearer KEY' (the "
               "openai client's api_key) or 'x-api-key: KEY' (the anthropic client's)")
        if forwarded:
            why += ("; requests forwarded between nodes are signed with the cluster secret, "
                    "and this node has none (set --secret or SKULKP2P_SECRET on every node)")
        raise _unauthorized(why, "missing_api_key")

    def check_body(self, digest: str, body: bytes) -> None:
        """A signed request's body, once read, against the hash its signature covers."""
        if not NodeAuth.body_matches(digest, body):
            raise _unauthorized("the node signature of this request does not hold: its body "
                                "is not the one signed", "invalid_node_auth")
