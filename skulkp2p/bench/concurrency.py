"""`python -m skulkp2p bench --concurrency N`: N clients at once through HTTP, batched against FIFO.

The bench starts its own agents (`python -m skulkp2p join` on 127.0.0.1, real sockets): one
with `--max-batch N` ("batched") and one with `--max-batch 1` ("fifo", today's one-at-a-time
worker), side by side in the same run, or measures a running node given by `--url` (no FIFO
baseline then). Each round, N client threads are released together; client i streams workload
i mod W of `--workloads` (so the clients ask different things) as a greedy chat completion.

Arms: `plain` and `spec`. For an MLX card they are the request's `speculation` (`"off"`,
`"auto"`), so one agent per mode serves both; for a llama-server card speculation is the
child's configuration, so each (arm, mode) gets its own agent, `plain` with
SKULKP2P_LLAMA_SERVER_FORCE_NO_SPEC=1. The MLX agents run with the prefix cache and the draft
memory off: the rounds repeat the same prompts, which would otherwise be served from the
caches of earlier rounds.

Per (arm, mode): aggregate tok/s (completion tokens of the round over its wall time, from the
release of the clients to the last token; median over `--runs` rounds), per-request decode
tok/s (median over every request), time to first token p50 and p99 (nearest rank over every
request), and the speedup of batched over fifo. Before the rounds every workload is served once
alone on the fifo agent (per arm): every output of every round must equal that solo output, or
the command fails after writing its document. Rounds are interleaved (round r of every arm and
mode before round r+1).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skulkp2p.bench.errors import BenchError
from skulkp2p.bench.report import fmt, loadavg, machine_info, round_or_none, write_document
from skulkp2p.bench.served import stream_chat
from skulkp2p.bench.served_report import Generation
from skulkp2p.bench.workloads import WARMUP_MESSAGES, WARMUP_TOKENS, WORKLOADS
from skulkp2p.served.child import _die_with_parent, free_port
from skulkp2p.served.model import FORCE_NO_SPEC, wants_served

log = logging.getLogger("skulkp2p.bench")

ARMS = ("plain", "spec")
MLX_SPECULATION = {"plain": "off", "spec": "auto"}
READY_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 600.0  # one request of a round; a stalled node ends the bench, never hangs


@dataclass(eq=False)  # one agent is one object: hashed by identity
class Node:
    """One agent the clients talk to: started here (proc) or given by --url."""

    name: str  # "plain-batched", "batched", "url", ...
    mode: str  # "batched" | "fifo" | "url"
    host: str
    port: int
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    args: list[str] = field(default_factory=list)

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            text = ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return " | ".join(lines[-3:])[-600:] or "(no output)"


def _start_node(name: str, mode: str, model: str, data_dir: str | None, extra: list[str],
                env_extra: dict[str, str], tmp: Path) -> Node:
    import skulkp2p

    port = free_port()
    env = dict(os.environ)
    env.pop(FORCE_NO_SPEC, None)
    env.update(env_extra)
    root = str(Path(skulkp2p.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    args = ["join", "--model", model, "--http-port", str(port), "--port", "0",
            "--name", f"bench-{name}", *extra]
    if data_dir:
        args += ["--data-dir", data_dir]
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as err:
        # dies with the bench even on kill -9 (a llama-server child goes with its agent)
        proc = subprocess.Popen([sys.executable, "-m", "skulkp2p", "--log-level", "info", *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=env, preexec_fn=_die_with_parent)
    log.info("agent %s: pid %d, http port %d, log %s", name, proc.pid, port, log_path)
    return Node(name, mode, "127.0.0.1", port, proc, log_path, args)


def _health(node: Node) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{node.host}:{node.port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def _await_ready(node: Node, deadline: float) -> None:
    while _health(node) != 200:
        if node.proc is not None and node.proc.poll() is not None:
            raise BenchError(f"agent {node.name} exited with status {node.proc.returncode}: "
                             f"{node.log_tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"agent {node.name} not ready after {READY_TIMEOUT_S:.0f} s: "
                             f"{node.log_tail()}")
        time.sleep(0.2)


def _stop_node(node: Node) -> None:
    """SIGTERM (the agent stops its llama-server child too), SIGKILL if it lingers."""
    proc = node.proc
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _url_node(url: str) -> Node:
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise BenchError(f"--url must be http://HOST:PORT of a node, got {url!r}")
    return Node("url", "url", parts.hostname, parts.port or 80)


# --------------------------------------------------------------------------------------------
# One round: N clients released together


@dataclass
class Round:
    generations: list[tuple[str, Generation]]  # (workload, generation) per client
    wall_s: float

    @property
    def aggregate_tok_s(self) -> float | None:
        tokens = sum(g.tokens for _, g in self.generations)
        return tokens / self.wall_s if self.wall_s > 0 else None


def _body(messages: list[dict[str, str]], max_tokens: int, speculation: str | None
          ) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if speculation is not None:
        body["speculation"] = speculation
    return body


def run_round(node: Node, speculation: str | None, workloads: list[str], max_tokens: int
              ) -> Round:
    """len(workloads) clients, each its own thread and connection, released at once."""
    n = len(workloads)
    gate = threading.Barrier(n + 1)
    out: list[Generation | BaseException | None] = [None] * n

    def client(i: int) -> None:
        try:
            gate.wait(CLIENT_TIMEOUT_S)
            out[i] = stream_chat(node.port, _body(WORKLOADS[workloads[i]], max_tokens,
                                                  speculation),
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
# Numbers


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def summarize_cell(rounds: list[Round], solo_ttft: float | None) -> dict[str, Any]:
    gens = [g for r in rounds for _, g in r.generations]
    aggs = [a for r in rounds if (a := r.aggregate_tok_s) is not None]
    per_request = [g.tok_s for g in gens if g.tok_s is not None]
    ttfts = [g.ttft_s for g in gens]
    p99 = percentile(ttfts, 99)
    row: dict[str, Any] = {
        "rounds": len(rounds), "requests": len(gens),
        "aggregate_tok_s": round_or_none(statistics.median(aggs) if aggs else None, 2),
        "aggregate_tok_s_runs": [round(a, 2) for a in aggs],
        "per_request_tok_s": round_or_none(
            statistics.median(per_request) if per_request else None, 2),
        "ttft_p50_s": round_or_none(percentile(ttfts, 50), 4),
        "ttft_p99_s": round_or_none(p99, 4),
        "ttft_p99_over_solo": round_or_none(p99 / solo_ttft if p99 and solo_ttft else None, 2),
        "wall_s": [round(r.wall_s, 3) for r in rounds],
        "tokens": sum(g.tokens for g in gens),
    }
    drafted = [g.drafted for g in gens if g.drafted is not None]
    if drafted:
        accepted = sum(g.accepted or 0 for g in gens)
        row.update(drafted=sum(drafted), accepted=accepted,
                   acceptance=round_or_none(accepted / sum(drafted) if sum(drafted) else None,
                                            3))
    return row


def markdown_table(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    lines = [f"\nbench --concurrency {s['concurrency']}: {doc['model']['id']} "
             f"({doc['engine']}), {s['max_tokens']} tokens, {s['runs']} rounds, clients: "
             f"{', '.join(s['client_workloads'])}\n",
             "| arm | mode | aggregate tok/s | x fifo | per-request tok/s | TTFT p50 | TTFT p99 "
             "| p99 / solo |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in doc["results"]:
        lines.append(f"| {row['arm']} | {row['mode']} | {fmt(row['aggregate_tok_s'], '.1f')} | "
                     f"{fmt(row.get('speedup_vs_fifo'), '.2f')} | "
                     f"{fmt(row['per_request_tok_s'], '.1f')} | "
                     f"{fmt(row['ttft_p50_s'], '.3f')} | {fmt(row['ttft_p99_s'], '.3f')} | "
                     f"{fmt(row['ttft_p99_over_solo'], '.2f')} |")
    if doc["mismatches"]:
        lines.append(f"\nMISMATCHES (output differs from solo): {len(doc['mismatches'])}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# The command


def run_concurrency_bench(args: argparse.Namespace, store: Any) -> int:
    n = args.concurrency
    url = getattr(args, "url", None)
    url_node = _url_node(url) if url else None  # a bad --url fails before anything starts
    resolved = store.resolve(args.model) if not url else None
    served = bool(resolved is not None and wants_served(resolved.card))
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
                "every output must equal it (llama-server: its own agent's solo output, and a "
                "difference is recorded, not fatal)",
    }
    if served:
        # Fetched here, once: agents started together would each fetch it into the same place.
        from skulkp2p.progress import ProgressBar
        from skulkp2p.served.child import ServedError
        from skulkp2p.served.model import resolve_gguf
        try:
            resolve_gguf(store, resolved.card, lambda label: ProgressBar(label, sys.stderr))
        except ServedError as e:
            raise BenchError(str(e)) from None
    tmp = Path(tempfile.mkdtemp(prefix="skulkp2p-concurrency-bench-"))
    nodes: dict[tuple[str, str], Node] = {}  # (arm, mode) -> node
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
                        node = _start_node(f"{arm}-{mode}", mode, args.model, data_dir,
                                           batch + queue, env, tmp)
                        started.append(node)
                        nodes[(arm, mode)] = node
                else:  # the request's speculation: one agent serves both arms
                    node = _start_node(mode, mode, args.model, data_dir,
                                       batch + queue + ["--prefix-cache-mb", "0",
                                                        "--draft-memory-tokens", "0"], {}, tmp)
                    started.append(node)
                    for arm in ARMS:
                        nodes[(arm, mode)] = node
        deadline = time.monotonic() + READY_TIMEOUT_S
        for node in dict.fromkeys(nodes.values()):
            _await_ready(node, deadline)
        settings["agents"] = {node.name: node.args for node in dict.fromkeys(nodes.values())}
        ref_mode = "url" if url else "fifo"

        def speculation(arm: str) -> str | None:
            return None if served else MLX_SPECULATION[arm]

        warm = min(WARMUP_TOKENS, args.max_tokens)
        for (arm, _mode), node in nodes.items():  # warm-up: every agent and arm once, short
            stream_chat(node.port, _body(WARMUP_MESSAGES, warm, speculation(arm)),
                        f"{node.name} warm-up", timeout=CLIENT_TIMEOUT_S, host=node.host)
        # Every workload alone, per arm: on the fifo agent (the reference every output must
        # equal), and for llama-server also on each agent itself (llama.cpp is not batch- or
        # cache-invariant: its own solo output is what a round is compared with there).
        solo: dict[str, dict[str, Generation]] = {arm: {} for arm in ARMS}
        own_solo: dict[tuple[str, str], dict[str, Generation]] = {}
        for (arm, mode), node in nodes.items():
            if mode != ref_mode and not served:
                continue
            own_solo[(arm, mode)] = {}
            for wl in workloads:
                g = stream_chat(node.port, _body(WORKLOADS[wl], args.max_tokens,
                                                 speculation(arm)),
                                f"{node.name} solo {wl}", timeout=CLIENT_TIMEOUT_S,
                                host=node.host)
                own_solo[(arm, mode)][wl] = g
                log.info("solo %-5s %-7s %-10s %s tok/s, ttft %.3f s", arm, mode, wl,
                         fmt(g.tok_s, ".1f"), g.ttft_s)
            if mode == ref_mode:
                solo[arm] = own_solo[(arm, mode)]
        rounds: dict[tuple[str, str], list[Round]] = {key: [] for key in nodes}
        mismatches: list[dict[str, Any]] = []
        for r in range(args.runs):
            for arm in ARMS:
                for mode in modes:
                    rnd = run_round(nodes[(arm, mode)], speculation(arm), client_workloads,
                                    args.max_tokens)
                    rounds[(arm, mode)].append(rnd)
                    ref = own_solo[(arm, mode)] if served else solo[arm]
                    for i, (wl, g) in enumerate(rnd.generations):
                        if g.text != ref[wl].text:
                            mismatches.append({"arm": arm, "mode": mode, "round": r,
                                               "client": i, "workload": wl,
                                               "solo": ref[wl].text[:200],
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
            _stop_node(node)
    shutil.rmtree(tmp, ignore_errors=True)

    results = []
    for arm in ARMS:
        solo_ttft = statistics.median(g.ttft_s for g in solo[arm].values())
        fifo = None
        for mode in (["fifo", "batched"] if not url else ["url"]):
            row = {"arm": arm, "mode": mode, "max_batch": {"batched": n, "fifo": 1}.get(mode),
                   **summarize_cell(rounds[(arm, mode)], solo_ttft),
                   "solo_ttft_s": round(solo_ttft, 4)}
            if mode == "fifo":
                fifo = row["aggregate_tok_s"]
            elif fifo and row["aggregate_tok_s"]:
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
        "outputs_equal_solo": not mismatches,
        "mismatches": mismatches,
        "skipped": skipped,
    }
    write_document(doc, markdown_table(doc), args.json_out)
    if mismatches and served:
        # llama.cpp's greedy text moves with its batch and cache state (the served bench found
        # the same between its plain and speculative decode): recorded, not our failure.
        log.warning("%d outputs of llama-server differ from its own solo output (recorded in "
                    "the document: llama.cpp is not batch-invariant)", len(mismatches))
    elif mismatches:
        raise BenchError(f"{len(mismatches)} concurrent outputs differ from the same request "
                         f"served alone (first: {mismatches[0]['arm']} {mismatches[0]['mode']} "
                         f"{mismatches[0]['workload']})")
    return 0


def refuse_other_modes(args: argparse.Namespace) -> None:
    """--concurrency measures agents over HTTP: the in-process options do not apply."""
    for flag, given in (("--agent", getattr(args, "agent", False)),
                        ("--widths", getattr(args, "widths", False)),
                        ("--nodes", getattr(args, "nodes", 1) != 1),
                        ("--arms", bool(getattr(args, "arms", None))),
                        ("--plot", bool(getattr(args, "plot", None))),
                        ("--draft-model", bool(getattr(args, "draft_model", None))),
                        ("--engine served", getattr(args, "engine", "mlx") == "served")):
        if given:
            raise BenchError(f"{flag} does not apply to --concurrency (its arms are plain and "
                             "spec, batched against fifo, over HTTP; a llama-server card is "
                             "recognised from its card)")

