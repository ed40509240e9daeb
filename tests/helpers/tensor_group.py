"""A tensor-parallel group of real rank processes on 127.0.0.1 with the head model that runs
the decode loop over them (as a group's first member does), and one greedy/sampled request
through any loaded model: shared by tests/test_tensor.py and tests/test_tensor_link.py."""

from __future__ import annotations

from pathlib import Path

from skulkp2p.engine.drafting.call_costs import LiveWidthCosts
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.parallel.tensor.group import RankProcess, TensorForward
from skulkp2p.engine.runner.generate import stream
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.procs import free_port

ECHO = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"


class Group:
    """N rank processes on 127.0.0.1 and the head model (embedding, norm, head, drafter) that
    runs the decode loop over them, as a group's first member does."""

    def __init__(self, path: Path, n: int, timeout: float = 20.0, prefix_cache_mb: float = 0.0,
                 prefix_disk=None):
        """`prefix_disk`: where the ranks keep their slices of the prefix cache on disk too
        (a PrefixDiskSettings; None: memory only)."""
        addrs = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        self.ranks = [RankProcess(path, r, addrs, "float32", prefix_cache_mb=prefix_cache_mb,
                                  prefix_disk=prefix_disk, model_id=path.name)
                      for r in range(n)]
        try:
            self.ready = [r.wait_ready(60) for r in self.ranks]
        except BaseException:
            self.close()
            raise
        self.head = load_model(path, path.name, dtype="float32", head_only=True)
        self.timeout = timeout
        self.forwards: list[TensorForward] = []

        def make(req, hidden, interrupt):
            live = self.head.width_costs  # a live table is timed into, as a cluster's group
            fwd = TensorForward(self.head.model, self.ranks[0], hidden=hidden,
                                interrupt=interrupt, timeout=self.timeout, prefill_step=16,
                                call_costs=live if isinstance(live, LiveWidthCosts) else None)
            self.forwards.append(fwd)
            return fwd

        self.head.make_forward = make

    def close(self) -> None:
        for r in self.ranks:
            r.kill()


def generate(loaded, speculation, max_tokens: int = 40, prefix_cache=None, prompt=None,
             **fields):
    req = parse_request({"prompt": ECHO, "max_tokens": max_tokens, "speculation": speculation,
                         **fields})
    g = stream(loaded, req, prefix_cache=prefix_cache, prompt=prompt)
    while True:
        try:
            next(g)
        except StopIteration as e:
            return e.value
