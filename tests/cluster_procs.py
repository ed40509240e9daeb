"""Real cluster nodes as processes on 127.0.0.x loopback addresses, for tests.

Each node gets its own loopback IP (so the fault proxy can tell nodes apart by source address),
free ports, and a log file; ``close()`` kills every pid it started, whatever happened.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skulkp2p.cluster.node import fetch_status
from skulkp2p.netfault import FaultProxy, free_port, loopback_ips_usable  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
SECRET = "test-cluster-secret"


@dataclass
class Node:
    index: int
    name: str
    ip: str
    port: int  # real listener
    addr: str  # advertised (through the proxy when there is one)
    proc: subprocess.Popen
    log: Path
    http: str | None = None  # HOST:PORT of a join's HTTP API

    @property
    def pid(self) -> int:
        return self.proc.pid


class ProcCluster:
    def __init__(self, tmp_path: Path, proxy: bool = False, env: dict[str, str] | None = None):
        self.tmp = tmp_path
        # A random block of loopback IPs: other test runs on this machine may be using some.
        self.base = random.Random().randrange(20, 220)
        self.proxy = FaultProxy() if proxy else None
        self.nodes: dict[int, Node] = {}
        self.env = {**os.environ, "SKULKP2P_SECRET": SECRET, "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.data_dir = tmp_path / "data"

    def ip(self, i: int) -> str:
        return f"127.0.0.{self.base + i}"

    def start_join(self, i: int, model: str, peers: list[int] | None = None,
                   args: list[str] = ()) -> Node:
        """`python -m skulkp2p join` with its cluster listener and HTTP API on 127.0.0.x."""
        http_port = free_port(self.ip(i))
        node = self.start(i, peers, ["--model", model, "--http-host", self.ip(i),
                                     "--http-port", str(http_port), *args],
                          command=["-m", "skulkp2p", "join"])
        node.http = f"{self.ip(i)}:{http_port}"
        return node

    def start(self, i: int, peers: list[int] | None = None, args: list[str] = (),
              command: list[str] = ("-m", "skulkp2p.cluster.node")) -> Node:
        ip = self.ip(i)
        port = free_port(ip)
        addr = f"{ip}:{port}"
        if self.proxy is not None:
            adv = free_port(ip)
            self.proxy.listen(ip, adv, port)
            addr = f"{ip}:{adv}"
        peers = [0] if peers is None and i != 0 else (peers or [])
        cmd = [sys.executable, *command, "--name", f"n{i}", "--host", ip, "--port",
               str(port), "--data-dir", str(self.data_dir)]
        if self.proxy is not None:
            cmd += ["--advertise", addr]
        for p in peers:
            cmd += ["--peer", self._addr_of(p)]
        log = self.tmp / f"n{i}.log"
        out = open(log, "ab")
        proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=self.env)
        out.close()
        node = Node(i, f"n{i}", ip, port, addr, proc, log)
        self.nodes[i] = node
        return node

    def _addr_of(self, i: int) -> str:
        if i in self.nodes:
            return self.nodes[i].addr
        raise KeyError(f"node {i} not started yet")

    def start_many(self, n: int, args: list[str] = ()) -> list[Node]:
        first = self.start(0, args=list(args))
        return [first] + [self.start(i, args=list(args)) for i in range(1, n)]

    # ---------------------------------------------------------------- observing

    def status(self, i: int, timeout: float = 1.5) -> dict[str, Any] | None:
        node = self.nodes[i]
        try:
            return fetch_status(f"{node.ip}:{node.port}", SECRET, timeout)
        except (OSError, TimeoutError, ValueError):
            return None

    def statuses(self, among: list[int] | None = None) -> dict[int, dict[str, Any] | None]:
        return {i: self.status(i) for i in (among if among is not None else self.nodes)}

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> float:
        """Poll ``pred`` until it holds; returns the seconds it took, fails with logs."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if pred():
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n"
                             + self.diagnostics())

    def agreed(self, among: list[int]) -> dict[str, Any] | None:
        """The common status of ``among`` if they all answer, follow one leader in one term,
        and see the same members in the same states; else None."""
        sts = [self.status(i) for i in among]
        if any(s is None for s in sts):
            return None
        views = {(s["leader"], s["term"],
                  tuple((m["name"], m["state"]) for m in s["members"])) for s in sts}
        if len(views) != 1 or sts[0]["leader"] is None:
            return None
        return sts[0]

    def diagnostics(self) -> str:
        lines = []
        for i, node in self.nodes.items():
            st = self.status(i, timeout=0.5)
            brief = None if st is None else {k: st[k] for k in ("leader", "term", "role")} | {
                "members": [(m["name"], m["state"]) for m in st["members"]]}
            lines.append(f"--- {node.name} pid {node.pid} rc {node.proc.poll()} {brief}")
            try:
                lines += node.log.read_text(errors="replace").splitlines()[-15:]
            except OSError:
                pass
        return "\n".join(lines)

    # ---------------------------------------------------------------- faults and clean-up

    def signal(self, i: int, sig: int) -> None:
        os.kill(self.nodes[i].pid, sig)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                try:
                    os.kill(node.pid, signal.SIGCONT)
                    os.kill(node.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for node in self.nodes.values():
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self.proxy is not None:
            self.proxy.close()
