"""Command line: join, pipe, models, cards, bench, head."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from skulkp2p.models.cards import DEFAULT_MODEL, CardError
from skulkp2p.models.store import ModelStoreError


class CliError(Exception):
    """Ends the command with one line on stderr and exit status 1."""


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _store(args):
    from skulkp2p.models.store import ModelStore
    return ModelStore(Path(args.data_dir) if args.data_dir else None)


def _prepare_engine_process() -> None:
    """Before mlx is imported: the engine's CPU switch (engine/cpu/switch.py: the fast BLAS,
    which may re-exec this process once, its thread policy, the model pieces)."""
    try:
        from skulkp2p.engine.cpu import switch
    except ImportError:
        return
    try:  # a bad SKULKP2P_BLAS_THREADS fails here, not at the first forward
        switch.install()
    except ValueError as e:
        raise CliError(str(e)) from None


def _log_engine_path() -> None:
    try:
        from skulkp2p.engine.cpu import blas
    except ImportError:
        return
    blas.log_fast_path(blas.fast_path_report(), logging.getLogger("skulkp2p"))


def _draft_memory_argument(p) -> None:
    p.add_argument("--draft-memory-tokens", type=int, default=None, metavar="N",
                   help="the MLX engine keeps earlier requests' prompts and outputs in memory "
                        "(never on disk) for drafting, up to N tokens, least recently used out "
                        "first; 0 turns it off (default: the card's "
                        "speculation.lookup.memory_tokens, else 65536)")


def _max_batch(value: str) -> int:
    from skulkp2p.node.engines import MaxBatchError, check_max_batch  # no mlx

    try:
        return check_max_batch(int(value))
    except (ValueError, MaxBatchError):
        from skulkp2p.node.engines import MAX_BATCH_LIMIT
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_BATCH_LIMIT}, "
                                         f"got {value!r}") from None


def _max_batch_argument(p) -> None:
    p.add_argument("--max-batch", type=_max_batch, default=None, metavar="N",
                   help="requests a model generates at once (1: one at a time, first in first "
                        "out; a llama-server child gets N parallel slots); default: the card's "
                        "runtime.max_batch, else the engine's default")


def cmd_join(args) -> int:
    """Serve the HTTP API at once (health 503 while loading), load the model on its worker
    thread, serve until SIGINT/SIGTERM, exit 0."""
    store = _store(args)
    resolved = store.resolve(args.model)  # a bad --model fails before anything loads
    cluster = _cluster_config(args)  # so does a cluster setting that cannot work
    _prepare_engine_process()
    _log_engine_path()
    from skulkp2p.api.server import ServerConfig
    from skulkp2p.node.join import JoinError, JoinSettings, run_join

    settings = JoinSettings(
        model=args.model, model_id=resolved.id, http_host=args.http_host,
        http_port=args.http_port, max_queue=args.max_queue, sse_keepalive=args.sse_keepalive,
        draft_memory_tokens=args.draft_memory_tokens, max_batch=args.max_batch,
        http_config=ServerConfig(max_body_bytes=args.max_body_bytes,
                                 header_timeout=args.http_header_timeout,
                                 idle_timeout=args.http_idle_timeout),
        prefix_cache_mb=args.prefix_cache_mb)
    try:
        return run_join(store, settings, cluster)
    except JoinError as e:
        raise CliError(str(e)) from None


def _cluster_config(args):
    from skulkp2p.cluster.config import ClusterConfigError, config_from_args

    try:
        return config_from_args(args)
    except ClusterConfigError as e:
        raise CliError(str(e)) from None


def cmd_pipe(args) -> int:
    from skulkp2p.pipe import run_pipe

    if args.peer:  # the cluster answers; no model in this process
        import os

        from skulkp2p.cluster.client import PeerError, run_pipe_remote
        try:
            return run_pipe_remote(args.peer, args.secret or os.environ.get("SKULKP2P_SECRET"),
                                   args.model, sys.stdin, sys.stdout,
                                   retry_s=args.retry_for)
        except PeerError as e:
            raise CliError(str(e)) from None
    model = args.model or DEFAULT_MODEL
    store = _store(args)
    store.resolve(model)  # a bad --model fails before anything loads
    _prepare_engine_process()
    _log_engine_path()
    from functools import partial

    from skulkp2p.node.engines import open_engine

    return run_pipe(store, model, sys.stdin, sys.stdout,
                    partial(open_engine, prefix_cache_mb=args.prefix_cache_mb,
                            draft_memory_tokens=args.draft_memory_tokens,
                            max_batch=args.max_batch))


def cmd_models(args) -> int:
    from skulkp2p.progress import ProgressBar

    store = _store(args)
    try:
        if args.action == "list":
            for row in store.list():
                state = "pulled" if row["pulled"] else "not pulled"
                print(f"{row['id']:24} {row['family']:8} {row['size_bytes'] / 1e6:8.0f} MB  {state}")
        elif args.action == "pull":
            path = store.pull(args.id, progress=lambda label: ProgressBar(label))
            print(path)
        elif args.action == "path":
            print(store.path(args.id))
    except ModelStoreError as e:
        raise CliError(str(e)) from None
    return 0


def cmd_cards(args) -> int:
    from skulkp2p.models.cards import load_cards

    cards = load_cards()
    if args.action == "list":
        for card_id, card in sorted(cards.items()):
            print(f"{card_id:24} {card.family:8} {card.layers:3} layers  {card.name}")
        return 0
    if args.id not in cards:
        raise CliError(f"no card {args.id!r} (known: {', '.join(sorted(cards))})")
    print(json.dumps(cards[args.id].summary(), indent=2))
    return 0


def cmd_bench(args) -> int:
    from skulkp2p.bench import BenchError, run_bench

    store = _store(args)
    store.resolve(args.model)  # a bad --model fails before anything loads
    if args.draft_model:
        store.resolve(args.draft_model)
    _prepare_engine_process()
    _log_engine_path()
    try:
        return run_bench(args, store)
    except BenchError as e:
        raise CliError(str(e)) from None


def cmd_head(args) -> int:
    from skulkp2p.training.head_options import HeadError

    if args.action != "publish":  # publishing only copies tensors: no model runs
        _prepare_engine_process()
    from skulkp2p.training.head_command import run_head

    try:
        return run_head(args)
    except HeadError as e:
        raise CliError(str(e)) from None


def _megabytes(value: str) -> float:
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of MB, 0 or more, got {value!r}")
    return mb


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got "
                                         f"{value!r}")
    return seconds


def add_prefix_cache_argument(p: argparse.ArgumentParser) -> None:
    from skulkp2p.engine.protocol import DEFAULT_PREFIX_CACHE_MB  # no mlx

    p.add_argument("--prefix-cache-mb", type=_megabytes, default=DEFAULT_PREFIX_CACHE_MB,
                   metavar="MB", help="memory per model for the prefix cache: a request reuses "
                   "the caches of the longest prompt prefix an earlier one left (in memory, "
                   f"never on disk; default {DEFAULT_PREFIX_CACHE_MB}; 0 turns it off)")


def package_version() -> str:
    """The installed distribution's version (its metadata), else the package's __version__ (a
    source tree on sys.path without an install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("skulkp2p")
    except PackageNotFoundError:
        from skulkp2p import __version__
        return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skulkp2p",
                                description="Serve LLMs from a cluster of identical agents.")
    p.add_argument("--version", action="version", version=f"skulkp2p {package_version()}")
    p.add_argument("--log-level", default="info", help="debug, info, warning (default info)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp):
        sp.add_argument("--data-dir", help="model cache (default: the user's cache dir, "
                        "or SKULKP2P_DATA_DIR)")
        return sp

    j = common(sub.add_parser("join", help="start an agent on this node and serve a model"))
    j.add_argument("--model", default=DEFAULT_MODEL, help=f"card id or path (default {DEFAULT_MODEL})")
    j.add_argument("--http-host", default="127.0.0.1",
                   help="address the HTTP API binds to (default 127.0.0.1)")
    j.add_argument("--http-port", type=int, default=52415, help="HTTP API port (default 52415)")
    j.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for the model; one more gets 429 (default 16)")
    j.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body; larger gets 413 (default 8 MiB)")
    j.add_argument("--http-header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request head; then 408 (default 10)")
    j.add_argument("--http-idle-timeout", type=float, default=30.0,
                   help="seconds an idle keep-alive connection stays open (default 30)")
    j.add_argument("--sse-keepalive", type=float, default=10.0,
                   help="seconds of silence in a stream before a keep-alive comment (default 10)")
    add_prefix_cache_argument(j)
    _draft_memory_argument(j)
    _max_batch_argument(j)
    from skulkp2p.cluster.config import add_cluster_arguments  # stdlib + msgpack: no mlx

    add_cluster_arguments(j)
    j.set_defaults(func=cmd_join)

    pp = common(sub.add_parser("pipe", help="JSONL requests on stdin, JSONL results on stdout"))
    pp.add_argument("--model", default=None, help=f"card id or path (default {DEFAULT_MODEL}; "
                    "with --peer, the serving node's own model)")
    pp.add_argument("--peer", metavar="HOST:PORT",
                    help="send the requests through the cluster node at this cluster address "
                         "(its --host:--port) instead of loading a model here")
    pp.add_argument("--secret", help="the cluster secret for --peer (or SKULKP2P_SECRET)")
    from skulkp2p.cluster.client import DEFAULT_RETRY_S  # stdlib + msgpack: no mlx

    pp.add_argument("--retry-for", type=_seconds, default=DEFAULT_RETRY_S, metavar="S",
                    help="with --peer: how long a line the cluster answers 503 (loading, being "
                         "placed again, its ring or tensor group broken) is retried before it "
                         f"gets an error result (default {DEFAULT_RETRY_S:.0f}; 0: never)")
    add_prefix_cache_argument(pp)
    _draft_memory_argument(pp)
    _max_batch_argument(pp)
    pp.set_defaults(func=cmd_pipe)

    m = common(sub.add_parser("models", help="the local model store: list, pull, path"))
    msub = m.add_subparsers(dest="action", required=True, metavar="ACTION")
    leaf_data_dir = dict(default=argparse.SUPPRESS, help="model cache (as above)")
    msub.add_parser("list", help="cards and whether each is pulled").add_argument(
        "--data-dir", **leaf_data_dir)
    for name, text in (("pull", "fetch and convert a model"), ("path", "print its local folder")):
        a = msub.add_parser(name, help=text)
        a.add_argument("id", help="card id or local path")
        a.add_argument("--data-dir", **leaf_data_dir)
    m.set_defaults(func=cmd_models)

    c = sub.add_parser("cards", help="model cards: list, show")
    csub = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    csub.add_parser("list", help="all cards")
    cs = csub.add_parser("show", help="one card as JSON")
    cs.add_argument("id")
    c.set_defaults(func=cmd_cards)

    from skulkp2p.bench import add_bench_arguments  # imports no mlx: before the BLAS is set up

    b = common(sub.add_parser("bench", help="decode speed of each arm on named workloads (JSON)"))
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)

    from skulkp2p.training.head_options import add_head_arguments  # no mlx

    h = sub.add_parser("head", help="drafting heads: train, publish, probe, validation-shards")
    add_head_arguments(h)
    h.set_defaults(func=cmd_head)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except (CliError, CardError, ModelStoreError) as e:
        print(f"skulkp2p: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout closed by the reader (| head): not an error of ours
        sys.stderr.close()
        return 0
