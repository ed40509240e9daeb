"""The error a tensor-parallel group's call ends with (engine/parallel/tensor/group.py raises it). No MLX and no
processes here: the API's worker imports it to tell a broken group (transient: the leader
re-places the model, the client retries) from a bug in the forward, as it does RingError
(engine/parallel/ring/frames.py)."""

from __future__ import annotations


class TensorError(RuntimeError):
    """The tensor-parallel group could not complete a call (a member died, froze, or the
    placement moved): the request ends with this message."""


class TensorAgreementError(TensorError):
    """The group's ranks disagree on what they serve (dtype, model files): forming it again
    does not help until a member changes (engine/parallel/tensor/link.py)."""
