"""A tensor group forming while leadership moves, with real `join` processes on 127.0.0.x.

The situation a loaded machine once produced: the leader, a member of a group being formed, went
away after publishing its rank address and before its rank connected; leadership moved; the
member came back under the same placement and published a fresh address at the same
generation. The other member's rank process still waited for the old address (a rank whose
peer never connects waits for ever inside `mx.distributed.init`). Here the member is killed the
moment its rank process starts (so that rank never connects) and restarted; the group must form
within seconds of its return, not after the rank's formation timeout (READY_TIMEOUT_S)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from skulkp2p.engine.tensor import READY_TIMEOUT_S
from tests.helpers.http_client import call, status_of
from tests.helpers.procs import ProcCluster, loopback_ips_usable

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a,"
# A member killed here stays suspect this long before it is declared dead: long enough for it
# to come back under the same placement (a dead member would be re-placed, a different case).
TIMERS = "probe=0.2,suspect=60,election=1"
# From the member's return: its agent starting, loading, the group forming. Well under the
# rank's formation timeout, which is what the group waited out before.
FORMS_AFTER_RETURN_S = 75.0
assert FORMS_AFTER_RETURN_S < READY_TIMEOUT_S


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live children of `pid`, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # (field 4, after the command name in parentheses, is the parent's pid)
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append((int(entry), cmdline))
    return out


def _rank_started(pid: int) -> int | None:
    for child, cmdline in _children(pid):
        if "skulkp2p.engine.tensor_rank" in cmdline:
            return child
    return None


def _generate(http: str) -> tuple[int, dict]:
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 8, "speculation": "off"}
    try:
        status, _, out = call(http, "POST", "/v1/cluster/generate", body, timeout=30)
    except OSError as e:
        return 0, {"error": str(e)}
    return status, out


@pytest.mark.slow
def test_group_re_forms_at_once_when_a_member_comes_back_mid_formation(tiny_model,
                                                                        tmp_path):
    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    llama = str(tiny_model("llama", seed=0))
    args = ["--memory-limit", "2GB", "--timers", TIMERS]
    c = ProcCluster(tmp_path, env={"SKULKP2P_RING_TIMEOUT": "20"})
    try:
        for i in range(3):
            c.start_join(i, llama, args=args)
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and s["placements"], 90, "a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90, "health")
        leader = c.agreed([0, 1, 2])["leader"]
        assert leader == "n0", leader  # the founder leads; it is the member killed below
        old_pid = c.nodes[0].pid

        status, _, out = call(c.nodes[0].http, "POST", "/v1/cluster/place",
                              {"model": "llama", "nodes": ["n0", "n1"], "parallel": "tensor"})
        assert status == 200 and out["placement"]["parallel"] == "tensor", out
        placed = (out["placement"]["term"], out["placement"]["serial"])

        # The leader's rank process appears: kill the leader at once (its rank dies with it,
        # PR_SET_PDEATHSIG, long before it imported MLX), so that rank never connects.
        deadline = time.monotonic() + 60
        while (rank := _rank_started(old_pid)) is None:
            assert c.nodes[0].proc.poll() is None, c.diagnostics()
            assert time.monotonic() < deadline, "n0 never started its rank"
            time.sleep(0.005)
        c.signal(0, signal.SIGKILL)
        c.nodes[0].proc.wait(10)
        # n1 starts its rank for that formation (n0's address in its host file) and waits.
        n1_log = c.nodes[1].log
        c.wait(lambda: "rank 1 of 2 started" in n1_log.read_text(errors="replace"), 30,
               "n1's rank started")
        assert "rank 1 ready" not in n1_log.read_text(errors="replace")
        # Leadership moves; the placement stays (n0 is only suspected).
        c.wait(lambda: (s := c.agreed([1, 2])) and s["leader"] in ("n1", "n2"), 60,
               "a new leader")

        # n0 comes back (same name, a new process) under the same placement.
        t0 = time.monotonic()
        c.start_join(0, llama, peers=[1], args=args)
        c.wait(lambda: status_of(c.nodes[0].http) != 0, 60, "n0 back")

        def answered() -> bool:
            status, out = _generate(c.nodes[2].http)
            return status == 200 and "error" not in out and bool(out.get("tokens"))

        c.wait(answered, FORMS_AFTER_RETURN_S, "the group to form after n0 came back")
        took = time.monotonic() - t0
        st = c.agreed([0, 1, 2]) or c.status(2)
        (p,) = [p for p in st["placements"] if p["model"] == "llama"]
        assert p["parallel"] == "tensor" and p["ring"] == ["n0", "n1"], p
        assert (p["term"], p["serial"]) == placed, (p, placed)  # the same placement throughout
        text = n1_log.read_text(errors="replace")
        assert "member n0 started over" in text, text[-3000:]
        print(f"\nn0 killed as its rank {rank} started; the group answered {took:.1f} s after "
              f"n0 was restarted")
    finally:
        c.close()
