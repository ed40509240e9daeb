"""What every ring frame carries (engine/ring.py, engine/ring_batch.py): its header, the error a
traversal ends with, and the stages' compute times. No MLX here: the node's control plane imports
it through ring.py."""

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
