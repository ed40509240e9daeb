"""`bench --nodes N --parallel tensor`: the bench's model tensor-parallel over N rank processes.

The N ranks are the processes a cluster starts per placement (`engine/parallel/tensor/rank.py`), each on
its own loopback IP (127.0.0.x), holding its slice of every layer and forming an
`mx.distributed` ring group over TCP; the bench process holds the embedding, final norm, head
and drafter and runs the one decode loop over a `TensorForward`, as a group's first member does.
With `--link-delay-ms D` every rank is reached by the others only through the fault-injecting
proxy (`skulkp2p/netfault.py`): each rank gets its own host file in which its own entry is its
real listener and the others' are their proxy ports, so D delays every collective's every hop,
and rank 0's command link (each call's header) crosses a proxy of its own with the same delay;
without it the ranks connect directly (the proxy's own hops would add to every all-sum:
docs/measurements/tensor-parallel.md, "the delay honoured below a millisecond").

Where the time goes, per run: the bench's own compute (embedding, norm, head), rank 0's time per
call (compute of its slice plus the collectives, as it measures it), the pipe between the bench
and rank 0 (the rest of the wait), and the decode loop's own work. The ranks' compute is an
estimate: at start every rank times its slice with no collective (`compute`: calls of 1 and of
16 rows), so a run's compute is calls x the one-row time + the rows past the first x the time
per row more; the rest of the ranks' time is the collectives and the ranks waiting on each
other (on a loaded CPU, for a peer to be scheduled). The older estimate, calls x (2 per layer +
3) x one all-sum of one row timed alone (`probe`), is kept as `allsum_probe_est_s`: alone, an
all-sum is as cheap as the CPU is idle, so it says little when the machine is shared.

The depth controller uses the group's own verify-width table, measured when the group is open
(`engine/tensor.measure_group_widths`, as a cluster's group does when it forms) as the seed of
a live table that every verify call of the bench's requests is timed into
(`engine/drafting/call_costs.py`), warm-up included; each run records its calls by width and the table
after it. The table one process would have used is recorded beside it. With `--one-node` the bench also runs plain and
spec on the whole model in its own process, in the same run (bench/command.py).
"""

from __future__ import annotations

import atexit
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skulkp2p.bench.cores import allowed_cores
from skulkp2p.netfault import FaultProxy, free_port, link_round_trip_ms, loopback_ips_usable

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.bench")

READY_TIMEOUT_S = 600.0
PROBE_COUNT = 200
COMPUTE_COUNT = 20


class TensorBenchError(RuntimeError):
    """The group could not be set up (the bench turns it into its own error)."""


class TensorBench:
    """N rank processes on loopback, started by :meth:`open`, ended by :meth:`close`."""

    def __init__(self, store: ModelStore, spec: str, dtype: str, nodes: int,
                 link_delay_ms: float = 0.0, timeout_s: float | None = None,
                 prefix_cache_mb: float = 0.0, node_cpus: list[frozenset[int]] | None = None):
        """`node_cpus`: the cores of each emulated node (bench/cores.py): rank i runs on
        node i's; None: every process on every core."""
        if nodes < 2:
            raise ValueError("a tensor-parallel group has at least 2 nodes")
        self.store, self.spec, self.dtype, self.nodes = store, spec, dtype, nodes
        self.delay_s = max(0.0, link_delay_ms) / 1e3
        self.timeout_s = timeout_s
        self.prefix_cache_mb = prefix_cache_mb  # each rank's slice (used by --agent's arms)
        self.node_cpus = node_cpus
        self.ranks: list[Any] = []
        self.proxy: FaultProxy | None = None
        self.command_proxy: FaultProxy | None = None  # the command link's, with a delay
        self._forwards: list[Any] = []
        self._bytes_seen = 0
        self._closed = False
        self.per_call_collectives = 0
        self.live: Any = None  # the group's LiveWidthCosts, once measured (_measure_widths)
        self._calls_seen: dict[int, int] = {}
        self._times_seen: list[dict[str, float]] | None = None
        self.allsum_s = 0.0  # one all-sum of one row, alone (probe)
        self.compute_one_s = 0.0  # a rank's slice over one row with no collective
        self.compute_row_s = 0.0  # each row more
        self.settings: dict[str, Any] = {
            "parallel": "tensor", "nodes": nodes, "link_delay_ms": link_delay_ms,
            "hops_per_traversal": nodes,
            "transport": "mx.distributed ring backend over TCP on loopback (through the "
                         "fault-injecting proxy, netfault.py, when a link delay is set); the "
                         "ranks are child processes and compute the head's logits a share of "
                         "the vocabulary each; the decode loop and embedding are the bench's",
            "traversals": 0, "bytes": 0, "head_compute_s": 0.0, "ranks_s": 0.0,
            "collectives_est_s": 0.0, "ranks_compute_est_s": 0.0, "pipe_s": 0.0,
            "loop_s": 0.0,
        }

    def open(self) -> LoadedModel:
        atexit.register(self.close)
        try:
            return self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> LoadedModel:
        from skulkp2p.cluster.facts import model_spec
        from skulkp2p.engine.parallel.tensor.group import RankProcess, TensorError
        from skulkp2p.engine.parallel.tensor.shard import ShardError, plan_shards
        from skulkp2p.engine.runner.loader import open_model

        path = self.store.pull(self.spec)
        spec = model_spec(self.store, self.spec)
        try:
            plan_shards(max(spec.kv_heads, 1), max(spec.kv_heads, 1), 1, self.nodes)
        except ShardError as e:
            raise TensorBenchError(f"--nodes {self.nodes}: {e}") from None
        if loopback_ips_usable():
            base = random.Random().randrange(20, 220)
            ips = [f"127.0.0.{base + i}" for i in range(self.nodes)]
        else:
            ips = ["127.0.0.1"] * self.nodes
        real = [f"{ip}:{free_port(ip)}" for ip in ips]
        via = list(real)
        commands: list[list[str] | None] = [None] * self.nodes
        if self.delay_s > 0:  # without a delay the ranks connect directly (no proxy's hops)
            via = [f"{ip}:{free_port(ip)}" for ip in ips]
            commands = self._open_command_proxy(ips)
        t0 = time.monotonic()
        for r in range(self.nodes):
            addrs = [real[j] if j == r else via[j] for j in range(self.nodes)]
            self.ranks.append(RankProcess(Path(path), r, addrs, self.dtype,
                                          label=f"bench rank {r}",
                                          prefix_cache_mb=self.prefix_cache_mb,
                                          command_addrs=commands[r],
                                          cpus=None if self.node_cpus is None
                                          else self.node_cpus[r]))
        if self.delay_s > 0:
            self._open_proxy(ips, real, via)
            if (rtt := link_round_trip_ms(self.proxy, ips)) is not None:
                self.settings["link_round_trip_ms"] = rtt
        loaded = open_model(self.store, self.spec, self.dtype, head_only=True)
        try:
            ready = [rank.wait_ready(READY_TIMEOUT_S) for rank in self.ranks]
        except TensorError as e:
            raise TensorBenchError(f"tensor-parallel group: {e}") from None
        self.per_call_collectives = 2 * spec.layers + 3  # + the rows in, the logits out
        self.allsum_s = self.ranks[0].probe(1, PROBE_COUNT) / PROBE_COUNT
        # The ranks' own compute, timed with no collective: per call of one row, and per row
        # past the first (from calls of 16 rows).
        self.compute_one_s = self.ranks[0].compute(1, COMPUTE_COUNT) / COMPUTE_COUNT
        wide = self.ranks[0].compute(16, COMPUTE_COUNT // 2) / (COMPUTE_COUNT // 2)
        self.compute_row_s = max(0.0, (wide - self.compute_one_s) / 15)
        self._install(loaded)
        self._measure_widths(loaded)
        self.settings.update(
            ranks=[{"rank": r, "addr": real[r], "pid": x.get("pid"),
                    "param_bytes": x.get("param_bytes"), "active_bytes": x.get("active_bytes"),
                    "cores": allowed_cores(self.ranks[r].pid)}
                   for r, x in enumerate(ready)],
            head_param_bytes=_param_bytes(loaded),
            allsum_us_one_row=round(self.allsum_s * 1e6, 1),
            rank_compute_ms_one_row=round(self.compute_one_s * 1e3, 3),
            rank_compute_ms_per_more_row=round(self.compute_row_s * 1e3, 3),
            collectives_per_call=self.per_call_collectives,
            command_link="through the delaying proxy" if self.command_proxy else "direct",
            setup_s=round(time.monotonic() - t0, 2))
        log.info("tensor-parallel group of %d ready (%.1f ms per hop, one all-sum %.0f us) in "
                 "%.1f s", self.nodes, self.delay_s * 1e3, self.allsum_s * 1e6,
                 self.settings["setup_s"])
        return loaded

    def _measure_widths(self, loaded: LoadedModel) -> None:
        """The group's own verify-width costs, for the depth controller (as a cluster's group
        measures them when it forms, node/serving.py); the table one process measured (or the
        default) is recorded beside them."""
        from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
        from skulkp2p.engine.drafting.gates import DEFAULT_WIDTH_COSTS
        from skulkp2p.engine.drafting.width_costs import relative_costs
        from skulkp2p.engine.parallel.tensor.group import TensorError, measure_group_widths

        before = loaded.width_costs or DEFAULT_WIDTH_COSTS.get(loaded.dtype)
        try:
            seconds = measure_group_widths(loaded.model, loaded.tokenizer, self.ranks[0],
                                           check=self._broken, timeout=self.timeout_s)
        except TensorError as e:
            raise TensorBenchError(f"tensor-parallel group: measuring its widths: {e}") from None
        # Seeded by the probe, then following the group's verify calls (as a cluster's group).
        self.live = LiveWidthCosts(seconds, where="the bench's tensor-parallel group")
        loaded.width_costs = self.live
        self.settings.update(
            group_width_seconds={str(w): round(s, 5) for w, s in seconds.items()},
            group_width_costs={str(w): c for w, c in relative_costs(seconds).items()},
            single_process_width_costs=None if before is None else {
                str(w): c for w, c in sorted(before.items())})

    def _open_command_proxy(self, ips: list[str]) -> list[list[str] | None]:
        """The command link (engine/parallel/tensor/link.py: rank 0 sends each call's header to every
        other rank over TCP) through a delaying proxy of its own, so that a delayed bench
        delays every link a call crosses (before, the header went direct while the
        collectives crossed the proxy); its own proxy so that its bytes are told apart
        (`command_link_bytes`). Each other rank listens on a port of its own chosen here and
        rank 0 dials that rank's proxy port; the proxy may listen at once, since rank 0 dials
        only after an all-sum that every rank reaches listening. Returns each rank's
        addresses (its own entry real, the others' through the proxy)."""
        self.command_proxy = FaultProxy()
        for src in {*ips, "127.0.0.1"}:
            for dst in ips:
                if src != dst:
                    self.command_proxy.delay(src, dst, self.delay_s)
        real = [f"{ip}:{free_port(ip)}" for ip in ips]
        via = [f"{ip}:{free_port(ip)}" for ip in ips]
        for r in range(1, len(ips)):
            self.command_proxy.listen(ips[r], int(via[r].rsplit(":", 1)[1]),
                                      int(real[r].rsplit(":", 1)[1]))
        return [[real[j] if j == r else via[j] for j in range(len(ips))]
                for r in range(len(ips))]

    def _open_proxy(self, ips: list[str], real: list[str], via: list[str]) -> None:
        """Each rank's proxy port opens once that rank listens: a rank that reached the proxy
        before its peer listened would see a connection made and then dropped, which the ring
        backend does not retry (a refused one it does, for ~15 s). The last rank connects
        before it listens, the others listen first, so the ports open one by one."""
        self.proxy = FaultProxy()
        for src in {*ips, "127.0.0.1"}:  # outgoing connections come from any source on lo
            for dst in ips:
                if src != dst:
                    self.proxy.delay(src, dst, self.delay_s)
        waiting = set(range(len(ips)))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while waiting:
            for i in sorted(waiting):
                if _listening(real[i]):
                    self.proxy.listen(ips[i], int(via[i].rsplit(":", 1)[1]),
                                      int(real[i].rsplit(":", 1)[1]))
                    waiting.discard(i)
            dead = [r for r in self.ranks if not r.alive()]
            if dead:
                try:  # its last frame says why (an error), else its exit status does
                    dead[0].wait_ready(1.0)
                except Exception as e:
                    raise TensorBenchError(f"tensor-parallel group: {e}") from None
            if time.monotonic() > deadline:
                raise TensorBenchError("tensor-parallel group: the ranks do not listen")
            time.sleep(0.02)

    def _install(self, loaded: LoadedModel) -> None:
        from skulkp2p.engine.parallel.tensor.group import TensorForward

        def make(req: Any, hidden: str | None, interrupt: Any) -> TensorForward:
            fwd = TensorForward(loaded.model, self.ranks[0],
                                prefill_step=int(loaded.runtime.get("prefill_step", 2048)),
                                hidden=hidden, interrupt=interrupt, check=self._broken,
                                timeout=self.timeout_s, label="the bench's model",
                                call_costs=self.live)
            self._forwards.append(fwd)
            return fwd

        loaded.make_forward = make

    def _broken(self) -> str | None:
        for rank in self.ranks:
            if not rank.alive():
                return rank.why_dead()
        return None

    def mark_run(self) -> None:
        """A group arm's run starts now: its rank times (take_run) count from here, so that
        the one-node arms run in between are not in them."""
        self._times_seen = self._rank_times()

    def _rank_times(self) -> list[dict[str, float]] | None:
        from skulkp2p.engine.parallel.tensor.group import TensorError

        try:
            return self.ranks[0].stats()
        except TensorError as e:
            log.warning("tensor-parallel group: no rank times: %s", e)
            return None

    def _take_times(self, run: dict[str, Any]) -> None:
        # Each rank's wall and CPU time over this run, in calls (busy) and waiting for the
        # next command (idle): a rank that polls while it waits shows CPU near its wall time.
        now, before = self._rank_times(), self._times_seen
        self._times_seen = now
        if now is None or before is None:
            return
        for r, (a, b) in enumerate(zip(now, before, strict=True)):
            for k in ("busy_wall_s", "busy_cpu_s", "idle_wall_s", "idle_cpu_s"):
                run[f"rank{r}_{k}"] = round(a[k] - b[k], 4)  # (scalars: the summary's medians)

    def take_run(self, total_s: float | None) -> dict[str, Any]:
        fwds, self._forwards = self._forwards, []
        wait = sum(f.wait_s for f in fwds)
        ranks = sum(f.ranks_s for f in fwds)
        head = sum(f.compute_s for f in fwds)
        calls = sum(f.calls for f in fwds)
        rows = sum(f.rows for f in fwds)
        # The ranks' time less their compute timed alone: the collectives and the waiting on
        # each other (scheduling on a shared CPU included), and with a delay the link.
        compute = min(ranks, calls * self.compute_one_s + max(0, rows - calls)
                      * self.compute_row_s)
        coll = ranks - compute
        seen = sum(self.proxy.bytes.values()) if self.proxy else 0
        if self.command_proxy is not None:
            self.settings["command_link_bytes"] = sum(self.command_proxy.bytes.values())
        run = {"traversals": calls, "head_compute_s": round(head, 4),
               "ranks_s": round(ranks, 4), "collectives_est_s": round(coll, 4),
               "ranks_compute_est_s": round(compute, 4), "rows": rows,
               "allsum_probe_est_s": round(calls * self.per_call_collectives * self.allsum_s,
                                           4),
               "pipe_s": round(max(0.0, wait - ranks), 4), "link_s": round(coll, 4),
               "bytes": seen - self._bytes_seen}
        self._bytes_seen = seen
        if self.live is not None:
            self._take_widths(run)
        if total_s is not None:
            self._take_times(run)
            run["loop_s"] = round(max(0.0, total_s - wait - head), 4)
            run["total_s"] = round(total_s, 4)
            s = self.settings
            for key in ("traversals", "bytes", "head_compute_s", "ranks_s", "collectives_est_s",
                        "ranks_compute_est_s", "pipe_s", "loop_s"):
                s[key] = round(s[key] + run[key], 4)
        return run

    def _take_widths(self, run: dict[str, Any]) -> None:
        # The verify calls of this run by width, and the live table after it (what the depth
        # controller priced the next run's drafts with).
        now = self.live.calls()
        run["verify_calls_by_width"] = {str(w): n - self._calls_seen.get(w, 0)
                                        for w, n in now.items() if n > self._calls_seen.get(w, 0)}
        self._calls_seen = now
        run["width_costs_after"] = {str(w): round(c, 3) for w, c in self.live.items()}
        self.settings.update(
            group_width_costs_live={str(w): round(c, 4) for w, c in self.live.items()},
            group_width_seconds_live={str(w): round(x, 5)
                                      for w, x in self.live.seconds().items()},
            group_verify_calls_by_width={str(w): n for w, n in now.items()})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rank in self.ranks:
            rank.kill()
        for proxy in (self.proxy, self.command_proxy):
            if proxy is not None:
                proxy.close()
        atexit.unregister(self.close)


def _param_bytes(loaded: LoadedModel) -> int:
    from skulkp2p.engine.model.stage import param_bytes

    return param_bytes(loaded.model)


def _listening(addr: str) -> bool:
    """Whether a socket listens on addr (IPv4, from /proc/net/tcp: no connection is made,
    which the rank would take for its peer)."""
    import ipaddress

    host, port = addr.rsplit(":", 1)
    want = f"{int(ipaddress.IPv4Address(host)).to_bytes(4, 'little').hex().upper()}:" \
           f"{int(port):04X}"
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return True  # not Linux: go on and let the ready timeout bound it
    return any(len(f := row.split()) > 3 and f[1] == want and f[3] == "0A" for row in rows)
