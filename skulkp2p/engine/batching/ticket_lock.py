"""The model's lock: first come first served, handed straight to the oldest waiter."""

from __future__ import annotations

import collections
import threading


class TicketLock:
    """A lock granted in the order it was asked for. Python's own lock lets the thread that
    releases it take it straight back, so a request decoding alone could keep the model from
    one that waits to join; here whoever asked first goes first (admission stays first come
    first served). Works under threading.Condition (it says who owns it).

    A release hands the lock straight to the oldest waiter by opening that waiter's own gate:
    only the thread whose turn it is wakes. (Waking every waiter on every release to check
    its ticket cost a context switch per waiting row per hand-off, several per row per step:
    with 16 rows, hundreds of wake-ups a step.)"""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)  # queued changed (wait_queued)
        self._held = False
        self._owner: int | None = None
        self._gates: collections.deque[threading.Lock] = collections.deque()  # the waiters'

    @property
    def queued(self) -> int:
        """Threads holding or waiting for the lock."""
        return len(self._gates) + self._held

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if not self._held:  # (nobody waits while the lock is free: releases hand over)
                self._held, self._owner = True, me
                self._changed.notify_all()
                return True
            if not blocking:
                return False
            gate = threading.Lock()
            gate.acquire()
            self._gates.append(gate)
            self._changed.notify_all()
        gate.acquire()  # opened by the release that hands the lock to this thread
        with self._mutex:
            self._owner = me
        return True

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a TicketLock this thread does not hold")
            self._owner = None
            if self._gates:
                self._gates.popleft().release()  # still held: now by the oldest waiter
            else:
                self._held = False
            self._changed.notify_all()

    def wait_queued(self, n: int, timeout: float) -> bool:
        """Wait until `n` threads hold or wait for the lock (False when `timeout` passed)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.queued >= n, timeout)

    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
