"""What every ring frame carries (engine/parallel/ring/traversal.py, engine/parallel/ring/batch_rows.py): its header, the error a
traversal ends with, the stages' compute times, and the wrapping of a token tree's payload. No MLX
here: the node's control plane imports it through ring.py.

A tree verify (engine/model/tree.py) wraps its payload as {"tree": parents, "x": tokens or rows}
(`tree_payload`). A chain frame is unchanged, so frames of senders older than trees still decode;
a stage older than trees cannot read the wrapped payload (its first stage wants a token list, the
others a packed array) and drops the frame, so the sender's traversal ends with a RingError
instead of a stage running a tree as a causal chain (wrong rows, silently)."""

from __future__ import annotations

from typing import Any

from skulkp2p import wire

FRAME = "ring"


class RingError(RuntimeError):
    """The ring could not complete a traversal (a stage died, froze, or dropped the frame)."""


def header(term: int, instance: str, request: str, step: int, op: str) -> dict[str, Any]:
    return {"t": FRAME, "v": wire.PROTOCOL_VERSION, "term": term, "instance": instance,
            "request": request, "step": step, "op": op}


def check_answer(out: dict[str, Any], step: int, request: str, start: int) -> None:
    """The answer closing a traversal is for this step of this request (or batch) and ends at
    the layer this stage starts at; else RingError (a stale answer, or a ring re-placed)."""
    if out.get("step") != step or out.get("request") != request:
        raise RingError(f"ring answered step {out.get('step')} of {out.get('request')}, "
                        f"expected step {step} of {request}")
    if out.get("at", start) != start:
        raise RingError(f"the ring's stages end at layer {out.get('at')}, this stage starts "
                        f"at {start}: it was re-placed; retry")


def seconds_list(value: Any) -> list[float]:
    """A frame's "cs" (each stage's compute seconds so far), sanitised."""
    if not isinstance(value, list):
        return []
    return [float(v) for v in value if isinstance(v, int | float)][:64]


def tree_payload(x: Any, parents: Any) -> dict[str, Any]:
    """A tree verify's payload: the tokens (first stage) or packed rows, with the tree's parents
    (per row, on a batch frame: None for a row that is a chain)."""
    return {"tree": parents, "x": x}


def open_payload(x: Any) -> tuple[Any, Any]:
    """(tokens or packed rows, the tree's parents or None for a chain frame)."""
    if isinstance(x, dict) and "tree" in x:
        if "x" not in x:
            raise ValueError("a tree payload without its tokens or rows")
        return x["x"], x["tree"]
    return x, None


def int_list(value: Any, what: str) -> list[int]:
    """A frame's list of ints (a tree's parents, a kept path), checked."""
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{what} must be a list of ints")
    return [int(v) for v in value]
