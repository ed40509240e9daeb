"""`join`: one agent, wired. The HTTP API answers at once (health 503 while loading), the
cluster node joins its peers, the model this node is given by placement loads on its worker
thread through the engine factory, and everything stops cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB, Engine
from skulkp2p.node.engines import open_engine, prefix_disk_settings

if TYPE_CHECKING:
    from skulkp2p.api.server import ServerConfig
    from skulkp2p.cluster.config import NodeConfig
    from skulkp2p.models.store import ModelStore
    from skulkp2p.node.engines import EngineChoice

log = logging.getLogger("skulkp2p.node")

# What the agent's event loop ends with: (workers ended cleanly, its own model's load error)
_Outcome: TypeAlias = tuple[bool, BaseException | None]


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
    http_config: ServerConfig | None
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB  # per model (and ring stage); 0: off
    draft_memory_tokens: int | None = None  # MLX engine's draft memory (0 = off, None = card's)
    max_batch: int | None = None  # requests a model generates at once (None: card's, else default)
    engine: EngineChoice | None = None  # --engine's choice between the model's forms
    prefix_cache_disk_gb: float = 0.0  # the prefix cache's entries on disk, per model; 0: off


def run_join(store: ModelStore, settings: JoinSettings, cluster: NodeConfig) -> int:
    """Run the agent until a signal, then end the process with status 0. Raises JoinError."""
    from skulkp2p.cluster.config import ClusterConfigError
    from skulkp2p.node.announce import node_facts, own_want
    from skulkp2p.node.serving import ClusterServing, serve_cluster
    from skulkp2p.node.stages import LocalPlacements

    def on_listening(host: str, port: int) -> None:
        log.info("http: OpenAI/Anthropic API on http://%s:%d/v1 (health: http://%s:%d/health)",
                 host, port, host, port)

    def load_model(spec: str = settings.model) -> Engine:
        # On the model's worker thread: the cluster decides which models this node loads
        # (its own --model when placed here, or another node's).
        return open_engine(store, spec, prefix_cache_mb=settings.prefix_cache_mb,
                           draft_memory_tokens=settings.draft_memory_tokens,
                           max_batch=settings.max_batch,
                           prefix_disk=prefix_disk_settings(store.data_dir,
                                                            settings.prefix_cache_disk_gb))

    def on_ready(engine: Engine) -> None:
        info = engine.info()
        if info.engine == "llama_server":
            log.info("ready: model %s served by llama-server (pid %s, %s, speculation %s); "
                     "Ctrl-C to stop", info.model, info.detail.get("pid"),
                     info.detail.get("compute"), info.detail.get("speculation"))
            return
        log.info("ready: model %s (%s, %d layers here) on this node; Ctrl-C to stop",
                 info.model, info.dtype, info.detail.get("layers_here", 0))

    async def run() -> _Outcome:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            serving = ClusterServing(LocalPlacements(
                store, settings.model, settings.model_id, load_model,
                max_queue=settings.max_queue, keepalive_s=settings.sse_keepalive,
                on_ready=on_ready, prefix_cache_mb=settings.prefix_cache_mb,
                max_batch=settings.max_batch,
                prefix_disk=prefix_disk_settings(store.data_dir, settings.prefix_cache_disk_gb)))
            return await serve_cluster(cluster, serving,
                                       own_want(store, settings.model, cluster.name,
                                                settings.engine),
                                       settings.http_host, settings.http_port, stop,
                                       http_config=settings.http_config,
                                       facts=node_facts(store), on_listening=on_listening)
        except ClusterConfigError as e:
            raise JoinError(str(e)) from None
        except OSError as e:
            raise JoinError(f"cannot serve HTTP on {settings.http_host}:{settings.http_port}: "
                            f"{e.strerror or e}") from None

    runner: Callable[[Coroutine[object, object, _Outcome]], _Outcome]
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
    # Everything this agent owns is stopped (HTTP, cluster, workers, llama-server children), so
    # leave without the interpreter's teardown: with a worker still inside one long MLX call (a
    # load or a prefill chunk that cannot be interrupted) the teardown would hang, and native
    # thread pools torn down at exit sometimes abort ("terminate called without an active
    # exception", SIGABRT: seen about once in ten clean stops).
    if not clean:
        log.info("a model worker was still inside an MLX call; leaving without it")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
