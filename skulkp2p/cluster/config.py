"""A cluster node's configuration: its flags (shared by `join` and `python -m
skulkp2p.cluster.node`), addresses and sizes as given on the command line, and the rule that a
node without a secret listens on loopback only."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from skulkp2p import wire
from skulkp2p.cluster.durable import state_path
from skulkp2p.cluster.timers import Timers, timers_from_env

DEFAULT_PORT = 52416
DEFAULT_DISCOVERY_WAIT_S = 3.0
ENV_SECRET = "SKULKP2P_SECRET"


class ClusterConfigError(ValueError):
    """A cluster setting that cannot work; the message says which and how to fix it."""


def parse_size(text: str) -> int:
    """"300MB", "1.5GB", "512MiB", "2g" or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ClusterConfigError(f"bad size {text!r} (e.g. 300MB, 1.5GB, 512MiB)")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    base = 1024 if binary else 1000
    return int(number * base ** " kmgt".index(unit or " "))


def parse_addr(text: str, default_port: int = DEFAULT_PORT) -> str:
    """"host:port" (or a bare host) -> "host:port"; IPv6 as "[::1]:port"."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    try:
        port_n = int(port) if port else default_port
    except ValueError:
        raise ClusterConfigError(f"bad address {text!r}: port must be a number") from None
    if not host or not 0 < port_n < 65536:
        raise ClusterConfigError(f"bad address {text!r} (expected HOST:PORT)")
    return f"[{host}]:{port_n}" if ":" in host else f"{host}:{port_n}"


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_allowed(host: str, secret: str | None) -> None:
    """Without a secret anyone on the network could join or inject: loopback only."""
    if not secret and not is_loopback(host):
        raise ClusterConfigError(
            f"refusing to listen on {host} without a cluster secret: anyone who can reach it "
            f"could join or inject. Set --secret or {ENV_SECRET} (the same on every node), or "
            "use a loopback --host such as 127.0.0.1")


@dataclass
class NodeConfig:
    name: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    advertise: str | None = None  # the address others reach us at (default host:port)
    peers: list[str] = field(default_factory=list)
    secret: str | None = None
    priority: int = 0
    memory_limit: int | None = None
    timers: Timers = field(default_factory=Timers)
    max_control_frame: int = wire.CONTROL_MAX_FRAME
    max_data_frame: int = wire.DATA_MAX_FRAME
    # The port was not chosen and there are no peers: a busy default port (another node on
    # this machine) falls back to a free one instead of failing.
    port_fallback: bool = False
    # Where this node keeps its term, vote and plan across restarts (None: in memory only, a
    # throwaway node).
    state_file: Path | None = None
    # The name was not given: it is HOSTNAME:PORT of the port actually bound, so that two
    # nodes on one machine (--port 0, or a busy default port) never share a name or a state file.
    name_from_port: bool = False
    # LAN discovery over mDNS (cluster/discovery.py): on unless --no-discovery, and running only
    # with a secret and a control listener off loopback; on these interfaces (default: chosen
    # from the control address); a node without --peer looks this long for others before it
    # founds a cluster of its own.
    discovery: bool = False
    discovery_interfaces: list[str] = field(default_factory=list)
    discovery_wait: float = DEFAULT_DISCOVERY_WAIT_S


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster flags, shared by `join` and by this module's own main."""
    g = p.add_argument_group("cluster")
    g.add_argument("--name", help="this node's name in the cluster (default HOSTNAME:PORT)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the cluster listener binds to (default 127.0.0.1; anything "
                        "but loopback needs a secret)")
    g.add_argument("--port", type=int, default=None,
                   help=f"cluster listener port (default {DEFAULT_PORT}; 0 picks a free one)")
    g.add_argument("--advertise", metavar="HOST:PORT",
                   help="address other nodes reach this one at (default --host:--port)")
    g.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="a node of the cluster to join through (repeatable); on one LAN the "
                        "nodes find each other without it (discovery)")
    g.add_argument("--secret", help=f"shared cluster secret (or {ENV_SECRET}; prefer the "
                                    "variable: flags show up in ps)")
    g.add_argument("--priority", type=int, default=0,
                   help="election priority: higher wins among equal terms (default 0)")
    g.add_argument("--memory-limit", metavar="SIZE",
                   help="cap on the memory this node offers to placements, e.g. 300MB")
    g.add_argument("--no-cluster-state", action="store_true",
                   help="keep the term, vote and placement plan in memory only (a throwaway "
                        "node: a restart forgets them); default: saved in the data dir")
    g.add_argument("--no-discovery", action="store_true",
                   help="do not advertise this node or look for others on the LAN over mDNS "
                        "(discovery runs only with a secret and a --host other than loopback)")
    g.add_argument("--discovery-interface", action="append", default=[], metavar="NAME",
                   help="a network interface to discover nodes on (default: the one holding "
                        "--host, or for 0.0.0.0 every LAN interface but container "
                        "bridges, VPN links and loopback)")
    g.add_argument("--discovery-wait", type=float, default=DEFAULT_DISCOVERY_WAIT_S,
                   metavar="SECONDS",
                   help="without --peer, how long to look for the cluster's nodes on the LAN "
                        "before founding a cluster of its own (default "
                        f"{DEFAULT_DISCOVERY_WAIT_S:g})")
    g.add_argument("--timers", metavar="SPEC",
                   help="control-plane timers, e.g. probe=0.5,suspect=2,election=1.5 "
                        "(or SKULKP2P_TIMERS)")


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    secret = args.secret or os.environ.get(ENV_SECRET) or None
    check_bind_allowed(args.host, secret)
    try:
        timers = timers_from_env(args.timers)
    except ValueError as e:
        raise ClusterConfigError(str(e)) from None
    port = DEFAULT_PORT if args.port is None else args.port
    name = args.name or f"{socket.gethostname()}:{port}"
    caps = {}
    for env, key in (("SKULKP2P_MAX_CONTROL_FRAME", "max_control_frame"),
                     ("SKULKP2P_MAX_DATA_FRAME", "max_data_frame")):
        if os.environ.get(env):
            caps[key] = parse_size(os.environ[env])
    interfaces, no_discovery = list(args.discovery_interface), args.no_discovery
    if no_discovery and interfaces:
        raise ClusterConfigError("--no-discovery and --discovery-interface contradict each "
                                 "other: give one of them")
    wait = args.discovery_wait
    if not 0 <= wait <= 600:
        raise ClusterConfigError(f"--discovery-wait {wait:g}: give 0 to 600 seconds")
    state_file = None
    if not getattr(args, "no_cluster_state", False):
        from skulkp2p.models.store import default_data_dir

        data_dir = getattr(args, "data_dir", None)
        state_file = state_path(Path(data_dir) if data_dir else default_data_dir(), name)
    return NodeConfig(
        **caps, name=name, state_file=state_file, name_from_port=args.name is None,
        host=args.host, port=port,
        port_fallback=args.port is None and not args.peer,
        advertise=parse_addr(args.advertise) if args.advertise else None,
        peers=[parse_addr(p) for p in args.peer], secret=secret, priority=args.priority,
        memory_limit=parse_size(args.memory_limit) if args.memory_limit else None,
        timers=timers, discovery=not no_discovery, discovery_interfaces=interfaces,
        discovery_wait=wait)
