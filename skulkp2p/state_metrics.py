"""Metric families read from a node's state at scrape time, with no HTTP and no mlx: the
cluster's view (members, leadership, placements, the wire's counters) from its status object,
and each model's measured verify-cost table. `Telemetry` (telemetry.py) collects them into its
registry at every scrape.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from skulkp2p.engine.cpu.blas_threads import NARROW_REASONS, PolicyCounts
from skulkp2p.engine.protocol import VerifyCosts
from skulkp2p.metrics import PREFIX, Family

WIRE_REASONS = ("oversize", "unsigned", "bad-signature", "undecodable", "not-a-map", "no-type",
                "version", "array", "handshake")
MEMBER_STATES = ("alive", "suspect", "dead", "left")


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
    calls = Family(PREFIX + "verify_cost_calls", "gauge",
                   "Verify calls of `width` rows behind a live table's estimate (a tensor-"
                   "parallel group's table follows its own calls after the probe at forming).")
    for model, c in sorted(costs.items()):
        rel = c.relative
        for width, s in sorted(c.seconds.items()):
            seconds.add(s, model=model, width=width, where=c.where)
            relative.add(rel[width], model=model, width=width, where=c.where)
            if c.source == "live":
                calls.add(c.calls.get(width, 0), model=model, width=width, where=c.where)
        measured.add(round(c.measured_at, 3), model=model, where=c.where)  # as /v1/models
    return [seconds, relative, measured, calls]


def draft_memory_families(stats: Mapping[str, Mapping[str, object]]) -> list[Family]:
    """Each model's draft memory (its engine's `DraftMemoryShare.stats()`): what it holds,
    the sequences it shared with and received from the model's other replicas, and the tokens
    drafted from it, in all and from what other replicas sent."""
    p = PREFIX + "draft_memory_"
    held = Family(p + "tokens", "gauge", "Tokens the model's draft memory holds (earlier "
                  "requests' prompts and outputs).")
    drafted = Family(p + "drafted_tokens_total", "counter",
                     "Tokens drafted from the draft memory.")
    received_drafted = Family(p + "drafted_received_tokens_total", "counter",
                              "Tokens drafted from what the model's other replicas sent.")
    received = Family(p + "received_sequences_total", "counter",
                      "Finished sequences the model's other replicas sent here.")
    shared = Family(p + "shared_sequences_total", "counter",
                    "Finished sequences handed to the model's other replicas.")
    for model, s in sorted(stats.items()):
        for fam, name in ((held, "tokens"), (drafted, "drafted_tokens"),
                          (received_drafted, "drafted_received_tokens"),
                          (received, "received"), (shared, "shared")):
            value = s.get(name)
            if isinstance(value, int):
                fam.add(value, model=model)
    return [held, drafted, received_drafted, received, shared]


def blas_thread_families(counts: PolicyCounts | None) -> list[Family]:
    """The process's OpenBLAS thread policy (engine/cpu/blas_threads.py): forwards per thread
    count, why forwards the timings would run wide ran narrow, switches and guard trips; no
    samples where no policy runs (no OpenBLAS, or no forward yet)."""
    p = PREFIX + "blas_"
    forwards = Family(p + "forwards_total", "counter",
                      "Forwards (and pipelined decode steps) run with `threads` OpenBLAS "
                      "threads.")
    narrowed = Family(p + "narrowed_total", "counter",
                      "Forwards the policy's timings would run wide that ran narrow, by reason "
                      "(busy: another process had a runnable task; shared: another thread ran "
                      "forwards; tripped: the guard was tripped).")
    switches = Family(p + "thread_switches_total", "counter",
                      "Changes of the OpenBLAS thread count between forwards.")
    trips = Family(p + "guard_trips_total", "counter",
                   "Two-thread forwards slower than the one-thread reference by the guard's "
                   "ratio (each holds every forward narrow for a while).")
    light = Family(p + "light_loads_total", "counter",
                   "Load probe readings that saw another process's task runnable reading after "
                   "reading while other processes used under a quarter core (a streaming "
                   "server's clients): not counted as busy.")
    bounds = Family(p + "threads", "gauge",
                    "The policy's thread counts: `narrow` and `wide` (mode auto: chosen per "
                    "forward; fixed: SKULKP2P_BLAS_THREADS, both bounds equal).")
    if counts is not None:
        for n in sorted({counts.narrow, counts.wide, *counts.forwards}):
            forwards.add(counts.forwards.get(n, 0), threads=n)
        for reason in NARROW_REASONS:
            narrowed.add(counts.narrowed.get(reason, 0), reason=reason)
        switches.add(counts.switches)
        trips.add(counts.trips)
        light.add(counts.light_loads)
        narrow = counts.narrow if counts.mode == "auto" else counts.wide
        bounds.add(narrow, bound="narrow", mode=counts.mode)
        bounds.add(counts.wide, bound="wide", mode=counts.mode)
    return [forwards, narrowed, switches, trips, light, bounds]


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
