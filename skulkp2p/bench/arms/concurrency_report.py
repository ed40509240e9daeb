"""The numbers of `bench --concurrency`: a round (N clients released together: their
generations and its wall time), the per-(arm, mode) summary of its rounds, and the Markdown
table."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from skulkp2p.bench.arms.served_report import Generation
from skulkp2p.bench.report import fmt, round_or_none


@dataclass
class Round:
    generations: list[tuple[str, Generation]]  # (workload, generation) per client
    wall_s: float

    @property
    def aggregate_tok_s(self) -> float | None:
        tokens = sum(g.tokens for _, g in self.generations)
        return tokens / self.wall_s if self.wall_s > 0 else None


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def summarize_cell(rounds: list[Round], solo_ttft: float | None) -> dict[str, Any]:
    gens = [g for r in rounds for _, g in r.generations]
    aggs = [a for r in rounds if (a := r.aggregate_tok_s) is not None]
    per_request = [g.tok_s for g in gens if g.tok_s is not None]
    ttfts = [g.ttft_s for g in gens]
    p99 = percentile(ttfts, 99)
    row: dict[str, Any] = {
        "rounds": len(rounds), "requests": len(gens),
        "aggregate_tok_s": round_or_none(statistics.median(aggs) if aggs else None, 2),
        "aggregate_tok_s_runs": [round(a, 2) for a in aggs],
        "per_request_tok_s": round_or_none(
            statistics.median(per_request) if per_request else None, 2),
        "ttft_p50_s": round_or_none(percentile(ttfts, 50), 4),
        "ttft_p99_s": round_or_none(p99, 4),
        "ttft_p99_over_solo": round_or_none(p99 / solo_ttft if p99 and solo_ttft else None, 2),
        "wall_s": [round(r.wall_s, 3) for r in rounds],
        "tokens": sum(g.tokens for g in gens),
    }
    drafted = [g.drafted for g in gens if g.drafted is not None]
    if drafted:
        accepted = sum(g.accepted or 0 for g in gens)
        row.update(drafted=sum(drafted), accepted=accepted,
                   acceptance=round_or_none(accepted / sum(drafted) if sum(drafted) else None,
                                            3))
    return row


def _blas(b: dict[str, Any] | None) -> str:
    """The thread policy's share of wide forwards in a cell's rounds, and why the rest were
    kept narrow."""
    if not b or b.get("wide_share") is None:
        return "-"
    return (f"{100 * b['wide_share']:.0f}% ({b['busy']}/{b['shared']}/{b['tripped']}"
            f"{', ' + str(b['trips']) + ' trips' if b['trips'] else ''})")


def markdown_table(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    ring = f", rings of {len(next(iter(s['rings'].values())))} agents" if s.get("rings") else ""
    lines = [f"\nbench --concurrency {s['concurrency']}{ring}: {doc['model']['id']} "
             f"({doc['engine']}), {s['max_tokens']} tokens, {s['runs']} rounds, clients: "
             f"{', '.join(s['client_workloads'])}\n",
             "| arm | mode | aggregate tok/s | x fifo | per-request tok/s | TTFT p50 | TTFT p99 "
             "| p99 / solo | BLAS wide (narrowed: busy/shared/tripped) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in doc["results"]:
        lines.append(f"| {row['arm']} | {row['mode']} | {fmt(row['aggregate_tok_s'], '.1f')} | "
                     f"{fmt(row.get('speedup_vs_fifo'), '.2f')} | "
                     f"{fmt(row['per_request_tok_s'], '.1f')} | "
                     f"{fmt(row['ttft_p50_s'], '.3f')} | {fmt(row['ttft_p99_s'], '.3f')} | "
                     f"{fmt(row['ttft_p99_over_solo'], '.2f')} | {_blas(row.get('blas'))} |")
    if doc["mismatches"]:
        lines.append(f"\nMISMATCHES (output differs from solo): {len(doc['mismatches'])}")
    return "\n".join(lines) + "\n"
