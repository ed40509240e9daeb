"""API keys and node signatures (api/auth.py), on real sockets with the real clients.

In-process (the quick tier): the one-model app with a scripted engine behind keys: every route
with no key, a wrong key and the right key, raw and through the real `openai` and `anthropic`
clients; open reads; 100-continue; a request marked as forwarded, signed, forged, replayed or
changed; every log line the server writes checked for the keys.

Real processes: a keyed `join` (HTTP on 0.0.0.0, keys from --api-key and a keys file) through
both clients, place and generate, and a headless Chromium that asks for the key once; two keyed
nodes on 127.0.0.x forwarding to each other with the cluster secret, and `pipe --peer` with a
key; the refusal of HTTP beyond loopback without a key (exit status, one stderr line) and its
acceptance with --insecure-http; a keys file that cannot be read or holds no key. Every log
line of every node is checked for the keys. Every pid is killed at the end."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from skulkp2p.api.auth import (
    FORWARDED_HEADER,
    NODE_AUTH_HEADER,
    ApiKeys,
    AuthPolicy,
    NodeAuth,
    check_key,
    presented_keys,
)
from skulkp2p.api.http import Headers
from tests.helpers.browser import Browser, BrowserError, chromium_binary
from tests.helpers.fake_engine import LiveNode, Script, chat
from tests.helpers.http_client import H11Client, call, parse_responses, raw_exchange, status_of
from tests.helpers.procs import SECRET, JoinNode, ProcCluster, loopback_ips_usable, run_cli

KEY = "skulk-test-key-7f3a9c1e5b2d4068"
KEY2 = "skulk-file-key-19c0e7d2a4b65f83"  # from a keys file
WRONG = "skulk-wrong-key-0b8e6d4c2a197f35"
SECRETS = (KEY, KEY2, WRONG)
BEARER = {"Authorization": f"Bearer {KEY}"}

# Each route the one-model app serves, a body for it, and whether it asks for a key.
ROUTES = [
    ("GET", "/health", None, False),
    ("GET", "/", None, False),
    ("GET", "/dashboard.js", None, False),
    ("GET", "/dashboard.css", None, False),
    ("GET", "/v1/models", None, True),
    ("GET", "/metrics", None, True),
    ("GET", "/v1/stats", None, True),
    ("POST", "/v1/chat/completions", chat("tokens=2"), True),
    ("POST", "/v1/completions", {"model": "fake", "prompt": "tokens=2", "max_tokens": 2},
     True),
    ("POST", "/v1/responses", {"model": "fake", "input": "tokens=2"}, True),
    ("POST", "/v1/messages", {"model": "fake", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "tokens=2"}]}, True),
]


def no_secret_in(lines: list[str], where: str) -> None:
    for line in lines:
        for secret in SECRETS:
            assert secret not in line, f"a key in {where}: {line[:300]}"


@pytest.fixture
def logs():
    """Every log line any logger writes while the test runs (DEBUG and up, with tracebacks);
    afterwards none may hold a key."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Keep(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    no_secret_in(lines, "a log line of the in-process server")


def keyed(**policy) -> LiveNode:
    node = LiveNode(Script(), auth=AuthPolicy(ApiKeys([KEY]), **policy), max_body_bytes=65536)
    node.wait_ready()
    return node


@pytest.fixture
def node(logs):
    n = keyed()
    yield n
    n.close()


# ---------------------------------------------------------------- the pieces


def test_keys_are_matched_against_every_key_and_read_from_either_header():
    keys = ApiKeys([KEY, KEY2])
    assert keys.matches(KEY) and keys.matches(KEY2)
    assert not keys.matches(WRONG) and not keys.matches(KEY[:-1]) and not keys.matches("")
    assert not ApiKeys().matches(KEY) and len(ApiKeys()) == 0
    h = Headers([("authorization", f"bearer {KEY}"), ("x-api-key", f" {KEY2} "),
                 ("authorization", "Basic dXNlcjpwYXNz"), ("authorization", "Bearer ")])
    assert presented_keys(h) == [KEY, KEY2]
    for bad in ("short", "has a space in it ok", "x" * 4097, "tab\tinside-a-long-key"):
        with pytest.raises(ValueError) as e:
            check_key(bad)
        assert bad not in str(e.value)  # the message never quotes the key
    assert check_key(KEY) == KEY


def test_a_node_signature_holds_only_for_what_was_signed():
    clock = [1_000_000.0]
    signer = NodeAuth(SECRET, clock=lambda: clock[0])
    receiver = NodeAuth(SECRET, clock=lambda: clock[0])
    args = ("POST", "/v1/chat/completions", "127.0.0.1:8000")
    value = signer.sign(*args, b"{}")
    digest = receiver.verify(*args, value)
    assert NodeAuth.body_matches(digest, b"{}") and not NodeAuth.body_matches(digest, b"{ }")
    with pytest.raises(Exception, match="a replay"):
        receiver.verify(*args, value)
    for method, target, host in (("GET", args[1], args[2]), ("POST", "/v1/messages", args[2]),
                                 ("POST", args[1], "127.0.0.1:8001")):
        with pytest.raises(Exception, match="does not match"):
            receiver.verify(method, target, host, signer.sign(*args, b"{}"))
    with pytest.raises(Exception, match="does not match"):
        receiver.verify(*args, NodeAuth("another secret", clock=lambda: clock[0]).sign(
            *args, b"{}"))
    with pytest.raises(Exception, match="malformed"):
        receiver.verify(*args, "sig=00")
    old = signer.sign(*args, b"{}")
    clock[0] += 61
    with pytest.raises(Exception, match="outside the 60 s window"):
        receiver.verify(*args, old)
    # The nonces of requests out of the window are forgotten (memory stays bounded).
    assert len(receiver._seen) == 1
    receiver.verify(*args, signer.sign(*args, b""))
    assert len(receiver._seen) == 1
    full = NodeAuth(SECRET, clock=lambda: clock[0], max_nonces=1)
    full.verify(*args, signer.sign(*args, b""))
    with pytest.raises(Exception, match="too many"):
        full.verify(*args, signer.sign(*args, b""))


# ---------------------------------------------------------------- the in-process server


def _expect_401(r, path: str, code: str) -> None:
    assert r.status == 401, (path, r.status, r.body[:300])
    assert r.headers["www-authenticate"] == "Bearer"
    body = r.json()
    if path == "/v1/messages":  # Anthropic's shape
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == code, body


def test_every_route_without_a_key_with_a_wrong_key_and_with_the_right_key(node, logs):
    with H11Client(node.port) as c:  # one keep-alive connection: a 401 keeps it usable
        for method, path, body, needs_key in ROUTES:
            r = c.request(method, path, body)
            if needs_key:
                _expect_401(r, path, "missing_api_key")
            else:
                assert r.status == 200, (path, r.status)
            r = c.request(method, path, body, [("Authorization", f"Bearer {WRONG}")])
            if needs_key:
                _expect_401(r, path, "invalid_api_key")
            for header in (("Authorization", f"Bearer {KEY}"), ("x-api-key", KEY)):
                r = c.request(method, path, body, [header])
                assert r.status == 200, (path, header[0], r.status, r.body[:300])
            if method == "GET":  # HEAD asks what its GET asks
                r = c.request("HEAD", path)
                assert r.status == (401 if needs_key else 200), path
        # A route nobody serves: 401 to a stranger, 404 to a client with a key.
        _expect_401(c.request("GET", "/v1/nope"), "/v1/nope", "missing_api_key")
        assert c.request("GET", "/v1/nope", None, [("x-api-key", KEY)]).status == 404
        # A wrong method on an open path says what it takes.
        assert c.request("POST", "/health", b"{}").status == 405
    assert any("/v1/models -> 401" in line for line in logs), logs  # (the capture works)


def test_the_real_clients_raise_their_authentication_errors(node):
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=f"{node.base}/v1", api_key=WRONG, max_retries=0, timeout=30)
    ant = anthropic.Anthropic(base_url=node.base, api_key=WRONG, max_retries=0, timeout=30)
    ask = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "tokens=2"}]}
    for headers in ({}, {"Authorization": openai.Omit()}):  # a wrong key, then none at all
        with pytest.raises(openai.AuthenticationError) as e:
            oai.chat.completions.create(**ask, extra_headers=headers)
        assert e.value.status_code == 401 and e.value.code in ("invalid_api_key",
                                                                "missing_api_key")
        with pytest.raises(openai.AuthenticationError):
            oai.models.list(extra_headers=headers)
    for headers in ({}, {"X-Api-Key": anthropic.Omit(), "Authorization": anthropic.Omit()}):
        with pytest.raises(anthropic.AuthenticationError) as e2:
            ant.messages.create(**ask, extra_headers=headers)
        assert e2.value.body["error"]["type"] == "authentication_error"
    oai = openai.OpenAI(base_url=f"{node.base}/v1", api_key=KEY, max_retries=0, timeout=30)
    assert oai.chat.completions.create(**ask).choices[0].message.content == "w0 w1 "
    assert [m.id for m in oai.models.list().data] == ["fake"]
    chunks = oai.chat.completions.create(**ask, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "w0 w1 "
    ant = anthropic.Anthropic(base_url=node.base, api_key=KEY, max_retries=0, timeout=30)
    assert ant.messages.create(**ask).content[0].text == "w0 w1 "


def test_open_reads_leave_generation_keyed(logs):
    n = keyed(open_reads=True)
    try:
        with H11Client(n.port) as c:
            for path in ("/v1/models", "/v1/stats", "/metrics"):
                assert c.request("GET", path).status == 200, path
            _expect_401(c.request("POST", "/v1/chat/completions", chat("tokens=1")),
                        "/v1/chat/completions", "missing_api_key")
            assert c.request("POST", "/v1/chat/completions", chat("tokens=1"),
                             [("x-api-key", KEY)]).status == 200
    finally:
        n.close()


def test_a_request_without_a_key_is_refused_before_its_body(node):
    raw = raw_exchange(node.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"Expect: 100-continue\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 60000\r\n\r\n")
    assert b"100 Continue" not in raw
    (r,) = parse_responses(raw)
    assert r.status == 401 and r.headers["connection"] == "close"
    # Without Expect the body is read and dropped; the connection serves the next request.
    body = b'{"pad": "' + b"x" * 50000 + b'"}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    raw = raw_exchange(node.port, head + body + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                b"Connection: close\r\n\r\n")
    assert [r.status for r in parse_responses(raw)] == [401, 200]


def _signed(auth: NodeAuth, port: int, body: bytes, path: str = "/v1/chat/completions",
            host: str | None = None) -> list[tuple[str, str]]:
    """The headers of a request to 127.0.0.1:`port` signed for `path` and `host` (this
    server's by default)."""
    return [("Host", f"127.0.0.1:{port}"), (FORWARDED_HEADER, "1"),
            (NODE_AUTH_HEADER, auth.sign("POST", path, host or f"127.0.0.1:{port}", body))]


def _post(port: int, headers: list[tuple[str, str]], body: bytes,
          path: str = "/v1/chat/completions"):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        lines = [f"POST {path} HTTP/1.1", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", "Connection: close",
                 *(f"{k}: {v}" for k, v in headers)]
        if not any(k.lower() == "host" for k, _ in headers):
            lines.append("Host: 127.0.0.1")
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    (r,) = parse_responses(raw)
    return r


def test_a_request_marked_forwarded_must_carry_a_node_signature(logs):
    n = keyed(node=NodeAuth(SECRET))
    try:
        body = json.dumps(chat("tokens=2")).encode()
        ours = NodeAuth(SECRET)
        # Signed by a node of the cluster: served, without a user key.
        signed = _signed(ours, n.port, body)
        r = _post(n.port, signed, body)
        assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == "w0 w1 "
        refused = {
            "replayed": (signed, body),
            "marked, unsigned, with the user's key": (
                [(FORWARDED_HEADER, "1"), ("Authorization", f"Bearer {KEY}")], body),
            "forged": ([(FORWARDED_HEADER, "1"), (NODE_AUTH_HEADER, f"ts={int(time.time())},"
                        f"nonce={'0' * 32},body={'0' * 64},sig={'0' * 64}")], body),
            "another secret": (_signed(NodeAuth("not the cluster secret"), n.port, body), body),
            "another body": (_signed(ours, n.port, body), body.replace(b"tokens=2", b"tokens=9")),
            "another node's Host": (_signed(ours, n.port, body, host=f"localhost:{n.port}"),
                                    body),
            "another route": (_signed(ours, n.port, body, path="/v1/completions"), body),
        }
        for why, (headers, sent) in refused.items():
            r = _post(n.port, headers, sent)
            assert r.status == 401, (why, r.status, r.body[:300])
            assert r.json()["error"]["code"] == "invalid_node_auth", (why, r.json())
        # A plain request with the user's key is served as ever.
        assert _post(n.port, [("Authorization", f"Bearer {KEY}")], body).status == 200
    finally:
        n.close()


def test_a_node_without_keys_still_checks_node_signatures(logs):
    """No keys (a node on loopback): every route is open, but what claims to come from a node
    of the cluster still has to prove it."""
    n = LiveNode(Script(), auth=AuthPolicy(node=NodeAuth(SECRET)))
    try:
        n.wait_ready()
        body = json.dumps(chat("tokens=1")).encode()
        assert _post(n.port, [], body).status == 200
        assert _post(n.port, [(FORWARDED_HEADER, "1")], body).status == 401
        assert _post(n.port, _signed(NodeAuth(SECRET), n.port, body), body).status == 200
    finally:
        n.close()


def test_keys_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    from skulkp2p.cli import CliError, _api_keys, build_parser

    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# the team's keys\n\n  {KEY2}  \n# {WRONG} (revoked)\n")

    def keys(*argv: str) -> list[str]:
        return _api_keys(build_parser().parse_args(["join", *argv]))

    monkeypatch.setenv("SKULKP2P_API_KEY", f"{WRONG}, {KEY} ,")
    assert keys() == [WRONG, KEY]  # the variable, comma-separated
    assert keys("--api-key", KEY, "--api-keys-file", str(keys_file)) == [KEY, KEY2]  # flags win
    monkeypatch.setenv("SKULKP2P_API_KEY", "short")
    with pytest.raises(CliError) as e:
        keys()
    assert "SKULKP2P_API_KEY, entry 1" in str(e.value) and "short" not in str(e.value)
    monkeypatch.delenv("SKULKP2P_API_KEY")
    assert keys() == []
    bad = tmp_path / "bad"
    bad.write_text(f"{KEY}\nnot a key\n")
    with pytest.raises(CliError, match="line 2"):
        keys("--api-keys-file", str(bad))
    with pytest.raises(SystemExit):  # argparse refuses a bad --api-key (exit status 2)
        keys("--api-key", "short")


# ---------------------------------------------------------------- real processes


def _clean_env(monkeypatch) -> None:
    for name in ("SKULKP2P_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.process
def test_http_beyond_loopback_without_a_key_is_refused_at_start(tiny_models, tmp_path,
                                                                monkeypatch):
    _clean_env(monkeypatch)
    model = str(tiny_models["llama"])
    for host in ("0.0.0.0", "::"):
        r = run_cli("join", "--model", model, "--data-dir", str(tmp_path), "--http-host", host,
                    "--http-port", "0", timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (r.returncode, r.stderr)
        assert lines[0].startswith(f"skulkp2p: error: refusing to serve HTTP on {host} "
                                   "without an API key")
        assert "--api-key" in lines[0] and "SKULKP2P_API_KEY" in lines[0] \
            and "--insecure-http" in lines[0]
    for content in (None, "# only a comment\n\n"):
        path = tmp_path / ("missing" if content is None else "empty")
        if content is not None:
            path.write_text(content)
        r = run_cli("join", "--model", model, "--api-keys-file", str(path), timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert f"--api-keys-file {path}" in lines[0]
        assert ("cannot read" if content is None else "holds no key") in lines[0]


@pytest.mark.process
def test_insecure_http_serves_beyond_loopback_without_a_key(tiny_models, tmp_path,
                                                            monkeypatch):
    _clean_env(monkeypatch)
    node = JoinNode(str(tiny_models["llama"]), tmp_path, "--data-dir", str(tmp_path),
                    "--http-host", "0.0.0.0", "--insecure-http")
    try:
        with H11Client(node.port) as c:
            assert c.request("GET", "/v1/models").status == 200  # open, as it was told
        assert "without an API key (--insecure-http)" in node.text()
    finally:
        assert node.stop() == 0, node.text()[-3000:]


@pytest.fixture(scope="module")
def keyed_node(tiny_models, tmp_path_factory):
    """A `join` on every address (0.0.0.0) with two keys (--api-key and a keys file), logging
    at debug level; its whole log is checked for keys when the module is done."""
    tmp = tmp_path_factory.mktemp("keyed")
    keys_file = tmp / "keys.txt"
    keys_file.write_text(f"# keys for the tests\n{KEY2}\n")
    with pytest.MonkeyPatch.context() as mp:
        _clean_env(mp)
        n = JoinNode(str(tiny_models["llama"]), tmp, "--data-dir", str(tmp), "--http-host",
                     "0.0.0.0", "--api-key", KEY, "--api-keys-file", str(keys_file),
                     log_level="debug")
    yield n
    assert n.stop() == 0, n.text()[-3000:]
    no_secret_in(n.text().splitlines(), "the keyed node's log")
    assert "http: refused requests (401)" in n.text()


@pytest.mark.process
def test_a_keyed_node_through_the_real_clients(keyed_node):
    import anthropic
    import openai

    base = keyed_node.base
    ask = {"model": "llama", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
           "extra_body": {"speculation": "off"}}
    for key in (WRONG, None):
        oai = openai.OpenAI(base_url=f"{base}/v1", api_key=key or "unused", max_retries=0,
                            timeout=60)
        headers = {"Authorization": openai.Omit()} if key is None else {}
        with pytest.raises(openai.AuthenticationError):
            oai.chat.completions.create(**ask, extra_headers=headers)
        with pytest.raises(openai.AuthenticationError):
            oai.models.list(extra_headers=headers)
        ant = anthropic.Anthropic(base_url=base, api_key=key or "unused", max_retries=0,
                                  timeout=60)
        headers = {"X-Api-Key": anthropic.Omit(), "Authorization": anthropic.Omit()} \
            if key is None else {}
        with pytest.raises(anthropic.AuthenticationError) as e:
            ant.messages.create(model="llama", max_tokens=4, extra_headers=headers,
                                messages=[{"role": "user", "content": "Hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
    for key in (KEY, KEY2):  # the flag's key and the file's
        oai = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in oai.models.list().data] == ["llama"]
        r = oai.chat.completions.create(**ask)
        assert r.usage.completion_tokens == 4
        ant = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)
        msg = ant.messages.create(model="llama", max_tokens=4,
                                  messages=[{"role": "user", "content": "Hi"}])
        assert msg.usage.output_tokens == 4


@pytest.mark.process
def test_a_keyed_node_s_routes_raw(keyed_node):
    addr = f"127.0.0.1:{keyed_node.port}"
    chat_body = {"model": "llama", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    routes = [("GET", "/v1/models", None), ("GET", "/v1/cluster", None),
              ("GET", "/v1/stats?scope=cluster", None), ("GET", "/metrics", None),
              ("POST", "/v1/chat/completions", chat_body),
              ("POST", "/v1/completions", {"model": "llama", "prompt": "Hi", "max_tokens": 2}),
              ("POST", "/v1/responses", {"model": "llama", "input": "Hi",
                                         "max_output_tokens": 2}),
              ("POST", "/v1/messages", chat_body),
              ("POST", "/v1/cluster/generate", {"messages": chat_body["messages"],
                                                "max_tokens": 2}),
              ("POST", "/v1/cluster/place", {"model": "llama"})]
    for method, path, body in routes:
        for headers, code in (({}, "missing_api_key"),
                              ({"Authorization": f"Bearer {WRONG}"}, "invalid_api_key"),
                              ({"x-api-key": WRONG}, "invalid_api_key")):
            status, got, out = call(addr, method, path, body, headers=headers)
            assert status == 401 and got["www-authenticate"] == "Bearer", (path, status, out)
            assert out["error"]["code"] == code, (path, out)
            if path == "/v1/messages":
                assert out["type"] == "error" and out["error"]["type"] == "authentication_error"
        status, _, out = call(addr, method, path, body, headers=BEARER)
        assert status == 200, (path, status, out)
    assert status_of(addr) == 200  # /health needs no key
    for path in ("/", "/dashboard.js", "/dashboard.css"):
        assert call(addr, "GET", path)[0] == 200, path


@pytest.mark.process
@pytest.mark.browser
def test_the_dashboard_asks_for_the_key_once(keyed_node):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set SKULKP2P_CHROMIUM)")
    url = f"http://127.0.0.1:{keyed_node.port}/"
    form = "document.getElementById('key-form')"
    # (`window.old` marks a page about to be reloaded: the conditions hold on the new one)
    live = ("!window.old && document.readyState === 'complete' && document.getElementById("
            "'updated').textContent.startsWith('live') && document.getElementById('node-name')"
            ".textContent !== '…'")

    def after_reload(page, expression: str, what: str) -> None:
        """Wait for `expression` on the reloaded page (an evaluation that meets the old page's
        context going away is asked again)."""
        deadline = time.monotonic() + 20
        while True:
            try:
                if page.eval(expression):
                    return
            except BrowserError:
                pass
            assert time.monotonic() < deadline, f"the reloaded page never showed {what}"
            time.sleep(0.1)

    def enter(page, key: str) -> None:
        page.eval(f"document.getElementById('key-input').value = {json.dumps(key)};"
                  "document.getElementById('key-use').click(); true")

    with Browser(binary) as browser:
        page = browser.open(url)  # the page itself loads without a key
        page.wait(f"!{form}.hidden", 20, "the key form")
        assert page.eval("document.getElementById('updated').textContent") == \
            "waiting for an API key"
        enter(page, KEY)
        page.wait(live, 20, "the cluster's data")
        page.wait("document.querySelectorAll('#try-model option').length > 0", 20,
                  "the model list")
        assert page.eval(f"[{form}.hidden, {form}.dataset.prompts]") == [True, "1"]
        assert page.eval("sessionStorage.getItem('skulkp2p-api-key')") == KEY
        # The try form streams with the key too.
        page.eval("document.getElementById('try-max').value = '4';"
                  "document.getElementById('try-send').click(); true")
        info = page.wait("(t => t.includes('tokens') && t)(document.getElementById("
                         "'try-stats').textContent)", 60, "the try form's result")
        assert "→ 4 tokens" in info, info
        # Reloaded in the same tab: the key is kept, nothing is asked again.
        page.eval("window.old = true; location.reload(); true")
        after_reload(page, live, "the cluster's data")
        assert page.eval(f"[{form}.hidden, {form}.dataset.prompts ?? null]") == [True, None]
        # A wrong key is dropped and asked for again.
        page.eval("window.old = true; sessionStorage.clear(); location.reload(); true")
        after_reload(page, f"!window.old && document.readyState === 'complete' && "
                           f"!{form}.hidden", "the key form")
        enter(page, WRONG)
        page.wait(f"!{form}.hidden && document.getElementById('key-note').textContent"
                  ".includes('refused')", 20, "the wrong key refused")
        assert page.eval("sessionStorage.getItem('skulkp2p-api-key')") is None
        enter(page, KEY)
        page.wait(live, 20, "the cluster's data")


@pytest.fixture(scope="module")
def keyed_pair(tiny_models, tmp_path_factory):
    """n0 and n1 on 127.0.0.x with the key in SKULKP2P_API_KEY and the cluster secret, logging
    at debug level; the tiny llama placed on n1 alone, so that n0 forwards to it."""
    if not loopback_ips_usable():
        pytest.skip("needs the 127.0.0.0/8 loopback range (Linux)")
    c = ProcCluster(tmp_path_factory.mktemp("keys"), env={"SKULKP2P_API_KEY": KEY})
    try:
        for i in range(2):
            node = c.start(i, None, ["--model", str(tiny_models["llama"]), "--http-host",
                                     c.ip(i), "--http-port", "0", "--timers",
                                     "probe=0.2,suspect=1,election=1"],
                           command=["-m", "skulkp2p", "--log-level", "debug", "join"])
            node.http_log_from = 0
        c.wait(lambda: (s := c.agreed([0, 1])) and s["placements"], 90, "a placement")
        status, _, out = call(c.nodes[0].http, "POST", "/v1/cluster/place",
                              {"model": "llama", "nodes": ["n1"]}, headers=BEARER)
        assert status == 200 and out["placement"]["ring"] == ["n1"], out
        c.wait(lambda: all(status_of(n.http) == 200 for n in c.nodes.values()), 90,
               "both healthy, the model on n1")
        yield c
    finally:
        c.close()
        for node in c.nodes.values():
            no_secret_in(node.log.read_text(errors="replace").splitlines(),
                         f"{node.name}'s log")


def _chat_until_served(addr: str, headers: dict[str, str]) -> tuple[int, dict]:
    body = {"model": "llama", "max_tokens": 3, "speculation": "off",
            "messages": [{"role": "user", "content": "Hi"}]}
    deadline = time.monotonic() + 60
    while True:
        status, _, out = call(addr, "POST", "/v1/chat/completions", body, headers=headers)
        if status != 503 or time.monotonic() > deadline:  # (503: n1 still loading)
            return status, out
        time.sleep(0.2)


@pytest.mark.cluster
def test_forwarding_between_keyed_nodes_signs_with_the_cluster_secret(keyed_pair):
    n0, n1 = keyed_pair.nodes[0], keyed_pair.nodes[1]
    status, out = _chat_until_served(n0.http, BEARER)  # n0 does not serve it: forwarded
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    stats = call(n1.http, "GET", "/v1/stats", headers=BEARER)[2]
    assert stats["models"]["llama"]["totals"]["requests"] >= 1  # n1 served it
    assert call(n0.http, "GET", "/v1/stats", headers=BEARER)[2]["models"] == {}
    status, out = _chat_until_served(n0.http, {"Authorization": f"Bearer {WRONG}"})
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    # The dashboard's gather asks n1 with n0's signature, not a key.
    both = call(n0.http, "GET", "/v1/stats?scope=cluster", headers=BEARER)[2]
    assert [n["node"] for n in both["nodes"]] == ["n0", "n1"]
    assert "error" not in both["nodes"][1] and both["nodes"][1]["models"]["llama"]

    # The forwarded path on n1: only a request signed with the cluster secret passes.
    body = json.dumps({"model": "llama", "max_tokens": 2, "speculation": "off",
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    host, port = n1.http.rsplit(":", 1)

    def post(headers: list[tuple[str, str]], sent: bytes = body):
        with socket.create_connection((host, int(port)), timeout=60) as s:
            lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: {n1.http}",
                     "Content-Type: application/json", f"Content-Length: {len(sent)}",
                     "Connection: close", *(f"{k}: {v}" for k, v in headers)]
            s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + sent)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        (r,) = parse_responses(raw)
        return r

    def signed(auth: NodeAuth) -> list[tuple[str, str]]:
        return [(FORWARDED_HEADER, "1"),
                (NODE_AUTH_HEADER, auth.sign("POST", "/v1/chat/completions", n1.http, body))]

    good = signed(NodeAuth(SECRET))
    assert post(good).status == 200
    for why, headers in {
        "no signature, the user's key": [(FORWARDED_HEADER, "1"),
                                         ("Authorization", f"Bearer {KEY}")],
        "no signature, no key": [(FORWARDED_HEADER, "1")],
        "forged": [(FORWARDED_HEADER, "1"),
                   (NODE_AUTH_HEADER, good[1][1][:-64] + "0" * 64)],
        "another secret": signed(NodeAuth("not the cluster secret")),
        "replayed": good,
    }.items():
        r = post(headers)
        assert r.status == 401 and r.json()["error"]["code"] == "invalid_node_auth", (why, r)


@pytest.mark.cluster
def test_pipe_peer_sends_the_key(keyed_pair):
    n0 = keyed_pair.nodes[0]
    line = json.dumps({"id": 1, "model": "llama", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "Hi"}]}) + "\n"
    env = {"SKULKP2P_SECRET": SECRET, "SKULKP2P_API_KEY": KEY}
    r = run_cli("pipe", "--peer", f"{n0.ip}:{n0.port}", input=line, env=env, timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["id"] == 1 and out["usage"]["completion_tokens"] == 2, \
        (r.stdout, r.stderr[-2000:])
    env["SKULKP2P_API_KEY"] = ""
    r = run_cli("pipe", "--peer", f"{n0.ip}:{n0.port}", input=line, env=env, timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"]["type"] == "missing_api_key", out
    no_secret_in(r.stderr.splitlines(), "pipe --peer's log")
