"""Measure the served engine by hand: our proxy vs llama-server direct (TTFT, decode tok/s), and
llama.cpp's speculation vs plain on an echo and a qa prompt.

    SKULKP2P_LLAMA_SERVER_BIN=... python tools/served_bench.py --gguf PATH [--runs 5]

Client-side timings over streamed chat completions (greedy, 128 tokens). Arms alternate run by
run so that noise on a shared machine hits them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skulkp2p.models.cards import load_card  # noqa: E402
from skulkp2p.served.binary import find_binary  # noqa: E402
from skulkp2p.served.child import ServedChild, free_port  # noqa: E402
from skulkp2p.served.model import server_args  # noqa: E402

PROMPTS = {
    "echo": "Rewrite this Python function with type hints, changing nothing else:\n\n"
            "def add_item(cart, name, price, qty):\n    total = price * qty\n"
            "    cart.append({'name': name, 'price': price, 'qty': qty, 'total': total})\n"
            "    return cart\n",
    "qa": "Explain in a few sentences why the sky is blue.",
}


def stream(port: int, content: str, max_tokens: int) -> tuple[float, float, int, dict]:
    """(ttft_s, decode tok/s after the first token, completion tokens, speculation or {})"""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    t_first = t_last = None
    n = 0
    spec: dict = {}
    for line in r:
        if line.strip() == b"data: [DONE]":
            break  # the connection stays open (keep-alive)
        if not line.startswith(b"data: "):
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            n = ev["usage"]["completion_tokens"]
        if ev.get("speculation"):
            spec = ev["speculation"]
        if ev.get("timings", {}).get("draft_n") is not None:
            spec = {"drafted": ev["timings"]["draft_n"],
                    "accepted": ev["timings"]["draft_n_accepted"]}
        for ch in ev.get("choices") or []:
            if (ch.get("delta") or {}).get("content"):
                t_last = time.perf_counter()
                t_first = t_first or t_last
    conn.close()
    return t_first - t0, (n - 1) / (t_last - t_first) if n > 1 else 0.0, n, spec


def agent(card_dir: Path, card_id: str, env: dict) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(Path(tempfile.mkdtemp()) / "join.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "skulkp2p", "join", "--model", card_id,
                             "--http-port", str(port)], cwd=ROOT, stdout=log, stderr=log,
                            env={**os.environ, **env, "SKULKP2P_CARDS_DIR": str(card_dir)})
    deadline = time.monotonic() + 180
    while "ready: model" not in Path(log.name).read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(Path(log.name).read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    return proc, port


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    binary = find_binary()
    card_dir = Path(tempfile.mkdtemp())
    gguf = Path(args.gguf).resolve()
    (card_dir / "b.toml").write_text(f"""id = "bench-gguf"
family = "llama"
format = "gguf"
layers = 30
hidden_size = 576
kv_heads = 3
context_length = 8192
size_bytes = 90_000_000
[source]
kind = "local"
path = "{gguf}"
[placement]
engine = "llama_server"
gguf_file = "{gguf}"
served_spec_type = "ngram_simple"
served_spec_n_max = 8
served_context = 2048
""")
    card = load_card(card_dir / "b.toml")
    plain = ServedChild("plain", binary, server_args(None, card, gguf, no_spec=True))
    spec = ServedChild("spec", binary, server_args(None, card, gguf, no_spec=False))
    procs = []
    try:
        plain.start()
        spec.start()
        proc, port = agent(card_dir, "bench-gguf", {"SKULKP2P_LLAMA_SERVER_FORCE_NO_SPEC": "1"})
        procs.append(proc)
        arms = {"direct-plain": plain.port, "proxy-plain": port, "direct-ngram": spec.port}
        res: dict[tuple[str, str], list] = {}
        for i in range(args.runs):
            for name, content in PROMPTS.items():
                # a fresh prefix per run: llama.cpp's prompt cache must not serve a repeat
                text = f"(run {i}) " + content
                for arm, p in arms.items():
                    res.setdefault((arm, name), []).append(stream(p, text, args.max_tokens))
        for (arm, name), rows in sorted(res.items()):
            ttft = statistics.median(r[0] for r in rows) * 1000
            tps = statistics.median(r[1] for r in rows)
            n = statistics.median(r[2] for r in rows)
            sp = rows[-1][3]
            print(f"{arm:13s} {name:5s} ttft {ttft:7.1f} ms  decode {tps:6.1f} tok/s  "
                  f"tokens {n:.0f}  {sp}")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        plain.stop()
        spec.stop()


if __name__ == "__main__":
    main()
