"""The prefix cache's entries on disk (engine/cache/disk_store.py): written whole or not at all,
checksummed, tied to the model's fingerprint, bounded and least recently used out first, found
again by a new store on the same folder (a restart), and the per-request opt-out. Real mlx-lm
cache objects with real arrays; the process test kills a real writer mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from skulkp2p.engine.cache.disk_store import (
    SUFFIX,
    TMP_SUFFIX,
    BadEntry,
    PrefixDiskStore,
    StoredEntry,
    StoreInUse,
    read_entry,
    weights_fingerprint,
)
from skulkp2p.engine.cache.prefix_cache import PrefixCache
from skulkp2p.engine.model.loaded import load_model
from skulkp2p.engine.protocol import PrefixDiskSettings
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.anthropic_messages import messages_request
from skulkp2p.formats.completions import completion_request
from skulkp2p.formats.openai_chat import chat_request
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.formats.responses_api import response_request

FP = "f" * 64
ROOT = Path(__file__).resolve().parents[1]


def _kv(length: int, seed: int, dtype: mx.Dtype = mx.float32, heads: int = 2) -> KVCache:
    """A KVCache holding `length` positions in a buffer with room to spare (as a real one)."""
    c = KVCache()
    k = mx.random.normal((1, heads, length, 8), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, heads, length, 8), key=mx.random.key(seed + 1)).astype(dtype)
    c.update_and_fetch(k, v)
    return c


def _entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


def _store(folder: Path, max_bytes: int = 1 << 30, fp: str = FP) -> PrefixDiskStore:
    return PrefixDiskStore(folder, max_bytes, fp)


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


def test_round_trip_every_cache_type(tmp_path):
    """KV (float32, bfloat16), recurrent and rotating caches, the MTP head's cache and hidden
    row come back bit for bit from a new store on the folder (a restart)."""
    rec = ArraysCache(2)
    rec[0] = mx.random.normal((1, 3, 4))
    rot = RotatingKVCache(max_size=4)
    rot.update_and_fetch(mx.ones((1, 2, 6, 8)), mx.zeros((1, 2, 6, 8)))
    caches = [_kv(5, 1), _kv(5, 3, mx.bfloat16), rec, rot]
    mtp, hidden = _kv(5, 7), mx.arange(16, dtype=mx.bfloat16)
    store = _store(tmp_path)
    assert store.put(StoredEntry((1, 2, 3, 4, 5, 6), caches, mtp, 5, hidden, False))
    store.close()
    again = _store(tmp_path)
    [(entry, common)] = again.candidates([1, 2, 3, 4, 5, 6, 9])
    assert common is None and entry.length == 5 and entry.mtp_rows == 5 and entry.has_hidden
    back = again.load(entry)
    assert back is not None and back.key == (1, 2, 3, 4, 5, 6) and not back.trimmable
    for a, b in zip(caches, back.caches, strict=True):
        assert type(a) is type(b)
        for x, y in zip(tree_flatten(a.state), tree_flatten(b.state),
                        strict=True):
            assert x[0] == y[0]
            if isinstance(x[1], mx.array):
                assert _equal(x[1], y[1])
            else:
                assert x[1] == y[1]
    assert back.mtp is not None and _equal(back.mtp.state[0], mtp.state[0])
    assert back.mtp_hidden is not None and _equal(back.mtp_hidden, hidden)
    again.close()


def test_prefix_cache_finds_entries_after_a_restart(tmp_path):
    """A lookup that misses memory loads the entry from disk; the hit is counted, and the next
    cache on the same folder finds what the first one wrote."""
    tokens = list(range(10, 40))
    c = _kv(len(tokens) - 1, 5)
    first = PrefixCache(1 << 28, _store(tmp_path))
    assert first.store(tokens, [c])
    first.close()
    second = PrefixCache(1 << 28, _store(tmp_path))
    hit = second.fetch(tokens + [99, 100])
    assert hit is not None and hit.length == len(tokens) - 1
    assert _equal(hit.caches[0].state[0], c.state[0][..., :hit.length, :])
    stats = second.stats()
    assert stats["disk_hits"] == 1 and stats["disk_loads"] == 1 and stats["hits"] == 1
    # A prompt that leaves the key part-way takes the trimmed entry (from memory now).
    part = second.fetch(tokens[:12] + [7, 7])
    assert part is not None and part.length == 11
    second.close()


def test_corrupt_and_truncated_entries_are_refused_and_removed(tmp_path):
    store = _store(tmp_path)
    for i in range(2):
        store.put(StoredEntry((i, 1, 2, 3), [_kv(3, i)], None, 0, None, True))
    store.close()
    flipped, cut = _entries(tmp_path)
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF  # an array's byte: only the checksum can tell
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-100])
    with pytest.raises(BadEntry, match="checksum"):
        read_entry(flipped, FP)
    cache = PrefixCache(1 << 28, _store(tmp_path))
    assert cache.fetch([0, 1, 2, 3, 4]) is None and cache.fetch([1, 1, 2, 3, 4]) is None
    assert _entries(tmp_path) == [] and cache.stats()["disk_refused"] == 2
    cache.close()


def test_lru_bound(tmp_path):
    """At most max_bytes of files; the least recently used (a load counts) go first, and a new
    store on the folder keeps that order (the files' times)."""
    one = StoredEntry((0, 1, 2, 3), [_kv(3, 0)], None, 0, None, True)
    probe = _store(tmp_path / "probe")
    probe.put(one)
    probe.close()
    size = _entries(tmp_path / "probe")[0].stat().st_size
    store = _store(tmp_path / "lru", max_bytes=2 * size + size // 2)
    for i in range(2):
        store.put(StoredEntry((i, 1, 2, 3), [_kv(3, i)], None, 0, None, True))
        store.flush()
    [(first, _)] = store.candidates([0, 1, 2, 3])
    assert store.load(first) is not None  # entry 0 is used: entry 1 is now the oldest
    store.flush()
    store.put(StoredEntry((2, 1, 2, 3), [_kv(3, 2)], None, 0, None, True))
    store.flush()
    assert store.nbytes <= store.max_bytes and len(store) == 2
    assert store.candidates([1, 1, 2, 3]) == [] and store.candidates([0, 1, 2, 3])
    store.close()
    again = _store(tmp_path / "lru", max_bytes=size + size // 2)  # a smaller bound
    assert len(again) == 1 and again.candidates([2, 1, 2, 3])  # the newest stays
    assert len(_entries(tmp_path / "lru")) == 1
    again.close()


def test_folders_of_superseded_weights_go_when_room_is_needed(tmp_path):
    """The model's folders under other fingerprints (its weights replaced, another dtype or
    library version) count against the bound and are removed whole, least recently used first,
    when room is needed; one a live process holds stays, and so does anything not a store's:
    another model's folder, a file of someone else's in a superseded folder (its folder stays)."""
    from skulkp2p.engine.cache.disk_store import store_folder

    one = StoredEntry((0, 1, 2, 3), [_kv(3, 0)], None, 0, None, True)

    def fill(fp: str, n: int = 1) -> Path:
        store = _store(store_folder(tmp_path, "org/model", fp), fp=fp)
        for i in range(n):
            store.put(StoredEntry((i, 1, 2, 3), [_kv(3, i)], None, 0, None, True))
        store.close()
        return store.folder

    old, older, foreign = fill("a" * 64), fill("b" * 64), fill("c" * 64)
    os.utime(_entries(older)[0], (1, 1))  # the least recently used
    (foreign / "notes.txt").write_text("not the store's")
    os.utime(_entries(foreign)[0], (2, 2))  # the next
    other_model = _store(store_folder(tmp_path, "org/other", "d" * 64), fp="d" * 64)
    other_model.put(one)
    other_model.close()
    held = _store(store_folder(tmp_path, "org/model", "e" * 64), fp="e" * 64)  # live: stays
    held.put(one)
    held.flush()
    size = _entries(old)[0].stat().st_size

    # Room for three entries: at the start four superseded ones are too many (the oldest
    # folder goes); this store's first entry needs room again (the next one's entry goes, but
    # not the file that is not the store's, nor so its folder).
    current = _store(store_folder(tmp_path, "org/model", FP), max_bytes=3 * size + size // 2)
    assert not older.exists() and current.stats()["disk_superseded_removed"] == 1
    assert len(_entries(foreign)) == 1
    current.put(one)
    current.flush()
    assert foreign.exists() and [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert old.exists() and current.stats()["disk_superseded_removed"] == 1
    current.close()
    # A smaller bound at the next start: the rest of what no process holds goes too.
    again = _store(store_folder(tmp_path, "org/model", FP), max_bytes=size + size // 2)
    assert not old.exists() and held.folder.exists() and len(again) == 1
    assert len(_entries(store_folder(tmp_path, "org/other", "d" * 64))) == 1
    again.close()
    held.close()


def test_a_longer_entry_replaces_its_prefixes_on_disk(tmp_path):
    """The next turn's entry serves the earlier turn's prompts (trimmed): the earlier file goes."""
    store = _store(tmp_path)
    store.put(StoredEntry((1, 2, 3, 4), [_kv(3, 0)], None, 0, None, True))
    store.flush()
    store.put(StoredEntry((1, 2, 3, 4, 5, 6), [_kv(5, 0)], None, 0, None, True))
    store.close()
    assert len(_entries(tmp_path)) == 1


def test_opt_out_writes_nothing(tmp_path):
    """persist=False (a request's `disk_cache: false`) keeps the entry in memory only."""
    disk = _store(tmp_path)
    cache = PrefixCache(1 << 28, disk)
    assert cache.store([5, 6, 7, 8], [_kv(3, 0)], persist=False)
    assert cache.store([9, 6, 7, 8], [_kv(3, 1)])  # written after it, in order
    disk.flush()
    [entry] = _entries(tmp_path)
    assert read_entry(entry, FP).key == (9, 6, 7, 8)
    assert cache.fetch([5, 6, 7, 8, 1]) is not None  # (in memory all the same)
    cache.close()


def test_another_models_entries_are_never_loaded(tmp_path):
    store = _store(tmp_path)
    store.put(StoredEntry((1, 2, 3), [_kv(2, 0)], None, 0, None, True))
    store.close()
    [path] = _entries(tmp_path)
    with pytest.raises(BadEntry, match="another model"):
        read_entry(path, "0" * 64)
    other = _store(tmp_path, fp="0" * 64)
    assert len(other) == 0 and other.candidates([1, 2, 3, 4]) == []
    other.close()
    # The fingerprint follows the weights (a fine-tune: same names and shapes, other values)
    # and what computes the caches (the dtype).
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    w = mx.random.normal((256, 1024), key=mx.random.key(0))
    mx.save_safetensors(str(model / "model.safetensors"), {"w": w})
    a = weights_fingerprint(model, ["m", "float32"])
    assert a == weights_fingerprint(model, ["m", "float32"])
    assert a != weights_fingerprint(model, ["m", "bfloat16"])
    mx.save_safetensors(str(model / "model.safetensors"), {"w": w + 1e-3})
    assert a != weights_fingerprint(model, ["m", "float32"])


def test_one_process_per_folder(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(StoreInUse):
        _store(tmp_path)
    store.close()
    _store(tmp_path).close()


def test_every_front_end_takes_the_opt_out():
    def no_check(_model):
        return None
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_request({"messages": msgs}).disk_cache
    assert not parse_request({"messages": msgs, "disk_cache": False}).disk_cache
    assert not chat_request({"messages": msgs, "disk_cache": False}, no_check).req.disk_cache
    assert not completion_request({"prompt": "x", "disk_cache": False},
                                  no_check).req.disk_cache
    assert not response_request({"input": "hi", "disk_cache": False}, no_check,
                                lambda rid: ()).req.disk_cache
    assert not messages_request({"messages": msgs, "max_tokens": 4, "disk_cache": False},
                                no_check).req.disk_cache
    with pytest.raises(RequestError) as e:
        parse_request({"messages": msgs, "disk_cache": "no"})
    assert e.value.param == "disk_cache"


DOC = ("def area(w, h):\n    return w * h\n\n" * 12
       + "The survey counted birds along the river every spring. " * 14
       + "\nQuestion: what does area return?\nAnswer:")


def _generate(engine, prompt: str):
    from skulkp2p.formats.pipe_format import parse_request

    generation = engine.generate(parse_request({"prompt": prompt, "max_tokens": 12}))
    for _ in generation:
        pass
    return generation.result


@pytest.mark.parametrize("family,max_batch", [("llama", 1), ("llama", 4), ("qwen3_5", 1)])
def test_an_engine_started_again_restores_from_disk(tmp_path, tiny_models, family, max_batch):
    """The engine's own path, one request alone and as a row of the batch, plain KV and
    recurrent state: a new engine on the same folder (a restart) restores the prompt from disk
    and decodes what the cold run decoded."""
    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    lm = load_model(tiny_models[family], family, dtype="float32")
    settings = PrefixDiskSettings(tmp_path, 1 << 30)
    first = MlxEngine(lm, 64, prefix_disk=settings, max_batch=max_batch)
    cold = _generate(first, DOC)  # an empty cache: a cold run
    assert cold.usage.cached_tokens == 0
    first.close()  # writes what it queued
    again = MlxEngine(lm, 64, prefix_disk=settings, max_batch=max_batch)
    warm = _generate(again, DOC)
    assert warm.usage.cached_tokens > 0 and again.info().detail["prefix_cache"]["disk_hits"] == 1
    assert (warm.tokens, warm.text) == (cold.tokens, cold.text)
    again.close()


def test_a_batched_row_reads_its_entry_while_another_row_decodes(tmp_path, tiny_models):
    """A restarted batched engine: while one row reads its prompt's entry from disk (file,
    checksum, parse), another row keeps decoding (the read happens before the row takes the
    model's lock; only the copy into MLX arrays happens under it), and both decode what they
    decode cold."""
    import dataclasses
    import threading

    from skulkp2p.engine.runner.mlx_engine import MlxEngine

    lm = load_model(tiny_models["llama"], "llama", dtype="float32")
    settings = PrefixDiskSettings(tmp_path, 1 << 30)
    busy = dataclasses.replace(parse_request({"prompt": "Count the waves:", "max_tokens": 160,
                                              "disk_cache": False}), ignore_eos=True)

    def run(engine, req, out: list[int] | None = None):
        generation = engine.generate(req)
        for chunk in generation:
            if out is not None:
                out.extend(chunk.tokens)
        return generation.result

    first = MlxEngine(lm, 64, prefix_disk=settings, max_batch=4)
    cold = _generate(first, DOC)
    cold_busy = run(first, busy)
    first.close()  # writes what it queued

    again = MlxEngine(lm, 64, prefix_disk=settings, max_batch=4)
    assert again.prefix_cache is not None and again.prefix_cache.disk is not None
    disk = again.prefix_cache.disk
    decoded: list[int] = []  # the busy row's tokens as they come
    during: list[int] = []  # tokens the busy row decoded while the read went on
    read = disk.read

    def watched_read(entry):
        if threading.current_thread() is busy_row:  # (its own prompt: nothing on disk)
            return read(entry)
        at = len(decoded)
        deadline = time.monotonic() + 30
        while len(decoded) < at + 3 and time.monotonic() < deadline:  # (bounded)
            time.sleep(0.001)
        during.append(len(decoded) - at)
        return read(entry)
    disk.read = watched_read
    results: dict[str, object] = {}
    busy_row = threading.Thread(target=lambda: results.update(busy=run(again, busy, decoded)))
    busy_row.start()
    deadline = time.monotonic() + 60
    while not decoded and time.monotonic() < deadline:
        time.sleep(0.001)
    warm = _generate(again, DOC)
    busy_row.join(120)
    assert during and during[0] >= 3, during  # the other row decoded meanwhile
    assert warm.usage.cached_tokens > 0 and again.info().detail["prefix_cache"]["disk_hits"] == 1
    assert (warm.tokens, warm.text) == (cold.tokens, cold.text)
    assert results["busy"].tokens == cold_busy.tokens == decoded
    again.close()


def _disk_ring(path: Path, settings: PrefixDiskSettings, max_batch: int = 1):
    """A 3-stage in-process ring of the tiny llama (frames through the wire codec), every stage
    with its own prefix cache on disk under `settings`, as a node's stages keep them
    (node/stages.py): (the last stage's engine, the other stages' workers)."""
    from skulkp2p.engine.model.stage import StageModel, StageSpan
    from skulkp2p.engine.parallel.ring.traversal import InProcessLink, RingForward, StageWorker
    from skulkp2p.engine.runner.mlx_engine import MlxEngine, prefix_disk_store

    spans = [StageSpan(0, 1, 4), StageSpan(1, 3, 4), StageSpan(3, 4, 4)]
    parts = [load_model(path, "llama", dtype="float32", span=s) for s in spans]
    workers = [StageWorker(StageModel(p.model, p.span), 1,
                           PrefixCache(64 << 20, prefix_disk_store(p, settings)))
               for p in parts[:-1]]
    link = InProcessLink(workers)
    last = parts[-1]
    n = iter(range(10 ** 6))
    last.make_forward = lambda req, hidden, interrupt: RingForward(
        StageModel(last.model, last.span), link, term=1, instance="i", request=f"r{next(n)}",
        hidden=hidden, interrupt=interrupt, prefill_step=64)
    return MlxEngine(last, 64, prefix_disk=settings, max_batch=max_batch), workers


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_restarted_ring_restores_every_stage_from_disk(tmp_path, tiny_models, max_batch):
    """Every stage of a pipeline ring keeps its entries on disk, in a folder of its own layer
    range: a ring started again on the same folders (a restart) restores the prompt on every
    stage from disk and decodes what the cold run decoded; a request that says no writes
    nothing on any stage; a stage that lost its folder makes the ring prefill (same output)."""
    settings = PrefixDiskSettings(tmp_path, 1 << 30)
    engine, workers = _disk_ring(tiny_models["llama"], settings, max_batch)
    cold = _generate(engine, DOC)
    assert cold.usage.cached_tokens == 0
    for cache in [engine.prefix_cache, *(w.prefix_cache for w in workers)]:
        cache.close()  # (what a node's SIGTERM does: the queued entries are written)
    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(folders) == 3 and all(len(_entries(f)) == 1 for f in folders), folders

    engine, workers = _disk_ring(tiny_models["llama"], settings, max_batch)  # a restart
    warm = _generate(engine, DOC)
    assert warm.usage.cached_tokens > 0
    assert (warm.tokens, warm.text) == (cold.tokens, cold.text)
    assert engine.info().detail["prefix_cache"]["disk_hits"] == 1
    assert all(w.prefix_cache.disk_hits == 1 for w in workers)
    off = engine.generate(parse_request({"prompt": "Another text entirely.", "max_tokens": 4,
                                         "disk_cache": False}))
    for _ in off:
        pass
    for cache in [engine.prefix_cache, *(w.prefix_cache for w in workers)]:
        cache.close()
    assert all(len(_entries(f)) == 1 for f in folders)  # nothing of it on any stage's disk

    for f in _entries(folders[1]):  # one stage lost its entries (a new disk, say)
        f.unlink()
    engine, workers = _disk_ring(tiny_models["llama"], settings, max_batch)
    again = _generate(engine, DOC)
    assert again.usage.cached_tokens == 0 and (again.tokens, again.text) == (cold.tokens,
                                                                             cold.text)
    for cache in [engine.prefix_cache, *(w.prefix_cache for w in workers)]:
        cache.close()


@pytest.mark.process
def test_a_tensor_group_formed_again_restores_every_rank_from_disk(tmp_path, tiny_models):
    """Each rank of a tensor-parallel group keeps its slices on disk (a folder per model, rank
    and group size), and the loop's member its index: a group formed again (new rank
    processes, a new index) restores the prompt on every rank from disk and decodes what the
    cold group decoded; a request that says no writes nothing on any rank."""
    from skulkp2p.engine.runner.mlx_engine import prefix_disk_store
    from tests.helpers.tensor_group import ECHO, Group, generate

    path = tiny_models["llama"]
    settings = PrefixDiskSettings(tmp_path, 1 << 30)

    def rank_entries() -> list[int]:
        return [sum(len(_entries(f)) for f in tmp_path.glob(f"*@tp{r}of2-*")) for r in (0, 1)]

    group = Group(path, 2, prefix_cache_mb=64, prefix_disk=settings)
    try:
        cold = generate(group.head, "off", max_tokens=12)  # (no index: the ranks keep nothing)
        index = PrefixCache(64 << 20, prefix_disk_store(group.head, settings))
        first = generate(group.head, "off", max_tokens=12, prefix_cache=index)
        index.close()
        assert first.tokens == cold.tokens
        deadline = time.monotonic() + 30  # each rank writes its slice behind (bounded wait)
        while rank_entries() != [1, 1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rank_entries() == [1, 1]
    finally:
        group.close()  # (by pid: what was written stays)

    group = Group(path, 2, prefix_cache_mb=64, prefix_disk=settings)
    index = PrefixCache(64 << 20, prefix_disk_store(group.head, settings))
    try:
        again = generate(group.head, "off", max_tokens=12, prefix_cache=index)
        assert again.usage.cached_tokens > 0 and index.disk_hits == 1
        assert again.tokens == cold.tokens and again.text == cold.text
        assert group.forwards[-1].rows < len(group.head.tokenizer.encode(ECHO)) // 2
        generate(group.head, "off", max_tokens=4, prefix_cache=index, disk_cache=False,
                 prompt=list(reversed(group.head.tokenizer.encode(ECHO)))[:20])
        index.close()
        assert len(index) == 2 and rank_entries() == [1, 1]  # nothing of it on any disk
    finally:
        group.close()


_WRITER = """
import sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from skulkp2p.engine.cache.disk_store import StoredEntry, encode, write_entry
c = KVCache()
big = mx.random.normal((1, 8, 16384, 64))
c.update_and_fetch(big, big)
i = 0
while True:
    write_entry(Path(sys.argv[1]), encode(StoredEntry((i, 1, 2), [c], None, 0, None, True),
                                          sys.argv[2]))
    i += 1
"""


@pytest.mark.process
def test_kill_during_a_write_leaves_nothing_that_loads(tmp_path):
    """A writer killed by SIGKILL mid-write (its temporary file on disk) leaves whole entries or
    none: every entry a new store indexes loads, and the temporary file is removed."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), FP], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.endswith(TMP_SUFFIX) for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any(p.name.endswith(TMP_SUFFIX) for p in tmp_path.iterdir())
    store = _store(tmp_path)
    assert not any(p.name.endswith(TMP_SUFFIX) for p in tmp_path.iterdir())
    for entry in store.entries():
        assert store.load(entry) is not None
    assert store.refused == 0
    store.close()
