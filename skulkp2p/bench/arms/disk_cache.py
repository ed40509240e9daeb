"""`bench --restart-ttft`: the time to first token of an agent turn in a process just started,
with the prefix cache's entries on disk from the process before it, and without (cold).

Each side is a fresh `python -m skulkp2p pipe` process (the MLX engine, `--engine mlx`) on a
data dir of its own in a temporary folder (the model's folder linked in, so nothing is fetched
and the user's own prefix cache is neither read nor written):

1. A writer process runs the agent conversation's (workloads.AGENT_TURNS) turns before the
   measured one (the last of `--turns`, default all), each with the model's own answers, and
   exits: its entries are on disk.
2. Then, `--runs` times, interleaved: a process with `--prefix-cache-disk-gb 0` runs the measured
   turn (cold: nothing cached anywhere), and a process with the disk cache on runs it (its prompt
   restored from disk, up to the previous turn's answer: the entries are put back as the writer
   left them before each run, so a run never finds the measured turn's own entry of the run
   before). Time to first token is the engine's (`timing.ttft_s`, the request's start to its
   first token, the disk load included); the model's load is not counted.

Greedy: the measured turn's tokens must be the same in every process, or the command fails after
writing the JSON. No mlx here: the engine runs in the child processes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skulkp2p.bench.arms.agent import DEFAULT_AGENT_MAX_TOKENS
from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.report import fmt, loadavg, machine_info, write_atomic
from skulkp2p.bench.workloads import AGENT_TURNS, agent_messages

if TYPE_CHECKING:
    from skulkp2p.models.store import ModelStore

log = logging.getLogger("skulkp2p.bench")

AIM = 10.0  # the disk cache's aim: cold time to first token over the time from disk
DISK_GB = 4.0  # the disk side's --prefix-cache-disk-gb (far more than one conversation needs)
MAX_TOKENS = DEFAULT_AGENT_MAX_TOKENS  # each answer's length, as `bench --agent`


class _Pipe:
    """A `pipe` child answering one JSON line per request line; killed by pid on close."""

    def __init__(self, model: str, data_dir: Path, disk_gb: float, log_path: Path):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(log_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skulkp2p", "pipe", "--model", model, "--engine", "mlx",
                 "--data-dir", str(data_dir), "--prefix-cache-disk-gb", str(disk_gb)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.log_path = log_path

    def ask(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"messages": messages, "max_tokens": max_tokens,
                                          "temperature": 0, "speculation": "off"}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"the pipe process ended: {self._tail()}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise BenchError(f"the pipe answered an error: {out['error']}")
        return out

    def close(self) -> None:
        """End of input: the pipe writes what its disk cache queued, then exits."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            if self.proc.wait(timeout=120) != 0:
                raise BenchError(f"the pipe process failed: {self._tail()}")
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]


def _one(model: str, data: Path, disk_gb: float, log_path: Path,
         messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    pipe = _Pipe(model, data, disk_gb, log_path)
    try:
        out = pipe.ask(messages, max_tokens)
    finally:
        pipe.close()
    return out


def run_restart_bench(args: Any, store: ModelStore) -> int:
    turns = getattr(args, "turns", None) or len(AGENT_TURNS)
    lengths = args.max_tokens  # (before the workloads' options settle it: a list, or None)
    max_tokens = MAX_TOKENS if not lengths else int(
        lengths[0] if isinstance(lengths, list) else lengths)
    model_id = store.resolve(args.model, fetch=True).id
    source = Path(store.pull(args.model))
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="skulkp2p-restart-") as tmp:
        data = Path(tmp) / "data"
        (data / "models").mkdir(parents=True)
        (data / "models" / model_id).symlink_to(source.resolve(), target_is_directory=True)
        log_path = Path(tmp) / "pipe.log"
        writer = _Pipe(model_id, data, DISK_GB, log_path)
        answers: list[str] = []
        try:
            for _ in range(turns - 1):
                answers.append(writer.ask(agent_messages(answers), max_tokens)["text"])
        finally:
            writer.close()
        messages = agent_messages(answers)
        entries, written = data / "prefix-cache", Path(tmp) / "written"
        shutil.copytree(entries, written)
        cold: list[dict[str, Any]] = []
        disk: list[dict[str, Any]] = []
        for run in range(args.runs):
            cold.append(_one(model_id, data, 0, log_path, messages, max_tokens))
            shutil.rmtree(entries)
            shutil.copytree(written, entries)  # as the writer left them
            disk.append(_one(model_id, data, DISK_GB, log_path, messages, max_tokens))
            log.info("run %d: time to first token %.3f s cold, %.3f s from disk (%d of %d "
                     "prompt tokens restored)", run + 1, cold[-1]["timing"]["ttft_s"],
                     disk[-1]["timing"]["ttft_s"], disk[-1]["usage"]["cached_tokens"],
                     disk[-1]["usage"]["prompt_tokens"])
    cold_s = statistics.median(r["timing"]["ttft_s"] for r in cold)
    disk_s = statistics.median(r["timing"]["ttft_s"] for r in disk)
    identical = all(r["tokens"] == cold[0]["tokens"] for r in cold + disk)
    record = {
        "bench": "restart-ttft", "model": model_id, "turn": turns,
        "prompt_tokens": disk[0]["usage"]["prompt_tokens"],
        "cached_tokens": [r["usage"]["cached_tokens"] for r in disk],
        "max_tokens": max_tokens, "runs": args.runs,
        "ttft_cold_s": [r["timing"]["ttft_s"] for r in cold],
        "ttft_disk_s": [r["timing"]["ttft_s"] for r in disk],
        "ttft_cold_median_s": cold_s, "ttft_disk_median_s": disk_s,
        "ratio": round(cold_s / disk_s, 2) if disk_s > 0 else None, "aim": AIM,
        "identical_output": identical, "machine": machine_info(),
        "loadavg_before": load_before, "loadavg_after": loadavg(),
    }
    if args.json_out:
        write_atomic(Path(args.json_out), json.dumps(record, indent=2) + "\n")
    print(f"turn {turns} of the agent conversation ({record['prompt_tokens']} prompt tokens), "
          f"in a process just started, median of {args.runs}:")
    print(f"  cold (no disk cache):  time to first token {fmt(cold_s, '.3f')} s")
    print(f"  from disk:             time to first token {fmt(disk_s, '.3f')} s "
          f"({', '.join(str(c) for c in record['cached_tokens'])} tokens restored)")
    print(f"  {record['ratio']}x sooner (aim {AIM:g}x); outputs identical: {identical}")
    if not identical:
        raise BenchError("the measured turn's tokens differ between processes")
    return 0
