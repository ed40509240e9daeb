"""The MLX bench's results: per arm and workload, medians, speedup, acceptance and exactness
(`cell_results`), and the per-workload summary that closes the JSON document and its table."""

from __future__ import annotations

import statistics
from typing import Any

from skulkp2p.bench.arms.mlx_arms import (
    FREE_PLAIN,
    ONE_NODE_PLAIN,
    ONE_NODE_SPEC,
    PLAIN,
    Arm,
    Cell,
    Run,
)
from skulkp2p.bench.report import (
    fmt,
    ring_summary,
    round_or_none,
    yes_no,
)


def cell_results(cells: dict[tuple[str, str], Cell], arms: list[Arm], workloads: list[str],
                 sampled: bool = False, coupled: frozenset[str] = frozenset()
                 ) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[str]]:
    """Per arm and workload: medians, speedup, acceptance, exactness; the cells that were
    skipped; and the arm/workload pairs whose tokens differ from plain's. `sampled`: acceptance
    sums every run's, and only the arms in `coupled` (deterministic drafts: a seeded request
    emits plain sampling's text) are compared, run r with plain's run r (the same seed); the
    others' identical_to_plain is None."""
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
            if sampled:
                ref_runs = one_runs if arm.one_node else plain_runs
                # a partial document may hold fewer runs of plain than of this arm
                identical = all(x.tokens == r.tokens for x, r in
                                zip(cell.runs, ref_runs, strict=False)) \
                    if arm.name in coupled and ref_runs else None
            else:
                identical = None if ref is None else all(x.tokens == ref for x in cell.runs)
            if arm.kind == "llama":  # against the peer's own plain, by text
                identical = all(x.text == llama_runs[0].text for x in cell.runs) \
                    if llama_runs else None
            if not arm.constrained:  # another request (no schema): nothing to compare
                identical = None
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
            checked = [x.valid for x in cell.runs if x.valid is not None]
            if checked:  # the structured set: the share of runs valid against the schema
                results[-1]["valid_rate"] = round(sum(checked) / len(checked), 4)
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
        if doc["settings"].get("structured"):
            free = by.get((wl, FREE_PLAIN.name), {}).get("tok_s")
            rates = [r["valid_rate"] for r in doc["results"] if r["workload"] == wl
                     and r["arm"] != FREE_PLAIN.name and not r["peer"] and "valid_rate" in r]
            peers = [r["valid_rate"] for r in doc["results"] if r["workload"] == wl
                     and r["peer"] and "valid_rate" in r]
            out[-1].update(plain_x_free_plain=round(plain / free, 3) if plain and free else None,
                           all_valid=bool(rates) and min(rates) == 1.0,
                           llama_valid_rate=min(peers) if peers else None,
                           free_plain_valid_rate=by.get((wl, FREE_PLAIN.name), {}).get(
                               "valid_rate"))
    _gain_kept(out, doc["settings"].get("lengths") or {})
    return out


def _gain_kept(rows: list[dict[str, Any]], lengths: dict[str, int]) -> None:
    """Several --max-tokens lengths: each longer row's share of the shortest length's gain,
    (spec x plain - 1) / (shortest's spec x plain - 1), where the shortest gained at all."""
    by = {r["workload"]: r for r in rows}
    for r in rows:
        base, _, n = r["workload"].rpartition("@")
        if not base or not n.isdigit():
            continue
        same = sorted((lengths[k], k) for k in lengths if k.rpartition("@")[0] == base)
        shortest = by.get(same[0][1]) if same else None
        if shortest is None or shortest is r:
            continue
        gain, short_gain = r["spec_x_plain"], shortest["spec_x_plain"]
        r["gain_kept"] = round((gain - 1) / (short_gain - 1), 3) \
            if gain is not None and short_gain is not None and short_gain > 1 else None


# The drafting aims the bench reports directly (SmolLM2-135M on a 2-core CPU, first seen): spec
# over plain on qa and on a question over a given context (greedy), the geometric mean over the
# run's workloads at temperature 0.7, and the share of the shortest length's gain a longer
# length keeps.
AIM_QA = 1.5
AIM_CTXQA = 1.4
AIM_SAMPLED_GEOMEAN = 1.5
AIM_GAIN_KEPT = 0.85


def _per_run_ratio(doc: dict[str, Any], label: str) -> float | None:
    """The median over runs of spec's tok/s over plain's in the same run: run r of every arm of
    a case runs back to back, so on a machine whose load changes between runs this ratio is
    steadier than the ratio of the medians."""
    by = {(r["workload"], r["arm"]): r for r in doc["results"]}
    spec, plain = by.get((label, "spec")), by.get((label, "plain"))
    if spec is None or plain is None:
        return None
    ratios = [s["tok_s"] / p["tok_s"] for s, p in zip(spec["runs"], plain["runs"], strict=False)
              if s.get("tok_s") and p.get("tok_s")]
    return round(statistics.median(ratios), 3) if ratios else None


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return round(statistics.geometric_mean(xs), 3) if xs else None


def aims(doc: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The drafting aims' quantities from a text-workload run: per length, qa's and ctxqa's
    spec x plain (when they ran), the geometric mean over every workload (the sampled aim when
    the run sampled), and at each longer length the share of the shortest length's geometric
    gain it keeps. Each row has the ratio of medians (the bench's `spec x plain`), the median of
    per-run ratios, the aim and whether the ratio of medians meets it; `first_seen` and the
    temperature say whether the aim applies to this run as it stands."""
    s = doc["settings"]
    lengths: dict[str, int] = s.get("lengths") or {}
    by_label = {r["workload"]: r for r in rows}
    labels = list(s["workloads"])
    sizes = sorted({lengths.get(label, s["max_tokens"]) for label in labels})
    sampled = not s.get("greedy", True)
    applies = bool(s.get("first_seen"))

    def label_of(workload: str, n: int) -> str:
        return f"{workload}@{n}" if len(sizes) > 1 else workload

    def tokens(label: str) -> int | None:
        plain = [r for r in doc["results"] if r["workload"] == label and r["arm"] == "plain"]
        return plain[0]["tokens_generated"] if plain else None

    out: list[dict[str, Any]] = []
    geo: dict[int, tuple[float | None, float | None]] = {}
    for n in sizes:
        at_n = [label for label in labels if lengths.get(label, s["max_tokens"]) == n]
        for workload, aim in (("qa", AIM_QA), ("ctxqa", AIM_CTXQA)):
            label = label_of(workload, n)
            if label in by_label:  # (the aims for qa and ctxqa are greedy figures)
                x, aim_x = by_label[label]["spec_x_plain"], None if sampled else aim
                out.append({"quantity": f"{workload} spec x plain", "length": n, "value": x,
                            "per_run": _per_run_ratio(doc, label), "tokens": tokens(label),
                            "aim": aim_x, "met": None if x is None or aim_x is None
                            else x >= aim_x})
        g = _geomean([by_label[label]["spec_x_plain"] for label in at_n
                      if by_label.get(label, {}).get("spec_x_plain")])
        g_run = _geomean([x for label in at_n if (x := _per_run_ratio(doc, label))])
        geo[n] = (g, g_run)
        aim_g = AIM_SAMPLED_GEOMEAN if sampled else None
        out.append({"quantity": f"geomean spec x plain over {len(at_n)} workload(s)"
                                + (f" (temperature {s['sampling']['temperature']:g})"
                                   if sampled else " (greedy)"),
                    "length": n, "value": g, "per_run": g_run, "tokens": None, "aim": aim_g,
                    "met": None if g is None or aim_g is None else g >= aim_g})
    for n in sizes[1:]:
        (g, g_run), (short, short_run) = geo[n], geo[sizes[0]]
        kept = round((g - 1) / (short - 1), 3) if g and short and short > 1 else None
        kept_run = round((g_run - 1) / (short_run - 1), 3) \
            if g_run and short_run and short_run > 1 else None
        out.append({"quantity": f"share of the {sizes[0]}-token geomean gain kept", "length": n,
                    "value": kept, "per_run": kept_run, "tokens": None, "aim": AIM_GAIN_KEPT,
                    "met": None if kept is None else kept >= AIM_GAIN_KEPT})
    for row in out:
        row["first_seen"] = applies
    return out


def aims_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    mode = "first seen" if rows[0]["first_seen"] else \
        "NOT first seen (the aims are first-seen figures: --first-seen)"
    lines = ["", f"drafting aims ({mode}; per run: the median of spec ÷ plain within a run; "
                 "tokens: plain's, EOS or the length):", "",
             "| quantity | length | spec × plain | per run | tokens | aim | met |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        share = r["quantity"].startswith("share")
        spec = ".0%" if share else ".2f"
        lines.append(f"| {r['quantity']} | {r['length']} | {fmt(r['value'], spec)} | "
                     f"{fmt(r['per_run'], spec)} | {fmt(r['tokens'], 'd')} | "
                     f"{fmt(r['aim'], '.0%' if share else '.2f')} | {yes_no(r['met'])} |")
    return "\n".join(lines) + "\n"


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
    if any("all_valid" in r for r in rows):
        return _structured_table(rows)
    kept = any("gain_kept" in r for r in rows)
    lines = ["", "| workload | spec × plain | plain × mlx_lm | llama best n-gram × its plain "
             "| ahead | ours exact |" + (" gain kept |" if kept else ""),
             "|---|---:|---:|---|---|---|" + ("---:|" if kept else "")]
    for r in rows:
        best, ahead = _llama_cells(r)
        lines.append(f"| {r['workload']} | {fmt(r['spec_x_plain'], '.2f')} | "
                     f"{fmt(r['plain_x_mlx_lm'], '.2f')} | {best} | {ahead} | "
                     f"{'yes' if r['exact'] else 'NO'} |"
                     + (f" {fmt(r.get('gain_kept'), '.0%')} |" if kept else ""))
    return "\n".join(lines) + "\n"


def _llama_cells(r: dict[str, Any]) -> tuple[str, str]:
    """A summary row's llama-server cells: its best n-gram arm against its plain, and whether
    we are ahead of it ("—" where llama-server did not run)."""
    best = "—" if r["llama_best_ngram"] is None else \
        f"{fmt(r['llama_best_x_plain'], '.2f')} ({r['llama_best_ngram'][6:]})"
    ahead = "—" if r["ahead_of_llama"] is None else ("yes" if r["ahead_of_llama"] else "no")
    return best, ahead


def _structured_table(rows: list[dict[str, Any]]) -> str:
    """bench --structured: the gain under the grammar, what the masks cost, validity."""
    lines = ["", "| workload | spec × plain | plain × free_plain | llama best n-gram × its "
             "plain | ahead | ours all valid | llama valid (worst arm) | free_plain valid "
             "| ours exact |", "|---|---:|---:|---|---|---|---:|---:|---|"]
    for r in rows:
        best, ahead = _llama_cells(r)
        lines.append(f"| {r['workload']} | {fmt(r['spec_x_plain'], '.2f')} | "
                     f"{fmt(r.get('plain_x_free_plain'), '.2f')} | {best} | {ahead} | "
                     f"{'yes' if r['all_valid'] else 'NO'} | "
                     f"{fmt(r.get('llama_valid_rate'), '.0%')} | "
                     f"{fmt(r.get('free_plain_valid_rate'), '.0%')} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"
