"""`python -m skulkp2p bench`: decode speed of each arm on named workloads, as JSON and a table.

Protocol (the anchors' one): greedy, `--max-tokens` generated tokens, median of `--runs` runs after
a warm-up, every arm on the same loaded model in the same process. Arms:

* `plain` (speculation "off") — the baseline every speedup is measured against;
* `spec` (speculation "auto") — whatever the engine decides on its own;
* explicit drafters from `--arms`, e.g. `lookup:4`, `mtp:1`, `draft:3`;
* peers: `mlx_lm` (mlx_lm.stream_generate on the same model object and prompt tokens) and
  `mlx_lm_draft` (mlx-lm's speculative generate with `--draft-model`).

Runs are interleaved (run r of every workload and arm before run r+1), so slow drift of the
machine spreads over all arms instead of favouring whichever ran first. Decode tok/s is measured
the same way for every arm: generated tokens after the first / time from first to last token.

`--widths` measures the verify-width cost table (the fastest of 7 forwards of w tokens after a
64-token prefill, relative to w=1) with the engine's `width_costs` module and saves it under
`<data-dir>/widths/`, where the loader reads it for the depth controller.

Nothing here imports mlx at module level: the CLI must arrange the BLAS preload (a re-exec)
before mlx loads.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skulkp2p.engine.generate import LoadedModel
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.bench")

DEFAULT_MAX_TOKENS = 200
DEFAULT_RUNS = 3
WARMUP_TOKENS = 8
MLX_LM_DRAFT_TOKENS = 2  # mlx-lm's own default num_draft_tokens

# --------------------------------------------------------------------------------------------
# Workloads: fixed texts, so that runs on different days and machines compare.

_ECHO_CODE = '''\
import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Order:
    order_id: str
    customer: str
    amount: float
    paid: bool


def load_orders(path: Path) -> list[Order]:
    orders = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            orders.append(Order(row["id"], row["customer"],
                                float(row["amount"]), row["paid"] == "yes"))
    return orders


def summarize(orders: list[Order]) -> dict[str, float]:
    total = 0.0
    unpaid = 0.0
    for order in orders:
        total += order.amount
        if not order.paid:
            unpaid += order.amount
    share = unpaid / total if total else 0.0
    return {"total": total, "unpaid": unpaid, "share": share}


def top_customers(orders: list[Order], n: int = 3) -> list[str]:
    by_customer: dict[str, float] = {}
    for order in orders:
        by_customer[order.customer] = by_customer.get(order.customer, 0.0) + order.amount
    ranked = sorted(by_customer, key=by_customer.get, reverse=True)
    return ranked[:n]
'''

_EDIT_CODE = '''\
def fetch_json(url, retries=3):
    last_error = None
    for attempt in range(retries):
        try:
            with urlopen(url) as response:
                return json.loads(response.read())
        except URLError as e:
            last_error = e
            time.sleep(2 ** attempt)
    raise last_error
'''

WORKLOADS: dict[str, list[dict[str, str]]] = {
    # Output echoes the prompt almost verbatim: where prompt lookup should shine.
    "echo": [{"role": "user", "content": (
        "Rename the variable `total` to `grand_total` everywhere in this Python module. "
        "Reply with the complete updated module in one code block and nothing else.\n\n"
        f"```python\n{_ECHO_CODE}```")}],
    # Agentic-style edit: a small function, instructions, part echo and part new code.
    "code-edit": [
        {"role": "system", "content": "You are a coding agent. Apply the requested change and "
                                      "reply with the full updated function only."},
        {"role": "user", "content": (
            "Task: add a `timeout` parameter (default 10.0 seconds) to `fetch_json` and pass it "
            "to `urlopen`; also add a docstring. Keep everything else unchanged.\n\n"
            f"File `net.py`:\n```python\n{_EDIT_CODE}```")}],
    # Novel answers: little to look up, so drafters should at least not lose.
    "qa": [{"role": "user", "content": (
        "Answer each question in two or three sentences.\n"
        "1. Why is the sky blue?\n"
        "2. What does a CPU cache do?\n"
        "3. Who wrote Pride and Prejudice, and when was it published?\n"
        "4. How do vaccines train the immune system?")}],
    "creative": [{"role": "user", "content": (
        "Write a short story of about 200 words about a lighthouse keeper who finds a message "
        "in a bottle written in her own handwriting.")}],
}

_WARMUP_MESSAGES = [{"role": "user", "content": "Repeat exactly: red green blue red green blue"}]


class BenchError(Exception):
    """Ends the bench with one line on stderr (the CLI turns it into its own error)."""


# --------------------------------------------------------------------------------------------
# Arms


PEERS = ("mlx_lm", "mlx_lm_draft")
DRAFTER_NAMES = ("lookup", "mtp", "draft")


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "engine" | "mlx_lm" | "mlx_lm_draft"
    speculation: Any = None  # the request's `speculation` field, for engine arms

    @property
    def peer(self) -> bool:
        return self.kind != "engine"


PLAIN = Arm("plain", "engine", "off")
SPEC = Arm("spec", "engine", "auto")


def parse_arm(text: str) -> Arm:
    """One arm name: plain, spec, mlx_lm, mlx_lm_draft, or DRAFTER:DEPTH (lookup:4)."""
    text = text.strip()
    if text == "plain":
        return PLAIN
    if text == "spec":
        return SPEC
    if text in PEERS:
        return Arm(text, text)
    m = re.fullmatch(r"([a-z_]+):(\d+)", text)
    if not m or m.group(1) not in DRAFTER_NAMES:
        raise ValueError(f"unknown arm {text!r} (expected plain, spec, mlx_lm, mlx_lm_draft or "
                         f"DRAFTER:DEPTH with DRAFTER one of {', '.join(DRAFTER_NAMES)})")
    depth = int(m.group(2))
    if not 1 <= depth <= 32:
        raise ValueError(f"arm {text!r}: depth must be 1..32")
    return Arm(text, "engine", {"drafter": m.group(1), "depth": depth})


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


def _one_line_error(self: argparse.ArgumentParser, message: str) -> None:
    # A bench is often scripted: a bad option gets one line, not the usage block.
    print(f"{self.prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The bench sub-command's options (kept here so cli.py stays small)."""
    from skulkp2p.models.cards import DEFAULT_MODEL

    p.error = types.MethodType(_one_line_error, p)  # type: ignore[method-assign]
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"card id or model folder (default {DEFAULT_MODEL})")
    p.add_argument("--engine", choices=("mlx", "served"), default="mlx",
                   help="mlx (default), or served: a llama-server card (placement.engine = "
                        "llama_server), plain vs its speculation, through our proxy vs direct")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: what this node would serve with (float32 on OpenBLAS)")
    p.add_argument("--max-tokens", type=_positive, default=DEFAULT_MAX_TOKENS,
                   help=f"generated tokens per run (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--runs", type=_positive, default=DEFAULT_RUNS,
                   help=f"measured runs per arm and workload; the median counts "
                        f"(default {DEFAULT_RUNS})")
    p.add_argument("--workloads", type=_workload_list, default=list(WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} (default all)")
    p.add_argument("--arms", type=_arm_list, default=[],
                   help="extra arms beside plain, spec and the peers: comma list of "
                        "DRAFTER:DEPTH (lookup:4, mtp:1, draft:3)")
    p.add_argument("--no-peers", action="store_true", help="skip the mlx-lm peer arms")
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
    p.add_argument("--link-delay-ms", type=float, default=0.0,
                   help="with --nodes: latency added to every hop by a proxy, standing in "
                        "for a LAN (default 0)")
    p.add_argument("--widths", action="store_true",
                   help="also measure the verify-width cost table (w = 1..16) and save it under "
                        "<data-dir>/widths/")


def select_arms(extra: Sequence[Arm], peers: bool, draft_model: str | None
                ) -> tuple[list[Arm], list[dict[str, str]]]:
    """plain first (the baseline), spec, the extra arms, then the peers; and the skipped peers
    with the reason (the JSON says why a peer is missing rather than leaving it out silently)."""
    wanted = [PLAIN, SPEC, *extra]
    if peers:
        wanted += [Arm("mlx_lm", "mlx_lm"), Arm("mlx_lm_draft", "mlx_lm_draft")]
    arms = list({a.name: a for a in wanted}.values())  # first mention wins, order kept
    skipped: list[dict[str, str]] = []
    if not draft_model and any(a.kind == "mlx_lm_draft" for a in arms):
        arms = [a for a in arms if a.kind != "mlx_lm_draft"]
        skipped.append({"arm": "mlx_lm_draft", "reason": "no --draft-model given"})
    for name in PEERS:
        if not peers and all(a.name != name for a in arms):
            skipped.append({"arm": name, "reason": "--no-peers"})
    return arms, skipped


# --------------------------------------------------------------------------------------------
# One generation per arm kind


@dataclass
class Run:
    tokens: list[int]
    ttft_s: float
    decode_s: float
    drafted: int | None = None
    accepted: int | None = None
    acceptance_per_position: list[float | None] | None = None
    text: str = ""
    ring: dict[str, Any] | None = None  # --nodes: where the time went (bench_ring.py)

    @property
    def tok_s(self) -> float | None:
        if len(self.tokens) < 2 or self.decode_s <= 0:
            return None
        return (len(self.tokens) - 1) / self.decode_s

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tok_s": _round(self.tok_s, 2), "ttft_s": round(self.ttft_s, 4),
                               "decode_s": round(self.decode_s, 4), "tokens": len(self.tokens)}
        if self.drafted is not None:
            out.update(drafted=self.drafted, accepted=self.accepted)
        if self.ring is not None:
            out["ring"] = self.ring
        return out


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


class SkipArm(Exception):
    """This arm cannot run on this model (the reason goes into the JSON)."""


def _request(messages: list[dict[str, str]], max_tokens: int, speculation: Any):
    from skulkp2p.engine.request import parse_request

    return parse_request({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                          "speculation": speculation})


def run_engine(loaded: LoadedModel, messages: list[dict[str, str]], max_tokens: int,
               speculation: Any) -> Run:
    from skulkp2p.engine.generate import stream
    from skulkp2p.engine.request import RequestError

    req = _request(messages, max_tokens, speculation)
    result: dict[str, Any] = {}
    t_first = t_last = None
    t0 = time.perf_counter()
    try:
        for chunk in stream(loaded, req, result):
            if chunk.tokens:  # timed at receipt, as a client would see it
                t_last = time.perf_counter()
                t_first = t_first or t_last
    except RequestError as e:
        raise SkipArm(e.message) from None
    end = t_last or time.perf_counter()
    spec = result.get("speculation") or {}
    return Run(tokens=list(result["tokens"]), ttft_s=(t_first or end) - t0,
               decode_s=end - (t_first or end), drafted=spec.get("drafted"),
               accepted=spec.get("accepted"),
               acceptance_per_position=spec.get("acceptance_per_position"),
               text=result.get("text", ""))


def run_mlx_lm(loaded: LoadedModel, messages: list[dict[str, str]], max_tokens: int,
               draft: LoadedModel | None = None, draft_tokens: int = MLX_LM_DRAFT_TOKENS) -> Run:
    """mlx-lm's stream_generate on the same model object and the same prompt tokens."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    from skulkp2p.engine.generate import prompt_tokens

    prompt = prompt_tokens(loaded, _request(messages, max_tokens, "off"))
    eos = set(loaded.tokenizer.eos_token_ids)
    kwargs: dict[str, Any] = {"prefill_step_size": int(loaded.runtime.get("prefill_step", 2048))}
    if draft is not None:
        kwargs.update(draft_model=draft.model, num_draft_tokens=draft_tokens)
    tokens: list[int] = []
    from_draft: list[bool] = []
    t_first = t_last = None
    t0 = time.perf_counter()
    try:
        for resp in stream_generate(loaded.model, loaded.tokenizer, mx.array(prompt),
                                    max_tokens=max_tokens, **kwargs):
            if resp.finish_reason == "stop" and resp.token in eos:
                break  # mlx-lm reports the EOS token in its last response; it is not output
            t_last = time.perf_counter()
            t_first = t_first or t_last
            tokens.append(int(resp.token))
            from_draft.append(bool(resp.from_draft))
    except ValueError as e:  # e.g. "Speculative decoding requires a trimmable prompt cache"
        raise SkipArm(f"mlx-lm: {e}") from None
    end = t_last or time.perf_counter()
    run = Run(tokens=tokens, ttft_s=(t_first or end) - t0, decode_s=end - (t_first or end),
              text=loaded.tokenizer.decode(tokens))
    if draft is not None:
        run.drafted, run.accepted, run.acceptance_per_position = _mlx_lm_acceptance(
            from_draft, max_tokens, draft_tokens)
    return run


def _mlx_lm_acceptance(from_draft: list[bool], max_tokens: int, k: int
                       ) -> tuple[int, int, list[float | None]]:
    """Drafted/accepted counts of mlx-lm's speculative loop, rebuilt from its from_draft flags:
    each round drafts min(k, tokens left), yields the accepted drafts, then one verifier token."""
    drafted_at = [0] * k
    accepted_at = [0] * k
    produced = 0
    i = 0
    while i < len(from_draft):
        n_draft = min(k, max_tokens - produced)
        n_acc = 0
        while i < len(from_draft) and from_draft[i]:
            n_acc += 1
            i += 1
        i += 1  # the verifier's own token ends the round
        produced += n_acc + 1
        for j in range(n_draft):
            drafted_at[j] += 1
            accepted_at[j] += int(j < n_acc)
    per_pos = [round(a / d, 4) if d else None for a, d in zip(accepted_at, drafted_at,
                                                              strict=True)]
    return sum(drafted_at), sum(accepted_at), per_pos


# --------------------------------------------------------------------------------------------
# Report


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


def _yes_no(x: bool | None) -> str:
    return "—" if x is None else ("yes" if x else "NO")


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown_tables(doc: dict[str, Any]) -> str:
    m, e, s = doc["model"], doc["engine"], doc["settings"]
    lines = [f"bench: {m['id']} {m['dtype']} (blas {e.get('blas')}), {s['max_tokens']} tokens, "
             f"median of {s['runs']} run(s)", "",
             "| workload | arm | tok/s | × plain | TTFT s | drafted | accepted | acceptance "
             "| per position | identical |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["results"]:
        per_pos = r.get("acceptance_per_position")
        pp = " ".join(_fmt(a, ".2f") for a in per_pos[:8]) if per_pos else "—"
        lines.append(
            f"| {r['workload']} | {r['arm']} | {_fmt(r['tok_s'], '.2f')} | "
            f"{_fmt(r['speedup_vs_plain'], '.2f')} | {_fmt(r['ttft_s'], '.3f')} | "
            f"{_fmt(r['drafted'], 'd')} | {_fmt(r['accepted'], 'd')} | "
            f"{_fmt(r['acceptance'], '.0%')} | {pp} | {_yes_no(r['identical_to_plain'])} |")
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
        from skulkp2p.bench_ring import ring_table

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
# The command


@dataclass
class _Cell:
    runs: list[Run] = field(default_factory=list)
    skip: str | None = None


def _execute(arm: Arm, loaded: LoadedModel, draft: LoadedModel | None, messages, max_tokens: int,
             draft_tokens: int) -> Run:
    if arm.kind == "engine":
        return run_engine(loaded, messages, max_tokens, arm.speculation)
    if arm.kind == "mlx_lm":
        return run_mlx_lm(loaded, messages, max_tokens)
    return run_mlx_lm(loaded, messages, max_tokens, draft, draft_tokens)


def _results(cells: dict[tuple[str, str], _Cell], arms: list[Arm], workloads: list[str]
             ) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[str]]:
    """Per arm and workload: medians, speedup, acceptance, exactness; the cells that were
    skipped; and the arm/workload pairs whose greedy tokens differ from plain's."""
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    mismatched: list[str] = []
    for wl in workloads:
        plain_runs = cells[(wl, "plain")].runs
        # None when plain could not run this workload (e.g. the prompt exceeds the context)
        reference = plain_runs[0].tokens if plain_runs else None
        base = None
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
            first = cell.runs[0]
            identical = None if reference is None else all(x.tokens == reference
                                                           for x in cell.runs)
            if identical is False:
                mismatched.append(f"{arm.name}/{wl}")
            results.append({
                "arm": arm.name, "workload": wl, "peer": arm.peer,
                "tok_s": _round(med, 2),
                "ttft_s": round(statistics.median(x.ttft_s for x in cell.runs), 4),
                "runs": [x.summary() for x in cell.runs],
                "speedup_vs_plain": round(med / base, 3) if med and base else None,
                # per generation (greedy: every run drafts the same)
                "drafted": first.drafted, "accepted": first.accepted,
                "acceptance": round(first.accepted / first.drafted, 4)
                if first.drafted else None,
                "acceptance_per_position": first.acceptance_per_position,
                "tokens_generated": len(first.tokens),
                "identical_to_plain": identical,
            })
            if all(x.ring for x in cell.runs):
                from skulkp2p.bench_ring import ring_summary

                results[-1]["ring"] = ring_summary([x.ring for x in cell.runs])
    return results, skipped, mismatched


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_document(doc: dict[str, Any], table: str, json_out: str | None) -> None:
    """The JSON to --json (atomically) and the table to stdout; without --json, the JSON to
    stdout and the table to stderr."""
    text = json.dumps(doc, indent=2) + "\n"
    if json_out:
        _write_atomic(Path(json_out), text)
        sys.stdout.write(table)
    else:
        sys.stdout.write(text)
        sys.stderr.write(table)
    sys.stdout.flush()


def run_bench(args: argparse.Namespace, store: ModelStore) -> int:
    """The whole command after the CLI has arranged the BLAS; returns the exit status."""
    from skulkp2p.served.bench import dispatch

    status = dispatch(args, store)  # --engine served; a served card without it is refused
    if status is not None:
        return status
    if args.plot:
        require_matplotlib()  # before minutes of measuring, not after
    from skulkp2p.engine import blas
    from skulkp2p.engine.loader import open_model, serving_dtype

    engine = blas.fast_path_report()
    load_before = _loadavg()  # other work on a 2-core node skews timings: record it
    dtype = args.dtype or serving_dtype()
    nodes = getattr(args, "nodes", 1)
    # mlx-lm's peers need the whole model in one piece: not on a ring.
    arms, skipped = select_arms(args.arms, not args.no_peers and nodes == 1, args.draft_model)
    for sk in skipped if nodes > 1 and not args.no_peers else ():
        sk["reason"] = "mlx-lm needs the whole model in one process, not a ring"
    if nodes == 1:
        return _run_loaded(args, store, engine, load_before, arms, skipped,
                           open_model(store, args.model, dtype), None)
    if args.widths:  # a stage's slice would overwrite the whole model's cost table
        raise BenchError("--widths measures the whole model in one process: run it without "
                         "--nodes")
    from skulkp2p.bench_ring import RingBench, RingBenchError

    ring = RingBench(store, args.model, dtype, nodes, getattr(args, "link_delay_ms", 0.0))
    try:  # the stage processes end with the bench, however it ends
        try:
            loaded = ring.open()
        except RingBenchError as e:
            raise BenchError(str(e)) from None
        return _run_loaded(args, store, engine, load_before, arms, skipped, loaded, ring)
    finally:
        ring.close()


def _run_loaded(args: argparse.Namespace, store: ModelStore, engine: dict[str, Any],
                load_before: list[float] | None, arms: list[Arm], skipped: list[dict[str, str]],
                loaded: LoadedModel, ring: Any) -> int:
    draft = _open_draft(store, args.draft_model, loaded) if args.draft_model else None

    # Warm-up: each arm once on a short prompt (kernels, allocator); also finds arms that
    # cannot run on this model at all.
    for arm in list(arms):
        try:
            _execute(arm, loaded, draft, _WARMUP_MESSAGES, min(WARMUP_TOKENS, args.max_tokens),
                     args.draft_tokens)
        except SkipArm as e:
            log.warning("arm %s skipped: %s", arm.name, e)
            skipped.append({"arm": arm.name, "reason": str(e)})
            arms.remove(arm)
    if PLAIN not in arms:
        raise BenchError(f"the plain arm cannot run: {skipped[-1]['reason']}")
    if ring is not None:
        ring.take_run(None)  # the warm-up's traversals do not count

    workloads = list(args.workloads)
    cells = {(wl, a.name): _Cell() for wl in workloads for a in arms}
    settings = {
        "max_tokens": args.max_tokens, "runs": args.runs, "statistic": "median",
        "warmup": f"each arm once, {min(WARMUP_TOKENS, args.max_tokens)} tokens",
        "order": "interleaved: run r of every workload and arm before run r+1",
        "greedy": True, "chat_template": True,
        "workloads": workloads, "arms": [a.name for a in arms],
        "draft_model": args.draft_model, "draft_tokens": args.draft_tokens,
        "engine_draft_model": getattr(getattr(loaded, "draft", None), "id", None),
        # what the engine's depth controller read from <data-dir>/widths (spec arm)
        "width_costs_used": _str_keys(getattr(loaded, "width_costs", None)),
        "prompt_tokens": {wl: _prompt_len(loaded, wl) for wl in workloads},
    }
    if ring is not None:
        settings["ring"] = ring.settings  # filled in as the ring runs: compute vs link seconds

    def document(complete: bool) -> tuple[dict[str, Any], list[str]]:
        results, cell_skips, mismatched = _results(cells, arms, workloads)
        plain_text = {wl: cells[(wl, "plain")].runs[0].text[:400]
                      for wl in workloads if cells[(wl, "plain")].runs}
        return {
            "complete": complete,
            "machine": {**machine_info(), "loadavg_before": load_before,
                        "loadavg_after": _loadavg()},
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
                    run = _execute(arm, loaded, draft, WORKLOADS[wl], args.max_tokens,
                                   args.draft_tokens)
                except SkipArm as e:
                    cell.skip = str(e)
                    continue
                if ring is not None:
                    run.ring = ring.take_run(run.ttft_s + run.decode_s)
                cell.runs.append(run)
                log.info("run %d/%d %-10s %-14s %s tok/s, ttft %.2fs%s", r + 1, args.runs, wl,
                         arm.name, _fmt(run.tok_s, ".2f"), run.ttft_s,
                         "" if run.drafted is None else f", accepted {run.accepted}/{run.drafted}")
                if args.json_out:  # a bench killed by a time limit keeps what it measured
                    _write_atomic(Path(args.json_out),
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

        load_widths = _loadavg()
        seconds = measure_width_seconds(loaded, _ECHO_CODE)
        path = save_width_costs(loaded.id, loaded.dtype, store.data_dir, seconds,
                                {"blas": engine.get("blas"), "reps": WIDTH_REPS,
                                 "statistic": "min", "machine": doc["machine"],
                                 "loadavg_before": load_widths, "loadavg_after": _loadavg()})
        doc["widths"] = {
            "prefill_tokens": WIDTH_PREFILL, "reps": WIDTH_REPS, "statistic": "min",
            "file": str(path), "loadavg_before": load_widths,
            "seconds": {str(w): round(s, 6) for w, s in seconds.items()},
            "relative": {str(w): c for w, c in relative_costs(seconds).items()},
        }

    write_document(doc, markdown_tables(doc), args.json_out)
    if args.plot:
        plot_speedups(doc, Path(args.plot))
    if mismatched:
        own = [m for m in mismatched if not m.split("/")[0].startswith("mlx_lm")]
        log.warning("greedy tokens differ from plain: %s", ", ".join(mismatched))
        if own:  # our arms must be exact; a peer's mismatch is recorded, not ours to fail on
            raise BenchError(f"greedy output differs from plain for {', '.join(own)}")
    return 0


def _open_draft(store: ModelStore, spec: str, loaded: LoadedModel) -> LoadedModel:
    """Load --draft-model in the target's dtype. It drafts for mlx-lm's speculative peer and,
    unless the card already names one, becomes the engine's draft model too (draft:k arms and
    spec), as a card's speculation.draft_model would."""
    from skulkp2p.engine.loader import open_model
    from skulkp2p.engine.request import RequestError

    draft = open_model(store, spec, loaded.dtype)
    if hasattr(loaded, "draft") and loaded.draft is None:
        try:
            from skulkp2p.engine.draft_model import check_compatible
            from skulkp2p.engine.trunk import Trunk

            vocab = [int(Trunk(m.model).embed_tokens.weight.shape[0]) for m in (loaded, draft)]
            check_compatible(loaded.tokenizer, draft.tokenizer, *vocab, draft_id=draft.id)
        except RequestError as e:
            raise BenchError(str(e)) from None
        except ImportError:  # an engine without draft-model support: the peer still runs
            return draft
        loaded.draft = draft
    return draft


def _str_keys(d: dict[int, float] | None) -> dict[str, float] | None:
    return None if d is None else {str(k): v for k, v in sorted(d.items())}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _prompt_len(loaded: LoadedModel, workload: str) -> int:
    from skulkp2p.engine.generate import prompt_tokens

    return len(prompt_tokens(loaded, _request(WORKLOADS[workload], 1, "off")))
