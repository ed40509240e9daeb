"""Prometheus' text format (0.0.4) and a metrics registry, with no HTTP and no mlx: counters,
gauges and histograms with labels, updated from any thread, plus collectors called at scrape
time (what is read, not pushed: queue depth, the cluster's state). `telemetry.py` records a
node's requests into one; api/dashboard.py serves it at /metrics.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
