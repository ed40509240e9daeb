"""What a node must remember across a restart: its election state and the placement plan it holds.

Raft keeps ``currentTerm``, ``votedFor`` and its log on stable storage and writes them before it
answers anyone; without that a node restarted in a power cut comes back with no plan (its vote
can then elect a leader that lacks an acknowledged placement) and with no memory of its vote (it
can vote twice in one term). ``DurableState`` is the same for this control plane: the term, the
vote in it, the plan (its (term, version), the leader that made it, the newest version known
committed, and the place requests with their placements), and the members this node knew
(Raft's configuration): a restarted node counts its quorum over them, so one that knew others
never founds a cluster of its own again. ``ClusterCore`` fills and restores it; the node writes
it with ``save_state`` before it sends anything that depends on it.

The file is JSON (an operator can read it), written atomically: a temporary file in the same
directory, fsync, ``os.replace``, fsync of the directory; a reader sees the old file or the new
one, never half of one. ``load_state`` never raises: a missing file is a first start, a corrupt
one or one of another node or cluster is a warning and a fresh start.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

from skulkp2p.atomic_file import write_atomic
from skulkp2p.wire import Message

log = logging.getLogger("skulkp2p.cluster")

FORMAT = 1
STATE_DIR = "cluster"  # under the node's data dir


@dataclass(frozen=True)
class KnownMember:
    """Another member this node knew: a voter (it counts towards the quorum until it leaves),
    or one that left gracefully."""

    name: str
    addr: str
    left: bool = False


# (term, voted for, plan term, plan version, committed, plan leader, members): what
# DurableState.key compares
DurableKey: TypeAlias = tuple[int, str | None, int, int, int | None, str | None,
                              tuple[KnownMember, ...]]


@dataclass(frozen=True)
class DurableState:
    node: str
    term: int = 0
    voted_for: str | None = None
    plan_term: int = -1  # the term of the leader that made the plan this node holds
    plan_version: int = 0
    committed: int | None = None  # newest version of that plan known held by a majority
    # The plan's place requests ({"spec", "nodes"}), their placements and errors, as on the wire.
    requests: tuple[Message, ...] = ()
    placements: tuple[Message, ...] = ()
    errors: tuple[Message, ...] = ()
    plan_leader: str | None = None  # the leader that made the plan (None: not known)
    members: tuple[KnownMember, ...] = ()  # the other members, sorted by name
    cluster: str = field(default="", compare=False)  # set by save_state

    def key(self) -> DurableKey:
        """What changes when the state does (cheap to compare on every tick)."""
        return (self.term, self.voted_for, self.plan_term, self.plan_version, self.committed,
                self.plan_leader, self.members)


def cluster_id(key: bytes) -> str:
    """A short tag of the cluster's frame key: a file written for another cluster (another
    secret) is ignored. An HMAC, so the file does not give the secret away."""
    return hmac.new(key, b"skulkp2p cluster state", hashlib.sha256).hexdigest()[:16]


def state_path(data_dir: Path, node: str) -> Path:
    """``<data dir>/cluster/<node name>.json`` (characters a file name cannot hold become _)."""
    return Path(data_dir) / STATE_DIR / _file_name(node)


def renamed_state_path(path: Path, node: str) -> Path:
    """The state file beside ``path`` for a node named ``node`` (a name fixed only once its
    port was bound)."""
    return path.with_name(_file_name(node))


def _file_name(node: str) -> str:
    return (re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_") + ".json"


class StateInUse(RuntimeError):
    """Another live process holds this node's state file."""


def lock_state(path: Path, node: str) -> int | None:
    """Hold ``path`` for this process (an exclusive lock on ``.<name>.lock`` beside it, released
    when the process ends, however it ends): two agents given one name and one data dir would
    otherwise read and overwrite each other's term and vote. Returns the lock's descriptor, or
    None where no lock file can be made (the node goes on; its saves fail and say so, as
    before); raises StateInUse when another process holds it."""
    lock = path.with_name(f".{path.name}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        log.warning("cluster: cannot make the state lock %s (%s)", lock, e.strerror or e)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StateInUse(f"another agent named {node!r} is running with this data dir "
                             f"(it holds {path}): give this one its own --name or --data-dir"
                             ) from None
        log.warning("cluster: cannot lock %s (%s)", lock, e.strerror or e)
        return None
    return fd


def to_json(state: DurableState, cluster: str) -> bytes:
    doc = {"format": FORMAT, "cluster": cluster, "node": state.node, "term": state.term,
           "voted_for": state.voted_for,
           "members": [{"name": m.name, "addr": m.addr, "left": m.left} for m in state.members],
           "plan": {"term": state.plan_term, "version": state.plan_version,
                    "leader": state.plan_leader, "committed": state.committed,
                    "requests": list(state.requests), "placements": list(state.placements),
                    "errors": list(state.errors)}}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


class StateFileError(ValueError):
    """The file is not a state file this version can read."""


def from_json(data: bytes) -> DurableState:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise StateFileError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateFileError(f"not a format-{FORMAT} state file")
    plan = doc.get("plan")
    if not isinstance(plan, dict):
        raise StateFileError("no plan")

    def _int(v: object, what: str) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise StateFileError(f"{what} is not an integer")
        return v

    def _dicts(v: object, what: str) -> tuple[Message, ...]:
        if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
            raise StateFileError(f"{what} is not a list of objects")
        return tuple(v)

    voted, node, cluster = doc.get("voted_for"), doc.get("node"), doc.get("cluster")
    if voted is not None and not isinstance(voted, str):
        raise StateFileError("voted_for is not a name")
    if not isinstance(node, str) or not isinstance(cluster, str):
        raise StateFileError("no node or cluster")
    committed = plan.get("committed")
    leader = plan.get("leader")
    if leader is not None and not isinstance(leader, str):
        raise StateFileError("plan leader is not a name")
    members: list[KnownMember] = []
    # (a file written before the member list was saved has none: the node knew nobody)
    for m in _dicts(doc.get("members", []), "members"):
        name, addr = m.get("name"), m.get("addr")
        if not isinstance(name, str) or not name or not isinstance(addr, str):
            raise StateFileError("a member without a name or address")
        members.append(KnownMember(name, addr, m.get("left") is True))
    return DurableState(
        node=node, term=_int(doc.get("term"), "term"), voted_for=voted,
        plan_term=_int(plan.get("term"), "plan term"),
        plan_version=_int(plan.get("version"), "plan version"),
        committed=None if committed is None else _int(committed, "committed"),
        requests=_dicts(plan.get("requests"), "requests"),
        placements=_dicts(plan.get("placements"), "placements"),
        errors=_dicts(plan.get("errors"), "errors"), plan_leader=leader,
        members=tuple(sorted(members, key=lambda m: m.name)), cluster=cluster)


def save_state(path: Path, state: DurableState, cluster: str) -> None:
    """Write atomically and durably (raises OSError; the caller decides what a failure means)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (to_json(state, cluster),), mode=0o600)


def load_state(path: Path, node: str, cluster: str) -> DurableState | None:
    """The state saved for this node of this cluster, or None (first start, or a file that
    cannot be used: one warning line says why, and the node starts fresh)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cluster: cannot read %s (%s): starting with a fresh cluster state", path,
                    e.strerror or e)
        return None
    try:
        state = from_json(data)
    except StateFileError as e:
        log.warning("cluster: %s is corrupt (%s): starting with a fresh cluster state", path, e)
        return None
    if state.node != node:
        log.warning("cluster: %s belongs to node %r, not %r: ignoring it, starting fresh", path,
                    state.node, node)
        return None
    if state.cluster != cluster:
        log.warning("cluster: %s was written for another cluster (another secret): ignoring "
                    "it, starting fresh", path)
        return None
    return state
