"""`python -m skulkp2p pipe`: JSONL requests on stdin, one JSONL result per request on stdout.

A bad line gets an error result with its id (when known) and the pipe goes on; EOF ends it with
status 0. Models load on first use, on the engine their card names (the factory the CLI passes
in, node/engines.py: a GGUF card runs on its llama-server child, as over HTTP), and stay loaded
for the rest of the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import IO

import orjson

from skulkp2p.engine.json_types import JSONObject
from skulkp2p.engine.protocol import Engine, EngineFailed, EngineUnavailable
from skulkp2p.engine.request import RequestError
from skulkp2p.formats.pipe_format import error_json, parse_request, request_id, result_json
from skulkp2p.models.store import ModelStore, ModelStoreError

# (store, card id or path) -> a loaded engine: the composition root's factory, given by the CLI
OpenEngine = Callable[[ModelStore, str], Engine]

log = logging.getLogger("skulkp2p.pipe")


class ModelLoadFailed(Exception):
    """The model resolved, but its engine could not be opened (missing weights, a card field
    the loader refuses, a mismatched drafter pair): the request's fault only in naming it."""


class PipeSession:
    def __init__(self, store: ModelStore, default_model: str, open_engine: OpenEngine):
        self.store = store
        self.open_engine = open_engine
        self.default_model = default_model
        self.engines: dict[str, Engine] = {}
        self.named: dict[str, str] = {}  # engine id -> the card id lines named (its other form)

    def engine(self, spec: str) -> Engine:
        # a card id, a path or a Hugging Face repository id (fetched: the line names it);
        # raises ModelStoreError for an unknown, missing, gated or uncached model
        resolved = self.store.resolve(spec, fetch=True)
        if resolved.id not in self.engines:
            try:
                self.engines[resolved.id] = self.open_engine(self.store, spec)
                served = self.engines[resolved.id].id
                if served != resolved.id and served in self.store.cards:
                    self.named[served] = resolved.id  # e.g. its GGUF form on llama-server
            except (ModelStoreError, RequestError):
                raise
            except Exception as e:  # tried again on the next line that names it
                log.error("model %s could not be loaded: %s: %s", resolved.id,
                          type(e).__name__, e)
                raise ModelLoadFailed(f"model {resolved.id} could not be loaded: "
                                      f"{type(e).__name__}: {e}") from e
        return self.engines[resolved.id]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()  # a llama-server child ends with the pipe

    def handle_line(self, line: bytes | str) -> JSONObject:
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            return error_json(None, "invalid_json", f"line is not valid JSON: {e}")
        req_id = request_id(obj)
        try:
            req = parse_request(obj)
            engine = self.engine(req.model or self.default_model)
            generation = engine.generate(req)
            for _ in generation:
                pass
            assert generation.result is not None
            return result_json(generation.result, req.id, self.named.get(engine.id, engine.id))
        except RequestError as e:
            return error_json(req_id, e.type, e.message, e.param)
        except ModelStoreError as e:
            return error_json(req_id, "model_not_found", str(e), "model")
        except ModelLoadFailed as e:
            return error_json(req_id, "model_load_failed", str(e), "model")
        except (EngineUnavailable, EngineFailed) as e:
            return error_json(req_id, "model_unavailable", e.message)
        except Exception as e:  # one request's failure must not end the stream
            log.exception("request %r failed", req_id)
            return error_json(req_id, "internal_error", f"{type(e).__name__}: {e}")


def run_pipe(store: ModelStore, default_model: str, stdin: IO[str], stdout: IO[str],
             open_engine: OpenEngine) -> int:
    store.resolve(default_model, fetch=True)  # an unknown --model fails at once, not per line
    session = PipeSession(store, default_model, open_engine)
    try:
        for line in stdin:
            if not line.strip():
                continue
            result = session.handle_line(line)
            stdout.write(orjson.dumps(result).decode() + "\n")
            stdout.flush()
    finally:
        session.close()
    return 0
