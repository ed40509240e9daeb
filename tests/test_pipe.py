"""The JSONL pipe as a user runs it: a real subprocess, real stdin/stdout."""

import json

import pytest

from tests.helpers.procs import run_cli


def pipe(model, lines, args=(), **kw):
    proc = run_cli("pipe", "--model", str(model), *args,
                   input="".join(line + "\n" for line in lines), **kw)
    return proc, [json.loads(line) for line in proc.stdout.splitlines()]


BAD_LINES = [
    "this is not json",
    json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    json.dumps({"id": "b", "prompt": "x", "max_tokens": "four"}),
    json.dumps({"id": "c", "prompt": "x", "model": "no-such-model"}),
    json.dumps([1, 2, 3]),
    json.dumps({"id": "d", "prompt": "x", "temperature": "hot"}),
    json.dumps({"id": "e", "prompt": "x", "speculation": {"drafter": "oracle"}}),
    json.dumps({"id": "f", "prompt": "hello", "max_tokens": 3}),
    json.dumps({"id": "g", "prompt": "x", "speculation": {"drafter": "mtp", "depth": 2}}),
    json.dumps({"id": "h", "prompt": "x", "speculation": {"drafter": "draft"}}),
]


@pytest.fixture(scope="module")
def errors_pipe(tiny_models, tmp_path_factory):
    """One pipe on the tiny llama for the two tests below: the bad lines, then a request for a
    model that fails to load and one after it. (proc, answers to the bad lines, the rest.)"""
    broken = tmp_path_factory.mktemp("pipe") / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no weights
    load_lines = [json.dumps({"id": "a", "prompt": "x", "model": str(broken)}),
                  json.dumps({"id": "b", "prompt": "hello", "max_tokens": 2})]
    proc, out = pipe(tiny_models["llama"], BAD_LINES + load_lines)
    return proc, out[:len(BAD_LINES)], out[len(BAD_LINES):]


@pytest.mark.process
def test_pipe_bad_lines_get_errors_and_pipe_goes_on(errors_pipe):
    proc, out, rest = errors_pipe
    assert proc.returncode == 0, proc.stderr
    assert len(out) == len(BAD_LINES) and len(rest) == 2
    assert out[0]["error"]["type"] == "invalid_json" and "id" not in out[0]
    assert out[1]["id"] == "a" and len(out[1]["tokens"]) == 4 and out[1]["finish_reason"] == "length"
    assert out[2]["id"] == "b" and out[2]["error"]["param"] == "max_tokens"
    assert out[3]["id"] == "c" and out[3]["error"]["type"] == "model_not_found"
    assert "no-such-model" in out[3]["error"]["message"]
    assert "error" in out[4]
    assert out[5]["error"]["param"] == "temperature"
    assert out[6]["error"]["param"] == "speculation"
    assert out[7]["id"] == "f" and out[7]["usage"]["completion_tokens"] == 3
    assert out[8]["error"]["param"] == "speculation" and "no MTP head" in out[8]["error"]["message"]
    assert out[9]["error"]["param"] == "speculation" and "no draft model" in out[9]["error"][
        "message"]


@pytest.mark.process
def test_a_model_that_fails_to_load_is_a_clear_error_per_line_and_the_pipe_goes_on(
        errors_pipe):
    proc, _, out = errors_pipe
    assert proc.returncode == 0, proc.stderr
    assert out[0]["id"] == "a" and out[0]["error"]["type"] == "model_load_failed"
    assert out[0]["error"]["param"] == "model" and "broken could not be loaded" in out[0][
        "error"]["message"]
    assert out[1]["id"] == "b" and out[1]["usage"]["completion_tokens"] == 2
    assert "Traceback" not in proc.stderr


@pytest.mark.process
def test_pipe_empty_stdin(tiny_models):
    proc, out = pipe(tiny_models["llama"], [])
    assert proc.returncode == 0 and out == []


@pytest.mark.process
def test_pipe_unknown_model_flag_fails_once():
    proc = run_cli("pipe", "--model", "no-such-model", input="")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'no-such-model'" in lines[0]


@pytest.mark.process
def test_pipe_prompt_too_long(tiny_models):
    prompt = "word " * 3000  # the tiny models take 512 positions
    proc, out = pipe(tiny_models["qwen3"], [json.dumps({"id": 1, "prompt": prompt})])
    assert out[0]["id"] == 1 and "prompt is" in out[0]["error"]["message"]


@pytest.mark.process
def test_pipe_prefix_cache_flag(tiny_models):
    """The second of two requests on one document reuses the first's caches (usage says how
    many prompt tokens), decodes the same tokens as without the cache; 0 MB turns it off.
    (The disk cache is off: an earlier run's entries on disk would serve the first request.)"""
    doc = "The survey counted birds along the river every spring. " * 20
    lines = [json.dumps({"id": i, "prompt": doc + q, "max_tokens": 8})
             for i, q in enumerate(("Where?", "Where?", "When?"))]
    runs = {mb: pipe(tiny_models["llama"], lines,
                     args=("--prefix-cache-mb", mb, "--prefix-cache-disk-gb", "0"))
            for mb in ("64", "0")}
    for proc, _ in runs.values():
        assert proc.returncode == 0, proc.stderr
    on, off = runs["64"][1], runs["0"][1]
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off]
    assert [r["usage"]["cached_tokens"] for r in off] == [0, 0, 0]
    assert on[0]["usage"]["cached_tokens"] == 0
    assert on[1]["usage"]["cached_tokens"] == on[1]["usage"]["prompt_tokens"] - 1
    assert 0 < on[2]["usage"]["cached_tokens"] < on[2]["usage"]["prompt_tokens"]
    bad = run_cli("pipe", "--model", str(tiny_models["llama"]), "--prefix-cache-mb", "-1",
                  input="")
    assert bad.returncode == 2 and "--prefix-cache-mb" in bad.stderr


@pytest.mark.process
@pytest.mark.parametrize("value", ["0", "-2", "four", "1.5", "100000"])
def test_pipe_and_join_refuse_a_bad_max_batch(tiny_models, value):
    for command in ("pipe", "join"):
        bad = run_cli(command, "--model", str(tiny_models["llama"]), "--max-batch", value,
                      input="")
        assert bad.returncode == 2, bad.stderr
        assert f"--max-batch: must be a whole number from 1 to 256, got {value!r}" in bad.stderr


@pytest.mark.process
def test_pipe_max_batch_flag_runs(tiny_models):
    """--max-batch reaches the engine factory; the pipe answers the same with any value."""
    lines = [json.dumps({"id": i, "prompt": p, "max_tokens": 6})
             for i, p in enumerate(("One two", "Three four"))]
    runs = [pipe(tiny_models["llama"], lines, args=("--max-batch", n)) for n in ("1", "3")]
    for proc, _ in runs:
        assert proc.returncode == 0, proc.stderr
    assert [r["tokens"] for r in runs[0][1]] == [r["tokens"] for r in runs[1][1]]


@pytest.mark.process
@pytest.mark.slow
def test_smollm2_pipe(smollm2_path, tmp_path):
    """The real default model: chat and raw prompts, greedy equal to mlx-lm, stops, seeds."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    lines = [
        json.dumps({"id": "chat", "messages": chat, "max_tokens": 40}),
        json.dumps({"id": "raw", "prompt": "The three primary colors are", "max_tokens": 16}),
        json.dumps({"id": "stop", "messages": chat, "max_tokens": 40, "stop": ["Paris"]}),
        json.dumps({"id": "s1", "messages": chat, "max_tokens": 8, "temperature": 0.8,
                    "seed": 42}),
        json.dumps({"id": "s2", "messages": chat, "max_tokens": 8, "temperature": 0.8,
                    "seed": 42}),
    ]
    env = {"SKULKP2P_DATA_DIR": str(smollm2_path.parent.parent), "SKULKP2P_DTYPE": "bfloat16"}
    proc, out = pipe("smollm2-135m", lines, ["--engine", "mlx"], env=env)
    assert proc.returncode == 0, proc.stderr
    res = {r["id"]: r for r in out}
    assert "Paris" in res["chat"]["text"]
    assert res["stop"]["finish_reason"] == "stop" and "Paris" not in res["stop"]["text"]
    assert res["chat"]["text"].startswith(res["stop"]["text"])
    assert res["s1"]["tokens"] == res["s2"]["tokens"] and len(res["s1"]["tokens"]) == 8

    model, tok = load(str(smollm2_path))
    for rid, prompt in (("chat", tok.apply_chat_template(chat, add_generation_prompt=True)),
                        ("raw", tok.encode("The three primary colors are"))):
        ref = []
        for r in stream_generate(model, tok, mx.array(prompt), max_tokens=len(res[rid]["tokens"])):
            if r.token in tok.eos_token_ids:
                break
            ref.append(r.token)
        assert res[rid]["tokens"] == ref, rid
