"""Structured outputs (response_format, text.format): the fields each front end reads, the 400s of
a bad schema, and constrained decoding's exactness: greedy output of every drafter equals
constrained plain decoding token for token (the grammar's mask applies to every verified row),
seeded sampled output too where drafts are deterministic (the coupled accept rule), and every
output is valid against its schema. On tiny random-weight models (which wander anywhere the
grammar lets them) and on the real SmolLM2, in process and through the HTTP server with the
real `openai` client."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest

from skulkp2p.engine.decode.drafter_seam import Drafter
from skulkp2p.engine.decode.grammar import Grammar, compile_format
from skulkp2p.engine.decode.loop import DecodeStats, decode
from skulkp2p.engine.decode.sampling import make_rng
from skulkp2p.engine.model.forward import LocalForward
from skulkp2p.engine.request import (
    GenerationRequest,
    Message,
    RequestError,
    ResponseFormat,
    SamplingParams,
    Speculation,
)
from skulkp2p.formats.openai_chat import chat_request
from skulkp2p.formats.pipe_format import parse_request
from skulkp2p.formats.responses_api import response_request

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
FLAGS = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "color": {"enum": ["red", "green", "blue"]}, "note": {"type": "string", "maxLength": 6},
    "extra": {"type": ["integer", "null"], "minimum": -9, "maximum": 9}},
    "required": ["ok", "n", "color", "note", "extra"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "maximum": 99},
                                         "done": {"type": "boolean"}},
        "required": ["id", "done"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
SCHEMAS = [PERSON, FLAGS, NESTED]

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def conforms(value: object, schema: dict, path: str = "$") -> None:
    """A hand check of the keywords these tests' schemas use (jsonschema is not a dependency)."""
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        ok = any((k == "integer" and type(value) is int)
                 or (k == "number" and type(value) in (int, float))
                 or (k in _TYPES and type(value) is _TYPES[k]) for k in kinds)
        assert ok, (path, value, kinds)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, (path, key)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (path, set(value) - set(props))
        for key, sub in value.items():
            if key in props:
                conforms(sub, props[key], f"{path}.{key}")
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value)), path
        assert len(value) >= schema.get("minItems", 0), path
        for i, sub in enumerate(value):
            conforms(sub, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, str):
        assert len(value) <= schema.get("maxLength", len(value)), path
    if type(value) in (int, float):
        assert value >= schema.get("minimum", value) and value <= schema.get("maximum", value)


def valid(text: str, schema: dict) -> object:
    value = json.loads(text)
    conforms(value, schema)
    return value


def schema_format(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", schema, "out", True)


# --- the fields, and the 400s ------------------------------------------------------------------

def _chat(fmt: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": fmt}


def test_chat_pipe_and_responses_fields():
    def check(model: object) -> None:
        return None

    r = chat_request(_chat({"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}), check).req
    assert r.response_format == ResponseFormat("json_schema", PERSON, "person", True)
    assert chat_request(_chat({"type": "json_object"}), check).req.response_format == \
        ResponseFormat("json_object")
    assert not chat_request(_chat({"type": "text"}), check).req.response_format.constrained
    pipe = parse_request({"prompt": "x", "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "f",
                                                                             "schema": FLAGS}}})
    assert pipe.response_format.schema == FLAGS and pipe.response_format.strict is None
    body = {"model": "m", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "flags", "schema": FLAGS, "strict": True}}}
    parsed = response_request(body, check, lambda rid: ())
    assert parsed.req.response_format == ResponseFormat("json_schema", FLAGS, "flags", True)
    assert response_request({"model": "m", "input": "hi", "text": {"format": {
        "type": "json_object"}}}, check, lambda rid: ()).req.response_format.type == \
        "json_object"


@pytest.mark.parametrize(("schema", "param", "says"), [
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "properties.a.uniqueItems", "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "intger"}}}, "properties.a.type", "intger"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": "x"}}},
     "properties.a.minLength", "minLength"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
     "properties.a.$ref", "does not exist"),
    ({"type": "string", "format": "hostnamex"}, "format", "hostnamex"),
])
def test_bad_schema_is_refused_naming_its_path(schema, param, says):
    with pytest.raises(RequestError) as e:
        parse_request({"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert e.value.param == f"response_format.json_schema.schema.{param}"
    assert says in e.value.message and e.value.status == 400
    with pytest.raises(RequestError) as e:
        response_request({"model": "m", "input": "hi", "text": {"format": {
            "type": "json_schema", "name": "s", "schema": schema}}}, lambda m: None,
            lambda rid: ())
    assert e.value.param == f"text.format.schema.{param}"


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "bogus": 1}},
     "response_format.json_schema.bogus"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ("json", "response_format"),
])
def test_bad_response_format_fields(fmt, param):
    with pytest.raises(RequestError) as e:
        parse_request({"prompt": "x", "response_format": fmt})
    assert e.value.param == param


def test_tools_with_a_format_are_taken():
    # (calls fit the tool grammar, an answer the format: tests/test_structured_tools.py)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = parse_request({"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                         "response_format": {"type": "json_object"}})
    assert req.uses_tools and req.response_format.constrained


# --- the matcher -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model):
    """A tiny qwen3 with an MTP head: random weights, so its output goes wherever the mask
    lets it."""
    from skulkp2p.engine.model.loaded import load_model
    return load_model(tiny_model("qwen3", mtp=True), "qwen3")


def _grammar(lm, schema: dict) -> Grammar:
    from skulkp2p.engine.runner.generate import constraint
    return constraint(lm, GenerationRequest(prompt="x", response_format=schema_format(schema)))


def test_matcher_masks_forces_and_ends(tiny):
    g = _grammar(tiny, PERSON)
    tok = tiny.tokenizer
    forced = g.forced()
    assert tok.decode(forced).startswith('{"name": ')  # the required first key is forced
    eos = sorted(tok.eos_token_ids)
    assert not g.mask()[eos].any()  # no EOS before the object is complete
    text = '{"name": "Al", "age": 3, "tags": []}'
    ids = list(tok.encode(text, add_special_tokens=False))
    assert g.valid_prefix(ids) == len(ids)
    for t in ids:
        assert g.mask()[t]
        g.accept(t)
    assert g.done and g.mask()[eos].any() and g.mask().sum() == len(set(eos) & set(range(
        g.n_vocab)))
    bad = list(tok.encode('{"nam": 1}', add_special_tokens=False))
    g.rollback(len(ids))
    assert g.valid_prefix(bad) < len(bad) and g.accepted == 0


# --- exactness on tiny models ------------------------------------------------------------------

DRAFTERS = [Speculation(mode="explicit", drafter="lookup", depth=4),
            Speculation(mode="explicit", drafter="mtp", depth=3),
            Speculation(mode="auto")]


GREEDY = SamplingParams()


def _run(lm, schema: dict, spec: Speculation, sampling: SamplingParams = GREEDY,
         prompt: str = "hello", max_tokens: int = 80, messages=None):
    from skulkp2p.engine.runner.generate import run
    req = GenerationRequest(prompt=None if messages else prompt, messages=messages,
                            max_tokens=max_tokens, sampling=sampling, speculation=spec,
                            response_format=schema_format(schema))
    return run(lm, req)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "flags", "nested"])
def test_tiny_greedy_and_seeded_spec_equal_plain(tiny, schema):
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=7),
                     SamplingParams(temperature=0.8, top_p=0.9, seed=11)):
        plain = _run(tiny, schema, Speculation(mode="off"), sampling)
        assert plain.finish_reason == "stop", plain
        valid(plain.text, schema)
        for spec in DRAFTERS:
            got = _run(tiny, schema, spec, sampling)
            assert got.tokens == plain.tokens, (spec, sampling, got.text, plain.text)
            assert got.speculation is not None and got.speculation.accepted > 0


def test_tiny_many_seeds_all_valid(tiny):
    """Sampled output is valid whatever the seed (the mask, not luck, keeps it so)."""
    for seed in range(6):
        r = _run(tiny, FLAGS, DRAFTERS[0], SamplingParams(temperature=1.5, seed=seed))
        assert r.finish_reason == "stop"
        valid(r.text, FLAGS)


def test_json_object_is_an_object(tiny):
    from skulkp2p.engine.runner.generate import run
    r = run(tiny, GenerationRequest(prompt="hi", max_tokens=48,
                                    response_format=ResponseFormat("json_object")))
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    else:
        assert r.text.startswith("{")


def test_length_inside_an_object(tiny):
    r = _run(tiny, PERSON, DRAFTERS[0], max_tokens=6)
    assert r.finish_reason == "length" and len(r.tokens) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


class RefusedDrafter(Drafter):
    """A real drafter (the Drafter protocol) whose drafts the grammar refuses from the start:
    each draft is the token after the last one, drawn from a q peaked there."""
    name = "refused"

    def __init__(self, vocab: int, with_q: bool):
        self.vocab, self.with_q = vocab, with_q
        self.proposed = 0

    def propose(self, history, k):
        draft = [(history[-1] + 1 + i) % self.vocab for i in range(k)]
        self.proposed += len(draft)
        if not self.with_q:
            return draft, None
        qs = []
        for t in draft:
            q = np.full(self.vocab, 0.1 / (self.vocab - 1))
            q[t] = 0.9
            qs.append(q)
        return draft, qs

    def begin(self, prompt, forward):
        return None

    def observe(self, drafted, accepted, emitted, forward):
        return None

    def quiet(self):
        return False


def _decode(lm, schema, params, drafter=None, depth=0, n=60):
    from skulkp2p.engine.drafting.draft_model import vocab_size
    g = _grammar(lm, schema)
    fwd = LocalForward(lm.model, 64)
    prompt = list(lm.tokenizer.encode("hello"))
    stats = DecodeStats()
    eos = set(lm.tokenizer.eos_token_ids)
    out = []
    for t in decode(fwd, prompt, params, n, make_rng(params.seed), drafter, depth, stats,
                    grammar=g):
        if t in eos:
            break
        out.append(t)
    return out, stats, vocab_size(lm.model)


def test_refused_drafts_are_cut_before_the_verify(tiny):
    plain, _, vocab = _decode(tiny, FLAGS, SamplingParams())
    valid(tiny.tokenizer.decode(plain), FLAGS)
    for with_q in (False, True):
        drafter = RefusedDrafter(vocab, with_q)
        got, stats, _ = _decode(tiny, FLAGS, SamplingParams(), drafter, 4)
        assert got == plain and drafter.proposed > 0
        assert stats.drafted > 0  # the grammar's forced tokens, drafted before its drafts
    sampled = SamplingParams(temperature=1.0, seed=5)
    plain, _, _ = _decode(tiny, FLAGS, sampled)
    got, _, _ = _decode(tiny, FLAGS, sampled, RefusedDrafter(vocab, False), 4)
    assert got == plain  # deterministic drafts: coupled to plain sampling
    drawn, _, _ = _decode(tiny, FLAGS, sampled, RefusedDrafter(vocab, True), 4, n=200)
    valid(tiny.tokenizer.decode(drawn), FLAGS)  # drafts from a q: exact in distribution only


@pytest.mark.slow
def test_refused_q_draft_keeps_the_distribution(tiny):
    """A refused draft from a q is decided by the accept rule at its row (rejected, drawn from
    norm(max(0, p - q))), so the output keeps plain sampling's distribution: the value of "ok"
    (the first free choice, where the drafter's refused tokens land) is drawn as often true
    with and without the drafter, over many seeds."""
    from skulkp2p.engine.drafting.draft_model import vocab_size
    vocab = vocab_size(tiny.model)
    n = 250
    trues = {"plain": 0, "q": 0}
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        for kind, drafter in (("plain", None), ("q", RefusedDrafter(vocab, True))):
            out, _, _ = _decode(tiny, FLAGS, params, drafter, 2, n=8)
            text = tiny.tokenizer.decode(out)
            assert text.startswith('{"ok": ') and text[7] in "tf", text
            trues[kind] += text[7] == "t"
    share = {k: v / n for k, v in trues.items()}
    assert 0.02 < share["plain"] < 0.98, share  # a real choice to compare
    assert abs(share["plain"] - share["q"]) < 0.13, share  # about 3 standard deviations


@pytest.mark.parametrize("n", [2, 3])
def test_on_a_pipeline_ring_as_on_one_node(tiny_model, n):
    """The loop runs on the ring's last stage over the forward seam: the same constrained
    tokens as the whole model on one node, greedy and seeded, with and without drafts."""
    from tests.helpers.rings import Ring, full, stages
    path = tiny_model("llama", seed=0, mtp=True)
    whole = full(path)
    ring = Ring(stages(path, n)).last
    for sampling in (GREEDY, SamplingParams(temperature=1.0, seed=4)):
        alone = _run(whole, FLAGS, Speculation(mode="off"), sampling)
        valid(alone.text, FLAGS)
        for spec in (Speculation(mode="off"), DRAFTERS[0]):
            assert _run(ring, FLAGS, spec, sampling).tokens == alone.tokens, (n, spec)


def test_llama_server_child_gets_the_schema():
    from skulkp2p.served.served_engine import child_body
    req = GenerationRequest(prompt="x", response_format=schema_format(FLAGS))
    assert child_body(req, 16)["json_schema"] == FLAGS
    assert child_body(replace(req, response_format=ResponseFormat("json_object")),
                      16)["json_schema"] == {"type": "object"}
    assert "json_schema" not in child_body(GenerationRequest(prompt="x"), 16)


# --- SmolLM2 ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_path):
    from tests.helpers.loaded import smollm2_float32
    return smollm2_float32()


ASK = {
    "person": (PERSON, "Describe a person named Ann, aged 31, who likes tea and cats, as JSON."),
    "flags": (FLAGS, "Give a JSON object with ok, n, color, note and extra."),
    "nested": (NESTED, "List two todo items as JSON with id and done."),
}


@pytest.fixture(scope="module")
def smol_plain(smol):
    """``smol_plain(name)``: plain greedy decoding of ASK[name] under its schema (96 tokens),
    run once per module: the reference of several tests here."""
    done: dict[str, object] = {}

    def plain(name: str):
        if name not in done:
            schema, question = ASK[name]
            done[name] = _run(smol, schema, Speculation(mode="off"),
                              messages=(Message("user", question),), max_tokens=96)
        return done[name]
    return plain


# Every drafter on one schema, auto (lookup and the EAGLE head together) on the others: each
# drafter on each schema runs on the tiny models (test_tiny_greedy_and_seeded_spec_equal_plain).
SMOL_DRAFTERS = {"person": DRAFTERS, "flags": DRAFTERS[2:], "nested": DRAFTERS[2:]}


@pytest.mark.parametrize("name", list(ASK))
def test_smollm2_greedy_spec_equals_plain(smol, smol_plain, name):
    schema, question = ASK[name]
    msgs = (Message("user", question),)
    plain = smol_plain(name)
    assert plain.finish_reason == "stop", plain.text
    valid(plain.text, schema)
    for spec in SMOL_DRAFTERS[name]:
        got = _run(smol, schema, spec, messages=msgs, max_tokens=96)
        assert got.text == plain.text and got.tokens == plain.tokens, (spec, got.text)
        assert got.speculation is not None and got.speculation.accepted > 0


def test_smollm2_seeded_sampled_valid_and_coupled(smol):
    """One seed on SmolLM2 (two ran here before: 4 of this file's 96-token generations); the
    tiny models' test_tiny_greedy_and_seeded_spec_equal_plain runs two sampled settings with
    every drafter on every schema."""
    msgs = (Message("user", ASK["person"][1]),)
    for seed in (1,):
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        plain = _run(smol, PERSON, Speculation(mode="off"), sampling, messages=msgs,
                     max_tokens=96)
        assert plain.finish_reason == "stop"
        valid(plain.text, PERSON)
        got = _run(smol, PERSON, DRAFTERS[0], sampling, messages=msgs, max_tokens=96)
        assert got.tokens == plain.tokens


def test_grammar_compiles_every_test_schema():
    for schema in SCHEMAS:
        assert compile_format(schema_format(schema))


# --- through the HTTP server, with the real openai client ---------------------------------------

@pytest.fixture(scope="module")
def served(smol):
    from skulkp2p.engine.runner.mlx_engine import MlxEngine
    from tests.helpers.fake_engine import LiveNode
    node = LiveNode(engine=MlxEngine(smol, max_batch=2), model_id="smol", max_queue=8,
                    keepalive_s=5, max_body_bytes=1 << 16, idle_timeout=30, body_timeout=30)
    node.wait_ready()
    yield node
    node.close()


@pytest.fixture
def oai(served):
    import openai
    return openai.OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_openai_chat_json_schema(oai, smol_plain):
    schema, question = ASK["person"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                  "strict": True}}
    msgs = [{"role": "user", "content": question}]
    r = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=96,
                                    temperature=0, response_format=fmt)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    valid(text, schema)
    assert text == smol_plain("person").text
    chunks = list(oai.chat.completions.create(model="smol", messages=msgs, max_tokens=96,
                                              temperature=0, response_format=fmt,
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    short = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=5,
                                        temperature=0, response_format=fmt)
    assert short.choices[0].finish_reason == "length"
    obj = oai.chat.completions.create(model="smol", messages=msgs, max_tokens=64,
                                      temperature=0, response_format={"type": "json_object"})
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # (a long string value: cut at max_tokens, inside the object)
        assert obj.choices[0].finish_reason == "length" and content.startswith("{")


def test_openai_concurrent_rows_each_hold_their_schema(oai, smol_plain):
    """Two constrained requests decode as rows of one batch, each with its own matcher, and
    each gives what it gives alone."""
    out: dict[str, str] = {}

    def ask(name: str) -> None:
        schema, question = ASK[name]
        r = oai.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": question}], max_tokens=96,
            temperature=0, response_format={"type": "json_schema", "json_schema": {
                "name": name, "schema": schema}})
        out[name] = r.choices[0].message.content
    threads = [threading.Thread(target=ask, args=(n,)) for n in ("person", "nested")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(out) == {"person", "nested"}
    for name, text in out.items():
        valid(text, ASK[name][0])
        assert text == smol_plain(name).text, name  # what it gives alone


def test_openai_responses_text_format(oai):
    schema, question = ASK["flags"]
    r = oai.responses.create(model="smol", input=question, max_output_tokens=96,
                             temperature=0, text={"format": {
                                 "type": "json_schema", "name": "flags", "schema": schema,
                                 "strict": True}})
    valid(r.output_text, schema)
    assert r.text.format.type == "json_schema"


def test_pipe_response_format(smol):
    """The JSONL pipe's session, line in, result out, on the real engine."""
    from skulkp2p.engine.runner.mlx_engine import MlxEngine
    from skulkp2p.models.store import ModelStore
    from skulkp2p.pipe import PipeSession
    from tests.helpers.models import test_data_dir

    session = PipeSession(ModelStore(test_data_dir()), "smollm2-135m",
                          lambda store, spec: MlxEngine(smol, max_batch=1))
    schema, question = ASK["nested"]
    line = {"id": 7, "messages": [{"role": "user", "content": question}], "max_tokens": 96,
            "response_format": {"type": "json_schema", "json_schema": {"name": "todo",
                                                                      "schema": schema}}}
    out = session.handle_line(json.dumps(line))
    assert out["id"] == 7 and out["finish_reason"] == "stop", out
    valid(out["text"], schema)
    line["response_format"] = {"type": "json_schema", "json_schema": {
        "name": "todo", "schema": {"type": "array", "uniqueItems": True}}}
    err = session.handle_line(json.dumps(line))["error"]
    assert err["param"] == "response_format.json_schema.schema.uniqueItems", err
    session.close()


def test_openai_bad_schema_is_a_400(oai):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}})
    assert e.value.status_code == 400
    assert e.value.body["param"] == "response_format.json_schema.schema.properties.a.uniqueItems"
    assert "uniqueItems" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="smol", input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "intger"}}})
    assert e.value.status_code == 400


# --- the constrained round's shortcuts ---------------------------------------------------------

def _masked_argmax_decode(lm, schema: dict, n: int = 60) -> list[int]:
    """Constrained greedy decoding one token a forward, every row fully masked: the reference
    the loop's shortcuts (a row's own greedy token where the grammar allows it, the mask built
    only where it does not; forced tokens drafted past the drafter's depth) must keep."""
    import mlx.core as mx

    from skulkp2p.engine.decode.sampling import greedy_token
    g = _grammar(lm, schema)
    fwd = LocalForward(lm.model, 64)
    prompt = list(lm.tokenizer.encode("hello"))
    eos = set(lm.tokenizer.eos_token_ids)
    fwd.prefill(prompt[:-1])
    pending, out = prompt[-1], []
    while len(out) < n:
        row = fwd([pending])[0:1]
        allowed = g.mask()
        allowed = np.concatenate([allowed, np.zeros(row.shape[-1] - allowed.shape[0], bool)])
        token = greedy_token(mx.where(mx.array(allowed)[None, :], row,
                                      mx.array(-np.inf, dtype=row.dtype)))
        g.accept(token)
        if token in eos:
            break
        out.append(token)
        pending = token
    return out


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "flags", "nested"])
def test_greedy_shortcuts_equal_fully_masked_decoding(tiny, schema):
    want = _masked_argmax_decode(tiny, schema)
    for drafter, depth in ((None, 0), (RefusedDrafter(vocab_size_of(tiny), False), 2)):
        got, stats, _ = _decode(tiny, schema, SamplingParams(), drafter, depth)
        assert got == want, (drafter, tiny.tokenizer.decode(got), tiny.tokenizer.decode(want))
    # depth 2, yet whole runs of forced tokens (a key and its punctuation) go in one draft
    assert len(stats.drafted_at) > 2


def test_forced_after_looks_ahead_without_consuming(tiny):
    g = _grammar(tiny, PERSON)
    first = g.forced()
    ids = first + list(tiny.tokenizer.encode('"Al"', add_special_tokens=False))
    assert g.valid_prefix(ids) == len(ids)
    after = g.forced_after(ids)
    assert tiny.tokenizer.decode(after).startswith(', "age": ')
    assert g.accepted == 0 and g.forced() == first  # nothing consumed
    assert g.forced_after([*ids, *after]) == []  # the age is the model's to choose
    bad = list(tiny.tokenizer.encode("nope", add_special_tokens=False))
    assert g.forced_after(bad) == []


def vocab_size_of(lm) -> int:
    from skulkp2p.engine.drafting.draft_model import vocab_size
    return vocab_size(lm.model)


# --- values copied from the text -----------------------------------------------------------------

def test_space_blind_lookup_copies_a_value_after_a_quote(tiny):
    """Inside a JSON string a copied word follows the quote, not a space: its first token
    differs from the text's (" Rot" there, "Rot" here), yet the rest is drafted from the text,
    in the text's own tokens; a one-token key drafts at most MAX_DRAFT_ONE_KEY, a longer one
    up to MAX_DRAFT."""
    from skulkp2p.engine.decode.value_copy import MAX_DRAFT_ONE_KEY, SpaceBlindLookup

    copier = SpaceBlindLookup(_grammar(tiny, PERSON).tokenizer)
    tok = _grammar(tiny, PERSON).tokenizer
    spaced, bare = next(iter(copier.classes.items()))
    assert tok.decode_bytes([spaced]) == b" " + tok.decode_bytes([bare])
    plain_ids = [t for t in range(300, 400) if t not in copier.classes
                 and t not in copier.classes.values()][:12]
    text, rest, quote = plain_ids[:2], plain_ids[2:10], plain_ids[10]
    history = [*text, spaced, *rest, quote, bare]  # the text, then the copy's first token
    got = copier.propose(history, 16)
    assert got == rest[:MAX_DRAFT_ONE_KEY]
    assert copier.propose(history + got[:2], 16) == rest[2:] + [quote, bare, *got[:2]]
    assert copier.propose(history, 0) == [] and copier.propose([quote, text[0]], 4) == []


def test_smollm2_copied_values_are_drafted_and_exact(smol):
    """An extraction whose values are copied from the prompt: the copier drafts them (values
    after a forced key), and greedy output is constrained plain decoding's token for token, with
    each drafter. (Sampled: copies are deterministic drafts, decided by plain sampling's own draw
    at each row: test_tiny_greedy_and_seeded_spec_equal_plain runs them seeded.)"""
    from skulkp2p.engine.runner.generate import constraint, prompt_tokens
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "ceo": {"type": "string", "maxLength": 20},
        "employees": {"type": "integer"}},
        "required": ["city", "ceo", "employees"], "additionalProperties": False}
    req = GenerationRequest(messages=(Message("user", (
        "Extract city, ceo and employees as JSON. Text: The city is Rotterdam, the CEO is "
        "Mila Jansen and the company employs 240 people.")),),
        response_format=schema_format(schema))
    prompt = prompt_tokens(smol, req)
    eos = set(smol.tokenizer.eos_token_ids)

    def decoded(params, drafter, depth):
        stats = DecodeStats()
        out = []
        for t in decode(LocalForward(smol.model, 256), prompt, params, 40,
                        make_rng(params.seed), drafter, depth, stats,
                        grammar=constraint(smol, req)):
            if t in eos:
                break
            out.append(t)
        return out, stats

    plain, _ = decoded(GREEDY, None, 0)
    valid(smol.tokenizer.decode(plain), schema)
    for drafter in (RefusedDrafter(vocab_size_of(smol), False), _lookup_of(smol)):
        got, stats = decoded(GREEDY, drafter, 8)
        assert got == plain, (drafter, smol.tokenizer.decode(got))
        assert stats.copied > 0 and stats.accepted > 0


def _lookup_of(lm):
    from skulkp2p.engine.runner.generate import _lookup
    return _lookup(lm, 2)
