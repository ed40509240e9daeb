"""One member of a tensor-parallel group, as its own process: `python -m
skulkp2p.engine.parallel.tensor.rank --model PATH --rank R --size N --hostfile FILE [--dtype D]`.

Why a process per placement: an MLX process joins one `mx.distributed` group for its life, so a
re-placement (new members, a new term) needs new processes; and a collective blocked on a frozen
peer cannot be interrupted from inside, but its process can be killed. The node's control plane
starts these, watches them, and kills them (by pid) when the placement goes.

Every rank holds its share of every layer and its rows of the output head (tensor_shard.py), and
no embedding. Rank 0 talks to the process that runs the decode loop over its stdin/stdout (wire
frames, one per call): rows in, the summed last hidden rows out, and with "logits" the whole
vocabulary's logits of every row (each rank computes its share; one all-gather). It passes
each command's header to the other ranks over the group's command link (tensor_link.py: a TCP
connection on which they block, where an all-sum would have them poll a core between calls),
then the rows with an all-sum.
Before any collective of model data the ranks check that they agree on the dtype and the model
files (tensor_link.agree). The other ranks only compute; each writes one "ready" frame on its
stdout and exits when rank 0 closes the link or the group breaks.

Commands (rank 0's stdin): {"op": "run", "x": rows [w, H], "rollback": [keep, dropped] | None,
"reset": bool, "logits": bool} -> {"op": "out", "h": rows [w, H] (before the final norm),
"logits": [w, V] | "logits_at": {"dtype", "shape"} (left in the shared memory of
`--logits-fd`, mapped by both processes) | absent, "cs": seconds}; {"op": "probe", "width": w,
"count": n} -> {"op": "probe", "s": seconds} (n all-sums of w rows alone: what the collectives
cost, for the bench's split of the time); {"op": "restore", "length": n, "key": [ids]} ->
{"op": "restored", "held": n | 0}; {"op": "store", "key": [ids], "rollback": [keep, dropped] |
None} -> {"op": "stored", "ok": bool, "bytes": the largest rank's entry}; {"op": "compute",
"width": w, "count": n} -> {"op": "compute", "s": seconds} (n forwards of w rows through this
rank's slice with no collective, after a 64-row prefill: a rank's own compute, for the bench's
split of the time; every rank runs it at once, as in a call); {"op": "stop"}.

The prefix cache (`--prefix-cache-mb`): every rank keeps its own slice of every entry in its own
`PrefixCache`, under the keys the loop's member names (it keeps the index and decides hits),
and on disk too with `--prefix-cache-disk-dir` (a folder per model, rank and group size: a group
formed again of as many ranks finds its slices; a store with STORE_MEMORY_ONLY writes none).
"restore" has every rank fetch the entry for `key` at exactly `length` positions; one all-sum
of the ranks' misses tells all of them whether anyone missed, and then every rank starts from
empty caches (the prompt is prefilled whole: never a wrong answer). "store" applies the
pending rollback and keeps the caches under `key` on every rank.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from skulkp2p import wire
from skulkp2p.wire import WireValue

if TYPE_CHECKING:  # mlx loads in main, after the CPU switch
    import mmap

    import mlx.core as mx
    import mlx.nn as nn

    from skulkp2p.engine.cache.caches import CacheEntry
    from skulkp2p.engine.cache.disk_store import PrefixDiskStore
    from skulkp2p.engine.cache.prefix_cache import PrefixCache
    from skulkp2p.engine.parallel.tensor.shard import HeadSlice

FRAME = "tp"
OP_RUN, OP_STOP, OP_PROBE, OP_RESTORE, OP_STORE, OP_COMPUTE, OP_STATS = 1, 2, 3, 4, 5, 6, 7
COMPUTE_PREFILL = 64
# A command's header (CommandLink): op, width (restore/store: the key's length), rollback
# dropped (a probe: its count; a restore: the positions to restore), flags (a run's)
RUN_RESET, RUN_LOGITS = 1, 2
STORE_MEMORY_ONLY = 1  # a store's flag: the request keeps its entries off the disk


def write_frame(out: BinaryIO, msg: wire.Message) -> None:
    out.write(wire.encode_frame({"t": FRAME, **msg}, wire.frame_key(None), wire.DATA_MAX_FRAME))
    out.flush()


def read_frame(inp: BinaryIO, decoder: wire.FrameDecoder) -> wire.Message | None:
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


def load_rank_model(path: Path, rank: int, size: int, group: mx.distributed.Group, dtype: str
                    ) -> tuple[nn.Module, HeadSlice]:
    """(the model cut to this rank's share of every layer, without embedding, norm or head;
    this rank's rows of the head with the final norm, a tensor_shard.HeadSlice)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_load_model

    from skulkp2p.engine.model.loaded import DTYPES, _trunk_classes
    from skulkp2p.engine.model.stage import _NoEmbedding
    from skulkp2p.engine.model.trunk import Trunk, _Identity
    from skulkp2p.engine.parallel.tensor.shard import head_slice, layer_plan, shard_layers

    model, _config = mlx_load_model(Path(path), lazy=True, get_model_classes=_trunk_classes)
    plan = layer_plan(model, rank, size)
    model.set_dtype(DTYPES[dtype])
    head = head_slice(model, rank, size)  # before the head goes; a copy of its rows
    mx.eval(head.weight, head.norm.parameters())
    trunk = Trunk(model)
    trunk.body.embed_tokens = _NoEmbedding()
    trunk.body.norm = _Identity()  # the rows go out before the norm; `head` applies it
    if hasattr(trunk.text, "lm_head"):
        trunk.text.lm_head = _Identity()
    shard_layers(model, plan, group)
    mx.eval(model.parameters())
    from skulkp2p.engine.cpu import switch
    switch.apply(model, dtype)  # the CPU switch's model pieces, as on one node
    return model, head


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensor_rank")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--hostfile", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-cache-mb", type=float, default=0.0)
    ap.add_argument("--prefix-cache-disk-dir", default="",
                    help="where this rank keeps its slices of the prefix cache's entries on "
                         "disk too (a folder per model, rank and group size); default: memory "
                         "only")
    ap.add_argument("--prefix-cache-disk-bytes", type=int, default=0)
    ap.add_argument("--model-id", default="", help="the model's id (its folder's name on disk)")
    ap.add_argument("--logits-fd", type=int, default=-1,
                    help="rank 0: an inherited descriptor of shared memory where each call's "
                         "logits are left for the process that runs the decode loop, instead "
                         "of the pipe")
    ap.add_argument("--command-addrs", default="",
                    help="ip:port per rank, comma-separated, for the command link (this rank's "
                         "own entry: where it listens; the others': where rank 0 dials); "
                         "default: ephemeral ports")
    args = ap.parse_args(argv)
    os.environ["MLX_RANK"] = str(args.rank)
    os.environ["MLX_HOSTFILE"] = args.hostfile
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    from skulkp2p.engine.cpu import switch

    # The CPU switch, before mlx loads; the BLAS is the parent's (its environment preloads it)
    switch.install(blas=False)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from skulkp2p.engine.cache.caches import trim
    from skulkp2p.engine.cache.prefix_cache import MB, PrefixCache
    from skulkp2p.engine.cpu.weight_first import verify_rows
    from skulkp2p.engine.model.arrays import leaves
    from skulkp2p.engine.model.stage import param_bytes
    from skulkp2p.engine.model.trunk import Trunk
    from skulkp2p.engine.parallel.tensor.link import (
        AgreementError,
        CommandLink,
        agree,
        hosts_of,
        model_digest,
    )

    try:
        digest = model_digest(Path(args.model))
        group = mx.distributed.init(backend="ring", strict=True)
        if group.size() != args.size or group.rank() != args.rank:
            raise RuntimeError(f"group formed as rank {group.rank()} of {group.size()}, "
                               f"expected {args.rank} of {args.size}")
        # Before any collective of model data: an all-sum of rows in two dtypes crashes.
        agree(group, args.rank, args.size, args.dtype, digest)
        model, head = load_rank_model(Path(args.model), args.rank, args.size, group, args.dtype)
        # Everyone loaded: one collective before saying so.
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=group))
        link = CommandLink.open(group, args.rank, args.size, hosts_of(Path(args.hostfile)),
                                args.command_addrs.split(",") if args.command_addrs else None)
    except AgreementError as e:  # not worth forming again: the node says why and waits
        write_frame(out, {"op": "error", "kind": "agreement", "error": str(e)})
        return 1
    except Exception as e:  # the parent reads this one line
        write_frame(out, {"op": "error", "error": f"{type(e).__name__}: {e}"})
        return 1
    body = Trunk(model).body
    hidden = int(model.args.hidden_size) if hasattr(model, "args") else 0
    dtype = leaves(model.parameters())[0].dtype
    mx.clear_cache()
    # param_bytes: what the shards add up to (the layers' and the head's rows); active_bytes:
    # what MLX really keeps (a slice that still pinned its whole tensor would show here).
    held = param_bytes(model) + head.weight.nbytes + param_bytes(head.norm)
    write_frame(out, {"op": "ready", "rank": args.rank, "param_bytes": held,
                      "active_bytes": mx.get_active_memory(), "pid": os.getpid()})
    shared = _map_logits(args.logits_fd) if args.rank == 0 else None
    cache = make_prompt_cache(model)
    prefix = PrefixCache(int(args.prefix_cache_mb * MB), _disk_store(args)) \
        if args.prefix_cache_mb > 0 else None
    if prefix is not None:
        atexit.register(prefix.close)  # a rank told to stop writes what it queued (SIGKILL: not)
    decoder = wire.FrameDecoder(wire.frame_key(None), wire.DATA_MAX_FRAME)
    inp = sys.stdin.buffer
    times = RankTimes()
    while True:
        times.idle_from()
        header: list[int] | None = None
        if args.rank == 0:
            # (its fields are read as they come: the process that runs the loop wrote it)
            msg: dict[str, Any] | None = read_frame(inp, decoder)
            if msg is None or msg.get("op") == "stop":
                header = [OP_STOP, 0, 0, 0]
            elif msg.get("op") == "probe":
                header = [OP_PROBE, int(msg["width"]), int(msg["count"]), 0]
            elif msg.get("op") == "compute":
                header = [OP_COMPUTE, int(msg["width"]), int(msg["count"]), 0]
            elif msg.get("op") == "stats":
                header = [OP_STATS, 0, 0, 0]
            elif msg.get("op") == "restore":
                key_in = [int(t) for t in msg["key"]]
                header = [OP_RESTORE, len(key_in), int(msg["length"]), 0]
            elif msg.get("op") == "store":
                key_in = [int(t) for t in msg["key"]]
                rb = msg.get("rollback") or [0, 0]
                header = [OP_STORE, len(key_in), int(rb[1]),
                          STORE_MEMORY_ONLY if msg.get("disk") is False else 0]
            else:
                rb = msg.get("rollback") or [0, 0]
                x_in = wire.unpack_array(msg["x"], as_mlx=True).astype(dtype)
                flags = (RUN_RESET if msg.get("reset") else 0) | (
                    RUN_LOGITS if msg.get("logits") else 0)
                header = [OP_RUN, x_in.shape[0], int(rb[1]), flags]
            try:
                link.send(header)
            except OSError as e:  # a rank is gone: the group is over
                write_frame(out, {"op": "error", "error": f"a rank is gone ({e})"})
                return 1
        else:
            header = link.receive()  # blocks in the kernel until rank 0 sends the next
            if header is None:  # rank 0 is gone (killed, or its group ended)
                print("tensor_rank: rank 0 closed the command link", file=sys.stderr)
                return 0
        op, width, dropped, flags = header
        if op == OP_STOP:
            return 0
        times.busy_from()
        t0 = time.perf_counter()
        if op == OP_STATS:
            got = _gather_times(times, args.rank, args.size, group)
            if args.rank == 0:
                write_frame(out, {"op": "stats", "ranks": got})
            continue
        if op == OP_PROBE:
            probe = mx.zeros((width, hidden), dtype=dtype)
            for _ in range(dropped):
                mx.eval(mx.distributed.all_sum(probe, group=group))
            if args.rank == 0:
                write_frame(out, {"op": "probe", "s": round(time.perf_counter() - t0, 6)})
            continue
        if op == OP_COMPUTE:
            took = _compute_alone(model, body, head, width, dropped, hidden, dtype)
            mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=group))  # everyone done
            if args.rank == 0:
                write_frame(out, {"op": "compute", "s": round(took, 6)})
            continue
        if op in (OP_RESTORE, OP_STORE):
            key = _share_key(key_in if args.rank == 0 else None, width, group)
            if op == OP_RESTORE:
                cache, held = _restore(prefix, model, key, dropped, group)
                if args.rank == 0:
                    write_frame(out, {"op": "restored", "held": held})
            else:
                if dropped:
                    trim(cache, dropped)
                ok, nbytes = _store(prefix, cache, key, args.rank, args.size, group,
                                    persist=not flags & STORE_MEMORY_ONLY)
                if args.rank == 0:
                    write_frame(out, {"op": "stored", "ok": ok, "bytes": nbytes})
            continue
        if flags & RUN_RESET:
            cache = make_prompt_cache(model)
        elif dropped:
            trim(cache, dropped)
        x = x_in if args.rank == 0 else mx.zeros((width, hidden), dtype=dtype)
        x = mx.distributed.all_sum(x, group=group)  # rank 0's rows, to everyone
        # A call that wants logits is a verify (or a step): its products weight-first where
        # it has 2+ rows (weight_first.py); a prefill's stay mlx-lm's.
        with verify_rows(bool(flags & RUN_LOGITS) and width > 1):
            h = body(None, cache, input_embeddings=x[None])[0]
            part = head.logits(h) if flags & RUN_LOGITS else None
        logits = None
        if part is not None:  # every rank has the whole rows now: each scores its ids
            logits = mx.distributed.all_gather(part, group=group) if args.size > 1 else part
            if args.rank == 0:
                logits = head.assemble(logits, width)
        mx.eval([a for a in (h, logits) if a is not None])
        if args.rank == 0:
            reply: wire.Message = {"op": "out", "h": wire.pack_array(h),
                     "cs": round(time.perf_counter() - t0, 6)}
            if logits is not None:
                packed = wire.pack_array(logits)
                data = packed.pop("data")
                if shared is not None and len(data) <= len(shared):
                    shared[:len(data)] = data  # before the frame that says it is there
                    reply["logits_at"] = packed
                else:
                    reply["logits"] = {**packed, "data": data}
            write_frame(out, reply)


def _map_logits(fd: int) -> mmap.mmap | None:
    """The shared memory the loop's member reads logits from (mapped whole), or None: then they
    travel in the reply frame."""
    import mmap

    if fd < 0:
        return None
    try:
        return mmap.mmap(fd, 0)
    except (OSError, ValueError) as e:
        print(f"tensor_rank: logits over the pipe ({e})", file=sys.stderr)
        return None
    finally:
        os.close(fd)


class RankTimes:
    """Where this rank's wall and CPU time went: waiting for the next command (idle) or
    running one (busy: its compute and its collectives, polling while it waits on a peer).
    CPU is the whole process's (MLX's socket threads included), so a rank that polls while
    it waits shows CPU near its wall time."""

    def __init__(self) -> None:
        self.calls = 0
        self.busy_wall = self.busy_cpu = self.idle_wall = self.idle_cpu = 0.0
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self._busy = False

    def _close(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        if self._busy:
            self.busy_wall += wall - self._wall
            self.busy_cpu += cpu - self._cpu
        else:
            self.idle_wall += wall - self._wall
            self.idle_cpu += cpu - self._cpu
        self._wall, self._cpu = wall, cpu

    def idle_from(self) -> None:
        self._close()
        self._busy = False

    def busy_from(self) -> None:
        self._close()
        self._busy = True
        self.calls += 1

    def row(self) -> list[float]:
        self._close()
        return [float(self.calls), self.busy_wall, self.busy_cpu, self.idle_wall, self.idle_cpu]


STAT_FIELDS = ("calls", "busy_wall_s", "busy_cpu_s", "idle_wall_s", "idle_cpu_s")


def _gather_times(times: RankTimes, rank: int, size: int, group: mx.distributed.Group
                  ) -> list[WireValue]:
    """Every rank's RankTimes so far (one all-sum where each writes its own row)."""
    import mlx.core as mx

    table = mx.zeros((size, len(STAT_FIELDS)), dtype=mx.float32)
    table[rank] = mx.array(times.row(), dtype=mx.float32)
    # (tolist is typed for any depth: a 2-d array's is a list of rows)
    rows = cast("list[list[float]]", mx.distributed.all_sum(table, group=group).tolist())
    return [{k: round(float(v), 4) for k, v in zip(STAT_FIELDS, r, strict=True)} for r in rows]


def _compute_alone(model: nn.Module, body: nn.Module, head: HeadSlice, width: int, count: int,
                   hidden: int, dtype: mx.Dtype) -> float:
    """Seconds of `count` forwards of `width` rows through this rank's slice alone (no
    collective; its rows of the head included), each rolled back, after a
    COMPUTE_PREFILL-row prefill; a scratch cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from skulkp2p.engine.cache.caches import trim
    from skulkp2p.engine.cpu.weight_first import verify_rows
    from skulkp2p.engine.parallel.tensor.shard import without_collectives

    scratch = make_prompt_cache(model)
    with without_collectives():
        mx.eval(body(None, scratch, input_embeddings=mx.zeros((1, COMPUTE_PREFILL, hidden),
                                                               dtype=dtype)))
        rows = mx.zeros((1, width, hidden), dtype=dtype)
        mx.eval(body(None, scratch, input_embeddings=rows))  # warm this width
        trim(scratch, width)
        t0 = time.perf_counter()
        for _ in range(count):
            with verify_rows(width > 1):  # as a verify of this width runs
                mx.eval(head.logits(body(None, scratch, input_embeddings=rows)[0]))
            trim(scratch, width)
        return time.perf_counter() - t0


def _share_key(key: list[int] | None, n: int, group: mx.distributed.Group) -> list[int]:
    """Rank 0's token ids, to every rank (the others add zeros)."""
    import mlx.core as mx

    mine = mx.array(key, dtype=mx.int32) if key is not None else mx.zeros((n,), dtype=mx.int32)
    summed = mx.distributed.all_sum(mine, group=group)
    return [int(t) for t in cast("list[int]", summed.tolist())]  # (a 1-d array's numbers)


def _any_rank(flag: bool, group: mx.distributed.Group) -> bool:
    import mlx.core as mx

    summed = mx.distributed.all_sum(mx.array([int(flag)], dtype=mx.int32), group=group)
    return int(cast(int, summed.item())) > 0  # (an int32 array's item is an int)


def _restore(prefix: PrefixCache | None, model: nn.Module, key: list[int], length: int,
             group: mx.distributed.Group) -> tuple[list[CacheEntry], int]:
    """(this rank's caches, positions held): the entry for `key` at exactly `length`
    positions if every rank has its own slice of it, else empty caches everywhere."""
    from mlx_lm.models.cache import make_prompt_cache

    hit = None
    if length > 0 and prefix is not None and len(key) == length + 1:
        hit = prefix.fetch(key, want=length)
    if _any_rank(hit is None, group) or hit is None:
        return make_prompt_cache(model), 0
    return hit.caches, length


def _disk_store(args: argparse.Namespace) -> PrefixDiskStore | None:
    """This rank's slices of the prefix cache's entries on disk: a folder per model, rank and
    group size, tied to a fingerprint of the weights and of this shard (None: off, or the
    folder is in use)."""
    from skulkp2p.engine.cache.disk_store import (
        PrefixDiskStore,
        StoreInUse,
        cache_identity,
        store_folder,
        weights_fingerprint,
    )

    if not args.prefix_cache_disk_dir or args.prefix_cache_disk_bytes <= 0:
        return None
    model_id = args.model_id or Path(args.model).name
    part = f"tp{args.rank}of{args.size}"
    fingerprint = weights_fingerprint(Path(args.model),
                                      cache_identity(model_id, args.dtype, part))
    folder = store_folder(Path(args.prefix_cache_disk_dir), model_id, fingerprint, part)
    try:
        return PrefixDiskStore(folder, args.prefix_cache_disk_bytes, fingerprint)
    except (StoreInUse, OSError) as e:
        print(f"tensor_rank: prefix cache entries in memory only ({e})", file=sys.stderr)
        return None


def _store(prefix: PrefixCache | None, cache: list[CacheEntry], key: list[int], rank: int,
           size: int, group: mx.distributed.Group, persist: bool = True) -> tuple[bool, int]:
    """Keep this rank's caches under `key`; (whether every rank kept its slice, the bytes of
    the largest rank's entry: what the loop member's index counts against its bound)."""
    import mlx.core as mx

    kept = prefix is not None and prefix.store(key, cache, persist=persist)
    nbytes = (prefix.entry_bytes(key) or 0) if prefix is not None and kept else 0
    row = mx.zeros((2, size), dtype=mx.int64)
    row[0, rank] = int(kept)
    row[1, rank] = nbytes
    # (tolist is typed for any depth: a 2-d array's is a list of rows)
    got = cast("list[list[int]]", mx.distributed.all_sum(row, group=group).tolist())
    return all(got[0]), int(max(got[1]))


def write_hostfile(path: Path, addrs: list[str]) -> None:
    """The ring backend's host file: one list of addresses per rank."""
    path.write_text(json.dumps([[a] for a in addrs]))


if __name__ == "__main__":
    sys.exit(main())
