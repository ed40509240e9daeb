"""Timers of the control plane, shared by membership and election.

Defaults aim at a LAN (and loopback on a busy machine): a killed node is suspected within about
1.5 s and declared dead about 2 s later; a dead leader is replaced in 2-3 s. Tune them with
``--timers probe=0.2,suspect=1`` or the SKULKP2P_TIMERS environment variable (same syntax).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

ENV_TIMERS = "SKULKP2P_TIMERS"


@dataclass(frozen=True)
class Timers:
    # SWIM failure detection
    probe_interval: float = 0.5  # one probe of one member per interval
    ping_timeout: float = 0.3  # no direct ack by then: ask k others to ping the target
    probe_timeout: float = 1.0  # no ack at all by then (from the ping): suspect the target
    suspect_timeout: float = 2.0  # suspect that long without refuting: dead
    indirect_k: int = 3  # members asked to ping on our behalf
    sync_interval: float = 2.0  # full-state exchange with one random member (and one dead one)
    retransmit_mult: int = 3  # a rumour rides on mult * ceil(log2(n+1)) messages
    max_piggyback: int = 8  # rumours per message
    # Election
    heartbeat: float = 0.25  # leader -> every member
    election_timeout: float = 1.5  # no heartbeat that long: ask for pre-votes
    election_jitter: float = 0.5  # random extra, against split votes
    election_rank_step: float = 0.25  # extra per rank: the best-ranked survivor stands first

    @property
    def leader_lease(self) -> float:
        """A leader without acks from a majority for this long steps down; a voter that heard a
        leader this recently refuses pre-votes (a returning node cannot unseat it)."""
        return self.election_timeout


# short names accepted in a spec
ALIASES = {
    "probe": "probe_interval", "ping": "ping_timeout", "probe_timeout": "probe_timeout",
    "suspect": "suspect_timeout", "k": "indirect_k", "sync": "sync_interval",
    "heartbeat": "heartbeat", "election": "election_timeout", "jitter": "election_jitter",
    "rank_step": "election_rank_step",
}


def parse_timers(spec: str | None, base: Timers | None = None) -> Timers:
    """``"probe=0.2,suspect=1"`` over ``base`` (default: the defaults). Full field names work
    too. Raises ValueError naming the bad part."""
    timers = base or Timers()
    if not spec:
        return timers
    fields = {f.name: f for f in dataclasses.fields(Timers)}
    changes: dict[str, float | int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        name = ALIASES.get(key.strip(), key.strip())
        if not sep or name not in fields:
            raise ValueError(f"timers: bad entry {part!r} (known: {', '.join(sorted(ALIASES))})")
        try:
            number = int(value) if fields[name].type in ("int", int) else float(value)
        except ValueError:
            raise ValueError(f"timers: {key.strip()} needs a number, got {value!r}") from None
        if number <= 0:
            raise ValueError(f"timers: {key.strip()} must be positive, got {value!r}")
        changes[name] = number
    # Each value was parsed as its own field's type (int or float), which one kwargs type
    # cannot say for every field at once: the fields are merged as values instead.
    timers = Timers(**{**dataclasses.asdict(timers), **changes})
    if timers.ping_timeout >= timers.probe_timeout:
        raise ValueError("timers: ping must be shorter than probe_timeout")
    return timers


def timers_from_env(spec: str | None = None) -> Timers:
    """SKULKP2P_TIMERS, then ``spec`` (a flag) over it."""
    return parse_timers(spec, parse_timers(os.environ.get(ENV_TIMERS)))
