"""The OpenAI request bodies we accept, and the error objects we answer with.

Bodies are validated with pydantic; any failure becomes an `APIError` whose `body()` is the
OpenAI error object `{"error": {"message", "type", "param", "code"}}`. Fields the OpenAI API
defines but we cannot honour (n > 1, logprobs, penalties other than llama.cpp's repeat
penalty) are refused with a 400 rather than silently ignored; fields we don't know are
ignored, as OpenAI-compatible servers do, so that clients sending e.g. `user` keep working.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise APIError(400, f"content parts of type '{part.type}' are not supported; "
                                    "this model reads text only", param="messages")
        return "".join(p.text or "" for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    ignore_eos: bool = False

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported; send one request per completion", param="n")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; use repeat_penalty (llama.cpp's rule)",
                               param=name)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4:
            raise APIError(400, "at most 4 stop sequences are allowed", param="stop")

    def sampling_kwargs(self) -> dict:
        """The SamplingParams fields the client set (others keep localrun's defaults)."""
        out = {k: v for k in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed")
               if (v := getattr(self, k)) is not None}
        if self.stop is not None:
            out["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        out["ignore_eos"] = self.ignore_eos
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def requested_max_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens   # OpenAI's default for completions

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "a batch of prompts is not supported; send one request per prompt",
                               param="prompt")
            p = p[0]
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p


def parse(model_cls: type[_Body], raw: bytes) -> _Body:
    """A validated request body, or an APIError with one clear sentence."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate_json(raw, strict=True)   # strict: "1" is not a number
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"{where}: {first['msg']}", param=str(first["loc"][0]) if first["loc"] else None) \
            from None
