"""The OpenAI API's request bodies, as the server accepts them, and its error bodies.

Requests are validated by pydantic models that forbid unknown fields, so a misspelt field is a 400
naming it rather than a silently ignored setting. Fields of the OpenAI API that maxlm does not
implement are accepted only at their neutral value (``n`` 1, penalties 0, no logprobs, ...); any
other value is a 400 naming the field. ``top_k``, ``ignore_eos`` and ``stop_token_ids`` are the
extra fields vLLM accepts (the ``openai`` client sends them with ``extra_body``).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from maxlm.serve.engine import RequestParams

MAX_STOP_STRINGS = 8


class APIError(Exception):
    """An error the client gets as an OpenAI error body: ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extra field; 0 and -1 are off
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    user: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field set to a value maxlm does not implement."""
        if self.n != 1:
            return "n", f"n = {self.n} is not supported: one completion per prompt (n = 1)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
        return None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        return tuple(stops)

    def params(self, max_tokens: int) -> RequestParams:
        return RequestParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                             top_k=max(self.top_k, 0), seed=self.seed, stop=self.stops(),
                             stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI API's default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", f"best_of = {self.best_of} is not supported (only 1)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs:
            return "top_logprobs", "logprobs are not supported"
        return super().unsupported()


def parse(model: type[BaseModel], body: Any) -> Any:
    """The request model from a decoded JSON body, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"unknown field {field!r}", field) from None
        if first["type"] == "missing":
            raise APIError(400, f"missing required field {field!r}", field) from None
        value = first.get("input")
        raise APIError(400, f"{field}: {first['msg']} (got {value!r:.80})", field.split(".")[0]) from None
    problem = request.unsupported()
    if problem:
        raise APIError(400, problem[1], problem[0])
    return request
