"""Real processes for tests, each stopped by its own pid whatever happens: the CLI run to
completion (``run_cli``), one ``join`` node on 127.0.0.1 (``JoinNode``, ``running_join``), and
a cluster of nodes on 127.0.0.x loopback addresses (``ProcCluster``); free ports."""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skulkp2p.cluster.status_client import fetch_status
from skulkp2p.netfault import FaultProxy, loopback_ips_usable  # noqa: F401  (re-exported)
from skulkp2p.ports import free_port
from tests.helpers import ROOT
from tests.helpers.http_client import H11Client, call

SECRET = "test-cluster-secret"


# ---------------------------------------------------------------- ports and pids



_LISTENING = re.compile(rb"http: OpenAI/Anthropic API on http://[^\s]*:(\d+)/v1")
_join_logs = itertools.count()


def listening_port(log: Path, proc: subprocess.Popen, timeout: float = 60) -> int:
    """The HTTP port an agent started with ``--http-port 0`` bound, read from its log line
    (so no other process can take the port between choosing and binding it)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _LISTENING.search(log.read_bytes())
        if m:
            return int(m.group(1))
        assert proc.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "the agent never said where it listens"
        time.sleep(0.02)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` by its pid if it still runs, and reap it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- the CLI


def run_cli(*args: str, input: str | None = None, env: dict | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m skulkp2p ARGS` run to completion (output captured)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "skulkp2p", *args], input=input,
                          capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


# ---------------------------------------------------------------- one `join`


class JoinNode:
    """`python -m skulkp2p join` on a port it binds itself (``--http-port 0``, read back from
    its log) unless ``http_port`` names one; stopped with SIGTERM (status 0 expected).

    With ``wait_ready`` (the default) the constructor returns once the model is loaded, having
    recorded what /health said while it loaded; without it, once it listens (at once after
    the process started when ``http_port`` is given)."""

    def __init__(self, model: str, tmp: Path, *extra: str, ready_timeout: float = 120,
                 wait_ready: bool = True, http_port: int | None = None,
                 log_level: str = "info", env: dict[str, str] | None = None):
        self.log = tmp / f"join-{os.getpid()}-{next(_join_logs)}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skulkp2p", "--log-level", log_level, "join", "--model",
                 model, "--http-port", str(http_port or 0), *extra],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                env={**os.environ, **env} if env else None)
        self.health_while_loading: list[tuple[int, dict]] = []
        if http_port:
            self.port = http_port
        else:
            try:
                self.port = listening_port(self.log, self.proc, ready_timeout)
            except BaseException:
                self.kill()
                raise
        self.base = f"http://127.0.0.1:{self.port}"
        if not wait_ready:
            return
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "http: " not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, "join never listened"
            time.sleep(0.05)
        # The API answers while the model loads: record what /health says meanwhile.
        while "ready: model" not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, "join never said it was ready"
            with H11Client(self.port) as c:
                r = c.request("GET", "/health")
                self.health_while_loading.append((r.status, r.headers))
            time.sleep(0.1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            self.kill()

    def kill(self) -> None:
        kill(self.proc)

    def healthy(self) -> bool:
        with H11Client(self.port, timeout=10) as c:
            return c.request("GET", "/health").status == 200


@contextmanager
def running_join(model, data_dir: Path, wait_for: bytes) -> Iterator[tuple[subprocess.Popen,
                                                                           Path]]:
    """A `join` subprocess, yielded once its log shows `wait_for`; killed by pid if still alive."""
    log = data_dir / "join.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "skulkp2p", "join", "--model", str(model),
                                 "--data-dir", str(data_dir), "--http-port", "0"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while wait_for not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"join never logged {wait_for!r}"
            time.sleep(0.02)
        yield proc, log
    finally:
        kill(proc)


# ---------------------------------------------------------------- a cluster on 127.0.0.x
#
# Each node gets its own loopback IP (so the fault proxy can tell nodes apart by source
# address), free ports, and a log file; ``close()`` kills every pid it started, whatever
# happened.


@dataclass
class ProcNode:
    index: int
    name: str
    ip: str
    port: int  # real listener
    addr: str  # advertised (through the proxy when there is one)
    proc: subprocess.Popen
    log: Path
    http_log_from: int | None = None  # a join: where in its log this start's lines begin
    _http: str | None = None

    @property
    def http(self) -> str | None:
        """HOST:PORT of a join's HTTP API, the port it bound itself (read from its log)."""
        if self._http is None and self.http_log_from is not None:
            deadline = time.monotonic() + 60
            while (m := _LISTENING.search(self.log.read_bytes()[self.http_log_from:])) is None:
                assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, f"{self.name} never said where it listens"
                time.sleep(0.02)
            self._http = f"{self.ip}:{int(m.group(1))}"
        return self._http

    @property
    def pid(self) -> int:
        return self.proc.pid


class ProcCluster:
    def __init__(self, tmp_path: Path, proxy: bool = False, env: dict[str, str] | None = None):
        self.tmp = tmp_path
        # A random block of loopback IPs: other test runs on this machine may be using some.
        self.base = random.Random().randrange(20, 220)
        self.proxy = FaultProxy() if proxy else None
        self.nodes: dict[int, ProcNode] = {}
        self.env = {**os.environ, "SKULKP2P_SECRET": SECRET, "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.data_dir = tmp_path / "data"

    def ip(self, i: int) -> str:
        return f"127.0.0.{self.base + i}"

    def start_join(self, i: int, model: str, peers: list[int] | None = None,
                   args: list[str] = ()) -> ProcNode:
        """`python -m skulkp2p join` with its cluster listener and HTTP API on 127.0.0.x."""
        log = self.tmp / f"n{i}.log"
        log_from = log.stat().st_size if log.exists() else 0
        node = self.start(i, peers, ["--model", model, "--http-host", self.ip(i),
                                     "--http-port", "0", *args],
                          command=["-m", "skulkp2p", "join"])
        node.http_log_from = log_from
        return node

    def start(self, i: int, peers: list[int] | None = None, args: list[str] = (),
              command: list[str] = ("-m", "skulkp2p.cluster.node")) -> ProcNode:
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
        node = ProcNode(i, f"n{i}", ip, port, addr, proc, log)
        self.nodes[i] = node
        return node

    def _addr_of(self, i: int) -> str:
        if i in self.nodes:
            return self.nodes[i].addr
        raise KeyError(f"node {i} not started yet")

    def start_many(self, n: int, args: list[str] = ()) -> list[ProcNode]:
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

    def wait_decoding(self, model: str, tokens: int, timeout: float = 60.0) -> None:
        """Wait until some node's /v1/stats shows a request on `model` that has generated at
        least `tokens` tokens (a request is under way mid-decode, not queued or prefilling)."""
        def under_way() -> bool:
            for node in self.nodes.values():
                try:
                    status, _, body = call(node.http, "GET", "/v1/stats", timeout=2)
                except OSError:
                    continue
                running = (body.get("models", {}).get(model, {}).get("in_flight", [])
                           if status == 200 else [])
                if any((r.get("tokens") or 0) >= tokens for r in running):
                    return True
            return False
        self.wait(under_way, timeout, f"a request on {model} {tokens} tokens into decoding")

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
