"""How often greedy text on a tensor-parallel group differs from one node's, on the bench's
workloads.

On a group each layer's output is a sum of the members' partial products, added in another
order than one node's single matmul, so the logits differ in the last bits and a near-tie can
flip a greedy token. This runs every bench workload greedy (speculation off) on one node and on
a group of N rank processes on loopback (`engine/parallel/tensor/rank.py`, as a cluster runs them) and
reports, per workload, whether the tokens are the same and where they first part.

    python tools/tensor_divergence.py [--model smollm2-135m] [--nodes 2] [--max-tokens 200]
        [--data-dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def greedy(loaded, messages, max_tokens: int) -> list[int]:
    from skulkp2p.engine.decode.generate import stream
    from skulkp2p.engine.request import parse_request

    req = parse_request({"messages": messages, "max_tokens": max_tokens, "speculation": "off"})
    g = stream(loaded, req)
    while True:
        try:
            next(g)
        except StopIteration as e:
            return list(e.value.tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)

    from skulkp2p.engine.cpu import blas

    blas.ensure_fast_blas()
    from skulkp2p.bench.workloads import WORKLOADS
    from skulkp2p.engine.model.loader import open_model, serving_dtype
    from skulkp2p.engine.parallel.tensor.group import RankProcess, TensorForward
    from skulkp2p.models.store import ModelStore
    from skulkp2p.netfault import free_port

    store = ModelStore(Path(args.data_dir)) if args.data_dir else ModelStore()
    path = store.pull(args.model)
    dtype = serving_dtype()
    single = open_model(store, args.model, dtype)
    addrs = [f"127.0.0.1:{free_port('127.0.0.1')}" for _ in range(args.nodes)]
    ranks = [RankProcess(path, r, addrs, dtype) for r in range(args.nodes)]
    rows = []
    try:
        for r in ranks:
            r.wait_ready()
        head = open_model(store, args.model, dtype, head_only=True)
        head.make_forward = lambda req, hidden, interrupt: TensorForward(
            head.model, ranks[0], hidden=hidden, interrupt=interrupt)
        for name, messages in WORKLOADS.items():
            one = greedy(single, messages, args.max_tokens)
            group = greedy(head, messages, args.max_tokens)
            first = next((i for i, (a, b) in enumerate(zip(one, group, strict=False))
                          if a != b), None if len(one) == len(group) else min(len(one),
                                                                               len(group)))
            rows.append({"workload": name, "tokens": len(one), "identical": one == group,
                         "first_difference_at": first})
            print(f"{name:10s} {len(one):4d} tokens  identical: {one == group}"
                  + ("" if first is None else f"  (first difference at token {first})"),
                  flush=True)
    finally:
        for r in ranks:
            r.kill()
    differ = sum(not r["identical"] for r in rows)
    print(f"greedy text differs from one node's on {differ} of {len(rows)} workloads "
          f"({args.nodes} ranks, {dtype}, {args.max_tokens} tokens)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"model": args.model, "nodes": args.nodes, "dtype": dtype,
             "max_tokens": args.max_tokens, "workloads": rows, "differ": differ}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
