"""What an agent's OpenBLAS thread policy did during a bench's rounds, read from its /metrics:
forwards per thread count, forwards kept narrow by reason (`busy`: another process had a
runnable task; `shared`: another thread ran forwards; `tripped`: the guard was tripped),
thread switches and guard trips (`skulkp2p_blas_*`, README "Dashboard and metrics"). The
concurrency bench reads every agent of an (arm, mode) before and after each of its rounds and
reports the sums of the differences."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

METRICS_TIMEOUT_S = 10.0
_SAMPLE = re.compile(r'^skulkp2p_blas_(forwards|narrowed|thread_switches|guard_trips|light_loads)'
                     r'_total'
                     r'(?:\{(\w+)="([^"]*)"\})? (\S+)$')
_NARROW = re.compile(r'^skulkp2p_blas_threads\{bound="narrow",mode="\w+"\} (\S+)$')


@dataclass
class BlasPolicy:
    """The policy's counters (one scrape), or their differences over rounds."""
    forwards: dict[int, int] = field(default_factory=dict)  # thread count -> forwards
    narrowed: dict[str, int] = field(default_factory=dict)  # reason -> forwards
    switches: int = 0
    trips: int = 0
    light_loads: int = 0  # probe readings: a runnable task of others using little CPU
    narrow: int | None = None  # the policy's narrow count (a setting, not a counter)

    def minus(self, before: BlasPolicy) -> BlasPolicy:
        return BlasPolicy(
            {n: v - before.forwards.get(n, 0) for n, v in self.forwards.items()},
            {r: v - before.narrowed.get(r, 0) for r, v in self.narrowed.items()},
            self.switches - before.switches, self.trips - before.trips,
            self.light_loads - before.light_loads, self.narrow)

    def add(self, other: BlasPolicy) -> None:
        for n, v in other.forwards.items():
            self.forwards[n] = self.forwards.get(n, 0) + v
        for r, v in other.narrowed.items():
            self.narrowed[r] = self.narrowed.get(r, 0) + v
        self.switches += other.switches
        self.trips += other.trips
        self.light_loads += other.light_loads
        self.narrow = other.narrow if self.narrow is None else self.narrow

    def to_json(self) -> dict[str, Any]:
        total = sum(self.forwards.values())
        narrow = self.narrow if self.narrow is not None else min(self.forwards, default=1)
        wide = sum(v for n, v in self.forwards.items() if n > narrow)
        return {"forwards_per_threads": {str(n): v for n, v in sorted(self.forwards.items())},
                "wide_share": round(wide / total, 3) if total else None, "narrow": narrow,
                **{r: self.narrowed.get(r, 0) for r in ("busy", "shared", "tripped")},
                "switches": self.switches, "trips": self.trips,
                "light_loads": self.light_loads}


def parse_blas_policy(text: str) -> BlasPolicy | None:
    """The counters in a /metrics text, or None where it has none (no OpenBLAS there, no
    forward yet, an agent from before these metrics, a llama-server child)."""
    got = BlasPolicy()
    found = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            if (b := _NARROW.match(line)) is not None:
                got.narrow = int(float(b.group(1)))
            continue
        found = True
        family, _label, value, number = m.groups()
        n = int(float(number))
        if family == "forwards":
            got.forwards[int(value)] = n
        elif family == "narrowed":
            got.narrowed[value] = n
        elif family == "thread_switches":
            got.switches = n
        elif family == "light_loads":
            got.light_loads = n
        else:
            got.trips = n
    return got if found else None


def read_blas_policy(host: str, port: int) -> BlasPolicy | None:
    """One scrape of an agent's /metrics (None where it shows no policy or cannot be read:
    the report then says so rather than failing the bench)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics",
                                    timeout=METRICS_TIMEOUT_S) as r:
            return parse_blas_policy(r.read().decode("utf-8", "replace"))
    except OSError:
        return None


def read_all(agents: Iterable[tuple[str, int]]) -> list[BlasPolicy | None]:
    return [read_blas_policy(host, port) for host, port in agents]


def accumulate(total: BlasPolicy | None, before: list[BlasPolicy | None],
               after: list[BlasPolicy | None]) -> BlasPolicy | None:
    """`total` plus every agent's after - before (agents without counters add nothing; None
    while none had any)."""
    for b, a in zip(before, after, strict=True):
        if a is None:
            continue
        if total is None:
            total = BlasPolicy()
        total.add(a.minus(b if b is not None else BlasPolicy()))
    return total
