"""What this node tells the cluster about itself: the engines it can run, the models it has on
disk, the dtype it runs them in, and the model it asks to have placed (its --model)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from skulkp2p.cluster.facts import model_spec
from skulkp2p.wire import Message

if TYPE_CHECKING:
    from skulkp2p.models.store import ModelStore
    from skulkp2p.node.engines import EngineChoice


def own_want(store: ModelStore, model: str, node_name: str,
             choice: EngineChoice | None = None) -> Message:
    """What this node asks the cluster to place: its --model. A model from a local folder or
    file can only be placed on nodes that have it (those that ask for it). `choice`: the form
    this node chose (node/engines.py, choose_engine): its GGUF form keeps the model's id (what
    clients ask for) with the GGUF card's engine, size and slots, so placement counts the memory
    llama-server takes."""
    resolved = store.resolve(model, fetch=True)
    spec = model_spec(store, model)
    if choice is not None:
        if choice.load != model:
            form = model_spec(store, choice.load)
            spec = dataclasses.replace(form, id=spec.id)
        spec = dataclasses.replace(spec, engine_reason=choice.reason)
    want = spec.to_dict()
    if resolved.card is None or resolved.card.source.kind == "local":
        want["only"] = [node_name]
    return want


def detect_engines() -> list[str]:
    """Engines this node can run, without importing them (mlx import is slow)."""
    engines = []
    if importlib.util.find_spec("mlx") is not None:
        if sys.platform == "darwin":
            engines.append("mlx-metal")
        elif importlib.util.find_spec("mlx_cuda") is not None or \
                os.environ.get("SKULKP2P_DEVICE", "").lower() == "cuda":
            engines.append("mlx-cuda")
        else:
            engines.append("mlx-cpu")
    from skulkp2p.served.binary import engines as served_engines
    engines.extend(served_engines())  # llama_server, llama_server-<cuda|rocm|vulkan|cpu>
    return engines


def node_facts(store: ModelStore) -> Message:
    """Facts for the cluster beyond memory: engines, models on disk, the dtype we run."""
    facts: Message = {"engines": list(detect_engines())}
    try:
        facts["models"] = [row["id"] for row in store.list() if row["pulled"]]
    except Exception:  # a broken card must not keep the node out of the cluster
        facts["models"] = []
    try:
        from skulkp2p.engine.cpu import blas

        facts["dtype"] = blas.fast_path_report()["dtype"]
    except Exception:
        facts["dtype"] = "bfloat16"
    return facts
