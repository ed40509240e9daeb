"""Two nodes on one machine never share a name or a state file: a node whose name was not given
is named after the port it actually bound (`--port 0`, or a busy default port), and a second live
process given the same name and data dir is refused with one line instead of reading and
overwriting the first one's term and vote (cluster/config.py, cluster/node.py, durable.lock_state).
Real nodes on loopback sockets in this process, and real `python -m skulkp2p.cluster.node`
processes."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from skulkp2p.cluster.config import ClusterConfigError, NodeConfig
from skulkp2p.cluster.durable import state_path
from skulkp2p.cluster.node import ClusterNode
from tests.helpers.procs import kill

HOST = socket.gethostname()


def _config(data: Path, name: str, port: int, **kw) -> NodeConfig:
    return NodeConfig(name, port=port, state_file=state_path(data, name),
                      memory_limit=1_000_000_000, **kw)


def test_nodes_named_by_a_port_they_did_not_choose_get_the_bound_port(tmp_path):
    """Two nodes with --port 0 and one data dir, and one whose default port is busy: each is
    named HOSTNAME:<the port it bound>, with its own state file and lock, and a model only the
    renamed node has is asked for under its new name."""

    async def run() -> None:
        a = ClusterNode(_config(tmp_path, f"{HOST}:0", 0, name_from_port=True))
        b = ClusterNode(_config(tmp_path, f"{HOST}:0", 0, name_from_port=True))
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            local = {"model": "mine", "only": [f"{HOST}:{taken}"]}  # a model only c has
            c = ClusterNode(_config(tmp_path, f"{HOST}:{taken}", taken, name_from_port=True,
                                    port_fallback=True), {"wants": [local]})
            started = []
            try:
                for n in (a, b, c):
                    await n.start()
                    started.append(n)
                ports = [n._server.sockets[0].getsockname()[1] for n in started]
                assert ports[2] != taken
                names = [n.config.name for n in started]
                assert names == [f"{HOST}:{p}" for p in ports]
                assert len(set(names)) == 3
                assert [n.config.state_file for n in started] == \
                    [state_path(tmp_path, name) for name in names]
                assert [n.core.name for n in started] == names
                assert c.facts["wants"] == [{"model": "mine", "only": [names[2]]}]
            finally:
                for n in started:
                    await n.close(leave=False)

    asyncio.run(run())


def test_a_given_name_and_port_are_kept(tmp_path):
    async def run() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        n = ClusterNode(_config(tmp_path, "mine", port, name_from_port=False))
        await n.start()
        try:
            assert n.config.name == "mine"
            assert n.config.state_file == state_path(tmp_path, "mine")
        finally:
            await n.close(leave=False)

    asyncio.run(run())


def test_a_second_live_node_with_the_same_name_and_data_dir_is_refused(tmp_path):
    """Its start fails with a clear error before it reads the file; once the first has stopped,
    the name is free again."""

    async def run() -> None:
        first = ClusterNode(_config(tmp_path, "twin", 0))
        await first.start()
        second = ClusterNode(_config(tmp_path, "twin", 0))
        try:
            with pytest.raises(ClusterConfigError, match="another agent named 'twin' is "
                                                         "running with this data dir"):
                await second.start()
            assert second.core is None  # it never read the first one's state
        finally:
            await first.close(leave=False)
        third = ClusterNode(_config(tmp_path, "twin", 0))
        await third.start()
        await third.close(leave=False)

    asyncio.run(run())


@pytest.mark.process
def test_two_processes_with_one_name_and_data_dir(tmp_path):
    """Real processes: the second exits with status 1 and one line on stderr; the first runs on
    and stops cleanly on SIGTERM."""
    cmd = [sys.executable, "-m", "skulkp2p.cluster.node", "--name", "twin", "--port", "0",
           "--data-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "first.log"
    with open(log, "wb") as out:
        first = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        lock = tmp_path / "cluster" / ".twin.json.lock"
        for _ in range(600):  # the first holds the lock once it logs that it listens
            if b"listening on" in log.read_bytes():
                break
            assert first.poll() is None, log.read_text(errors="replace")
            try:
                first.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        assert b"listening on" in log.read_bytes(), log.read_text(errors="replace")
        assert lock.exists()
        second = subprocess.run(cmd, capture_output=True, env=env, timeout=60)
        assert second.returncode == 1
        lines = second.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and "another agent named 'twin' is running with this data dir" \
            in lines[0], second.stderr
        assert first.poll() is None
        first.terminate()
        assert first.wait(20) == 0
    finally:
        kill(first)
