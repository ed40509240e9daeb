"""`python -m skulkp2p bench --concurrency N --replicas R [--cores-per-node K]`: N clients at
once against a model on one replica and on R replicas of one cluster, side by side.

The bench starts R `join` agents on 127.0.0.1 forming a cluster of their own (its own secret),
each (with --cores-per-node K) on K cores of its own and with the OpenBLAS threads a node of K
cores starts with, with the prefix cache and the draft memory off (the rounds repeat their
prompts): first batched agents (--max-batch N), then, a cluster of their own, one-at-a-time
agents (--max-batch 1). Each round the model is placed (POST /v1/cluster/place)
with `replicas` 1, then R, alternately, and once every replica serves, an untimed warm-up, then
N client threads are released together against agent 0 (the first replica's node: with one
replica it serves every request itself, with R it routes them, node/replica_route.py), each
streaming workload i mod W as a greedy chat completion. Per mode: aggregate tok/s (completion
tokens over the round's wall time, median over --runs), per-request decode tok/s, TTFT, and
which replica served how many requests; and the speedup of R replicas over one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from skulkp2p.bench.arms.concurrency import MakeBody, _body, run_round
from skulkp2p.bench.arms.concurrency_report import Round, summarize_cell
from skulkp2p.bench.arms.http_agents import (
    READY_TIMEOUT_S,
    Node,
    await_ready,
    http_json,
    raise_if_exited,
    start_node,
    stop_node,
)
from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.report import fmt, loadavg, machine_info, write_document
from skulkp2p.served.child import free_port

MODES = ("one", "replicas")


def _pin(node: Node, cpus: frozenset[int] | None) -> None:
    """Every thread of the agent on ``cpus`` (threads started later inherit it)."""
    if cpus is None or node.proc is None:
        return
    try:
        tids = os.listdir(f"/proc/{node.proc.pid}/task")
    except OSError:
        tids = [str(node.proc.pid)]
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def _served_counts(agents: list[Node], model: str) -> dict[str, int]:
    """Requests each agent's own worker finished (its /metrics)."""
    import re
    import urllib.request

    out = {}
    pattern = re.compile(r'^skulkp2p_requests_total\{[^}]*model="' + re.escape(model)
                         + r'"[^}]*\} (\d+)', re.M)
    for a in agents:
        try:
            with urllib.request.urlopen(f"http://{a.host}:{a.port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            text = ""
        out[a.name] = sum(int(n) for n in pattern.findall(text))
    return out


def _place(agents: list[Node], model: str, replicas: int, deadline: float) -> list[str]:
    """Place ``model`` with ``replicas`` copies; the replicas' entry nodes once each serves."""
    placed = False
    while time.monotonic() < deadline:
        raise_if_exited(agents)
        if not placed:
            status, _ = http_json(agents[0], "POST", "/v1/cluster/place",
                                  {"model": model, "replicas": replicas})
            placed = status == 200
        else:
            status, out = http_json(agents[0], "GET", "/v1/models")
            entry = next((m for m in (out or {}).get("data", []) if m.get("id") == model), None)
            copies = entry.get("replicas", []) if entry else []
            if len(copies) == replicas:
                names = [c["entry"] for c in copies]
                by_name = {a.name: a for a in agents}
                if all(_ready(by_name[n], model) for n in names if n in by_name):
                    return names
        time.sleep(0.3)
    raise BenchError(f"{model} not served on {replicas} replicas after {READY_TIMEOUT_S:.0f} s: "
                     f"{agents[0].log_tail()}")


def _ready(agent: Node, model: str) -> bool:
    status, out = http_json(agent, "GET", "/v1/models")
    return status == 200 and any(m.get("id") == model and m.get("ready")
                                 for m in (out or {}).get("data", []))


def run_replicas_bench(args: argparse.Namespace, store: Any) -> int:
    n, r = args.concurrency, args.replicas
    if r < 2:
        raise BenchError("--replicas must be 2 or more (one replica is the baseline it is "
                         "measured against)")
    if getattr(args, "url", None) or getattr(args, "nodes", 1) > 1:
        raise BenchError("--replicas starts its own agents: not with --url or --nodes")
    resolved = store.resolve(args.model)
    k = getattr(args, "cores_per_node", None)
    cpus: list[frozenset[int]] | None = None
    if k is not None:
        from skulkp2p.bench.cores import node_cores
        cpus = node_cores(r, k)
    workloads = list(args.workloads)
    client_workloads = [workloads[i % len(workloads)] for i in range(n)]
    tmp = Path(tempfile.mkdtemp(prefix="skulkp2p-replicas-bench-"))
    batches = (n, 1)
    cells = [(b, m) for b in batches for m in MODES]
    rounds: dict[tuple[int, str], list[Round]] = {c: [] for c in cells}
    served: dict[tuple[int, str], list[dict[str, int]]] = {c: [] for c in cells}
    load_before = loadavg()
    settings_agents: list[list[str]] = []
    for max_batch in batches:
        _run_cluster(args, resolved.id, r, max_batch, cpus, client_workloads, tmp,
                     rounds, served, settings_agents)
    shutil.rmtree(tmp, ignore_errors=True)
    results = []
    for max_batch in batches:
        base = None
        for mode in MODES:
            cell = (max_batch, mode)
            row = {"max_batch": max_batch, "mode": mode, "replicas": 1 if mode == "one" else r,
                   **summarize_cell(rounds[cell], None), "served_by": served[cell]}
            if mode == "one":
                base = row["aggregate_tok_s"]
            elif base and row["aggregate_tok_s"]:
                row["speedup_vs_one"] = round(row["aggregate_tok_s"] / base, 2)
            results.append(row)
    doc = {
        "complete": True,
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": loadavg()},
        "model": {"id": resolved.id},
        "settings": {"concurrency": n, "replicas": r, "cores_per_node": k,
                     "max_tokens": args.max_tokens, "runs": args.runs,
                     "workloads": workloads, "client_workloads": client_workloads,
                     "order": "per run: one replica, then R (re-placed each time); the batched "
                              "agents' runs, then the one-at-a-time agents'",
                     "speculation": "auto", "agents": settings_agents},
        "results": results,
    }
    table = ["| max batch | mode | replicas | aggregate tok/s | per-request tok/s | TTFT p50 s "
             "| speedup |", "|---|---|---|---|---|---|---|"]
    for row in results:
        table.append(f"| {row['max_batch']} | {row['mode']} | {row['replicas']} | "
                     f"{row['aggregate_tok_s']} | {row['per_request_tok_s']} | "
                     f"{row['ttft_p50_s']} | {row.get('speedup_vs_one', '–')} |")
    write_document(doc, "\n".join(table) + "\n", args.json_out)
    return 0


def _run_cluster(args: argparse.Namespace, model: str, r: int, max_batch: int,
                 cpus: list[frozenset[int]] | None, client_workloads: list[str], tmp: Path,
                 rounds: dict[tuple[int, str], list[Round]],
                 served: dict[tuple[int, str], list[dict[str, int]]],
                 settings_agents: list[list[str]]) -> None:
    """R agents of one cluster with ``max_batch``; --runs rounds of each mode, alternately."""
    n = args.concurrency
    k = getattr(args, "cores_per_node", None)
    agents: list[Node] = []
    try:
        secret = os.urandom(16).hex()
        port = free_port()
        env = {"SKULKP2P_SECRET": secret}
        if k is not None:
            from skulkp2p.engine.cpu.blas import default_blas_threads
            env["OPENBLAS_NUM_THREADS"] = str(default_blas_threads(k))
        for i in range(r):
            cluster = ["--host", "127.0.0.1", "--port", str(port if i == 0 else 0),
                       "--name", f"b{max_batch}-replica{i}", "--max-batch", str(max_batch),
                       "--max-queue", str(max(16, 2 * n)), "--prefix-cache-mb", "0",
                       "--draft-memory-tokens", "0"]
            if i:
                cluster += ["--peer", f"127.0.0.1:{port}"]
            agent = start_node(f"b{max_batch}-replica{i}", "batched", args.model,
                               getattr(args, "data_dir", None), cluster, env, tmp)
            _pin(agent, cpus[i] if cpus else None)
            agents.append(agent)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for a in agents:
            await_ready(a, deadline)
        for i, a in enumerate(agents):  # threads started while loading: pinned too
            _pin(a, cpus[i] if cpus else None)

        def make(messages: list[dict[str, str]], tag: str) -> dict[str, Any]:
            return _body(messages, args.max_tokens, "auto")
        body: MakeBody = make
        for run in range(args.runs):
            for mode in MODES:
                cell = (max_batch, mode)
                entries = _place(agents, model, 1 if mode == "one" else r,
                                 time.monotonic() + READY_TIMEOUT_S)
                for i, a in enumerate(agents):
                    _pin(a, cpus[i] if cpus else None)
                run_round(agents[0], body, client_workloads, f"warm.{run}.{mode}")
                before = _served_counts(agents, model)
                rnd = run_round(agents[0], body, client_workloads, f"{run}.{mode}")
                after = _served_counts(agents, model)
                rounds[cell].append(rnd)
                served[cell].append({name: after[name] - before[name] for name in after})
                print(f"max batch {max_batch} round {run + 1}/{args.runs} {mode:8s} on "
                      f"{', '.join(entries)}: aggregate {fmt(rnd.aggregate_tok_s, '.1f')} "
                      f"tok/s, wall {rnd.wall_s:.2f} s, served {served[cell][-1]}", flush=True)
        settings_agents.extend(a.args for a in agents)
    except BaseException:
        if agents:
            print(f"agent logs kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for a in agents:
            stop_node(a)
