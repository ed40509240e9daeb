"""What a node measures, with no HTTP and no mlx: a metrics registry rendered in Prometheus'
text format (0.0.4), and a recorder of each model's requests.

- `Registry`: counters, gauges and histograms with labels, updated from any thread, plus
  collectors called at scrape time (queue depth and the cluster's state are read, not pushed).
- `Telemetry`: fed typed events — `RequestStarted` when a job starts on a model's worker and
  `RequestFinished` (carrying the engine's `GenerationResult`) when it ends — it keeps per model
  the requests in flight, the last N finished (bounded) and a time series of acceptance and decode
  speed over the last minutes (a bounded ring of buckets), and counts everything into its
  registry under the names `/metrics` documents (speculation named like vLLM's `spec_decode_*`).

The HTTP side (api/dashboard.py) renders `Telemetry.registry` and `Telemetry.stats()`.
"""

from __future__ import annotations

import collections
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skulkp2p.engine.protocol import VerifyCosts
from skulkp2p.engine.results import (
    GenerationResult,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "skulkp2p_"

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# ---------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class Sample:
    name: str  # the full sample name (a counter's ends in _total, a histogram's in _bucket...)
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass
class Family:
    """One metric as scraped: `# HELP`, `# TYPE`, then its samples."""
    name: str
    type: str  # counter | gauge | histogram
    help: str
    samples: list[Sample] = field(default_factory=list)

    def add(self, value: float, suffix: str = "", **labels: Any) -> Family:
        self.samples.append(Sample(self.name + suffix,
                                   tuple((k, str(v)) for k, v in labels.items()), value))
        return self


def format_value(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def render(families: Iterable[Family]) -> str:
    """Prometheus' text exposition format, version 0.0.4."""
    out: list[str] = []
    for fam in families:
        out.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        out.append(f"# TYPE {fam.name} {fam.type}")
        for s in fam.samples:
            labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in s.labels)
            out.append(f"{s.name}{{{labels}}} {format_value(s.value)}" if labels
                       else f"{s.name} {format_value(s.value)}")
    return "\n".join(out) + "\n"


class _Metric:
    type = ""

    def __init__(self, registry: Registry, name: str, help: str, labels: Sequence[str]):
        if not _NAME.match(name):
            raise ValueError(f"bad metric name {name!r}")
        for lab in labels:
            if not _LABEL.match(lab) or lab.startswith("__") or lab == "le":
                raise ValueError(f"bad label name {lab!r} for {name}")
        self.registry = registry
        self.name = name
        self.help = help
        self.labelnames = tuple(labels)
        self._values: dict[tuple[str, ...], Any] = {}

    def _key(self, labels: Mapping[str, Any]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[k]) for k in self.labelnames)

    def _pairs(self, key: tuple[str, ...]) -> dict[str, str]:
        return dict(zip(self.labelnames, key, strict=True))

    def family(self) -> Family:
        raise NotImplementedError


class _Scalar(_Metric):
    """One number per label set (counters and gauges)."""

    def value(self, **labels: Any) -> float:
        with self.registry.lock:
            return self._values.get(self._key(labels), 0)

    def family(self) -> Family:
        fam = Family(self.name, self.type, self.help)
        for key, v in sorted(self._values.items()):
            fam.add(v, **self._pairs(key))
        return fam


class Counter(_Scalar):
    """Only goes up. Its samples are named NAME (which must end in _total)."""
    type = "counter"

    def __init__(self, registry: Registry, name: str, help: str, labels: Sequence[str]):
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name!r}")
        super().__init__(registry, name, help, labels)

    def inc(self, amount: float = 1, **labels: Any) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot go down ({amount})")
        key = self._key(labels)
        with self.registry.lock:
            self._values[key] = self._values.get(key, 0) + amount

    def touch(self, **labels: Any) -> None:
        """Make the series exist at 0 (so a rate() sees it from the start)."""
        key = self._key(labels)
        with self.registry.lock:
            self._values.setdefault(key, 0)

class Gauge(_Scalar):
    type = "gauge"

    def set(self, value: float, **labels: Any) -> None:
        key = self._key(labels)
        with self.registry.lock:
            self._values[key] = value

    def inc(self, amount: float = 1, **labels: Any) -> None:
        key = self._key(labels)
        with self.registry.lock:
            self._values[key] = self._values.get(key, 0) + amount

class Histogram(_Metric):
    """Cumulative buckets (`le`), `_sum` and `_count`, as Prometheus expects."""
    type = "histogram"

    def __init__(self, registry: Registry, name: str, help: str, labels: Sequence[str],
                 buckets: Sequence[float]):
        super().__init__(registry, name, help, labels)
        bs = sorted(float(b) for b in buckets)
        if not bs or len(set(bs)) != len(bs):
            raise ValueError(f"{name}: buckets must be distinct and not empty")
        if bs[-1] != math.inf:
            bs.append(math.inf)
        self.buckets = tuple(bs)

    def observe(self, value: float, count: int = 1, **labels: Any) -> None:
        """`count` observations of `value` (e.g. one per token at a request's mean pace)."""
        if count <= 0:
            return
        key = self._key(labels)
        with self.registry.lock:
            state = self._values.get(key)
            if state is None:
                state = self._values[key] = [[0] * len(self.buckets), 0.0, 0]
            for i, b in enumerate(self.buckets):
                if value <= b:
                    state[0][i] += count
                    break
            state[1] += value * count
            state[2] += count

    def count(self, **labels: Any) -> int:
        with self.registry.lock:
            state = self._values.get(self._key(labels))
            return state[2] if state else 0

    def family(self) -> Family:
        fam = Family(self.name, self.type, self.help)
        for key, (counts, total, n) in sorted(self._values.items()):
            pairs = self._pairs(key)
            cum = 0
            for b, c in zip(self.buckets, counts, strict=True):
                cum += c
                fam.add(cum, "_bucket", **pairs, le=format_value(b))
            fam.add(total, "_sum", **pairs)
            fam.add(n, "_count", **pairs)
        return fam


Collector = Callable[[], Iterable[Family]]


class Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Collector] = []

    def _add(self, metric: _Metric) -> Any:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(self, name, help, labels))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(self, name, help, labels))

    def histogram(self, name: str, help: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = (0.1, 1, 10)) -> Histogram:
        return self._add(Histogram(self, name, help, labels, buckets))

    def collector(self, fn: Collector) -> None:
        """`fn` is called at every scrape and returns families of its own."""
        self._collectors.append(fn)

    def collect(self) -> list[Family]:
        with self.lock:
            fams = [m.family() for m in self._metrics.values()]
        for fn in self._collectors:
            fams.extend(fn())
        return fams

    def render(self) -> str:
        return render(self.collect())


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
WIRE_REASONS = ("oversize", "unsigned", "bad-signature", "undecodable", "not-a-map", "no-type",
                "version", "array")
MEMBER_STATES = ("alive", "suspect", "dead", "left")


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
        status = None
        if self._cluster is not None:
            try:
                status = self._cluster()
            except Exception:
                status = None
        if status:
            fams.extend(cluster_families(status))
        return fams


def verify_cost_families(costs: Mapping[str, VerifyCosts]) -> list[Family]:
    """Each model's measured verify-cost table (what /v1/models shows as `verify_costs`), as
    gauges labelled by model, width (rows in one verify call) and where it was measured."""
    seconds = Family(PREFIX + "verify_cost_seconds", "gauge",
                     "Seconds of one verify call of `width` rows where the model runs, "
                     "measured there (a tensor-parallel group measures its own when it forms).")
    relative = Family(PREFIX + "verify_cost_relative", "gauge",
                      "A verify call's cost relative to one row's (width 1 = 1.0): what the "
                      "depth controller prices drafts with.")
    measured = Family(PREFIX + "verify_costs_measured_timestamp_seconds", "gauge",
                      "Unix time the model's verify costs were measured.")
    for model, c in sorted(costs.items()):
        rel = c.relative
        for width, s in sorted(c.seconds.items()):
            seconds.add(s, model=model, width=width, where=c.where)
            relative.add(rel[width], model=model, width=width, where=c.where)
        measured.add(round(c.measured_at, 3), model=model, where=c.where)  # as /v1/models
    return [seconds, relative, measured]


def cluster_families(st: Mapping[str, Any]) -> list[Family]:
    """Cluster metrics from a node's status (GET /v1/cluster's object, plus `data_metrics`:
    the data plane's counters), read at scrape time."""
    p = PREFIX + "cluster_"
    states = collections.Counter(m.get("state") for m in st.get("members") or ())
    members = Family(p + "members", "gauge", "Members this node knows, by state.")
    for s in MEMBER_STATES:
        members.add(states.get(s, 0), state=s)
    metrics = st.get("metrics") or {}
    data = st.get("data_metrics") or {}
    rejected = Family(PREFIX + "wire_frames_rejected_total", "counter",
                      "Frames refused (and their connection closed), by plane and reason.")
    for plane, counts in (("control", metrics), ("data", data)):
        for reason in WIRE_REASONS:
            rejected.add(int(counts.get(f"wire_error_{reason}", 0)), plane=plane, reason=reason)
    frames = Family(PREFIX + "wire_frames_total", "counter",
                    "Control frames received and sent.")
    frames.add(int(metrics.get("frames_in", 0)), direction="in")
    frames.add(int(metrics.get("frames_out", 0)), direction="out")
    return [
        members,
        Family(p + "is_leader", "gauge", "1 when this node leads the cluster.").add(
            int(st.get("leader") is not None and st.get("leader") == st.get("node"))),
        Family(p + "has_leader", "gauge", "1 when this node knows a leader.").add(
            int(st.get("leader") is not None)),
        Family(p + "term", "gauge", "The election term this node is in.").add(
            int(st.get("term") or 0)),
        Family(p + "leader_changes_total", "counter",
               "Times this node learnt of a new leader (a new term with a leader; the first "
               "one included).").add(int(metrics.get("leader_changes", 0))),
        Family(p + "placements", "gauge", "Models placed in the cluster.").add(
            len(st.get("placements") or ())),
        Family(p + "placement_errors", "gauge", "Models asked for that fit nowhere now.").add(
            len(st.get("errors") or ())),
        rejected,
        frames,
        Family(PREFIX + "wire_frames_dropped_total", "counter",
               "Control frames dropped on the way out (full queue, failed connect).").add(
            int(metrics.get("frames_dropped", 0))),
        Family(PREFIX + "cluster_messages_failed_total", "counter",
               "Signed messages the control plane failed to handle.").add(
            int(metrics.get("bad_messages", 0))),
    ]
