"""The fault-injecting proxy's delay, measured through it (skulkp2p/netfault.py)."""

from __future__ import annotations

import pytest

from skulkp2p.netfault import FaultProxy, loopback_ips_usable, round_trip_seconds

pytestmark = pytest.mark.skipif(not loopback_ips_usable(), reason="needs 127.0.0.0/8")


def test_a_delay_is_paid_on_both_hops_of_a_round_trip():
    proxy = FaultProxy()
    try:
        a, b = "127.0.0.61", "127.0.0.62"
        proxy.delay(a, b, 0.0003)  # below a millisecond: select() honours it
        slow = round_trip_seconds(proxy, a, b, count=20)
        assert slow >= 2 * 0.0003
        proxy.delay(a, b, 0.004)
        assert round_trip_seconds(proxy, a, b, count=5) >= 2 * 0.004
        assert sum(proxy.bytes.values()) >= 2 * (20 + 5)  # every byte crossed the proxy
    finally:
        proxy.close()


def test_a_blocked_link_raises_instead_of_hanging():
    proxy = FaultProxy()
    try:
        a, b = "127.0.0.63", "127.0.0.64"
        proxy.block(a, b)
        with pytest.raises(OSError):
            round_trip_seconds(proxy, a, b, count=1, timeout_s=0.5)
    finally:
        proxy.close()
