"""`python -m skulkp2p pipe`: JSONL requests on stdin, one JSONL result per request on stdout.

A bad line gets an error result with its id (when known) and the pipe goes on; EOF ends it with
status 0. Models load on first use and stay loaded for the rest of the stream.
"""

from __future__ import annotations

import logging
from typing import IO, Any

import orjson

from skulkp2p.engine.request import RequestError, parse_request
from skulkp2p.models.store import ModelStore, ModelStoreError

log = logging.getLogger("skulkp2p.pipe")


def _error(req_id: Any, type_: str, message: str, param: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"error": {"type": type_, "message": message, "param": param}}
    if req_id is not None:
        out = {"id": req_id, **out}
    return out


class PipeSession:
    def __init__(self, store: ModelStore, default_model: str):
        self.store = store
        self.default_model = default_model
        self.loaded: dict[str, Any] = {}

    def model(self, spec: str):
        from skulkp2p.engine.loader import open_model

        resolved = self.store.resolve(spec)  # raises ModelStoreError for an unknown model
        if resolved.id not in self.loaded:
            self.loaded[resolved.id] = open_model(self.store, spec)
        return self.loaded[resolved.id]

    def handle_line(self, line: bytes | str) -> dict[str, Any]:
        from skulkp2p.engine.generate import generate

        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            return _error(None, "invalid_json", f"line is not valid JSON: {e}")
        req_id = obj.get("id") if isinstance(obj, dict) else None
        try:
            req = parse_request(obj)
            loaded = self.model(req.model or self.default_model)
            return generate(loaded, req)
        except RequestError as e:
            return _error(req_id, e.type, e.message, e.param)
        except ModelStoreError as e:
            return _error(req_id, "model_not_found", str(e), "model")
        except Exception as e:  # one request's failure must not end the stream
            log.exception("request %r failed", req_id)
            return _error(req_id, "internal_error", f"{type(e).__name__}: {e}")


def run_pipe(store: ModelStore, default_model: str, stdin: IO[str], stdout: IO[str]) -> int:
    store.resolve(default_model)  # an unknown --model fails at once, not on every line
    session = PipeSession(store, default_model)
    for line in stdin:
        if not line.strip():
            continue
        result = session.handle_line(line)
        stdout.write(orjson.dumps(result).decode() + "\n")
        stdout.flush()
    return 0
