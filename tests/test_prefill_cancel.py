"""A request cancelled during its prefill stops within the chunk in flight: the engine checks its
cancel flag between prefill chunks, once the prefill ended and once the drafter began, on the
lone path (a LocalForward) and on the batched one (a row of the model's batch, which leaves it);
counted in forwards run, never timed. Through HTTP (a real node, SmolLM2 chunked small, one
request at a time), a stream whose client leaves during the prefill is cancelled without a token
and the next request is answered.

The counts come from a spy on the trunk's forwards (`StageModel.run`: every prefill chunk, verify
and step of a request on its own caches runs through it): the real forward runs, the spy
cancels the generation as a chosen chunk starts."""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import struct
import threading
import time

import openai
import pytest

from skulkp2p.engine.drafting.mtp_drafter import MtpDrafter
from skulkp2p.engine.model.stage import StageModel
from skulkp2p.engine.protocol import Cancelled, Generation
from skulkp2p.engine.runner.generate import prompt_tokens
from skulkp2p.engine.runner.mlx_engine import MlxEngine
from skulkp2p.formats.pipe_format import parse_request
from tests.helpers.batch import loaded
from tests.helpers.http_client import H11Client
from tests.helpers.procs import JoinNode

CHUNK = 16  # prefill chunk (the card's runtime.prefill_step), in tokens
PROMPT = "the river runs under the old stone bridge and the bird sings " * 12


def _engine(tiny_model, max_batch: int, mtp: bool = False) -> MlxEngine:
    lm = loaded(tiny_model("llama", mtp=mtp))
    lm = dataclasses.replace(lm, runtime={**lm.runtime, "prefill_step": CHUNK})
    return MlxEngine(lm, 0, memory_tokens=0, max_batch=max_batch)


class Forwards:
    """The trunk's forwards over a request's own caches, in order (`prefill`: whether each was
    a prefill chunk, which asks for no logits), cancelling `generation` as the `cancel_at`-th
    of them (1-based) starts; with `prefill_only`, the steps that ask for logits are not
    counted (another request's, beside it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cancel_at: int | None = None,
                 prefill_only: bool = False):
        self.prefill: list[bool] = []
        self.generation: Generation | None = None
        self.cancel_at = cancel_at
        real = StageModel.run
        spy = self

        def run(stage: StageModel, x, cache, *, logits: bool = True, **kwargs):
            if not (prefill_only and logits):
                spy.prefill.append(not logits)
                if len(spy.prefill) == spy.cancel_at:
                    assert spy.generation is not None
                    spy.generation.cancel()
            return real(stage, x, cache, logits=logits, **kwargs)

        monkeypatch.setattr(StageModel, "run", run)

    @property
    def after_cancel(self) -> int:
        """Forwards begun once the generation was cancelled (the one starting then counts)."""
        assert self.cancel_at is not None
        return len(self.prefill) - self.cancel_at + 1


def _prompt_chunks(engine: MlxEngine, req) -> int:
    n = len(prompt_tokens(engine.loaded, req)) - 1  # (the last token is the first round's)
    return -(-n // CHUNK)


@pytest.mark.parametrize("max_batch", [1, 2], ids=["alone", "batched"])
@pytest.mark.parametrize("at", ["second", "last"])
def test_a_prefill_cancelled_runs_at_most_the_chunk_in_flight(tiny_model, monkeypatch,
                                                              max_batch, at):
    engine = _engine(tiny_model, max_batch)
    req = parse_request({"prompt": PROMPT, "max_tokens": 8, "speculation": "off"})
    chunks = _prompt_chunks(engine, req)
    assert chunks >= 4
    spy = Forwards(monkeypatch, 2 if at == "second" else chunks)
    generation = spy.generation = engine.generate(req)
    with pytest.raises(Cancelled):
        list(generation)
    # The chunk starting as the client left ran, and nothing after it: no chunk, no round.
    assert spy.after_cancel == 1 and all(spy.prefill)
    if engine.scheduler is not None:
        assert engine.scheduler.active == [] and engine.scheduler.requests == 0
    uncancelled = Forwards(monkeypatch)  # (the same request to its end: every chunk)
    whole = uncancelled.generation = engine.generate(req)
    list(whole)
    assert uncancelled.prefill.count(True) == chunks
    assert whole.result is not None and whole.result.usage.completion_tokens == 8


def test_the_drafter_does_not_begin_after_a_cancelled_prefill(tiny_model, monkeypatch):
    """The MTP head's pass over the prompt (its own chunks) runs after the trunk's prefill: a
    request cancelled during the prefill's last chunk never starts it, nor a first round."""
    engine = _engine(tiny_model, 1, mtp=True)
    body = {"prompt": PROMPT, "max_tokens": 4, "speculation": {"drafter": "mtp", "depth": 2}}
    begun: list[int] = []
    real_begin = MtpDrafter.begin

    def begin(drafter: MtpDrafter, prompt: list[int], forward) -> None:
        begun.append(len(prompt))
        real_begin(drafter, prompt, forward)

    monkeypatch.setattr(MtpDrafter, "begin", begin)
    chunks = _prompt_chunks(engine, parse_request(body))
    whole = engine.generate(parse_request(body))  # (not cancelled: the head begins, rounds run)
    list(whole)
    assert len(begun) == 1 and whole.result is not None
    assert whole.result.usage.completion_tokens == 4
    begun.clear()
    spy = Forwards(monkeypatch, chunks)
    generation = spy.generation = engine.generate(parse_request(body))
    with pytest.raises(Cancelled):
        list(generation)
    assert begun == [] and spy.after_cancel == 1 and all(spy.prefill)


def test_a_row_cancelled_in_its_prefill_leaves_the_batch_and_the_others_go_on(
        tiny_model, monkeypatch):
    """One request decodes on the batched path while another's long prompt prefills beside it
    and is cancelled as its second chunk starts: that chunk is its last forward, the decoding
    request ends with the text it has alone, and the batch is empty at the end."""
    engine = _engine(tiny_model, 2)
    sched = engine.scheduler
    assert sched is not None
    short = parse_request({"prompt": "one two three one two", "max_tokens": 40,
                           "speculation": "off"})
    alone = engine.generate(short)
    list(alone)
    assert alone.result is not None
    spy = Forwards(monkeypatch, prefill_only=True)
    long = parse_request({"prompt": PROMPT, "max_tokens": 8, "speculation": "off"})
    first_token = threading.Event()
    out: dict[str, object] = {}

    def decoding() -> None:
        gen = engine.generate(short)
        for chunk in gen:
            if chunk.tokens:
                first_token.set()
        out["decoding"] = gen.result

    def prefilling() -> None:
        gen = spy.generation = engine.generate(long)
        spy.cancel_at = len(spy.prefill) + 2  # its second chunk
        try:
            list(gen)
        except Cancelled:
            out["prefilling"] = "cancelled"

    a = threading.Thread(target=decoding)
    a.start()
    assert first_token.wait(60)
    b = threading.Thread(target=prefilling)
    b.start()
    for t in (a, b):
        t.join(120)
        assert not t.is_alive()
    assert out["prefilling"] == "cancelled" and spy.after_cancel == 1
    result = out["decoding"]
    assert result is not None and result.tokens == alone.result.tokens  # type: ignore[union-attr]
    assert sched.active == [] and sched.requests == 0


# ---- through HTTP -------------------------------------------------------------------------------


def _card(cards, smollm2_path) -> str:
    """SmolLM2 served one request at a time, its prompts prefilled in chunks of 128 tokens."""
    cards.mkdir(parents=True, exist_ok=True)
    (cards / "smollm2-chunked.toml").write_text(f'''id = "smollm2-chunked"
family = "llama"
format = "mlx"
layers = 30
hidden_size = 576
kv_heads = 3
context_length = 8192
size_bytes = 269_060_352

[source]
kind = "local"
path = "{smollm2_path}"

[runtime]
max_batch = 1
prefill_step = 128
''')
    return "smollm2-chunked"


def _metric(port: int, name: str, **labels: str) -> float:
    with H11Client(port, timeout=30) as c:
        text = c.request("GET", "/metrics").body.decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"skulkp2p_{name}{{") and want in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.process
def test_a_stream_closed_during_its_prefill_frees_the_model_for_the_next(
        smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SKULKP2P_CARDS_DIR", str(tmp_path / "cards"))
    model = _card(tmp_path / "cards", smollm2_path)
    node = JoinNode(model, tmp_path, "--data-dir", str(tmp_path))
    try:
        words = " ".join(f"w{i % 97} apple" for i in range(1500))  # about 5,900 tokens
        body = json.dumps({"model": model, "stream": True, "max_tokens": 50, "messages": [
            {"role": "user", "content": words}]}).encode()
        s = socket.create_connection(("127.0.0.1", node.port), timeout=30)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                  % (len(body), body))
        deadline = time.monotonic() + 60
        while not _metric(node.port, "requests_running", model=model):  # its prefill began
            assert time.monotonic() < deadline, node.text()[-2000:]
            answered, _, _ = select.select([s], [], [], 0.02)
            assert not answered, s.recv(65536)  # (refused, or over before the prefill began)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset, as a killed client gives
        client = openai.OpenAI(base_url=node.base + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        r = client.chat.completions.create(model=model, max_tokens=3, messages=[
            {"role": "user", "content": "Hello!"}])
        assert r.usage.completion_tokens == 3
        # One request at a time: the second ran once the first was cancelled, before a token.
        assert "job 1 cancelled after 0 tokens" in node.text()
        assert _metric(node.port, "requests_total", model=model, outcome="cancelled") == 1
        assert _metric(node.port, "requests_total", model=model, outcome="ok") == 1
    finally:
        assert node.stop() == 0, node.text()[-3000:]
