"""Request bodies of the OpenAI API as vLLM serves it, and how they become SamplingParams.

Unknown fields are ignored (as vLLM does); fields magicdec does not implement are refused with a 400 when they ask
for something (penalties, `best_of`, ...) rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from magicdec.errors import InvalidRequestError
from magicdec.sampling import SamplingParams

#: Fields of the OpenAI API magicdec does not implement, with the value that means "not asked for".
UNSUPPORTED = {"best_of": None, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
               "logit_bias": None, "tools": None, "response_format": None, "prompt_logprobs": None}


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields completions and chat completions share (vLLM's `top_k` and `ignore_eos` included)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def check_supported(self) -> None:
        for name, default in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name, default)
            if value not in (None, default):
                raise InvalidRequestError(f"`{name}` is not supported by this server")
        if not 1 <= self.n <= 128:
            raise InvalidRequestError(f"n must be an integer in [1, 128], got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true")

    @property
    def output_logprobs(self) -> int | None:
        """Alternatives to report with each generated token's log-probability (None: no log-probabilities)."""
        return None

    @property
    def input_logprobs(self) -> int | None:
        """Alternatives to report with each prompt token's log-probability (None: none)."""
        return None

    def sampling_params(self, max_tokens: int, index: int) -> SamplingParams:
        """Parameters of choice `index` (seeded choices take seed + index, so n > 1 gives n different samples)."""
        top_k = self.top_k or 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,  # the OpenAI default
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" -1
            seed=None if self.seed is None else self.seed + index,
            stop=self.stop_strings,
            ignore_eos=self.ignore_eos,
            logprobs=self.output_logprobs,
            prompt_logprobs=self.input_logprobs,
        )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """`logprobs`: alternatives per token (OpenAI's legacy format); `echo`: the prompt before the output, with its
    log-probabilities where `logprobs` asks (`max_tokens` 0: the prompt alone, as lm-evaluation-harness scores it);
    `prompt_logprobs`: vLLM's, the prompt's log-probabilities with that many alternatives."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI default for completions
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None

    @property
    def echo_only(self) -> bool:
        """The prompt alone is asked for: one token is generated (the engine's least) and not shown, as vLLM does."""
        return self.echo and self.max_tokens == 0

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def input_logprobs(self) -> int | None:
        return self.prompt_logprobs if self.prompt_logprobs is not None or not self.echo else self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); other part types are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"message content parts of type {part.get('type')!r} are not supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(GenerationRequest):
    """`logprobs`: report each generated token's log-probability, with `top_logprobs` alternatives (default 0)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")

    @property
    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


ERROR_TYPES: dict[int, str] = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
