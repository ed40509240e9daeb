"""Wire protocol: length-prefixed, HMAC-signed msgpack frames (sans-I/O).

A frame on the wire::

    +----------------+----------------------+--------------------------------------+
    | length: u32 BE | tag: 32 bytes        | body: msgpack map {"t": str, "v": int, ...} |
    +----------------+----------------------+--------------------------------------+

``length`` counts the tag and the body. ``tag`` is HMAC-SHA256 over the length prefix and the
body, keyed with the cluster secret, so a stranger can neither join nor inject, and a frame cut or
spliced anywhere fails the check. The tag is checked before the body is parsed: bytes from
someone without the secret never reach the msgpack decoder.

Without a secret every node uses the same public key (:data:`NO_SECRET_KEY`); frames are then
only protected against corruption, which is why a node without a secret binds loopback only.

Everything that can go wrong with received bytes raises :class:`WireError` (with a short
``reason`` that the node counts): the caller closes that connection and carries on. Nothing here
does I/O: :class:`FrameDecoder` is fed bytes and hands back messages, like h11.

Arrays travel as a map of raw bytes beside ``dtype`` and ``shape`` (:func:`pack_array`), bfloat16
included (as its 16-bit pattern); never pickle.

**The handshake.** A connection to a node's listener proves the secret before the node holds more
than a few KiB for it. The listener speaks first: a fixed :data:`HELLO` (magic, protocol version, a
fresh random nonce). The connector answers with one ``auth`` frame signed with the cluster key
(at most :data:`HANDSHAKE_MAX_FRAME`, checked from its header) that holds the listener's nonce and
one of its own; a frame captured from another connection names another nonce and is refused.
Every later frame is signed with that connection's own key for its direction
(:func:`session_keys`, an HMAC of both nonces) and its tag also covers its sequence number on the
connection (counted by both sides, not sent): a frame replayed, reordered or dropped by someone on
the path fails the check. :class:`Accepting` and :class:`Connecting` are the two sides, sans-I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeAlias, overload

import msgpack

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

PROTOCOL_VERSION = 2  # 2: the handshake, per-connection keys and sequence numbers
TAG_BYTES = 32
HEADER = struct.Struct(">I")
SEQ = struct.Struct(">Q")  # a frame's sequence number on its connection, under its tag
# Hard caps on one frame (tag + body): control traffic is small; data frames carry hidden-state
# rows of a verify round (k+1 rows x hidden x 4 bytes is far below this for any model we serve).
CONTROL_MAX_FRAME = 1 << 20
DATA_MAX_FRAME = 64 << 20
# Public key for clusters without a secret (loopback only): integrity, not authenticity.
NO_SECRET_KEY = b"skulkp2p/no-secret/v1"
# The handshake: the listener's hello (magic, version, nonce), and the cap on the connector's
# auth frame, the only frame a listener reads before the connection has proved the secret.
NONCE_BYTES = 16
HELLO_MAGIC = b"skp2"
HELLO = struct.Struct(f">4sB{NONCE_BYTES}s")
HANDSHAKE_MAX_FRAME = 4 << 10

# dtype name -> (numpy dtype name used to hold the bytes, item size)
ARRAY_DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("float32", 4), "float16": ("float16", 2), "bfloat16": ("uint16", 2),
    "float64": ("float64", 8), "int8": ("int8", 1), "int16": ("int16", 2),
    "int32": ("int32", 4), "int64": ("int64", 8), "uint8": ("uint8", 1),
    "uint16": ("uint16", 2), "uint32": ("uint32", 4), "uint64": ("uint64", 8),
    "bool": ("bool", 1),
}
MAX_ARRAY_DIMS = 8

# What msgpack carries: a message is a map of these (nested maps have string keys, as
# decode_body's strict_map_key enforces).
WireValue: TypeAlias = (None | bool | int | float | str | bytes | list["WireValue"]
                        | dict[str, "WireValue"])
Message: TypeAlias = dict[str, WireValue]


def as_int(value: WireValue) -> int:
    """``int(value)`` of a number (or numeric string) off the wire; TypeError for a list, a map
    or None, as ``int()`` raises."""
    if isinstance(value, list | dict) or value is None:
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return int(value)


def as_list(value: WireValue) -> list[WireValue]:
    """A list off the wire; anything else (absent, or malformed) as an empty one."""
    return value if isinstance(value, list) else []


class WireError(Exception):
    """Bytes that are not a valid frame of this cluster; close the connection that sent them.

    ``reason`` is one of: oversize, unsigned, bad-signature, undecodable, not-a-map, no-type,
    version, array, handshake.
    """

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def frame_key(secret: str | bytes | None) -> bytes:
    """The HMAC key for a cluster secret (None or empty: the public no-secret key)."""
    if not secret:
        return NO_SECRET_KEY
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _tag(key: bytes, header: bytes, body: bytes, seq: int | None = None) -> bytes:
    mac = hmac.new(key, SEQ.pack(seq) if seq is not None else b"", hashlib.sha256)
    mac.update(header)
    mac.update(body)
    return mac.digest()


def pack_body(msg: Mapping[str, WireValue], max_frame: int = CONTROL_MAX_FRAME) -> bytes:
    """The msgpack body of a frame for ``msg`` (a map with a ``t`` type; ``v`` is set here),
    to be signed later (:meth:`FrameEncoder.sign`): packing a large message may run on another
    thread than the one that signs and sends it.

    Raises WireError("oversize") if the frame would exceed ``max_frame`` (the receiver would
    drop the connection anyway), and ValueError if ``msg`` has no string ``t``.
    """
    if not isinstance(msg.get("t"), str):
        raise ValueError("a frame needs a string 't' (its type)")
    body = msgpack.packb({**msg, "v": PROTOCOL_VERSION}, use_bin_type=True)
    if TAG_BYTES + len(body) > max_frame:
        raise WireError("oversize", f"frame of {TAG_BYTES + len(body)} bytes > cap {max_frame}")
    return body


def _frame(body: bytes, key: bytes, max_frame: int, seq: int | None) -> bytes:
    length = TAG_BYTES + len(body)
    if length > max_frame:
        raise WireError("oversize", f"frame of {length} bytes > cap {max_frame}")
    header = HEADER.pack(length)
    return header + _tag(key, header, body, seq) + body


def encode_frame(msg: Mapping[str, WireValue], key: bytes,
                 max_frame: int = CONTROL_MAX_FRAME) -> bytes:
    """One frame for ``msg`` (a map with a ``t`` type; ``v`` is set here), signed with ``key``
    and no sequence number (the handshake's auth frame, and pipes between local processes).

    Raises WireError("oversize") if the frame would exceed ``max_frame`` (the receiver would
    drop the connection anyway), and ValueError if ``msg`` has no string ``t``.
    """
    return _frame(pack_body(msg, max_frame), key, max_frame, None)


class FrameEncoder:
    """The frames of one direction of an authenticated connection: signed with that direction's
    key (:func:`session_keys`), each tag covering the frame's sequence number (0, 1, ...). Frames
    must go on the wire in the order they were signed."""

    def __init__(self, key: bytes, max_frame: int = CONTROL_MAX_FRAME):
        self.key = key
        self.max_frame = max_frame
        self.seq = 0

    def sign(self, body: bytes) -> bytes:
        """The frame of a body from :func:`pack_body` (WireError("oversize") over the cap)."""
        frame = _frame(body, self.key, self.max_frame, self.seq)
        self.seq += 1
        return frame

    def encode(self, msg: Mapping[str, WireValue]) -> bytes:
        return self.sign(pack_body(msg, self.max_frame))


def _no_ext(code: int, data: bytes) -> NoReturn:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def decode_body(header: bytes, payload: bytes, key: bytes, seq: int | None = None) -> Message:
    """Check the tag of one frame's payload (tag + body) and parse the body."""
    if len(payload) < TAG_BYTES + 1:
        raise WireError("unsigned", f"frame of {len(payload)} bytes has no room for a tag")
    tag, body = payload[:TAG_BYTES], payload[TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, header, body, seq)):
        raise WireError("bad-signature", "tag does not match this cluster's secret"
                        if seq is None else "tag does not match this connection's key and "
                        "sequence (another secret, or a frame replayed or reordered)")
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise WireError("undecodable", f"{type(e).__name__}: {e}") from None
    if not isinstance(msg, dict):
        raise WireError("not-a-map", f"body is a {type(msg).__name__}")
    if not isinstance(msg.get("t"), str):
        raise WireError("no-type", "body has no string 't'")
    if msg.get("v") != PROTOCOL_VERSION:
        raise WireError("version", f"protocol version {msg.get('v')!r}, "
                                   f"this node speaks {PROTOCOL_VERSION}")
    return msg


class FrameDecoder:
    """Turns a byte stream into messages. Feed it what the socket gave; it returns the whole
    frames it now holds. After a WireError the stream is unusable (framing is lost): close it.

    ``rekey`` switches it, between two frames, to an authenticated connection's key for this
    direction, with sequence numbers, and raises its cap (:class:`Accepting`).
    """

    def __init__(self, key: bytes, max_frame: int = CONTROL_MAX_FRAME):
        self.key = key
        self.max_frame = max_frame
        self.seq: int | None = None  # the next frame's sequence number (None: unsequenced)
        self._buf = bytearray()
        self._need: int | None = None  # payload length of the frame being read
        self._failed: WireError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def inside_frame(self) -> bool:
        """Whether it holds part of a frame (a header, or some of the bytes after one)."""
        return bool(self._buf) or self._need is not None

    def rekey(self, key: bytes, max_frame: int) -> None:
        """Frames from now on (including any already buffered) are signed with ``key`` and
        numbered from 0, and may be up to ``max_frame``."""
        self.key, self.max_frame, self.seq = key, max_frame, 0

    def feed(self, data: bytes, limit: int | None = None) -> list[Message]:
        """The whole frames held once ``data`` is added; at most ``limit`` of them (the rest
        stay buffered for the next call: ``feed(b"")`` returns them)."""
        if self._failed is not None:
            raise self._failed
        self._buf += data
        out: list[Message] = []
        try:
            while limit is None or len(out) < limit:
                if self._need is None:
                    if len(self._buf) < HEADER.size:
                        break
                    (length,) = HEADER.unpack_from(self._buf)
                    # Refuse before buffering: a peer must not make us hold 4 GiB.
                    if length > self.max_frame:
                        raise WireError("oversize", f"frame of {length} bytes > cap "
                                                    f"{self.max_frame}")
                    self._need = length
                if len(self._buf) < HEADER.size + self._need:
                    break
                end = HEADER.size + self._need
                header = bytes(self._buf[:HEADER.size])
                payload = bytes(self._buf[HEADER.size:end])
                del self._buf[:end]
                self._need = None
                out.append(decode_body(header, payload, self.key, self.seq))
                if self.seq is not None:
                    self.seq += 1
        except WireError as e:
            self._failed = e
            self._buf.clear()
            raise
        return out

    def eof_error(self) -> WireError | None:
        """At end of stream: a WireError if it stopped inside a frame, else None."""
        if self._failed is None and self.inside_frame:
            return WireError("undecodable", f"stream ended inside a frame ({len(self._buf)} "
                                            "bytes buffered)")
        return None


# --------------------------------------------------------------------------------------------
# The handshake


def session_keys(key: bytes, listener_nonce: bytes, connector_nonce: bytes
                 ) -> tuple[bytes, bytes]:
    """(the key of frames to the listener, the key of frames from it) on one connection."""
    nonces = listener_nonce + connector_nonce
    return (hmac.new(key, b"skulkp2p/to-listener/" + nonces, hashlib.sha256).digest(),
            hmac.new(key, b"skulkp2p/from-listener/" + nonces, hashlib.sha256).digest())


def _nonce(value: WireValue) -> bytes:
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise WireError("handshake", "the auth frame's nonces are not "
                                     f"{NONCE_BYTES} bytes each")
    return value


class Accepting:
    """The listener's side of one connection: send :attr:`hello`, feed what comes back. The
    first frame must be the connector's ``auth`` frame, at most HANDSHAKE_MAX_FRAME and signed
    with the cluster key; once it is (``feed`` returns True), :attr:`decoder` reads the rest
    under the connection's key (frames it already holds included: ``decoder.feed(b"")``) and
    :attr:`encoder` signs what goes back. Raises WireError for anything else."""

    def __init__(self, key: bytes, max_in: int = CONTROL_MAX_FRAME,
                 max_out: int = CONTROL_MAX_FRAME):
        self.key = key
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.hello = HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, self.nonce)
        self.decoder = FrameDecoder(key, HANDSHAKE_MAX_FRAME)
        self.encoder: FrameEncoder | None = None  # set once authenticated
        self._max_in, self._max_out = max_in, max_out

    @property
    def authenticated(self) -> bool:
        return self.encoder is not None

    def feed(self, data: bytes) -> bool:
        if self.encoder is not None:
            raise RuntimeError("already authenticated: feed the decoder")
        got = self.decoder.feed(data, limit=1)
        if not got:
            return False
        msg = got[0]
        if msg["t"] != "auth":
            raise WireError("handshake", f"expected an auth frame first, got {msg['t']!r}")
        if _nonce(msg.get("listener")) != self.nonce:
            raise WireError("handshake", "the auth frame names another connection's nonce "
                                         "(a replayed frame)")
        to_me, to_them = session_keys(self.key, self.nonce, _nonce(msg.get("connector")))
        self.decoder.rekey(to_me, self._max_in)
        self.encoder = FrameEncoder(to_them, self._max_out)
        return True


class Connecting:
    """The connector's side: :meth:`answer` the listener's hello (HELLO.size bytes) with the
    bytes to send back; then :attr:`encoder` signs frames to the listener and :attr:`decoder`
    reads its answers."""

    def __init__(self, key: bytes, max_out: int = CONTROL_MAX_FRAME,
                 max_in: int = CONTROL_MAX_FRAME):
        self.key = key
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._max_out, self._max_in = max_out, max_in
        self.encoder: FrameEncoder | None = None
        self.decoder: FrameDecoder | None = None

    def answer(self, hello: bytes) -> bytes:
        if len(hello) != HELLO.size:
            raise WireError("handshake", f"a hello of {len(hello)} bytes, not {HELLO.size}")
        magic, version, listener = HELLO.unpack(hello)
        if magic != HELLO_MAGIC:
            raise WireError("handshake", "the listener is not a skulkp2p node")
        if version != PROTOCOL_VERSION:
            raise WireError("version", f"the listener speaks protocol version {version}, this "
                                       f"node {PROTOCOL_VERSION}")
        auth = encode_frame({"t": "auth", "listener": listener, "connector": self.nonce},
                            self.key, HANDSHAKE_MAX_FRAME)
        to_them, to_me = session_keys(self.key, listener, self.nonce)
        self.encoder = FrameEncoder(to_them, self._max_out)
        self.decoder = FrameDecoder(self.key)
        self.decoder.rekey(to_me, self._max_in)
        return auth


# --------------------------------------------------------------------------------------------
# Arrays


def pack_array(arr: Any) -> dict[str, Any]:
    """A numpy or mlx array as {"dtype", "shape", "data"} with its raw C-order bytes."""
    import numpy as np

    dtype_name = _dtype_name(arr)
    if dtype_name == "bfloat16":
        arr = _mlx_bits(arr)  # numpy has no bfloat16: carry the 16-bit patterns
    elif type(arr).__module__.startswith("mlx"):
        arr = np.asarray(arr)
    arr = np.ascontiguousarray(arr)
    if dtype_name not in ARRAY_DTYPES:
        raise ValueError(f"arrays of dtype {dtype_name} cannot travel")
    return {"dtype": dtype_name, "shape": list(arr.shape), "data": arr.tobytes()}


def _dtype_name(arr: Any) -> str:
    name = str(arr.dtype)
    return name.rsplit(".", 1)[-1]  # "mlx.core.bfloat16" -> "bfloat16"


def _mlx_bits(arr: Any) -> Any:
    import numpy as np

    if type(arr).__module__.startswith("mlx"):
        import mlx.core as mx

        return np.asarray(arr.view(mx.uint16))
    return np.asarray(arr).view(np.uint16)  # e.g. ml_dtypes.bfloat16


@overload
def unpack_array(obj: object, as_mlx: Literal[False] = False) -> np.ndarray: ...
@overload
def unpack_array(obj: object, as_mlx: Literal[True]) -> mx.array: ...
@overload
def unpack_array(obj: object, as_mlx: bool) -> np.ndarray | mx.array: ...


def unpack_array(obj: object, as_mlx: bool = False) -> np.ndarray | mx.array:
    """The array of a :func:`pack_array` map: numpy (bfloat16 as its uint16 bit patterns, since
    numpy has no bfloat16) or, with ``as_mlx``, an mlx array of the real dtype. A malformed map
    raises WireError("array")."""
    import numpy as np

    if not isinstance(obj, dict):
        raise WireError("array", "not a map")
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if dtype not in ARRAY_DTYPES:
        raise WireError("array", f"unknown dtype {dtype!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_ARRAY_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                       for d in shape)):
        raise WireError("array", f"bad shape {shape!r}")
    if not isinstance(data, bytes):
        raise WireError("array", "data is not bytes")
    holder, itemsize = ARRAY_DTYPES[dtype]
    if math.prod(shape) * itemsize != len(data):
        raise WireError("array", f"{len(data)} bytes do not make a {dtype} array of shape "
                                 f"{shape}")
    out = np.frombuffer(data, dtype=holder).reshape(shape)
    if not as_mlx:
        return out
    import mlx.core as mx

    arr = mx.array(out)
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr
