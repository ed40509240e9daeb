"""Token trees on pipeline rings (engine/parallel/ring/traversal.py): a tree is verified in ONE traversal, every
stage runs it under the tree's mask and positions, and the accepted path travels to every stage
with the next frame, where each compacts its caches to it. Greedy output with trees on equals
plain decoding and mlx-lm's generate on rings of 2 and 3 stages (tiny llama, qwen2, qwen3);
after a tree round every stage's caches equal, bit for bit, the caches of a ring that ran only
the accepted path; a stage that skipped the compaction is caught; hybrid recurrent models
(qwen3_5) keep chains on rings too."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from skulkp2p import wire
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import SamplingParams, make_rng
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.model.stage import StageModel
from skulkp2p.engine.parallel.ring.frames import header, tree_payload
from skulkp2p.engine.parallel.ring.traversal import InProcessLink, RingForward, StageWorker
from tests.helpers.reference import mlx_lm_tokens
from tests.helpers.rings import full, stages
from tests.helpers.trees import CODE, FREE_WIDTH, PARENTS, TOKENS, same_rows, tree_drafter

FAMILIES = ("llama", "qwen2", "qwen3")
PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def paths(tiny_model) -> dict[str, Path]:
    return {fam: tiny_model(fam) for fam in (*FAMILIES, "qwen3_5")}



class KeepDroppingWorker(StageWorker):
    """A stage that ignores the accepted path it is sent: what a stage that skips the
    compaction does (the tests below must catch it)."""

    def handle(self, msg):
        return super().handle({**msg, "keep": None})


def ring_forward(parts, request="r1", worker=StageWorker) -> RingForward:
    workers = [worker(StageModel(p.model, p.span), 3) for p in parts[:-1]]
    last = parts[-1]
    return RingForward(StageModel(last.model, last.span), InProcessLink(workers), term=3,
                       instance="i1", request=request, prefill_step=7)


def stage_caches(fwd: RingForward) -> list[list]:
    """Every stage's caches of the request, first stage first."""
    out = [w.sessions[fwd.request][2].cache for w in fwd.link.workers]
    return [*out, fwd.cache]


def caches_equal(a: list[list], b: list[list]) -> bool:
    for stage_a, stage_b in zip(a, b, strict=True):
        for x, y in zip(stage_a, stage_b, strict=True):
            if x.offset != y.offset:
                return False
            n = x.offset
            if not (mx.array_equal(x.keys[..., :n, :], y.keys[..., :n, :])
                    and mx.array_equal(x.values[..., :n, :], y.values[..., :n, :])):
                return False
    return True


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_ring_greedy_with_trees_equals_plain_and_mlx_lm(paths, family, n):
    lm = full(paths[family])
    prompt = lm.tokenizer.encode(CODE)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 64, make_rng(0)))
    assert plain == mlx_lm_tokens(lm, prompt, 64)
    fwd = ring_forward(stages(paths[family], n))
    assert fwd.trees
    stats = DecodeStats()
    drafter = tree_drafter()
    got = list(decode(fwd, prompt, SamplingParams(), 64, make_rng(0), drafter, 8, stats))
    assert got == plain
    assert stats.tree_rounds > 0 and drafter.side_offered > 0
    # one traversal per prefill chunk and per round, a tree round included (every round emits
    # its accepted drafts and one token of the target's)
    chunks = -(-(len(prompt) - 1) // fwd.prefill_step)
    assert fwd.traversals == chunks + len(plain) - stats.accepted


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", [[3, 6], [1, 2, 5], [3], [], [1, 2]])
@pytest.mark.usefixtures("mlx_lm_functions")
def test_ring_caches_after_a_tree_equal_the_path_alone(paths, family, n, path):
    """A tree round, its path kept, one more round (it carries the path to the other
    stages): every stage's caches and the round's logits equal those of a ring that ran only
    the accepted path; a stage that skips the compaction fails the same check. (Bit for bit
    with mlx-lm's functions; a float32 CPU node's numpy verify keeps it within rounding,
    tests/test_numpy_verify.py.)"""
    parts = stages(paths[family], n)
    ref = ring_forward(parts, request="ref")
    ref.prefill(PROMPT)
    ref([TOKENS[0], *[TOKENS[j] for j in path]])
    want = ref([3, 4])
    for worker, must_equal in ((StageWorker, True), (KeepDroppingWorker, False)):
        fwd = ring_forward(parts, request=f"tree-{worker.__name__}", worker=worker)
        fwd.prefill(PROMPT)
        before = fwd.traversals
        fwd.verify_tree(TOKENS, PARENTS)
        fwd.keep_path(path)
        assert fwd.traversals == before + 1  # the tree and its path: one traversal
        got = fwd([3, 4])
        if must_equal:
            assert caches_equal(stage_caches(fwd), stage_caches(ref))
            assert mx.array_equal(got, want)
        else:  # (even a kept chain prefix, which moves nothing, shortens the caches)
            assert not caches_equal(stage_caches(fwd), stage_caches(ref))


@pytest.mark.parametrize("family", FAMILIES)
def test_ring_tree_rows_equal_local_tree_rows(paths, family):
    """The last stage's logits rows of a tree traversal are the single node's tree rows (bit for
    bit on the reference BLAS; the stages' products run on other row counts than the single
    node's, so on OpenBLAS within helpers.trees.same_rows)."""
    lm = full(paths[family])
    local = LocalForward(lm.model)
    local.prefill(PROMPT)
    fwd = ring_forward(stages(paths[family], 3))
    fwd.prefill(PROMPT)
    why = same_rows(fwd.verify_tree(TOKENS, PARENTS), local.verify_tree(TOKENS, PARENTS))
    assert why is None, f"the ring's tree rows and the single node's {why}"


def test_stages_refuse_bad_paths_and_stray_trees(paths):
    """A kept path that is not a path of the stage's last tree, a path with no tree before it,
    and a tree on a prefill frame are dropped (the sender's traversal fails), never applied."""
    parts = stages(paths["llama"], 2)
    worker = StageWorker(StageModel(parts[0].model, parts[0].span), term=4)
    frame = {**header(4, "i", "a", 0, "prefill"), "x": PROMPT, "rollback": None}
    assert worker.handle(frame) is not None
    stray = {**frame, "step": 1, "x": tree_payload(TOKENS, PARENTS)}
    assert worker.handle(stray) is None  # a tree only in a verify frame
    nokeep = {**frame, "step": 1, "op": "verify", "x": [3], "keep": [1]}
    assert worker.handle(nokeep) is None  # no tree was verified
    tree = {**frame, "step": 1, "op": "verify", "x": tree_payload(TOKENS, PARENTS)}
    assert worker.handle(tree) is not None
    bad = {**frame, "step": 2, "op": "verify", "x": [3], "keep": [3, 5]}  # 5 is under 2
    assert worker.handle(bad) is None  # dropped: not a path of the tree
    assert worker.handle({**bad, "keep": [3, 6]}) is not None
    assert worker.dropped == 3
    # A stage older than trees reads a tree frame's payload as rows (or tokens) and fails:
    # it drops the frame instead of running the tree as a chain.
    with pytest.raises(wire.WireError):
        wire.unpack_array(tree_payload(wire.pack_array(mx.zeros((2, 3))), [-1, 0]))


def test_hybrid_ring_keeps_chains(paths):
    """qwen3_5 (recurrent layers) on a ring: the forward verifies no trees, the loop drafts
    chains for a tree drafter, exactly as plain; its stages refuse a tree frame."""
    lm = full(paths["qwen3_5"])
    prompt = lm.tokenizer.encode(CODE)
    plain = list(decode(LocalForward(lm.model), prompt, SamplingParams(), 40, make_rng(0)))
    parts = stages(paths["qwen3_5"], 2)
    fwd = ring_forward(parts)
    assert not fwd.trees
    with pytest.raises(ValueError, match="chains only"):
        fwd.verify_tree(TOKENS, PARENTS)
    stats = DecodeStats()
    got = list(decode(ring_forward(parts, request="r2"), prompt, SamplingParams(), 40,
                      make_rng(0), tree_drafter(), 8, stats))
    assert got == plain and stats.tree_rounds == 0 and stats.drafted > 0
    worker = StageWorker(StageModel(parts[0].model, parts[0].span), term=4)
    frame = {**header(4, "i", "a", 0, "prefill"), "x": PROMPT, "rollback": None}
    assert worker.handle(frame) is not None
    assert worker.handle({**frame, "step": 1, "op": "verify",
                          "x": tree_payload(TOKENS, PARENTS)}) is None


class StripKeepInBatch(StageWorker):
    """A stage that ignores the accepted paths of a batch frame's rows (skips compaction)."""

    def handle(self, msg):
        if msg.get("op") == "batch":
            msg = {**msg, "rows": [{**r, "keep": None} for r in msg["rows"]]}
        return super().handle(msg)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_ring_rows_verify_trees_exactly(paths, family, n):
    """Rows of a batched ring step carry their trees in the batch frame (the other rows are
    chains in it); every request's greedy tokens are plain decoding's on one node, and every
    row is freed on every stage at the end."""
    import dataclasses

    from skulkp2p.engine.runner.mlx_engine import MlxEngine
    from skulkp2p.formats.pipe_format import parse_request
    from tests.helpers.batch import solo, together
    from tests.helpers.rings import Ring

    lm = full(paths[family])
    prompts = [CODE, CODE.replace("add", "div"), "a b c d a b c d a b", CODE[:60]]

    def reqs(spec):
        return [parse_request({"id": i, "prompt": p, "max_tokens": 24 + 8 * i,
                               "speculation": "off" if i == 3 else spec})
                for i, p in enumerate(prompts)]

    plain = solo(MlxEngine(lm, 0, memory_tokens=0, max_batch=1), reqs("off"))
    trees_on = {**lm.speculation, "lookup": {**lm.speculation.get("lookup", {}), "trees": True}}
    for worker, exact in ((StageWorker, True), (StripKeepInBatch, False)):
        ring = Ring(stages(paths[family], n))
        if worker is not StageWorker:
            ring.link.workers = [worker(w.stage, w.term) for w in ring.workers]
            ring.workers = ring.link.workers
        ring.last = dataclasses.replace(ring.last, speculation=trees_on,
                                        width_costs=FREE_WIDTH)
        engine = ring.engine(4)
        assert engine.scheduler is not None and engine.scheduler.trees
        try:
            got = together(engine, reqs("auto"))
        except RuntimeError:  # (a stage that skipped compaction may also fail the ring)
            assert not exact
            continue
        same = [r.tokens for r in got] == [r.tokens for r in plain]
        tree_rounds = sum(r.speculation.tree_rounds or 0 for r in got if r.speculation)
        assert tree_rounds > 0 and engine.scheduler.through.peak > 1
        if exact:
            assert same
            assert ring.held() == [0] * (n - 1)
        else:  # a stage that skips the compaction is caught by the same comparison
            assert not same


@pytest.mark.cluster
@pytest.mark.slow
def test_ring_of_processes_with_trees_equals_plain(paths, tmp_path):
    """`join` nodes on loopback serve tiny llama from a card with `[speculation.lookup]
    trees = true` (and a width-cost table where every branch pays): greedy output with trees
    on a ring of 2 processes, both ways round, equals plain decoding on one node."""
    import json

    from skulkp2p.engine.drafting.width_costs import save_width_costs
    from tests.helpers.http_client import call, status_of
    from tests.helpers.procs import ProcCluster, loopback_ips_usable

    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    model = paths["llama"]
    config = json.loads((model / "config.json").read_text())
    cards = tmp_path / "cards"
    cards.mkdir()
    (cards / "llama-trees.toml").write_text(f'''id = "llama-trees"
family = "llama"
format = "mlx"
layers = {config["num_hidden_layers"]}
hidden_size = {config["hidden_size"]}
kv_heads = {config.get("num_key_value_heads", config["num_attention_heads"])}
context_length = 4096
size_bytes = 1_000_000

[source]
kind = "local"
path = "{model}"

[speculation.lookup]
trees = true
''')
    c = ProcCluster(tmp_path, env={"SKULKP2P_CARDS_DIR": str(cards),
                                   "SKULKP2P_RING_TIMEOUT": "20"})
    save_width_costs("llama-trees", "float32", c.data_dir, FREE_WIDTH)
    body = {"model": "llama-trees", "prompt": CODE, "max_tokens": 48}

    def ask(spec) -> dict:
        got: dict = {}

        def answered() -> bool:
            try:  # every request ends within the ring's timeout (plus a margin): no hang
                status, _, out = call(c.nodes[0].http, "POST", "/v1/cluster/generate",
                                      {**body, "speculation": spec}, timeout=20 + 15)
            except OSError as e:
                raise AssertionError(f"no answer within the ring timeout + 15 s ({spec}): "
                                     f"{e}\n{c.diagnostics()}") from e
            if status == 200 and "re-placed" not in str(out.get("error")):
                got.update(out)
                return True
            return False  # 503 while a placement loads
        c.wait(answered, 120, f"an answer ({spec})")
        return got

    def place(ring: list[str]) -> None:
        status, _, out = call(c.nodes[0].http, "POST", "/v1/cluster/place",
                              {"model": "llama-trees", "nodes": ring})
        assert status == 200, out
        c.wait(lambda: (s := c.agreed([0, 1])) and any(
            p["model"] == "llama-trees" and p["ring"] == ring for p in s["placements"]), 30,
            f"llama-trees on {ring}")

    try:
        for i in range(2):
            c.start_join(i, "llama-trees", args=["--memory-limit", "2GB", "--timers",
                                                 "probe=0.2,suspect=1,election=1"])
        c.wait(lambda: (s := c.agreed([0, 1])) and s["placements"], 90, "a placement")
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90, "health")
        place(["n1"])
        plain = ask("off")
        assert ask("auto")["tokens"] == plain["tokens"]
        for ring in (["n0", "n1"], ["n1", "n0"]):
            place(ring)
            got = ask("auto")
            assert got["tokens"] == plain["tokens"], (ring, got)
            assert got["text"] == plain["text"]
            assert got["speculation"].get("tree_rounds", 0) > 0, got["speculation"]
    finally:
        c.close()
