"""Which tasks the BLAS thread policy's load probe sees when it calls the machine busy.

    python tools/load_probe_trace.py --json OUT -- --workloads code-edit --runs 1 \
        --no-llama-server --no-peers

Runs ``python -m skulkp2p bench`` (the arguments after ``--``) in this process with the policy's
load probe (engine/blas_threads.LoadProbe) wrapped: at every reading it also takes the naive
reading (loadavg's runnable count, then our threads' states: the probe before LoadProbe) and
the bracketed one (our threads before and after loadavg), and when either sees another task
it scans /proc/*/task/*/stat for every task in state R and records who they were (this
process's threads, other processes' by command and nice value, kernel threads). The scan takes
a few milliseconds, so it sees the machine a moment after the probe did: a task the probe
counted may have gone ("nobody else" below). Writes a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _stat(path: str) -> tuple[str, str, int, int] | None:
    """(comm, state, nice, ppid) of one /proc stat file, or None if the task ended."""
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    comm = text[text.find("(") + 1:text.rfind(")")]
    rest = text[text.rfind(")") + 2:].split()
    return comm, rest[0], int(rest[16]), int(rest[1])


def running_tasks() -> list[dict[str, Any]]:
    """Every task on the machine in state R right now (a few ms: not one instant)."""
    me = os.getpid()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            s = _stat(f"/proc/{pid}/task/{tid}/stat")
            if s is None or s[1] != "R":
                continue
            comm, _, nice, ppid = s
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")[:80]
            except OSError:
                cmd = ""
            kind = "ours" if int(pid) == me else ("kernel" if not cmd else "other")
            out.append({"pid": int(pid), "tid": int(tid), "comm": comm, "nice": nice,
                        "kind": kind, "cmd": cmd})
    return out


def naive_reading(proc: Any) -> int:
    """The probe as it was before LoadProbe: loadavg's runnable count, then our threads'."""
    try:
        running = proc._machine_running()
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - proc.own_running())


class Recorder:
    """Wraps the policy's probe: at every reading also takes the naive one (loadavg, then our
    threads) and the bracketed one (LoadProbe.read), and when either sees another task, scans
    /proc for who was running."""

    def __init__(self, probe: Any):
        self.probe = probe
        self.calls = 0
        self.counts: Counter[str] = Counter()
        self.busy: list[dict[str, Any]] = []

    def __call__(self) -> int:
        before = self.probe.readings
        answer = self.probe()
        self.calls += 1
        if self.probe.readings == before:
            return answer  # the probe's rate limit: nothing read this time
        naive = naive_reading(self.probe)
        bracketed = self.probe.read()
        self.counts["readings"] += 1
        self.counts["naive saw another"] += naive > 0
        self.counts["bracketed saw another"] += bracketed > 0
        self.counts["confirmed (the policy's answer)"] += answer > 0
        if naive > 0 or bracketed > 0:
            self.busy.append({"t": time.monotonic(), "naive": naive, "bracketed": bracketed,
                              "answer": answer, "tasks": running_tasks()})
        return answer

    def summary(self) -> dict[str, Any]:
        who: Counter[str] = Counter()
        kinds: Counter[str] = Counter()
        for b in self.busy:
            others = [t for t in b["tasks"] if t["kind"] != "ours"]
            ours = [t for t in b["tasks"] if t["kind"] == "ours"]
            kinds[f"ours running at the scan: {len(ours)}"] += 1
            if not others:
                kinds["nobody else running at the scan"] += 1
            elif all(t["kind"] == "kernel" for t in others):
                kinds["only kernel threads"] += 1
            elif any(t["kind"] == "other" and t["nice"] <= 0 for t in others):
                kinds["another process's task at nice <= 0"] += 1
            else:
                kinds["only niced other processes (and kernel threads)"] += 1
            for t in others:
                who[f"{t['kind']} nice={t['nice']} {t['comm']} | {t['cmd'][:70]}"] += 1
        return {"probe_calls": self.calls, "counts": dict(self.counts),
                "seen_breakdown": dict(kinds), "tasks_seen": dict(who.most_common(30))}


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True, help="where to write the summary")
    args = p.parse_args(argv[:split])
    bench_args = argv[split + 1:]

    from skulkp2p.engine.cpu import blas, blas_threads

    blas.ensure_fast_blas()  # re-executes this script once with the preload
    policy = blas_threads.policy()
    if policy is None:
        print("load_probe_trace: no OpenBLAS in this process", file=sys.stderr)
        return 1
    recorder = Recorder(policy._runnable)
    policy._runnable = recorder
    from skulkp2p.cli import main as cli_main

    bench_json = args.json.with_suffix(".bench.json")
    rc = cli_main(["bench", *bench_args, "--json", str(bench_json)])
    doc = {"bench_rc": rc, "policy": policy.describe(), **recorder.summary()}
    args.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
