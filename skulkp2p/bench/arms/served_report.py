"""The served bench's numbers: rows per workload, arm and path, the proxy's overhead, the table.

Proxy overhead per workload: (direct - proxy) / direct on median decode tok/s and (proxy - direct)
/ direct on median TTFT, so positive numbers are what our layer costs; workload "all" pools every
workload's runs. Greedy text through the proxy must equal the direct text, run by run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from skulkp2p.bench.report import fmt, round_or_none, yes_no

PLAIN, SPEC = "served-plain", "served-spec"


@dataclass
class Generation:
    """One streamed chat completion, timed as a client sees it."""

    text: str
    tokens: int
    ttft_s: float
    decode_s: float
    prompt_tokens: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    agent_cpu_s: float | None = None  # CPU time our agent used during this request
    child_cpu_s: float | None = None  # and its llama-server

    @property
    def tok_s(self) -> float | None:
        if self.tokens < 2 or self.decode_s <= 0:
            return None
        return (self.tokens - 1) / self.decode_s

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tok_s": round_or_none(self.tok_s, 2),
                               "ttft_s": round(self.ttft_s, 4),
                               "decode_s": round(self.decode_s, 4), "tokens": self.tokens}
        if self.drafted is not None:
            out.update(drafted=self.drafted, accepted=self.accepted)
        if self.agent_cpu_s is not None:
            out.update(agent_cpu_s=round(self.agent_cpu_s, 3),
                       child_cpu_s=round_or_none(self.child_cpu_s, 3))
        return out


def path_arm(arm: str, path: str) -> str:
    """The arm's name in the document: "served-spec" through the proxy, "served-spec-direct"."""
    return arm if path == "proxy" else f"{arm}-direct"


def median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize(cells: dict[tuple[str, str, str], list[Generation]], arms: list[str],
              workloads: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                             list[str]]:
    """Rows per workload, arm and path; proxy overhead per workload and arm; and the
    arm/workload pairs whose proxy text differs from direct."""
    results: list[dict[str, Any]] = []
    overhead: list[dict[str, Any]] = []
    mismatched: list[str] = []
    for wl in workloads:
        for path in ("proxy", "direct"):
            base = None
            for arm in arms:
                runs = cells[(wl, arm, path)]
                if not runs:
                    continue
                med = median([g.tok_s for g in runs])
                if arm == PLAIN:
                    base = med
                first = runs[0]
                row: dict[str, Any] = {
                    "arm": path_arm(arm, path), "workload": wl, "path": path,
                    "tok_s": round_or_none(med, 2),
                    "ttft_s": round(statistics.median(g.ttft_s for g in runs), 4),
                    "runs": [g.summary() for g in runs],
                    "speedup_vs_plain": round(med / base, 3) if med and base else None,
                    # per generation, from the first run (the engine's counts)
                    "drafted": first.drafted, "accepted": first.accepted,
                    "acceptance": round(first.accepted / first.drafted, 4)
                    if first.drafted else None,
                    "tokens_generated": first.tokens,
                }
                plain = cells[(wl, PLAIN, path)]
                if arm != PLAIN and plain:
                    row["identical_to_plain"] = all(g.text == plain[0].text for g in runs)
                if path == "proxy":
                    direct = cells[(wl, arm, "direct")]
                    pairs = list(zip(runs, direct, strict=False))
                    same = all(p.text == d.text and p.tokens == d.tokens for p, d in pairs)
                    row["identical_to_direct"] = same if pairs else None
                    if pairs and not same:
                        mismatched.append(f"{arm}/{wl}")
                results.append(row)
        for arm in arms:
            proxy, direct = cells[(wl, arm, "proxy")], cells[(wl, arm, "direct")]
            n = min(len(proxy), len(direct))
            if not n:
                continue
            p_tok, d_tok = median([g.tok_s for g in proxy]), median([g.tok_s for g in direct])
            p_ttft = statistics.median(g.ttft_s for g in proxy)
            d_ttft = statistics.median(g.ttft_s for g in direct)
            paired_tok = median([(d.tok_s - p.tok_s) / d.tok_s
                                  for p, d in zip(proxy[:n], direct[:n], strict=True)
                                  if p.tok_s and d.tok_s])
            paired_ttft = median([(p.ttft_s - d.ttft_s) / d.ttft_s
                                   for p, d in zip(proxy[:n], direct[:n], strict=True)
                                   if d.ttft_s > 0])
            overhead.append({
                "workload": wl, "arm": arm, "runs": n,
                # of the medians; positive = slower through our proxy
                "decode_tok_s": round((d_tok - p_tok) / d_tok, 4) if p_tok and d_tok else None,
                "ttft": round((p_ttft - d_ttft) / d_ttft, 4) if d_ttft > 0 else None,
                "ttft_ms": round((p_ttft - d_ttft) * 1000, 2),
                # the median of run-by-run ratios (each proxy run next to its direct run)
                "decode_tok_s_paired": round_or_none(paired_tok, 4),
                "ttft_paired": round_or_none(paired_ttft, 4),
            })
    for arm in arms:
        pooled = pooled_overhead(cells, arm, workloads)
        if pooled:
            overhead.append(pooled)
    return results, overhead, mismatched



def pooled_overhead(cells: dict[tuple[str, str, str], list[Generation]], arm: str,
                    workloads: list[str]) -> dict[str, Any] | None:
    """Every workload's runs together (workload "all"): decode tok/s as total tokens over total
    decode seconds per path, TTFT as the mean, and the mean and standard error of the run-by-run
    decode overhead: on a noisy machine one workload's 5 runs cannot resolve a few per cent."""
    pairs = [(p, d) for wl in workloads
             for p, d in zip(cells[(wl, arm, "proxy")], cells[(wl, arm, "direct")],
                             strict=False)]
    if not pairs:
        return None

    def rate(gens: list[Generation]) -> float | None:
        secs = sum(g.decode_s for g in gens if g.tokens > 1)
        return sum(g.tokens - 1 for g in gens if g.tokens > 1) / secs if secs > 0 else None

    p_tok, d_tok = rate([p for p, _ in pairs]), rate([d for _, d in pairs])
    p_ttft = statistics.fmean(p.ttft_s for p, _ in pairs)
    d_ttft = statistics.fmean(d.ttft_s for _, d in pairs)
    ratios = [(d.tok_s - p.tok_s) / d.tok_s for p, d in pairs if p.tok_s and d.tok_s]
    def cpu_ms_per_token(gens: list[Generation], attr: str) -> float | None:
        used = [(getattr(g, attr), g.tokens) for g in gens if getattr(g, attr) is not None]
        tokens = sum(n for _, n in used)
        return round(sum(c for c, _ in used) / tokens * 1000, 3) if tokens else None

    proxy, direct = [p for p, _ in pairs], [d for _, d in pairs]
    return {
        "workload": "all", "arm": arm, "runs": len(pairs),
        # CPU per generated token (clock-tick resolution, summed over all runs): the agent's
        # through the proxy is our layer's cost; beside direct runs it is its idle background
        "agent_cpu_ms_per_token": {"proxy": cpu_ms_per_token(proxy, "agent_cpu_s"),
                                   "direct": cpu_ms_per_token(direct, "agent_cpu_s")},
        "child_cpu_ms_per_token": {"proxy": cpu_ms_per_token(proxy, "child_cpu_s"),
                                   "direct": cpu_ms_per_token(direct, "child_cpu_s")},
        "decode_tok_s": round((d_tok - p_tok) / d_tok, 4) if p_tok and d_tok else None,
        "ttft": round((p_ttft - d_ttft) / d_ttft, 4) if d_ttft > 0 else None,
        "ttft_ms": round((p_ttft - d_ttft) * 1000, 2),
        "decode_tok_s_paired": round_or_none(statistics.median(ratios), 4) if ratios else None,
        "ttft_paired": round_or_none(statistics.median((p.ttft_s - d.ttft_s) / d.ttft_s
                                                for p, d in pairs if d.ttft_s > 0), 4),
        "decode_tok_s_paired_mean": round_or_none(statistics.fmean(ratios), 4) if ratios else None,
        "decode_tok_s_paired_sem": round_or_none(statistics.stdev(ratios) / len(ratios) ** 0.5, 4)
        if len(ratios) > 1 else None,
    }


def markdown_tables(doc: dict[str, Any]) -> str:
    m, e, s = doc["model"], doc["engine"], doc["settings"]
    threads = f", threads {e['threads_env']}" if e.get("threads_env") else ""
    lines = [f"bench: {m['id']} on llama-server ({e['spec_type']}{threads}), "
             f"{s['max_tokens']} tokens, median of {s['runs']} run(s); loadavg "
             f"{doc['machine']['loadavg_before']} -> {doc['machine']['loadavg_after']}", "",
             "| workload | arm | tok/s | × plain | TTFT ms | drafted | accepted | acceptance "
             "| = direct | = plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["results"]:
        lines.append(
            f"| {r['workload']} | {r['arm']} | {fmt(r['tok_s'], '.2f')} | "
            f"{fmt(r['speedup_vs_plain'], '.2f')} | {r['ttft_s'] * 1000:.1f} | "
            f"{fmt(r['drafted'], 'd')} | {fmt(r['accepted'], 'd')} | "
            f"{fmt(r['acceptance'], '.0%')} | {yes_no(r.get('identical_to_direct'))} | "
            f"{yes_no(r.get('identical_to_plain'))} |")
    lines += ["", "proxy overhead (positive = slower through our proxy; of medians, and the "
                  "median of run-by-run pairs):", "",
              "| workload | arm | decode tok/s | paired | TTFT | paired | TTFT +ms |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for o in doc["proxy_overhead"]:
        lines.append(
            f"| {o['workload']} | {o['arm']} | {fmt(o['decode_tok_s'], '+.1%')} | "
            f"{fmt(o['decode_tok_s_paired'], '+.1%')} | {fmt(o['ttft'], '+.1%')} | "
            f"{fmt(o['ttft_paired'], '+.1%')} | {o['ttft_ms']:+.1f} |")
    pooled = [o for o in doc["proxy_overhead"] if o.get("decode_tok_s_paired_sem") is not None]
    lines += [""] if pooled else []
    for o in pooled:
        lines.append(f"{o['arm']}, all workloads ({o['runs']} pairs): decode overhead "
                     f"{fmt(o['decode_tok_s'], '+.1%')} of total tok/s; run by run mean "
                     f"{fmt(o['decode_tok_s_paired_mean'], '+.1%')} ± "
                     f"{o['decode_tok_s_paired_sem']:.1%} (standard error)")
        a, c = o.get("agent_cpu_ms_per_token") or {}, o.get("child_cpu_ms_per_token") or {}
        if a.get("proxy") is not None:
            lines.append(f"  CPU ms per token: our agent {a['proxy']:.2f} through the proxy "
                         f"({fmt(a.get('direct'), '.2f')} idle during direct runs); "
                         f"llama-server {fmt(c.get('proxy'), '.2f')} proxied, "
                         f"{fmt(c.get('direct'), '.2f')} direct")
    for sk in doc.get("skipped", []):
        lines.append(f"\nskipped {sk['arm']}: {sk['reason']}")
    return "\n".join(lines) + "\n"
