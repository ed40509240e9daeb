"""A LAN of Linux network namespaces made for one test, and HTTP into it.

``Lan`` makes a namespace holding a bridge and, per host, a namespace whose ``eth0`` (one end of
a veth pair, the other end on the bridge) has an address on 10.77.0.0/24, with the multicast range
routed to it: the hosts see each other, and nothing else (no address or link is made outside
these namespaces). ``close()`` deletes every namespace it made, which takes the veth pairs and
the bridge with it; ``netns_unusable()`` says why namespaces cannot be made here (not root, no
``ip``, a sandbox that forbids them), or None.

The test process stays in its own namespace: ``call`` opens its socket from a thread that has
entered the host's namespace (setns(2) moves only the calling thread), then talks over it as
over any socket."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import shutil
import subprocess
import threading
import uuid
from dataclasses import dataclass

SUBNET = "10.77.0"
_CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def netns_unusable() -> str | None:
    """Why this test process cannot make network namespaces, or None when it can."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"skprobe-{uuid.uuid4().hex[:8]}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add fails here: {made.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
                   check=False)
        if veth.returncode != 0:
            return f"cannot make a veth pair here: {veth.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"ip netns does not work here: {e}"
    finally:
        _ip("netns", "del", probe, check=False)


@dataclass(frozen=True)
class Host:
    ns: str  # the namespace's name
    ip: str  # eth0's address in it


class Lan:
    """Namespaces on one bridge; ``host(i)`` makes host i at 10.77.0.(i + 1)."""

    def __init__(self) -> None:
        self.prefix = f"sk{uuid.uuid4().hex[:6]}"
        self.bridge_ns = f"{self.prefix}-lan"
        self.namespaces: list[str] = []
        self.hosts: dict[int, Host] = {}
        self._add_ns(self.bridge_ns)
        try:
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            # No IGMP snooping: every frame of the mDNS group reaches every port.
            _ip("-n", self.bridge_ns, "link", "set", "br0", "type", "bridge",
                "mcast_snooping", "0")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def host(self, i: int) -> Host:
        ns = f"{self.prefix}-h{i}"
        ip = f"{SUBNET}.{i + 1}"
        self._add_ns(ns)
        port = f"p{i}"
        # Both ends are made inside the namespaces: nothing appears in the test's own.
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns",
            self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "multicast", "on")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        self.hosts[i] = Host(ns, ip)
        return self.hosts[i]

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host i's namespace (ip execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", self.hosts[i].ns, *argv]

    def close(self) -> None:
        """Delete every namespace made (their links go with them); idempotent."""
        errors = []
        for ns in reversed(self.namespaces):
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0 and ns in _ip("netns", "list", check=False).stdout:
                errors.append(f"{ns}: {r.stderr.strip()}")
        self.namespaces.clear()
        assert not errors, f"could not delete network namespaces: {errors}"

    def leftovers(self) -> list[str]:
        """The namespaces of this Lan that still exist (for the test's own check)."""
        listed = _ip("netns", "list", check=False).stdout
        return [line.split()[0] for line in listed.splitlines()
                if line.startswith(self.prefix)]


def _connect_in(ns: str, host: str, port: int, timeout: float):
    """A TCP connection made from inside namespace ``ns``."""
    import socket

    result: dict[str, object] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            finally:
                os.close(fd)
            result["sock"] = socket.create_connection((host, port), timeout=timeout)
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout + 5)
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    if "sock" not in result:
        raise TimeoutError(f"connecting to {host}:{port} in {ns} did not finish")
    return result["sock"]


def call(host: Host, port: int, method: str, path: str, body: object = None,
         timeout: float = 60) -> tuple[int, object]:
    """One HTTP request to host's ``port`` (in its namespace): (status, JSON body or text)."""
    sock = _connect_in(host.ns, host.ip, port, timeout)
    conn = http.client.HTTPConnection(host.ip, port, timeout=timeout)
    conn.sock = sock
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")
    finally:
        conn.close()
