"""`join` loads its model, says it is ready, and exits cleanly on Ctrl-C (SIGINT) or SIGTERM;
from the moment its HTTP port accepts, /health answers 503 (retry later) or 200, never 500."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from skulkp2p.cluster.config import DEFAULT_PORT
from tests.helpers import ROOT
from tests.helpers.http_client import Reply, parse_responses, raw_exchange
from tests.helpers.procs import JoinNode, free_port, running_join

HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_join_ready_then_clean_exit(tiny_models, sig, tmp_path):
    with running_join(tiny_models["llama"], tmp_path, b"ready: model") as (proc, log):
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=20) == 0
        assert "stopped" in log.read_text()


@pytest.mark.process
def test_join_unknown_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "skulkp2p", "join", "--model", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "unknown model 'nope'" in proc.stderr


@pytest.mark.process
def test_join_sigint_while_loading_exits_promptly(tiny_models, tmp_path):
    """Ctrl-C as soon as the API is up (the model may still be loading) ends the node."""
    with running_join(tiny_models["llama"], tmp_path, b"http: ") as (proc, log):
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()


def _first_health_replies(port: int, proc: subprocess.Popen, deadline: float,
                          n: int = 4) -> list[bytes]:
    """Connect the moment ``port`` accepts (retrying refused connections without pause), then
    at once ask for /health on that connection and on ``n - 1`` more opened right behind it:
    the likeliest requests to meet a node whose HTTP server is up while the rest of it is still
    being built. Returns the raw answers, in order."""
    while True:
        try:
            first = socket.create_connection(("127.0.0.1", port), timeout=30)
            break
        except ConnectionRefusedError:
            assert proc.poll() is None, f"join exited ({proc.returncode}) before listening"
            assert time.monotonic() < deadline, "join's HTTP port never accepted"
    socks = [first]
    try:
        first.sendall(HEALTH)
        for _ in range(n - 1):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            socks[-1].sendall(HEALTH)
        answers = []
        for s in socks:
            raw = bytearray()
            while chunk := s.recv(65536):
                raw += chunk
            answers.append(bytes(raw))
        return answers
    finally:
        for s in socks:
            s.close()


@contextmanager
def port_held(host: str, port: int) -> Iterator[None]:
    """Keep host:port busy (bound, not listening: connections to it are refused) if it is free;
    if it is not, someone else keeps it busy, which serves as well."""
    with socket.socket() as s:
        with suppress(OSError):
            s.bind((host, port))
        yield


@pytest.mark.process
def test_health_is_503_or_200_from_the_first_connection(tiny_models, tmp_path):
    """A fresh `join` polled on /health as fast as we can, from the first accepted connection
    until it answers 200: every answer is 503 (a JSON error and Retry-After: not ready yet) or
    200. A 500 (say, /health reaching into a cluster node not built yet) must never appear.

    The cluster's default port is busy, as a second node on one machine finds it: the node
    falls back to a free port, one more step between its HTTP port opening and its cluster
    node being up, which makes a request in between likely to meet the node half-built."""
    with port_held("127.0.0.1", DEFAULT_PORT):
        node = JoinNode(str(tiny_models["llama"]), tmp_path, "--data-dir", str(tmp_path),
                        wait_ready=False, http_port=free_port())
        replies: list[Reply] = []
        try:
            deadline = time.monotonic() + 120
            pending = _first_health_replies(node.port, node.proc, deadline)
            while True:
                raw = pending.pop(0) if pending else raw_exchange(node.port, HEALTH, timeout=30)
                got = parse_responses(raw)
                assert len(got) == 1, raw[:500]
                replies.append(got[0])
                if (got[0].status == 200 and not pending) or len(replies) >= 50_000:
                    break
                assert node.proc.poll() is None, node.text()[-3000:]
                assert time.monotonic() < deadline, Counter(r.status for r in replies)
        finally:
            node.stop()

    counts = Counter(r.status for r in replies)
    bad = [r for r in replies if r.status not in (200, 503)]
    assert not bad, (f"{len(bad)} of {len(replies)} /health answers were neither 503 nor 200 "
                     f"({dict(counts)}); the first: {bad[0].status} {bad[0].body[:300]!r}")
    assert replies[-1].status == 200, f"no 200 after {len(replies)} answers: {dict(counts)}"
    for r in replies:
        if r.status == 200:
            continue
        assert r.headers.get("retry-after"), r.headers
        assert r.headers.get("content-type", "").startswith("application/json"), r.headers
        error = json.loads(r.body)["error"]
        assert error["message"] and error["code"], error
