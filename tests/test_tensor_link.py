"""What a tensor-parallel group's ranks exchange besides the model's collectives
(engine/parallel/tensor/link.py), on real rank processes on loopback: they agree on the dtype and the
model files before any collective of model data (a mismatch is a clear error on every rank, not
a crash), and a rank other than rank 0 waits for the next command without spending CPU."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time

import pytest

from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.parallel.tensor.group import RankProcess, TensorAgreementError
from skulkp2p.engine.parallel.tensor.link import (
    DTYPE_CODES,
    MAX_PENDING,
    TOKEN_WORDS,
    accept_proven,
    disagreement,
)
from tests.helpers.procs import free_port
from tests.helpers.tensor_group import Group, generate


def _row(dtype: str, digest: str) -> list[int]:
    return [DTYPE_CODES[dtype]] + [int(digest[4 * i:4 * i + 4], 16) for i in range(8)]


def test_disagreement_names_what_differs():
    a, b = "ab" * 16, "cd" * 16
    assert disagreement([_row("float32", a), _row("float32", a)]) is None
    why = disagreement([_row("float32", a), _row("bfloat16", a)])
    assert why.startswith("serving dtype differs (rank 0 float32, rank 1 bfloat16)")
    assert "model files" not in why
    why = disagreement([_row("float32", a), _row("float32", b), _row("float32", a)])
    assert why.startswith(f"model files differ (sha256 rank 0 {a[:12]}, rank 1 {b[:12]}")
    both = disagreement([_row("float32", a), _row("bfloat16", b)])
    assert "serving dtype differs" in both and "model files differ" in both


def _form(paths, dtypes):
    addrs = [f"127.0.0.1:{free_port()}" for _ in paths]
    return [RankProcess(p, r, addrs, d) for r, (p, d) in enumerate(zip(paths, dtypes,
                                                                        strict=True))]


@pytest.mark.process
@pytest.mark.parametrize("case", ["dtype", "files"])
def test_ranks_that_disagree_end_formation_with_a_clear_error(tiny_model, case):
    same = tiny_model("llama")
    if case == "dtype":  # the crash this guards against: float32 rows summed with bfloat16
        paths, dtypes = [same, same], ["float32", "bfloat16"]
        want = "serving dtype differs (rank 0 float32, rank 1 bfloat16)"
    else:  # same architecture and shapes, other weights
        paths, dtypes = [same, tiny_model("llama", seed=1)], ["float32", "float32"]
        want = "model files differ"
    ranks = _form(paths, dtypes)
    try:
        for r in ranks:  # every rank finds it, before any collective of model data
            with pytest.raises(TensorAgreementError, match="the group's ranks disagree") as got:
                r.wait_ready(60)
            assert want in str(got.value)
        for r in ranks:
            assert r.proc.wait(30) == 1  # an orderly exit, not a signal (SIGSEGV)
    finally:
        for r in ranks:
            r.kill()


@pytest.mark.process
def test_a_follower_rank_waits_for_commands_without_spending_cpu(tiny_model):
    """MLX's ring backend polls while a collective waits; a rank that learned each command
    from an all-sum kept a core busy between calls (docs/measurements/tensor-parallel.md, "The
    follower blocks between calls"). Over the command link it blocks in the kernel."""
    path = tiny_model("llama")
    group = Group(path, 2)
    try:
        single = load_model(path, "llama", dtype="float32")
        first = generate(group.head, "off", max_tokens=8).tokens
        before = group.ranks[0].stats()
        # The group idles while this process works (as during a one-node arm or drafting).
        t0 = time.monotonic()
        runs = 0
        while time.monotonic() - t0 < 1.0 and runs < 200:
            generate(single, "off", max_tokens=8)
            runs += 1
        after = group.ranks[0].stats()
        idle_wall = after[1]["idle_wall_s"] - before[1]["idle_wall_s"]
        idle_cpu = after[1]["idle_cpu_s"] - before[1]["idle_cpu_s"]
        assert idle_wall > 0.5, (before, after)
        assert idle_cpu < 0.25 * idle_wall, (idle_cpu, idle_wall)
        assert after[1]["calls"] > before[1]["calls"]  # stats is itself a command
        assert generate(group.head, "off", max_tokens=8).tokens == first  # still answers
    finally:
        group.close()


def _closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other end closed ``s`` (EOF or reset) within ``timeout``."""
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
    except ConnectionError:
        pass
    except TimeoutError:
        return False
    return True


def test_the_command_link_takes_only_the_connection_that_shows_rank_0s_token():
    """Strangers who reach a rank's command port first (idle, a wrong token, more of them than
    may wait) do not take rank 0's place: they are closed and rank 0's connection is the one
    taken."""
    token = secrets.token_bytes(4 * TOKEN_WORDS)
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = server.getsockname()
        strangers = [socket.create_connection(addr, timeout=5) for _ in range(MAX_PENDING + 4)]
        wrong = socket.create_connection(addr, timeout=5)
        wrong.sendall(token[:-1] + bytes([token[-1] ^ 1]))
        strangers.append(wrong)
        rank0 = socket.create_connection(addr, timeout=5)
        rank0.sendall(token)
        try:
            conn, refused = accept_proven(server, token, timeout=10)
            with conn:
                assert conn.getpeername() == rank0.getsockname()
                assert refused == len(strangers)
                assert all(_closed(s) for s in strangers)
                rank0.sendall(b"next")
                assert conn.recv(4) == b"next"
        finally:
            for s in [*strangers, rank0]:
                s.close()


def test_a_stranger_on_the_command_port_is_closed_at_its_deadline():
    """A connection that trickles part of the token is closed PROOF_TIMEOUT_S after its accept
    (bytes do not move the deadline); rank 0, connecting after, is taken; with no rank 0 at all
    the wait ends with a TimeoutError."""
    token = secrets.token_bytes(4 * TOKEN_WORDS)
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = server.getsockname()
        stranger = socket.create_connection(addr, timeout=5)
        taken: list[tuple[socket.socket, int]] = []
        accepting = threading.Thread(
            target=lambda: taken.append(accept_proven(server, token, 10, proof_s=1.0)))
        t0 = time.monotonic()
        accepting.start()
        for b in token[:5]:  # the right first bytes, slowly
            stranger.sendall(bytes([b]))
            stranger.settimeout(0.1)
            with contextlib.suppress(TimeoutError):
                assert stranger.recv(1) == b""
                break
        assert _closed(stranger) and 1.0 <= time.monotonic() - t0 < 3.0
        rank0 = socket.create_connection(addr, timeout=5)
        rank0.sendall(token)
        accepting.join(10)
        conn, refused = taken[0]
        assert refused == 1 and conn.getpeername() == rank0.getsockname()
        conn.close()
        rank0.close()
        stranger.close()
    with socket.create_server(("127.0.0.1", 0)) as server:
        with pytest.raises(TimeoutError):
            accept_proven(server, token, 0.3)
