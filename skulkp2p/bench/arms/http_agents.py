"""The `join` agents `bench --concurrency` measures: started here on 127.0.0.1 (one agent, or a
ring of K agents forming a cluster of their own), waited on until they serve, asked over HTTP, and
stopped by pid; or a running node given by `--url`. A served agent's llama-server child can be
asked directly too (its port read from the agent's log)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skulkp2p.bench.bench_error import BenchError
from skulkp2p.served.child import _die_with_parent, free_port
from skulkp2p.served.child_config import FORCE_NO_SPEC

log = logging.getLogger("skulkp2p.bench")

READY_TIMEOUT_S = 300.0
_CHILD_READY = re.compile(r"llama-server for \S+ ready on http://127\.0\.0\.1:(\d+) ")


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


def start_node(name: str, mode: str, model: str, data_dir: str | None, extra: list[str],
                env_extra: dict[str, str], tmp: Path) -> Node:
    import skulkp2p

    port = free_port()
    env = dict(os.environ)
    env.pop(FORCE_NO_SPEC, None)
    env.pop("SKULKP2P_API_KEY", None)  # the bench's own agent on loopback: no key to send
    env.update(env_extra)
    root = str(Path(skulkp2p.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    args = ["join", "--model", model, "--http-port", str(port), "--port", "0",
            "--name", f"bench-{name}", "--no-cluster-state", *extra]  # a throwaway cluster
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


def health(node: Node) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{node.host}:{node.port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def await_ready(node: Node, deadline: float) -> None:
    while health(node) != 200:
        if node.proc is not None and node.proc.poll() is not None:
            raise BenchError(f"agent {node.name} exited with status {node.proc.returncode}: "
                             f"{node.log_tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"agent {node.name} not ready after {READY_TIMEOUT_S:.0f} s: "
                             f"{node.log_tail()}")
        time.sleep(0.2)


def stop_node(node: Node) -> None:
    """SIGTERM (the agent stops its llama-server child too), SIGKILL if it lingers."""
    if node.proc is not None:
        stop_process(node.proc)


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM an agent's process, SIGKILL it if it lingers past `grace_s`; reaped either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def direct_node(node: Node) -> Node:
    """The llama-server child of a served agent, asked directly (its port from the agent's
    log): what its parallel slots do without our worker and proxy in between."""
    m = None
    if node.log_path is not None:
        m = _CHILD_READY.search(node.log_path.read_text(errors="replace"))
    if m is None:
        raise BenchError(f"agent {node.name}: cannot find the port of its llama-server in its "
                         f"log: {node.log_tail()}")
    return Node(f"{node.name}-direct", f"{node.mode}-direct", "127.0.0.1", int(m.group(1)),
                args=["(its llama-server child, asked directly)"])


def node_at_url(url: str) -> Node:
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise BenchError(f"--url must be http://HOST:PORT of a node, got {url!r}")
    return Node("url", "url", parts.hostname, parts.port or 80)


def http_json(node: Node, method: str, path: str, body: dict[str, Any] | None = None
               ) -> tuple[int, Any]:
    import json

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{node.host}:{node.port}{path}", data=data,
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def start_ring(mode: str, k: int, model: str, data_dir: str | None, extra: list[str],
                tmp: Path) -> list[Node]:
    """K agents of one cluster of their own (a secret of its own: the other mode's ring never
    joins it), the first the others' peer."""
    secret = os.urandom(16).hex()
    port = free_port()
    agents = []
    for i in range(k):
        cluster = ["--host", "127.0.0.1", "--port", str(port if i == 0 else 0),
                   "--name", f"{mode}{i}"]
        if i:
            cluster += ["--peer", f"127.0.0.1:{port}"]
        agents.append(start_node(f"{mode}{i}", mode, model, data_dir, extra + cluster,
                                  {"SKULKP2P_SECRET": secret}, tmp))
    return agents


def raise_if_exited(agents: list[Node]) -> None:
    """BenchError naming the first agent whose process has exited, with its log's tail."""
    for a in agents:
        if a.proc is not None and a.proc.poll() is not None:
            raise BenchError(f"agent {a.name} exited with status {a.proc.returncode}: "
                             f"{a.log_tail()}")


def place_ring(agents: list[Node], model: str, deadline: float) -> Node:
    """Place `model` on a ring of every agent; the last stage, once it serves (the clients'
    node)."""
    names = [a.name for a in agents]
    last = agents[-1]
    placed = False
    while time.monotonic() < deadline:
        raise_if_exited(agents)
        if not placed:  # 503 while the cluster has no leader or has not seen every member
            status, _ = http_json(agents[0], "POST", "/v1/cluster/place",
                                   {"model": model, "nodes": names})
            placed = status == 200
        else:
            status, out = http_json(last, "GET", "/v1/models")
            if status == 200 and any(m.get("id") == model and m.get("ring") == names
                                     and m.get("ready") for m in out.get("data", [])):
                return last
        time.sleep(0.3)
    raise BenchError(f"{model} not served on the ring {' -> '.join(names)} after "
                     f"{READY_TIMEOUT_S:.0f} s: {last.log_tail()}")
