"""`join`: one agent, wired. The HTTP API answers at once (health 503 while loading), the
cluster node joins its peers, the model this node is given by placement loads on its worker
thread through the engine factory, and everything stops cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from skulkp2p.engine.protocol import Engine
from skulkp2p.node.engines import open_engine

log = logging.getLogger("skulkp2p.node")


class JoinError(Exception):
    """The agent cannot serve (a bad setting, a port in use, its model failed to load)."""


@dataclass(frozen=True)
class JoinSettings:
    model: str  # as given on the command line (card id or path)
    model_id: str  # its resolved id
    http_host: str
    http_port: int
    max_queue: int
    sse_keepalive: float
    http_config: Any  # api.server.ServerConfig
    draft_memory_tokens: int | None = None  # MLX engine's draft memory (0 = off, None = card's)


def run_join(store: Any, settings: JoinSettings, cluster: Any) -> int:
    """Run the agent until a signal; 0 on a clean stop. Raises JoinError."""
    from skulkp2p.cluster.node import ClusterConfigError
    from skulkp2p.node.serving import ClusterServing, node_facts, own_want, serve_cluster

    def on_listening(host: str, port: int) -> None:
        log.info("http: OpenAI/Anthropic API on http://%s:%d/v1 (health: http://%s:%d/health)",
                 host, port, host, port)

    def load_model(spec: str = settings.model) -> Engine:
        # On the model's worker thread: the cluster decides which models this node loads
        # (its own --model when placed here, or another node's).
        return open_engine(store, spec, settings.draft_memory_tokens)

    def on_ready(engine: Engine) -> None:
        info = engine.info()
        if info.engine == "llama_server":
            log.info("ready: model %s served by llama-server (pid %s, %s, speculation %s); "
                     "Ctrl-C to stop", info.model, info.detail.get("pid"),
                     info.detail.get("compute"), info.detail.get("speculation"))
            return
        log.info("ready: model %s (%s, %d layers here) on this node; Ctrl-C to stop",
                 info.model, info.dtype, info.detail.get("layers_here", 0))

    async def run() -> tuple[bool, BaseException | None]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            serving = ClusterServing(store, settings.model, settings.model_id, load_model,
                                     max_queue=settings.max_queue,
                                     keepalive_s=settings.sse_keepalive, on_ready=on_ready)
            return await serve_cluster(cluster, serving,
                                       own_want(store, settings.model, cluster.name),
                                       settings.http_host, settings.http_port, stop,
                                       http_config=settings.http_config,
                                       facts=node_facts(store), on_listening=on_listening)
        except ClusterConfigError as e:
            raise JoinError(str(e)) from None
        except OSError as e:
            raise JoinError(f"cannot serve HTTP on {settings.http_host}:{settings.http_port}: "
                            f"{e.strerror or e}") from None

    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    clean, load_error = runner(run())
    if load_error is not None:
        raise JoinError(f"model {settings.model_id} failed to load: "
                        f"{type(load_error).__name__}: {load_error}")
    log.info("stopped")
    if not clean:
        # The worker is inside one long MLX call (a model load or a prefill chunk) that cannot
        # be interrupted; leave without waiting for it rather than hang the shutdown.
        logging.shutdown()
        os._exit(0)
    return 0
