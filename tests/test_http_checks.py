"""The HTTP checks that need cluster nodes: the `model` field answers any name the cluster does
not serve the same way, whether or not it is a path on this node's disk (no filesystem oracle),
and a request relayed from one node to another (api/relay.py, which puts the target's address in
the Host) passes the Host check. Real cluster nodes in this process (the real ClusterServing,
HTTP server and relay on 127.0.0.1 sockets); the engine is the scripted fake."""

from __future__ import annotations

import asyncio
import threading

import pytest

from skulkp2p.cluster.config import NodeConfig
from skulkp2p.cluster.placement import ModelSpec
from skulkp2p.models.store import ModelStore
from skulkp2p.node.serving import ClusterServing, serve_cluster
from skulkp2p.node.stages import LocalPlacements
from tests.helpers.fake_engine import FakeEngine, Script, wait_until
from tests.helpers.http_client import H11Client, call, parse_responses, raw_exchange

CHAT = [{"role": "user", "content": "tokens=2"}]


class InProcessNode:
    """`serve_cluster` on its own event-loop thread: one cluster node and its HTTP API on
    127.0.0.1, its own model "fake" (the scripted engine) asked for on itself."""

    def __init__(self, tmp, name: str, peers: list[str] | None = None,
                 own: bool = True):
        self.store = ModelStore(tmp / f"data-{name}")
        self.serving = ClusterServing(LocalPlacements(self.store, "fake", "fake",
                                                      lambda spec: FakeEngine(Script())))
        config = NodeConfig(name, port=0, peers=peers or [], memory_limit=2_000_000_000)
        spec = ModelSpec("fake", 1, 1000).to_dict()
        want = {**spec, "only": [name]} if own else {**spec, "only": ["n0"]}
        self.listening = threading.Event()
        self.result: tuple[bool, BaseException | None] | None = None

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop = asyncio.Event()

            def listening(host: str, port: int) -> None:
                self.http = f"127.0.0.1:{port}"
                self.port = port
                self.listening.set()

            self.result = await serve_cluster(config, self.serving, want, "127.0.0.1", 0,
                                              self.stop, facts={"engines": ["mlx-cpu"]},
                                              on_listening=listening)

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self.thread.start()
        assert self.listening.wait(10)
        wait_until(lambda: self.serving.node is not None and self.serving.node.addr != ""
                   and self.serving.node.core is not None, 10)

    @property
    def addr(self) -> str:
        node = self.serving.node
        assert node is not None
        return node.addr

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.fixture
def n0(tmp_path):
    node = InProcessNode(tmp_path, "n0")
    try:
        wait_until(lambda: call(node.http, "GET", "/health", timeout=5)[0] == 200, 20)
        yield node
    finally:
        node.close()


def test_the_model_field_says_the_same_of_every_name_it_does_not_serve(n0, tmp_path):
    """A folder with a config.json, a .gguf file, a folder without one, a path that does not
    exist, an unknown name, a card that is not placed: one status, one message (the name as
    sent), one code, on every generation route. A path that resolves to a model the cluster
    serves still names it."""
    real = tmp_path / "secret-model"
    real.mkdir()
    (real / "config.json").write_text("{}")
    gguf = tmp_path / "weights.gguf"
    gguf.write_bytes(b"GGUF")
    card = sorted(n0.store.cards)[0]
    names = [str(real), str(gguf), str(tmp_path), str(tmp_path / "missing-model"),
             str(tmp_path / "missing.gguf"), "no-such-model", card]
    answers = set()
    for name in names:
        status, _, body = call(n0.http, "POST", "/v1/chat/completions",
                               {"model": name, "messages": CHAT, "max_tokens": 2})
        err = body["error"]
        answers.add((status, err["type"], err["param"], err["code"],
                     err["message"].replace(repr(name), "NAME")))
        status, _, body = call(n0.http, "POST", "/v1/messages",
                               {"model": name, "messages": CHAT, "max_tokens": 2})
        assert body["type"] == "error"  # Anthropic's shape, also when the resolver refuses
        answers.add((status, "anthropic", body["error"]["type"],
                     body["error"]["message"].replace(repr(name), "NAME")))
        status, _, body = call(n0.http, "POST", "/v1/cluster/generate",
                               {"model": name, "messages": CHAT, "max_tokens": 2})
        answers.add((status, "pipe", body["error"]["code"],
                     body["error"]["message"].replace(repr(name), "NAME")))
    message = ("model NAME is not placed in this cluster (placed: fake); ask for it with POST "
               "/v1/cluster/place")
    assert answers == {(404, "not_found_error", "model", "model_not_found", message),
                       (404, "anthropic", "not_found_error", message),
                       (404, "pipe", "model_not_found", message)}
    served = tmp_path / "fake"  # a folder named like the served model: that model
    served.mkdir()
    (served / "config.json").write_text("{}")
    status, _, body = call(n0.http, "POST", "/v1/chat/completions",
                           {"model": str(served), "messages": CHAT, "max_tokens": 2})
    assert status == 200 and body["model"] == "fake"


def test_a_relayed_request_passes_the_host_check(n0, tmp_path):
    """n1 serves nothing itself: it relays to n0 with n0's announced address as the Host,
    which n0 answers; a stranger's Host on n1 is refused before anything is relayed."""
    n1 = InProcessNode(tmp_path, "n1", peers=[n0.addr], own=False)
    try:
        def ready() -> bool:
            status, _, st = call(n1.http, "GET", "/v1/cluster", timeout=5)
            return status == 200 and st["leader"] is not None and any(
                p["model"] == "fake" for p in st["placements"])

        wait_until(ready, 20)
        status, _, body = call(n1.http, "POST", "/v1/chat/completions",
                               {"messages": CHAT, "max_tokens": 2})
        assert status == 200 and body["choices"][0]["message"]["content"] == "w0 w1 "
        with H11Client(n1.port) as c:  # streamed through the relay too
            r = c.request("POST", "/v1/chat/completions",
                          {"messages": CHAT, "max_tokens": 2, "stream": True})
            assert r.status == 200 and r.sse()[-1] == (None, "[DONE]")
        raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: evil.example:%d\r\n"
               b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}" % n1.port)
        (r,) = parse_responses(raw_exchange(n1.port, raw))
        assert r.status == 421 and r.json()["error"]["code"] == "misdirected_request"
    finally:
        n1.close()


def test_allowed_hosts_from_the_command_line_and_the_environment(monkeypatch):
    from skulkp2p.cli import CliError, _allowed_hosts, build_parser

    parse = build_parser().parse_args
    monkeypatch.setenv("SKULKP2P_ALLOWED_HOSTS", " api.example , proxy.lan:8443,")
    assert _allowed_hosts(parse(["join"])) == ("api.example", "proxy.lan:8443")
    args = parse(["join", "--allowed-host", "a.example", "--allowed-host", "[::2]:9"])
    assert _allowed_hosts(args) == ("a.example", "[::2]:9")  # the flags win
    with pytest.raises(SystemExit):
        parse(["join", "--allowed-host", "not a host"])
    monkeypatch.setenv("SKULKP2P_ALLOWED_HOSTS", "*,bad host")
    with pytest.raises(CliError, match="SKULKP2P_ALLOWED_HOSTS"):
        _allowed_hosts(parse(["join"]))
