"""`python -m skulkp2p bench`: the command (`run_bench`) and the MLX bench's measurement loop;
its options are bench/options.py, its results and summary bench/records.py.

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
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skulkp2p.bench.arms.agent import DEFAULT_AGENT_MAX_TOKENS
from skulkp2p.bench.arms.mlx_arms import (
    FREE_PLAIN,
    ONE_NODE_PLAIN,
    ONE_NODE_SPEC,
    PLAIN,
    Arm,
    Cell,
    Sampling,
    SkipArm,
    drafts_deterministic,
    execute,
    open_draft,
    prompt_len,
    select_arms,
)
from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.cases import bench_cases, valid_against
from skulkp2p.bench.options import DEFAULT_MAX_TOKENS
from skulkp2p.bench.records import aims, aims_table, cell_results, summary, summary_table
from skulkp2p.bench.report import (
    fmt,
    loadavg,
    machine_info,
    markdown_tables,
    plot_speedups,
    require_matplotlib,
    write_atomic,
    write_document,
)
from skulkp2p.bench.workloads import (
    ECHO_CODE,
    STRUCTURED,
    WARMUP_MESSAGES,
    WARMUP_TOKENS,
    WORKLOADS,
)

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.bench")


def run_bench(args: argparse.Namespace, store: ModelStore) -> int:
    """The whole command after the CLI has arranged the BLAS; returns the exit status."""
    from skulkp2p.bench.arms.served_arm import dispatch

    if getattr(args, "restart_ttft", False):
        from skulkp2p.bench.arms.disk_cache import run_restart_bench

        return run_restart_bench(args, store)
    resolve_workload_options(args)
    if getattr(args, "agent", False) and (args.plot or args.widths):
        raise BenchError("--agent has its own tables: run --plot and --widths without it")
    if getattr(args, "turns", None) and not getattr(args, "agent", False):
        raise BenchError("--turns is the length of --agent's conversation: it needs --agent")
    if getattr(args, "url", None) and not getattr(args, "concurrency", None):
        raise BenchError("--url needs --concurrency N")
    if getattr(args, "temperature", 0.0) > 0.0 and (
            getattr(args, "agent", False) or getattr(args, "concurrency", None)
            or getattr(args, "nodes", 1) > 1 or getattr(args, "engine", "mlx") != "mlx"):
        raise BenchError("--temperature runs the workloads on one node (no --agent, "
                         "--concurrency, --nodes or --engine served)")
    if getattr(args, "unseeded", False) and not getattr(args, "temperature", 0.0) > 0.0:
        raise BenchError("--unseeded leaves the seed out of sampled requests: it needs "
                         "--temperature")
    if getattr(args, "replicas", None) is not None:
        if not getattr(args, "concurrency", None):
            raise BenchError("--replicas needs --concurrency N")
        from skulkp2p.bench.arms.replicas import run_replicas_bench

        return run_replicas_bench(args, store)
    node_cpus = None
    if getattr(args, "cores_per_node", None) is not None:
        from skulkp2p.bench.cores import node_cores, pin_this_process

        if getattr(args, "concurrency", None) or getattr(args, "agent", False):
            raise BenchError("--cores-per-node emulates the nodes of a ring or group of the "
                             "workloads' bench: not with --concurrency or --agent")
        node_cpus = node_cores(getattr(args, "nodes", 1), args.cores_per_node)
        # This process runs the decode loop and --one-node's arms: a group's node 0 (with rank
        # 0), a pipeline ring's last node (its last stage).
        pin_this_process(node_cpus[0] if getattr(args, "parallel", "pipeline") == "tensor"
                         else node_cpus[-1])
    if getattr(args, "concurrency", None):
        from skulkp2p.bench.arms.concurrency import refuse_other_modes, run_concurrency_bench

        refuse_other_modes(args)
        return run_concurrency_bench(args, store)
    status = dispatch(args, store)  # --engine served; a served card without it is refused
    if status is not None:
        return status
    if args.plot:
        require_matplotlib()  # before minutes of measuring, not after
    from skulkp2p.engine.cpu import blas
    from skulkp2p.engine.runner.loader import open_model, serving_dtype

    engine = blas.fast_path_report()
    load_before = loadavg()  # other work on a 2-core node skews timings: record it
    dtype = args.dtype or serving_dtype()
    nodes = getattr(args, "nodes", 1)
    # mlx-lm's peers need the whole model in one piece: not on a ring.
    arms, skipped = select_arms(args.arms, not args.no_peers and nodes == 1, args.draft_model)
    if getattr(args, "structured", False):
        # mlx-lm's generate has no grammar: its arms would not decode the same task
        for arm in [a for a in arms if a.kind in ("mlx_lm", "mlx_lm_draft")]:
            arms.remove(arm)
            skipped.append({"arm": arm.name, "reason": "no structured outputs (bench "
                                                       "--structured)"})
        arms.insert(1, FREE_PLAIN)
    for sk in skipped if nodes > 1 and not args.no_peers else ():
        sk["reason"] = "mlx-lm needs the whole model in one process, not a ring"
    args.peer = None
    if nodes == 1 and not getattr(args, "no_llama_server", False):
        from skulkp2p.bench.arms.peers import LLAMA_ARMS, find_llama_server, peer_gguf

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
    if getattr(args, "ignore_eos", False):
        for arm in [a for a in arms if a.kind in ("mlx_lm", "mlx_lm_draft", "llama")]:
            arms.remove(arm)
            skipped.append({"arm": arm.name, "reason": "engine arms only (bench --ignore-eos)"})
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
    from skulkp2p.bench.arms.ring_arm import RingBench, RingBenchError
    from skulkp2p.bench.arms.tensor_arm import TensorBench, TensorBenchError

    if getattr(args, "parallel", "pipeline") == "tensor":
        ring: Any = TensorBench(store, args.model, dtype, nodes,
                                getattr(args, "link_delay_ms", 0.0),
                                prefix_cache_mb=getattr(args, "prefix_cache_mb", 0.0),
                                node_cpus=node_cpus)
    else:
        ring = RingBench(store, args.model, dtype, nodes, getattr(args, "link_delay_ms", 0.0),
                         prefix_cache_mb=getattr(args, "prefix_cache_mb", 0.0),
                         node_cpus=node_cpus)
    try:  # the stage processes end with the bench, however it ends
        try:
            loaded = ring.open()
        except (RingBenchError, TensorBenchError) as e:
            raise BenchError(str(e)) from None
        return _run_loaded(args, store, engine, load_before, arms, skipped, loaded, ring)
    finally:
        ring.close()


def resolve_workload_options(args: argparse.Namespace) -> None:
    """--max-tokens (a length or several), --workloads, --structured and --first-seen settled
    before anything loads: `args.lengths` the lengths, `args.max_tokens` the first (what the
    other modes read), `args.workloads` the names. BenchError for a combination that cannot
    run."""
    structured = getattr(args, "structured", False)
    lengths = args.max_tokens
    if isinstance(lengths, int):
        lengths = [lengths]
    workloads_mode = not (getattr(args, "agent", False) or getattr(args, "concurrency", None)
                          or getattr(args, "engine", "mlx") != "mlx")
    if lengths is None:
        lengths = [DEFAULT_AGENT_MAX_TOKENS if getattr(args, "agent", False)
                   else DEFAULT_MAX_TOKENS]
    if len(lengths) > 1 and (not workloads_mode or getattr(args, "nodes", 1) > 1):
        raise BenchError("several --max-tokens lengths run the workloads on one node (no "
                         "--agent, --concurrency, --nodes or --engine served)")
    args.lengths, args.max_tokens = list(lengths), lengths[0]
    if (structured or getattr(args, "first_seen", False)) and (
            not workloads_mode or getattr(args, "nodes", 1) > 1):
        raise BenchError("--structured and --first-seen run the workloads on one node (no "
                         "--agent, --concurrency, --nodes or --engine served)")
    if getattr(args, "ignore_eos", False) and (structured or not workloads_mode
                                               or getattr(args, "nodes", 1) > 1):
        raise BenchError("--ignore-eos runs the text workloads on one node (no --structured, "
                         "--agent, --concurrency, --nodes or --engine served)")
    if getattr(args, "first_seen", False) and getattr(args, "draft_memory_tokens", None):
        raise BenchError("--first-seen turns the draft memory off: no --draft-memory-tokens")
    if getattr(args, "workloads", None) is None:
        args.workloads = list(STRUCTURED) if structured else list(WORKLOADS)
    wrong = [w for w in args.workloads if (w in STRUCTURED) != structured]
    if wrong:
        raise BenchError(f"workload {wrong[0]!r} is " + (
            "not in the structured set (--structured: " + ", ".join(STRUCTURED) + ")"
            if structured else "in the structured set: add --structured"))
    if structured:
        from skulkp2p.bench.cases import require_jsonschema

        require_jsonschema()


def _run_loaded(args: argparse.Namespace, store: ModelStore, engine: dict[str, Any],
                load_before: list[float] | None, arms: list[Arm], skipped: list[dict[str, str]],
                loaded: LoadedModel, ring: Any) -> int:
    draft = open_draft(store, args.draft_model, loaded) if args.draft_model else None
    # The single-node reference beside a ring or group: the whole model in this process.
    single = None
    if ring is not None and getattr(args, "one_node", False) and not getattr(args, "agent",
                                                                             False):
        from skulkp2p.engine.runner.loader import open_model

        single = open_model(store, args.model, loaded.dtype)
        arms = [*arms, ONE_NODE_PLAIN, ONE_NODE_SPEC]

    def model_of(arm: Arm) -> LoadedModel:
        return single if arm.one_node and single is not None else loaded

    if getattr(args, "agent", False):
        from skulkp2p.bench.arms.agent import run_agent

        doc, table = run_agent(args, engine, load_before, loaded, ring)
        write_document(doc, table, args.json_out)
        if doc["mismatched"]:
            raise BenchError(f"greedy output differs from plain for "
                             f"{', '.join(doc['mismatched'])}")
        return 0

    # The mlx-lm arms run in this process: every one of their forwards gets a fixed OpenBLAS
    # thread count (--peer-blas-threads, default the start count); ours, the engine's policy.
    from skulkp2p.bench.cores import allowed_cores
    from skulkp2p.engine.cpu import blas, blas_threads

    threads = blas_threads.policy()
    peer_threads = getattr(args, "peer_blas_threads", None) or (
        threads.narrow if threads is not None else None)
    # On an emulated node (--cores-per-node) every forward here gets that node's thread count.
    cores_per_node = getattr(args, "cores_per_node", None)
    node_threads = None if cores_per_node is None else blas.default_blas_threads(cores_per_node)

    def arm_threads(arm: Arm) -> Any:
        return blas_threads.pinned(peer_threads if arm.kind in ("mlx_lm", "mlx_lm_draft")
                                   else node_threads)

    first_seen = getattr(args, "first_seen", False)
    cases = bench_cases(args.workloads, getattr(args, "lengths", [args.max_tokens]), first_seen)
    # Warm-up: each arm once on a short prompt (kernels, allocator; the structured set's
    # grammar too); also finds arms that cannot run on this model at all.
    for arm in list(arms):
        if arm.kind == "llama":
            continue  # a fresh server per measured request: nothing to warm
        try:
            with arm_threads(arm):
                execute(arm, model_of(arm), draft, WARMUP_MESSAGES,
                        min(WARMUP_TOKENS, args.max_tokens), args.draft_tokens,
                        schema=cases[0].schema)
        except SkipArm as e:
            log.warning("arm %s skipped: %s", arm.name, e)
            skipped.append({"arm": arm.name, "reason": str(e)})
            arms.remove(arm)
    if PLAIN not in arms:
        raise BenchError(f"the plain arm cannot run: {skipped[-1]['reason']}")
    if ring is not None:
        ring.take_run(None)  # the warm-up's traversals do not count

    workloads = [c.label for c in cases]
    cells = {(c.label, a.name): Cell() for c in cases for a in arms}
    memory_tokens = 0 if first_seen else getattr(args, "draft_memory_tokens", None)
    temperature = getattr(args, "temperature", 0.0)
    sampled = temperature > 0.0
    unseeded = bool(getattr(args, "unseeded", False))
    settings = {
        "max_tokens": args.max_tokens, "runs": args.runs, "statistic": "median",
        "lengths": {c.label: c.max_tokens for c in cases},
        "structured": getattr(args, "structured", False),
        "schemas": {c.label: c.schema for c in cases if c.schema is not None} or None,
        "first_seen": first_seen,
        "ignore_eos": getattr(args, "ignore_eos", False),
        "warmup": f"each arm once, {min(WARMUP_TOKENS, args.max_tokens)} tokens",
        "order": "interleaved: run r of every workload and arm before run r+1",
        "greedy": not sampled, "chat_template": True,
        "sampling": {"temperature": temperature,
                     "seeds": "none: every request unseeded, no text compared with plain's"
                     if unseeded else f"{args.seed} + run index, the same for every arm",
                     "acceptance": "summed over all runs"} if sampled else None,
        "workloads": workloads, "arms": [a.name for a in arms],
        "sessions": {c.label: len(c.setup) for c in cases if c.setup},
        "fresh": "a fresh engine (empty draft memory) or llama-server per measured request; "
                 + ("first seen: no earlier requests, the draft memory off, no prefix cache"
                    if first_seen else "a session's earlier requests go to it first, "
                                       "unmeasured"),
        "draft_memory_tokens": memory_tokens,
        "llama_server": str(args.peer[0]) if getattr(args, "peer", None) else None,
        "llama_gguf": str(args.peer[1]) if getattr(args, "peer", None) else None,
        "draft_model": args.draft_model, "draft_tokens": args.draft_tokens,
        "engine_draft_model": getattr(getattr(loaded, "draft", None), "id", None),
        # what the engine's depth controller read from <data-dir>/widths (spec arm)
        "width_costs_used": _str_keys(getattr(loaded, "width_costs", None)),
        "one_node_width_costs_used": None if single is None else _str_keys(
            getattr(single, "width_costs", None)),
        "prompt_tokens": {c.label: prompt_len(loaded, c.messages) for c in cases},
        "cores_per_node": cores_per_node,
        "bench_cores": None if cores_per_node is None else allowed_cores(os.getpid()),
    }
    if ring is not None:
        settings["ring"] = ring.settings  # filled in as the ring runs: compute vs link seconds

    def document(complete: bool) -> tuple[dict[str, Any], list[str]]:
        results, cell_skips, mismatched = cell_results(
            cells, arms, workloads, sampled,
            frozenset(() if unseeded else
                      (a.name for a in arms if drafts_deterministic(a, loaded))))
        plain_text = {wl: cells[(wl, "plain")].runs[0].text[:400]
                      for wl in workloads if cells[(wl, "plain")].runs}
        return {
            "complete": complete,
            "machine": {**machine_info(), "loadavg_before": load_before,
                        "loadavg_after": loadavg()},
            "engine": {**engine, "blas_threads": None if threads is None else {
                **threads.describe(), "peer_arms": peer_threads}},
            "model": {"id": loaded.id, "path": str(loaded.path), "dtype": loaded.dtype},
            "settings": {**settings, "plain_text": plain_text},
            "results": results,
            "skipped": skipped + cell_skips,
        }, mismatched

    for r in range(args.runs):
        # Run r starts at arm r: on a loaded machine the arm that runs first after another
        # workload (or the warm-up) is not always the one favoured, so no arm holds one place.
        shift = r % len(arms) if arms else 0
        order = [*arms[shift:], *arms[:shift]]
        for case in cases:
            wl = case.label
            for arm in order:
                cell = cells[(wl, arm.name)]
                if cell.skip:
                    continue
                if ring is not None and not arm.one_node and hasattr(ring, "mark_run"):
                    ring.mark_run()  # (a tensor group's rank times count from here)
                try:
                    with arm_threads(arm):
                        run = execute(arm, model_of(arm), draft, case.messages,
                                      case.max_tokens, args.draft_tokens, case.setup,
                                      memory_tokens, getattr(args, "peer", None),
                                      Sampling(temperature, None if unseeded else args.seed + r)
                                      if sampled else None,
                                      case.schema, getattr(args, "ignore_eos", False))
                except SkipArm as e:
                    cell.skip = str(e)
                    continue
                if ring is not None and not arm.one_node:
                    run.ring = ring.take_run(run.ttft_s + run.decode_s)
                if case.schema is not None:
                    run.valid = valid_against(run.text, case.schema)
                cell.runs.append(run)
                log.info("run %d/%d %-10s %-14s %s tok/s, ttft %.2fs%s", r + 1, args.runs, wl,
                         arm.name, fmt(run.tok_s, ".2f"), run.ttft_s,
                         "" if run.drafted is None else f", accepted {run.accepted}/{run.drafted}")
                if args.json_out:  # a bench killed by a time limit keeps what it measured
                    write_atomic(Path(args.json_out),
                                 json.dumps(document(False)[0], indent=2) + "\n")

    doc, mismatched = document(True)
    if args.widths:
        from skulkp2p.engine.drafting.width_costs import (
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
    tables = markdown_tables(doc) + summary_table(doc["summary"])
    if not settings["structured"] and ring is None:  # the drafting aims' quantities
        doc["aims"] = aims(doc, doc["summary"])
        tables += aims_table(doc["aims"])
    write_document(doc, tables, args.json_out)
    if args.plot:
        plot_speedups(doc, Path(args.plot))
    if mismatched:
        own = [m for m in mismatched if not m.split("/")[0].startswith(("mlx_lm", "llama_"))]
        log.warning("greedy tokens differ from plain: %s", ", ".join(mismatched))
        if own:  # our arms must be exact; a peer's mismatch is recorded, not ours to fail on
            raise BenchError(f"greedy output differs from plain for {', '.join(own)}")
    return 0


def _str_keys(d: dict[int, float] | None) -> dict[str, float] | None:
    return None if d is None else {str(k): v for k, v in sorted(d.items())}
