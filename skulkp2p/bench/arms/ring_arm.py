"""`bench --nodes N`: the bench's model as a pipeline ring of N real processes on loopback.

Stages 1..N-1 are child processes (`python -m skulkp2p.bench.arms.ring_arm ...`), each holding only its
layers and answering ring frames on the cluster's own data plane (`cluster/ring_link.RingData`,
a signed TCP listener); the last stage is the bench process itself, which runs the one decode
loop over a `RingForward` and a `TcpRingLink`, exactly as a cluster's last stage does. Every
stage has its own loopback IP (127.0.0.x, or 127.0.0.1 where the range is not usable) and is
reached only through the fault-injecting proxy (`skulkp2p/netfault.py`), which adds
`--link-delay-ms` of latency to every hop: a traversal crosses N hops (last -> first, then
stage to stage back to the last).

Where the time goes, per run: the last stage times its own compute and its wait for each
traversal; the other stages put their compute seconds into the frame they pass on (`cs`), so
link time = wait - the other stages' compute (network, proxy delay, framing, thread hand-offs);
the rest of the run is the decode loop on the last stage (drafting, sampling, detokenising).
`report.py` turns these into each result row's `ring` medians and the ring table.

Clean-up: every child is killed by its pid when the bench ends, however it ends (the bench's
`finally`, an atexit hook); a child also exits on its own when its stdin closes, so not even a
SIGKILL of the bench leaves stages behind.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skulkp2p.bench.cores import allowed_cores
from skulkp2p.netfault import FaultProxy, free_port, link_round_trip_ms, loopback_ips_usable

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.bench")

MODEL_KEY = "bench"  # the ring frames' `model` field between the bench's stages
SECRET_ENV = "SKULKP2P_BENCH_RING_SECRET"
READY_TIMEOUT_S = 600.0  # loading a stage (a first pull is done before the stages start)
STOP_TIMEOUT_S = 5.0
TERM = 1


class RingBenchError(RuntimeError):
    """The ring could not be set up (the bench turns it into its own error)."""


@dataclass
class _Stage:
    index: int
    layers: tuple[int, int]
    ip: str
    port: int  # its real ring listener
    via: str  # the address others reach it at: the proxy's port on its IP
    proc: subprocess.Popen | None = None  # None: the last stage, this process
    log_path: Path | None = None
    ready: dict[str, Any] | None = None
    error: str | None = None


class RingBench:
    """N stages on loopback, started by :meth:`open`, stopped by :meth:`close` (idempotent)."""

    def __init__(self, store: ModelStore, spec: str, dtype: str, nodes: int,
                 link_delay_ms: float = 0.0, timeout_s: float | None = None,
                 prefix_cache_mb: float = 0.0, node_cpus: list[frozenset[int]] | None = None):
        """`node_cpus`: the cores of each emulated node (bench/cores.py): stage i runs on node
        i's (the last stage, this process, is pinned by the caller); None: every core."""
        if nodes < 2:
            raise ValueError("a ring has at least 2 nodes")
        self.node_cpus = node_cpus
        self.store, self.spec, self.dtype, self.nodes = store, spec, dtype, nodes
        self.prefix_cache_mb = prefix_cache_mb  # each stage process's own prefix cache
        self.delay_s = max(0.0, link_delay_ms) / 1e3
        self.timeout_s = timeout_s
        self.stages: list[_Stage] = []
        self.proxy: FaultProxy | None = None
        self.data: Any = None  # this process's RingData
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._tmp: Path | None = None
        self._forwards: list[Any] = []
        self._bytes_seen = 0
        self._closed = False
        self.instance = uuid.uuid4().hex
        # The running totals over measured runs, shown under settings.ring.
        self.settings: dict[str, Any] = {
            "nodes": nodes, "link_delay_ms": link_delay_ms, "hops_per_traversal": nodes,
            "transport": "TCP on loopback through the fault-injecting proxy (netfault.py); "
                         "stages 1..N-1 are child processes, the last stage is the bench",
            "traversals": 0, "bytes": 0, "last_stage_compute_s": 0.0,
            "other_stages_compute_s": 0.0, "link_s": 0.0, "loop_s": 0.0,
        }

    # ---------------------------------------------------------------- set-up

    def open(self) -> LoadedModel:
        """Start the proxy, the stage processes and this process's last stage; return the last
        stage's model, whose forward is a RingForward over TCP."""
        atexit.register(self.close)
        try:
            return self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> LoadedModel:
        from skulkp2p import wire
        from skulkp2p.cluster.facts import model_spec
        from skulkp2p.cluster.placement import split_with_tail
        from skulkp2p.cluster.ring_link import RingData
        from skulkp2p.engine.model.stage import StageSpan
        from skulkp2p.engine.runner.loader import open_model

        self.store.pull(self.spec)  # once, before N processes would each try
        spec = model_spec(self.store, self.spec)
        total = spec.layers
        try:  # as placement splits it: a Gemma 4 model's tail stays on the last stage
            ranges = split_with_tail(total, [1.0] * self.nodes, spec.tail_start)
        except ValueError as e:
            raise RingBenchError(f"--nodes {self.nodes}: {e}") from None
        if ranges is None:
            raise RingBenchError(f"--nodes {self.nodes}: {self.spec} keeps layers "
                                 f"[{spec.tail_start}, {total}) on its last stage: at most "
                                 f"{spec.tail_start + 1} nodes")
        self.settings["layers"] = [list(r) for r in ranges]
        if loopback_ips_usable():
            base = random.Random().randrange(20, 220)  # other runs may use some of the range
            ips = [f"127.0.0.{base + i}" for i in range(self.nodes)]
        else:
            ips = ["127.0.0.1"] * self.nodes
        self.proxy = FaultProxy()
        for i, (ip, r) in enumerate(zip(ips, ranges, strict=True)):
            port, via = free_port(ip), free_port(ip)
            self.proxy.listen(ip, via, port)
            self.stages.append(_Stage(i, r, ip, port, f"{ip}:{via}"))
        for i in range(self.nodes):  # every hop: last -> first, i -> i+1
            self.proxy.delay(ips[i - 1], ips[i], self.delay_s)
        if (rtt := link_round_trip_ms(self.proxy, ips)) is not None:
            self.settings["link_round_trip_ms"] = rtt

        secret = secrets.token_hex(16)
        self._tmp = Path(tempfile.mkdtemp(prefix="skulkp2p-bench-ring-"))
        last = self.stages[-1]
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                             name="bench-ring-io")
        self._loop_thread.start()
        self.data = RingData(wire.frame_key(secret))
        asyncio.run_coroutine_threadsafe(
            self.data.start(last.ip, bind_source=last.ip, port=last.port), self._loop).result(10)
        env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
        for st in self.stages[:-1]:
            self._start_stage(st, total, self.stages[st.index + 1].via, env)

        t0 = time.monotonic()
        span = StageSpan(last.layers[0], last.layers[1], total)
        loaded = open_model(self.store, self.spec, self.dtype, span=span)
        self._wait_ready(t0)
        self._install(loaded)
        from skulkp2p.engine.model.stage import param_bytes

        self.settings["stages"] = [
            {"stage": st.index + 1, "layers": list(st.layers), "addr": st.via,
             "pid": st.proc.pid if st.proc else os.getpid(),
             "param_bytes": (st.ready or {}).get("param_bytes") if st.proc
             else param_bytes(loaded.model),
             "cores": allowed_cores(st.proc.pid if st.proc else os.getpid())}
            for st in self.stages]
        self.settings["setup_s"] = round(time.monotonic() - t0, 2)
        log.info("ring of %d stages ready (layers %s, %.1f ms per hop) in %.1f s", self.nodes,
                 self.settings["layers"], self.delay_s * 1e3, self.settings["setup_s"])
        return loaded

    def _start_stage(self, st: _Stage, total: int, next_addr: str, env: dict[str, str]
                     ) -> None:
        st.log_path = self._tmp / f"stage{st.index + 1}.log"
        cmd = [sys.executable, "-m", "skulkp2p.bench.arms.ring_arm", "--model", self.spec,
               "--dtype", self.dtype, "--layers", f"{st.layers[0]},{st.layers[1]},{total}",
               "--host", st.ip, "--port", str(st.port), "--next", next_addr,
               "--data-dir", str(self.store.data_dir),
               "--prefix-cache-mb", str(self.prefix_cache_mb)]
        cpus = None if self.node_cpus is None else self.node_cpus[st.index]
        if cpus is not None:  # OpenBLAS threads as a node of that many cores would start with
            from skulkp2p.engine.cpu.blas import default_blas_threads
            env = {**env, "OPENBLAS_NUM_THREADS": str(default_blas_threads(len(cpus)))}
        with open(st.log_path, "wb") as err:
            st.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=err, env=env,
                                       preexec_fn=None if cpus is None
                                       else (lambda: os.sched_setaffinity(0, cpus)))
        threading.Thread(target=self._read_stage, args=(st,), daemon=True,
                         name=f"bench-stage{st.index + 1}").start()
        log.info("stage %d of %d: pid %d, layers %d-%d, at %s", st.index + 1, self.nodes,
                 st.proc.pid, st.layers[0], st.layers[1] - 1, st.via)

    @staticmethod
    def _read_stage(st: _Stage) -> None:
        try:
            for line in st.proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if "error" in msg:
                    st.error = str(msg["error"])
                elif msg.get("ready"):
                    st.ready = msg
        except (OSError, ValueError):  # closed by close(), racing this thread
            pass

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + READY_TIMEOUT_S
        for st in self.stages[:-1]:
            while st.ready is None:
                rc = st.proc.poll()
                if st.error or rc is not None or time.monotonic() > deadline:
                    why = st.error or (f"exited with status {rc}" if rc is not None
                                       else f"not ready after {READY_TIMEOUT_S:.0f} s")
                    raise RingBenchError(f"ring stage {st.index + 1} (pid {st.proc.pid}): "
                                         f"{why}\n{_tail(st.log_path)}")
                time.sleep(0.05)

    def _install(self, loaded: LoadedModel) -> None:
        from skulkp2p.cluster.ring_link import TcpRingLink
        from skulkp2p.engine.model.stage import StageModel
        from skulkp2p.engine.parallel.ring.traversal import RingForward

        stage = StageModel(loaded.model, loaded.span)
        first = self.stages[0].via

        def make(req: Any, hidden: str | None, interrupt: Any) -> RingForward:
            link = TcpRingLink(self.data, MODEL_KEY, first, self._broken, self.timeout_s)
            fwd = RingForward(stage, link, term=TERM, instance=self.instance,
                              request=uuid.uuid4().hex,
                              prefill_step=int(loaded.runtime.get("prefill_step", 2048)),
                              hidden=hidden, interrupt=interrupt)
            self._forwards.append(fwd)
            return fwd

        loaded.make_forward = make

    def _broken(self) -> str | None:
        for st in self.stages[:-1]:
            rc = st.proc.poll()
            if rc is not None:
                return f"stage {st.index + 1} (pid {st.proc.pid}) exited with status {rc}"
        return None

    # ---------------------------------------------------------------- accounting

    def _proxy_bytes(self) -> int:
        return sum(self.proxy.bytes.values()) if self.proxy else 0

    def take_run(self, total_s: float | None) -> dict[str, Any]:
        """Where the time of the requests since the last call went (one bench run: `total_s`
        its wall time); adds it to the running totals. Call once after the warm-up to drop it.
        """
        fwds, self._forwards = self._forwards, []
        wait = sum(f.wait_s for f in fwds)
        others = sum(f.stages_compute_s for f in fwds)
        own = sum(f.compute_s for f in fwds)
        seen = self._proxy_bytes()
        run = {"traversals": sum(f.traversals for f in fwds),
               "last_stage_compute_s": round(own, 4),
               "other_stages_compute_s": round(others, 4),
               "link_s": round(max(0.0, wait - others), 4),
               "bytes": seen - self._bytes_seen}
        self._bytes_seen = seen
        if total_s is not None:
            run["loop_s"] = round(max(0.0, total_s - wait - own), 4)
            run["total_s"] = round(total_s, 4)
            s = self.settings
            for key in ("traversals", "bytes", "last_stage_compute_s", "other_stages_compute_s",
                        "link_s", "loop_s"):
                s[key] = round(s[key] + run[key], 4)
        return run

    # ---------------------------------------------------------------- clean-up

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for st in self.stages:
            if st.proc is None or st.proc.poll() is not None:
                continue
            try:
                st.proc.stdin.close()  # a stage exits when its stdin closes ...
            except OSError:
                pass
            try:
                os.kill(st.proc.pid, signal.SIGTERM)  # ... or on SIGTERM
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for st in self.stages:
            if st.proc is None:
                continue
            try:
                st.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.kill(st.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                st.proc.wait(5)
            if st.proc.stdout is not None:
                st.proc.stdout.close()
        if self.data is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.data.close(), self._loop).result(5)
            except Exception as e:  # closing anyway
                log.debug("ring: closing the data plane: %s", e)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(5)
        if self.proxy is not None:
            self.proxy.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        atexit.unregister(self.close)


def _tail(path: Path | None, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except (OSError, AttributeError):
        return ""


# --------------------------------------------------------------------------------------------
# A stage process: `python -m skulkp2p.bench.arms.ring_arm --model M --layers A,B,L --host IP ...`


def _stage_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m skulkp2p.bench.arms.ring_arm",
                                description="one stage of bench --nodes (started by the bench)")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--layers", required=True, help="START,END,TOTAL")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--next", required=True, help="the next stage's ring address")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--prefix-cache-mb", type=float, default=0.0)
    return p.parse_args(argv)


def _say(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


async def _serve_stage(args: argparse.Namespace) -> int:
    from skulkp2p import wire
    from skulkp2p.cluster.ring_link import RingData
    from skulkp2p.engine.model.stage import StageModel, StageSpan, param_bytes
    from skulkp2p.engine.parallel.ring.traversal import StageWorker
    from skulkp2p.engine.runner.loader import open_model
    from skulkp2p.models.store import ModelStore

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def stdin_readable() -> None:  # EOF: the bench is gone, however it went: stop too
        try:
            more = os.read(0, 4096)
        except OSError:
            more = b""
        if not more:
            loop.remove_reader(0)
            stop.set()

    loop.add_reader(0, stdin_readable)
    start, end, total = (int(x) for x in args.layers.split(","))
    span = StageSpan(start, end, total)
    data = RingData(wire.frame_key(os.environ.get(SECRET_ENV)))
    await data.start(args.host, bind_source=args.host, port=args.port)
    try:
        load = loop.run_in_executor(None, lambda: open_model(
            ModelStore(Path(args.data_dir)), args.model, args.dtype, span=span))
        await asyncio.wait({load, asyncio.ensure_future(stop.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            return 0
        loaded = load.result()
        from skulkp2p.engine.cache.prefix_cache import MB, PrefixCache

        mb = args.prefix_cache_mb
        data.set_stage(MODEL_KEY, StageWorker(StageModel(loaded.model, span), TERM,
                                              PrefixCache(int(mb * MB)) if mb > 0 else None),
                       lambda: args.next)
        _say(ready=True, param_bytes=param_bytes(loaded.model), pid=os.getpid())
        await stop.wait()
        return 0
    finally:
        await data.close()


def stage_main(argv: list[str] | None = None) -> int:
    args = _stage_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench ends its stages (Ctrl-C there)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from skulkp2p.engine.cpu import switch

    switch.install()  # the CPU switch (OpenBLAS inherited from the bench as a rule); before mlx
    try:
        return asyncio.run(_serve_stage(args))
    except Exception as e:
        _say(error=f"{type(e).__name__}: {e}")
        logging.getLogger("skulkp2p.bench").exception("stage failed")
        return 1


if __name__ == "__main__":
    status = stage_main()
    logging.shutdown()
    sys.stdout.flush()
    # Nothing is left to finish: skip the interpreter's teardown of mlx and its BLAS threads,
    # which took seconds here, so the bench's clean-up does not wait on it.
    os._exit(status)
