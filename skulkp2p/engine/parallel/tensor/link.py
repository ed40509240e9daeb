"""What a tensor-parallel group's ranks exchange besides the model's own collectives: the
agreement they check before any collective of model data, and the command channel.

**Agreement.** Every rank loads the model from its own node's copy and in the dtype its own node
serves (float32 or bfloat16, decided per node). An all-sum between ranks whose rows differ in
dtype sums buffers of different sizes: one such mismatch crashed a rank with SIGSEGV. So right
after `mx.distributed.init`, before the model's first collective, the ranks all-sum a small
int32 table in which each writes its own row (its dtype and a digest of its model files) and
every rank compares the rows: a mismatch ends formation on every rank with one error naming what
differs, which the node shows (`/v1/cluster`, its log) instead of a crash. The table is int32 of
the same shape on every rank, so this collective itself is safe whatever the ranks disagree on.

**Commands.** MLX's ring backend waits for a collective by polling its sockets (it never blocks
in the kernel), so a rank other than rank 0, which learned each command from an all-sum, kept a
core busy between calls: while the loop's member drafted, sampled and ran the head, that rank
spun on the same 2 cores (most of a core, idle between calls: docs/measurements/
tensor-parallel.md, "The follower blocks between calls"; /proc/PID/stat of the ranks). So rank 0
sends each command's header over a plain TCP connection to every other rank, which blocks in
`recv` until it comes (no CPU between calls). Failure stays bounded: rank 0 killed closes the
connection (the rank reads EOF and exits); a rank killed makes rank 0's next collective fail on
its closed ring socket; a frozen peer is found by the waiting member (engine/parallel/tensor/group.py) and the
group's processes are killed by pid. The connection is set up over the group itself: each other
rank listens on an ephemeral port of its own host-file address and the ports are all-summed.

**Who may connect.** The listener takes rank 0's connection only, whoever connects first: rank 0
draws a random token that the same all-sum hands to every rank, and sends it first on each
connection (:func:`accept_proven`). A connection that does not show all of it within
PROOF_TIMEOUT_S of its accept (one deadline, however its bytes trickle) is closed, at most
MAX_PENDING wait at once (a new one past that closes the oldest), nothing but the token is ever
read before, and the listener closes once rank 0 is in.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import selectors
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # mlx loads lazily: the node's control plane imports this module
    import mlx.core as mx

# dtype names as codes in the agreement table (0: unknown)
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
DIGEST_CHUNKS = 8  # the digest's first 8 x 16 bits (int32 cells; the others add zeros)
ACCEPT_TIMEOUT_S = 60.0
TOKEN_WORDS = 8  # rank 0's proof on the command link: 8 random int32 cells of the all-sum
PROOF_TIMEOUT_S = 5.0  # from accept to the whole token
MAX_PENDING = 16  # connections waiting to show the token at once
SAMPLES, SAMPLE_BYTES = 64, 1 << 16  # 4 MiB of each weights file in the digest
HEADER = struct.Struct("<4i")


log = logging.getLogger("skulkp2p.tensor")


class AgreementError(RuntimeError):
    """The ranks of a group disagree on what they serve (dtype, model files)."""


def model_digest(path: Path) -> str:
    """sha256 over what tells two copies of a model apart: config.json whole, and of every
    *.safetensors (in name order) its size, its header (every tensor's name, dtype, shape and
    offsets) and SAMPLES evenly spaced samples of SAMPLE_BYTES of its data. A sample, not every
    byte: reading all of a model's weights took seconds per rank start on a shared CPU
    (docs/measurements/tensor-parallel.md, "The follower blocks between calls"); other weights of the same shapes differ in
    every sample, and a download corrupted in place is the store's to catch (it checks the
    card's sha256)."""
    h = hashlib.sha256()
    files = sorted([p for p in Path(path).iterdir() if p.name == "config.json"
                    or p.name.endswith(".safetensors")], key=lambda p: p.name)
    if not files:
        raise AgreementError(f"no config.json or *.safetensors in {path}")
    for p in files:
        h.update(p.name.encode() + b"\0")
        size = p.stat().st_size
        with open(p, "rb") as f:
            if p.name == "config.json":
                h.update(f.read())
                continue
            h.update(str(size).encode() + b"\0")
            head = f.read(8)
            h.update(head + f.read(int.from_bytes(head, "little") if len(head) == 8 else 0))
            for i in range(SAMPLES):
                f.seek(size * i // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _row(dtype: str, digest: str) -> list[int]:
    return [DTYPE_CODES.get(dtype, 0)] + [int(digest[4 * i:4 * i + 4], 16)
                                         for i in range(DIGEST_CHUNKS)]


def disagreement(rows: list[list[int]], dtypes: dict[int, str] | None = None) -> str | None:
    """What the ranks' rows (dtype code, digest chunks) disagree on, in words; None when they
    all agree. Pure: the tests feed it rows."""
    names = {v: k for k, v in (dtypes or DTYPE_CODES).items()}
    parts = []
    codes = [r[0] for r in rows]
    if len(set(codes)) > 1:
        said = ", ".join(f"rank {i} {names.get(c, f'code {c}')}" for i, c in enumerate(codes))
        parts.append(f"serving dtype differs ({said}): every member must serve the model in "
                     f"the same dtype")
    digests = ["".join(f"{c:04x}" for c in r[1:]) for r in rows]
    if len(set(digests)) > 1:
        said = ", ".join(f"rank {i} {d[:12]}" for i, d in enumerate(digests))
        parts.append(f"model files differ (sha256 {said}): every member must hold the same "
                     f"copy of the model")
    return "; ".join(parts) or None


def agree(group: mx.distributed.Group, rank: int, size: int, dtype: str, digest: str) -> None:
    """Check, with one int32 all-sum, that every rank serves the same dtype and model files;
    raises AgreementError (on every rank alike) when they do not."""
    import mlx.core as mx

    mine = _row(dtype, digest)
    table = mx.zeros((size, len(mine)), dtype=mx.int32)
    table[rank] = mx.array(mine, dtype=mx.int32)
    summed = mx.distributed.all_sum(table, group=group)
    # (tolist is typed for any depth: a 2-d array's is a list of rows)
    rows = [[int(v) for v in r] for r in cast("list[list[int]]", summed.tolist())]
    why = disagreement(rows)
    if why:
        raise AgreementError(f"the group's ranks disagree: {why}")


def hosts_of(hostfile: Path) -> list[str]:
    """Each rank's host (the ring backend's host file: one list of "ip:port" per rank)."""
    return [entry[0].rsplit(":", 1)[0] for entry in json.loads(Path(hostfile).read_text())]


def accept_proven(server: socket.socket, token: bytes, timeout: float,
                  proof_s: float = PROOF_TIMEOUT_S, max_pending: int = MAX_PENDING
                  ) -> tuple[socket.socket, int]:
    """(the first connection to ``server`` that sends ``token``, how many others were closed).
    Each connection must send the whole token within ``proof_s`` of its accept; only then is it
    compared (in constant time, so no prefix tells a guesser it is on the right track). Raises
    TimeoutError when none did within ``timeout``. Blocking; the token is read and nothing
    else."""
    deadline = time.monotonic() + timeout
    pending: dict[socket.socket, tuple[float, bytearray]] = {}  # oldest first
    refused = 0
    server.setblocking(False)
    with selectors.DefaultSelector() as sel:
        sel.register(server, selectors.EVENT_READ)

        def drop(c: socket.socket) -> None:
            nonlocal refused
            sel.unregister(c)
            pending.pop(c, None)
            c.close()
            refused += 1

        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"no connection showed rank 0's token within "
                                       f"{timeout:g} s")
                for c, (until, _) in list(pending.items()):
                    if now >= until:
                        drop(c)
                wake = min([deadline, *(until for until, _ in pending.values())])
                for sk, _ in sel.select(max(0.0, wake - now)):
                    if sk.fileobj is server:
                        try:
                            c, _ = server.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        if len(pending) >= max_pending:
                            drop(next(iter(pending)))
                        c.setblocking(False)
                        pending[c] = (time.monotonic() + proof_s, bytearray())
                        sel.register(c, selectors.EVENT_READ)
                        continue
                    c = cast(socket.socket, sk.fileobj)
                    if c not in pending:
                        continue
                    buf = pending[c][1]
                    try:
                        data = c.recv(len(token) - len(buf))
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    buf += data
                    if not data or (len(buf) == len(token)
                                    and not hmac.compare_digest(bytes(buf), token)):
                        drop(c)
                    elif len(buf) == len(token):
                        sel.unregister(c)
                        del pending[c]
                        for other in list(pending):
                            drop(other)
                        c.setblocking(True)
                        return c, refused
        finally:
            for c in list(pending):
                sel.unregister(c)
                c.close()


class CommandLink:
    """Rank 0's connections to the other ranks, or another rank's connection from rank 0:
    each command's header (4 int32) goes over it instead of an all-sum, so that a rank waiting
    for the next command blocks in the kernel instead of polling."""

    def __init__(self, rank: int, conns: list[socket.socket]):
        self.rank = rank
        self.conns = conns  # rank 0: one per other rank, in rank order; others: [rank 0's]

    @classmethod
    def open(cls, group: mx.distributed.Group, rank: int, size: int, hosts: list[str],
             addrs: list[str] | None = None) -> CommandLink:
        """Set up over the group: every other rank listens on its own host, the ports are
        all-summed, rank 0 connects to each (each other rank accepts exactly one).

        `addrs` ("ip:port" per rank, as this rank sees them, like its host file): every other
        rank listens on its own entry and rank 0 connects to theirs, so that a bench can put
        the link behind its delaying proxy (each rank's own entry its real port, the others'
        their proxy ports); the all-sum is then only the barrier that has every rank listen
        before rank 0 connects. Without it, ephemeral ports (a cluster's groups)."""
        import mlx.core as mx

        if addrs is not None and len(addrs) != size:
            raise ValueError(f"command addresses: {len(addrs)} for a group of {size}")
        server = None
        port = 0
        if rank != 0:
            host, want = ((hosts[rank], 0) if addrs is None
                          else (addrs[rank].rsplit(":", 1)[0], int(addrs[rank].rsplit(":", 1)[1])))
            server = socket.create_server((host, want))
            port = server.getsockname()[1]
        # The ports, and rank 0's token (rank 0 draws it; every other cell of it is 0 here).
        cells = mx.zeros((size + TOKEN_WORDS,), dtype=mx.int32)
        cells[rank] = port
        if rank == 0:
            cells[size:] = mx.array([secrets.randbits(31) for _ in range(TOKEN_WORDS)],
                                    dtype=mx.int32)
        # (tolist is typed for any depth: a 1-d array's is a list of numbers)
        summed = mx.distributed.all_sum(cells, group=group)
        got = [int(p) for p in cast("list[int]", summed.tolist())]
        token = struct.pack(f"<{TOKEN_WORDS}i", *got[size:])
        dial = [(hosts[r], got[r]) for r in range(size)] if addrs is None else [
            (a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addrs]
        conns: list[socket.socket] = []
        try:
            if rank == 0:
                for r in range(1, size):
                    c = socket.create_connection(dial[r], timeout=ACCEPT_TIMEOUT_S)
                    conns.append(c)
                    c.sendall(token)
            else:
                assert server is not None
                c, refused = accept_proven(server, token, ACCEPT_TIMEOUT_S)
                if refused:
                    log.warning("tensor rank %d: the command link refused %d connection(s) "
                                "that did not show rank 0's token", rank, refused)
                conns.append(c)
        finally:
            if server is not None:
                server.close()
        for c in conns:
            c.settimeout(None)  # blocking: the wait for a command costs no CPU
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, conns)

    def send(self, header: list[int]) -> None:
        """Rank 0: the next command's header to every other rank (raises OSError when one is
        gone; its collective would fail anyway)."""
        data = HEADER.pack(*header)
        for c in self.conns:
            c.sendall(data)

    def receive(self) -> list[int] | None:
        """Another rank: the next command's header, blocking; None when rank 0 is gone."""
        buf = b""
        while len(buf) < HEADER.size:
            try:
                got = self.conns[0].recv(HEADER.size - len(buf))
            except OSError:
                return None
            if not got:
                return None
            buf += got
        return list(HEADER.unpack(buf))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
