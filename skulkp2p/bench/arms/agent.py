"""`bench --agent`: the multi-turn agent workload and the shared-prefix pair, with the prefix
cache on and off, plain and speculative, side by side in one run.

* The agent conversation (workloads.AGENT_TURNS): one conversation growing over six turns as a
  coding agent's does (ask, read a ~1,000-token file, edit, a test run's result, edit again,
  summary); each turn's assistant message is the model's own answer of the turn before. Per
  turn: time to first token, decode tok/s, prompt and cached tokens.
* The shared-prefix pair: two requests with the same ~1,100-token prefix (system prompt and the
  file) and different questions; the time to first token of each.

Arms: plain and spec (speculation "auto"), each with the prefix cache off and on (`+prefix`,
`--prefix-cache-mb`). Every arm runs every conversation on a fresh engine (an empty cache), runs
are interleaved (run r of every arm before run r+1), medians over `--runs`. Greedy: every arm's
tokens must equal plain's, turn by turn, or the command fails after writing the JSON. No mlx at
module level.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.report import fmt, loadavg, machine_info, round_or_none, write_atomic
from skulkp2p.bench.workloads import (
    AGENT_TURNS,
    SHARED_PREFIX_QUESTIONS,
    WARMUP_MESSAGES,
    WARMUP_TOKENS,
    agent_messages,
    shared_prefix_messages,
)

if TYPE_CHECKING:
    from skulkp2p.engine.model.loaded import LoadedModel

log = logging.getLogger("skulkp2p.bench")

DEFAULT_AGENT_MAX_TOKENS = 96
AIM = 5.0  # time to first token: the cache's aim, as a ratio of cold to warm


@dataclass(frozen=True)
class AgentArm:
    name: str
    speculation: str  # the request's "speculation"
    prefix: bool  # the prefix cache on


ARMS = (AgentArm("plain", "off", False), AgentArm("spec", "auto", False),
        AgentArm("plain+prefix", "off", True), AgentArm("spec+prefix", "auto", True))


@dataclass
class Turn:
    tokens: list[int]
    text: str
    ttft_s: float
    decode_s: float
    prompt_tokens: int
    cached_tokens: int
    drafted: int | None = None
    accepted: int | None = None

    @property
    def tok_s(self) -> float | None:
        if len(self.tokens) < 2 or self.decode_s <= 0:
            return None
        return (len(self.tokens) - 1) / self.decode_s


@dataclass
class ArmRuns:
    conversations: list[list[Turn]] = field(default_factory=list)
    pairs: list[tuple[Turn, Turn]] = field(default_factory=list)


def ask(engine: Any, messages: list[dict[str, str]], max_tokens: int, speculation: str
        ) -> Turn:
    """One greedy chat request, timed as a client sees it."""
    from skulkp2p.formats.pipe_format import parse_request

    req = parse_request({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                         "speculation": speculation})
    generation = engine.generate(req)
    t_first = t_last = None
    t0 = time.perf_counter()
    for chunk in generation:
        if chunk.tokens:
            t_last = time.perf_counter()
            t_first = t_first or t_last
    end = t_last or time.perf_counter()
    result = generation.result
    assert result is not None
    spec = result.speculation
    return Turn(list(result.tokens), result.text, (t_first or end) - t0, end - (t_first or end),
                result.usage.prompt_tokens, result.usage.cached_tokens,
                spec.drafted if spec else None, spec.accepted if spec else None)


def _engine(loaded: LoadedModel, arm: AgentArm, prefix_cache_mb: float) -> Any:
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    return MlxEngine(loaded, prefix_cache_mb if arm.prefix else 0)


def conversation(loaded: LoadedModel, arm: AgentArm, max_tokens: int,
                 prefix_cache_mb: float, n_turns: int = len(AGENT_TURNS)) -> list[Turn]:
    """The agent conversation (its first `n_turns` turns) on a fresh engine: each turn's answer
    goes into the next turn."""
    engine = _engine(loaded, arm, prefix_cache_mb)
    answers: list[str] = []
    turns: list[Turn] = []
    for _ in AGENT_TURNS[:n_turns]:
        turns.append(ask(engine, agent_messages(answers), max_tokens, arm.speculation))
        answers.append(turns[-1].text)
    return turns


def shared_pair(loaded: LoadedModel, arm: AgentArm, max_tokens: int,
                prefix_cache_mb: float) -> tuple[Turn, Turn]:
    engine = _engine(loaded, arm, prefix_cache_mb)
    first, second = (ask(engine, shared_prefix_messages(q), max_tokens, arm.speculation)
                     for q in SHARED_PREFIX_QUESTIONS)
    return first, second


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _turn_stats(turns: list[Turn], reference: list[int] | None) -> dict[str, Any]:
    drafted = [t.drafted for t in turns if t.drafted is not None]
    return {"ttft_s": round_or_none(_median([t.ttft_s for t in turns]), 4),
            "decode_tok_s": round_or_none(_median([t.tok_s for t in turns]), 2),
            "prompt_tokens": turns[0].prompt_tokens,
            "cached_tokens": turns[0].cached_tokens, "tokens": len(turns[0].tokens),
            "drafted": sum(drafted) if drafted else None,
            "accepted": sum(t.accepted or 0 for t in turns) if drafted else None,
            "identical_to_plain": None if reference is None else all(
                t.tokens == reference for t in turns)}


def results(cells: dict[str, ArmRuns], n_turns: int = len(AGENT_TURNS)
            ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Per turn and per arm medians, the shared pair, and the arms whose tokens differ."""
    mismatched: list[str] = []
    plain = cells["plain"].conversations
    turns: list[dict[str, Any]] = []
    for i, (name, _) in enumerate(AGENT_TURNS[:n_turns]):
        if not all(len(c.conversations) for c in cells.values()):
            break
        ref = plain[0][i].tokens
        arms = {a: _turn_stats([conv[i] for conv in runs.conversations], ref)
                for a, runs in cells.items()}
        for a, row in arms.items():
            if row["identical_to_plain"] is False:
                mismatched.append(f"{a}/turn {i + 1}")
        turns.append({
            "turn": i + 1, "name": name, "prompt_tokens": arms["plain"]["prompt_tokens"],
            "arms": arms,
            # time to first token without the cache over with it (the cache's gain)
            "ttft_gain_prefix": {s: _ratio(arms[s]["ttft_s"], arms[f"{s}+prefix"]["ttft_s"])
                                 for s in ("plain", "spec")},
            # decode tok/s of spec over plain (the speculation's gain)
            "decode_gain_spec": {k: _ratio(arms[f"spec{k}"]["decode_tok_s"],
                                           arms[f"plain{k}"]["decode_tok_s"])
                                 for k in ("", "+prefix")},
        })
    pair: dict[str, Any] = {"questions": list(SHARED_PREFIX_QUESTIONS), "arms": {}}
    for a, runs in cells.items():
        if not runs.pairs:
            continue
        first = _median([p[0].ttft_s for p in runs.pairs])
        second = _median([p[1].ttft_s for p in runs.pairs])
        pair["arms"][a] = {
            "prompt_tokens": [runs.pairs[0][0].prompt_tokens, runs.pairs[0][1].prompt_tokens],
            "first_ttft_s": round_or_none(first, 4), "second_ttft_s": round_or_none(second, 4),
            "second_cached_tokens": runs.pairs[0][1].cached_tokens,
            "first_over_second": _ratio(first, second)}
        ref = cells["plain"].pairs[0] if cells["plain"].pairs else None
        if ref is not None and any(p[0].tokens != ref[0].tokens or p[1].tokens != ref[1].tokens
                                   for p in runs.pairs):
            mismatched.append(f"{a}/shared-prefix")
    return turns, pair, mismatched


def aims(turns: list[dict[str, Any]], pair: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"ratio": AIM}
    for s in ("plain", "spec"):
        row = pair["arms"].get(f"{s}+prefix")
        got = row["first_over_second"] if row else None
        out[f"shared_prefix_second_ttft_{s}"] = {"first_over_second": got,
                                                 "met": None if got is None else got >= AIM}
        gain = turns[4]["ttft_gain_prefix"][s] if len(turns) >= 5 else None
        out[f"turn5_ttft_{s}"] = {"without_over_with": gain,
                                  "met": None if gain is None else gain >= AIM}
    return out


def table(doc: dict[str, Any]) -> str:
    m, s = doc["model"], doc["settings"]
    lines = [f"bench --agent: {m['id']} {m['dtype']}, up to {s['max_tokens']} tokens a turn, "
             f"median of {s['runs']} run(s), prefix cache {s['prefix_cache_mb']} MB", "",
             "| turn | prompt | cached | TTFT s plain | +prefix | × | TTFT s spec | +prefix | × "
             "| tok/s plain | spec | plain+prefix | spec+prefix | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in doc["turns"]:
        a = t["arms"]
        same = all(r["identical_to_plain"] is not False for r in a.values())
        lines.append(
            f"| {t['turn']} {t['name']} | {t['prompt_tokens']} | "
            f"{a['plain+prefix']['cached_tokens']} | {fmt(a['plain']['ttft_s'], '.3f')} | "
            f"{fmt(a['plain+prefix']['ttft_s'], '.3f')} | "
            f"{fmt(t['ttft_gain_prefix']['plain'], '.1f')} | {fmt(a['spec']['ttft_s'], '.3f')} "
            f"| {fmt(a['spec+prefix']['ttft_s'], '.3f')} | "
            f"{fmt(t['ttft_gain_prefix']['spec'], '.1f')} | "
            + " | ".join(fmt(a[k]["decode_tok_s"], ".1f") for k in
                         ("plain", "spec", "plain+prefix", "spec+prefix"))
            + f" | {'yes' if same else 'NO'} |")
    lines += ["", "shared prefix (same system prompt and file, two questions):", "",
              "| arm | prompt tokens | TTFT s first | TTFT s second | cached | × |",
              "|---|---|---:|---:|---:|---:|"]
    for name, r in doc["shared_prefix"]["arms"].items():
        lines.append(f"| {name} | {r['prompt_tokens'][0]}, {r['prompt_tokens'][1]} | "
                     f"{fmt(r['first_ttft_s'], '.3f')} | {fmt(r['second_ttft_s'], '.3f')} | "
                     f"{r['second_cached_tokens']} | {fmt(r['first_over_second'], '.1f')} |")
    lines += ["", f"aims (×{AIM:.0f}): " + ", ".join(
        f"{k} {'met' if v['met'] else 'not met' if v['met'] is False else '—'}"
        for k, v in doc["aims"].items() if isinstance(v, dict))]
    return "\n".join(lines) + "\n"


def run_agent(args: Any, engine_report: dict[str, Any], load_before: list[float] | None,
              loaded: LoadedModel, ring: Any = None) -> tuple[dict[str, Any], str]:
    """Measure; return the JSON document and its table (the caller writes them, and fails when
    an arm's greedy tokens differ from plain's). `ring`: the model is a ring's last stage
    (`--nodes`); its stages keep their own prefix caches."""
    mb = float(args.prefix_cache_mb)
    if mb <= 0:
        raise BenchError("--agent compares the prefix cache on and off: --prefix-cache-mb must "
                         "be more than 0")
    max_tokens = args.max_tokens
    n_turns = args.turns or len(AGENT_TURNS)  # --turns: the first N only
    cells = {arm.name: ArmRuns() for arm in ARMS}
    settings = {
        "max_tokens": max_tokens, "runs": args.runs, "statistic": "median",
        "prefix_cache_mb": mb, "arms": [a.name for a in ARMS], "greedy": True,
        "turns": [name for name, _ in AGENT_TURNS[:n_turns]],
        "order": "interleaved: run r of every arm before run r+1; a fresh engine (empty cache) "
                 "for every conversation and every pair",
        "warmup": "each arm: a short request and a cold shared-prefix request",
    }
    if ring is not None:
        settings["ring"] = ring.settings

    def done() -> None:
        if ring is not None:
            ring.take_run(None)  # let the finished requests' forwards go

    for arm in ARMS:  # warm-up: kernels, the allocator, a long prefill
        engine = _engine(loaded, arm, mb)
        ask(engine, WARMUP_MESSAGES, min(WARMUP_TOKENS, max_tokens), arm.speculation)
        ask(engine, shared_prefix_messages("Say OK."), 2, arm.speculation)
    done()

    def document(complete: bool) -> tuple[dict[str, Any], list[str]]:
        turns, pair, mismatched = results(cells, n_turns)
        return {"complete": complete, "mode": "agent",
                "machine": {**machine_info(), "loadavg_before": load_before,
                            "loadavg_after": loadavg()},
                "engine": engine_report,
                "model": {"id": loaded.id, "path": str(loaded.path), "dtype": loaded.dtype},
                "settings": settings, "turns": turns, "shared_prefix": pair,
                "aims": aims(turns, pair)}, mismatched

    for r in range(args.runs):
        for arm in ARMS:
            conv = conversation(loaded, arm, max_tokens, mb, n_turns)
            done()
            cells[arm.name].conversations.append(conv)
            log.info("run %d/%d %-12s turns: ttft %s s, cached %s", r + 1, args.runs, arm.name,
                     " ".join(f"{t.ttft_s:.2f}" for t in conv),
                     " ".join(str(t.cached_tokens) for t in conv))
            if args.json_out:  # a bench killed by a time limit keeps what it measured
                write_atomic(Path(args.json_out), json.dumps(document(False)[0], indent=2) + "\n")
        for arm in ARMS:
            pair = shared_pair(loaded, arm, max_tokens, mb)
            done()
            cells[arm.name].pairs.append(pair)
            log.info("run %d/%d %-12s shared prefix: ttft %.3f s then %.3f s (%d cached)", r + 1,
                     args.runs, arm.name, pair[0].ttft_s, pair[1].ttft_s, pair[1].cached_tokens)
    doc, mismatched = document(True)
    doc["mismatched"] = mismatched
    return doc, table(doc)
