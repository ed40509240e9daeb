"""skulkp2p.metrics, telemetry and state_metrics: the metrics registry's text format (read back
with prometheus_client's own parser), the request recorder (in flight, recent, the time series, the window) fed typed results,
and the cluster metrics read from a node's status. No HTTP, no mlx here; the routes and a real
`join` are in test_dashboard.py."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from skulkp2p.engine.protocol import VerifyCosts
from skulkp2p.engine.results import (
    DrafterCounts,
    GenerationResult,
    SpeculationStats,
    Timing,
    Usage,
)
from skulkp2p.metrics import Registry, render
from skulkp2p.state_metrics import cluster_families
from skulkp2p.telemetry import RequestFinished, RequestStarted, Telemetry


def parsed(text: str) -> dict[str, dict]:
    """{family name: {"type", "samples": {(sample name, sorted labels): value}}}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {"type": fam.type, "samples": {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}}
    return out


def value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    return fams[family]["samples"][(sample or family, tuple(sorted(
        (k, str(v)) for k, v in labels.items())))]


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def result(n_out: int = 33, ttft: float = 0.25, total: float = 2.25, spec=None
           ) -> GenerationResult:
    return GenerationResult("text", list(range(n_out)), "length", Usage(12, n_out),
                            Timing(ttft, total, round((n_out - 1) / (total - ttft), 2)), spec)


def lookup_stats(drafted: int = 16, accepted: int = 10) -> SpeculationStats:
    return SpeculationStats("lookup", "explicit", drafted, accepted, max_depth=4, rounds=4,
                            acceptance_per_position=[1.0, 0.75, 0.5, 0.25], gate_fired=False,
                            gate_events=[], drafted_per_position=[4, 4, 4, 4],
                            accepted_per_position=[4, 3, 2, 1])


def test_registry_renders_what_prometheus_parses():
    r = Registry()
    c = r.counter("demo_requests_total", "Requests.\nSecond line \\ here.", ("model", "why"))
    g = r.gauge("demo_depth", "Queue depth.", ("model",))
    h = r.histogram("demo_latency_seconds", "Latency.", ("model",), (0.1, 1.0, 10.0))
    odd = 'a "quoted"\\name\nwith a newline'
    c.inc(model=odd, why="ok")
    c.inc(2.5, model=odd, why="ok")
    c.touch(model="m", why="error")
    g.set(7, model="m")
    for v in (0.05, 0.5, 0.5, 5.0, 50.0):
        h.observe(v, model="m")
    h.observe(0.2, 3, model="m")  # three observations at once
    r.collector(lambda: [render_family_from_collector()])
    fams = parsed(r.render())
    assert fams["demo_requests"]["type"] == "counter"
    assert value(fams, "demo_requests", "demo_requests_total", model=odd, why="ok") == 3.5
    assert value(fams, "demo_requests", "demo_requests_total", model="m", why="error") == 0
    assert value(fams, "demo_depth", model="m") == 7
    assert fams["demo_latency_seconds"]["type"] == "histogram"
    buckets = {le: value(fams, "demo_latency_seconds", "demo_latency_seconds_bucket",
                         model="m", le=le) for le in ("0.1", "1.0", "10.0", "+Inf")}
    assert buckets == {"0.1": 1, "1.0": 6, "10.0": 7, "+Inf": 8}  # cumulative
    assert value(fams, "demo_latency_seconds", "demo_latency_seconds_count", model="m") == 8
    assert math.isclose(value(fams, "demo_latency_seconds", "demo_latency_seconds_sum",
                              model="m"), 0.05 + 1.0 + 5.0 + 50.0 + 0.6)
    assert value(fams, "demo_collected", plane="x") == 4


def render_family_from_collector():
    from skulkp2p.metrics import Family
    return Family("demo_collected", "gauge", "From a collector.").add(4, plane="x")


def test_registry_refuses_what_prometheus_would():
    r = Registry()
    with pytest.raises(ValueError, match="_total"):
        r.counter("demo_requests", "no _total")
    with pytest.raises(ValueError, match="bad metric name"):
        r.gauge("demo-depth", "a dash")
    with pytest.raises(ValueError, match="bad label"):
        r.gauge("demo_depth", "x", ("le",))
    c = r.counter("demo_total", "x", ("model",))
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(other="x")
    with pytest.raises(ValueError, match="cannot go down"):
        c.inc(-1, model="m")
    with pytest.raises(ValueError, match="already registered"):
        r.counter("demo_total", "again")
    assert render([]) == "\n"


def test_recorder_in_flight_recent_and_metrics():
    clock = Clock()
    t = Telemetry(recent=3, window_s=60, bucket_s=5, clock=clock)
    tokens = {"n": 0}
    t.start(RequestStarted("m", 1, 12), lambda: tokens["n"])
    clock.t += 1.5
    tokens["n"] = 7
    st = t.stats()["models"]["m"]
    assert st["in_flight"] == [{"id": 1, "started": 1_000_000.0, "elapsed_s": 1.5,
                                "prompt_tokens": 12, "tokens": 7}]
    fams = parsed(t.registry.render())
    assert value(fams, "skulkp2p_requests_running", model="m") == 1

    auto = SpeculationStats(
        "lookup+mtp", "auto", 20, 12, max_depth=4, rounds=7,
        acceptance_per_position=[0.86, 0.6, 0.4, 0.5], gate_fired=True,
        gate_events=[{"at_token": 9, "event": "off", "reason": "no depth pays",
                      "drafter": "mtp"}],
        by_drafter={"lookup": DrafterCounts(3, 12, 9), "mtp": DrafterCounts(4, 8, 3)},
        drafted_per_position=[7, 5, 5, 3], accepted_per_position=[6, 3, 2, 1])
    t.finish(RequestFinished("m", 1, "ok", result(spec=auto)))
    st = t.stats()["models"]["m"]
    assert st["in_flight"] == []
    (rec,) = st["recent"]
    assert rec["id"] == 1 and rec["outcome"] == "ok" and rec["completion_tokens"] == 33
    assert rec["ttft_s"] == 0.25 and rec["decode_tok_s"] == 16.0
    spec = rec["speculation"]
    assert spec["acceptance"] == 0.6 and spec["drafter"] == "lookup+mtp"
    assert spec["by_drafter"] == {"lookup": {"drafted": 12, "accepted": 9, "acceptance": 0.75},
                                  "mtp": {"drafted": 8, "accepted": 3, "acceptance": 0.375}}
    assert spec["gate_events"][0]["event"] == "off"
    assert st["drafters"] == {
        "lookup": {"rounds": 3, "drafted": 12, "accepted": 9, "acceptance": 0.75,
                   "gate_off": 0, "gate_on": 0},
        "mtp": {"rounds": 4, "drafted": 8, "accepted": 3, "acceptance": 0.375,
                "gate_off": 1, "gate_on": 0}}

    fams = parsed(t.registry.render())
    assert value(fams, "skulkp2p_requests", "skulkp2p_requests_total", model="m",
                 outcome="ok") == 1
    assert value(fams, "skulkp2p_requests", "skulkp2p_requests_total", model="m",
                 outcome="error") == 0  # every outcome exists from the start
    assert value(fams, "skulkp2p_generation_tokens", "skulkp2p_generation_tokens_total",
                 model="m") == 33
    assert value(fams, "skulkp2p_prompt_tokens", "skulkp2p_prompt_tokens_total",
                 model="m") == 12
    assert value(fams, "skulkp2p_prefill_seconds", "skulkp2p_prefill_seconds_total",
                 model="m") == 0.25
    assert value(fams, "skulkp2p_decode_seconds", "skulkp2p_decode_seconds_total",
                 model="m") == 2.0
    sp = "skulkp2p_spec_decode_"
    for drafter, (rounds, drafted, accepted) in {"lookup": (3, 12, 9), "mtp": (4, 8, 3)}.items():
        assert value(fams, sp + "num_drafts", sp + "num_drafts_total", model="m",
                     drafter=drafter) == rounds
        assert value(fams, sp + "num_draft_tokens", sp + "num_draft_tokens_total", model="m",
                     drafter=drafter) == drafted
        assert value(fams, sp + "num_accepted_tokens", sp + "num_accepted_tokens_total",
                     model="m", drafter=drafter) == accepted
    per_pos = [value(fams, sp + "num_accepted_tokens_per_pos",
                     sp + "num_accepted_tokens_per_pos_total", model="m",
                     drafter="lookup+mtp", position=i) for i in range(4)]
    assert per_pos == [6, 3, 2, 1] and sum(per_pos) == auto.accepted
    assert value(fams, sp + "gate_events", sp + "gate_events_total", model="m",
                 drafter="mtp", event="off") == 1
    assert value(fams, "skulkp2p_time_to_first_token_seconds",
                 "skulkp2p_time_to_first_token_seconds_count", model="m") == 1
    # Time per output token: one observation per token after the first, at the mean pace.
    assert value(fams, "skulkp2p_time_per_output_token_seconds",
                 "skulkp2p_time_per_output_token_seconds_count", model="m") == 32
    assert math.isclose(value(fams, "skulkp2p_time_per_output_token_seconds",
                              "skulkp2p_time_per_output_token_seconds_sum", model="m"), 2.0)

    # Failures and cancellations count, with what is known; the recent list stays bounded.
    t.start(RequestStarted("m", 2, 5))
    t.finish(RequestFinished("m", 2, "cancelled"))
    t.finish(RequestFinished("m", 3, "error"))  # refused before it started (prompt too long)
    for i in range(4, 7):
        t.finish(RequestFinished("m", i, "ok", result()))
    st = t.stats()["models"]["m"]
    assert [r["id"] for r in st["recent"]] == [6, 5, 4]  # newest first, 3 kept
    assert st["totals"]["requests"] == 6 and st["totals"]["cancelled"] == 1
    assert st["totals"]["error"] == 1 and st["totals"]["acceptance"] == 0.6
    fams = parsed(t.registry.render())
    assert value(fams, "skulkp2p_requests", "skulkp2p_requests_total", model="m",
                 outcome="cancelled") == 1
    assert value(fams, "skulkp2p_requests", "skulkp2p_requests_total", model="m",
                 outcome="error") == 1


def test_series_buckets_and_window():
    clock = Clock(1_000_000.0)
    t = Telemetry(window_s=60, bucket_s=5, clock=clock)
    t.finish(RequestFinished("m", 1, "ok", result(33, 0.5, 2.5, lookup_stats(16, 10))))
    clock.t += 1  # same bucket: summed
    t.finish(RequestFinished("m", 2, "ok", result(17, 0.5, 1.5, lookup_stats(8, 2))))
    clock.t += 10  # a later bucket
    t.finish(RequestFinished("m", 3, "ok", result(11, 0.1, 1.1)))
    series = t.stats()["models"]["m"]["series"]
    assert [p["requests"] for p in series] == [2, 1]
    assert series[0]["t"] == 1_000_000.0 and series[1]["t"] == 1_000_010.0
    assert series[0]["acceptance"] == round(12 / 24, 4)
    assert series[0]["tok_s"] == round((32 + 16) / (2.0 + 1.0), 2)
    assert series[1]["acceptance"] is None and series[1]["tok_s"] == 10.0
    clock.t += 55  # the first bucket is now older than the window
    assert [p["t"] for p in t.stats()["models"]["m"]["series"]] == [1_000_010.0]
    # The ring of buckets is bounded whatever happens.
    for i in range(100):
        clock.t += 5
        t.finish(RequestFinished("m", 10 + i, "ok", result()))
    assert len(t._models["m"].series) == 12


def test_cluster_metrics_from_a_status():
    st = {"node": "a", "leader": "a", "term": 3, "role": "leader",
          "members": [{"name": "a", "state": "alive"}, {"name": "b", "state": "alive"},
                      {"name": "c", "state": "dead"}],
          "placements": [{"model": "m"}], "errors": [{"model": "huge", "error": "no"}],
          "metrics": {"leader_changes": 2, "wire_error_bad-signature": 3, "frames_in": 10,
                      "frames_out": 12, "bad_messages": 1},
          "data_metrics": {"wire_error_oversize": 1}}
    t = Telemetry()
    t.watch_cluster(lambda: st)
    t.watch_models(lambda: {"m": {"state": "ready", "waiting": 4}})
    fams = parsed(t.registry.render())
    assert value(fams, "skulkp2p_cluster_members", state="alive") == 2
    assert value(fams, "skulkp2p_cluster_members", state="dead") == 1
    assert value(fams, "skulkp2p_cluster_members", state="left") == 0
    assert value(fams, "skulkp2p_cluster_is_leader") == 1
    assert value(fams, "skulkp2p_cluster_term") == 3
    assert value(fams, "skulkp2p_cluster_leader_changes",
                 "skulkp2p_cluster_leader_changes_total") == 2
    assert value(fams, "skulkp2p_cluster_placement_errors") == 1
    rej = "skulkp2p_wire_frames_rejected"
    assert value(fams, rej, rej + "_total", plane="control", reason="bad-signature") == 3
    assert value(fams, rej, rej + "_total", plane="data", reason="oversize") == 1
    assert value(fams, rej, rej + "_total", plane="data", reason="unsigned") == 0
    assert value(fams, "skulkp2p_requests_waiting", model="m") == 4
    # A follower without a leader, and a node outside any cluster.
    follower = {**st, "node": "b", "leader": None}
    names = {f.name: f for f in cluster_families(follower)}
    assert names["skulkp2p_cluster_is_leader"].samples[0].value == 0
    assert names["skulkp2p_cluster_has_leader"].samples[0].value == 0
    t.watch_cluster(lambda: None)
    assert "skulkp2p_cluster_members" not in parsed(t.registry.render())


def test_verify_costs_as_gauges_and_in_stats():
    """A model's measured verify-cost table (what /v1/models shows) as gauges by model, width
    and where, and in the stats the page reads; a model without one has no samples."""
    costs = VerifyCosts({1: 0.004, 2: 0.005, 4: 0.008}, 1_700_000_000.5,
                        "tensor-parallel group n0, n1")
    t = Telemetry()
    t.watch_models(lambda: {"m": {"state": "ready", "waiting": 0},
                            "plain": {"state": "ready", "waiting": 0}})
    t.watch_verify_costs(lambda: {"m": costs})
    fams = parsed(t.registry.render())
    where = "tensor-parallel group n0, n1"
    assert fams["skulkp2p_verify_cost_seconds"]["type"] == "gauge"
    assert fams["skulkp2p_verify_cost_seconds"]["samples"] == {
        ("skulkp2p_verify_cost_seconds", (("model", "m"), ("where", where), ("width", str(w)))):
            s for w, s in costs.seconds.items()}
    assert value(fams, "skulkp2p_verify_cost_relative", model="m", width=4, where=where) == 2.0
    assert value(fams, "skulkp2p_verify_cost_relative", model="m", width=1, where=where) == 1.0
    assert value(fams, "skulkp2p_verify_costs_measured_timestamp_seconds", model="m",
                 where=where) == 1_700_000_000.5
    stats = t.stats()["models"]
    assert stats["m"]["verify_costs"] == costs.to_json()
    assert "verify_costs" not in stats["plain"]
    # None reported (a single node's or a ring's engine today): the families, no samples.
    t.watch_verify_costs(lambda: {})
    fams = parsed(t.registry.render())
    assert fams["skulkp2p_verify_cost_seconds"]["samples"] == {}
    assert "verify_costs" not in t.stats()["models"]["m"]
