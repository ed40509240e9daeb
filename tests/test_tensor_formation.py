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

from skulkp2p.engine.parallel.tensor.group import READY_TIMEOUT_S
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
        if "skulkp2p.engine.parallel.tensor.rank" in cmdline:
            return child
    return None


def _generate(http: str) -> tuple[int, dict]:
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 8, "speculation": "off"}
    try:
        status, _, out = call(http, "POST", "/v1/cluster/generate", body, timeout=30)
    except OSError as e:
        return 0, {"error": str(e)}
    return status, out


@pytest.mark.cluster
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
        # The leader is the member killed below. (Not necessarily the founder: on a loaded box
        # the founder, busy loading the model, missed heartbeats and another node led.)
        views: list[dict] = []
        c.wait(lambda: (s := c.agreed([0, 1, 2])) and views.append(s) is None, 60, "one leader")
        lead = int(views[-1]["leader"][1:])
        peer, third = [i for i in (0, 1, 2) if i != lead]
        old_pid = c.nodes[lead].pid

        status, _, out = call(c.nodes[lead].http, "POST", "/v1/cluster/place",
                              {"model": "llama", "nodes": [f"n{lead}", f"n{peer}"],
                               "parallel": "tensor"})
        assert status == 200 and out["placement"]["parallel"] == "tensor", out
        placed = (out["placement"]["term"], out["placement"]["serial"])

        # The leader's rank process appears: kill the leader at once (its rank dies with it,
        # PR_SET_PDEATHSIG, long before it imported MLX), so that rank never connects.
        deadline = time.monotonic() + 60
        while (rank := _rank_started(old_pid)) is None:
            assert c.nodes[lead].proc.poll() is None, c.diagnostics()
            assert time.monotonic() < deadline, f"n{lead} never started its rank"
            time.sleep(0.005)
        c.signal(lead, signal.SIGKILL)
        c.nodes[lead].proc.wait(10)
        # The peer starts its rank for that formation (the leader's address in its host file)
        # and waits.
        peer_log = c.nodes[peer].log
        c.wait(lambda: "rank 1 of 2 started" in peer_log.read_text(errors="replace"), 30,
               f"n{peer}'s rank started")
        assert "rank 1 ready" not in peer_log.read_text(errors="replace")
        # Leadership moves; the placement stays (the leader is only suspected).
        c.wait(lambda: (s := c.agreed([peer, third])) and s["leader"] != f"n{lead}", 60,
               "a new leader")

        # The leader comes back (same name, a new process) under the same placement.
        t0 = time.monotonic()
        c.start_join(lead, llama, peers=[peer], args=args)
        c.wait(lambda: status_of(c.nodes[lead].http) != 0, 60, f"n{lead} back")

        def answered() -> bool:
            status, out = _generate(c.nodes[third].http)
            return status == 200 and "error" not in out and bool(out.get("tokens"))

        c.wait(answered, FORMS_AFTER_RETURN_S, f"the group to form after n{lead} came back")
        took = time.monotonic() - t0
        st = c.agreed([0, 1, 2]) or c.status(third)
        (p,) = [p for p in st["placements"] if p["model"] == "llama"]
        assert p["parallel"] == "tensor" and p["ring"] == [f"n{lead}", f"n{peer}"], p
        assert (p["term"], p["serial"]) == placed, (p, placed)  # the same placement throughout
        text = peer_log.read_text(errors="replace")
        assert f"member n{lead} started over" in text, text[-3000:]
        print(f"\nn{lead} killed as its rank {rank} started; the group answered {took:.1f} s "
              f"after it was restarted")
    finally:
        c.close()
