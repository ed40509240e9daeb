"""`bench --cores-per-node K`: emulate a cluster of small nodes on one bigger machine.

On one machine every process of a ring or group shares all of its cores, so its processes
compete for them and a single-node arm gets all of them: neither is what N nodes of K cores
each would do. With K set, node i's processes may run only on cores [iK, (i+1)K) (Linux CPU
affinity, inherited by every thread they start). The bench process (the decode loop, the head,
the drafter, and the single-node arms of `--one-node`) is a tensor group's node 0, beside rank
0, and a pipeline ring's last node (it is the last stage); node i runs rank i or stage i. Each
starts OpenBLAS with the threads a node of K cores would (K - 1, at least one). The links stay
loopback (add `--link-delay-ms` for a LAN's latency).
"""

from __future__ import annotations

import os

from skulkp2p.bench.bench_error import BenchError


def node_cores(nodes: int, cores_per_node: int) -> list[frozenset[int]]:
    """The cores of each emulated node, from the cores this process may run on (a clear error
    when there are too few)."""
    if nodes < 2:
        raise BenchError("--cores-per-node needs --nodes 2 or more (the nodes it emulates)")
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        raise BenchError("--cores-per-node needs Linux CPU affinity (sched_setaffinity)") \
            from None
    need = nodes * cores_per_node
    if need > len(mine):
        raise BenchError(f"--cores-per-node {cores_per_node} with --nodes {nodes} needs {need} "
                         f"cores; this process may run on {len(mine)}")
    return [frozenset(mine[i * cores_per_node:(i + 1) * cores_per_node])
            for i in range(nodes)]


def pin_this_process(cpus: frozenset[int]) -> None:
    """Every thread of this process (OpenBLAS's pool, mlx's stream threads) on `cpus` only;
    threads started later inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # (a thread that ended meanwhile)


def allowed_cores(pid: int) -> list[int]:
    """The cores process `pid` (its main thread) may run on, as the kernel has it."""
    return sorted(os.sched_getaffinity(pid))

