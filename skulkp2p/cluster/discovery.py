"""Finding the cluster's other nodes on the LAN: mDNS / DNS-SD through python-zeroconf.

Each node advertises one ``_skulkp2p._tcp.local.`` service (instance name: the node's name) whose
SRV record holds its control-plane port and whose TXT record holds:

- ``tag``: the cluster tag, the first 16 hex digits of HMAC-SHA256(secret, "skulkp2p discovery
  tag"). It tells nodes of one secret from others without showing the secret: a node that knows
  the secret can compute it, nobody else can, and it reveals no more about the secret than any
  signed frame does;
- ``name`` and ``addr``: the node's cluster name and the control address it answers at (the
  address other nodes use for it, as a ``--peer`` would name it);
- ``v``: this record's format (1).

It browses for the same type and hands every node of its own tag it finds to ``on_found`` as an
address to join through, exactly as a ``--peer`` seed (cluster/node.py: the signed join; nodes of
another secret are ignored here, and could not join anyway). Found and lost peers are logged once
per change and listed by ``view`` (GET /v1/cluster's ``discovered``).

Which interfaces (``choose_interfaces``): the ones named by ``--discovery-interface``; else the
interface holding the control address; else, for a wildcard bind, every interface that is up,
multicast-capable and has an IPv4 address, except container bridges and virtual links (docker0,
br-*, veth*, virbr*, ...), VPN links (tun*, wg*, tailscale*, utun*, ...) and loopback; loopback
only when nothing else is there. IPv4 multicast only.

Discovery runs only for a node with a secret whose control listener is not on loopback
(``discovery_wanted``): a node without a secret stays on loopback and says nothing on the LAN.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from skulkp2p.cluster.config import (
    ClusterConfigError,
    NodeConfig,
    is_loopback,
    parse_addr,
    split_addr,
)
from skulkp2p.wire import Message, WireValue

if TYPE_CHECKING:  # zeroconf loads when discovery starts
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger("skulkp2p.cluster")

SERVICE_TYPE = "_skulkp2p._tcp.local."
TAG_LABEL = b"skulkp2p discovery tag"
RECORD_VERSION = "1"
# Host and other records live 2 minutes (zeroconf refreshes them before they expire): a node that
# died without its goodbye drops out of the others' lists within that, not after mDNS's default
# 75 minutes for PTR and TXT records.
RECORD_TTL_S = 120
RESOLVE_TIMEOUT_MS = 3000
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

# Interfaces left out unless named: container and VM bridges and their virtual ends, and VPN or
# tunnel links (multicast there reaches nobody on the LAN, or the wrong people).
CONTAINER_PREFIXES = ("docker", "br-", "veth", "virbr", "vnet", "cni", "flannel", "cali",
                      "vxlan", "weave", "kube-", "lxcbr", "lxdbr", "podman", "cilium", "vmnet",
                      "vboxnet", "tap")
VPN_PREFIXES = ("tun", "wg", "tailscale", "utun", "zt", "ppp", "ipsec", "gif", "stf", "awdl",
                "llw", "nordlynx")
_IFF_UP, _IFF_LOOPBACK, _IFF_MULTICAST = 0x1, 0x8, 0x1000


def cluster_tag(secret: str) -> str:
    """The cluster's discovery tag: 16 hex digits of HMAC-SHA256(secret, the tag label)."""
    return hmac.new(secret.encode(), TAG_LABEL, hashlib.sha256).hexdigest()[:16]


def discovery_wanted(config: NodeConfig) -> bool:
    """Discovery runs when it is on, the node has a secret, and its control listener is not on
    loopback (a node without a secret listens on loopback only and stays off the LAN)."""
    return bool(config.discovery and config.secret and not is_loopback(config.host))


# ---------------------------------------------------------------- interfaces


@dataclass(frozen=True)
class Interface:
    """A network interface as discovery sees it (``system_interfaces`` reads this machine's)."""

    name: str
    ipv4: tuple[str, ...] = ()
    up: bool = True
    multicast: bool = True
    loopback: bool = False


def system_interfaces() -> list[Interface]:
    """This machine's interfaces and their IPv4 addresses (ifaddr, zeroconf's own dependency);
    on Linux also whether each is up and multicast-capable (/sys/class/net)."""
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        ipv4 = tuple(ip.ip for ip in adapter.ips if isinstance(ip.ip, str))
        flags = _linux_flags(adapter.name)
        loopback = bool(ipv4) and all(ipaddress.ip_address(a).is_loopback for a in ipv4)
        if flags is None:
            out.append(Interface(adapter.name, ipv4, loopback=loopback))
        else:
            out.append(Interface(adapter.name, ipv4, up=bool(flags & _IFF_UP),
                                 multicast=bool(flags & _IFF_MULTICAST),
                                 loopback=loopback or bool(flags & _IFF_LOOPBACK)))
    return out


def _linux_flags(name: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{name}/flags").read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def left_out(iface: Interface) -> str | None:
    """Why the default choice leaves ``iface`` out, or None when it is a LAN interface."""
    name = iface.name.lower()
    if iface.loopback:
        return "loopback"
    if name.startswith(CONTAINER_PREFIXES):
        return "a container or VM bridge"
    if name.startswith(VPN_PREFIXES):
        return "a VPN or tunnel link"
    if not iface.up:
        return "down"
    if not iface.multicast:
        return "not multicast-capable"
    if not iface.ipv4:
        return "no IPv4 address"
    return None


def choose_interfaces(interfaces: Sequence[Interface], host: str,
                      wanted: Sequence[str] = ()) -> list[Interface]:
    """The interfaces to advertise and browse on, for a control listener bound to ``host``.

    ``wanted`` (``--discovery-interface``) wins, each name checked; else the interface holding
    ``host``; else (a wildcard bind) every LAN interface (``left_out``), loopback only when there
    is nothing else."""
    by_name = {i.name: i for i in interfaces}
    if wanted:
        chosen = []
        for name in dict.fromkeys(wanted):
            iface = by_name.get(name)
            if iface is None:
                raise ClusterConfigError(
                    f"--discovery-interface {name}: no such interface here (there are "
                    f"{', '.join(sorted(by_name)) or 'none'})")
            if not iface.ipv4:
                raise ClusterConfigError(f"--discovery-interface {name}: it has no IPv4 address "
                                         "(discovery uses IPv4 multicast)")
            chosen.append(iface)
        return chosen
    if host not in WILDCARD_HOSTS:
        holding = [i for i in interfaces if set(i.ipv4) & _addresses_of(host)]
        if holding:
            return holding
    lan = [i for i in interfaces if left_out(i) is None]
    if lan:
        return lan
    return [i for i in interfaces if i.loopback and i.ipv4][:1]


def _addresses_of(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {str(a[4][0]) for a in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return set()


def reachable_addr(addr: str, host: str, interfaces: Sequence[Interface]) -> str:
    """The control address to advertise: ``addr`` unless the listener is on a wildcard and
    ``addr``'s host is on none of the discovery interfaces (say the hostname resolves to
    127.0.1.1); then the first discovery interface's address, with ``addr``'s port."""
    if host not in WILDCARD_HOSTS:
        return addr
    ip, port = split_addr(addr)
    ours = [a for i in interfaces for a in i.ipv4]
    if ip in ours or not ours:
        return addr
    return parse_addr(f"{ours[0]}:{port}")


# ---------------------------------------------------------------- the service


@dataclass
class FoundPeer:
    """A node of this cluster that discovery found."""

    name: str
    addr: str
    instance: str  # its mDNS service instance
    first_seen: float  # Unix time
    last_seen: float  # Unix time: its records last arrived or were resolved

    def view(self) -> Message:
        return {"name": self.name, "addr": self.addr, "instance": self.instance,
                "first_seen": round(self.first_seen, 3), "last_seen": round(self.last_seen, 3)}


class Discovery:
    """Advertise this node and browse for its cluster's others, on the running event loop."""

    def __init__(self, *, name: str, addr: str, secret: str, interfaces: Sequence[Interface],
                 on_found: Callable[[str], None] | None = None,
                 metrics: collections.Counter[str] | None = None):
        self.name = name
        self.addr = addr
        self.interfaces = list(interfaces)
        self.tag = cluster_tag(secret)
        self.on_found = on_found
        self.metrics: collections.Counter[str] = metrics if metrics is not None \
            else collections.Counter()
        self.peers: dict[str, FoundPeer] = {}  # by instance name
        self._present: set[str] = set()  # instances the browser currently lists
        self._ignored: dict[str, str] = {}  # instance -> why (logged once)
        self._found = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None

    @property
    def instance(self) -> str | None:
        """This node's own service instance name (zeroconf renames it on a clash)."""
        return self._info.name if self._info is not None else None

    async def start(self) -> None:
        """Open the mDNS sockets, start browsing, and register this node's service in the
        background (probing for its name takes about a second). Raises what zeroconf raises
        (OSError when the sockets cannot be opened)."""
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        ips = [a for i in self.interfaces for a in i.ipv4]
        self._zc = AsyncZeroconf(interfaces=ips, ip_version=IPVersion.V4Only)
        host, port = split_addr(self.addr)
        try:
            addresses = [str(ipaddress.IPv4Address(host))]
        except ValueError:  # advertised by hostname: the interfaces' addresses
            addresses = ips
        label = _dns_label(self.name)
        digest = hashlib.sha256(f"{self.name} {self.addr}".encode()).hexdigest()[:6]
        self._info = AsyncServiceInfo(
            SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=port,
            properties={"v": RECORD_VERSION, "tag": self.tag, "name": self.name,
                        "addr": self.addr},
            server=f"{label[:50]}-{digest}.local.", host_ttl=RECORD_TTL_S,
            other_ttl=RECORD_TTL_S, parsed_addresses=addresses)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE,
                                            handlers=[self.on_service_change])
        self._spawn(self._register())
        log.info("discovery: advertising %s (%s) on %s and looking for this cluster's nodes",
                 self.addr, SERVICE_TYPE.rstrip("."),
                 ", ".join(f"{i.name} {'/'.join(i.ipv4)}" for i in self.interfaces))

    async def close(self) -> None:
        """Withdraw the service (goodbye packets, so the others drop this node at once) and
        close the sockets."""
        for task in list(self._tasks):
            task.cancel()
        if self._browser is not None:
            browser, self._browser = self._browser, None
            await browser.async_cancel()
        if self._zc is not None:
            zc, self._zc = self._zc, None
            try:
                await asyncio.wait_for(zc.async_close(), 5)
            except Exception as e:  # stopping goes on whatever mDNS does
                log.warning("discovery: closing mDNS failed: %s: %s", type(e).__name__, e)

    async def first_peers(self, wait_s: float) -> list[str]:
        """The addresses of this cluster's nodes found within ``wait_s`` seconds (returns as
        soon as one is found; an empty list when none is)."""
        if not self.peers:
            try:
                await asyncio.wait_for(self._found.wait(), wait_s)
            except TimeoutError:
                pass
        return [p.addr for p in self.peers.values()]

    def view(self) -> list[WireValue]:
        """The peers found, by name (GET /v1/cluster's ``discovered``)."""
        from zeroconf import current_time_millis

        zc = self._zc
        out: list[WireValue] = []
        for instance, p in sorted(self.peers.items(), key=lambda kv: kv[1].name):
            if zc is not None:  # the newest of its records (refreshed before they expire)
                now_ms = current_time_millis()
                for record in zc.zeroconf.cache.async_entries_with_name(instance):
                    p.last_seen = max(p.last_seen, time.time() - (now_ms - record.created) / 1000)
            out.append(p.view())
        return out

    # ---------------------------------------------------------------- internals

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _register(self) -> None:
        assert self._zc is not None and self._info is not None
        try:
            await self._zc.async_register_service(self._info, allow_name_change=True)
        except Exception as e:  # the node runs on, reachable through --peer
            log.warning("discovery: cannot advertise this node over mDNS: %s: %s",
                        type(e).__name__, e)
            return
        log.debug("discovery: registered as %s", self._info.name)

    def on_service_change(self, zeroconf: object, service_type: str, name: str,
                          state_change: object) -> None:
        """The browser's handler: a service of our type was added, updated or removed (the
        first two are resolved, then judged by ``resolved``)."""
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            self._present.discard(name)
            self._ignored.pop(name, None)  # should it come back, it is news again
            self._lost(name)
        else:  # Added, Updated: (re)read its records
            self._present.add(name)
            self._spawn(self._resolve(service_type, name))

    async def _resolve(self, service_type: str, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        if self._zc is None or name == self.instance:
            return
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS):
            log.debug("discovery: %s did not answer", name)
            return
        ips = info.parsed_addresses()
        self.resolved(name, info.decoded_properties,
                      f"{ips[0]}:{info.port}" if ips and info.port else None)

    def resolved(self, name: str, props: Mapping[str, str | None],
                 srv_addr: str | None = None) -> None:
        """What to make of service ``name``, whose TXT record reads ``props`` and whose SRV and
        address records give ``srv_addr`` (used when the TXT record names no address): a peer
        found (or moved), another cluster's node ignored, or ourselves."""
        if name not in self._present or name == self.instance:
            return  # gone while we asked, or our own (renamed) service
        tag, node, addr = props.get("tag"), props.get("name"), props.get("addr") or srv_addr
        try:
            addr = parse_addr(addr) if addr else None
        except ClusterConfigError:
            addr = None
        node = node or name.removesuffix(f".{SERVICE_TYPE}")
        if tag is None or not hmac.compare_digest(tag.encode(), self.tag.encode()):
            self._ignore(name, f"{node} at {addr or '?'}: another cluster (another secret)")
            return
        if addr is None:
            self._ignore(name, f"{node}: its record names no usable address")
            return
        if addr == self.addr:
            return  # ourselves, under an older instance name
        if node == self.name:
            self._ignore(name, f"{node} at {addr}: it has this node's name")
            return
        self._ignored.pop(name, None)
        now = time.time()
        known = self.peers.get(name)
        if known is not None and known.addr == addr and known.name == node:
            known.last_seen = now
            return
        self.peers[name] = FoundPeer(node, addr, name, known.first_seen if known else now, now)
        if known is None:
            self.metrics["discovery_found"] += 1
            log.info("discovery: found %s at %s", node, addr)
        else:
            log.info("discovery: %s is now at %s (was %s at %s)", node, addr, known.name,
                     known.addr)
        self._found.set()
        if self.on_found is not None:
            try:
                self.on_found(addr)
            except Exception:
                log.exception("discovery: handing %s to the cluster failed", addr)

    def _lost(self, name: str) -> None:
        peer = self.peers.pop(name, None)
        if peer is not None:
            self.metrics["discovery_lost"] += 1
            log.info("discovery: lost %s at %s (it withdrew its service, or its records "
                     "expired)", peer.name, peer.addr)

    def _ignore(self, name: str, why: str) -> None:
        if self._ignored.get(name) != why:
            self._ignored[name] = why
            self.metrics["discovery_ignored"] += 1
            log.info("discovery: ignoring %s", why)
        self._lost(name)


def _dns_label(name: str) -> str:
    """A service instance label for a node name: at most 63 bytes of UTF-8, no dots (some
    browsers show them badly)."""
    label = re.sub(r"[.\x00-\x1f]", "-", name) or "node"
    while len(label.encode()) > 63:
        label = label[:-1]
    return label


async def start_discovery(config: NodeConfig, addr: str,
                          on_found: Callable[[str], None] | None = None,
                          metrics: collections.Counter[str] | None = None,
                          interfaces: Iterable[Interface] | None = None) -> Discovery | None:
    """Discovery for a node listening at ``addr``, started; None when it does not run here
    (``discovery_wanted``) or mDNS cannot start (a warning: ``--peer`` still works). A
    ``--discovery-interface`` that does not exist raises ClusterConfigError. Its ``addr`` is
    the address to advertise (``reachable_addr``)."""
    if not discovery_wanted(config):
        return None
    assert config.secret is not None
    present = list(interfaces) if interfaces is not None else system_interfaces()
    chosen = choose_interfaces(present, config.host, config.discovery_interfaces)
    if not chosen:
        log.warning("discovery: no interface with an IPv4 address to look for nodes on; "
                    "join through --peer")
        return None
    if config.advertise is None:
        addr = reachable_addr(addr, config.host, chosen)
    found = Discovery(name=config.name, addr=addr, secret=config.secret, interfaces=chosen,
                      on_found=on_found, metrics=metrics)
    try:
        await found.start()
    except Exception as e:  # sockets, a sandbox: the node runs on without it
        log.warning("discovery: cannot start mDNS on %s (%s: %s); running without it: join "
                    "through --peer", ", ".join(i.name for i in chosen), type(e).__name__, e)
        await found.close()
        return None
    return found
