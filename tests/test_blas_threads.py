"""Per-forward OpenBLAS thread counts (skulkp2p.engine.cpu.blas_threads).

The decisions are tested on a ThreadPolicy with a clock the test advances (a forward "takes" what
the test says) and a load probe the test sets; the calls into OpenBLAS are recorded. Whether the
real libopenblas runs with the count the policy says, and whether greedy decoding stays exact
whatever the count, is tested in a child interpreter with OpenBLAS preloaded (the preload only
counts at process start), on SmolLM2-135M: a tiny model's products are too small for OpenBLAS
to split across threads at all. The child runs every setting in turn (see CHILD).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from skulkp2p.engine.cpu import blas_threads as bt
from tests.helpers.blas import child_env, fast_path_available


class RecordingBlas:
    """Stands in for libopenblas's two calls; keeps what was set, in order, with the syncs."""

    def __init__(self, start: int = 1):
        self.n = start
        self.calls: list[str] = []

    def get(self) -> int:
        return self.n

    def set(self, n: int) -> None:
        self.calls.append(f"set {n}")
        self.n = n


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(fixed: int | None = None, busy: list[int] | None = None
         ) -> tuple[bt.ThreadPolicy, RecordingBlas, Clock]:
    blas, clock = RecordingBlas(), Clock()
    others = busy if busy is not None else [0]
    policy = bt.ThreadPolicy(blas, narrow=1, wide=2, fixed=fixed,  # type: ignore[arg-type]
                             sync=lambda: blas.calls.append("sync"),
                             runnable=lambda: others[0], clock=clock)
    return policy, blas, clock


def forward(policy: bt.ThreadPolicy, clock: Clock, width: int, seconds: float) -> int:
    """One waited forward that takes `seconds`; the count it ran with."""
    with policy.waited(width):
        used = policy.blas.get()
        assert used == policy.current
        clock.t += seconds
    return used


def test_parse_setting() -> None:
    assert bt.parse_setting(None) is None
    assert bt.parse_setting(" Auto ") is None
    assert bt.parse_setting("2") == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="SKULKP2P_BLAS_THREADS"):
            bt.parse_setting(bad)


def test_width_classes() -> None:
    assert [bt.width_class(w) for w in (1, 2, 3, 4, 5, 9, 16, 17, 512)] == \
        [1, 2, 4, 4, 8, 16, 16, 32, 512]


def test_fixed_count_for_every_forward() -> None:
    policy, blas, clock = make(fixed=2)
    used = [forward(policy, clock, w, 0.05) for w in (1, 9, 300, 1)]
    policy.step()
    assert used == [2, 2, 2, 2] and blas.n == 2
    assert blas.calls == ["sync", "set 2"]  # switched once, after draining mlx's stream


def test_quiet_baseline_then_the_faster_count_and_exploring() -> None:
    policy, blas, clock = make()
    # Two threads take 40 ms where one takes 50 (a quiet 2-core node, w = 1).
    cost = {1: 0.050, 2: 0.040}
    used = []
    for _ in range(2 * bt.BASELINE + 2 * bt.EXPLORE_EVERY):
        with policy.waited(1):
            n = blas.get()
            clock.t += cost[n]
        used.append(n)
    assert used[:2 * bt.BASELINE] == [1] * bt.BASELINE + [2] * bt.BASELINE
    rest = used[2 * bt.BASELINE:]
    assert rest.count(1) == 2 and rest.count(2) == len(rest) - 2  # one re-timing per period
    # Every switch drains mlx's stream first.
    assert all(blas.calls[i - 1] == "sync" for i, c in enumerate(blas.calls)
               if c.startswith("set"))


def test_two_threads_slower_keeps_one() -> None:
    policy, blas, clock = make()
    cost = {1: 0.050, 2: 0.060}  # slower but within the trip margin: chosen against, no trip
    used = []
    for _ in range(2 * bt.BASELINE + 10):
        with policy.waited(4):
            n = blas.get()
            clock.t += cost[n]
        used.append(n)
    assert used[2 * bt.BASELINE:] == [1] * 10
    assert policy.counters.trips == 0


def test_widths_choose_separately() -> None:
    policy, blas, clock = make()
    cost = {(1, 1): 0.050, (1, 2): 0.060, (16, 1): 0.090, (16, 2): 0.060}
    for _ in range(2 * bt.BASELINE + 3):
        for w in (1, 16):
            with policy.waited(w):
                clock.t += cost[(w, blas.get())]
    assert forward(policy, clock, 1, 0.05) == 1
    assert forward(policy, clock, 16, 0.06) == 2


def test_a_cliff_trips_to_one_thread_and_backs_off() -> None:
    policy, blas, clock = make()
    for _ in range(bt.BASELINE):
        assert forward(policy, clock, 4, 0.070) == 1
    # The machine got busy between two probes of /proc/loadavg: a two-thread forward takes 2 s.
    assert forward(policy, clock, 4, 2.0) == 2
    assert policy.counters.trips == 1
    assert forward(policy, clock, 4, 0.070) == 1  # one thread at once, for TRIP_S
    clock.t += bt.TRIP_S
    assert forward(policy, clock, 4, 2.5) == 2  # re-tried after the trip: still a cliff
    assert policy.counters.trips == 2
    clock.t += bt.TRIP_S  # the second trip lasts twice as long
    assert forward(policy, clock, 4, 0.070) == 1
    clock.t += bt.TRIP_S
    assert forward(policy, clock, 4, 0.060) == 2  # load gone: two threads again
    assert policy.timings[("forward", 4)].samples[2] == 1  # the cliffs were not averaged in
    # What /metrics exports: the two forwards held narrow by a trip are counted as such.
    counts = policy.counts()
    assert counts.trips == 2 and counts.narrowed == {"busy": 0, "shared": 0, "tripped": 2}
    assert counts.forwards == {1: bt.BASELINE + 2, 2: 3} and counts.mode == "auto"


def test_another_runnable_task_means_one_thread() -> None:
    busy = [0]
    policy, blas, clock = make(busy=busy)
    cost = {1: 0.050, 2: 0.040}
    for _ in range(2 * bt.BASELINE):
        with policy.waited(1):
            clock.t += cost[blas.get()]
    assert forward(policy, clock, 1, 0.04) == 2
    busy[0] = 1
    assert forward(policy, clock, 1, 0.05) == 1
    busy[0] = 0
    assert forward(policy, clock, 1, 0.05) == 1  # held for BUSY_HOLD_S after it was seen
    clock.t += bt.BUSY_HOLD_S
    assert forward(policy, clock, 1, 0.04) == 2
    assert policy.counters.busy == 2


def test_a_second_thread_running_forwards_means_one_thread() -> None:
    policy, blas, clock = make()
    cost = {1: 0.050, 2: 0.040}
    for _ in range(2 * bt.BASELINE):
        with policy.waited(1):
            clock.t += cost[blas.get()]
    assert forward(policy, clock, 1, 0.04) == 2
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(forward(policy, clock, 1, 0.05)))
    other.start()
    other.join(timeout=30)
    assert seen == [1]
    assert forward(policy, clock, 1, 0.05) == 1  # both threads narrow while they overlap
    clock.t += bt.SHARED_HOLD_S + 0.1
    assert forward(policy, clock, 1, 0.04) == 2


def test_forwards_of_one_owner_from_several_threads_may_run_wide() -> None:
    """A batch scheduler's steps are run by whichever row's thread holds its lock: they never
    overlap, so they count as one owner's and keep two threads; a forward of another owner (or
    of no owner: its thread) in between is shared, and narrow."""
    policy, blas, clock = make()
    sched, other_model = object(), object()
    cost = {1: 0.050, 2: 0.040}
    for _ in range(2 * bt.BASELINE):
        with policy.waited(4, "batch", owner=sched):
            clock.t += cost[blas.get()]

    def batch_step(owner: object) -> int:
        with policy.waited(4, "batch", owner=owner):
            clock.t += 0.04
            return blas.get()

    seen: list[int] = []
    for _ in range(3):  # three row threads take turns running the scheduler's steps
        t = threading.Thread(target=lambda: seen.append(batch_step(sched)))
        t.start()
        t.join(timeout=30)
    assert seen == [2, 2, 2]
    assert policy.counters.shared == 0
    assert batch_step(other_model) == 1  # another model's forward: shared, narrow
    assert batch_step(sched) == 1  # and the scheduler's, while they overlap
    assert policy.counters.shared == 2


def test_pipelined_steps_time_their_intervals() -> None:
    policy, blas, clock = make()
    interval = {1: 0.050, 2: 0.045}
    used = []
    for _ in range(2 * bt.STEP_BASELINE + 6):
        policy.step()
        used.append(blas.get())
        clock.t += interval[blas.get()]
    t = policy.timings[("step", 1)]
    # A step's interval is timed from the previous step; the first interval after a switch
    # (the pipeline was drained for it) times neither count.
    assert used[:bt.STEP_BASELINE + 1] == [1] * bt.STEP_BASELINE + [2]
    assert t.samples[1] == bt.STEP_BASELINE
    assert t.samples[2] == used.count(2) - 2
    assert used[-1] == 2
    assert t.seconds[2] == pytest.approx(0.045) and t.seconds[1] == pytest.approx(0.050)
    # A waited forward in between breaks the chain of intervals.
    forward(policy, clock, 4, 0.5)
    before = dict(t.samples)
    policy.step()
    assert t.samples == before


def test_pinned_overrides_and_is_not_timed() -> None:
    policy, blas, clock = make()
    with policy.pinned(2):
        assert forward(policy, clock, 1, 5.0) == 2
        policy.step()
        assert blas.n == 2
    assert policy.counters.trips == 0 and ("forward", 1) not in policy.timings
    assert forward(policy, clock, 1, 0.05) == 1  # the policy again (baseline: narrow)


def test_other_runnable_reads_proc() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    n = bt.other_runnable()
    assert isinstance(n, int) and n >= 0


class FakeProc:
    """A /proc with loadavg and this process's tasks (self/task/<tid>/stat), as files."""

    def __init__(self, root: Path):
        self.root = root
        (root / "self" / "task").mkdir(parents=True)
        self.running(1)

    def running(self, n: int) -> None:
        """/proc/loadavg's runnable count (the machine's, ours included)."""
        (self.root / "loadavg").write_text(f"0.50 0.40 0.30 {n}/321 4567\n")

    def task(self, tid: int, state: str, comm: str = "python3") -> None:
        d = self.root / "self" / "task" / str(tid)
        d.mkdir(exist_ok=True)
        (d / "stat").write_text(f"{tid} ({comm}) {state} 1 {tid} {tid} 0 -1 4194560 0 0\n")

    def gone(self, tid: int) -> None:
        d = self.root / "self" / "task" / str(tid)
        (d / "stat").unlink()
        d.rmdir()

    def cpu(self, machine: int, ours: int) -> None:
        """/proc/stat's busy ticks (user, nice, system and steal; idle and the rest beside
        them) and this process's (/proc/self/stat's utime + stime)."""
        u, n = machine // 2, machine // 4
        sy = machine - u - n - 3
        (self.root / "stat").write_text(f"cpu  {u} {n} {sy} 99999 7 5 6 3 0 0\ncpu0 1 2 3\n")
        (self.root / "self" / "stat").write_text(
            f"4567 (python3) R 1 4567 4567 0 -1 4194560 10 0 0 0 {ours - 2} 2 0 0 20 0 9 0\n")


EVERY = 1.01 * bt.LoadProbe.EVERY_S  # one reading interval of the probe (and a hair: floats)


def probe_on(root: Path) -> tuple[bt.LoadProbe, FakeProc, Clock]:
    clock = Clock()
    return bt.LoadProbe(str(root), clock), FakeProc(root), clock


def test_probe_subtracts_our_running_threads(tmp_path: Path) -> None:
    probe, proc, _ = probe_on(tmp_path)
    proc.task(10, "R")  # the calling thread
    proc.task(11, "R", "mlx stream")  # ours: running a step
    proc.task(12, "S", "openblas")
    proc.running(2)
    assert probe.read() == 0
    proc.running(3)  # one task more than ours runnable: another process's
    assert probe.read() == 1
    proc.task(12, "R")  # ... or our BLAS worker woke: ours, not another's
    assert probe.read() == 0
    proc.gone(12)  # a thread that ended between listing and reading counts as not running
    proc.running(2)
    assert probe.read() == 0


def test_probe_counts_a_thread_of_ours_that_slept_after_loadavg_as_ours(tmp_path: Path
                                                                         ) -> None:
    """Our thread ran when loadavg was read and slept before its state was read: ours all the
    same (the probe before, loadavg then our states, called it another process's task)."""
    proc = FakeProc(tmp_path)
    proc.task(10, "R")
    proc.task(11, "R", "mlx stream")
    proc.running(2)

    class SleepsAfterLoadavg(bt.LoadProbe):
        def _machine_running(self) -> int:
            n = super()._machine_running()
            proc.task(11, "S", "mlx stream")  # the step finished right after the read
            return n

    assert SleepsAfterLoadavg(str(tmp_path), Clock()).read() == 0
    # The same moment read loadavg-then-ours, as before: one "other" task that was ours.
    proc.task(11, "R", "mlx stream")
    running = 2
    proc.task(11, "S", "mlx stream")
    assert running - bt.LoadProbe(str(tmp_path)).own_running() == 1


def test_probe_confirms_a_load_before_reporting_it(tmp_path: Path) -> None:
    probe, proc, clock = probe_on(tmp_path)
    proc.task(10, "R")
    proc.running(2)  # a transient: one reading sees another task, the next does not
    assert probe() == 0
    clock.t += EVERY
    proc.running(1)
    assert probe() == 0
    clock.t += EVERY
    proc.running(3)  # a lasting load: reported from its CONFIRM-th reading on
    answers = []
    for _ in range(bt.LoadProbe.CONFIRM + 1):
        answers.append(probe())
        clock.t += EVERY
    assert answers == [0] * (bt.LoadProbe.CONFIRM - 1) + [2, 2]
    proc.running(1)
    assert probe() == 0  # gone: reported gone at once


def test_probe_reads_proc_at_most_every_interval(tmp_path: Path) -> None:
    probe, proc, clock = probe_on(tmp_path)
    proc.task(10, "R")
    proc.running(2)
    for _ in range(bt.LoadProbe.CONFIRM):
        probe()
        clock.t += EVERY
    assert probe() == 1 and probe.readings == bt.LoadProbe.CONFIRM + 1
    proc.running(1)
    clock.t += 0.4 * EVERY
    assert probe() == 1 and probe.readings == bt.LoadProbe.CONFIRM + 1  # the last answer stands
    clock.t += 0.7 * EVERY
    assert probe() == 0 and probe.readings == bt.LoadProbe.CONFIRM + 2


def test_probe_confirms_at_the_next_call_not_the_next_interval(tmp_path: Path) -> None:
    probe, proc, clock = probe_on(tmp_path)
    proc.task(10, "R")
    assert probe() == 0 and probe.readings == 1
    proc.running(2)
    clock.t += EVERY
    answers = [probe()]  # seen once: not yet a load
    for _ in range(bt.LoadProbe.CONFIRM - 1):
        clock.t += 0.001  # the next forward, well within the interval: read again all the same
        answers.append(probe())
    assert answers == [0] * (bt.LoadProbe.CONFIRM - 1) + [1]
    assert probe.readings == 1 + bt.LoadProbe.CONFIRM
    clock.t += 0.001
    assert probe() == 1 and probe.readings == 1 + bt.LoadProbe.CONFIRM  # confirmed: cached


def test_probe_ignores_runnable_tasks_that_use_little_cpu(tmp_path: Path) -> None:
    """A lasting runnable count is a load only if other processes also used OTHERS_CPU_MIN of
    a core: a server's streaming clients wake for each chunk just before the next step's
    reading (runnable at every reading) but use ~1% of a core; a CPU-bound process uses one."""
    probe, proc, clock = probe_on(tmp_path)
    hz = bt._clock_ticks()
    machine, ours = 1000, 600
    proc.task(10, "R")
    proc.running(2)  # another task runnable at every reading below
    proc.cpu(machine, ours)

    def after(seconds: float, others_cores: float, ours_cores: float = 1.0) -> int:
        nonlocal machine, ours
        clock.t += seconds
        ours += round(ours_cores * seconds * hz)
        machine += round(ours_cores * seconds * hz) + round(others_cores * seconds * hz)
        proc.cpu(machine, ours)
        return probe()

    light = [after(EVERY, 0.01) for _ in range(8)]  # the clients: 1% of a core
    assert light == [0] * 8 and probe.light >= 6
    # A CPU-bound process: reported once a window has seen it, and from then on.
    heavy = [after(EVERY, 1.0) for _ in range(4)]
    assert heavy[-2:] == [1, 1], heavy
    assert probe.others_cpu() == pytest.approx(1.0, abs=0.1)


def test_probe_without_proc_stat_counts_runnable_tasks_alone(tmp_path: Path) -> None:
    probe, proc, clock = probe_on(tmp_path)  # a /proc with loadavg and our tasks, no stat
    proc.task(10, "R")
    proc.running(2)
    answers = []
    for _ in range(bt.LoadProbe.CONFIRM):
        answers.append(probe())
        clock.t += EVERY
    assert answers[-1] == 1 and probe.others_cpu() is None


def test_probe_without_proc_says_quiet(tmp_path: Path) -> None:
    probe = bt.LoadProbe(str(tmp_path / "absent"), Clock())
    assert probe.read() == 0 and probe() == 0


def test_policy_on_a_fake_proc_goes_narrow_only_for_a_lasting_load(tmp_path: Path) -> None:
    blas, clock = RecordingBlas(), Clock()
    proc = FakeProc(tmp_path)
    proc.task(10, "R")
    proc.running(1)
    policy = bt.ThreadPolicy(blas, narrow=1, wide=2, fixed=None,  # type: ignore[arg-type]
                             sync=lambda: None, runnable=bt.LoadProbe(str(tmp_path), clock),
                             clock=clock)
    cost = {1: 0.050, 2: 0.040}
    for _ in range(2 * bt.BASELINE):
        with policy.waited(1):
            clock.t += cost[blas.get()]
    clock.t += EVERY  # (each forward below comes a probe interval after the last reading)
    proc.running(2)  # a kernel thread, once
    assert forward(policy, clock, 1, 0.04) == 2
    proc.running(1)
    assert forward(policy, clock, 1, 0.04) == 2 and policy.counters.busy == 0
    clock.t += EVERY
    proc.running(2)  # another process's task, lasting: confirmed at the next forward
    used = [forward(policy, clock, 1, 0.05) for _ in range(bt.LoadProbe.CONFIRM + 2)]
    assert used == [2] * (bt.LoadProbe.CONFIRM - 1) + [1] * 3
    assert policy.counters.busy == 3


# --------------------------------------------------------------------------------------------
# Real OpenBLAS, preloaded in a child interpreter

# One child runs every setting in turn (SmolLM2-135M loaded once, mlx-lm's reference generated
# once): before each, the thread count goes back to the one the process started with and the
# policy is made afresh from the setting, as at a process's first forward (blas_threads._make
# reads the setting and the start count then). The quiet settings come first; the busy run
# last, with a CPU-bound process of the child's own beside it (killed by its pid once the run
# ends; it also ends itself if the child dies first).
CHILD = r"""
import json, os, subprocess, sys
from skulkp2p.engine.cpu import switch
switch.install()
import mlx.core as mx
from skulkp2p.engine.cpu import blas_threads
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.drafting.prompt_lookup import PromptLookup
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from tests.helpers.reference import mlx_lm_tokens

lm = load_model(sys.argv[1], "smollm2", dtype="float32")
runs = json.loads(sys.argv[2])
libopenblas = blas_threads.OpenBlasThreads.find()
assert libopenblas is not None, "no OpenBLAS in the child"
start = libopenblas.get()
text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"
prompt = lm.tokenizer.encode(text)
reference = None
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
for run in runs:
    libopenblas.set(start)
    os.environ[blas_threads.ENV] = run["setting"]
    blas_threads._policy = None  # made afresh at the next forward, from the setting above
    policy = blas_threads.policy()
    assert policy is not None, "no OpenBLAS in the child"
    if run["quiet"]:
        policy._runnable = lambda: 0  # decide as on a quiet machine, whatever runs beside it
    seen = []
    real_use = policy._use
    def use(n, real_use=real_use, seen=seen, policy=policy):
        real_use(n)
        seen.append((n, policy.blas.get()))  # what the policy set, what libopenblas runs
    policy._use = use
    if reference is None:  # (pinned to the start count, the narrow count of every setting)
        with blas_threads.pinned(policy.narrow):
            reference = mlx_lm_tokens(lm, prompt, max(r["tokens"] for r in runs))
        seen.clear()
    n = run["tokens"]
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if run["hog"] else None
    try:
        plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), n, make_rng(0)))
        stats = DecodeStats()
        spec = list(decode(LocalForward(lm.model), prompt, SamplingParams(), n, make_rng(0),
                           PromptLookup(), 4, stats))
    finally:
        if hog is not None:
            hog.kill()
            hog.wait(timeout=30)
    print("REPORT " + json.dumps({"name": run["name"], "plain": plain, "spec": spec,
                                  "reference": reference[:n], "drafted": stats.drafted,
                                  "seen": list(seen),
                                  "start": int(os.environ.get("OPENBLAS_NUM_THREADS", "0")),
                                  "policy": policy.describe()}), flush=True)
"""

# (name, SKULKP2P_BLAS_THREADS, decides as on a quiet machine, tokens, a hog beside it). Every
# run decodes plain steps and verifies lookup's drafts (asserted: it drafted); auto's 16 plain
# steps time both counts (BASELINE forwards each) before choosing. Two threads on every
# forward cost a busy 2-core machine several times one thread's CPU (OpenBLAS's threads spin
# while the other core is taken): that run decodes 8 tokens.
RUNS = [("1", "1", True, 16, False), ("2", "2", True, 8, False),
        ("auto", "auto", True, 16, False), ("busy", "auto", False, 12, True)]


@pytest.fixture(scope="module")
def child_reports(smollm2_path) -> dict[str, dict]:
    """Each run's report, by name, from one child interpreter (see CHILD)."""
    fast_path_available()
    runs = [{"name": n, "setting": s, "quiet": q, "tokens": t, "hog": h}
            for n, s, q, t, h in RUNS]
    out = subprocess.run([sys.executable, "-c", CHILD, str(smollm2_path), json.dumps(runs)],
                         env=child_env(), capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    reports = [json.loads(ln[len("REPORT "):]) for ln in out.stdout.splitlines()
               if ln.startswith("REPORT ")]
    return {r["name"]: r for r in reports}


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("setting", ["1", "2", "auto"])
def test_real_openblas_runs_the_count_said_and_greedy_stays_exact(child_reports, setting):
    report = child_reports[setting]
    # Every count the policy set is the count libopenblas reports.
    assert report["seen"] and all(said == runs for said, runs in report["seen"])
    counts = {said for said, _ in report["seen"]}
    if setting == "auto":
        # Quiet (as the child says): the start count (cores - 1, engine/cpu/blas.py) for the
        # baseline, one thread per core after it.
        p = report["policy"]
        assert p["narrow"] == report["start"] and counts == {p["narrow"], p["wide"]}, p
    else:
        assert counts == {int(setting)}
    assert report["drafted"] > 0
    assert report["spec"] == report["plain"] == report["reference"]


@pytest.mark.process
@pytest.mark.slow
def test_busy_machine_keeps_one_thread(child_reports):
    """With the real /proc probe and a CPU-bound process beside it, auto keeps one thread."""
    report = child_reports["busy"]
    p = report["policy"]
    if p["wide"] == p["narrow"]:
        pytest.skip("one core: nothing to decide")
    counts = [said for said, _ in report["seen"]]
    # The hog is runnable at nearly every probe; a probe that missed it costs at most a forward
    # or two before the guard trips, never a request's worth.
    assert counts.count(p["wide"]) <= 4, p
    assert report["policy"]["busy"] > 0
    assert report["spec"] == report["plain"] == report["reference"]


def test_a_batch_of_requests_counts_as_one_owner(tiny_models, monkeypatch) -> None:
    """Four requests decoded together on the batching engine (each on its own thread, steps
    run by whichever holds the lock): the policy never sees a shared forward, so a quiet node
    may run the batch's steps on two threads; outputs as served alone."""
    from skulkp2p.engine.runner.mlx_engine import MlxEngine
    from tests.helpers.batch import loaded, requests, solo, together

    policy, blas, clock = make()
    monkeypatch.setattr(bt, "_policy", policy)
    model = loaded(tiny_models["llama"])
    reqs = requests({}, "off")
    alone = solo(MlxEngine(model, max_batch=1), reqs)
    policy.counters = bt.Counters()
    clock.t += bt.SHARED_HOLD_S + 1  # the solo run's thread is long idle
    engine = MlxEngine(model, max_batch=4)
    batched = together(engine, reqs)
    assert engine.scheduler.steps > 0
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert policy.counters.shared == 0
    assert sum(policy.counters.forwards.values()) > engine.scheduler.steps
