"""Start a small cluster on loopback, give it some work, and look at its dashboard.

    python -m tests.helpers.dashboard_demo --model smollm2-135m --nodes 2 --ring --seconds 150 \\
        --screenshot docs/dashboard.png

Starts N `join` processes on 127.0.0.1 (n0 founds the cluster, the others join it), optionally
places the model on a ring of all of them, sends a mix of requests (echoed text with explicit
lookup, and "auto" speculation on questions and code) to random nodes for --seconds, then takes
a screenshot of n0's page with headless Chromium (`--screenshot`). Without --screenshot it
prints the dashboard's address and keeps the cluster up until Ctrl-C. Every process it started
is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import ROOT

WORK = [
    ("Repeat exactly, word for word: The cluster places each model on the smallest ring of "
     "nodes that can hold it, and any node answers any request by forwarding it to the node "
     "that serves the model.", {"drafter": "lookup", "depth": 4}),
    ("What is the capital of France, and why is it famous?", "auto"),
    ("Rename the variable x to total in this code:\ndef add(x, y):\n    x = x + y\n    "
     "return x\n", "auto"),
    ("Copy this list exactly: apples, pears, plums, apples, pears, plums, apples, pears.",
     "auto"),
    ("Write one sentence about speculative decoding.", "off"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120
         ) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, None
    except OSError:
        return 0, None
    finally:
        conn.close()


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ring", action="store_true", help="place the model on a ring of all nodes")
    ap.add_argument("--seconds", type=float, default=120, help="how long to send requests")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--screenshot", default=None, help="PNG file to write (needs chromium)")
    ap.add_argument("--size", default="1400,1250", help="browser window WIDTH,HEIGHT")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="skulkp2p-demo-"))
    env = {**os.environ, "SKULKP2P_SECRET": "demo-secret", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    nodes: list[tuple[str, int, int]] = []  # (name, control port, http port)
    try:
        for i in range(args.nodes):
            name, port, http_port = f"n{i}", free_port(), free_port()
            cmd = [sys.executable, "-m", "skulkp2p", "join", "--model", args.model,
                   "--engine", "mlx",
                   "--name", name, "--port", str(port), "--http-port", str(http_port),
                   # a demo starts fresh: no place requests restored from an earlier demo's run
                   "--no-cluster-state"]
            if args.data_dir:
                cmd += ["--data-dir", args.data_dir]
            if nodes:
                cmd += ["--peer", f"127.0.0.1:{nodes[0][1]}"]
            with open(tmp / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
            nodes.append((name, port, http_port))
        print(f"started {args.nodes} nodes (logs in {tmp})", flush=True)
        wait(lambda: all(call(h, "GET", "/health", timeout=5)[0] == 200 for _, _, h in nodes),
             600, "every node to be healthy")
        http0 = nodes[0][2]
        model = call(http0, "GET", "/v1/models")[1]["data"][0]["id"]
        if args.ring and args.nodes > 1:
            status, out = call(http0, "POST", "/v1/cluster/place",
                               {"model": model, "nodes": [n for n, _, _ in nodes]})
            if status != 200:
                raise SystemExit(f"placing {model} on a ring failed: {status} {out}")
            print(f"placed {model} on the ring {' -> '.join(out['placement']['ring'])}",
                  flush=True)
        rng = random.Random(0)
        deadline = time.monotonic() + args.seconds
        sent = 0
        while time.monotonic() < deadline and sent < 10_000:
            prompt, spec = WORK[sent % len(WORK)]
            port = rng.choice(nodes)[2]
            status, out = call(port, "POST", "/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens, "speculation": spec})
            sent += 1
            if status != 200:
                time.sleep(1)  # a ring still loading: 503, retried with the next request
                continue
            s = (out or {}).get("speculation") or {}
            print(f"request {sent}: {out['usage']['completion_tokens']} tokens, "
                  f"{out['timing']['decode_tok_s']} tok/s, drafter {s.get('drafter')}, "
                  f"acceptance {s.get('acceptance')}", flush=True)
        url = f"http://127.0.0.1:{http0}/"
        if not args.screenshot:
            print(f"dashboard: {url} (Ctrl-C stops the cluster)", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
            return 0
        chromium = next((shutil.which(b) for b in ("chromium", "chromium-browser",
                                                   "google-chrome") if shutil.which(b)), None)
        if chromium is None:
            raise SystemExit("no chromium found: apt-get install chromium")
        out_file = Path(args.screenshot).resolve()
        out_file.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--user-data-dir={tmp / 'chromium'}",
                        f"--window-size={args.size}", "--virtual-time-budget=5000",
                        f"--screenshot={out_file}", url],
                       check=True, timeout=120, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        print(f"screenshot of {url}: {out_file} ({out_file.stat().st_size} bytes)")
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        shutil.rmtree(tmp / "chromium", ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
