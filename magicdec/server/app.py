"""The OpenAI-compatible HTTP API over the AsyncEngine (FastAPI), and running it with uvicorn.

Routes as vLLM serves them: /v1/completions, /v1/chat/completions (SSE streaming with `stream`),
/v1/models, /tokenize, /detokenize, /health, /metrics. Every error is the OpenAI envelope
`{"error": {"message", "type", "param", "code"}}`: 400 bad input, 401 missing key, 404 unknown model,
429 full queue, 500 an engine failure, 503 a dead engine.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from magicdec.engine import check_token_ids
from magicdec.errors import InvalidRequestError
from magicdec.loading.tokenizer import Tokenizer
from magicdec.scheduler import QueueFullError
from magicdec.server.async_engine import AsyncEngine, EngineDeadError, Output
from magicdec.server.chat import ChatTemplate
from magicdec.server.detokenize import IncrementalDetokenizer
from magicdec.server.metrics import ServerMetrics
from magicdec.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                      GenerationRequest, TokenizeRequest, error_body)

#: How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


class ApiError(Exception):
    """An error answered with the OpenAI envelope."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


@dataclass
class _Choice:
    """One generated sequence of a response (request `request_id` in the engine)."""

    index: int
    request_id: str
    prompt_tokens: int
    detok: IncrementalDetokenizer
    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None


@dataclass
class _Call:
    """One completion call: its choices (n per prompt), all sending their Outputs to one queue."""

    kind: str  # "text_completion" or "chat.completion"
    model: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    choices: dict[str, _Choice] = field(default_factory=dict)
    prompt_tokens: list[int] = field(default_factory=list)  # per prompt, counted once however many choices
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"

    def usage(self) -> dict[str, int]:
        prompt, completion = sum(self.prompt_tokens), sum(c.tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _CallStream(StreamingResponse):
    """An SSE response that withdraws its requests however it ends: done, failed, or the client gone (even
    before the first byte, when the event generator never starts and so cannot clean up itself)."""

    def __init__(self, events: AsyncIterator[str], withdraw: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream")
        self._withdraw = withdraw

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._withdraw()


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, metrics: ServerMetrics, *, model_name: str,
              model_root: str, chat_template: str | None = None, api_key: str | None = None,
              on_ready: Callable[[], None] | None = None, on_stopped: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app; it starts the engine thread on startup and stops it on shutdown (calling
    `on_ready` and `on_stopped` after each)."""
    chat = ChatTemplate(chat_template, tokenizer) if chat_template else None
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if on_ready is not None:
            on_ready()
        yield
        engine.stop()
        if on_stopped is not None:
            on_stopped()

    async def check_api_key(request: Request) -> None:
        """The /v1 routes' dependency (a dependency, not an HTTP middleware, which would hide disconnects)."""
        given = request.headers.get("authorization", "")
        if api_key is not None and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)")

    app = FastAPI(title="magicdec", lifespan=lifespan)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    # --- errors --------------------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.message, e.param)

    @app.exception_handler(QueueFullError)
    async def on_queue_full(request: Request, e: QueueFullError) -> JSONResponse:
        return _error(429, str(e))

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(request: Request, e: InvalidRequestError) -> JSONResponse:
        return _error(400, str(e))

    @app.exception_handler(EngineDeadError)
    async def on_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return _error(503, str(e))

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI clients expect 400 for a malformed body.
        errors = e.errors()
        param = ".".join(str(x) for x in errors[0]["loc"][1:]) if errors else None
        message = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in errors)
        return _error(400, f"invalid request: {message}", param or None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    # --- helpers ------------------------------------------------------------------------------------------
    def check_model(name: str | None) -> str:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model `{name}` does not exist (this server serves `{model_name}`)", "model")
        return model_name

    def render_chat(messages: Sequence[ChatMessage], add_generation_prompt: bool) -> list[int]:
        if chat is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        text = chat.render([{"role": m.role, "content": m.text()} for m in messages], add_generation_prompt)
        return tokenizer.tok.encode(text, add_special_tokens=False).ids  # the template places BOS itself

    def completion_prompts(prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        for p in prompt:
            if isinstance(p, str) and not p:
                raise InvalidRequestError("the prompt is empty")
        return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]

    async def start(body: GenerationRequest, prompts: list[list[int]], kind: str,
                    max_tokens: int | None) -> _Call:
        """Queue every choice (n per prompt); on any refusal, withdraw those already queued."""
        body.check_supported()
        call = _Call(kind, check_model(body.model))
        try:
            for p, prompt in enumerate(prompts):
                room = engine.max_request_tokens - len(prompt)
                if room < 1:
                    raise ApiError(400, f"the prompt has {len(prompt)} tokens, more than the context of "
                                        f"{engine.max_request_tokens} tokens leaves room for", "prompt")
                call.prompt_tokens.append(len(prompt))
                for j in range(body.n):
                    choice = _Choice(p * body.n + j, f"{call.id}-{p * body.n + j}", len(prompt),
                                     IncrementalDetokenizer(tokenizer, body.stop_strings))
                    params = body.sampling_params(room if max_tokens is None else max_tokens, j)
                    call.choices[choice.request_id] = choice  # before adding: a cancelled add is withdrawn too
                    await engine.add(choice.request_id, prompt, params, call.queue)
        except BaseException:
            withdraw(call)
            raise
        return call

    def withdraw(call: _Call) -> None:
        """Abort the call's unfinished requests (the engine ignores ids it no longer knows)."""
        for choice in call.choices.values():
            if choice.finish_reason is None:
                engine.abort(choice.request_id)

    def chunk(call: _Call, choice: _Choice, text: str, finish_reason: str | None, usage: bool) -> dict:
        if call.kind == "chat.completion":
            body = {"index": choice.index, "delta": {"content": text} if text else {}, "logprobs": None,
                    "finish_reason": finish_reason}
        else:
            body = {"index": choice.index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        out = {"id": call.id, "object": call.chunk_kind, "created": call.created, "model": call.model,
               "choices": [body]}
        if usage:
            out["usage"] = None
        return out

    def record(choice: _Choice, out: Output) -> str:
        """Apply an Output to its choice; the text it makes final."""
        choice.tokens += len(out.new_ids)
        delta = choice.detok.push(out.new_ids)
        if out.finish_reason is not None:
            delta += choice.detok.finish(out.text)
            choice.text, choice.finish_reason = out.text, out.finish_reason
        return delta

    async def stream(call: _Call, include_usage: bool) -> AsyncIterator[str]:
        """The SSE events of a call (its requests are withdrawn by _CallStream however the stream ends)."""
        if call.kind == "chat.completion":
            for choice in sorted(call.choices.values(), key=lambda c: c.index):
                first = chunk(call, choice, "", None, include_usage)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield f"data: {json.dumps(first)}\n\n"
        pending = set(call.choices)
        while pending:
            out = await call.queue.get()
            if out.error is not None:
                yield f"data: {json.dumps(error_body(500, out.error))}\n\n"
                break
            if out.last:
                pending.discard(out.request_id)
            choice = call.choices[out.request_id]
            text = record(choice, out)
            if text or out.last:
                yield f"data: {json.dumps(chunk(call, choice, text, choice.finish_reason, include_usage))}\n\n"
        else:
            if include_usage:
                usage = {"id": call.id, "object": call.chunk_kind, "created": call.created, "model": call.model,
                         "choices": [], "usage": call.usage()}
                yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"

    async def collect(http: Request, call: _Call) -> dict | None:
        """Wait for every choice; None if the client disconnected first (its requests are aborted)."""
        pending = set(call.choices)
        try:
            while pending:
                try:
                    out = await asyncio.wait_for(call.queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await http.is_disconnected():
                        return None
                    continue
                if out.error is not None:
                    raise ApiError(500, out.error)
                record(call.choices[out.request_id], out)
                if out.last:
                    pending.discard(out.request_id)
        finally:
            withdraw(call)
        choices = []
        for c in sorted(call.choices.values(), key=lambda c: c.index):
            if call.kind == "chat.completion":
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": None, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason})
        return {"id": call.id, "object": call.kind, "created": call.created, "model": call.model,
                "choices": choices, "usage": call.usage()}

    async def respond(http: Request, body: GenerationRequest, call: _Call) -> Response:
        if body.stream:
            return _CallStream(stream(call, body.include_usage), lambda: withdraw(call))
        result = await collect(http, call)
        return JSONResponse(result) if result is not None else Response(status_code=499)

    # --- routes ------------------------------------------------------------------------------------------
    @v1.post("/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        call = await start(body, completion_prompts(body.prompt), "text_completion", body.max_tokens)
        return await respond(http, body, call)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        check_model(body.model)
        prompt = render_chat(body.messages, body.add_generation_prompt)
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        call = await start(body, [prompt], "chat.completion", max_tokens)
        return await respond(http, body, call)

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "magicdec", "root": model_root, "parent": None,
                                            "max_model_len": engine.max_request_tokens}]}

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give either `prompt` or `messages`")
        if body.messages is not None:
            tokens = render_chat(body.messages, body.add_generation_prompt)
        elif body.add_special_tokens:
            tokens = tokenizer.encode(body.prompt)
        else:
            tokens = tokenizer.tok.encode(body.prompt, add_special_tokens=False).ids
        return {"count": len(tokens), "max_model_len": engine.max_request_tokens, "tokens": tokens,
                "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        if body.tokens:
            check_token_ids(body.tokens, tokenizer.vocab_size)
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return _error(503, f"the engine is not running ({engine.error or 'stopped'})")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_server(app: FastAPI, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve until Ctrl-C or SIGTERM (uvicorn's handlers: stop accepting, let open requests finish for up to
    5 s, then the app's shutdown stops the engine). The socket is bound and listening before the app
    starts, so the "ready" line is true when printed, and a busy port is a plain OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind((host, port))
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
        sock.listen(2048)
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
