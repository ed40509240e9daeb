"""Round by round: who drafted, how deep, what was accepted, and what could have been copied.

    python tools/draft_trace.py [--workload code-edit] [--max-tokens 200] [--json PATH]
                                [--rounds] [--model ID]
    python tools/draft_trace.py --replay PATH      # the kept outputs through today's drafters
    python tools/draft_trace.py --cpu-runs N --workload echo,code-edit   # CPU-time ratios

Runs one of the bench's workloads (skulkp2p/bench/workloads.py) greedy with speculation "auto"
on a fresh MlxEngine (no prefix cache; the workload's earlier session requests sent first, as
the bench does), and records every round of the decode loop: which drafter drafted it (the
suffix drafter from the request's own text or from memory, the model's MTP/EAGLE head, or
nobody), the suffix drafter's longest own match and memory match when it was asked, the depth
drafted, the tokens accepted.

Beside it an ORACLE over the real output: at each output position, the longest continuation
that could have been copied from the text before it (the prompt, the earlier requests and the
output so far: the longest previous factor of the output there, so a copy agrees with what the
target emitted). Rounds are then classed:

- `copied`: lookup drafted and got what the oracle allowed (up to its depth);
- `lookup-short`: lookup drafted, every draft accepted, but the oracle had more (a depth cap);
- `lookup-wrong`: lookup drafted a continuation that diverged before the oracle's end (another
  occurrence of the match would have agreed);
- `missed-copy`: a copy of 2 or more tokens was there and lookup did not draft (no match of
  its minimum length at the text's end, its gate off, or the head drafted instead);
- `head-hit` / `head-miss`: the head drafted where nothing was copyable;
- `plain`: nobody drafted.

With --replay, the outputs a --json run kept go through today's drafters and gates without
the model (replay(): an oracle verifier, the head answered from its table of real drafts and
their probabilities under the head, so that `mtp_min_confidence` applies as it would), each
verify priced with the width cost table: a drafting policy weighed in seconds, before the bench
measures it. With --cpu-runs, plain, spec and spec without lookup.edits run side by side and
their CPU time per token is compared (cpu_pairs()).

It prints the rounds (with --rounds) and a summary per class: rounds, tokens emitted, tokens
the oracle allowed beyond what was accepted. Greedy output is the model's; the tool changes
nothing in how the request runs, it only listens (wrappers around the drafter's methods).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A copy must be at least this long to count as missed (a one-token "copy" is almost always
# there, and no drafter should be blamed for it).
MIN_COPY = 2


def copyable(text: list[int], start: int) -> list[int]:
    """For each position i >= start of `text`: the length of the longest run text[i:i+L] that
    also starts at some j < i (overlap allowed, as a copy may continue into itself): how many
    tokens from i on a perfect copy drafter could have drafted from the text before i."""
    out = []
    n = len(text)
    for i in range(start, n):
        best = 0
        first = text[i]
        for j in range(i):
            if text[j] != first:
                continue
            length = 1
            while i + length < n and text[j + length] == text[i + length]:
                length += 1
            best = max(best, length)
        out.append(best)
    return out


@dataclass
class Round:
    at: int  # output tokens emitted before this round
    source: str  # "lookup", "memory", "head", "none"
    drafted: int
    accepted: int
    own_match: int = -1  # the suffix drafter's longest own match at the text's end (-1: not asked)
    mem_match: int = -1
    lookup_on: bool = False
    head_on: bool = False
    asked: int = 0  # the k the loop asked for
    oracle: int = 0  # copyable tokens at this position (the oracle)
    kind: str = ""
    draft: list[int] = field(default_factory=list)


def _classify(r: Round, max_depth: int) -> str:
    reach = min(r.oracle, max_depth)
    if r.source in ("lookup", "memory"):
        if r.accepted >= reach:
            return "copied"
        if r.accepted == r.drafted:
            return "lookup-short"
        return "lookup-wrong"
    if r.oracle >= MIN_COPY:
        return "missed-copy"
    if r.source == "head":
        return "head-hit" if r.accepted else "head-miss"
    return "plain"


def trace(loaded: Any, workload: str, max_tokens: int) -> dict[str, Any]:
    """One greedy request with speculation auto, every round recorded."""
    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.bench.workloads import SESSIONS, WORKLOADS
    from skulkp2p.engine.decode import generate
    from skulkp2p.engine.decode.generate import prompt_tokens
    from skulkp2p.engine.decode.mlx_engine import MlxEngine
    from skulkp2p.engine.drafting.gates import GatedDrafter, LookupThenModel

    engine = MlxEngine(loaded, prefix_cache_mb=0)
    setup_tokens: list[list[int]] = []
    for earlier in SESSIONS.get(workload, []):
        req = engine_request(earlier, max_tokens, "auto")
        gen = engine.generate(req)
        for _ in gen:
            pass
        setup_tokens.append(prompt_tokens(loaded, req) + list(gen.result.tokens))

    rounds: list[Round] = []
    state: dict[str, Any] = {"emitted": 0, "pending": None}
    choose = generate._choose_drafter

    def lookup_of(drafter: Any) -> GatedDrafter | None:
        if isinstance(drafter, LookupThenModel):
            return drafter.lookup
        if isinstance(drafter, GatedDrafter) and drafter.name == "lookup":
            return drafter
        return None

    def chosen(*args: Any, **kwargs: Any) -> Any:
        drafter, depth, hidden = choose(*args, **kwargs)
        state["max_depth"] = depth
        if drafter is None:
            return drafter, depth, hidden
        lookup = lookup_of(drafter)
        model = drafter.model if isinstance(drafter, LookupThenModel) else None

        def before(k: int) -> Round:
            r = Round(at=state["emitted"], source="none", drafted=0, accepted=0, asked=k)
            if lookup is not None:
                inner = lookup.inner
                r.lookup_on = lookup.on
                sam = getattr(inner, "sam", None)
                if sam is not None:
                    r.own_match = sam.match_len
                    r.mem_match = getattr(inner, "memory_match", 0)
            r.head_on = bool(model is not None and model.on)
            return r

        def source_of(tokens: list[int]) -> str:
            if not tokens:
                return "none"
            src = getattr(drafter, "_source", None)
            if src is None:  # a single gated drafter
                src = drafter
            if src is lookup:
                before_mem = state.get("from_memory", 0)
                now = getattr(lookup.inner, "from_memory", 0)
                state["from_memory"] = now
                return "memory" if now > before_mem else "lookup"
            return "head"

        propose, propose_tree = drafter.propose, getattr(drafter, "propose_tree", None)

        def traced_propose(history: list[int], k: int) -> Any:
            r = before(k)
            draft, q = propose(history, k)
            r.source, r.drafted, r.draft = source_of(draft), len(draft), list(draft)
            state["pending"] = r
            return draft, q

        def traced_tree(history: list[int], k: int) -> Any:
            r = before(k)
            tree = propose_tree(history, k)
            tokens = tree.tokens if tree is not None else []
            r.source, r.drafted, r.draft = source_of(tokens), len(tokens), list(tokens)
            state["pending"] = r
            return tree

        observe, observe_tree = drafter.observe, getattr(drafter, "observe_tree", None)

        def close(accepted: int, emitted: list[int]) -> None:
            r = state.pop("pending", None) or Round(at=state["emitted"], source="none",
                                                    drafted=0, accepted=0)
            r.accepted = accepted
            rounds.append(r)
            state["emitted"] += len(emitted)

        def traced_observe(drafted: int, accepted: int, emitted: list[int], forward: Any) -> None:
            observe(drafted, accepted, emitted, forward)
            if state.get("pending") is None and drafted == 0:
                # a quiet stretch's token (the drafter asked after each, offering nothing)
                rounds.append(Round(at=state["emitted"], source="none", drafted=0, accepted=0))
                state["emitted"] += len(emitted)
                return
            close(accepted, emitted)

        def traced_observe_tree(tree: Any, path: list[int], emitted: list[int],
                                forward: Any) -> None:
            observe_tree(tree, path, emitted, forward)
            close(len(path), emitted)

        drafter.propose = traced_propose
        drafter.observe = traced_observe
        if propose_tree is not None:
            drafter.propose_tree = traced_tree
            drafter.observe_tree = traced_observe_tree
        return drafter, depth, hidden

    generate._choose_drafter = chosen
    try:
        req = engine_request(WORKLOADS[workload], max_tokens, "auto")
        prompt = prompt_tokens(loaded, req)
        gen = engine.generate(req)
        for _ in gen:
            pass
    finally:
        generate._choose_drafter = choose
    result = gen.result
    tokens = list(result.tokens)
    # The oracle's text: earlier requests (each followed by a separator no token equals), the
    # prompt, the output.
    before_text: list[int] = []
    for i, earlier in enumerate(setup_tokens):
        before_text += earlier + [-1 - i]
    text = before_text + prompt + tokens
    oracle = copyable(text, len(before_text) + len(prompt))
    max_depth = int(state.get("max_depth") or 16)
    for r in rounds:
        r.oracle = oracle[r.at] if r.at < len(oracle) else 0
        r.kind = _classify(r, max_depth)
    return {"workload": workload, "prompt": prompt, "setup": setup_tokens, "tokens": tokens,
            "oracle": oracle, "rounds": [asdict(r) for r in rounds], "max_depth": max_depth,
            "copyable_positions": sum(1 for x in oracle if x >= MIN_COPY),
            "head": head_table(loaded, prompt, tokens)}


def head_table(loaded: Any, prompt: list[int], tokens: list[int]) -> dict[int, list]:
    """The model's head's one-token draft at every point of the output: {history length:
    [the token it drafts there, its probability under the head]} (the head reads the trunk's
    hidden rows of the verified tokens, so its draft at a point depends only on the text before
    it; the probability lets the replay weigh a confidence threshold). Empty without a head."""
    if loaded.mtp is None:
        return {}
    from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
    from skulkp2p.engine.model.forward import LocalForward

    # As the request's head drafts (its context bias), without a confidence threshold: the
    # guess at every point, with the probability the threshold is weighed by.
    drafter = MtpDrafter(loaded.mtp,
                         context_bias=float(loaded.speculation.get("mtp_context_bias", 0.0)))
    forward = LocalForward(loaded.model, hidden=loaded.mtp.conventions.hidden)
    forward.prefill(prompt[:-1])
    drafter.begin(prompt, forward)
    history = list(prompt)
    table: dict[int, list] = {}
    for token in tokens:
        draft, _ = drafter.propose(history, 1)
        if draft:
            table[len(history)] = [draft[0], drafter.confidence(draft[0])]
        forward([history[-1]])
        drafter.observe(len(draft), 0, [token], forward)  # (the head trims its own rows)
        history.append(token)
    return table


class TableHead:
    """The model's head as a table (head_table): its one-token draft where the real head would
    draft at this point of the output. Nothing runs."""

    name = "mtp"

    def __init__(self, table: dict[int, Any], min_confidence: float = 0.0):
        # (tables kept before the head's probability was recorded hold the token alone)
        self.table = {at: (v, 1.0) if isinstance(v, int) else tuple(v)
                      for at, v in table.items()}
        self.min_confidence = min_confidence  # as MtpDrafter's

    def begin(self, prompt: list[int], forward: Any) -> None:
        pass

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        token, p = self.table.get(len(history), (None, 0.0))
        if k <= 0 or token is None or p < self.min_confidence:
            return [], None
        return [token], None

    def observe(self, drafted: int, accepted: int, emitted: list[int], forward: Any) -> None:
        pass

    def follow(self, accepted: int, emitted: list[int], forward: Any) -> None:
        pass

    lag = follow


def replay(loaded: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The same request replayed without the model: the real decode loop, gates and drafters as
    `auto` builds them (generate._choose_drafter, so a change there shows here), the head
    answered from its table, every verify by an oracle that knows the output (greedy output is
    a function of the text). Each verify is priced with the width cost table, the head's draft
    with its relative cost: the modelled speed-up over plain, tokens / cost."""
    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.decode import generate
    from skulkp2p.engine.decode.loop import DecodeStats, decode
    from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
    from skulkp2p.engine.drafting.gates import width_cost
    from skulkp2p.engine.drafting.suffix import SuffixMemory
    from tools.tree_sim import OracleForward

    prompt, tokens = data["prompt"], data["tokens"]
    table = {int(k): v for k, v in data.get("head", {}).items()}
    memory = SuffixMemory(65536)
    for earlier in data.get("setup", []):
        memory.add(earlier)
    made = generate._mtp_drafter
    generate._mtp_drafter = lambda loaded, min_confidence=0.0: TableHead(table, min_confidence)
    try:
        req = engine_request(WORKLOADS[data["workload"]], len(tokens), "auto")
        drafter, depth, _ = generate._choose_drafter(loaded, req, prompt, memory)
    finally:
        generate._mtp_drafter = made
    truth = prompt + tokens
    forward = OracleForward(truth, 0, max(truth) + 2)
    stats = DecodeStats()
    sources: list[str] = []
    if hasattr(drafter, "propose_tree"):
        def propose_tree(history: list[int], k: int, inner=drafter.propose_tree) -> Any:
            tree = inner(history, k)
            src = getattr(drafter, "_source", None)
            sources.append("head" if tree is not None and src is not getattr(
                drafter, "lookup", drafter) else "lookup" if tree is not None else "none")
            return tree
        drafter.propose_tree = propose_tree
    out = list(decode(forward, prompt, SamplingParams(), len(tokens), make_rng(0), drafter,
                      depth, stats, history=[]))
    assert out == tokens, "the replay left the output: the oracle or the loop is wrong"
    costs = generate._costs(loaded)
    head_cost = generate._relative_cost(loaded.mtp, loaded) if loaded.mtp is not None else 0.0
    cost = sum(width_cost(costs, w) for w in forward.widths)
    cost += head_cost * sources.count("head")
    return {"rounds": len(forward.widths), "drafted": stats.drafted,
            "accepted": stats.accepted, "head_rounds": sources.count("head"),
            "modelled_speedup": round(len(tokens) / cost, 3)}


def cpu_pairs(loaded: Any, workload: str, max_tokens: int, runs: int) -> dict[str, Any]:
    """plain, spec and spec with `[speculation.lookup] edits = false`, each on a fresh engine
    (the workload's session requests first, unmeasured), in rotating order, `runs` times: the
    process's CPU time per generated token of the measured request from its first token on, as
    the bench's decode tok/s (all threads' work, which a loaded machine moves far less than
    wall time), and spec ÷ plain, noedits ÷ plain as
    plain's CPU time over theirs, medians over the runs."""
    import statistics
    import time

    from skulkp2p.bench.arms.mlx_arms import engine_request
    from skulkp2p.bench.workloads import SESSIONS, WORKLOADS
    from skulkp2p.engine.decode.mlx_engine import MlxEngine

    arms = {"plain": ("off", True), "spec": ("auto", True), "noedits": ("auto", False)}
    saved = loaded.speculation

    def one(speculation: str, edits: bool) -> tuple[float, list[int], int, int]:
        lookup = dict(saved.get("lookup", {}))
        lookup["edits"] = edits
        loaded.speculation = {**saved, "lookup": lookup}
        try:
            engine = MlxEngine(loaded, prefix_cache_mb=0)
            for earlier in SESSIONS.get(workload, []):
                for _ in engine.generate(engine_request(earlier, max_tokens, speculation)):
                    pass
            gen = engine.generate(engine_request(WORKLOADS[workload], max_tokens, speculation))
            c0 = None
            for chunk in gen:
                if chunk.tokens and c0 is None:  # from the first token on, as the bench's
                    c0 = time.process_time()  # decode tok/s (the prefill left out)
            cpu = time.process_time() - (c0 if c0 is not None else time.process_time())
        finally:
            loaded.speculation = saved
        spec = gen.result.speculation
        tokens = list(gen.result.tokens)
        return (cpu / max(len(tokens) - 1, 1), tokens, spec.accepted if spec else 0,
                spec.drafted if spec else 0)

    names = list(arms)
    got: dict[str, list[tuple[float, list[int], int, int]]] = {n: [] for n in names}
    for r in range(runs):
        for name in names[r % 3:] + names[:r % 3]:
            got[name].append(one(*arms[name]))
    out: dict[str, Any] = {"workload": workload, "runs": runs}
    for name in ("spec", "noedits"):
        ratios = [p[0] / a[0] for p, a in zip(got["plain"], got[name], strict=True)]
        out[name] = {"cpu_ratio": round(statistics.median(ratios), 3),
                     "accepted": got[name][0][2], "drafted": got[name][0][3],
                     "exact": all(a[1] == p[1] for p, a in
                                  zip(got["plain"], got[name], strict=True))}
    out["plain_cpu_ms_per_token"] = round(statistics.median(x[0] for x in got["plain"]) * 1000,
                                          2)
    return out


def summary(data: dict[str, Any]) -> list[str]:
    rounds = [Round(**r) for r in data["rounds"]]
    by_kind: dict[str, list[Round]] = defaultdict(list)
    for r in rounds:
        by_kind[r.kind].append(r)
    lines = [f"{data['workload']}: {len(data['tokens'])} tokens in {len(rounds)} rounds "
             f"({sum(1 for r in rounds if r.drafted)} drafted; "
             f"{sum(r.accepted for r in rounds)}/{sum(r.drafted for r in rounds)} accepted); "
             f"max depth {data['max_depth']}"]
    lines.append(f"{'class':<14} {'rounds':>6} {'emitted':>8} {'drafted':>8} {'accepted':>9} "
                 f"{'oracle left':>12}")
    for kind in ("copied", "lookup-short", "lookup-wrong", "missed-copy", "head-hit",
                 "head-miss", "plain"):
        rs = by_kind.get(kind, [])
        if not rs:
            continue
        left = sum(max(0, min(r.oracle, data["max_depth"]) - r.accepted) for r in rs)
        lines.append(f"{kind:<14} {len(rs):>6} {sum(r.accepted + 1 for r in rs):>8} "
                     f"{sum(r.drafted for r in rs):>8} {sum(r.accepted for r in rs):>9} "
                     f"{left:>12}")
    missed = by_kind.get("missed-copy", [])
    if missed:
        why = Counter()
        for r in missed:
            if r.own_match < 0:
                why["lookup not asked"] += 1
            elif not r.lookup_on:
                why["lookup gate off"] += 1
            elif max(r.own_match, r.mem_match) < 2:
                why[f"no match of 2 (own {r.own_match})"] += 1
            else:
                why["match but no draft (depth 0)"] += 1
        lines.append("missed-copy, why: " + ", ".join(f"{k}: {v}" for k, v in why.items()))
    return lines


def show_rounds(data: dict[str, Any], decode_one: Any) -> list[str]:
    out = []
    tokens = data["tokens"]
    for r in (Round(**x) for x in data["rounds"]):
        got = tokens[r.at:r.at + r.accepted + 1]
        out.append(f"{r.at:>4} {r.kind:<13} {r.source:<6} d={r.drafted:<2} a={r.accepted:<2} "
                   f"oracle={r.oracle:<3} own={r.own_match:<3} mem={r.mem_match:<3} "
                   f"{'L' if r.lookup_on else '-'}{'H' if r.head_on else '-'} "
                   f"{decode_one(got)!r}"
                   + (f"  drafted {decode_one(r.draft)!r}" if r.drafted and r.accepted <
                      r.drafted else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="code-edit")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--model", default=None, help="a card id from the default store "
                   "(default: SmolLM2-135M from the test model store)")
    p.add_argument("--rounds", action="store_true", help="print every round")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--replay", default=None, metavar="JSON",
                   help="instead of running the model: replay the outputs a --json run kept "
                        "through the current drafters and gates (an oracle verifier, the head "
                        "from its table) and print the modelled speed-up")
    p.add_argument("--cpu-runs", type=int, default=0, metavar="N",
                   help="instead: N rotating runs of plain, spec and spec with lookup.edits "
                        "off per workload; CPU time per token ratios (see cpu_pairs)")
    args = p.parse_args(argv)

    from skulkp2p.engine.cpu import blas
    blas.ensure_fast_blas()
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.model.loader import open_model
    from skulkp2p.models.store import ModelStore

    names = args.workload.split(",")
    for name in names:
        if name not in WORKLOADS:
            print(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}", file=sys.stderr)
            return 2
    if args.model is None:
        from tests.helpers.models import test_data_dir
        loaded = open_model(ModelStore(test_data_dir()), "smollm2-135m", dtype="float32")
    else:
        loaded = open_model(ModelStore(), args.model)
    if args.cpu_runs:
        for name in names:
            print(json.dumps(cpu_pairs(loaded, name, args.max_tokens, args.cpu_runs)),
                  flush=True)
        return 0
    if args.replay:
        kept = json.loads(Path(args.replay).read_text())
        for name, data in kept.items():
            print(f"{name:10s} {json.dumps(replay(loaded, data))}")
        return 0
    every = {}
    for name in names:
        data = trace(loaded, name, args.max_tokens)
        every[name] = data
        if args.rounds:
            print("\n".join(show_rounds(data, loaded.tokenizer.decode)))
        print("\n".join(summary(data)))
        print(f"replayed: {json.dumps(replay(loaded, data))}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(every) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
