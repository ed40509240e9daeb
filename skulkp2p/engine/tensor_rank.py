"""One member of a tensor-parallel group, as its own process: `python -m
skulkp2p.engine.tensor_rank --model PATH --rank R --size N --hostfile FILE [--dtype D]`.

Why a process per placement: an MLX process joins one `mx.distributed` group for its life, so a
re-placement (new members, a new term) needs new processes; and a collective blocked on a frozen
peer cannot be interrupted from inside, but its process can be killed. The node's control plane
starts these, watches them, and kills them (by pid) when the placement goes.

Every rank holds its share of every layer (tensor_shard.py) and no embedding or head. Rank 0
talks to the process that runs the decode loop over its stdin/stdout (wire frames, one per
call): rows in, the summed last hidden rows out. It passes each command to the other ranks with
the collective itself (an all-sum of a small header where the others add zeros, then of the
rows), so the group needs no channel besides `mx.distributed`. The other ranks only compute;
each writes one "ready" frame on its stdout and exits when its stdin closes or the group breaks.

Commands (rank 0's stdin): {"op": "run", "x": rows [w, H], "rollback": [keep, dropped] | None,
"reset": bool} -> {"op": "out", "h": rows [w, H], "cs": seconds}; {"op": "probe", "width": w,
"count": n} -> {"op": "probe", "s": seconds} (n all-sums of w rows alone: what the collectives
cost, for the bench's split of the time); {"op": "stop"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

from skulkp2p import wire

FRAME = "tp"
OP_RUN, OP_STOP, OP_PROBE = 1, 2, 3
HEADER_INTS = 4  # op, width, rollback dropped (a probe: its count), reset


def write_frame(out: BinaryIO, msg: dict[str, Any]) -> None:
    out.write(wire.encode_frame({"t": FRAME, **msg}, wire.frame_key(None), wire.DATA_MAX_FRAME))
    out.flush()


def read_frame(inp: BinaryIO, decoder: wire.FrameDecoder) -> dict[str, Any] | None:
    """The next frame from a blocking stream, or None at its end."""
    while True:
        got = decoder.feed(b"")
        if got:
            return got[0]
        data = inp.read1(1 << 20) if hasattr(inp, "read1") else inp.read(1 << 20)
        if not data:
            return None
        frames = decoder.feed(data)
        if frames:
            # One command at a time: the sender waits for each answer before the next.
            return frames[0]


def load_rank_model(path: Path, rank: int, size: int, group: Any, dtype: str) -> Any:
    """The model cut to this rank's share of every layer, without embedding, norm or head."""
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_load_model

    from skulkp2p.engine.model import DTYPES, _trunk_classes
    from skulkp2p.engine.stage import _NoEmbedding
    from skulkp2p.engine.tensor_shard import layer_plan, shard_layers
    from skulkp2p.engine.trunk import Trunk, _Identity

    model, _config = mlx_load_model(Path(path), lazy=True, get_model_classes=_trunk_classes)
    plan = layer_plan(model, rank, size)
    trunk = Trunk(model)
    trunk.body.embed_tokens = _NoEmbedding()
    trunk.body.norm = _Identity()  # the decode loop's member applies the final norm and head
    if hasattr(trunk.text, "lm_head"):
        trunk.text.lm_head = _Identity()
    model.set_dtype(DTYPES[dtype])
    shard_layers(model, plan, group)
    mx.eval(model.parameters())
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensor_rank")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--hostfile", required=True)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    os.environ["MLX_RANK"] = str(args.rank)
    os.environ["MLX_HOSTFILE"] = args.hostfile
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from skulkp2p.engine.caches import trim
    from skulkp2p.engine.stage import param_bytes
    from skulkp2p.engine.trunk import Trunk

    try:
        group = mx.distributed.init(backend="ring", strict=True)
        if group.size() != args.size or group.rank() != args.rank:
            raise RuntimeError(f"group formed as rank {group.rank()} of {group.size()}, "
                               f"expected {args.rank} of {args.size}")
        model = load_rank_model(Path(args.model), args.rank, args.size, group, args.dtype)
        # Everyone loaded: one collective before saying so.
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=group))
    except Exception as e:  # the parent reads this one line
        write_frame(out, {"op": "error", "error": f"{type(e).__name__}: {e}"})
        return 1
    body = Trunk(model).body
    hidden = int(model.args.hidden_size) if hasattr(model, "args") else 0
    dtype = next(iter(v for _, v in _flat(model.parameters()))).dtype
    mx.clear_cache()
    # param_bytes: what the shards add up to; active_bytes: what MLX really keeps (a slice
    # that still pinned its whole tensor would show here).
    write_frame(out, {"op": "ready", "rank": args.rank, "param_bytes": param_bytes(model),
                      "active_bytes": mx.get_active_memory(), "pid": os.getpid()})
    cache = make_prompt_cache(model)
    decoder = wire.FrameDecoder(wire.frame_key(None), wire.DATA_MAX_FRAME)
    inp = sys.stdin.buffer
    while True:
        header = mx.zeros((HEADER_INTS,), dtype=mx.int32)
        msg: dict[str, Any] | None = None
        if args.rank == 0:
            msg = read_frame(inp, decoder)
            if msg is None or msg.get("op") == "stop":
                header = mx.array([OP_STOP, 0, 0, 0], dtype=mx.int32)
            elif msg.get("op") == "probe":
                header = mx.array([OP_PROBE, int(msg["width"]), int(msg["count"]), 0],
                                  dtype=mx.int32)
            else:
                rb = msg.get("rollback") or [0, 0]
                x_in = wire.unpack_array(msg["x"], as_mlx=True).astype(dtype)
                header = mx.array([OP_RUN, x_in.shape[0], int(rb[1]), int(bool(msg.get("reset")))],
                                  dtype=mx.int32)
        op, width, dropped, reset = (int(v) for v in
                                     mx.distributed.all_sum(header, group=group).tolist())
        if op == OP_STOP:
            return 0
        t0 = time.perf_counter()
        if op == OP_PROBE:
            probe = mx.zeros((width, hidden), dtype=dtype)
            for _ in range(dropped):
                mx.eval(mx.distributed.all_sum(probe, group=group))
            if args.rank == 0:
                write_frame(out, {"op": "probe", "s": round(time.perf_counter() - t0, 6)})
            continue
        if reset:
            cache = make_prompt_cache(model)
        elif dropped:
            trim(cache, dropped)
        x = x_in if args.rank == 0 else mx.zeros((width, hidden), dtype=dtype)
        x = mx.distributed.all_sum(x, group=group)  # rank 0's rows, to everyone
        h = body(None, cache, input_embeddings=x[None])[0]
        mx.eval(h)
        if args.rank == 0:
            write_frame(out, {"op": "out", "h": wire.pack_array(h),
                              "cs": round(time.perf_counter() - t0, 6)})


def _flat(tree: Any):
    from mlx.utils import tree_flatten
    return tree_flatten(tree)


def write_hostfile(path: Path, addrs: list[str]) -> None:
    """The ring backend's host file: one list of addresses per rank."""
    path.write_text(json.dumps([[a] for a in addrs]))


if __name__ == "__main__":
    sys.exit(main())
