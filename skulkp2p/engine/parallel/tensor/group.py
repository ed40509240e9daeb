"""Tensor-parallel placements: the decode loop's forward seam over a group of rank processes.

Every member of the placement runs one rank process (tensor_rank.py) holding its slice of every
layer (tensor_shard.py); the ranks form an `mx.distributed` group (the `ring` backend over TCP).
The member that serves the model runs the decode loop and the drafter in its own process over a
`TensorForward`: it embeds the tokens, sends the rows to its rank 0 (a pipe), and gets the summed
last hidden rows back with their logits, which the ranks computed a share of the vocabulary each
(tensor_shard.HeadSlice). A verify round of w tokens is one call: two all-reduces per layer and
one all-gather of logits, whatever w is.

Failures stay bounded: a collective blocked on a frozen peer cannot be interrupted in its
process, so the waiting side never blocks on it. It polls its rank 0's answers and, while
waiting, asks `check` (a member declared dead by the cluster, a re-placement) and a deadline
(SKULKP2P_RING_TIMEOUT, as rings); on failure it kills its rank 0 by pid, which closes the
group's sockets and its command link, so the other ranks end at once and exit.
"""

from __future__ import annotations

import ctypes
import io
import logging
import math
import mmap
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from skulkp2p import wire
from skulkp2p.engine.parallel.tensor.group_errors import TensorAgreementError, TensorError
from skulkp2p.wire import WireValue

__all__ = ["RankProcess", "TensorAgreementError", "TensorError", "TensorForward",
           "measure_group_widths", "tensor_timeout"]

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from skulkp2p.engine.cache.caches import CacheEntry
    from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
    from skulkp2p.engine.protocol import PrefixDiskSettings

log = logging.getLogger("skulkp2p.tensor")

READY_TIMEOUT_S = 120.0  # load and group formation; a peer that never comes ends it
# A call's logits come back up to this size; a wider call (a long prompt through __call__) gets
# the hidden rows only and this member applies its own whole head.
SPLIT_LOGITS_MAX_BYTES = 16 << 20


def _shared_logits() -> int:
    """A descriptor of anonymous shared memory where rank 0 leaves each call's logits for this
    member (RankProcess.call); it has no name, so nothing is left behind however the two
    processes end. Why not the pipe: a verify's logits are w x V values (3 MB for 16 rows of
    SmolLM2), and framing them (msgpack, an HMAC on each side, the pipe's copies) cost as much
    as the split saved on a wide call (docs/measurements/tensor-parallel.md, "The
    vocabulary-split head"); through one mapping they are
    copied twice."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("skulkp2p-tp-logits")
    else:  # macOS: a file whose name goes at once
        fd, name = tempfile.mkstemp(prefix="skulkp2p-tp-logits-")
        os.unlink(name)
    try:
        os.ftruncate(fd, SPLIT_LOGITS_MAX_BYTES)  # pages come as they are written
    except OSError:
        os.close(fd)
        raise
    return fd


_PR_SET_PDEATHSIG = 1


def tensor_timeout() -> float:
    return float(os.environ.get("SKULKP2P_RING_TIMEOUT", "30"))


def _die_with_parent() -> None:
    # In the forked child before exec: SIGKILL when the agent goes, however it goes.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setpgrp()


def _start_child(cpus: frozenset[int] | None) -> Callable[[], None]:
    """The child's set-up before exec: `_die_with_parent`, and with `cpus` the cores it may run
    on (every thread it starts inherits them: a bench's emulated node, `bench --cores-per-node`)."""
    def start() -> None:
        _die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return start


class RankProcess:
    """One rank of a group: a child process started with its host file, watched through its
    stdout (frames) and ended by pid."""

    def __init__(self, model_path: Path | str, rank: int, addrs: list[str], dtype: str,
                 label: str = "", prefix_cache_mb: float = 0.0,
                 command_addrs: list[str] | None = None, cpus: frozenset[int] | None = None,
                 prefix_disk: PrefixDiskSettings | None = None, model_id: str = ""):
        """`command_addrs`: where the command link listens and dials (tensor_link.CommandLink:
        a bench's delaying proxy); default ephemeral ports. `cpus`: the cores the process may
        run on (default: this process's). `prefix_disk`: where the rank keeps its slices of the
        prefix cache's entries on disk too (under `model_id`'s folders; None: memory only)."""
        from skulkp2p.engine.parallel.tensor.rank import write_hostfile

        self.rank = rank
        self.size = len(addrs)
        self.label = label or f"rank {rank}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"skulkp2p-tp{rank}-"))
        hostfile = self.dir / "hosts.json"
        write_hostfile(hostfile, addrs)
        self.stderr_path = self.dir / "stderr.log"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 (closed in kill)
        cmd = [sys.executable, "-m", "skulkp2p.engine.parallel.tensor.rank", "--model", str(model_path),
               "--rank", str(rank), "--size", str(self.size), "--hostfile", str(hostfile),
               "--dtype", dtype, "--prefix-cache-mb", str(max(0.0, prefix_cache_mb))]
        if prefix_disk is not None and prefix_disk.max_bytes > 0:
            cmd += ["--prefix-cache-disk-dir", str(prefix_disk.directory),
                    "--prefix-cache-disk-bytes", str(int(prefix_disk.max_bytes))]
        if model_id:
            cmd += ["--model-id", model_id]
        self._logits_map: mmap.mmap | None = None
        self.shared_reads = 0  # calls whose logits came through the shared memory
        shared: tuple[int, ...] = ()
        if rank == 0:  # the rank the loop's member talks to
            try:
                fd = _shared_logits()
                shared = (fd,)  # closed here once the child has it (below)
                self._logits_map = mmap.mmap(fd, SPLIT_LOGITS_MAX_BYTES)
                cmd += ["--logits-fd", str(fd)]
            except (OSError, ValueError) as e:
                log.info("tensor %s: logits come over the pipe (%s)", self.label, e)
        if command_addrs:
            cmd += ["--command-addrs", ",".join(command_addrs)]
        env = None
        if cpus is not None:  # OpenBLAS threads as a node of that many cores would start with
            from skulkp2p.engine.cpu.blas import default_blas_threads
            env = {**os.environ, "OPENBLAS_NUM_THREADS": str(default_blas_threads(len(cpus)))}
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._stderr, env=env, pass_fds=shared,
                                         preexec_fn=_start_child(cpus))
        finally:
            for fd in shared:  # the child holds its own; the mapping outlives the descriptor
                os.close(fd)
        self.pid = self.proc.pid
        # (stdin and stdout are pipes: Popen's buffered writer and reader)
        self._stdin = cast(io.BufferedWriter, self.proc.stdin)
        self._stdout = cast(io.BufferedReader, self.proc.stdout)
        self.frames: queue.Queue[wire.Message | None] = queue.Queue()
        self.ready: wire.Message | None = None
        self._lock = threading.Lock()  # one call at a time on rank 0's pipe
        threading.Thread(target=self._read, name=f"tp-rank{rank}-out", daemon=True).start()

    def _read(self) -> None:
        decoder = wire.FrameDecoder(wire.frame_key(None), wire.DATA_MAX_FRAME)
        out = self._stdout
        try:
            while True:
                data = out.read1(1 << 20)
                if not data:
                    break
                for msg in decoder.feed(data):
                    self.frames.put(msg)
        except (OSError, ValueError, wire.WireError) as e:
            log.warning("tensor %s: output unreadable: %s", self.label, e)
        finally:
            self.frames.put(None)  # the process ended (or its pipe broke)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def why_dead(self) -> str:
        code = self.proc.poll()
        try:
            tail = self.stderr_path.read_text(errors="replace").strip().splitlines()[-3:]
        except OSError:
            tail = []
        detail = f" ({' | '.join(t.strip() for t in tail)})" if tail else ""
        return f"its {self.label} process exited with status {code}{detail}"

    def _next(self, timeout: float, check: Callable[[], str | None] | None,
              what: str) -> wire.Message:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.frames.get(timeout=0.1)
            except queue.Empty:
                broken = check() if check is not None else None
                if broken:
                    raise TensorError(broken) from None
                if time.monotonic() > deadline:
                    raise TensorError(f"no answer from the group within {timeout:.0f} s "
                                      f"({what})") from None
                continue
            if msg is None:  # the process ended: say why the group broke, when it is known
                broken = check() if check is not None else None
                raise TensorError(broken or self.why_dead())
            if msg.get("op") == "error":
                kind = TensorAgreementError if msg.get("kind") == "agreement" else TensorError
                raise kind(f"{self.label}: {msg.get('error')!s}")
            return msg

    def wait_ready(self, timeout: float = READY_TIMEOUT_S,
                   check: Callable[[], str | None] | None = None) -> wire.Message:
        self.ready = self._next(timeout, check, "loading and forming the group")
        return self.ready

    def call(self, msg: wire.Message, timeout: float, check: Callable[[], str | None] | None
             ) -> tuple[wire.Message, mx.array | None]:
        """One command to rank 0 and its answer, with the logits rank 0 left in the shared
        memory for it (None where it left none there); raises TensorError in bounded time."""
        with self._lock:
            if not self.alive():
                raise TensorError(self.why_dead())
            frame = wire.encode_frame({"t": "tp", **msg}, wire.frame_key(None),
                                      wire.DATA_MAX_FRAME)
            try:
                self._stdin.write(frame)
                self._stdin.flush()
            except (BrokenPipeError, OSError) as e:
                raise TensorError(f"{self.label}: {e}") from None
            reply = self._next(timeout, check, "a forward call")
            shared = None
            if "logits_at" in reply:  # read before the lock lets the next call overwrite them
                shared = self._read_logits(reply.pop("logits_at"))
                self.shared_reads += 1
            return reply, shared

    def probe(self, width: int, count: int, timeout: float = 60.0) -> float:
        """Seconds that `count` all-sums of `width` rows take in the group, alone (rank 0)."""
        return _number(self.call({"op": "probe", "width": width, "count": count}, timeout,
                                 None)[0]["s"])

    def compute(self, width: int, count: int, timeout: float = 120.0) -> float:
        """Seconds of `count` forwards of `width` rows through rank 0's slice with no
        collective (every rank runs its own at once): the ranks' compute apart from the
        collectives, for the bench's split of the time."""
        return _number(self.call({"op": "compute", "width": width, "count": count}, timeout,
                                 None)[0]["s"])

    def stats(self, timeout: float = 60.0) -> list[dict[str, float]]:
        """Every rank's wall and CPU time since it started, busy (in calls) and idle (waiting
        for the next command): engine/tensor_rank.RankTimes."""
        ranks = self.call({"op": "stats"}, timeout, None)[0]["ranks"]
        return list(cast("list[dict[str, float]]", ranks))  # (as rank.py's _gather_times)

    def _read_logits(self, meta: WireValue) -> mx.array:
        """The logits rank 0 left in the shared memory for the answer just read ({"dtype",
        "shape"}); copied out, since the next call overwrites them."""
        if not isinstance(meta, dict):
            raise TensorError(f"{self.label}: logits left in memory without their shape")
        if self._logits_map is None:
            raise TensorError(f"{self.label}: logits left in memory this process did not map")
        dtype, shape = meta.get("dtype"), meta.get("shape")
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise TensorError(f"{self.label}: logits left in memory without their shape")
        _holder, itemsize = wire.ARRAY_DTYPES[dtype]
        n = itemsize * math.prod(wire.as_int(d) for d in shape)
        if n > len(self._logits_map):
            raise TensorError(f"{self.label}: logits of {n} bytes do not fit the shared memory")
        return wire.unpack_array({"dtype": meta["dtype"], "shape": meta["shape"],
                                  "data": self._logits_map[:n]}, as_mlx=True)

    def kill(self) -> None:
        """End the process by pid (idempotent), and unmap the shared memory."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.error("tensor %s: pid %d did not end", self.label, self.pid)
        for stream in (self._stdin, self._stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._stderr.close()
        if self._logits_map is not None:
            self._logits_map.close()
            self._logits_map = None


class TensorForward:
    """The Forward seam over a tensor-parallel group, on the member that runs the decode loop.
    `head` is this member's model with no layers (embedding, final norm, output head); `rank0`
    the local rank process; `check` says why the group is broken (or None)."""

    def __init__(self, head: nn.Module, rank0: RankProcess, *, prefill_step: int = 2048,
                 hidden: str | None = None, interrupt: Callable[[], None] | None = None,
                 check: Callable[[], str | None] | None = None, timeout: float | None = None,
                 label: str = "model", call_costs: LiveWidthCosts | None = None):
        """`call_costs`: the group's live width table (engine/drafting/call_costs.py), which every
        verify call of this forward is timed into, so that the depth controller prices the
        next rounds by what the group's calls really cost."""
        from skulkp2p.engine.model.trunk import Trunk

        if hidden not in (None, "after", "before"):
            raise ValueError(f"hidden must be 'after' or 'before', got {hidden!r}")
        self.trunk = Trunk(head)
        self.rank0 = rank0
        self.prefill_step = prefill_step
        self.hidden = hidden
        self.interrupt = interrupt
        self.check = check
        self.timeout = timeout or tensor_timeout()
        self.label = label
        self.call_costs = call_costs
        self.last_hidden: mx.array | None = None
        # The caches live in the ranks; a prefix-cache entry here is only the index (its
        # slices are kept by the ranks, `keep_in_group`).
        self.cache: list[CacheEntry] = []
        self._pending: tuple[int, int] | None = None  # rides on the next call
        self._reset = True  # the first call of a request starts the ranks' caches afresh
        # Where the time goes (for reports): waiting on the group, of which the ranks' own
        # time (compute and collectives, as rank 0 measured it); this member's head.
        self.calls = 0
        self.wait_s = 0.0
        self.ranks_s = 0.0
        self.compute_s = 0.0
        self.rows = 0
        self.logit_calls = 0  # calls that needed logits (the loop's; not the prefill's)
        self.split_calls = 0  # of which the ranks computed them (the rest: this member's head)
        weight = self.trunk.embed_tokens.weight
        self._row_bytes = int(weight.shape[0]) * weight.dtype.size  # one row of logits

    def _call(self, msg: wire.Message) -> tuple[wire.Message, mx.array | None]:
        try:
            return self.rank0.call(msg, self.timeout, self.check)
        except TensorError as e:
            self.rank0.kill()  # its collective may be blocked for good: the group is over
            raise TensorError(f"tensor-parallel group of {self.label} broke mid-request: "
                              f"{e}") from None

    def _run(self, tokens: list[int], logits: bool = False) -> tuple[mx.array, mx.array | None]:
        """(the summed last hidden rows, and with `logits` the ranks' logits of every row, or
        None when the call is too wide for them to travel)."""
        import mlx.core as mx

        t0 = time.perf_counter()
        x = self.trunk.embed_tokens(mx.array(tokens)[None])[0]
        mx.eval(x)
        self.compute_s += time.perf_counter() - t0
        self.logit_calls += int(logits)
        want = logits and len(tokens) * self._row_bytes <= SPLIT_LOGITS_MAX_BYTES
        msg: wire.Message = {"op": "run", "x": wire.pack_array(x), "reset": self._reset,
                             "logits": want,
                             "rollback": list(self._pending) if self._pending else None}
        t1 = time.perf_counter()
        out, shared = self._call(msg)
        self.wait_s += time.perf_counter() - t1
        self.ranks_s += _number(out.get("cs") or 0.0)
        self.calls += 1
        self.rows += len(tokens)
        self._reset = False
        self._pending = None
        h = wire.unpack_array(out["h"], as_mlx=True)
        if not want:
            return h, None
        self.split_calls += 1
        if shared is not None:
            return h, shared
        return h, wire.unpack_array(out["logits"], as_mlx=True)

    def _finish(self, h: mx.array, logits: bool, given: mx.array | None = None) -> mx.array | None:
        """The call's logits (`given` by the ranks, or this member's head on `h` when the
        call was too wide for theirs) and the hidden rows the drafter reads."""
        import mlx.core as mx

        t0 = time.perf_counter()
        normed = self.trunk.norm(h[None]) if (self.hidden == "after" or given is None) else None
        out = given
        if out is None and logits and normed is not None:  # (normed: given is None)
            out = self.trunk.head(normed)[0]
        if self.hidden == "before":
            self.last_hidden = h
        elif self.hidden == "after" and normed is not None:
            self.last_hidden = normed[0]
        mx.eval([a for a in (out, self.last_hidden) if a is not None])
        self.compute_s += time.perf_counter() - t0
        return out

    def restore(self, cache: list[CacheEntry], tokens: list[int], key: list[int]) -> int:
        """A prefix-cache hit in this member's index: every rank adopts its own slice of the
        entry under `key` (tokens and the next one) at exactly len(tokens) positions. Returns
        the positions now held: len(tokens), or 0 when some rank missed (then every rank
        starts empty and the prompt is prefilled whole: never a wrong answer)."""
        out, _ = self._call({"op": "restore", "length": len(tokens),
                             "key": [int(t) for t in key]})
        self._reset = False  # the ranks' caches are set: the entry's, or empty
        self._pending = None
        held = wire.as_int(out.get("held") or 0)
        if held != len(tokens):
            log.info("tensor: prefix of %d tokens missing on some rank: full prefill",
                     len(tokens))
            return 0
        return held

    def keep_in_group(self, key: list[int], disk: bool = True) -> int | None:
        """Have every rank keep its caches (after the pending rollback) under `key`, now (on
        its disk too unless `disk` is False); the bytes of the largest rank's slice, or None
        when some rank did not keep it."""
        out, _ = self._call({"op": "store", "key": [int(t) for t in key],
                             "rollback": list(self._pending) if self._pending else None,
                             **({} if disk else {"disk": False})})
        self._pending = None
        return wire.as_int(out.get("bytes") or 0) if out.get("ok") else None

    def prefill(self, tokens: list[int]) -> None:
        import mlx.core as mx

        rows: list[mx.array] = []
        for start in range(0, len(tokens), self.prefill_step):
            if self.interrupt is not None:
                self.interrupt()
            h, _ = self._run(tokens[start:start + self.prefill_step])
            if self.hidden:
                self._finish(h, logits=False)
                if self.last_hidden is not None:  # (set by _finish where `hidden` asks)
                    rows.append(self.last_hidden)
        if rows:
            self.last_hidden = mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]

    def __call__(self, tokens: list[int]) -> mx.array:
        t0 = time.perf_counter()
        h, given = self._run(tokens, logits=True)
        logits = self._finish(h, logits=True, given=given)
        if logits is None:
            raise RuntimeError("a call for logits gave none")
        if self.call_costs is not None:  # the whole call as the loop waits for it
            self.call_costs.observe(len(tokens), time.perf_counter() - t0)
        return logits

    def rollback(self, keep: int, dropped: int) -> None:
        if dropped > 0:
            self._pending = (keep, dropped)

    # The rest of the Forward seam (engine/model/forward.py), declared: a group verifies
    # chains only and runs the round loop (each step is a call to the ranks), and its ranks
    # keep their caches in `keep_in_group`.
    @property
    def trees(self) -> bool:
        return False

    def verify_tree(self, tokens: list[int], parents: list[int]) -> mx.array:
        raise ValueError("a tensor-parallel group verifies chains only")

    def keep_path(self, path: list[int]) -> None:
        raise ValueError("a tensor-parallel group verifies chains only")

    def may_run_ahead(self) -> bool:
        return False

    def lazy_step(self, token: mx.array) -> tuple[mx.array, mx.array | None]:
        raise NotImplementedError("a tensor-parallel group has no lazy steps")

    def end_run_ahead(self) -> None:
        return None

    def share_store(self, key: list[int], disk: bool = True) -> None:
        return None

    def close(self) -> None:
        """Nothing to send: the next request's first call resets the ranks' caches."""


class Encodes(Protocol):
    """A tokenizer, as far as the width measurement uses one (mlx-lm's TokenizerWrapper)."""

    def encode(self, text: str) -> list[int]: ...


def _number(value: WireValue) -> float:
    """A number off the wire (rank 0's seconds): float() of it, which raises for anything else
    (TypeError for a list, a map or None)."""
    if isinstance(value, list | dict) or value is None:
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def measure_group_widths(head: nn.Module, tokenizer: Encodes, rank0: RankProcess,
                         check: Callable[[], str | None] | None = None,
                         timeout: float | None = None) -> dict[int, float]:
    """Seconds of one verify call of w rows on this group, as the decode loop pays it (embedding,
    the pipe, the ranks' slices and collectives, norm and head), for the widths the depth
    controller interpolates between: the median of a few reps (GROUP_REPS) after a short
    prefill, each capped by the wider widths' (`non_decreasing`: a shared CPU's noise). Run
    when a group forms, before any request may use it (the calls reset the ranks' caches).

    Why the group's own table: one process's table (`bench --widths`) grows with w as its
    matmuls do, while a group's call is dominated by its collectives and the pipe, which cost
    the same at any w; with the wrong table the controller drafts too shallow."""
    from skulkp2p.engine.drafting.width_costs import (
        GROUP_REPS,
        GROUP_WIDTHS,
        WIDTH_PREFILL,
        WIDTH_TEXT,
        measure_forward_seconds,
        non_decreasing,
    )

    ids = list(tokenizer.encode(WIDTH_TEXT))
    need = WIDTH_PREFILL + max(GROUP_WIDTHS)
    while len(ids) < need:
        ids += ids
    fwd = TensorForward(head, rank0, check=check, timeout=timeout, label="the width probe")
    return non_decreasing(measure_forward_seconds(fwd, ids[:need], GROUP_WIDTHS, WIDTH_PREFILL,
                                                  GROUP_REPS))
