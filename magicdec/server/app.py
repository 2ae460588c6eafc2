"""The OpenAI-compatible HTTP API over the AsyncEngine (FastAPI), and running it with uvicorn.

Routes as vLLM serves them: /v1/completions, /v1/chat/completions (SSE streaming with `stream`), /v1/models,
/tokenize, /detokenize, /tokenizer_info, /health, /metrics. Every error is the OpenAI envelope `{"error": {"message",
"type", "param", "code"}}`: 400 bad input, 401 missing key, 404 unknown model, 413 a body over the size limit, 429
full queue, 500 an engine failure, 503 a dead engine.

Hostile input costs about what reading it costs: a body over the limit is refused before it is parsed, a prompt
longer in characters than the context's tokens can spell is refused before it is tokenized, and tokenizing,
chat-template rendering and /detokenize run on a few threads off the event loop (the tokenizer releases the GIL), so a
slow one delays no other request's admission or stream.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from magicdec.engine import check_token_ids
from magicdec.errors import InvalidRequestError
from magicdec.loading.tokenizer import Tokenizer
from magicdec.logprobs import TokenLogprob
from magicdec.scheduler import QueueFullError
from magicdec.server.async_engine import AsyncEngine, EngineDeadError, Output
from magicdec.server.chat import ChatTemplate
from magicdec.server.detokenize import IncrementalDetokenizer
from magicdec.server.logprob_format import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs
from magicdec.server.metrics import ServerMetrics
from magicdec.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                      GenerationRequest, TokenizeRequest, error_body)

#: How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
#: Threads that tokenize, render chat templates and detokenize for the requests, off the event loop.
TEXT_THREADS = 4
MB = 1_000_000
#: The most bytes a prompt's character takes in a JSON body (a control character escaped as \\u0000).
JSON_BYTES_PER_CHAR = 6
#: The characters a token is taken to stand for in sizing the default body limit, where the tokenizer has no bound.
ASSUMED_TOKEN_CHARS = 32
#: How much of a refused body is still read (and thrown away) before the 413 goes out, past the limit, and for how
#: long: a client that writes its whole body before reading the answer (Python's urllib) then reads the 413, where a
#: connection closed on unread bytes would reset under it (nginx's lingering close does the same). Bounded, so that no
#: client keeps the server reading: the rest of a larger body is left unread (an announced one is answered at once),
#: and its client may see the connection reset.
DRAIN_BYTES = 64 * MB
DRAIN_S = 30.0

T = TypeVar("T")


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int, chat_template: str | None = None,
                   pad_token_id: int | None = None) -> dict[str, Any]:
    """vLLM's /tokenizer_info, the fields of a tokenizer_config.json: from it and /tokenize, lm-evaluation-harness's
    remote tokenizer finds the special tokens and the chat template with no tokenizer files of its own."""
    return {"tokenizer_class": "PreTrainedTokenizerFast",  # the class transformers loads a tokenizer.json as
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.token_text(pad_token_id), "add_bos_token": tokenizer.add_bos,
            "model_max_length": max_model_len, "chat_template": chat_template}


def default_max_request_bytes(max_model_len: int, max_token_chars: int | None) -> int:
    """The default body limit: room for a prompt of `max_model_len` of the longest tokens, every character escaped,
    and 1 MB for the rest of the body, in whole MB (5 MB for SmolLM2 at its 8k context, 81 characters a token)."""
    prompt = max_model_len * (max_token_chars or ASSUMED_TOKEN_CHARS) * JSON_BYTES_PER_CHAR
    return (math.ceil(prompt / MB) + 1) * MB


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
    prompt: list[int]
    detok: IncrementalDetokenizer
    prompt_text: str = ""  # shown before the output where the request echoes its prompt
    tokens: int = 0
    cached_tokens: int = 0  # of the prompt, taken from the prefix cache
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the output tokens, where asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
    shown_chars: int = 0  # characters of the token texts whose log-probabilities were streamed (their offsets)
    started: bool = False  # a streamed chunk was sent (the echoed prompt goes with the first)

    def record(self, out: Output) -> str:
        """Apply an Output to the choice; the text it makes final."""
        self.tokens += len(out.new_ids)
        self.cached_tokens = out.cached_tokens
        self.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        delta = self.detok.push(out.new_ids)
        if out.finish_reason is not None:
            delta += self.detok.finish(out.text)
            self.text, self.finish_reason = out.text, out.finish_reason
        return delta


@dataclass
class _Call:
    """One completion call: its choices (n per prompt), all sending their Outputs to one queue. `logprobs`: the
    responses show the tokens' log-probabilities; `echo`: the prompt before the output (`hide_output`: the prompt
    alone); `prompt_logprobs`: vLLM's field of the prompt's log-probabilities."""

    kind: str  # "text_completion" or "chat.completion"
    model: str
    engine: AsyncEngine
    n: int  # choices per prompt
    texts: TokenTexts
    logprobs: bool = False
    echo: bool = False
    hide_output: bool = False
    prompt_logprobs: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    choices: dict[str, _Choice] = field(default_factory=dict)  # by request id, in index order
    prompt_tokens: list[int] = field(default_factory=list)  # per prompt, counted once however many choices
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"

    def usage(self) -> dict:
        """OpenAI's usage; a prompt's cached tokens are its choices' most (a prompt counts once, as its tokens do)."""
        prompt = sum(self.prompt_tokens)
        completion = 0 if self.hide_output else sum(c.tokens for c in self.choices.values())
        per_prompt: dict[int, int] = {}
        for c in self.choices.values():
            p = c.index // self.n
            per_prompt[p] = max(per_prompt.get(p, 0), c.cached_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())}}

    def withdraw(self) -> None:
        """Abort the unfinished requests (the engine ignores ids it no longer knows)."""
        for choice in self.choices.values():
            if choice.finish_reason is None:
                self.engine.abort(choice.request_id)

    def envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def shown(self, choice: _Choice, text: str, entries: list[TokenLogprob], with_prompt: bool) -> tuple[str,
                                                                                                        dict | None]:
        """The text and `logprobs` a response shows for output `text` whose tokens' log-probabilities are `entries`,
        after the prompt's where `with_prompt` (an echo)."""
        if self.hide_output:
            text, entries = "", []
        tokens, shown = [e.token for e in entries], list(entries)
        if with_prompt and self.echo:
            text, tokens = choice.prompt_text + text, choice.prompt + tokens
            shown = (choice.prompt_logprobs or [None] * len(choice.prompt)) + shown
        if not self.logprobs:
            return text, None
        if self.kind == "chat.completion":
            return text, {"content": chat_logprobs(shown, self.texts)}
        body = completion_logprobs(tokens, shown, self.texts, choice.shown_chars)
        choice.shown_chars += sum(map(len, body["tokens"]))
        return text, body

    def choice_body(self, choice: _Choice, text: str, logprobs: dict | None, finish_reason: str | None,
                    whole: bool) -> dict:
        """A choice as a response shows it: whole (the JSON answer) or the part of a chunk."""
        if self.kind != "chat.completion":
            content = {"text": text}
        elif whole:
            content = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"delta": {"content": text} if text else {}}
        body = {"index": choice.index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.prompt_logprobs and (whole or not choice.started):
            body["prompt_logprobs"] = prompt_logprobs(choice.prompt_logprobs or [], self.texts)
        return body

    def chunk(self, choice: _Choice, text: str, finish_reason: str | None, usage: bool,
              logprobs: dict | None = None) -> dict:
        out = self.envelope(self.chunk_kind, [self.choice_body(choice, text, logprobs, finish_reason, False)])
        if usage:
            out["usage"] = None
        return out

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """The SSE events of the call (its requests are withdrawn by _CallStream however the stream ends)."""
        if self.kind == "chat.completion":
            for choice in self.choices.values():
                first = self.chunk(choice, "", None, include_usage)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield f"data: {json.dumps(first)}\n\n"
        pending = set(self.choices)
        while pending:
            out = await self.queue.get()
            if out.error is not None:
                yield f"data: {json.dumps(error_body(500, out.error))}\n\n"
                break
            if out.last:
                pending.discard(out.request_id)
            choice = self.choices[out.request_id]
            text, logprobs = self.shown(choice, choice.record(out), out.logprobs or [], not choice.started)
            if text or out.last or (logprobs is not None and out.new_ids):
                event = self.chunk(choice, text, choice.finish_reason, include_usage, logprobs)
                choice.started = True
                yield f"data: {json.dumps(event)}\n\n"
        else:
            if include_usage:
                usage = {**self.envelope(self.chunk_kind, []), "usage": self.usage()}
                yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"

    async def collect(self, http: Request) -> dict | None:
        """Wait for every choice; None if the client disconnected first (its requests are aborted)."""
        pending = set(self.choices)
        try:
            while pending:
                try:
                    out = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await http.is_disconnected():
                        return None
                    continue
                if out.error is not None:
                    raise ApiError(500, out.error)
                self.choices[out.request_id].record(out)
                if out.last:
                    pending.discard(out.request_id)
        finally:
            self.withdraw()
        choices = [self.choice_body(c, *self.shown(c, c.text, c.logprobs, True), c.finish_reason, True)
                   for c in self.choices.values()]
        return {**self.envelope(self.kind, choices), "usage": self.usage()}


class _CallStream(StreamingResponse):
    """An SSE response that withdraws its requests however it ends: done, failed, or the client gone (even before the
    first byte, when the event generator never starts and so cannot clean up itself)."""

    def __init__(self, events: AsyncIterator[str], withdraw: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream")
        self._withdraw = withdraw

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._withdraw()


@dataclass
class Server:
    """What the routes share (engine, tokenizer, the model's names and chat template, API key); the routes."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model_name: str
    model_root: str
    template: ChatTemplate | None = None
    api_key: str | None = None
    on_ready: Callable[[], None] | None = None
    on_stopped: Callable[[], None] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # /tokenizer_info's answer
    created: int = field(default_factory=lambda: int(time.time()))
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="magicdec-text"))
    texts: TokenTexts = field(init=False)  # single tokens' texts, for log-probabilities

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)

    @property
    def max_prompt_chars(self) -> int | None:
        """The longest prompt text that can fit in the context (None: the tokenizer bounds no token's length)."""
        longest = self.tokenizer.max_token_chars
        return None if longest is None else self.engine.max_model_len * longest

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.engine.start()
        if self.on_ready is not None:
            self.on_ready()
        yield
        self.engine.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.on_stopped is not None:
            self.on_stopped()

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on one of the text threads."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def check_api_key(self, request: Request) -> None:
        """The /v1 routes' dependency (a dependency, not an HTTP middleware, which would hide disconnects)."""
        given = request.headers.get("authorization", "")
        if self.api_key is not None and not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)")

    def check_model(self, name: str | None) -> str:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model `{name}` does not exist (this server serves `{self.model_name}`)", "model")
        return self.model_name

    def check_fits(self, text: str, param: str) -> None:
        """Refuse a prompt text longer than any that can fit in the context, before it is tokenized."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise ApiError(400, f"the prompt has {len(text)} characters, more than the context of "
                                f"{self.engine.max_model_len} tokens can hold ({limit}: no token of this model stands "
                                f"for more than {self.tokenizer.max_token_chars} characters)", param)

    async def encode(self, texts: list[str], add_bos: bool = True) -> list[list[int]]:
        """Token ids of prompt texts, each checked to fit first."""
        for text in texts:
            self.check_fits(text, "prompt")
        return await self.off_loop(self.tokenizer.encode_batch, texts, add_bos)

    async def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> list[int]:
        if self.template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        return await self.off_loop(self.chat_ids, [{"role": m.role, "content": m.text()} for m in messages],
                                   add_generation_prompt)

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The prompt ids of chat messages (on a text thread): the rendered text, checked to fit, then tokenized."""
        text = self.template.render(messages, add_generation_prompt)
        self.check_fits(text, "messages")
        return self.tokenizer.encode(text, add_bos=False)  # the template places BOS itself

    async def completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(isinstance(p, str) and not p for p in prompt):
            raise InvalidRequestError("the prompt is empty")
        texts = iter(await self.encode([p for p in prompt if isinstance(p, str)]))
        return [next(texts) if isinstance(p, str) else p for p in prompt]

    def call(self, kind: str, body: GenerationRequest, **shows: bool) -> _Call:
        """A call of `kind` for a checked `body`, showing log-probabilities where it asks, and `shows` (_Call's
        echo, hide_output, prompt_logprobs)."""
        body.check_supported()
        return _Call(kind, self.check_model(body.model), self.engine, body.n, self.texts,
                     logprobs=body.output_logprobs is not None, **shows)

    async def generate(self, http: Request, body: GenerationRequest, prompts: list[list[int]], call: _Call,
                       max_tokens: int | None, prompt_texts: list[str] | None = None) -> Response:
        """Queue every choice of `call` (n per prompt; `prompt_texts` for an echo), on any refusal withdrawing those
        already queued; then the response: a stream of events, or the whole completion."""
        try:
            for p, prompt in enumerate(prompts):
                room = self.engine.max_model_len - len(prompt)
                if room < 1:
                    raise ApiError(400, f"the prompt has {len(prompt)} tokens, more than the context of "
                                        f"{self.engine.max_model_len} tokens leaves room for", "prompt")
                call.prompt_tokens.append(len(prompt))
                for j in range(body.n):
                    index = p * body.n + j
                    choice = _Choice(index, f"{call.id}-{index}", prompt,
                                     IncrementalDetokenizer(self.tokenizer, body.stop_strings),
                                     prompt_texts[p] if prompt_texts is not None else "")
                    params = body.sampling_params(room if max_tokens is None else max_tokens, j)
                    call.choices[choice.request_id] = choice  # before adding: a cancelled add is withdrawn too
                    await self.engine.add(choice.request_id, prompt, params, call.queue)
        except BaseException:
            call.withdraw()
            raise
        if body.stream:
            return _CallStream(call.stream(body.include_usage), call.withdraw)
        result = await call.collect(http)
        return JSONResponse(result) if result is not None else Response(status_code=499)

    # --- routes ----------------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        prompts = await self.completion_prompts(body.prompt)
        call = self.call("text_completion", body, echo=body.echo, hide_output=body.echo_only,
                         prompt_logprobs=body.prompt_logprobs is not None)
        texts = [await self.off_loop(self.tokenizer.decode, p) for p in prompts] if body.echo else None
        return await self.generate(http, body, prompts, call, 1 if body.echo_only else body.max_tokens, texts)

    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        self.check_model(body.model)
        prompt = await self.render_chat(body.messages, body.add_generation_prompt)
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        return await self.generate(http, body, [prompt], self.call("chat.completion", body), max_tokens)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "magicdec", "root": self.model_root, "parent": None,
                                            "max_model_len": self.engine.max_model_len}]}

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give either `prompt` or `messages`")
        if body.messages is not None:
            tokens = await self.render_chat(body.messages, body.add_generation_prompt)
        else:
            [tokens] = await self.encode([body.prompt], add_bos=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens, "token_strs": None}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        if body.tokens:
            check_token_ids(body.tokens, self.tokenizer.vocab_size)
        # special tokens kept, as in vLLM: lm-evaluation-harness sends decoded token ids as text to be scored
        return {"prompt": await self.off_loop(self.tokenizer.decode, body.tokens, False)}

    async def tokenizer_info(self) -> dict:
        return self.info

    async def health(self) -> Response:
        if not self.engine.alive:
            return _error(503, f"the engine is not running ({self.engine.error or 'stopped'})")
        return Response(status_code=200)

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- the body limit ---------------------------------------------------------------------------------------------
class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 without being parsed: at once where its
    Content-Length says so, as soon as what was read passes the limit where it comes in chunks.

    The rest of a refused body is read and thrown away first (up to DRAIN_BYTES past the limit, for DRAIN_S), so that
    every client reads the answer, urllib's too, which writes its whole body before reading and closes its side with
    `Connection: close`. A client that sent `Expect: 100-continue` is answered at once: it sends no body until told to.

    (FastAPI's own `max_body_size` answers an announced one in plain text, not in the OpenAI envelope.)"""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit
        self.message = (f"the request body is larger than this server's limit of {limit / MB:g} MB "
                        "(magicdec serve --max-request-mb)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            waits = headers.get("expect", "").lower() == "100-continue"
            if not waits and int(length) <= self.limit + DRAIN_BYTES:
                await _drain(receive, int(length))
            return await _error(413, self.message)(scope, receive, send)
        read = 0

        async def limited() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_BYTES)
                # raised inside the route's reading of the body: FastAPI passes HTTP exceptions to the handlers
                raise StarletteHTTPException(413, self.message)
            return message

        await self.app(scope, limited, send)


async def _drain(receive: Receive, most: int) -> None:
    """Read and discard the rest of a request body: until its end, the client's leaving, `most` bytes or DRAIN_S."""
    left = most
    try:
        async with asyncio.timeout(DRAIN_S):
            while left >= 0:
                message = await receive()
                left -= len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
    except TimeoutError:
        pass  # answered now: a client still sending may see its connection reset


# --- errors ------------------------------------------------------------------------------------------------
_STATUS = {QueueFullError: 429, InvalidRequestError: 400, EngineDeadError: 503}  # for exceptions that carry none


async def _on_error(request: Request, e: Exception) -> JSONResponse:
    if isinstance(e, ApiError):
        return _error(e.status, e.message, e.param)
    if isinstance(e, StarletteHTTPException):
        return _error(e.status_code, str(e.detail))
    return _error(next(status for kind, status in _STATUS.items() if isinstance(e, kind)), str(e))


async def _on_validation(request: Request, e: RequestValidationError) -> JSONResponse:
    # FastAPI says 422; OpenAI clients expect 400 for a malformed body.
    errors = e.errors()
    param = ".".join(str(x) for x in errors[0]["loc"][1:]) if errors else None
    message = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in errors)
    return _error(400, f"invalid request: {message}", param or None)


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, metrics: ServerMetrics, *, model_name: str,
              model_root: str, chat_template: str | None = None, api_key: str | None = None,
              max_request_bytes: int | None = None, pad_token_id: int | None = None,
              on_ready: Callable[[], None] | None = None, on_stopped: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app; it starts the engine thread on startup and stops it on shutdown (calling `on_ready` and
    `on_stopped` after each). A request body over `max_request_bytes` (default: `default_max_request_bytes`) gets 413
    without being parsed. `pad_token_id` is only reported (/tokenizer_info)."""
    template = ChatTemplate(chat_template, tokenizer) if chat_template else None
    server = Server(engine, tokenizer, metrics, model_name, model_root, template, api_key, on_ready, on_stopped,
                    tokenizer_info(tokenizer, engine.max_model_len, chat_template, pad_token_id))
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine.max_model_len, tokenizer.max_token_chars)
    app = FastAPI(title="magicdec", lifespan=server.lifespan)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    for kind in (ApiError, StarletteHTTPException, *_STATUS):
        app.add_exception_handler(kind, _on_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.check_api_key)])  # the others are open, as in vLLM
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"])
    v1.add_api_route("/models", server.models, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", server.tokenizer_info, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    return app


def run_server(app: FastAPI, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve until Ctrl-C or SIGTERM (uvicorn's handlers: stop accepting, let open requests finish for up to 5 s,
    then the app's shutdown stops the engine). The socket is bound and listening before the app starts, so the
    "ready" line is true when printed, and a busy port is a plain OSError."""
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
