import pytest

from skulkp2p.engine.request import RequestError, parse_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_defaults():
    r = parse_request(dict(CHAT))
    assert r.sampling.greedy and r.speculation.mode == "auto" and r.stop == ()


def test_fields():
    r = parse_request({"prompt": "x", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                       "top_k": 40, "min_p": 0.05, "seed": 3, "stop": ["\n"],
                       "repetition_penalty": 1.1, "speculation": {"drafter": "lookup", "depth": 3}})
    assert r.max_tokens == 5 and r.sampling.top_k == 40 and r.stop == ("\n",)
    assert r.speculation.drafter == "lookup" and r.speculation.depth == 3


def test_content_parts():
    r = parse_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert r.messages[0]["content"] == "ab"


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": 3}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"speculation": "fast"}, "speculation"),
    ({"speculation": {"drafter": "oracle"}}, "speculation"),
    ({"speculation": {"drafter": "lookup", "depth": 0}}, "depth"),
    ({"n": 2}, "n"),
    ({"model": 7}, "model"),
])
def test_bad_fields_named(extra, param):
    with pytest.raises(RequestError) as e:
        parse_request({**CHAT, **extra})
    assert e.value.param == param


@pytest.mark.parametrize("obj", [
    [], "x", {}, {"messages": []}, {"messages": [{"role": "bot", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"prompt": ""},
    {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
])
def test_bad_shapes(obj):
    with pytest.raises(RequestError):
        parse_request(obj)
