"""Rate-limited log lines (skulkp2p/ratelog.py): the first event at once, then at most one line
per interval that counts what happened since, by source and detail."""

from __future__ import annotations

import asyncio
import logging

from skulkp2p.ratelog import LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_is_one_line_then_one_count_per_interval(caplog):
    clock = Clock()
    lim = LogLimiter(logging.getLogger("t.ratelog"), "cluster: refused connections",
                     clock=clock)
    with caplog.at_level(logging.WARNING, "t.ratelog"):
        lim.note("10.0.0.9", "no handshake within 5 s")
        for i in range(999):  # within the interval: counted, not logged
            clock.now += 0.005
            lim.note("10.0.0.9" if i % 3 else "10.0.0.7", "bad-signature" if i % 2 else "x")
        assert [r.getMessage() for r in caplog.records] == [
            "cluster: refused connections: from 10.0.0.9: no handshake within 5 s"]
        clock.now = 111.0  # the interval is over: the next event logs the summary first
        lim.note("10.0.0.8", "x")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lim.total == 1000 + 1
    assert lines[1].startswith("cluster: refused connections: 999 in the last 11 s, from "
                               "10.0.0.9 (666), 10.0.0.7 (333): x (500), bad-signature (499)")
    caplog.clear()
    clock.now = 200.0  # quiet since: the 10.0.0.8 event is summarized alone, then a new line
    lim.flush()
    lim.flush()  # nothing counted: the interval ends
    lim.note("10.0.0.1", "x")
    assert [r.getMessage() for r in caplog.records] == [
        "cluster: refused connections: 1 in the last 89 s, from 10.0.0.8 (1): x (1)",
        "cluster: refused connections: from 10.0.0.1: x"]


def test_the_summary_comes_on_the_loops_timer_without_another_event(caplog):
    lim = LogLimiter(logging.getLogger("t.ratelog.timer"), "http: protocol errors",
                     logging.INFO, interval_s=0.05)

    async def flood() -> None:
        for _ in range(50):
            lim.note("127.0.0.1", "HTTP 400: bad request line")
        for _ in range(100):  # the timer fires once the interval is over
            if lim.lines == 2:
                return
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.INFO, "t.ratelog.timer"):
        asyncio.run(flood())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[1].startswith("http: protocol errors: 49 in the last ")
    assert lines[1].endswith("from 127.0.0.1 (49): HTTP 400: bad request line (49)")
