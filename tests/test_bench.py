"""`python -m skulkp2p bench` on a tiny model, as a user runs it; and its small helpers."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from skulkp2p.bench import BenchError, report
from skulkp2p.bench.arms import mlx_arms
from skulkp2p.engine.drafting import width_costs
from tests.helpers import ROOT
from tests.helpers.procs import run_cli

ARMS = {"plain", "spec", "lookup:2", "draft:2", "mlx_lm", "mlx_lm_draft"}
WORKLOADS = {"echo", "qa"}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama", name="m")


@pytest.mark.process
def test_bench_tiny_model_json_widths_and_plot(tiny, tmp_path):
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
            "--max-tokens", "16", "--runs", "1", "--workloads", "echo,qa", "--arms", "lookup:2,draft:2",
            "--widths", "--json", str(out),
            "--draft-model", str(tiny)]  # the model as its own draft: every draft is accepted
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        args += ["--plot", str(tmp_path / "speedups.png")]
    proc = run_cli(*args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    assert "| workload | arm |" in proc.stdout  # the table goes to stdout with --json

    for key in ("platform", "cpu", "cores", "python", "mlx", "mlx_lm"):
        assert key in doc["machine"]
    assert {"blas", "library", "dtype", "gflops_f32"} <= set(doc["engine"])
    assert doc["model"]["id"] == "m" and doc["model"]["dtype"] in ("float32", "bfloat16")
    assert doc["settings"]["max_tokens"] == 16 and doc["settings"]["runs"] == 1

    cells = {(r["arm"], r["workload"]): r for r in doc["results"]}
    assert set(cells) == {(a, w) for a in ARMS for w in WORKLOADS}
    for r in doc["results"]:
        assert r["identical_to_plain"] is True, r
        assert r["tok_s"] > 0 and r["ttft_s"] > 0 and len(r["runs"]) == 1
        assert r["tokens_generated"] == 16
    for wl in WORKLOADS:
        assert cells[("plain", wl)]["speedup_vs_plain"] == 1.0
        look = cells[("lookup:2", wl)]
        assert look["drafted"] > 0 and 0 <= look["accepted"] <= look["drafted"]
        # the suffix drafter drafts at most as many tokens as its match is long
        assert 1 <= len(look["acceptance_per_position"]) <= 2
        for arm in ("draft:2", "mlx_lm_draft"):  # same model drafting: every draft accepted
            cell = cells[(arm, wl)]
            assert cell["drafted"] > 0 and cell["accepted"] == cell["drafted"], cell
        assert cells[("mlx_lm_draft", wl)]["peer"] and not cells[("draft:2", wl)]["peer"]
    assert doc["settings"]["engine_draft_model"] == "m"

    widths = doc["widths"]
    assert set(widths["relative"]) == {str(w) for w in range(1, 17)}
    assert widths["relative"]["1"] == 1.0
    assert all(v > 0 for v in widths["relative"].values())
    saved = width_costs.load_width_costs("m", doc["model"]["dtype"], tmp_path / "data")
    assert saved is not None and sorted(saved) == list(range(1, 17)) and saved[1] == 1.0
    if has_mpl:
        assert (tmp_path / "speedups.png").stat().st_size > 1000


@pytest.mark.process
def test_bench_default_output_json_on_stdout_table_on_stderr(tiny, tmp_path):
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path), "--max-tokens", "4",
                   "--runs", "2", "--workloads", "qa", "--no-peers", timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [r["arm"] for r in doc["results"]] == ["plain", "spec"]
    # Each run starts at another arm, so no arm always runs first after the warm-up.
    order = re.findall(r"run (\d)/2 qa\s+(\S+)", proc.stderr)
    assert order == [("1", "plain"), ("1", "spec"), ("2", "spec"), ("2", "plain")], order
    # a model folder has no GGUF card for the llama-server arms: skipped, with the reason
    assert {s["arm"] for s in doc["skipped"]} <= {"mlx_lm", "mlx_lm_draft", "llama_*"}
    assert {"mlx_lm", "mlx_lm_draft"} <= {s["arm"] for s in doc["skipped"]}
    assert "widths" not in doc
    assert "| qa | plain |" in proc.stderr


@pytest.mark.process
@pytest.mark.parametrize("bad", [["--workloads", "nope"], ["--arms", "oracle:2"],
                                 ["--runs", "0"], ["--dtype", "int8"],
                                 ["--cores-per-node", "0"], ["--agent", "--turns", "7"]])
def test_bad_option_one_line_exit_2(bad):
    proc = run_cli("bench", *bad, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], proc.stderr


def test_plot_without_matplotlib_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(BenchError, match="--plot needs matplotlib"):
        report.require_matplotlib()


def test_width_costs_round_trip_and_missing(tmp_path):
    assert width_costs.load_width_costs("x", "float32", tmp_path) is None
    path = width_costs.save_width_costs("org/x", "float32", tmp_path, {1: 0.1, 2: 0.12, 4: 0.2})
    assert path.parent == tmp_path / "widths" and "/" not in path.name
    assert width_costs.load_width_costs("org/x", "float32", tmp_path) == {1: 1.0, 2: 1.2, 4: 2.0}
    assert width_costs.load_width_costs("org/x", "bfloat16", tmp_path) is None
    path.write_text("{not json")
    assert width_costs.load_width_costs("org/x", "float32", tmp_path) is None


def test_parse_arm_and_select_arms():
    assert mlx_arms.parse_arm("lookup:4").speculation == {"drafter": "lookup", "depth": 4}
    assert mlx_arms.parse_arm("spec").speculation == "auto"
    for bad in ("lookup", "lookup:0", "oracle:1", "mtp:x"):
        with pytest.raises(ValueError):
            mlx_arms.parse_arm(bad)
    arms, skipped = mlx_arms.select_arms([mlx_arms.parse_arm("mtp:1"), mlx_arms.PLAIN], True, None)
    assert [a.name for a in arms] == ["plain", "spec", "mtp:1", "mlx_lm"]
    assert skipped == [{"arm": "mlx_lm_draft", "reason": "no --draft-model given"}]
    arms, _ = mlx_arms.select_arms([], True, "some-draft")
    assert [a.name for a in arms][-2:] == ["mlx_lm", "mlx_lm_draft"]


def test_mlx_lm_acceptance_rebuilt_from_flags():
    # k=2, max_tokens=7: rounds (drafted, accepted) are (2, 2), (2, 0), (2, 1), and the last
    # one may draft only min(2, 7 - 6) = 1 token, rejected.
    flags = [True, True, False, False, True, False, False]
    drafted, accepted, per_pos = mlx_arms.mlx_lm_acceptance(flags, 7, 2)
    assert (drafted, accepted) == (7, 3)
    assert per_pos == [round(2 / 4, 4), round(1 / 3, 4)]


@pytest.mark.process
def test_bench_on_a_ring_of_processes_reports_compute_and_link(tiny, tmp_path):
    """`bench --nodes 2`: a stage process and the bench, over TCP through the delaying proxy;
    where the time went per run; speculative output equal to plain; no stage left behind."""
    import os

    out = tmp_path / "ring.json"
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                   "--max-tokens", "12", "--runs", "1", "--workloads", "echo",
                   "--arms", "lookup:2,spec_trees", "--nodes", "2", "--link-delay-ms", "2",
                   "--json", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    ring = doc["settings"]["ring"]
    assert ring["nodes"] == 2 and ring["layers"] == [[0, 2], [2, 4]]
    assert ring["link_delay_ms"] == 2 and ring["hops_per_traversal"] == 2
    # a round trip through the proxy, measured at start, crossed the delay both ways
    assert ring["link_round_trip_ms"] >= 2 * 2
    assert f"a round trip through the proxy measured {ring['link_round_trip_ms']:g} ms" \
        in proc.stdout
    stages = ring["stages"]
    assert [s["layers"] for s in stages] == [[0, 2], [2, 4]]
    assert stages[0]["pid"] != stages[1]["pid"] and stages[0]["param_bytes"] > 0
    # 2 ms on each of 2 hops, at least, for every traversal
    assert ring["traversals"] > 0 and ring["link_s"] >= ring["traversals"] * 2 * 2e-3
    assert ring["other_stages_compute_s"] > 0 and ring["last_stage_compute_s"] > 0
    assert ring["bytes"] > 0
    cells = {r["arm"]: r for r in doc["results"]}
    assert set(cells) == {"plain", "spec", "lookup:2", "spec_trees"}
    # the ring takes trees (tiny llama): the arm reports its tree rounds (0 when no branch paid)
    assert isinstance(cells["spec_trees"]["tree_rounds"], int)
    for r in doc["results"]:
        assert r["identical_to_plain"] is True, r
        x = r["ring"]
        assert x["traversals"] > 0 and x["link_s"] >= x["traversals"] * 4e-3, x
        assert x["total_s"] >= x["link_s"] + x["other_stages_compute_s"]
    assert cells["lookup:2"]["drafted"] > 0
    # a verify round is one traversal: fewer traversals than tokens when drafts are accepted
    if cells["lookup:2"]["accepted"]:
        assert cells["lookup:2"]["ring"]["traversals"] < cells["plain"]["ring"]["traversals"]
    assert "| last stage s | other stages s | link s |" in proc.stdout
    for s in stages[:-1]:  # the stage process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(s["pid"], 0)


@pytest.mark.process
def test_bench_tensor_parallel_group_reports_where_the_time_goes(tiny, tmp_path):
    """`bench --nodes 2 --parallel tensor`: two rank processes through the delaying proxy and
    the bench holding the head; speculative output equal to plain; no rank left behind."""
    import os

    out = tmp_path / "tensor.json"
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                   "--max-tokens", "12", "--runs", "1", "--workloads", "echo",
                   "--arms", "lookup:2", "--nodes", "2", "--parallel", "tensor",
                   "--link-delay-ms", "1", "--one-node", "--json", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    group = doc["settings"]["ring"]
    assert group["parallel"] == "tensor" and group["nodes"] == 2
    ranks = group["ranks"]
    assert len(ranks) == 2 and ranks[0]["pid"] != ranks[1]["pid"]
    assert all(r["param_bytes"] > 0 for r in ranks)
    # every all-sum crosses the proxy's 1 ms hops: the probe saw it
    assert group["allsum_us_one_row"] >= 1000
    assert group["link_round_trip_ms"] >= 2 * 1  # measured through the proxy, both ways
    # two all-sums a layer, the rows in, the logits out (the vocabulary-split head)
    assert group["collectives_per_call"] == 2 * 4 + 3 and group["bytes"] > 0
    # ... and so did the command link: each call's header (4 int32) to rank 1, delayed alike
    assert group["command_link"] == "through the delaying proxy"
    assert group["command_link_bytes"] >= 16 * group["traversals"] > 0
    assert group["rank_compute_ms_one_row"] > 0  # a rank's slice timed with no collective
    # The depth controller used the group's own width table, measured at start, as the seed
    # of the live table every verify call is timed into (engine/drafting/call_costs.py).
    assert set(group["group_width_seconds"]) == {"1", "2", "3", "4", "6", "8", "12", "16"}
    assert set(doc["settings"]["width_costs_used"]) >= set(group["group_width_costs"])
    assert set(group["group_width_costs_live"]) >= set(group["group_width_costs"])
    assert group["group_width_costs_live"]["1"] == 1.0
    cells = {r["arm"]: r for r in doc["results"]}
    assert set(cells) == {"plain", "spec", "lookup:2", "one_node_plain", "one_node_spec"}
    # The single-node arms ran in the same run, their gain against their own plain.
    assert cells["one_node_spec"]["plain_is"] == "one_node_plain"
    assert cells["one_node_spec"]["identical_to_plain"] is True
    assert "identical_to_group_plain" in cells["one_node_plain"]
    (row,) = doc["summary"]
    assert row["one_node_spec_x_plain"] == cells["one_node_spec"]["speedup_vs_plain"]
    assert row["gain_at_least_one_node"] == (row["spec_x_plain"] >= row["one_node_spec_x_plain"])
    for r in doc["results"]:
        assert r["identical_to_plain"] is True, r
        if r["arm"].startswith("one_node"):
            assert "ring" not in r  # nothing of the group's time is charged to them
            continue
        x = r["ring"]
        assert x["traversals"] > 0 and x["ranks_s"] >= x["collectives_est_s"] > 0, x
        for run in r["runs"]:  # every call but the prompt's one prefill chunk was a verify
            calls = run["ring"]["verify_calls_by_width"]
            assert sum(calls.values()) == run["ring"]["traversals"] - 1, run["ring"]
            if r["arm"] == "plain":
                assert set(calls) == {"1"}
        assert x["total_s"] >= x["ranks_s"]
    if cells["lookup:2"]["accepted"]:  # a verify round is one call to the group
        assert cells["lookup:2"]["ring"]["traversals"] < cells["plain"]["ring"]["traversals"]
    assert "| head s | ranks s |" in proc.stdout
    for r in ranks:  # the rank processes are gone
        with pytest.raises(ProcessLookupError):
            os.kill(r["pid"], 0)


@pytest.mark.process
@pytest.mark.parametrize("bad,message", [
    (("--cores-per-node", "1"), "--cores-per-node needs --nodes 2 or more"),
    (("--nodes", "2", "--cores-per-node", "1", "--agent"), "not with --concurrency or --agent"),
    (("--nodes", "2", "--parallel", "tensor", "--cores-per-node", "4096"),
     "--cores-per-node 4096 with --nodes 2 needs 8192 cores"),
])
def test_bench_cores_per_node_refused_before_anything_loads(bad, message):
    proc = run_cli("bench", *bad, timeout=60)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and message in errors[0], proc.stderr


@pytest.mark.process
def test_bench_turns_needs_agent_one_line():
    proc = run_cli("bench", "--turns", "2", timeout=60)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "--turns is the length of --agent's conversation: it needs " \
        "--agent" in errors[0], proc.stderr


def _on_two_one_core_nodes(tiny, tmp_path, *placement: str) -> tuple[dict, list[int]]:
    """`bench --nodes 2 --cores-per-node 1 --one-node` on the tiny model (with `placement`'s
    flags): its JSON, and the cores this process may run on (skips below two)."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("emulating two one-core nodes needs two cores")
    out = tmp_path / "pinned.json"
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                   "--max-tokens", "8", "--runs", "1", "--workloads", "echo",
                   "--arms", "lookup:2", "--nodes", "2", *placement,
                   "--cores-per-node", "1", "--one-node", "--json", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["settings"]["cores_per_node"] == 1
    assert {r["arm"] for r in doc["results"]} >= {"plain", "spec", "one_node_spec"}
    for r in doc["results"]:
        assert r["identical_to_plain"] is True, r
    return doc, cores


@pytest.mark.process
def test_bench_tensor_group_on_emulated_one_core_nodes(tiny, tmp_path):
    """`--cores-per-node 1`: node 0 (this bench's process: the loop, the head, the one-node
    arms) and rank 0 on the first core, rank 1 on the second, as the kernel reports them; the
    group's and the one node's outputs still equal their plain ones."""
    import os

    doc, cores = _on_two_one_core_nodes(tiny, tmp_path, "--parallel", "tensor")
    settings = doc["settings"]
    assert settings["bench_cores"] == [cores[0]]
    assert [r["cores"] for r in settings["ring"]["ranks"]] == [[cores[0]], [cores[1]]]
    for r in settings["ring"]["ranks"]:  # the rank processes are gone
        with pytest.raises(ProcessLookupError):
            os.kill(r["pid"], 0)


@pytest.mark.process
def test_bench_ring_on_emulated_one_core_nodes(tiny, tmp_path):
    """`--nodes 2 --cores-per-node 1` on a pipeline ring: stage 1 (a child) on the first core,
    the last stage (this bench's process, with the one-node arms) on the second."""
    doc, cores = _on_two_one_core_nodes(tiny, tmp_path)
    settings = doc["settings"]
    assert settings["bench_cores"] == [cores[1]]
    assert [st["cores"] for st in settings["ring"]["stages"]] == [[cores[0]], [cores[1]]]


@pytest.mark.process
def test_bench_agent_on_a_tensor_group_hits_the_prefix_cache(tiny, tmp_path):
    """`bench --agent --nodes 2 --parallel tensor`: the ranks keep their slices of the prefix
    cache; from turn 2 on, the conversation so far is restored on the group, exactly."""
    # Two turns: turn 2 restores turn 1 from the group's cache (as every later turn restores
    # the one before); the shared-prefix pair still runs, its second request restoring most of
    # the first's ~2,500 tokens on the group, exactly (the command fails on a mismatch).
    out = tmp_path / "agent-tensor.json"
    proc = run_cli("bench", "--agent", "--turns", "2", "--model", str(tiny), "--data-dir",
                   str(tmp_path), "--max-tokens", "6", "--runs", "1", "--prefix-cache-mb", "64",
                   "--nodes", "2", "--parallel", "tensor", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["mismatched"] == []
    assert doc["settings"]["ring"]["parallel"] == "tensor"
    turns = doc["turns"]
    assert len(turns) == 2 == len(doc["settings"]["turns"])
    assert doc["shared_prefix"]["arms"]["plain+prefix"]["second_cached_tokens"] > 500
    for i, t in enumerate(turns):
        assert all(r["identical_to_plain"] for r in t["arms"].values())
        if i > 0:
            assert t["arms"]["plain+prefix"]["cached_tokens"] > turns[i - 1]["prompt_tokens"] / 2
            assert t["arms"]["spec+prefix"]["cached_tokens"] > turns[i - 1]["prompt_tokens"] / 2


@pytest.mark.process
def test_bench_agent_turns_with_and_without_the_prefix_cache(tiny, tmp_path):
    """`bench --agent`: five turns of one conversation (the turn-5 aim's; the sixth, the
    longest prompt, runs the same paths) and the shared-prefix pair, four arms (plain, spec,
    each with the prefix cache off and on) in one run: per-turn TTFT, decode tok/s and cached
    tokens; every arm's tokens equal plain's. (Timings are reported, not asserted.)"""
    out = tmp_path / "agent.json"
    proc = run_cli("bench", "--agent", "--turns", "5", "--model", str(tiny), "--data-dir",
                   str(tmp_path), "--max-tokens", "6", "--runs", "1", "--prefix-cache-mb", "64",
                   "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["mode"] == "agent" and doc["mismatched"] == []
    assert [t["name"] for t in doc["turns"]] == doc["settings"]["turns"]
    assert len(doc["turns"]) == 5
    for i, t in enumerate(doc["turns"]):
        arms = t["arms"]
        assert set(arms) == {"plain", "spec", "plain+prefix", "spec+prefix"}
        assert all(r["identical_to_plain"] for r in arms.values())
        assert all(r["ttft_s"] > 0 for r in arms.values())
        assert arms["plain"]["cached_tokens"] == arms["spec"]["cached_tokens"] == 0
        if i > 0:  # from turn 2 on, the conversation so far comes from the cache
            assert arms["plain+prefix"]["cached_tokens"] > doc["turns"][i - 1]["prompt_tokens"] / 2
        assert set(t["ttft_gain_prefix"]) == {"plain", "spec"}
    pair = doc["shared_prefix"]["arms"]
    assert pair["plain"]["second_cached_tokens"] == 0
    assert pair["plain+prefix"]["second_cached_tokens"] > 500
    assert {"turn5_ttft_plain", "shared_prefix_second_ttft_spec"} <= set(doc["aims"])
    assert "| turn | prompt | cached |" in proc.stdout


@pytest.mark.process
def test_bench_options_import_no_mlx():
    """The CLI builds the bench's parser before the fast BLAS is set up: no mlx may load."""
    code = ("import sys\n"
            "from skulkp2p.bench import BenchError, add_bench_arguments, run_bench\n"
            "from skulkp2p.cli import build_parser\n"
            "build_parser().parse_args(['bench', '--arms', 'lookup:2'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.process
def test_bench_sessions_memory_ablation_and_summary(tiny, tmp_path):
    """The retry workload's second request drafts from the first in the engine's memory (spec)
    and not without it (spec_nomem); every arm starts from a fresh engine; exact throughout."""
    out = tmp_path / "out.json"
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                   "--max-tokens", "16", "--runs", "1", "--workloads", "retry,agent",
                   "--arms", "spec_nomem,spec_scan", "--no-peers", "--no-llama-server",
                   "--json", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["settings"]["sessions"] == {"retry": 1, "agent": 1}
    cells = {(r["arm"], r["workload"]): r for r in doc["results"]}
    assert all(r["identical_to_plain"] is True for r in doc["results"])
    spec, alone = cells[("spec", "retry")], cells[("spec_nomem", "retry")]
    assert spec["accepted"] >= 12 and spec["accepted"] > (alone["accepted"] or 0)
    rows = {r["workload"]: r for r in doc["summary"]}
    assert rows["retry"]["exact"] is True and rows["retry"]["llama_best_ngram"] is None
    assert "| workload | spec × plain |" in proc.stdout


def test_ablation_arms_parse():
    assert mlx_arms.parse_arm("spec_nomem").memory is False
    assert mlx_arms.parse_arm("spec_scan").lookup == "scan"


@pytest.mark.served
def test_llama_arms_on_a_fresh_server_each(smollm2_path):
    """The peer arms on the real llama-server (when one is installed): a fresh server per
    request, greedy text equal with and without its n-gram drafter, the child gone after."""
    import os
    from pathlib import Path

    from skulkp2p.bench.arms import peers
    from skulkp2p.bench.workloads import SESSIONS, WORKLOADS
    from skulkp2p.models.store import ModelStore
    from tests.helpers.models import test_data_dir

    binary = os.environ.get("SKULKP2P_LLAMA_SERVER_BIN") or str(
        Path.home() / ".cache/skulkp2p-ci/llama-server/llama-server")
    if not Path(binary).is_file():
        pytest.skip("no llama-server binary")
    gguf = peers.peer_gguf(ModelStore(test_data_dir()), "smollm2-135m")
    runs = {arm: peers.run_llama(Path(binary), gguf, arm, SESSIONS["retry"], WORKLOADS["retry"],
                                 24) for arm in ("llama_plain", "llama_ngram_mod")}
    assert runs["llama_plain"].text and runs["llama_plain"].text == runs["llama_ngram_mod"].text
    assert runs["llama_plain"].tokens == 24


@pytest.mark.process
def test_bench_concurrency_batched_against_fifo_equal_to_solo(tiny, tmp_path):
    """`bench --concurrency 3` starts two agents (--max-batch 3 and 1) and sends 3 clients at
    once, each a different workload: the document's shape, and every output equal to the same
    request served alone (the command fails otherwise)."""
    out = tmp_path / "conc.json"
    proc = run_cli("bench", "--concurrency", "3", "--model", str(tiny), "--data-dir",
                   str(tmp_path / "data"), "--max-tokens", "12", "--runs", "2",
                   "--workloads", "echo,qa,code-edit", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["engine"] == "mlx" and doc["model"]["id"] == "m"
    s = doc["settings"]
    assert s["concurrency"] == 3 and s["client_workloads"] == ["echo", "qa", "code-edit"]
    assert {name: args[args.index("--max-batch") + 1] for name, args in s["agents"].items()} \
        == {"batched": "3", "fifo": "1"}
    rows = {(r["arm"], r["mode"]): r for r in doc["results"]}
    assert set(rows) == {(a, m) for a in ("plain", "spec") for m in ("fifo", "batched")}
    for (_arm, mode), r in rows.items():
        assert r["rounds"] == 2 and r["requests"] == 6 and len(r["aggregate_tok_s_runs"]) == 2
        assert r["aggregate_tok_s"] > 0 and r["per_request_tok_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["solo_ttft_s"] > 0
        assert r["max_batch"] == (3 if mode == "batched" else 1)
        assert ("speedup_vs_fifo" in r) == (mode == "batched")
        # what the agent's OpenBLAS thread policy did in this cell's rounds (its /metrics
        # before and after each round): forwards counted, every narrowing reason reported
        b = r["blas"]
        assert sum(b["forwards_per_threads"].values()) > 0 and 0 <= b["wide_share"] <= 1
        assert all(b[k] >= 0 for k in ("busy", "shared", "tripped", "switches", "trips"))
    assert doc["outputs_equal_solo"] is True and doc["mismatches"] == []
    for arm in ("plain", "spec"):
        assert set(doc["solo"][arm]) == {"echo", "qa", "code-edit"}
        assert all(cell["tokens"] > 0 for cell in doc["solo"][arm].values())
    assert "| arm | mode | aggregate tok/s |" in proc.stdout


@pytest.mark.process
@pytest.mark.slow
def test_bench_concurrency_on_rings_of_agents(tiny, tmp_path):
    """`bench --concurrency 2 --nodes 2`: each mode a ring of two `join` agents in a cluster of
    its own, the clients on its last stage; every output equal to the same request alone."""
    out = tmp_path / "conc-ring.json"
    proc = run_cli("bench", "--concurrency", "2", "--nodes", "2", "--model", str(tiny),
                   "--data-dir", str(tmp_path / "data"), "--max-tokens", "8", "--runs", "1",
                   "--workloads", "echo,qa", "--json", str(out), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["settings"]["rings"] == {"batched": ["batched0", "batched1"],
                                        "fifo": ["fifo0", "fifo1"]}
    assert {name: args[args.index("--max-batch") + 1] for name, args in
            doc["settings"]["agents"].items()} == {"batched0": "2", "batched1": "2",
                                                   "fifo0": "1", "fifo1": "1"}
    rows = {(r["arm"], r["mode"]): r for r in doc["results"]}
    assert set(rows) == {(a, m) for a in ("plain", "spec") for m in ("fifo", "batched")}
    assert all(r["aggregate_tok_s"] > 0 for r in rows.values())
    assert all(sum(r["blas"]["forwards_per_threads"].values()) > 0 for r in rows.values())
    assert doc["outputs_equal_solo"] is True and doc["mismatches"] == []
    assert "rings of 2 agents" in proc.stdout


@pytest.mark.process
@pytest.mark.parametrize("bad,message", [
    (("--concurrency", "0"), "--concurrency: must be a positive integer"),
    (("--concurrency", "2", "--nodes", "2", "--url", "http://127.0.0.1:1"),
     "--concurrency with --nodes runs MLX rings"),
    (("--url", "http://127.0.0.1:1"), "--url needs --concurrency N"),
    (("--concurrency", "2", "--agent"), "--agent does not apply to --concurrency"),
    (("--concurrency", "2", "--url", "ftp://x"), "--url must be http://HOST:PORT"),
])
def test_bench_concurrency_bad_options_one_line(bad, message):
    proc = run_cli("bench", *bad, timeout=60)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and message in errors[0], proc.stderr  # (beside the BLAS log line)


def test_percentile_nearest_rank():
    from skulkp2p.bench.arms.concurrency_report import percentile

    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


@pytest.mark.process
def test_bench_sampled_runs_seeded_and_equal_plain_run_by_run(tiny, tmp_path):
    """--temperature T --seed S: engine arms sample (run r with seed S + r); arms that draft
    deterministically emit plain's text run by run (the same seed), acceptance sums every run,
    the greedy-only peers are skipped; the same command gives the same text again."""
    docs = []
    for i in range(2):
        out = tmp_path / f"out{i}.json"
        proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                       "--max-tokens", "16", "--runs", "2", "--workloads", "echo",
                       "--arms", "spec_trees", "--temperature", "0.7", "--seed", "5",
                       "--no-llama-server", "--json", str(out), timeout=180)
        assert proc.returncode == 0, proc.stderr
        docs.append(json.loads(out.read_text()))
    doc = docs[0]
    assert doc["settings"]["greedy"] is False
    assert doc["settings"]["sampling"]["temperature"] == 0.7
    assert {r["arm"] for r in doc["results"]} == {"plain", "spec", "spec_trees"}
    assert all(r["identical_to_plain"] is True for r in doc["results"])
    spec = next(r for r in doc["results"] if r["arm"] == "spec")
    assert spec["drafted"] == sum(x["drafted"] for x in spec["runs"])
    assert "mlx_lm" in {s["arm"] for s in doc["skipped"]
                        if s["reason"] == "greedy only (bench --temperature)"}
    assert docs[1]["settings"]["plain_text"] == doc["settings"]["plain_text"]
    # --unseeded: no seed goes out, so no arm's text is compared with plain's.
    out = tmp_path / "unseeded.json"
    proc = run_cli("bench", "--model", str(tiny), "--data-dir", str(tmp_path / "data"),
                   "--max-tokens", "16", "--runs", "1", "--workloads", "echo",
                   "--temperature", "0.7", "--unseeded", "--no-llama-server", "--json",
                   str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr
    unseeded = json.loads(out.read_text())
    assert unseeded["settings"]["sampling"]["seeds"].startswith("none")
    assert all(r["identical_to_plain"] is None for r in unseeded["results"])


@pytest.mark.process
@pytest.mark.parametrize("bad,message", [
    (("--temperature", "-1"), "--temperature: must be a finite number >= 0"),
    (("--temperature", "nan"), "--temperature: must be a finite number >= 0"),
    (("--temperature", "0.7", "--agent"), "--temperature runs the workloads on one node"),
    (("--unseeded",), "--unseeded leaves the seed out of sampled requests"),
])
def test_bench_sampled_bad_options_one_line(bad, message):
    proc = run_cli("bench", *bad, timeout=60)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and message in errors[0], proc.stderr
