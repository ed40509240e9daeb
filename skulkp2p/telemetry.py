"""What a node measures about its requests, with no HTTP and no mlx: `Telemetry`, fed typed
events — `RequestStarted` when a job starts on a model's worker and `RequestFinished` (carrying
the engine's `GenerationResult`) when it ends — keeps per model the requests in flight, the last N
finished (bounded) and a time series of acceptance and decode speed over the last minutes (a
bounded ring of buckets), and counts everything into its registry (metrics.py) under the names
`/metrics` documents (speculation named like vLLM's `spec_decode_*`); at scrape time it adds the
queue depth and the families read from the node's state (state_metrics.py).

The HTTP side (api/dashboard.py) renders `Telemetry.registry` and `Telemetry.stats()`.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from skulkp2p.engine.cpu.blas_threads import PolicyCounts
from skulkp2p.engine.protocol import VerifyCosts
from skulkp2p.engine.results import (
    GenerationResult,
)
from skulkp2p.metrics import PREFIX, Family, Registry
from skulkp2p.state_metrics import (
    blas_thread_families,
    cluster_families,
    draft_memory_families,
    verify_cost_families,
)

# ---------------------------------------------------------------------------------------------
# Events


@dataclass(frozen=True)
class RequestStarted:
    model: str
    request_id: int | str
    prompt_tokens: int


@dataclass(frozen=True)
class RequestFinished:
    model: str
    request_id: int | str
    outcome: str  # "ok" | "error" | "cancelled"
    result: GenerationResult | None = None  # set when outcome is "ok"


OUTCOMES = ("ok", "error", "cancelled")


TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class _Running:
    request_id: int | str
    prompt_tokens: int
    started: float
    progress: Callable[[], int] | None


@dataclass
class _Bucket:
    t: float
    requests: int = 0
    tokens: int = 0  # decoded after the first token (the numerator of decode tok/s)
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0


class _Model:
    def __init__(self, recent: int, buckets: int) -> None:
        self.running: dict[int | str, _Running] = {}
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=recent)
        self.series: collections.deque[_Bucket] = collections.deque(maxlen=buckets)
        self.totals = collections.Counter()
        # drafter -> rounds, drafted, accepted, gate_off, gate_on (since the node started)
        self.drafters: dict[str, collections.Counter] = {}


class Telemetry:
    """One node's request records and metrics. `start`/`finish` may be called from any thread
    (the models' worker threads); `stats` and `registry.render` from the event loop."""

    def __init__(self, recent: int = 30, window_s: float = 600.0, bucket_s: float = 5.0,
                 clock: Callable[[], float] = time.time):
        self.clock = clock
        self.recent_max = recent
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._lock = threading.Lock()
        self._models: dict[str, _Model] = {}
        self._queues: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None
        self._cluster: Callable[[], Mapping[str, Any] | None] | None = None
        self._verify_costs: Callable[[], Mapping[str, VerifyCosts]] | None = None
        self._blas_threads: Callable[[], PolicyCounts | None] | None = None
        self._draft_memory: Callable[[], Mapping[str, Mapping[str, object]]] | None = None
        r = self.registry = Registry()
        p = PREFIX
        self.requests = r.counter(p + "requests_total", "Requests finished, by outcome "
                                  "(ok, error, cancelled).", ("model", "outcome"))
        self.prompt_tokens = r.counter(p + "prompt_tokens_total", "Prompt tokens processed.",
                                       ("model",))
        self.generation_tokens = r.counter(p + "generation_tokens_total",
                                           "Tokens generated.", ("model",))
        self.prefill_seconds = r.counter(p + "prefill_seconds_total", "Seconds spent from a "
                                         "request's start to its first token.", ("model",))
        self.decode_seconds = r.counter(p + "decode_seconds_total", "Seconds spent after "
                                        "the first token until the request's end.", ("model",))
        self.running_gauge = r.gauge(p + "requests_running", "Requests generating now.",
                                     ("model",))
        self.ttft = r.histogram(p + "time_to_first_token_seconds", "Time to first token.",
                                ("model",), TTFT_BUCKETS)
        self.tpot = r.histogram(p + "time_per_output_token_seconds", "Time per output token "
                                "after the first (one observation per token, at its request's "
                                "mean pace).", ("model",), TPOT_BUCKETS)
        self.e2e = r.histogram(p + "e2e_request_latency_seconds", "Request latency from its "
                               "start on the model's worker to its end.", ("model",), E2E_BUCKETS)
        sp = p + "spec_decode_"
        self.num_drafts = r.counter(sp + "num_drafts_total", "Speculative rounds that "
                                    "drafted, by drafter.", ("model", "drafter"))
        self.num_draft_tokens = r.counter(sp + "num_draft_tokens_total", "Draft tokens "
                                          "proposed, by drafter.", ("model", "drafter"))
        self.num_accepted = r.counter(sp + "num_accepted_tokens_total", "Draft tokens "
                                      "accepted, by drafter.", ("model", "drafter"))
        self.num_accepted_per_pos = r.counter(
            sp + "num_accepted_tokens_per_pos_total", "Draft tokens accepted at each position "
            "of a draft (0 = the first drafted token).", ("model", "drafter", "position"))
        self.gate_events = r.counter(sp + "gate_events_total", "Gate switches of a drafter "
                                     "(off: it stopped paying; on: it came back).",
                                     ("model", "drafter", "event"))
        r.collector(self._collect_live)

    # ---- wiring (read at scrape time) ------------------------------------------------------

    def watch_models(self, fn: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        """`fn()` -> {model: {"state": str, "waiting": int}} for this node's workers."""
        self._queues = fn

    def watch_cluster(self, fn: Callable[[], Mapping[str, Any] | None]) -> None:
        """`fn()` -> the cluster status (as GET /v1/cluster shows it), or None."""
        self._cluster = fn

    def watch_verify_costs(self, fn: Callable[[], Mapping[str, VerifyCosts]]) -> None:
        """`fn()` -> {model: VerifyCosts} for this node's engines that report a measured
        verify-cost table (the seam's `EngineInfo.verify_costs`)."""
        self._verify_costs = fn

    def watch_draft_memory(self, fn: Callable[[], Mapping[str, Mapping[str, object]]]) -> None:
        """`fn()` -> {model: its engine's draft memory stats} (`DraftMemoryShare.stats()`)."""
        self._draft_memory = fn

    def watch_blas_threads(self, fn: Callable[[], PolicyCounts | None]) -> None:
        """`fn()` -> the process's OpenBLAS thread policy counters (engine/cpu/blas_threads.py's
        `counts`), or None where none runs."""
        self._blas_threads = fn

    # ---- events ------------------------------------------------------------------------------

    def _model(self, model: str) -> _Model:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model(self.recent_max,
                                             max(1, math.ceil(self.window_s / self.bucket_s)))
            self.running_gauge.set(0, model=model)
            for outcome in OUTCOMES:
                self.requests.touch(model=model, outcome=outcome)
            for c in (self.prompt_tokens, self.generation_tokens, self.prefill_seconds,
                      self.decode_seconds):
                c.touch(model=model)
        return m

    def start(self, ev: RequestStarted, progress: Callable[[], int] | None = None) -> None:
        """A job started on a model's worker; `progress()` tells its tokens so far."""
        with self._lock:
            m = self._model(ev.model)
            m.running[ev.request_id] = _Running(ev.request_id, ev.prompt_tokens, self.clock(),
                                                progress)
            self.running_gauge.set(len(m.running), model=ev.model)

    def finish(self, ev: RequestFinished) -> None:
        now = self.clock()
        with self._lock:
            m = self._model(ev.model)
            run = m.running.pop(ev.request_id, None)
            self.running_gauge.set(len(m.running), model=ev.model)
            self.requests.inc(model=ev.model, outcome=ev.outcome)
            m.totals["requests"] += 1
            m.totals[ev.outcome] += 1
            rec: dict[str, Any] = {
                "id": ev.request_id, "outcome": ev.outcome,
                "started": run.started if run else now, "finished": now,
                "prompt_tokens": run.prompt_tokens if run else None}
            res = ev.result
            if res is not None:
                rec.update(self._count_result(ev.model, m, res, now))
            m.recent.append(rec)

    def _count_result(self, model: str, m: _Model, res: GenerationResult, now: float
                      ) -> dict[str, Any]:
        n_out = res.usage.completion_tokens
        t = res.timing
        prefill_s = max(0.0, t.ttft_s)
        decode_s = max(0.0, t.total_s - t.ttft_s)
        self.prompt_tokens.inc(res.usage.prompt_tokens, model=model)
        self.generation_tokens.inc(n_out, model=model)
        self.prefill_seconds.inc(prefill_s, model=model)
        self.decode_seconds.inc(decode_s, model=model)
        self.ttft.observe(prefill_s, model=model)
        self.e2e.observe(max(0.0, t.total_s), model=model)
        if n_out > 1 and decode_s > 0:
            self.tpot.observe(decode_s / (n_out - 1), n_out - 1, model=model)
        m.totals["prompt_tokens"] += res.usage.prompt_tokens
        m.totals["generated_tokens"] += n_out
        rec: dict[str, Any] = {
            "prompt_tokens": res.usage.prompt_tokens, "completion_tokens": n_out,
            "finish_reason": res.finish_reason, "ttft_s": t.ttft_s, "total_s": t.total_s,
            "decode_tok_s": t.decode_tok_s if t.decode_tok_s is not None else (
                round((n_out - 1) / decode_s, 2) if n_out > 1 and decode_s > 0 else None)}
        spec = res.speculation
        drafted = accepted = 0
        if spec is not None:
            per = ({k: (v.rounds, v.drafted, v.accepted) for k, v in spec.by_drafter.items()}
                   if spec.by_drafter else
                   {spec.drafter: (spec.rounds or 0, spec.drafted, spec.accepted)})
            for name, (rounds, d, a) in per.items():
                m.drafters.setdefault(name, collections.Counter()).update(
                    rounds=rounds, drafted=d, accepted=a)
                self.num_drafts.inc(rounds, model=model, drafter=name)
                self.num_draft_tokens.inc(d, model=model, drafter=name)
                self.num_accepted.inc(a, model=model, drafter=name)
            for pos, a in enumerate(spec.accepted_per_position or ()):
                self.num_accepted_per_pos.inc(a, model=model, drafter=spec.drafter,
                                              position=pos)
            events = list(spec.gate_events or ())
            for e in events:
                who, what = str(e.get("drafter", spec.drafter)), str(e.get("event"))
                self.gate_events.inc(model=model, drafter=who, event=what)
                m.drafters.setdefault(who, collections.Counter())[f"gate_{what}"] += 1
            drafted, accepted = spec.drafted, spec.accepted
            m.totals["drafted"] += drafted
            m.totals["accepted"] += accepted
            rec["speculation"] = {
                "drafter": spec.drafter, "mode": spec.mode, "max_depth": spec.max_depth,
                "drafted": drafted, "accepted": accepted, "acceptance": spec.acceptance,
                "acceptance_per_position": spec.acceptance_per_position,
                "by_drafter": {k: {"drafted": d, "accepted": a,
                                   "acceptance": round(a / d, 4) if d else None}
                               for k, (_r, d, a) in per.items()},
                "gate_events": events}
        # The time series: one bucket per bucket_s, the last window_s kept.
        start = math.floor(now / self.bucket_s) * self.bucket_s
        if not m.series or m.series[-1].t != start:
            m.series.append(_Bucket(start))
        b = m.series[-1]
        b.requests += 1
        if n_out > 1 and decode_s > 0:
            b.tokens += n_out - 1
            b.decode_s += decode_s
        b.drafted += drafted
        b.accepted += accepted
        return rec

    # ---- reading -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per model: in flight, recent (newest first), the series and totals (JSON-ready)."""
        now = self.clock()
        live = self._live_models()
        costs = self._live_verify_costs()
        out: dict[str, Any] = {}
        with self._lock:
            names = sorted(set(self._models) | set(live) | set(costs))
            for name in names:
                m = self._models.get(name)
                info = dict(live.get(name, {}))
                running = []
                for r in (m.running.values() if m else ()):
                    tokens = None
                    if r.progress is not None:
                        try:
                            tokens = int(r.progress())
                        except Exception:  # a progress callable must not break the page
                            tokens = None
                    running.append({"id": r.request_id, "started": r.started,
                                    "elapsed_s": round(now - r.started, 3),
                                    "prompt_tokens": r.prompt_tokens, "tokens": tokens})
                series = []
                for b in (m.series if m else ()):
                    if b.t < now - self.window_s:
                        continue
                    series.append({
                        "t": b.t, "requests": b.requests,
                        "tok_s": round(b.tokens / b.decode_s, 2) if b.decode_s > 0 else None,
                        "acceptance": round(b.accepted / b.drafted, 4) if b.drafted else None,
                        "drafted": b.drafted, "accepted": b.accepted})
                totals = dict(m.totals) if m else {}
                totals["acceptance"] = (round(totals["accepted"] / totals["drafted"], 4)
                                        if totals.get("drafted") else None)
                drafters = {k: {"rounds": c["rounds"], "drafted": c["drafted"],
                                "accepted": c["accepted"],
                                "acceptance": (round(c["accepted"] / c["drafted"], 4)
                                               if c["drafted"] else None),
                                "gate_off": c["gate_off"], "gate_on": c["gate_on"]}
                            for k, c in sorted((m.drafters if m else {}).items())}
                out[name] = {**info, "in_flight": running, "drafters": drafters,
                             "recent": list(reversed(m.recent)) if m else [],
                             "series": series, "totals": totals}
                if name in costs:
                    out[name]["verify_costs"] = costs[name].to_json()
        return {"time": now, "window_s": self.window_s, "bucket_s": self.bucket_s,
                "models": out}

    def _live_models(self) -> Mapping[str, Mapping[str, Any]]:
        if self._queues is None:
            return {}
        try:
            return self._queues()
        except Exception:
            return {}

    def _live_verify_costs(self) -> Mapping[str, VerifyCosts]:
        if self._verify_costs is None:
            return {}
        try:
            return self._verify_costs()
        except Exception:  # an engine going away mid-scrape must not break the page
            return {}

    def _collect_live(self) -> list[Family]:
        fams = []
        waiting = Family(PREFIX + "requests_waiting", "gauge",
                         "Requests queued for a model's worker (queue depth).")
        for model, info in sorted(self._live_models().items()):
            waiting.add(int(info.get("waiting") or 0), model=model)
        fams.append(waiting)
        fams.extend(verify_cost_families(self._live_verify_costs()))
        if self._draft_memory is not None:
            try:
                memory = self._draft_memory()
            except Exception:  # an engine going away mid-scrape must not break the page
                memory = {}
            fams.extend(draft_memory_families(memory))
        if self._blas_threads is not None:
            try:
                counts = self._blas_threads()
            except Exception:  # a scrape must not break on a report
                counts = None
            fams.extend(blas_thread_families(counts))
        status = None
        if self._cluster is not None:
            try:
                status = self._cluster()
            except Exception:
                status = None
        if status:
            fams.extend(cluster_families(status))
        return fams
