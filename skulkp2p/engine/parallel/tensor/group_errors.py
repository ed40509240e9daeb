"""The error a tensor-parallel group's call ends with (engine/parallel/tensor/group.py raises it). No MLX and no
processes here. TensorError itself is defined on the engine's seam (engine/protocol.py), as
RingError is: the worker tells a broken group by it (transient: the leader re-places the
model, the client retries) from a bug in the forward."""

from __future__ import annotations

# On the engine's seam, where the worker tells a broken group from a bug; named here too.
from skulkp2p.engine.protocol import TensorError as TensorError


class TensorAgreementError(TensorError):
    """The group's ranks disagree on what they serve (dtype, model files): forming it again
    does not help until a member changes (engine/parallel/tensor/link.py)."""
