"""A GGUF card served by a llama-server child: the second implementation of the Engine
protocol (engine/protocol.py), beside the MLX engine.

The OpenAI and Anthropic routes, queueing, cancellation, SSE and the error format stay exactly
the MLX engine's: the worker sees an Engine. The child runs `max_concurrent` parallel slots
(`-np`, from `max_batch`) and llama.cpp batches their decode steps together; every `relay` (the
proxy, on asyncio streams, one connection to the child per request, no state shared between
requests) runs on the event loop, so a token goes from the child's socket to the client's
without a thread hand-off (`runs_on_loop`), and up to `max_concurrent` of them run at once where
the worker hands them out that way. `generate` is the blocking form (http.client), for callers
without a loop (the pipe). The child's command line comes from served/child_config.py; `relay`'s
HTTP framing is served/child_http.py.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any

import orjson

from skulkp2p.engine.decode.tool_calls import call_opening, json_tools_template
from skulkp2p.engine.protocol import EngineFailed, EngineInfo, EngineUnavailable, Generation
from skulkp2p.engine.request import GenerationRequest, RequestError
from skulkp2p.engine.results import (
    Chunk,
    GenerationResult,
    SpeculationStats,
    Timing,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from skulkp2p.formats.chat_messages import message_json, tool_json
from skulkp2p.models.cards import Card
from skulkp2p.served.binary import detect_compute, find_binary
from skulkp2p.served.child import ServedChild, ServedError
from skulkp2p.served.child_config import resolve_gguf, server_args, slot_context
from skulkp2p.served.child_http import LOST, BodyReader, request_head, response_head

log = logging.getLogger("skulkp2p.served")

CHILD_TIMEOUT_S = 600  # no byte from the child for this long: it is lost

# The most characters a token spells, for a prompt's bound before the child tokenises it (its
# vocabulary is the child's): the longest tokens of the vocabularies served here spell 128
# (Qwen's), doubled as the MLX engine doubles its own (engine/runner/generate.py).
MAX_CHARS_PER_TOKEN = 256


class ServedModel:
    runs_on_loop = True  # the proxy only waits on sockets: the worker relays it on the loop
    dtype = "gguf"

    def __init__(self, card: Card, child: ServedChild, compute: tuple[str, ...]):
        self.id = card.id
        self.card = card
        self.child = child
        self.compute = compute
        self.context_length = slot_context(card)  # per request (per slot)
        # Generations the child runs at once: its parallel slots (the -np it was started with).
        self.max_concurrent = (int(child.args[child.args.index("--parallel") + 1])
                               if "--parallel" in child.args else 1)
        self.runtime = dict(card.runtime)
        self.speculation_type = (
            "none" if "--spec-type" not in child.args
            else child.args[child.args.index("--spec-type") + 1])
        self.json_tools: bool | None = None  # the template's calls are <tool_call>{json}

    def close(self) -> None:
        self.child.stop()

    def info(self) -> EngineInfo:
        return EngineInfo(self.id, "llama_server", self.dtype, self.context_length, {
            "pid": self.child.pid, "compute": "/".join(self.compute),
            "speculation": self.speculation_type, "slots": self.max_concurrent})

    # ---- the Engine protocol -----------------------------------------------------------------

    def prompt_length(self, req: GenerationRequest) -> int:
        # Counting needs the child's template and tokenizer (two more round trips); the real
        # count arrives in the final usage. Over-long prompts are refused by the child (400),
        # and one too long by its characters alone here, before the child tokenises it.
        # (A forced tool call needs the template's format: learnt here, off the loop.)
        self._check_size(req)
        self._opening(req)
        return 0

    def _check_size(self, req: GenerationRequest) -> None:
        limit = (self.context_length - 1) * MAX_CHARS_PER_TOKEN
        if req.text_length > limit:
            raise RequestError(f"prompt is {req.text_length} characters; model {self.id} takes "
                               f"at most {self.context_length - 1} tokens, which spell at most "
                               f"{limit}", "messages" if req.messages is not None else "prompt")

    def generate(self, req: GenerationRequest) -> Generation:
        return Generation(lambda interrupt: self.stream(req, interrupt))

    def stream(self, req: GenerationRequest, interrupt: Callable[[], None] | None = None
               ) -> Generator[Chunk, None, GenerationResult]:
        """The blocking proxy (http.client): chunks as the child sends them, then the result."""
        self._check_size(req)
        self.prepare()
        body = self._body(req)
        chat = req.messages is not None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        conn = http.client.HTTPConnection(self.child.host, self.child.port,
                                          timeout=CHILD_TIMEOUT_S)
        reply = _Reply(self, chat, interrupt)
        try:
            try:
                conn.request("POST", path, json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                raise self._lost(e) from None
            if resp.status != 200:
                raise self._child_error(resp.status, resp.read())
            while not reply.done:
                # Whatever the child has sent so far in one call (`read1`: one chunk of its
                # chunked body, usually one event): two `readline`s per event through
                # http.client's chunked decoding cost more CPU than the rest of the proxying.
                try:
                    data = resp.read1(65536)
                except (ConnectionError, http.client.HTTPException, OSError) as e:
                    raise self._lost(e) from None
                yield from reply.feed(data)
        finally:
            conn.close()  # also how a cancelled request stops the child's generation
        return reply.result()

    async def relay(self, req: GenerationRequest, generation: Generation,
                    emit: Callable[[Chunk], None]) -> GenerationResult:
        """`stream`, run on the event loop: each chunk goes to `emit` as it arrives, with no
        thread between the child's socket and the client's (the worker calls `prepare` first,
        on its own thread). Same request, events, errors and result as `stream`."""
        body = json.dumps(self._body(req, blocking=False)).encode()
        chat = req.messages is not None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        reply = _Reply(self, chat, generation.interrupt)
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                async with asyncio.timeout(CHILD_TIMEOUT_S):
                    reader, writer = await asyncio.open_connection(self.child.host,
                                                                   self.child.port)
                    writer.write(request_head(path, self.child.host, self.child.port,
                                               len(body)) + body)
                    status, framing = await response_head(reader)
                    raw = b"" if status == 200 else await BodyReader(framing).read_all(reader)
            except LOST as e:
                raise self._lost(e) from None
            if status != 200:
                raise self._child_error(status, raw)
            framed = BodyReader(framing)
            while not reply.done:
                try:
                    async with asyncio.timeout(CHILD_TIMEOUT_S):
                        data = await framed.read(reader)
                except LOST as e:
                    raise self._lost(e) from None
                for chunk in reply.feed(data):
                    emit(chunk)
        finally:
            if writer is not None:
                writer.close()  # also how a cancelled request stops the child's generation
        generation.result = reply.result()
        return generation.result

    def _piece(self, event: dict[str, Any], chat: bool, final: dict[str, Any]) -> str | None:
        """The text of one streamed event; usage, timings and finish reason go to `final`."""
        if "error" in event:
            raise self._child_error(500, json.dumps(event).encode())
        for k in ("usage", "timings"):
            if event.get(k):
                final[k] = event[k]
        choices = event.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if choice.get("finish_reason"):
            final["finish_reason"] = choice["finish_reason"]
        return piece

    # ---- helpers -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Wait (blocking) until the child answers."""
        try:
            self.child.wait_ready(self.child.ready_timeout_s)
        except ServedError as e:
            raise EngineUnavailable(str(e), retry_after=None) from None

    def _knows_json_tools(self) -> bool:
        """(Blocking) whether the child's chat template asks for Hermes/Qwen JSON calls, read
        once from its /props."""
        if self.json_tools is None:
            self.prepare()
            conn = http.client.HTTPConnection(self.child.host, self.child.port, timeout=30)
            try:
                conn.request("GET", "/props")
                resp = conn.getresponse()
                props = json.loads(resp.read()) if resp.status == 200 else None
            except (OSError, http.client.HTTPException, ValueError):
                props = None
            finally:
                conn.close()
            if not isinstance(props, dict):
                return False  # asked again next time
            template = props.get("chat_template")
            self.json_tools = isinstance(template, str) and json_tools_template(template)
        return self.json_tools

    def _opening(self, req: GenerationRequest, blocking: bool = True) -> str:
        """How a forced call begins, where the template's format is known (Hermes/Qwen JSON):
        sent as the assistant's prefill, which llama-server continues and parses as a call.
        Off the loop only: `prompt_length` (the worker's thread) learns the format first."""
        if not req.uses_tools or req.tool_choice.mode not in ("required", "function"):
            return ""
        known = self._knows_json_tools() if blocking else bool(self.json_tools)
        return call_opening("json_tools", "<tool_call>", req) if known else ""

    def _lost(self, e: BaseException) -> EngineUnavailable:
        return EngineUnavailable(f"llama-server for {self.id} went away mid-request ({e}); it "
                                 "is being restarted, retry")

    def _child_error(self, status: int, raw: bytes) -> Exception:
        try:
            err = json.loads(raw).get("error", {})
            message = err.get("message") or raw.decode("utf-8", "replace")
        except (ValueError, AttributeError):
            message = raw.decode("utf-8", "replace")
        if 400 <= status < 500:
            return RequestError(f"llama-server refused the request: {message}", None)
        if status >= 503:
            return EngineUnavailable(f"llama-server for {self.id} failed: {message}",
                                     retry_after=None)
        return EngineFailed(f"llama-server for {self.id} failed: {message}")

    def _body(self, req: GenerationRequest, blocking: bool = True) -> dict[str, Any]:
        return child_body(req, int(self.runtime.get("max_tokens", 256)),
                          self._opening(req, blocking))

    def _result(self, text: str, final: dict[str, Any], t0: float, t_first: float | None,
                t_end: float, calls: tuple[ToolCall, ...] = ()) -> GenerationResult:
        usage = final.get("usage") or {}
        timings = final.get("timings") or {}
        n_out = int(usage.get("completion_tokens") or timings.get("predicted_n") or 0)
        n_in = int(usage.get("prompt_tokens") or timings.get("prompt_n") or 0)
        # llama-server's own prompt cache (cache_prompt): tokens it did not evaluate again.
        details = usage.get("prompt_tokens_details") or {}
        n_cached = int(timings.get("cache_n") or details.get("cached_tokens") or 0)
        finish = final.get("finish_reason") or "stop"
        decode_s = (t_end - t_first) if t_first is not None else 0.0
        timing = Timing(
            ttft_s=round((t_first or t_end) - t0, 4), total_s=round(t_end - t0, 4),
            decode_tok_s=round((n_out - 1) / decode_s, 2) if n_out > 1 and decode_s else None,
            engine="llama_server", child_prompt_ms=timings.get("prompt_ms"),
            child_predicted_per_second=timings.get("predicted_per_second"))
        speculation = None
        if self.speculation_type != "none":  # (the child leaves draft_n out when it drafted nothing)
            speculation = SpeculationStats(
                drafter=f"llama_server:{self.speculation_type}", mode="explicit",
                drafted=int(timings.get("draft_n") or 0),
                accepted=int(timings.get("draft_n_accepted") or 0))
        if finish != "length":
            finish = "tool_calls" if calls else "stop"
        return GenerationResult(text=text, tokens=[], finish_reason=finish,
                                usage=Usage(n_in, n_out, n_cached), timing=timing,
                                speculation=speculation, tool_calls=calls)


def child_body(req: GenerationRequest, default_max_tokens: int, opening: str = ""
               ) -> dict[str, Any]:
    """The streamed request the proxy sends to the child for `req` (also what the bench sends
    to the child directly, so both paths ask for exactly the same generation). `opening`: the
    beginning of a forced tool call, prefilled as the assistant's turn."""
    s = req.sampling
    body: dict[str, Any] = {
        "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": req.max_tokens or default_max_tokens, "temperature": s.temperature,
        "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        # llama-server samples with its own defaults otherwise (repeat penalty, ...)
        "repeat_penalty": s.repetition_penalty or 1.0,
        "timings_per_token": False, "cache_prompt": True,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if req.stop:
        body["stop"] = list(req.stop)
    fmt = req.response_format
    if fmt.constrained and req.uses_tools:  # (its schema grammar would leave no way to call)
        raise RequestError("a response format other than text cannot be combined with tools "
                           "on a model served by llama-server", "response_format")
    if fmt.constrained:  # llama-server compiles the schema into its own grammar
        body["json_schema"] = {"type": "object"} if fmt.type == "json_object" else \
            (fmt.schema or {})
    messages = None if req.messages is None else [message_json(m) for m in req.messages]
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = req.prompt
    if req.uses_tools:
        # llama-server takes "auto", "none" or "required": a named function is "required"
        # with only that function offered. Where the call's opening is known it is prefilled
        # instead (as the MLX engine does): llama-server continues the assistant's last message
        # and parses the call; its own "required" only constrains the call once it started.
        choice = req.tool_choice
        tools = [t for t in req.tools if choice.mode != "function" or t.name == choice.name]
        body["tools"] = [tool_json(t) for t in tools]
        body["tool_choice"] = "auto" if choice.mode == "auto" or opening else "required"
        body["parallel_tool_calls"] = req.parallel_tool_calls
        if opening and messages is not None:
            body["messages"] = [*messages, {"role": "assistant", "content": opening}]
    return body


class _Reply:
    """One streamed reply of the child as its bytes arrive, without I/O (`stream` and `relay`
    feed it): SSE lines split across reads, each event's text as a chunk, and what the result
    needs at the end (usage, timings, finish reason, time of the first token)."""

    def __init__(self, model: ServedModel, chat: bool, interrupt: Callable[[], None] | None):
        self.model = model
        self.chat = chat
        self.interrupt = interrupt
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.text: list[str] = []
        self.final: dict[str, Any] = {}
        self.done = False  # [DONE] seen, or the body ended
        self._rest = b""  # a partial line, completed by the next read
        self.calls: dict[int, dict[str, str]] = {}  # the child's tool calls, by its index

    def feed(self, data: bytes) -> Iterator[Chunk]:
        """The chunks in the next bytes of the body; b"" is its end (a last line without its
        newline still counts)."""
        if data:
            lines = (self._rest + data if self._rest else data).split(b"\n")
            self._rest = lines.pop()
        else:
            lines, self._rest, self.done = [self._rest], b"", True
        for event in _events(lines):
            if event is None:  # [DONE]
                self.done = True
                return
            if self.interrupt is not None:
                self.interrupt()
            piece = self.model._piece(event, self.chat, self.final)
            if piece:
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                self.text.append(piece)
                yield Chunk(piece)
            if self.chat:
                yield from self._tool_calls(event)

    def _tool_calls(self, event: dict[str, Any]) -> Iterator[Chunk]:
        """The child's `delta.tool_calls` (llama-server parses calls itself) as our typed
        deltas: a call's id and name first (with empty arguments), then its fragments."""
        for choice in event.get("choices") or []:
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                index = delta.get("index", len(self.calls))
                fn = delta.get("function") or {}
                if index not in self.calls:
                    if self.t_first is None:
                        self.t_first = time.perf_counter()
                    call_id = delta.get("id") or f"call_{uuid.uuid4().hex[:24]}"
                    self.calls[index] = {"id": call_id, "name": fn.get("name") or "",
                                         "arguments": ""}
                    yield Chunk("", tool_call=ToolCallDelta(len(self.calls) - 1, call_id,
                                                            self.calls[index]["name"], ""))
                fragment = fn.get("arguments") or ""
                if fragment:
                    self.calls[index]["arguments"] += fragment
                    position = list(self.calls).index(index)
                    yield Chunk("", tool_call=ToolCallDelta(position, arguments=fragment))

    def result(self) -> GenerationResult:
        calls = tuple(ToolCall(c["id"], c["name"], c["arguments"] or "{}")
                      for c in self.calls.values())
        return self.model._result("".join(self.text), self.final, self.t0, self.t_first,
                                  time.perf_counter(), calls)


def _events(lines: list[bytes]) -> Iterator[dict[str, Any] | None]:
    """The JSON payload of every `data:` line among `lines`; None for [DONE] (the end)."""
    for line in lines:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            yield None
            return
        try:
            event = _loads(payload)
        except ValueError:
            continue
        yield event


def _loads(payload: bytes) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        # What orjson refuses but json takes (a lone surrogate escape, NaN): parsed by json.
        return json.loads(payload)


def open_served(store: Any, spec: str, *, ready_timeout_s: float = 120.0,
                max_batch: int | None = None) -> ServedModel:
    """Fetch the card's GGUF, start its llama-server (with `served_slots(card, max_batch)`
    parallel slots), wait until it answers."""
    from skulkp2p.progress import ProgressBar

    card = store.resolve(spec).card
    binary = find_binary()
    if binary is None:
        raise ServedError(f"card {card.id} needs llama-server: install skulkp2p[served] or set "
                          "SKULKP2P_LLAMA_SERVER_BIN")
    model = resolve_gguf(store, card, lambda label: ProgressBar(label, sys.stderr))
    child = ServedChild(card.id, binary, server_args(store, card, model, max_batch=max_batch),
                        ready_timeout_s=ready_timeout_s)
    child.start()
    return ServedModel(card, child, detect_compute(binary))
