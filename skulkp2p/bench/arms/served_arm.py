"""`python -m skulkp2p bench --engine served`: the served engine measured two ways at once.

1. Its speculation: `served-plain` (the child started with SKULKP2P_LLAMA_SERVER_FORCE_NO_SPEC=1)
   against `served-spec` (the card's own speculation flags).
2. Our layer's cost: every arm is asked through our proxy (a real agent, `python -m skulkp2p
   join`, on 127.0.0.1) and directly at the port of that same agent's llama-server child, with
   the body our proxy would send (`child_body`), so both paths ask for the same generation.

Two agents run side by side (one per arm, each with its own child); requests go one at a time.
Runs are interleaved (run r of every workload and arm before run r+1) and the order of proxy and
direct flips every run, so noise on a shared machine hits both paths alike. Before each measured
request a short, different request goes to the same child, and the agents start their children
with LLAMA_ARG_CACHE_RAM=0 (unless set): every measured request then finds the same cache state,
no prompt served from a previous arm's run (TTFT would be a cache hit otherwise).

Timings are client-side, over streamed chat completions: TTFT from sending the request to the
first text; decode tok/s = (completion tokens - 1) / (time from first to last text). Proxy
overhead per workload: (direct - proxy) / direct on median decode tok/s and (proxy - direct) /
direct on median TTFT, so positive numbers are what our layer costs (`served_report.py`). Greedy
text through the proxy must equal the direct text, run by run; a mismatch is recorded and fails
the command.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skulkp2p.bench.arms.http_agents import stop_process
from skulkp2p.bench.arms.served_report import (
    PLAIN,
    SPEC,
    Generation,
    markdown_tables,
    path_arm,
    summarize,
)
from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.report import fmt, loadavg, machine_info, write_atomic, write_document
from skulkp2p.bench.workloads import WARMUP_MESSAGES, WARMUP_TOKENS, WORKLOADS
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.served.binary import detect_compute, find_binary
from skulkp2p.served.child import ServedError, _die_with_parent, free_port
from skulkp2p.served.child_config import FORCE_NO_SPEC, resolve_gguf, wants_served
from skulkp2p.served.served_engine import child_body

log = logging.getLogger("skulkp2p.bench")

CACHE_RAM_ENV = "LLAMA_ARG_CACHE_RAM"  # llama-server's own variable for --cache-ram
THREADS_ENV = "SKULKP2P_LLAMA_SERVER_THREADS"
AGENT_READY_TIMEOUT_S = 240.0
READ_TIMEOUT_S = 300.0  # a stalled server ends the bench with an error, never a hang
_READY = re.compile(r"ready: model \S+ served by llama-server \(pid (\d+)")


# --------------------------------------------------------------------------------------------
# Which bench runs


def dispatch(args: argparse.Namespace, store: Any) -> int | None:
    """Run the served bench for `--engine served`; refuse a served card without it. None: the
    MLX bench goes on."""
    resolved = store.resolve(args.model)
    served = wants_served(resolved.card)
    if getattr(args, "engine", "mlx") != "served":
        if served:
            raise BenchError(f"card {resolved.id} is served by llama-server: run the bench with "
                             "--engine served")
        return None
    if not served:
        raise BenchError(f"--engine served needs a card with placement.engine = "
                         f"\"llama_server\" (e.g. smollm2-135m-gguf); {args.model!r} is not one")
    return run_served_bench(args, store, resolved.card)


def _refuse_mlx_options(args: argparse.Namespace) -> None:
    for flag, given in (("--arms", bool(getattr(args, "arms", None))),
                        ("--draft-model", bool(getattr(args, "draft_model", None))),
                        ("--dtype", bool(getattr(args, "dtype", None))),
                        ("--nodes", getattr(args, "nodes", 1) != 1),
                        ("--link-delay-ms", bool(getattr(args, "link_delay_ms", 0.0))),
                        ("--widths", bool(getattr(args, "widths", False))),
                        ("--plot", bool(getattr(args, "plot", None)))):
        if given:
            raise BenchError(f"{flag} does not apply to --engine served (its arms are "
                             f"{PLAIN} and {SPEC}, each through our proxy and direct)")


# --------------------------------------------------------------------------------------------
# One streamed generation, the same client for both paths


def stream_chat(port: int, body: dict[str, Any], where: str,
                timeout: float = READ_TIMEOUT_S, host: str = "127.0.0.1") -> Generation:
    """POST a streamed chat completion to host:port; time it as a client sees it."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    parts: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    t_first = t_last = None
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"{where}: HTTP {resp.status}: "
                             f"{resp.read()[:300].decode('utf-8', 'replace')}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators and keep-alive comments
            data = line[5:].strip()
            if data == b"[DONE]":
                break  # read no further: the connection may be kept alive
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"{where}: {json.dumps(event['error'])[:300]}")
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
            spec = event.get("speculation") or spec
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    parts.append(piece)
    except (OSError, http.client.HTTPException) as e:  # socket.timeout is an OSError
        raise BenchError(f"{where}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    end = t_last or time.perf_counter()
    tokens = int(usage.get("completion_tokens") or timings.get("predicted_n") or 0)
    gen = Generation(text="".join(parts), tokens=tokens, ttft_s=(t_first or end) - t0,
                     decode_s=end - (t_first or end),
                     prompt_tokens=usage.get("prompt_tokens") or timings.get("prompt_n"))
    if spec:  # our proxy: the child's counts, already ours
        gen.drafted, gen.accepted = int(spec.get("drafted", 0)), int(spec.get("accepted", 0))
    elif "draft_n" in timings:  # llama-server direct
        gen.drafted = int(timings.get("draft_n") or 0)
        gen.accepted = int(timings.get("draft_n_accepted") or 0)
    return gen


def _request_json(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}


def proxy_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {**_request_json(messages, max_tokens), "stream": True,
            "stream_options": {"include_usage": True}}


def direct_body(messages: list[dict[str, str]], max_tokens: int,
                schema: dict | None = None) -> dict[str, Any]:
    """What our proxy sends the child for proxy_body(...); with `schema`, for that request
    constrained to it (the child's `json_schema`)."""
    body = _request_json(messages, max_tokens)
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "bench", "schema": schema}}
    return child_body(parse_request(body), max_tokens)


# --------------------------------------------------------------------------------------------
# The agents (one per arm) and their children


@dataclass
class Agent:
    arm: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    child_pid: int | None = None
    child_port: int | None = None
    child_args: list[str] = field(default_factory=list)
    flushes: int = 0

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def _start_agent(arm: str, card_id: str, data_dir: str | None, tmp: Path) -> Agent:
    import skulkp2p

    port = free_port()
    env = dict(os.environ)
    env.pop(FORCE_NO_SPEC, None)
    env.pop("SKULKP2P_API_KEY", None)  # the bench's own agent on loopback: no key to send
    if arm == PLAIN:
        env[FORCE_NO_SPEC] = "1"
    env.setdefault(CACHE_RAM_ENV, "0")
    root = str(Path(skulkp2p.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # One slot (--max-batch 1): the flush request before each measured one must evict the
    # slot's cached prompt; with several slots it lands in another and the measured request
    # would be served from the cache its twin (proxy or direct) left.
    cmd = [sys.executable, "-m", "skulkp2p", "--log-level", "info", "join", "--model", card_id,
           "--http-port", str(port), "--port", "0", "--name", f"bench-{arm}", "--max-batch", "1",
           "--no-cluster-state"]  # a throwaway cluster: no plan of an earlier run comes back
    if data_dir:
        cmd += ["--data-dir", data_dir]
    log_path = tmp / f"{arm}.log"
    with open(log_path, "wb") as err:
        # dies with the bench even on kill -9 (and its child with it); Ctrl-C is the bench's
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=env, preexec_fn=_die_with_parent)
    log.info("agent for %s: pid %d, http port %d, log %s", arm, proc.pid, port, log_path)
    return Agent(arm, proc, port, log_path)


def _last_lines(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-600:] or "(no output)"


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    except OSError:
        pass
    try:  # no /proc (macOS): ps shows the arguments, space-joined (our paths have none)
        out = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []


def _await_agent(agent: Agent, deadline: float) -> None:
    """Until the agent says its child is ready; then find the child's port from its command
    line (the agent picked it) and check the child answers there."""
    while True:
        text = agent.text()
        m = _READY.search(text)
        if m:
            break
        failed = [ln for ln in text.splitlines()
                  if "failed to load" in ln or "skulkp2p: error:" in ln]
        if failed:
            raise BenchError(f"agent for {agent.arm}: {failed[-1].strip()[-600:]}")
        if agent.proc.poll() is not None:
            raise BenchError(f"agent for {agent.arm} exited with status {agent.proc.returncode}:"
                             f" {_last_lines(text)}")
        if time.monotonic() > deadline:
            raise BenchError(f"agent for {agent.arm} not ready after "
                             f"{AGENT_READY_TIMEOUT_S:.0f} s: {_last_lines(text)}")
        time.sleep(0.1)
    agent.child_pid = int(m.group(1))
    args = _cmdline(agent.child_pid)
    if "--port" not in args:
        raise BenchError(f"agent for {agent.arm}: cannot read the port of its llama-server "
                         f"(pid {agent.child_pid})")
    agent.child_port = int(args[args.index("--port") + 1])
    agent.child_args = args[1:]
    try:
        with contextlib.closing(socket.create_connection(("127.0.0.1", agent.child_port), 10)):
            pass
    except OSError as e:
        raise BenchError(f"agent for {agent.arm}: its llama-server (pid {agent.child_pid}) does "
                         f"not answer on port {agent.child_port}: {e}") from None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _stop_agent(agent: Agent) -> None:
    """SIGTERM (the agent stops its child), SIGKILL if it lingers; then make sure the child is
    gone too, by its pid (PR_SET_PDEATHSIG should already have taken it)."""
    stop_process(agent.proc)
    pid = agent.child_pid
    if pid is None:
        return
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid) and "llama" in " ".join(_cmdline(pid)[:1]):
        log.warning("llama-server pid %d outlived its agent; killing it", pid)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# The measurement


def _measure(agent: Agent, path: str, messages: list[dict[str, str]], max_tokens: int
             ) -> Generation:
    # A short, different request first: the child's slot then holds another prompt, so this
    # one is not served from the cache of the previous run (of the other path).
    agent.flushes += 1
    stream_chat(agent.child_port, direct_body(
        [{"role": "user", "content": f"Say the number {agent.flushes}."}], 1),
        f"{agent.arm} cache flush")
    cpu0 = (_cpu_s(agent.proc.pid), _cpu_s(agent.child_pid))
    if path == "proxy":
        gen = stream_chat(agent.port, proxy_body(messages, max_tokens),
                          f"{agent.arm} through our proxy")
    else:
        gen = stream_chat(agent.child_port, direct_body(messages, max_tokens),
                          f"{agent.arm} llama-server direct")
    cpu1 = (_cpu_s(agent.proc.pid), _cpu_s(agent.child_pid))
    if None not in cpu0 and None not in cpu1:
        gen.agent_cpu_s, gen.child_cpu_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return gen


def _cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere). Noise on a
    shared machine changes wall times, hardly the CPU a request costs: the proxy's own cost."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _version(binary: Path) -> str | None:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines()
             if ln.strip().startswith(("version", "built"))]
    return "; ".join(lines) or None


def run_served_bench(args: argparse.Namespace, store: Any, card: Any) -> int:
    _refuse_mlx_options(args)
    binary = find_binary()
    if binary is None:
        raise BenchError(f"card {card.id} needs llama-server: install skulkp2p[served] or set "
                         "SKULKP2P_LLAMA_SERVER_BIN")
    from skulkp2p.progress import ProgressBar

    try:  # fetched here, once, with a progress bar; the agents then find it in place
        gguf = resolve_gguf(store, card, lambda label: ProgressBar(label, sys.stderr))
    except ServedError as e:
        raise BenchError(str(e)) from None
    load_before = loadavg()
    skipped: list[dict[str, Any]] = []
    spec_type = card.placement.get("served_spec_type", "none")
    arms = [PLAIN]
    if spec_type == "none":
        skipped.append({"arm": SPEC, "reason": f"card {card.id} has no speculation "
                                                "(served_spec_type none)"})
    else:
        arms.append(SPEC)
    workloads = list(args.workloads)
    cells: dict[tuple[str, str, str], list[Generation]] = {
        (wl, a, p): [] for wl in workloads for a in arms for p in ("proxy", "direct")}
    prompt_tokens: dict[str, int | None] = {}
    warm = min(WARMUP_TOKENS, args.max_tokens)
    agents: list[Agent] = []
    tmp = Path(tempfile.mkdtemp(prefix="skulkp2p-served-bench-"))
    engine = {"name": "llama_server", "binary": str(binary), "version": _version(binary),
              "compute": list(detect_compute(binary)), "spec_type": spec_type,
              "threads_env": os.environ.get(THREADS_ENV),
              "cache_ram_env": os.environ.get(CACHE_RAM_ENV, "0"), "child_args": {},
              "processes": {}}
    settings = {
        "max_tokens": args.max_tokens, "runs": args.runs, "statistic": "median",
        "warmup": f"each arm and path once, {warm} tokens",
        "order": "interleaved: run r of every workload and arm before run r+1; proxy and "
                 "direct swap places every run",
        "cache": "before each measured request a short different request to the same child; "
                 f"children started with {CACHE_RAM_ENV}={engine['cache_ram_env']}",
        "greedy": True, "chat_template": True, "workloads": workloads,
        "arms": [path_arm(a, p) for a in arms for p in ("proxy", "direct")],
        "proxy": "python -m skulkp2p join on 127.0.0.1 (our HTTP server and proxy), its "
                 "llama-server child asked directly for the direct path",
        "overhead": "(direct - proxy) / direct on median decode tok/s; (proxy - direct) / "
                    "direct on median TTFT: positive = our layer's cost; workload 'all': "
                    "total tokens / total decode seconds and mean TTFT over every workload",
    }

    def document(complete: bool) -> tuple[dict[str, Any], list[str]]:
        results, overhead, mismatched = summarize(cells, arms, workloads)
        plain_text = {wl: cells[(wl, PLAIN, "direct")][0].text[:400]
                      for wl in workloads if cells[(wl, PLAIN, "direct")]}
        return {
            "complete": complete,
            "machine": {**machine_info(), "loadavg_before": load_before,
                        "loadavg_after": loadavg()},
            "engine": engine,
            "model": {"id": card.id, "path": str(gguf), "dtype": "gguf"},
            "settings": {**settings, "prompt_tokens": prompt_tokens, "plain_text": plain_text},
            "results": results,
            "proxy_overhead": overhead,
            "skipped": skipped,
        }, mismatched

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally that stops the agents

    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        data_dir = getattr(args, "data_dir", None)
        for arm in arms:  # appended one by one: a failed start still stops the others
            agents.append(_start_agent(arm, card.id, data_dir, tmp))
        deadline = time.monotonic() + AGENT_READY_TIMEOUT_S
        for agent in agents:
            _await_agent(agent, deadline)
            engine["child_args"][agent.arm] = agent.child_args
            engine["processes"][agent.arm] = {"agent_pid": agent.proc.pid,
                                              "child_pid": agent.child_pid,
                                              "child_port": agent.child_port}
        by_arm = {a.arm: a for a in agents}
        for agent in agents:  # warm-up: each arm and path once, short
            for path in ("proxy", "direct"):
                _measure(agent, path, WARMUP_MESSAGES, warm)
        for r in range(args.runs):
            paths = ("proxy", "direct") if r % 2 == 0 else ("direct", "proxy")
            for wl in workloads:
                for arm in arms:
                    for path in paths:
                        gen = _measure(by_arm[arm], path, WORKLOADS[wl], args.max_tokens)
                        cells[(wl, arm, path)].append(gen)
                        if path == "direct" and gen.prompt_tokens:
                            prompt_tokens[wl] = gen.prompt_tokens
                        log.info("run %d/%d %-10s %-20s %s tok/s, ttft %.3fs%s", r + 1,
                                 args.runs, wl, path_arm(arm, path), fmt(gen.tok_s, ".2f"),
                                 gen.ttft_s, "" if gen.drafted is None
                                 else f", accepted {gen.accepted}/{gen.drafted}")
                        if args.json_out:  # a bench killed by a time limit keeps its runs
                            write_atomic(Path(args.json_out),
                                          json.dumps(document(False)[0], indent=2) + "\n")
    except BaseException:
        log.error("agent logs kept in %s", tmp)
        raise
    finally:
        for agent in agents:
            _stop_agent(agent)
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    shutil.rmtree(tmp, ignore_errors=True)

    doc, mismatched = document(True)
    write_document(doc, markdown_tables(doc), args.json_out)
    if mismatched:
        raise BenchError("greedy output through our proxy differs from llama-server direct "
                         f"for {', '.join(mismatched)}")
    return 0
