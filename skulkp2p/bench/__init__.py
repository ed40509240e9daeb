"""`python -m skulkp2p bench`: decode speed of each arm on named workloads, as JSON and a table.

    cli.py            the command (run_bench) and the MLX bench's measurement loop
    options.py        the sub-command's options (add_bench_arguments)
    results.py        per arm and workload results, the per-workload summary and its table
    workloads.py      the workload texts and the warm-up
    mlx_arms.py       the MLX arms (plain, spec, drafters, the mlx-lm peers): one timed run each
    ring.py           --nodes N: the model as a ring of stage processes on loopback
    served.py         --engine served: llama-server agents, through our proxy and direct
    served_report.py  the served bench's rows, proxy overhead and table
    concurrency.py    --concurrency N: N clients at once over HTTP, batched agents against FIFO
    http_agents.py    the join agents (or rings of them) it starts, waits on, asks and stops
    concurrency_report.py  its rounds' numbers (aggregate, per request, TTFT) and table
    report.py         machine info, load average, the JSON document, tables, plot
    errors.py         BenchError

The verify-width cost table that `--widths` measures belongs to the engine
(`skulkp2p/engine/drafting/width_costs.py`). Importing this package imports no mlx: the CLI builds its
parser before the fast BLAS is set up.
"""

from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.command import run_bench
from skulkp2p.bench.options import add_bench_arguments

__all__ = ["BenchError", "add_bench_arguments", "run_bench"]
