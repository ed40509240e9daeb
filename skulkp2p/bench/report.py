"""The bench's output: the machine it ran on, the JSON document and its tables, the plot.

Shared by the MLX bench (`cli.py`), its ring (`ring.py`) and the served bench (`served.py`);
the number formatting of every table is here, so they all print missing values the same way.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from skulkp2p import atomic_file
from skulkp2p.bench.bench_error import BenchError

# --------------------------------------------------------------------------------------------
# Values


def round_or_none(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


def yes_no(x: bool | None) -> str:
    return "—" if x is None else ("yes" if x else "NO")


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work on a 2-core node skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "cpu": cpu, "cores": cores,
            "python": platform.python_version(), "mlx": version("mlx"),
            "mlx_lm": version("mlx-lm")}


# --------------------------------------------------------------------------------------------
# The document


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path`, whole or not at all (an interrupted run leaves the old file)."""
    atomic_file.write_atomic(path, (text.encode("utf-8"),))


def write_document(doc: dict[str, Any], table: str, json_out: str | None) -> None:
    """The JSON to --json (atomically) and the table to stdout; without --json, the JSON to
    stdout and the table to stderr."""
    text = json.dumps(doc, indent=2) + "\n"
    if json_out:
        write_atomic(Path(json_out), text)
        sys.stdout.write(table)
    else:
        sys.stdout.write(text)
        sys.stderr.write(table)
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# Tables and plot


def _threads(engine: dict[str, Any]) -> str:
    """The OpenBLAS threads the arms ran with, for the table's title."""
    t = engine.get("blas_threads")
    if not t:
        return ""
    ours = (f"{t['mode']} {t['narrow']}-{t['wide']}" if t["mode"] == "auto"
            else f"fixed {t['wide']}")
    used = ", ".join(f"{n}: {c}" for n, c in t["forwards_per_count"].items())
    return (f"; threads: ours {ours} (forwards per count {used}; {t['trips']} trips), "
            f"mlx-lm {t['peer_arms']}")


def markdown_tables(doc: dict[str, Any]) -> str:
    m, e, s = doc["model"], doc["engine"], doc["settings"]
    lines = [f"bench: {m['id']} {m['dtype']} (blas {e.get('blas')}{_threads(e)}), "
             f"{s['max_tokens']} tokens, median of {s['runs']} run(s)", "",
             "| workload | arm | tok/s | × plain | TTFT s | drafted | accepted | acceptance "
             "| per position | identical |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["results"]:
        per_pos = r.get("acceptance_per_position")
        pp = " ".join(fmt(a, ".2f") for a in per_pos[:8]) if per_pos else "—"
        lines.append(
            f"| {r['workload']} | {r['arm']} | {fmt(r['tok_s'], '.2f')} | "
            f"{fmt(r['speedup_vs_plain'], '.2f')} | {fmt(r['ttft_s'], '.3f')} | "
            f"{fmt(r['drafted'], 'd')} | {fmt(r['accepted'], 'd')} | "
            f"{fmt(r['acceptance'], '.0%')} | {pp} | {yes_no(r['identical_to_plain'])} |")
    if doc.get("skipped"):
        lines.append("")
    for sk in doc.get("skipped", []):
        where = f" on {sk['workload']}" if sk.get("workload") else ""
        lines.append(f"skipped {sk['arm']}{where}: {sk['reason']}")
    if "widths" in doc:
        w = doc["widths"]
        lines += ["", f"verify width cost ({w['prefill_tokens']}-token prefill, fastest of "
                      f"{w['reps']}):", "", "| w | ms | × w=1 |", "|---:|---:|---:|"]
        for k, sec in w["seconds"].items():
            lines.append(f"| {k} | {sec * 1000:.1f} | {w['relative'][k]:.2f} |")
        lines.append(f"\nsaved to {w['file']}")
    text = "\n".join(lines) + "\n"
    if doc["settings"].get("ring"):
        text += ring_table(doc)
    return text


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed "
                         "(pip install matplotlib)") from None


def plot_speedups(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server node
    import matplotlib.pyplot as plt

    workloads = doc["settings"]["workloads"]
    arms = [a for a in dict.fromkeys(r["arm"] for r in doc["results"]) if a != "plain"]
    width = 0.8 / max(1, len(arms))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4))
    for i, arm in enumerate(arms):
        vals = []
        for wl in workloads:
            hit = [r["speedup_vs_plain"] for r in doc["results"]
                   if r["arm"] == arm and r["workload"] == wl]
            vals.append(hit[0] if hit and hit[0] is not None else 0.0)
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(workloads))]
        ax.bar(xs, vals, width, label=arm)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("decode speedup vs plain")
    m = doc["model"]
    ax.set_title(f"{m['id']} {m['dtype']} ({doc['engine'].get('blas')}), "
                 f"{doc['settings']['max_tokens']} tokens")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# bench --nodes: where the time of a ring went (ring.py measures it)


def ring_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and workload: the median run's split of the time (medians of each field), and
    link time per traversal."""
    keys = [k for k in runs[0] if all(k in r for r in runs)
            and all(isinstance(r[k], int | float) for r in runs)]
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}
    if out.get("traversals"):
        out["link_ms_per_traversal"] = round(out["link_s"] * 1e3 / out["traversals"], 3)
    return out


def _measured_link(ring: dict[str, Any]) -> str:
    rtt = ring.get("link_round_trip_ms")
    return "" if rtt is None else f" (a round trip through the proxy measured {rtt:g} ms)"


def ring_table(doc: dict[str, Any]) -> str:
    ring = doc["settings"].get("ring")
    if not ring:
        return ""
    if ring.get("parallel") == "tensor":
        return tensor_table(doc)
    lines = [f"\nring: {ring['nodes']} stages {ring.get('layers')}, "
             f"{ring['link_delay_ms']:g} ms per hop{_measured_link(ring)} x "
             f"{ring['hops_per_traversal']} hops per traversal; seconds per run (median):", "",
             "| workload | arm | total s | last stage s | other stages s | link s | loop s "
             "| traversals | link ms / traversal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["results"]:
        x = r.get("ring")
        if not x:
            continue
        lines.append(
            f"| {r['workload']} | {r['arm']} | {x.get('total_s', 0):.2f} | "
            f"{x['last_stage_compute_s']:.2f} | {x['other_stages_compute_s']:.2f} | "
            f"{x['link_s']:.2f} | {x.get('loop_s', 0):.2f} | {x['traversals']:.0f} | "
            f"{x.get('link_ms_per_traversal', 0):.2f} |")
    return "\n".join(lines) + "\n"


def tensor_table(doc: dict[str, Any]) -> str:
    """bench --nodes N --parallel tensor: where the time of the group went (tensor.py)."""
    g = doc["settings"]["ring"]
    lines = [f"\ntensor-parallel group: {g['nodes']} ranks, {g['link_delay_ms']:g} ms per hop"
             f"{_measured_link(g)}, "
             f"one all-sum of one row {g.get('allsum_us_one_row', 0):g} us alone, "
             f"{g.get('collectives_per_call')} collectives per call, a rank's slice alone "
             f"{g.get('rank_compute_ms_one_row', 0):g} ms a call + "
             f"{g.get('rank_compute_ms_per_more_row', 0):g} ms a row more; seconds per run "
             "(median; collectives = ranks less their compute alone):",
             "", "| workload | arm | total s | head s | ranks s | of which collectives (est.) s "
             "| pipe s | loop s | calls | collectives ms / call |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["results"]:
        x = r.get("ring")
        if not x:
            continue
        lines.append(
            f"| {r['workload']} | {r['arm']} | {x.get('total_s', 0):.2f} | "
            f"{x['head_compute_s']:.2f} | {x['ranks_s']:.2f} | {x['collectives_est_s']:.2f} | "
            f"{x['pipe_s']:.2f} | {x.get('loop_s', 0):.2f} | {x['traversals']:.0f} | "
            f"{x.get('link_ms_per_traversal', 0):.2f} |")
    ranks = range(int(g.get("nodes") or 0))
    if any("rank0_busy_wall_s" in (r.get("ring") or {}) for r in doc["results"]):
        lines += ["", "each rank's seconds per run (median), wall / CPU (its whole process: a rank "
                  "that polls while it waits shows CPU near wall), in calls and waiting for the "
                  "next command:", "",
                  "| workload | arm | " + " | ".join(f"rank {k} in calls | rank {k} between calls"
                                                    for k in ranks) + " |",
                  "|---|---|" + "---:|---:|" * len(ranks)]
        for r in doc["results"]:
            x = r.get("ring") or {}
            if "rank0_busy_wall_s" not in x:
                continue
            cells = [f"{x.get(f'rank{k}_{w}_wall_s', 0):.2f} / {x.get(f'rank{k}_{w}_cpu_s', 0):.2f}"
                     for k in ranks for w in ("busy", "idle")]
            lines.append(f"| {r['workload']} | {r['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
