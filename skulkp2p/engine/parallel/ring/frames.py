"""What every ring frame carries (engine/parallel/ring/traversal.py, engine/parallel/ring/batch_rows.py): its header, the error a
traversal ends with, the stages' compute times, and the wrapping of a token tree's payload. No MLX
here: the node's control plane imports it through ring.py.

A tree verify (engine/model/tree.py) wraps its payload as {"tree": parents, "x": tokens or rows}
(`tree_payload`). A chain frame is unchanged, so frames of senders older than trees still decode;
a stage older than trees cannot read the wrapped payload (its first stage wants a token list, the
others a packed array) and drops the frame, so the sender's traversal ends with a RingError
instead of a stage running a tree as a causal chain (wrong rows, silently)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from skulkp2p import wire

# On the engine's seam, where the worker tells a broken ring from a bug; named here too.
from skulkp2p.engine.protocol import RingError as RingError
from skulkp2p.wire import WireValue

FRAME = "ring"

# A frame: a message of wire.py (msgpack values by field name). Each field is checked where it
# is read; a frame with a bad one is dropped.
Frame = wire.Message


class RingLink(Protocol):
    """What carries frames round a ring (in process for tests: traversal.InProcessLink; TCP:
    cluster/ring_link.py)."""

    def traverse(self, msg: Frame) -> Frame:
        """Send `msg` to the first stage; return the frame that reaches the last stage. Raises
        RingError within a bounded time when a stage does not answer."""
        ...

    def send(self, msg: Frame) -> None:
        """Best effort, no answer awaited (the end of a request)."""
        ...


def header(term: int, instance: str, request: str, step: int, op: str) -> Frame:
    return {"t": FRAME, "v": wire.PROTOCOL_VERSION, "term": term, "instance": instance,
            "request": request, "step": step, "op": op}


def check_answer(out: Mapping[str, object], step: int, request: str, start: int) -> None:
    """The answer closing a traversal is for this step of this request (or batch) and ends at
    the layer this stage starts at; else RingError (a stale answer, or a ring re-placed)."""
    if out.get("step") != step or out.get("request") != request:
        raise RingError(f"ring answered step {out.get('step')} of {out.get('request')}, "
                        f"expected step {step} of {request}")
    if out.get("at", start) != start:
        raise RingError(f"the ring's stages end at layer {out.get('at')}, this stage starts "
                        f"at {start}: it was re-placed; retry")


def seconds_list(value: object) -> list[float]:
    """A frame's "cs" (each stage's compute seconds so far), sanitised."""
    if not isinstance(value, list):
        return []
    return [float(v) for v in value if isinstance(v, int | float)][:64]


def tree_payload(x: WireValue, parents: WireValue) -> Frame:
    """A tree verify's payload: the tokens (first stage) or packed rows, with the tree's parents
    (per row, on a batch frame: None for a row that is a chain)."""
    return {"tree": parents, "x": x}


def open_payload(x: WireValue) -> tuple[WireValue, WireValue]:
    """(tokens or packed rows, the tree's parents or None for a chain frame)."""
    if isinstance(x, dict) and "tree" in x:
        if "x" not in x:
            raise ValueError("a tree payload without its tokens or rows")
        return x["x"], x["tree"]
    return x, None


def int_list(value: object, what: str) -> list[int]:
    """A frame's list of ints (a tree's parents, a kept path), checked."""
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{what} must be a list of ints")
    return [int(v) for v in value]
