"""Soak: 16 concurrent streaming clients against a 3-node cluster on loopback serving a tiny model
from before a node is killed until a while after it is back, some cancelling mid-stream (closing the socket), while a node that neither
leads nor serves is killed with SIGKILL and restarted. Every request either completes exactly (its
text equals the same request served alone, greedy) or fails with a clear error (an HTTP status
with a JSON error body, or an SSE error event); every client is bounded by a deadline, so nothing
hangs; and afterwards the serving agent's open file descriptors and threads are back at their
baseline and its RSS within a stated tolerance of it.

With today's FIFO worker this tests queueing (16 clients on one model, --max-queue 32); with the
batching scheduler it tests batching: the test does not know which."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.http_client import call, status_of
from tests.helpers.procs import ProcCluster, loopback_ips_usable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not loopback_ips_usable(),
                                 reason="needs the 127.0.0.0/8 loopback range (Linux)")]

CLIENTS = 16
LOAD_S = 100.0  # the longest the clients keep sending
AFTER_REJOIN_S = 2.0  # they stop this long after the killed node is back (within LOAD_S);
# the 16 requests in flight then end after it too
REQUEST_DEADLINE_S = 60.0  # one request, head to [DONE]: past it the client reports a hang
MAX_TOKENS = 24
PROMPTS = [
    "Say something about dogs.", "Name three colours.", "Count from one to ten.",
    "Write a line of a poem about rain.", "What is two plus two?", "Describe a red apple.",
    "Repeat: alpha beta gamma alpha beta gamma.", "List some fruits.",
]
# RSS may settle above its baseline (allocator high-water marks, MLX's buffer cache, lazily
# built kernels): a bound, not a leak detector on its own. 16 concurrent streams hold a few MB.
RSS_TOLERANCE = 1.25
RSS_SLACK_MB = 64


@dataclass
class Outcome:
    kind: str  # ok | cancelled | error | bad
    detail: str = ""


@dataclass
class ClientLog:
    outcomes: list[Outcome] = field(default_factory=list)


def _body(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}


def stream_once(addr: str, prompt: str, expected: str, cancel_after: int | None) -> Outcome:
    """One streamed chat completion through HOST:PORT, classified. `cancel_after`: close the
    socket after that many text chunks (the client goes away mid-stream)."""
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + REQUEST_DEADLINE_S
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_DEADLINE_S)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(_body(prompt)).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read()
            try:
                err = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                return Outcome("bad", f"HTTP {resp.status} without a JSON error: {raw[:200]!r}")
            if not (isinstance(err, dict) and err.get("message")):
                return Outcome("bad", f"HTTP {resp.status} error without a message: {err!r}")
            return Outcome("error", f"{resp.status}: {err['message'][:120]}")
        pieces: list[str] = []
        while True:
            if time.monotonic() > deadline:
                return Outcome("bad", f"hung: no end {REQUEST_DEADLINE_S:.0f} s after sending")
            line = resp.readline()
            if not line:
                return Outcome("bad", f"stream ended without [DONE] after {len(pieces)} chunks")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # separators, keep-alive comments
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                err = event["error"]
                if not (isinstance(err, dict) and err.get("message")):
                    return Outcome("bad", f"SSE error event without a message: {event!r}")
                return Outcome("error", f"sse: {err['message'][:120]}")
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    pieces.append(piece)
            if cancel_after is not None and len(pieces) >= cancel_after:
                return Outcome("cancelled")  # the finally closes the socket mid-stream
        text = "".join(pieces)
        if text != expected:
            return Outcome("bad", f"text differs from solo: {text[:80]!r} != {expected[:80]!r}")
        return Outcome("ok")
    except (OSError, http.client.HTTPException, ValueError) as e:  # timeouts are OSErrors
        return Outcome("bad", f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def solo(addr: str, prompt: str) -> str:
    status, _, body = call(addr, "POST", "/v1/chat/completions",
                           {**_body(prompt), "stream": False})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def resources(pid: int) -> tuple[int, int, float]:
    """(open file descriptors, threads, RSS in MB) of a process, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if line.startswith("VmRSS:"))
    return fds, threads, rss_kb / 1024


@pytest.mark.cluster
def test_soak_16_streams_cancels_and_a_killed_node(tmp_path, tiny_models):
    model = str(tiny_models["llama"])
    args = ["--memory-limit", "2GB", "--max-queue", "32"]
    c = ProcCluster(tmp_path)
    try:
        for i in range(3):
            c.start_join(i, model, args=args)
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and s["placements"], 90,
               "3 joins to agree on a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90,
               "every node to answer /health with 200")
        st = c.agreed([0, 1, 2])
        serving = st["placements"][0]["ring"]
        assert len(serving) == 1, st["placements"]
        server = int(serving[0][1:])
        victim = next(i for i in (0, 1, 2) if f"n{i}" not in (st["leader"], serving[0]))
        entries = [c.nodes[i].http for i in (0, 1, 2) if i != victim]  # clients go here
        # The solo outputs, through both entry nodes (forwarding must not change them); this
        # also warms every path the load takes, before the baseline is read.
        expected = {p: solo(entries[0], p) for p in PROMPTS}
        for p in PROMPTS:
            assert solo(entries[1], p) == expected[p]
        pid = c.nodes[server].pid
        base = resources(pid)

        logs = [ClientLog() for _ in range(CLIENTS)]
        stop_at = [time.monotonic() + LOAD_S]  # brought forward once the node is back

        def client(k: int) -> None:
            n = 0
            while time.monotonic() < stop_at[0]:
                prompt = PROMPTS[(k + n) % len(PROMPTS)]
                # every 4th client cancels every 3rd request, after 1..3 chunks
                cancel = 1 + n % 3 if k % 4 == 0 and n % 3 == 0 else None
                logs[k].outcomes.append(stream_once(entries[(k + n) % len(entries)], prompt,
                                                    expected[prompt], cancel))
                n += 1

        threads = [threading.Thread(target=client, args=(k,), daemon=True)
                   for k in range(CLIENTS)]
        for t in threads:
            t.start()
        # Meanwhile: SIGKILL the victim, wait until the others see it dead, restart it, wait
        # until all three agree it is back (bounded; the load goes on throughout).
        c.wait(lambda: sum(len(x.outcomes) for x in logs) >= CLIENTS, 60,
               "the first requests of the load")
        c.signal(victim, signal.SIGKILL)
        c.nodes[victim].proc.wait(10)
        survivors = [i for i in (0, 1, 2) if i != victim]
        c.wait(lambda: (s := c.agreed(survivors)) and any(
            m["name"] == f"n{victim}" and m["state"] == "dead" for m in s["members"]), 30,
            "the others to declare the killed node dead")
        c.start_join(victim, model, peers=survivors, args=args)
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and all(
            m["state"] == "alive" for m in s["members"] if m["name"] in ("n0", "n1", "n2")),
            60, "the restarted node to rejoin")
        assert c.agreed([0, 1, 2])["placements"][0]["ring"] == serving  # it stayed put
        done_at_rejoin = sum(len(x.outcomes) for x in logs)
        assert time.monotonic() < stop_at[0], "the kill and restart must fall within the load"
        stop_at[0] = min(stop_at[0], time.monotonic() + AFTER_REJOIN_S)
        for t in threads:
            t.join(LOAD_S + REQUEST_DEADLINE_S + 30)
        assert not any(t.is_alive() for t in threads), "a client hung past every deadline"

        outcomes = [o for x in logs for o in x.outcomes]
        kinds = Counter(o.kind for o in outcomes)
        bad = [o.detail for o in outcomes if o.kind == "bad"]
        errors = Counter(o.detail for o in outcomes if o.kind == "error")
        print(f"soak: {len(outcomes)} requests {dict(kinds)}; errors {dict(errors)}")
        assert not bad, f"{len(bad)} requests neither completed exactly nor failed clearly: " \
                        f"{bad[:5]}"
        assert kinds["ok"] >= CLIENTS, kinds  # the load really ran
        assert kinds["cancelled"] >= 1, kinds
        assert len(outcomes) > done_at_rejoin, "no request ran after the node came back"

        # The serving agent lets go of everything the load held: connections, threads, memory.
        def settled() -> bool:
            now = resources(pid)
            return now[0] <= base[0] and now[1] <= base[1]
        try:
            c.wait(settled, 30, "the serving agent's descriptors and threads to settle")
        except AssertionError:
            raise AssertionError(f"serving agent: (fds, threads, rss MB) baseline {base}, "
                                 f"now {resources(pid)}") from None
        fds, n_threads, rss = resources(pid)
        assert rss <= base[2] * RSS_TOLERANCE + RSS_SLACK_MB, (base, (fds, n_threads, rss))
        print(f"soak: serving agent (fds, threads, rss MB) baseline {base}, after "
              f"{(fds, n_threads, round(rss, 1))}")
        # And it still answers exactly.
        assert solo(entries[0], PROMPTS[0]) == expected[PROMPTS[0]]
    finally:
        c.close()
