"""How many OpenBLAS threads each forward runs with on a CPU node.

A process starts with ``OPENBLAS_NUM_THREADS`` = cores - 1 (engine/cpu/blas.py: with as many spinning
workers as cores, a product whose worker is descheduled stalls). On a quiet 2-core node a second
thread still pays off where Python waits on the forward (a verify round, prefill): nothing of
ours needs the second core then. On a loaded node (other processes runnable: a 3-node CI cluster,
other jobs, even niced ones) two threads are a cliff: a forward takes many times as long
(docs/measurements/blas-threads.md). So this module
raises the count per forward only while it pays, and the forward calls it without knowing what
it decides:

* ``waited(width)``: a forward whose result the calling thread waits for. Two threads when the
  machine looks quiet (no other runnable task, per /proc/loadavg, now and for the last
  ``BUSY_HOLD_S``), and when the forwards of that width measured faster with two than with one.
  The first ``BASELINE`` forwards of each width class run with one thread (the reference), the
  next ``BASELINE`` with two; then the faster count, the other re-timed every ``EXPLORE_EVERY``
  forwards (while quiet).
* ``step()``: a one-token step of a pipelined greedy stretch (decode._pipelined: evaluated
  asynchronously while Python hands out the previous token). Timed as the interval between
  successive steps, chosen the same way.
* A two-thread forward slower than ``TRIP_RATIO`` x the one-thread reference of its class trips
  the guard: one thread everywhere for ``TRIP_S`` seconds (doubled on each trip, up to
  ``TRIP_MAX_S``), so a load that /proc/loadavg missed costs one forward, not a request.

The count only changes between forwards, after ``mx.synchronize()`` (nothing of mlx's is then
in a BLAS call), and only while one thread runs forwards: a second thread's forward (a server
running two requests' forwards side by side) pins one thread until it has been idle for
``SHARED_HOLD_S``. A batch scheduler's forwards count as one thread's (its rows' threads take
turns running its steps under its lock, so they never overlap): a batched step may run wide.

``SKULKP2P_BLAS_THREADS``: ``auto`` (default: the policy above), or a number (every forward
runs with that many threads; ``1``: one thread everywhere).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

ENV = "SKULKP2P_BLAS_THREADS"
AUTO = "auto"

BASELINE = 2  # forwards per width class timed at each count before choosing
EXPLORE_EVERY = 32  # then the count not chosen is re-timed once every this many forwards
STEP_BASELINE = 6  # pipelined steps: intervals are noisier (the consumer's Python is in them)
STEP_EXPLORE_EVERY = 96
EMA = 0.25  # weight of a new timing in a class's running figure
TRIP_RATIO = 1.6  # a wide forward this much slower than the narrow reference trips the guard
TRIP_S = 2.0
TRIP_MAX_S = 60.0
BUSY_HOLD_S = 1.0  # after another runnable task was seen, stay narrow this long
SHARED_HOLD_S = 1.0  # after a second thread ran a forward, stay narrow this long


def width_class(width: int) -> int:
    """Forwards of similar cost share timings: 1, 2, 4, 8, ... (the power of two at or above)."""
    return 1 << max(0, width - 1).bit_length()


@dataclass
class Timings:
    """One width class's running figures (seconds) per thread count."""
    seconds: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    calls: int = 0

    def record(self, threads: int, seconds: float) -> None:
        old = self.seconds.get(threads)
        self.seconds[threads] = seconds if old is None else old + EMA * (seconds - old)
        self.samples[threads] = self.samples.get(threads, 0) + 1


@dataclass
class Counters:
    """What the policy did, for the bench's report and the tests."""
    forwards: dict[int, int] = field(default_factory=dict)  # forwards (and steps) per count
    switches: int = 0
    trips: int = 0
    busy: int = 0  # decisions made narrow because another task was runnable
    shared: int = 0  # decisions made narrow because another thread ran forwards
    tripped: int = 0  # decisions made narrow because the guard was tripped


NARROW_REASONS = ("busy", "shared", "tripped")


@dataclass(frozen=True)
class PolicyCounts:
    """A snapshot of the policy's settings and counters since the process started (what an
    agent's /metrics exports; the concurrency bench reads their deltas per arm)."""
    mode: str  # "auto" | "fixed"
    narrow: int
    wide: int  # the fixed count in "fixed" mode
    forwards: dict[int, int]  # forwards (and pipelined steps) run with each thread count
    switches: int  # thread count changes
    trips: int  # times the guard tripped (a wide forward TRIP_RATIO slower than narrow)
    narrowed: dict[str, int]  # forwards the timings would run wide that ran narrow, by reason
    light_loads: int = 0  # probe readings that saw a lasting runnable task using little CPU


def _running(stat_path: str) -> int:
    """1 if the task of this /proc stat file is running or runnable (state R), else 0."""
    try:
        with open(stat_path, "rb") as fh:
            text = fh.read()
    except OSError:
        return 0  # the thread ended meanwhile
    return int(text[text.rfind(b")") + 2:text.rfind(b")") + 3] == b"R")


class LoadProbe:
    """Whether another process has a task running or waiting for a CPU: /proc/loadavg's count
    of runnable tasks (every task on the machine, ours included) less this process's own.

    Read naively (loadavg, then our threads' states) it called a quiet machine busy: our own
    threads change state between the two reads (mlx's stream thread finishing a pipelined
    step, an OpenBLAS worker going to sleep after its share of a product), and a kernel thread
    (kworker, kdamond, rcu) is runnable for a few microseconds now and then
    (docs/measurements/blas-threads.md, "What the load probe sees"). So:

    * our threads' states are read both before and after loadavg, and the larger count is
      ours (a thread that ran at the loadavg read is running at one of the two reads unless it
      both woke and slept within ~0.1 ms);
    * one excess is noise until seen again: a load counts when the last ``CONFIRM`` readings
      all saw one (a CPU-bound process is runnable at every reading; a transient is not);
    * readings are at most one per ``EVERY_S`` (0.1-0.3 ms each, on the decode's path:
      docs/measurements/blas-threads.md, "What the load probe sees"): in between, the last answer stands, except
      that a reading which saw a load not yet confirmed is followed by another at the next
      call, so a lasting load is confirmed one forward after it is first seen.

    * a confirmed count is a load only if other processes also used ``OTHERS_CPU_MIN`` of a
      core over the last ``WINDOW_S`` (/proc/stat's busy ticks less this process's own). The
      clients of a server streaming tokens wake for each chunk right after a step, when the
      next step's reading is taken: runnable at every reading yet using a sliver of a core,
      they held batched steps narrow as "busy" where nothing else ran
      (docs/measurements/concurrency.md, "What the thread policy does through HTTP";
      bench --concurrency 4). A
      CPU-bound process uses a core or a fair share of one, whatever its nice value.

    A load that comes and goes faster than this is missed; the policy's guard (a two-thread
    forward ``TRIP_RATIO`` slower than one thread's) catches what it costs.
    ``__call__`` returns the count of other runnable tasks, 0 while unconfirmed, while other
    processes use less than OTHERS_CPU_MIN, or where /proc cannot be read (without /proc/stat:
    the runnable count alone)."""

    CONFIRM = 2
    EVERY_S = 0.25
    OTHERS_CPU_MIN = 0.25  # cores' worth of CPU other processes use for their tasks to count
    WINDOW_S = 0.25  # CPU use is measured over windows this long (ticks are 10 ms)
    MIN_SPAN_S = 0.1  # a window under way this long already counts (a load that just began)

    def __init__(self, proc: str = "/proc", clock: Callable[[], float] = time.monotonic):
        self.proc = proc
        self._clock = clock
        self._last_read: float | None = None
        self._streak = 0  # consecutive readings that saw another runnable task
        self._answer = 0
        self.readings = 0  # how many times /proc was read (tests, reports)
        self._hz = _clock_ticks()
        self._window: tuple[float, int, int] | None = None  # (start, machine ticks, ours)
        self._share: float | None = None  # the last complete window's, in cores
        self.light = 0  # confirmed runnable counts ignored: others used little CPU (reports)

    def own_running(self) -> int:
        """This process's tasks in state R (the calling thread is one)."""
        base = f"{self.proc}/self/task"
        try:
            tasks = os.listdir(base)
        except OSError:
            return 0
        return sum(_running(f"{base}/{t}/stat") for t in tasks)

    def _machine_running(self) -> int:
        with open(f"{self.proc}/loadavg", encoding="ascii") as fh:
            return int(fh.read().split()[3].split("/")[0])

    def _cpu_ticks(self) -> tuple[int, int] | None:
        """(the machine's busy ticks, this process's) now, from /proc/stat's first line (user,
        nice, system, steal: another guest's use of our host is a load too) and
        /proc/self/stat (utime, stime); None where they cannot be read."""
        try:
            with open(f"{self.proc}/stat", "rb") as fh:
                cpu = fh.readline().split()
            with open(f"{self.proc}/self/stat", "rb") as fh:
                text = fh.read()
            own = text[text.rfind(b")") + 2:].split()
            machine = int(cpu[1]) + int(cpu[2]) + int(cpu[3]) + \
                (int(cpu[8]) if len(cpu) > 8 else 0)
            return machine, int(own[11]) + int(own[12])
        except (OSError, ValueError, IndexError):
            return None

    def others_cpu(self) -> float | None:
        """Cores' worth of CPU other processes used over the window under way (once it is
        MIN_SPAN_S long; before that, the last complete one's); None before any window or
        where /proc/stat cannot be read. A window closes after WINDOW_S."""
        now = self._clock()
        ticks = self._cpu_ticks()
        if ticks is None:
            return None
        if self._window is None:
            self._window = (now, *ticks)
            return None
        start, machine, own = self._window
        span = now - start
        if span < self.MIN_SPAN_S:
            return self._share
        share = max(0.0, (ticks[0] - machine) - (ticks[1] - own)) / self._hz / span
        if span >= self.WINDOW_S:
            self._share, self._window = share, (now, *ticks)
        return share

    def read(self) -> int:
        """One reading: other processes' runnable tasks now (no confirmation, no rate limit)."""
        try:
            before = self.own_running()
            running = self._machine_running()
            after = self.own_running()
        except (OSError, ValueError, IndexError):
            return 0
        return max(0, running - max(before, after))

    def __call__(self) -> int:
        now = self._clock()
        confirming = 0 < self._streak < self.CONFIRM
        if self._last_read is not None and now - self._last_read < self.EVERY_S \
                and not confirming:
            return self._answer
        self._last_read = now
        self.readings += 1
        others = self.read()
        share = self.others_cpu()  # every reading: keeps the CPU windows current
        self._streak = self._streak + 1 if others > 0 else 0
        self._answer = others if self._streak >= self.CONFIRM else 0
        if self._answer and share is not None and share < self.OTHERS_CPU_MIN:
            self.light += 1
            self._answer = 0
        return self._answer


def _clock_ticks() -> int:
    """/proc's time unit per second (USER_HZ, 100 on Linux)."""
    try:
        return int(os.sysconf("SC_CLK_TCK")) or 100
    except (AttributeError, OSError, ValueError):
        return 100


def other_runnable() -> int:
    """Tasks of other processes running or waiting for a CPU at this moment (one unconfirmed
    reading of LoadProbe: for tools and tests; the policy uses a LoadProbe)."""
    return LoadProbe().read()


class OpenBlasThreads:
    """The calls into the preloaded libopenblas (ctypes, symbols found in the process)."""

    def __init__(self, lib: ctypes.CDLL):
        self._set = lib.openblas_set_num_threads
        self._set.argtypes = [ctypes.c_int]
        self._set.restype = None
        self._get = lib.openblas_get_num_threads
        self._get.restype = ctypes.c_int

    @classmethod
    def find(cls) -> OpenBlasThreads | None:
        """The OpenBLAS this process runs, or None (no preload: reference BLAS, macOS)."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            lib = ctypes.CDLL(None)
            lib.openblas_set_num_threads  # noqa: B018  (AttributeError when absent)
            lib.openblas_get_num_threads  # noqa: B018
        except (OSError, AttributeError):
            return None
        return cls(lib)

    def get(self) -> int:
        return int(self._get())

    def set(self, n: int) -> None:
        self._set(n)


def parse_setting(text: str | None) -> int | None:
    """``SKULKP2P_BLAS_THREADS``: None for auto, else the fixed count (a clear error if bad)."""
    value = (text or "").strip().lower()
    if value in ("", AUTO):
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={text!r}: expected 'auto' or a thread count >= 1")
    return n


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadPolicy:
    """Per-forward OpenBLAS thread counts (see the module's docstring)."""

    def __init__(self, blas: OpenBlasThreads, narrow: int, wide: int, fixed: int | None,
                 sync: Callable[[], None], runnable: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.blas = blas
        self.narrow = narrow
        self.wide = max(wide, narrow)
        self.fixed = fixed
        self._sync = sync
        self._runnable = runnable if runnable is not None else LoadProbe()
        self._clock = clock
        self._lock = threading.Lock()
        self.current = blas.get()
        self.timings: dict[tuple[str, int], Timings] = {}  # (kind, width class) -> timings
        self.counters = Counters()
        self._trip_until = 0.0
        self._trip_s = TRIP_S
        self._busy_until = 0.0
        self._owner: int | None = None
        self._owner_seen = 0.0
        self._shared_until = 0.0
        self._step_last: tuple[float, int] | None = None  # (when, count) of the last step
        self._pinned: int | None = None

    @property
    def auto(self) -> bool:
        return self.fixed is None and self.wide > self.narrow

    def describe(self) -> dict[str, str | int | dict[str, int]]:
        """The policy's settings and what it did, for reports (the `counts` snapshot as JSON)."""
        c = self.counts()
        return {"mode": c.mode, "narrow": c.narrow, "wide": c.wide,
                "forwards_per_count": {str(k): v for k, v in sorted(c.forwards.items())},
                "switches": c.switches, "trips": c.trips, **c.narrowed}

    def counts(self) -> PolicyCounts:
        """The counters now. Read without the policy's lock, which a forward may hold while it
        synchronizes (a scrape must not wait on it): each field is one read under the GIL
        (dict() copies in one step), so a snapshot may be a forward behind, never torn."""
        c = self.counters
        return PolicyCounts(mode=AUTO if self.fixed is None else "fixed", narrow=self.narrow,
                            wide=self.wide if self.fixed is None else self.fixed,
                            forwards=dict(c.forwards), switches=c.switches, trips=c.trips,
                            narrowed={"busy": c.busy, "shared": c.shared,
                                      "tripped": c.tripped},
                            light_loads=int(getattr(self._runnable, "light", 0)))

    # ---------------------------------------------------------------- switching

    def _use(self, n: int) -> None:
        if n != self.current:
            self._sync()  # nothing of mlx's is in a BLAS call while the count changes
            self.blas.set(n)
            self.current = n
            self.counters.switches += 1
        self.counters.forwards[n] = self.counters.forwards.get(n, 0) + 1

    @contextmanager
    def pinned(self, n: int) -> Iterator[None]:
        """Every forward runs with ``n`` threads inside (the bench's static peer arms)."""
        with self._lock:
            self._pinned = n
            self._use(n)
        try:
            yield
        finally:
            with self._lock:
                self._pinned = None

    # ---------------------------------------------------------------- deciding

    def _note_thread(self, now: float, owner: object | None) -> None:
        """A forward from another thread than the last one's, within SHARED_HOLD_S: shared.
        `owner`: forwards that can never overlap (a batch scheduler's steps, which its rows'
        threads take in turns under its lock) count as one thread's, whichever thread runs
        them."""
        me = threading.get_ident() if owner is None else id(owner)
        if self._owner is not None and self._owner != me and \
                now - self._owner_seen < SHARED_HOLD_S:
            self._shared_until = now + SHARED_HOLD_S
        self._owner, self._owner_seen = me, now

    def _narrow_because(self, now: float) -> bool:
        """Whether a forward the timings would run wide must run narrow: another thread runs
        forwards, the guard is tripped, or another process has a task runnable."""
        if now < self._shared_until:
            self.counters.shared += 1
            return True
        if now < self._trip_until:
            self.counters.tripped += 1
            return True
        if self._runnable() > 0:  # read only here: /proc costs ~0.1 ms a call
            self._busy_until = now + BUSY_HOLD_S
        if now < self._busy_until:
            self.counters.busy += 1
            return True
        return False

    def _choose(self, t: Timings, baseline: int, explore_every: int) -> int:
        narrow_n = t.samples.get(self.narrow, 0)
        wide_n = t.samples.get(self.wide, 0)
        if narrow_n < baseline:
            return self.narrow
        if wide_n < baseline:
            return self.wide
        best = self.wide if t.seconds[self.wide] < t.seconds[self.narrow] else self.narrow
        other = self.narrow if best == self.wide else self.wide
        return other if t.calls % explore_every == 0 else best

    def _decide(self, key: tuple[str, int], baseline: int, explore_every: int,
                owner: object | None = None) -> int:
        if self._pinned is not None:
            return self._pinned
        if self.fixed is not None:
            return self.fixed
        if not self.auto:
            return self.narrow
        t = self.timings.setdefault(key, Timings())
        t.calls += 1
        now = self._clock()
        self._note_thread(now, owner)
        choice = self._choose(t, baseline, explore_every)
        if choice != self.narrow and self._narrow_because(now):
            return self.narrow
        return choice

    def _observe(self, key: tuple[str, int], threads: int, seconds: float) -> None:
        t = self.timings.setdefault(key, Timings())
        reference = t.seconds.get(self.narrow)
        if threads == self.wide and reference is not None and seconds > TRIP_RATIO * reference:
            # Slower than one thread by a margin: the machine got busy; one thread for a while.
            self._trip_until = self._clock() + self._trip_s
            self._trip_s = min(2 * self._trip_s, TRIP_MAX_S)
            self.counters.trips += 1
            return  # an outlier: it would hold the class at narrow long after the load went
        if threads == self.wide and reference is not None:
            self._trip_s = max(TRIP_S, self._trip_s / 2)
        t.record(threads, seconds)

    # ---------------------------------------------------------------- the forward's calls

    @contextmanager
    def waited(self, width: int, kind: str = "forward", owner: object | None = None
               ) -> Iterator[None]:
        """Around a forward of ``width`` tokens that the calling thread evaluates and waits for
        (`owner`: see _note_thread)."""
        key = (kind, width_class(width))
        with self._lock:
            n = self._decide(key, BASELINE, EXPLORE_EVERY, owner)
            self._use(n)
            self._step_last = None  # the next step's interval would include this forward
        start = self._clock()
        yield
        elapsed = self._clock() - start
        if self._pinned is None and self.fixed is None:
            with self._lock:
                self._observe(key, n, elapsed)

    def step(self, owner: object | None = None) -> None:
        """Before building a pipelined one-token step (the previous one may still be running;
        `owner`: see _note_thread)."""
        key = ("step", 1)
        with self._lock:
            now = self._clock()
            last, self._step_last = self._step_last, None
            if last is not None and last[1] == self.current and self._pinned is None \
                    and self.fixed is None:
                self._observe(key, self.current, now - last[0])
            n = self._decide(key, STEP_BASELINE, STEP_EXPLORE_EVERY, owner)
            switched = n != self.current
            self._use(n)
            # An interval that began before a switch (a drained pipeline) times neither count.
            self._step_last = None if switched else (self._clock(), n)


_policy: ThreadPolicy | None = None
_policy_lock = threading.Lock()
_NO_POLICY = object()
# Set by the CPU switch (switch.install): until then no forward changes the thread count.
_armed = False


def arm() -> None:
    """Let forwards run under the policy (switch.install calls it; the policy is made at the
    first forward after)."""
    global _armed
    _armed = True


def policy() -> ThreadPolicy | None:
    """This process's policy, made on first use (after mlx and OpenBLAS are loaded); None when
    no OpenBLAS runs here, or before the CPU switch armed it (switch.install)."""
    global _policy
    if not _armed:
        return None
    if _policy is None:
        with _policy_lock:
            if _policy is None:
                _policy = _make() or _NO_POLICY  # type: ignore[assignment]
    return None if _policy is _NO_POLICY else _policy


def _make() -> ThreadPolicy | None:
    fixed = parse_setting(os.environ.get(ENV))
    blas = OpenBlasThreads.find()
    if blas is None:
        return None
    import mlx.core as mx

    start = blas.get()
    narrow = start
    wide = max(start, cores())
    return ThreadPolicy(blas, narrow, wide, fixed, mx.synchronize)


def counts() -> PolicyCounts | None:
    """The policy's counters, or None while no forward has made it (nothing ran here yet) or
    where no OpenBLAS runs. Never makes the policy: a scrape must not load mlx."""
    p = _policy
    return None if p is None or p is _NO_POLICY else p.counts()


@contextmanager
def waited(width: int, kind: str = "forward", owner: object | None = None) -> Iterator[None]:
    """Around a forward the calling thread waits for (no-op without OpenBLAS). `owner`: the
    object whose forwards never overlap, whichever thread runs them (ThreadPolicy._note_thread);
    None: the calling thread."""
    p = policy()
    if p is None:
        yield
        return
    with p.waited(width, kind, owner):
        yield


def step(owner: object | None = None) -> None:
    """Before a pipelined step is built (no-op without OpenBLAS; `owner` as for waited)."""
    p = policy()
    if p is not None:
        p.step(owner)


@contextmanager
def pinned(n: int | None) -> Iterator[None]:
    """Run what is inside with ``n`` threads for every forward (None: the policy decides)."""
    p = policy()
    if p is None or n is None:
        yield
        return
    with p.pinned(n):
        yield
