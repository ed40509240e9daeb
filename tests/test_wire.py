"""Wire protocol: framing, signatures, caps, arrays, and fuzzing (only WireError may escape)."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from skulkp2p import wire
from skulkp2p.wire import FrameDecoder, WireError, encode_frame, frame_key

KEY = frame_key("s3cret")


def test_round_trip_in_any_chunking():
    msgs = [{"t": "ping", "seq": i, "from": "a", "blob": bytes(range(i % 256)) * 3}
            for i in range(50)]
    stream = b"".join(encode_frame(m, KEY) for m in msgs)
    rng = random.Random(0)
    for _ in range(20):
        dec, got, pos = FrameDecoder(KEY), [], 0
        while pos < len(stream):
            n = rng.randint(1, 300)
            got += dec.feed(stream[pos:pos + n])
            pos += n
        assert [g["seq"] for g in got] == list(range(50))
        assert all(g["v"] == wire.PROTOCOL_VERSION for g in got)
        assert dec.eof_error() is None


def test_wrong_secret_and_no_secret_are_refused():
    frame = encode_frame({"t": "ping"}, frame_key("other"))
    with pytest.raises(WireError) as e:
        FrameDecoder(KEY).feed(frame)
    assert e.value.reason == "bad-signature"
    with pytest.raises(WireError):
        FrameDecoder(KEY).feed(encode_frame({"t": "ping"}, frame_key(None)))
    # Two nodes without a secret understand each other (loopback-only clusters).
    assert FrameDecoder(frame_key(None)).feed(encode_frame({"t": "x"}, frame_key("")))


def test_unsigned_frame_is_refused():
    body = msgpack.packb({"t": "ping", "v": 1})
    with pytest.raises(WireError) as e:  # a bare msgpack body: too short to hold a tag
        FrameDecoder(KEY).feed(wire.HEADER.pack(len(body)) + body)
    assert e.value.reason == "unsigned"
    forged = wire.HEADER.pack(32 + len(body)) + b"\0" * 32 + body
    with pytest.raises(WireError) as e:
        FrameDecoder(KEY).feed(forged)
    assert e.value.reason == "bad-signature"


def test_tampered_frames_are_refused():
    frame = bytearray(encode_frame({"t": "lead", "term": 3}, KEY))
    for i in range(4, len(frame)):
        bad = bytearray(frame)
        bad[i] ^= 0x40
        with pytest.raises(WireError):
            FrameDecoder(KEY).feed(bytes(bad))


def test_oversize_refused_before_it_is_buffered():
    dec = FrameDecoder(KEY, max_frame=1000)
    with pytest.raises(WireError) as e:
        dec.feed(wire.HEADER.pack(1 << 30))  # only the header has arrived
    assert e.value.reason == "oversize"
    with pytest.raises(WireError):  # and the decoder stays failed
        dec.feed(b"")
    with pytest.raises(WireError):
        encode_frame({"t": "x", "pad": b"\0" * 2000}, KEY, max_frame=1000)
    assert wire.CONTROL_MAX_FRAME == 1 << 20 and wire.DATA_MAX_FRAME == 64 << 20
    big = encode_frame({"t": "x", "pad": b"\0" * (2 << 20)}, KEY, max_frame=wire.DATA_MAX_FRAME)
    with pytest.raises(WireError):
        FrameDecoder(KEY).feed(big)  # control cap by default
    assert FrameDecoder(KEY, max_frame=wire.DATA_MAX_FRAME).feed(big)[0]["t"] == "x"


@pytest.mark.parametrize("obj,reason", [
    ([1, 2], "not-a-map"), ({"v": 1}, "no-type"), ({"t": "x", "v": 99}, "version"),
    ({"t": 5, "v": 1}, "no-type"), ({1: 2, "t": "x", "v": 1}, "undecodable"),
])
def test_signed_but_invalid_bodies(obj, reason):
    body = msgpack.packb(obj)
    header = wire.HEADER.pack(32 + len(body))
    frame = header + wire._tag(KEY, header, body) + body
    with pytest.raises(WireError) as e:
        FrameDecoder(KEY).feed(frame)
    assert e.value.reason == reason


def _signed(body: bytes) -> bytes:
    header = wire.HEADER.pack(32 + len(body))
    return header + wire._tag(KEY, header, body) + body


def test_fuzz_random_truncated_and_signed_garbage_only_raise_wire_error():
    rng = random.Random(1234)
    good = encode_frame({"t": "sync", "members": [{"n": "a", "i": 1}] * 5}, KEY)
    seen = set()
    for i in range(4000):
        kind = i % 4
        if kind == 0:  # random bytes
            data = rng.randbytes(rng.randint(0, 200))
        elif kind == 1:  # a good frame cut short, or with junk after it
            data = good[:rng.randint(0, len(good))] + rng.randbytes(rng.randint(0, 40))
        elif kind == 2:  # valid signature over garbage: reaches the msgpack decoder
            data = _signed(rng.randbytes(rng.randint(1, 200)))
        else:  # valid signature over a mutated valid body
            body = bytearray(msgpack.packb({"t": "ping", "v": 1, "seq": i,
                                            "x": [1, 2, {"a": b"b"}]}))
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            data = _signed(bytes(body))
        dec = FrameDecoder(KEY, max_frame=4096)
        try:
            pos = 0
            while pos < len(data):
                step = rng.randint(1, 64)
                for msg in dec.feed(data[pos:pos + step]):
                    assert isinstance(msg, dict) and isinstance(msg["t"], str)
                pos += step
            err = dec.eof_error()
            if err is not None:
                seen.add(err.reason)
        except WireError as e:
            seen.add(e.reason)
    assert {"bad-signature", "undecodable"} <= seen


def test_deeply_nested_signed_body_is_a_wire_error():
    body = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    with pytest.raises(WireError):
        FrameDecoder(KEY, max_frame=1 << 20).feed(_signed(body))


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "uint8", "int64", "bool"])
def test_numpy_arrays_round_trip(dtype):
    a = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    frame = encode_frame({"t": "rows", "x": wire.pack_array(a)}, KEY, wire.DATA_MAX_FRAME)
    (msg,) = FrameDecoder(KEY, wire.DATA_MAX_FRAME).feed(frame)
    b = wire.unpack_array(msg["x"])
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_bfloat16_mlx_arrays_round_trip_bit_exact():
    mx = pytest.importorskip("mlx.core")
    a = mx.random.normal((3, 5)).astype(mx.bfloat16)
    packed = wire.pack_array(a)
    assert packed["dtype"] == "bfloat16" and len(packed["data"]) == 3 * 5 * 2
    (msg,) = FrameDecoder(KEY).feed(encode_frame({"t": "rows", "x": packed}, KEY))
    b = wire.unpack_array(msg["x"], as_mlx=True)
    assert b.dtype == mx.bfloat16 and b.shape == a.shape
    assert mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)).item()
    f = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    g = wire.unpack_array(wire.pack_array(f), as_mlx=True)
    assert g.dtype == mx.float32 and mx.array_equal(f, g).item()


@pytest.mark.parametrize("bad", [
    None, {"dtype": "object", "shape": [1], "data": b"x"},
    {"dtype": "float32", "shape": [2], "data": b"\0" * 7},
    {"dtype": "float32", "shape": [-1], "data": b""},
    {"dtype": "float32", "shape": [True], "data": b"\0" * 4},
    {"dtype": "float32", "shape": "2", "data": b"\0" * 8},
    {"dtype": "float32", "shape": [2], "data": "text"},
])
def test_malformed_arrays_are_wire_errors(bad):
    with pytest.raises(WireError) as e:
        wire.unpack_array(bad)
    assert e.value.reason == "array"


# --------------------------------------------------------------------------------------------
# The handshake (sans-I/O): the listener's nonce, the auth frame, per-connection keys and
# sequence numbers.


def _pair(key: bytes = KEY) -> tuple[wire.Accepting, wire.Connecting, bytes]:
    listener = wire.Accepting(KEY, max_in=wire.DATA_MAX_FRAME)
    connector = wire.Connecting(key, max_out=wire.DATA_MAX_FRAME)
    return listener, connector, connector.answer(listener.hello)


def test_handshake_then_frames_both_ways_in_any_chunking():
    listener, connector, auth = _pair()
    assert len(listener.hello) == wire.HELLO.size and len(auth) <= wire.HANDSHAKE_MAX_FRAME
    big = {"t": "rows", "blob": b"x" * (2 << 20)}  # past the handshake's cap, once allowed
    stream = auth + b"".join(connector.encoder.encode({"t": "m", "i": i}) for i in range(5)) \
        + connector.encoder.encode(big)
    got, done = [], False
    for pos in range(0, len(stream), 1000):
        chunk = stream[pos:pos + 1000]
        if not done:
            done = listener.feed(chunk)
            chunk = b""
        if done:
            got += listener.decoder.feed(chunk)
    assert [g.get("i") for g in got] == [0, 1, 2, 3, 4, None] and got[-1]["blob"] == big["blob"]
    reply = listener.encoder.encode({"t": "status-reply"})
    assert connector.decoder.feed(reply)[0]["t"] == "status-reply"


def test_a_frame_larger_than_the_handshake_cap_is_refused_from_its_header():
    listener = wire.Accepting(KEY, max_in=wire.DATA_MAX_FRAME)
    with pytest.raises(WireError) as e:
        listener.feed(wire.HEADER.pack(64 << 20))  # a 64 MiB frame declared, nothing else
    assert e.value.reason == "oversize" and listener.decoder.buffered == 0
    with pytest.raises(WireError) as e:  # a bit over the cap, body and all
        wire.Accepting(KEY).feed(encode_frame({"t": "auth", "pad": b"\0" * 5000}, KEY,
                                              wire.DATA_MAX_FRAME))
    assert e.value.reason == "oversize"


@pytest.mark.parametrize("case", ["wrong-secret", "not-auth", "no-nonce", "replayed-auth"])
def test_the_handshake_refuses(case):
    listener = wire.Accepting(KEY)
    if case == "wrong-secret":
        data = wire.Connecting(frame_key("other")).answer(listener.hello)
        reason = "bad-signature"
    elif case == "not-auth":  # a frame signed with the secret, but not the answer to the hello
        data = encode_frame({"t": "ping", "from": "x"}, KEY)
        reason = "handshake"
    elif case == "no-nonce":
        data = encode_frame({"t": "auth", "listener": b"short", "connector": b"\0" * 16}, KEY)
        reason = "handshake"
    else:  # the auth frame another connection sent (another listener nonce)
        _, _, data = _pair()
        reason = "handshake"
    with pytest.raises(WireError) as e:
        listener.feed(data)
    assert e.value.reason == reason and not listener.authenticated


def test_a_replayed_reordered_or_foreign_frame_is_refused_after_the_handshake():
    listener, connector, auth = _pair()
    frames = [connector.encoder.encode({"t": "lead", "term": i}) for i in range(3)]
    assert listener.feed(auth + frames[0])
    assert listener.decoder.feed(b"")[0]["term"] == 0
    with pytest.raises(WireError) as e:  # frame 0 again
        listener.decoder.feed(frames[0])
    assert e.value.reason == "bad-signature"
    listener, connector, auth = _pair()
    frames = [connector.encoder.encode({"t": "lead", "term": i}) for i in range(3)]
    assert listener.feed(auth)
    with pytest.raises(WireError):  # frame 1 before frame 0
        listener.decoder.feed(frames[1])
    # A frame of another connection (same secret, same sequence number) fails the check too.
    other, other_connector, other_auth = _pair()
    assert other.feed(other_auth)
    with pytest.raises(WireError):
        other.decoder.feed(frames[0])
    # ... and a frame signed with the cluster key alone (no connection key) as well.
    listener, connector, auth = _pair()
    assert listener.feed(auth)
    with pytest.raises(WireError):
        listener.decoder.feed(encode_frame({"t": "lead"}, KEY))
    # Each direction has its own key: the listener's frames cannot be reflected back to it.
    listener, connector, auth = _pair()
    assert listener.feed(auth)
    with pytest.raises(WireError):
        listener.decoder.feed(listener.encoder.encode({"t": "lead"}))


def test_a_hello_from_another_version_or_program_is_refused():
    listener = wire.Accepting(KEY)
    magic, _, nonce = wire.HELLO.unpack(listener.hello)
    with pytest.raises(WireError) as e:
        wire.Connecting(KEY).answer(wire.HELLO.pack(magic, wire.PROTOCOL_VERSION + 1, nonce))
    assert e.value.reason == "version"
    with pytest.raises(WireError) as e:
        wire.Connecting(KEY).answer(b"HTTP/1.1 400 Bad Req")  # not even the right size
    assert e.value.reason == "handshake"
    with pytest.raises(WireError) as e:
        wire.Connecting(KEY).answer(b"SSH-" + listener.hello[4:])
    assert e.value.reason == "handshake"
