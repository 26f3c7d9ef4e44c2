"""The OpenAI request bodies we accept, and the error objects we answer with.

Bodies are decoded within limits (json_body), checked for fields we cannot honour, then
validated with pydantic; any failure becomes an `APIError` whose `body()` is the OpenAI error
object `{"error": {"message", "type", "param", "code"}}`, its `code` always a string (the
status's name in DEFAULT_CODES where the raiser gives none), so clients can branch on it.
Every OpenAI field we do not implement (best_of > 1, functions, audio, ...) is refused with a
400 naming it when it asks for something, rather than silently ignored; a field at its no-op
value (best_of: 1) passes.
Fields no one defines are ignored, as OpenAI-compatible servers do. Sampling ranges are
checked by SamplingParams, the same rule as the Python API's; schemas and grammars by
localrun.grammar (failing closed), tools by localrun.tools.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from localrun.sampling_params import MAX_TOP_LOGPROBS

MAX_N = 16      # choices per request: each is a sequence in the engine (one prefill, n decodes)

# An error's code when its raiser names none: OpenAI's and llama.cpp's words where they have one
DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 408: "request_timeout", 409: "conflict", 413: "request_too_large",
                 415: "unsupported_media_type", 422: "invalid_request", 429: "rate_limit_exceeded",
                 500: "internal_error", 501: "not_implemented", 503: "unavailable", 504: "timeout"}


def default_code(status: int) -> str:
    return DEFAULT_CODES.get(status, "invalid_request" if status < 500 else "internal_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else default_code(status)
        self.headers = headers    # e.g. Retry-After on a 503

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None       # an assistant's earlier calls
    tool_call_id: str | None = None                # a tool's answer: which call it answers

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
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = None                  # vLLM's and llama-cpp-python's: no end of generation before
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None     # token id (as a string, as OpenAI sends it) -> bias
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    grammar: str | None = None                     # llama.cpp's field: GBNF (or Lark)
    json_schema: dict[str, Any] | None = None      # llama.cpp's field: a bare JSON schema

    def refuse_unsupported(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4:
            raise APIError(400, "at most 4 stop sequences are allowed", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop sequences must not be empty", param="stop")

    def sampling_kwargs(self, n_ctx: int | None = None) -> dict:
        """The SamplingParams fields the client set (others keep localrun's defaults). With
        n_ctx, also max_tokens as the request bounds it before its prompt is known (what it
        asked for, else the whole context): what the door checks min_tokens against, rather
        than SamplingParams' default."""
        out = {k: v for k in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed",
                              "presence_penalty", "frequency_penalty", "min_tokens")
               if (v := getattr(self, k)) is not None}
        if self.num_logprobs() is not None:
            out["logprobs"] = self.num_logprobs()
        if self.stop is not None:
            out["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.logit_bias:
            out["logit_bias"] = tuple((token_id(key), value) for key, value in self.logit_bias.items())
        out["ignore_eos"] = self.ignore_eos
        if n_ctx is not None:
            requested = self.requested_max_tokens()
            out["max_tokens"] = requested if requested is not None else n_ctx
        return out

    def requested_max_tokens(self) -> int | None:
        """The reply's bound the client asked for (None: as much as the context leaves)."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the sampled token's and the k most likely."""
        raise NotImplementedError

    def constraint_fields(self) -> list[tuple[str, str, Any]]:
        """(field, kind, source) of each output constraint the body asks for."""
        out = []
        if self.grammar is not None:
            out.append(("grammar", "grammar", self.grammar))
        if self.json_schema is not None:
            out.append(("json_schema", "json_schema", self.json_schema))
        return out


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")   # llama.cpp's json_object with a schema


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def constraint_fields(self) -> list[tuple[str, str, Any]]:
        out = super().constraint_fields()
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":     # llama.cpp's form may carry a schema: enforced
            out.append(("response_format", "json_schema", fmt.schema_) if fmt.schema_ is not None
                       else ("response_format", "json_object", None))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            out.append(("response_format", "json_schema", fmt.json_schema.schema_))
        return out

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs

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


def token_id(key: str) -> int:
    """A logit_bias key: a token id written as a string ("1234")."""
    if not (key.isascii() and key.isdigit() and len(key) <= 12):
        raise APIError(400, f"logit_bias keys must be token ids, got '{key[:20]}'", param="logit_bias")
    return int(key)


def _no_op(*values):
    return lambda v: v in (None, *values)


# OpenAI (and llama.cpp) fields we do not implement, with the values that ask for nothing
UNSUPPORTED = {
    "best_of": (_no_op(1), "best_of is not supported; use n for several choices"),
    "functions": (_no_op([]), "functions (the deprecated function calling) are not supported; use tools"),
    "function_call": (_no_op("none"), "function_call (deprecated) is not supported; use tool_choice"),
    "audio": (_no_op(), "audio output is not supported"),
    "modalities": (_no_op(["text"]), "modalities other than text are not supported"),
    "prediction": (_no_op(), "predicted outputs are not supported"),
    "web_search_options": (_no_op(), "web search is not supported"),
    "reasoning_effort": (_no_op(), "reasoning_effort is not supported"),
    "echo": (_no_op(False), "echo is not supported"),
    "suffix": (_no_op(""), "suffix (fill-in-the-middle) is not supported"),
    "mirostat": (_no_op(0), "mirostat sampling is not supported"),
    "typical_p": (_no_op(1, 1.0), "typical_p sampling is not supported"),
}
def refuse_unsupported(data: dict) -> None:
    """A 400 naming the first field that asks for something this server does not do."""
    for name, (is_no_op, message) in UNSUPPORTED.items():
        if name in data and not is_no_op(data[name]):
            raise APIError(400, message, param=name, code="unsupported_parameter")


def parse(model_cls: type[_Body], raw: bytes, data: dict) -> _Body:
    """A validated request body (raw, already decoded to data by json_body.decode), or an
    APIError with one clear sentence."""
    refuse_unsupported(data)
    try:
        return model_cls.model_validate_json(raw, strict=True)   # strict: "1" is not a number
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"{where}: {first['msg']}", param=str(first["loc"][0]) if first["loc"] else None) \
            from None
