"""`python -m skulkp2p bench --concurrency N`: N clients at once through HTTP, batched against FIFO.

The bench starts its own agents (`python -m skulkp2p join` on 127.0.0.1, real sockets): one
with `--max-batch N` ("batched") and one with `--max-batch 1` ("fifo", today's one-at-a-time
worker), side by side in the same run, or measures a running node given by `--url` (no FIFO
baseline then). Each round, N client threads are released together; client i streams workload
i mod W of `--workloads` (so the clients ask different things) as a greedy chat completion.

Arms: `plain` and `spec`. For an MLX card they are the request's `speculation` (`"off"`,
`"auto"`), so one agent per mode serves both; for a llama-server card speculation is the
child's configuration, so each (arm, mode) gets its own agent, `plain` with
SKULKP2P_LLAMA_SERVER_FORCE_NO_SPEC=1 and without llama-server's host-memory prompt cache;
there the clients also ask each agent's child directly (modes `batched-direct`,
`fifo-direct`, with the body our proxy would send), which shows what the child's parallel slots
give whatever our worker does in between. The MLX agents run with the prefix cache and the draft
memory off: the rounds repeat the same prompts, which would otherwise be served from the
caches of earlier rounds.

Per (arm, mode): aggregate tok/s (completion tokens of the round over its wall time, from the
release of the clients to the last token; median over `--runs` rounds), per-request decode tok/s
(median over every request), time to first token p50 and p99 (nearest rank over every request),
what the agents' OpenBLAS thread policy did in its rounds (`blas`: forwards per thread count,
the share run wide, forwards kept narrow by reason, switches, trips; from their /metrics before
and after each round, bench/blas_policy.py), and the speedup of batched over fifo. Before the
rounds every workload is served once alone on the fifo agent (per arm): every output of every
round must equal that solo output, or the command fails after writing its document (MLX cards;
on a llama-server card every request gets a system line of its own, so that no slot serves a
prompt it kept from an earlier round, and llama.cpp's text is not compared: it is not
batch-invariant). Rounds are interleaved (round r of every arm and mode before round r+1).

With `--nodes K` (MLX cards) each mode is a pipeline ring instead of one agent: K `join` agents
on 127.0.0.1 form a cluster of their own (its own secret), the model is placed on a ring of all
K (POST /v1/cluster/place), and the clients ask the ring's last stage, where its requests decode
(batched: the rows of every request in one traversal, engine/parallel/ring/batch_rows.py).

The agents are bench/arms/http_agents.py's; the numbers and the table bench/arms/concurrency_report.py's.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skulkp2p.bench.arms.concurrency_report import Round, markdown_table, summarize_cell
from skulkp2p.bench.arms.http_agents import (
    READY_TIMEOUT_S,
    Node,
    await_ready,
    direct_node,
    node_at_url,
    place_ring,
    start_node,
    start_ring,
    stop_node,
)
from skulkp2p.bench.arms.served_arm import direct_body, stream_chat
from skulkp2p.bench.arms.served_report import Generation
from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.blas_policy import BlasPolicy, accumulate, read_all
from skulkp2p.bench.report import fmt, loadavg, machine_info, round_or_none, write_document
from skulkp2p.bench.workloads import WARMUP_MESSAGES, WARMUP_TOKENS, WORKLOADS
from skulkp2p.served.child_config import FORCE_NO_SPEC, wants_served

log = logging.getLogger("skulkp2p.bench")

ARMS = ("plain", "spec")
MLX_SPECULATION = {"plain": "off", "spec": "auto"}
CLIENT_TIMEOUT_S = 600.0  # one request of a round; a stalled node ends the bench, never hangs


# --------------------------------------------------------------------------------------------
# One round: N clients released together


def _body(messages: list[dict[str, str]], max_tokens: int, speculation: str | None
          ) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if speculation is not None:
        body["speculation"] = speculation
    return body


MakeBody = Callable[[list[dict[str, str]], str], dict[str, Any]]


def run_round(node: Node, make_body: MakeBody, workloads: list[str], tag: str) -> Round:
    """len(workloads) clients, each its own thread and connection, released at once;
    `make_body(messages, tag)` turns a workload's messages into the request (`tag` names the
    round and client)."""
    n = len(workloads)
    gate = threading.Barrier(n + 1)
    out: list[Generation | BaseException | None] = [None] * n

    def client(i: int) -> None:
        try:
            gate.wait(CLIENT_TIMEOUT_S)
            out[i] = stream_chat(node.port, make_body(WORKLOADS[workloads[i]], f"{tag}.{i}"),
                                 f"{node.name} client {i} ({workloads[i]})",
                                 timeout=CLIENT_TIMEOUT_S, host=node.host)
        except BaseException as e:  # noqa: BLE001 - reported below, by client
            out[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    gate.wait(CLIENT_TIMEOUT_S)
    t0 = time.perf_counter()
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 10)
    wall = time.perf_counter() - t0
    for i, r in enumerate(out):
        if not isinstance(r, Generation):
            raise BenchError(f"{node.name} client {i}: {r or 'did not finish'}")
    return Round([(workloads[i], out[i]) for i in range(n)], wall)  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# The command


def run_concurrency_bench(args: argparse.Namespace, store: Any) -> int:
    n = args.concurrency
    ring_nodes = getattr(args, "nodes", 1)
    url = getattr(args, "url", None)
    url_node = node_at_url(url) if url else None  # a bad --url fails before anything starts
    resolved = store.resolve(args.model) if not url else None
    served = bool(resolved is not None and wants_served(resolved.card))
    if ring_nodes > 1 and (served or url):
        raise BenchError("--concurrency with --nodes runs MLX rings of agents started here "
                         "(not a llama-server card, not --url)")
    workloads = list(args.workloads)
    client_workloads = [workloads[i % len(workloads)] for i in range(n)]
    settings: dict[str, Any] = {
        "concurrency": n, "max_tokens": args.max_tokens, "runs": args.runs, "greedy": True,
        "workloads": workloads, "client_workloads": client_workloads,
        "order": "interleaved: round r of every arm and mode before round r+1",
        "aggregate": "completion tokens of a round / its wall time; median over rounds",
        "per_request": "median decode tok/s ((tokens - 1) / first to last token) over every "
                       "request", "ttft": "nearest-rank p50 and p99 over every request",
        "solo": "every workload once alone on the fifo agent (--url: on that node), per arm; "
                "every output must equal it (MLX; llama-server: not compared, each request "
                "has a system line of its own so that no slot serves a repeated prompt)",
    }
    if served:
        # Fetched here, once: agents started together would each fetch it into the same place.
        from skulkp2p.progress import ProgressBar
        from skulkp2p.served.child import ServedError
        from skulkp2p.served.child_config import resolve_gguf
        try:
            resolve_gguf(store, resolved.card, lambda label: ProgressBar(label, sys.stderr))
        except ServedError as e:
            raise BenchError(str(e)) from None
    tmp = Path(tempfile.mkdtemp(prefix="skulkp2p-concurrency-bench-"))
    nodes: dict[tuple[str, str], Node] = {}  # (arm, mode) -> node
    rings: dict[str, list[Node]] = {}  # mode -> its ring's agents (--nodes)
    started: list[Node] = []
    skipped: list[dict[str, str]] = []
    load_before = loadavg()
    try:
        if url_node is not None:
            nodes = {(arm, "url"): url_node for arm in ARMS}
            skipped.append({"arm": "fifo", "reason": "--url: the bench measures that node "
                                                     "only, with no FIFO baseline"})
            modes = ["url"]
        else:
            modes = ["batched", "fifo"]
            queue = ["--max-queue", str(max(16, 2 * n))]
            data_dir = getattr(args, "data_dir", None)
            for mode in modes:
                batch = ["--max-batch", str(n if mode == "batched" else 1)]
                if served:  # the child's speculation: one agent per arm
                    for arm in ARMS:
                        # no host-memory prompt cache (a repeated prompt would skip its
                        # prefill); each slot still keeps its last prompt, as llama-server does
                        env = {"LLAMA_ARG_CACHE_RAM": os.environ.get("LLAMA_ARG_CACHE_RAM",
                                                                     "0")}
                        if arm == "plain":
                            env[FORCE_NO_SPEC] = "1"
                        node = start_node(f"{arm}-{mode}", mode, args.model, data_dir,
                                           batch + queue, env, tmp)
                        started.append(node)
                        nodes[(arm, mode)] = node
                elif ring_nodes > 1:  # a ring of agents per mode, serving both arms
                    ring = start_ring(mode, ring_nodes, args.model, data_dir,
                                       batch + queue + ["--prefix-cache-mb", "0",
                                                        "--draft-memory-tokens", "0"], tmp)
                    started += ring
                    rings[mode] = ring
                else:  # the request's speculation: one agent serves both arms
                    node = start_node(mode, mode, args.model, data_dir,
                                       batch + queue + ["--prefix-cache-mb", "0",
                                                        "--draft-memory-tokens", "0"], {}, tmp)
                    started.append(node)
                    for arm in ARMS:
                        nodes[(arm, mode)] = node
        deadline = time.monotonic() + READY_TIMEOUT_S
        for node in dict.fromkeys([*nodes.values(), *(a for r in rings.values() for a in r)]):
            await_ready(node, deadline)
        for mode, ring in rings.items():
            last = place_ring(ring, resolved.id, deadline)
            for arm in ARMS:
                nodes[(arm, mode)] = last
            settings.setdefault("rings", {})[mode] = [a.name for a in ring]
        if served:  # and each agent's child directly, beside it
            for (arm, mode), node in list(nodes.items()):
                nodes[(arm, f"{mode}-direct")] = direct_node(node)
            modes += [f"{mode}-direct" for mode in modes]
        settings["agents"] = {node.name: node.args for node in dict.fromkeys(
            [*nodes.values(), *(a for r in rings.values() for a in r)])}
        ref_mode = "url" if url else "fifo"

        def body_for(arm: str, mode: str, max_tokens: int = args.max_tokens) -> MakeBody:
            def make(messages: list[dict[str, str]], tag: str) -> dict[str, Any]:
                if served:
                    # A system line of its own per request: llama-server's slots keep their
                    # last prompt, and -np N slots would keep N of the repeated prompts (a
                    # prefill skipped, for batched only). Our MLX agents run without caches.
                    messages = [{"role": "system", "content": f"Conversation {tag}."},
                                *messages]
                if mode.endswith("-direct"):  # what our proxy would send the child
                    return direct_body(messages, max_tokens)
                return _body(messages, max_tokens, None if served else MLX_SPECULATION[arm])
            return make

        warm = min(WARMUP_TOKENS, args.max_tokens)
        for (arm, mode), node in nodes.items():  # warm-up: every agent and arm once, short
            stream_chat(node.port, body_for(arm, mode, warm)(WARMUP_MESSAGES, "warm-up"),
                        f"{node.name} warm-up", timeout=CLIENT_TIMEOUT_S, host=node.host)
        # Every workload alone, per arm, on the fifo agent: the reference every output must
        # equal, and the 1-client TTFT.
        solo: dict[str, dict[str, Generation]] = {arm: {} for arm in ARMS}
        for arm in ARMS:
            node = nodes[(arm, ref_mode)]
            for wl in workloads:
                g = stream_chat(node.port, body_for(arm, ref_mode)(WORKLOADS[wl], f"solo.{wl}"),
                                f"{node.name} solo {wl}", timeout=CLIENT_TIMEOUT_S,
                                host=node.host)
                solo[arm][wl] = g
                log.info("solo %-5s %-10s %s tok/s, ttft %.3f s", arm, wl, fmt(g.tok_s, ".1f"),
                         g.ttft_s)
        rounds: dict[tuple[str, str], list[Round]] = {key: [] for key in nodes}
        # What each (arm, mode)'s agents' OpenBLAS thread policy did during its rounds (their
        # /metrics before and after each round; a ring: every stage's process).
        blas: dict[tuple[str, str], BlasPolicy | None] = dict.fromkeys(nodes)

        def policy_agents(arm: str, mode: str) -> list[tuple[str, int]]:
            if mode.endswith("-direct"):
                return []  # a llama-server child: no policy of ours runs there
            agents = rings.get(mode) or [nodes[(arm, mode)]]
            return [(a.host, a.port) for a in agents]

        mismatches: list[dict[str, Any]] = []
        for r in range(args.runs):
            for arm in ARMS:
                for mode in modes:
                    before = read_all(policy_agents(arm, mode))
                    rnd = run_round(nodes[(arm, mode)], body_for(arm, mode), client_workloads,
                                    f"{r}.{arm}.{mode}")
                    blas[(arm, mode)] = accumulate(blas[(arm, mode)], before,
                                                   read_all(policy_agents(arm, mode)))
                    rounds[(arm, mode)].append(rnd)
                    for i, (wl, g) in enumerate(rnd.generations):
                        if not served and g.text != solo[arm][wl].text:
                            mismatches.append({"arm": arm, "mode": mode, "round": r,
                                               "client": i, "workload": wl,
                                               "solo": solo[arm][wl].text[:200],
                                               "got": g.text[:200]})
                    log.info("round %d/%d %-5s %-7s aggregate %s tok/s, wall %.2f s", r + 1,
                             args.runs, arm, mode, fmt(rnd.aggregate_tok_s, ".1f"), rnd.wall_s)
    except BaseException:
        if started:
            log.error("agent logs kept in %s", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for node in started:
            stop_node(node)
    shutil.rmtree(tmp, ignore_errors=True)

    results = []
    for arm in ARMS:
        solo_ttft = statistics.median(g.ttft_s for g in solo[arm].values())
        order = ["url"] if url else ["fifo", "batched"] + (
            ["fifo-direct", "batched-direct"] if served else [])
        fifo = None
        for mode in order:
            row = {"arm": arm, "mode": mode,
                   "max_batch": None if url else (n if mode.startswith("batched") else 1),
                   **summarize_cell(rounds[(arm, mode)], solo_ttft),
                   "solo_ttft_s": round(solo_ttft, 4)}
            policy = blas[(arm, mode)]
            row["blas"] = policy.to_json() if policy is not None else None
            if mode.startswith("fifo"):
                fifo = row["aggregate_tok_s"]
            elif mode.startswith("batched") and fifo and row["aggregate_tok_s"]:
                row["speedup_vs_fifo"] = round(row["aggregate_tok_s"] / fifo, 2)
            results.append(row)
    doc = {
        "complete": True,
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": loadavg()},
        "engine": "llama_server" if served else ("mlx" if not url else "url"),
        "model": {"id": resolved.id if resolved is not None else None, "url": url},
        "settings": settings,
        "solo": {arm: {wl: {"text": g.text[:400], "tokens": g.tokens,
                            "ttft_s": round(g.ttft_s, 4), "tok_s": round_or_none(g.tok_s, 2)}
                       for wl, g in solo[arm].items()} for arm in ARMS},
        "results": results,
        # llama-server: every request has a prompt of its own (see body_for), and llama.cpp's
        # greedy text moves with its batch and cache state anyway (the served bench found the
        # same between its plain and speculative decode): not compared.
        "outputs_equal_solo": None if served else not mismatches,
        "mismatches": mismatches,
        "skipped": skipped,
    }
    write_document(doc, markdown_table(doc), args.json_out)
    if mismatches:
        raise BenchError(f"{len(mismatches)} concurrent outputs differ from the same request "
                         f"served alone (first: {mismatches[0]['arm']} {mismatches[0]['mode']} "
                         f"{mismatches[0]['workload']})")
    return 0


def refuse_other_modes(args: argparse.Namespace) -> None:
    """--concurrency measures agents over HTTP: the in-process options do not apply."""
    for flag, given in (("--agent", getattr(args, "agent", False)),
                        ("--widths", getattr(args, "widths", False)),
                        ("--parallel tensor", getattr(args, "parallel", "") == "tensor"),
                        ("--link-delay-ms", bool(getattr(args, "link_delay_ms", 0))),
                        ("--arms", bool(getattr(args, "arms", None))),
                        ("--plot", bool(getattr(args, "plot", None))),
                        ("--draft-model", bool(getattr(args, "draft_model", None))),
                        ("--engine served", getattr(args, "engine", "mlx") == "served")):
        if given:
            raise BenchError(f"{flag} does not apply to --concurrency (its arms are plain and "
                             "spec, batched against fifo, over HTTP; a llama-server card is "
                             "recognised from its card)")
