"""A real `join` node's prefix cache on disk across restarts: the next turn of an agent
conversation after a SIGTERM, and after a kill -9, restores its prompt from the entries the node
wrote before, and decodes what a cold run decodes (greedy); a request with `disk_cache: false`
writes nothing. One data dir, three starts of the node, one after the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulkp2p.engine.cache.disk_store import SUFFIX
from tests.helpers.http_client import call
from tests.helpers.procs import JoinNode

pytestmark = [pytest.mark.process, pytest.mark.model]

FILE = "\n".join(f"def step_{i}(state):\n    state['count'] += {i}\n    return state\n"
                 for i in range(24))
TURN1 = [{"role": "system", "content": "You are a coding agent. Answer briefly."},
         {"role": "user", "content": f"Here is utils.py:\n```python\n{FILE}```\nWhat does "
                                     "step_3 do?"}]
TURN2 = TURN1 + [{"role": "assistant", "content": "It adds 3 to the state's count."},
                 {"role": "user", "content": "And step_7?"}]


def _chat(node: JoinNode, messages: list[dict], **extra: object) -> tuple[str, int]:
    status, _, body = call(f"127.0.0.1:{node.port}", "POST", "/v1/chat/completions",
                           {"messages": messages, "max_tokens": 16, "temperature": 0, **extra},
                           timeout=300)
    assert status == 200, body
    return (body["choices"][0]["message"]["content"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _files(data: Path) -> set[Path]:
    return set((data / "prefix-cache").rglob(f"*{SUFFIX}"))


def _wait_for_new_file(node: JoinNode, data: Path, before: set[Path]) -> None:
    import time

    deadline = time.monotonic() + 120
    while not _files(data) - before:
        assert node.proc.poll() is None, node.text()[-3000:]
        assert time.monotonic() < deadline, "no entry was written"
        time.sleep(0.05)


def test_restarts_find_the_entries_on_disk(tmp_path, smollm2_path):
    data = tmp_path / "data"
    args = (str(smollm2_path), tmp_path, "--data-dir", str(data))

    first = JoinNode(*args)
    try:
        cold, cached = _chat(first, TURN2, disk_cache=False)  # cold, and never written
        assert cached == 0
        _chat(first, TURN1)  # (a memory hit on the entry above) its own entry is written
    finally:
        assert first.stop() == 0  # SIGTERM: the node writes what it queued, then exits
    written = _files(data)
    assert len(written) == 1  # turn 1's only: the opted-out request wrote nothing

    second = JoinNode(*args)
    try:
        text, cached_after_term = _chat(second, TURN2)
        assert cached_after_term > 0 and text == cold  # turn 1's prompt, from disk
        _wait_for_new_file(second, data, written)  # turn 2's own entry
    finally:
        second.kill()  # kill -9

    third = JoinNode(*args)
    try:
        text, cached_after_kill = _chat(third, TURN2)
        assert cached_after_kill > cached_after_term and text == cold
    finally:
        third.kill()
