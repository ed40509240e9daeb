"""The bench's structured set, its lengths and its first-seen mode: the options' checks (quick,
no model), the cases a run measures, the schema check, the summary's fields; and one short
structured run on a tiny model, as a user runs it."""

from __future__ import annotations

import argparse
import json

import pytest

from skulkp2p.bench import BenchError
from skulkp2p.bench.arms.agent import DEFAULT_AGENT_MAX_TOKENS
from skulkp2p.bench.cases import bench_cases, valid_against
from skulkp2p.bench.command import resolve_workload_options
from skulkp2p.bench.options import add_bench_arguments
from skulkp2p.bench.records import summary
from skulkp2p.bench.workloads import STRUCTURED, WORKLOADS
from tests.helpers.procs import run_cli


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench")
    add_bench_arguments(p)
    args = p.parse_args(list(argv))
    resolve_workload_options(args)
    return args


def test_lengths_and_defaults():
    args = parse()
    assert args.lengths == [200] and args.max_tokens == 200
    assert args.workloads == list(WORKLOADS) and not args.structured
    args = parse("--max-tokens", "200,1000", "--workloads", "qa")
    assert args.lengths == [200, 1000] and args.max_tokens == 200
    assert parse("--agent").lengths == [DEFAULT_AGENT_MAX_TOKENS]
    assert parse("--structured").workloads == list(STRUCTURED)
    assert parse("--structured", "--workloads", "form,list").workloads == ["form", "list"]


@pytest.mark.parametrize("value", ["0", "200,", "200,200", "a", "1,2,3,4,5", ",", "-5"])
def test_bad_lengths_exit_2(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse("--max-tokens", value)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-tokens" in err[0]


@pytest.mark.parametrize("argv,says", [
    (("--max-tokens", "200,1000", "--agent"), "several --max-tokens lengths"),
    (("--max-tokens", "200,1000", "--nodes", "2"), "several --max-tokens lengths"),
    (("--structured", "--agent"), "--structured and --first-seen run the workloads"),
    (("--first-seen", "--concurrency", "2"), "--structured and --first-seen run"),
    (("--first-seen", "--draft-memory-tokens", "100"), "no --draft-memory-tokens"),
    (("--structured", "--workloads", "qa"), "not in the structured set"),
    (("--workloads", "form"), "add --structured"),
    (("--structured", "--ignore-eos"), "--ignore-eos runs the text workloads"),
    (("--ignore-eos", "--agent"), "--ignore-eos runs the text workloads"),
])
def test_combinations_refused(argv, says):
    with pytest.raises(BenchError, match=says):
        parse(*argv)


def test_cases_labels_schemas_and_first_seen():
    cases = bench_cases(["retry", "qa"], [200, 1000])
    assert [c.label for c in cases] == ["retry@200", "retry@1000", "qa@200", "qa@1000"]
    assert cases[0].setup and not cases[2].setup and cases[1].max_tokens == 1000
    assert all(not c.setup for c in bench_cases(["retry"], [200], first_seen=True))
    one = bench_cases(list(STRUCTURED), [200])
    assert [c.label for c in one] == list(STRUCTURED)
    assert all(c.schema is STRUCTURED[c.label][1] for c in one)


def test_schema_check_is_independent_of_the_grammar():
    schema = STRUCTURED["form"][1]
    good = {"category": "shipping", "priority": "high", "sentiment": "angry",
            "product": "cargo_hauler", "channel": "email", "language": "en",
            "needs_human": True, "refund_requested": True, "tags": ["damaged"]}
    assert valid_against(json.dumps(good), schema)
    assert not valid_against(json.dumps({**good, "priority": "whenever"}), schema)
    assert not valid_against(json.dumps(good)[:-1], schema)  # cut short: not JSON
    assert not valid_against(json.dumps({**good, "extra": 1}), schema)


def _row(wl: str, arm: str, tok_s: float, speedup: float, **extra) -> dict:
    return {"workload": wl, "arm": arm, "tok_s": tok_s, "speedup_vs_plain": speedup,
            "identical_to_plain": True, "peer": arm.startswith("llama"), **extra}


def test_summary_of_structured_rows_and_gain_kept():
    doc = {"settings": {"workloads": ["form"], "structured": True, "lengths": {"form": 200}},
           "results": [_row("form", "plain", 10.0, 1.0, valid_rate=1.0),
                       _row("form", "free_plain", 11.0, 1.1, valid_rate=0.0),
                       _row("form", "spec", 30.0, 3.0, valid_rate=1.0),
                       _row("form", "llama_ngram_mod", 5.0, 1.2, valid_rate=0.5)]}
    (row,) = summary(doc)
    assert row["spec_x_plain"] == 3.0 and row["plain_x_free_plain"] == 0.909
    assert row["all_valid"] is True and row["free_plain_valid_rate"] == 0.0
    assert row["llama_valid_rate"] == 0.5  # a peer's invalid output is its own column
    assert row["ahead_of_llama"] is True
    doc = {"settings": {"workloads": ["qa@200", "qa@1000"], "lengths": {"qa@200": 200,
                                                                       "qa@1000": 1000}},
           "results": [_row("qa@200", "spec", 3, 1.5), _row("qa@1000", "spec", 3, 1.45)]}
    rows = {r["workload"]: r for r in summary(doc)}
    assert rows["qa@1000"]["gain_kept"] == 0.9 and "gain_kept" not in rows["qa@200"]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama", name="m")


@pytest.mark.process
def test_structured_bench_two_lengths_first_seen(tiny, tmp_path):
    """A structured run at two lengths, first seen: constrained plain and spec on every case,
    free_plain beside them, every run checked against its schema, spec identical to plain."""
    out = tmp_path / "out.json"
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                   "--structured", "--workloads", "form,list", "--max-tokens", "12,24",
                   "--first-seen", "--runs", "1", "--no-llama-server", "--json", str(out),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    s = doc["settings"]
    assert s["structured"] and s["first_seen"] and s["draft_memory_tokens"] == 0
    assert s["workloads"] == ["form@12", "form@24", "list@12", "list@24"]
    assert s["lengths"]["list@24"] == 24 and set(s["schemas"]) == set(s["workloads"])
    cells = {(r["arm"], r["workload"]): r for r in doc["results"]}
    assert set(cells) == {(a, w) for a in ("plain", "free_plain", "spec")
                          for w in s["workloads"]}
    assert {sk["arm"] for sk in doc["skipped"]} >= {"mlx_lm"}
    for r in doc["results"]:
        assert "valid_rate" in r and "valid" in r["runs"][0]
        assert r["identical_to_plain"] is (None if r["arm"] == "free_plain" else True), r
    assert {"plain_x_free_plain", "all_valid", "gain_kept"} <= set(doc["summary"][1])
    assert "plain × free_plain" in proc.stdout


@pytest.mark.process
def test_fixed_lengths_with_ignore_eos_stay_exact(tiny, tmp_path):
    """--ignore-eos: every engine run generates exactly its length, spec still equal to plain
    (greedy and seeded), the peers skipped."""
    for temperature in ("0", "0.7"):
        out = tmp_path / f"out{temperature}.json"
        proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                       "--workloads", "qa,retry", "--max-tokens", "8,20", "--ignore-eos",
                       "--first-seen", "--temperature", temperature, "--runs", "2",
                       "--no-llama-server", "--json", str(out), timeout=300)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(out.read_text())
        assert doc["settings"]["ignore_eos"] and doc["settings"]["sessions"] == {}
        assert {r["arm"] for r in doc["results"]} == {"plain", "spec"}
        for r in doc["results"]:
            assert r["identical_to_plain"] is True, r
            assert all(x["tokens"] == doc["settings"]["lengths"][r["workload"]]
                       for x in r["runs"]), r
        assert "engine arms only (bench --ignore-eos)" in {s["reason"] for s in doc["skipped"]}


def test_context_and_long_workloads_are_selectable_and_the_aims_summarised():
    """ctxqa (a question over a passage in the prompt) and guide (long on its own) are text
    workloads of their own; the aims' quantities come from a run's rows: qa and ctxqa, the
    geometric mean over the workloads (the sampled aim when the run samples), the share of the
    short length's gain a longer one keeps, and each also as the median of per-run ratios."""
    from skulkp2p.bench.records import aims

    args = parse("--workloads", "ctxqa,guide", "--first-seen")
    assert args.workloads == ["ctxqa", "guide"]
    assert all(not c.setup for c in bench_cases(args.workloads, [200]))
    assert "Passage:" in WORKLOADS["ctxqa"][-1]["content"]

    def run_rows(wl: str, plain: list[float], spec: list[float]) -> list[dict]:
        def row(arm: str, tok: list[float]) -> dict:
            return {**_row(wl, arm, sorted(tok)[1], 1.0), "tokens_generated": 200,
                    "runs": [{"tok_s": t} for t in tok]}
        return [row("plain", plain), row("spec", spec)]

    labels = ["qa@200", "qa@1000", "ctxqa@200", "ctxqa@1000"]
    results = [*run_rows("qa@200", [10, 20, 10], [15, 30, 16]),
               *run_rows("qa@1000", [10, 20, 10], [14, 28, 13]),
               *run_rows("ctxqa@200", [10, 20, 10], [16, 32, 12]),
               *run_rows("ctxqa@1000", [10, 20, 10], [13, 26, 12])]
    for r in results:
        if r["arm"] == "spec":
            r["speedup_vs_plain"] = r["tok_s"] / 10
    doc = {"settings": {"workloads": labels, "lengths": {k: int(k[-4:].strip("@"))
                                                         for k in labels},
                        "max_tokens": 200, "first_seen": True, "greedy": True},
           "results": results}
    rows = {(r["quantity"].split(" ")[0], r["length"]): r for r in aims(doc, summary(doc))}
    # medians of tok/s: qa 16/10; within each run: 15/10, 30/20, 16/10
    assert rows[("qa", 200)]["value"] == 1.6 and rows[("qa", 200)]["met"] is True
    assert rows[("qa", 200)]["per_run"] == 1.5 and rows[("ctxqa", 200)]["per_run"] == 1.6
    assert rows[("ctxqa", 1000)]["met"] is False and rows[("ctxqa", 1000)]["aim"] == 1.4
    assert rows[("geomean", 200)]["value"] == 1.6 and rows[("geomean", 200)]["aim"] is None
    assert rows[("geomean", 200)]["per_run"] == 1.549  # (1.5 x 1.6) ** 0.5
    assert rows[("share", 1000)]["value"] == round((1.349 - 1) / (1.6 - 1), 3)
    assert all(r["first_seen"] for r in rows.values())
    doc["settings"].update(greedy=False, sampling={"temperature": 0.7})
    sampled = {(r["quantity"].split(" ")[0], r["length"]): r for r in aims(doc, summary(doc))}
    assert sampled[("geomean", 200)]["aim"] == 1.5 and sampled[("geomean", 200)]["met"] is True
    assert sampled[("qa", 200)]["aim"] is None  # the qa and ctxqa aims are greedy figures


@pytest.mark.process
def test_context_and_long_workloads_run_first_seen_and_exact(tiny, tmp_path):
    """The two workloads through the bench at two lengths, first seen: spec equal to plain
    token for token, and the aims' table after the summary."""
    out = tmp_path / "out.json"
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                   "--workloads", "ctxqa,guide", "--max-tokens", "6,12", "--first-seen",
                   "--runs", "1", "--no-peers", "--no-llama-server", "--json", str(out),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["settings"]["workloads"] == ["ctxqa@6", "ctxqa@12", "guide@6", "guide@12"]
    assert {(r["arm"], r["identical_to_plain"]) for r in doc["results"]} == {
        ("plain", True), ("spec", True)}
    quantities = [(a["quantity"], a["length"]) for a in doc["aims"]]
    assert ("ctxqa spec x plain", 6) in quantities and quantities[-1][1] == 12
    assert "drafting aims (first seen" in proc.stdout
