"""`localrun serve`: the OpenAI-compatible HTTP API over one continuously batched engine.

The event loop only moves bytes: a request passes the access policy (guard: Host, Origin,
Content-Type), its body is read within a size and time limit (json_body), and everything
heavier (JSON decoding, validation, chat template, tokenization) runs in one worker thread
(`prepare`). The request then goes to the engine thread (`EngineLoop`) and the handler relays
its events (responses): as SSE chunks (sse-starlette) for streams, as one JSON body otherwise. Every response carries the request's `timings` (queue, prefill, TTFT,
decode speed, cached prompt tokens); streams carry them in the chunk with the finish reason.
A client that goes away aborts its request, which frees its KV blocks at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from localrun.errors import UserError
from localrun.sampling import InvalidSamplingParam, SamplingParams
from localrun.server.engine_loop import EngineLoop, Event, ServerRequest
from localrun.server.guard import AccessPolicy, RequestGuard
from localrun.server.json_body import ClientGone, decode, read_body
from localrun.server.metrics import ServerMetrics
from localrun.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse
from localrun.server.responses import respond

log = logging.getLogger("localrun.server")

MAX_BODY_BYTES = 8 * 2**20
BODY_TIMEOUT_S = 30.0
# A body cannot hold more prompt than this many bytes per token of the context: a token is at
# most the longest piece of the vocabulary, and JSON spells a byte in at most 6 (\u0041).
JSON_BYTES_PER_TEXT_BYTE = 6
JSON_OVERHEAD_BYTES = 64 * 1024         # the body's keys, other fields, message framing


@dataclass
class ServerConfig:
    model_name: str                      # the id /v1/models reports
    aliases: frozenset[str] = frozenset()    # other names a request may use for the model
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    access: AccessPolicy = AccessPolicy()

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise UserError("the API key must not be empty; give a key or none")


class Server:
    """State shared by the handlers: the model, the engine thread, the metrics."""

    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        engine = llm.engine
        self.metrics = ServerMetrics(engine)
        self.loop = EngineLoop(engine, llm.tokenizer, observer=self.metrics)
        self.created = int(time.time())
        self.body_limit = min(config.max_body_bytes, context_body_bytes(llm))
        self.worker = anyio.CapacityLimiter(1)     # prompt preparation, one request at a time

    # --- checks ------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        """Keys compare as bytes: the header's raw bytes (HTTP carries UTF-8 keys as they are)
        against the key's UTF-8."""
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1")   # the raw bytes back
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        if not secrets.compare_digest(token, key.encode("utf-8")):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    def check_model(self, name: str | None) -> str:
        if name is None or name == self.config.model_name or name in self.config.aliases:
            return self.config.model_name
        raise APIError(404, f"the model '{name}' does not exist; this server serves "
                            f"'{self.config.model_name}'", code="model_not_found", param="model")

    async def read_body(self, request: Request) -> bytes:
        return await read_body(request, self.body_limit, self.config.body_timeout_s)

    async def prepare(self, raw: bytes, chat: bool) -> tuple:
        """Off the event loop: (body, model name, prompt ids, dropped messages, SamplingParams)."""
        return await anyio.to_thread.run_sync(self._prepare, raw, chat, limiter=self.worker)

    def _prepare(self, raw: bytes, chat: bool) -> tuple:
        body = parse(ChatCompletionRequest if chat else CompletionRequest, raw, decode(raw))
        body.refuse_unsupported()
        name = self.check_model(body.model)
        check_sampling(body, self.llm.n_vocab)       # before the costly part
        if chat:
            prompt_ids, dropped = self.chat_prompt(body)
        else:
            prompt_ids, dropped = self.completion_prompt(body), 0
        return body, name, prompt_ids, dropped, self.sampling_params(body, prompt_ids)

    def sampling_params(self, body, prompt_ids: list[int]) -> SamplingParams:
        n_ctx, n_prompt = self.llm.n_ctx, len(prompt_ids)
        if n_prompt >= n_ctx:
            raise APIError(400, f"the prompt has {n_prompt} tokens but the context holds {n_ctx}; "
                                "shorten it", code="context_length_exceeded", param="messages")
        max_tokens = body.requested_max_tokens()
        room = n_ctx - n_prompt
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"max_tokens is {max_tokens} but the context of {n_ctx} leaves room for "
                                f"{room} tokens after the {n_prompt}-token prompt",
                           code="context_length_exceeded", param="max_tokens")
        return SamplingParams(max_tokens=max_tokens, **body.sampling_kwargs())

    # --- prompts -------------------------------------------------------------------------
    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], int]:
        """The prompt's token ids, and how many of the oldest messages were left out so that the
        conversation fits the context (system messages and the last turn always stay)."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            messages, dropped = self.llm.fit_chat(messages, body.requested_max_tokens())
            return self.llm.chat_prompt_ids(messages), dropped
        except UserError as e:
            raise APIError(400, str(e), param="messages") from None

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.single_prompt()
        try:
            return self.llm.tokenize(prompt) if isinstance(prompt, str) else self.llm._check_ids(prompt)
        except UserError as e:
            raise APIError(400, str(e), param="prompt") from None

    # --- running ---------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str) -> ServerRequest:
        request = ServerRequest(f"{prefix}-{uuid.uuid4().hex[:24]}", prompt_ids, params,
                                asyncio.get_running_loop())
        self.loop.submit(request)
        return request

    def log_request(self, request: ServerRequest, event: Event | None, status: str) -> None:
        if event is None or event.timings is None:
            log.info("%s %s prompt=%d", request.request_id, status, len(request.prompt_ids))
            return
        t = event.timings
        log.info("%s %s finish=%s prompt=%d cached=%d generated=%d queue=%.0fms ttft=%.0fms "
                 "decode=%.1ftok/s", request.request_id, status, event.finish_reason,
                 t["prompt_tokens"], t["cached_tokens"] or 0, event.num_generated_tokens,
                 (t["queue_s"] or 0) * 1000, (t["ttft_s"] or 0) * 1000, t["decode_tok_s"] or 0.0)


def context_body_bytes(llm) -> int:
    """The largest body whose prompt could fit the context (see JSON_BYTES_PER_TEXT_BYTE)."""
    tokenizer = llm.tokenizer
    longest = max(len(tokenizer.piece(i, special=True)) for i in range(llm.n_vocab))
    return llm.n_ctx * max(longest, 1) * JSON_BYTES_PER_TEXT_BYTE + JSON_OVERHEAD_BYTES


def check_sampling(body, n_vocab: int) -> None:
    """The sampling fields' ranges (SamplingParams's rule), as a 400 naming the field."""
    try:
        params = SamplingParams(**body.sampling_kwargs())
    except InvalidSamplingParam as e:
        raise APIError(400, str(e), param=e.field) from None
    if params.logit_bias and params.logit_bias[-1][0] >= n_vocab:
        raise APIError(400, f"logit_bias names token id {params.logit_bias[-1][0]}, outside the vocabulary "
                            f"(0..{n_vocab - 1})", param="logit_bias")


def create_app(llm, config: ServerConfig) -> FastAPI:
    server = Server(llm, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    # /docs and /redoc are off; /openapi.json is a route below that asks for the API key
    app = FastAPI(title="localrun", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(RequestGuard, policy=config.access)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(InvalidSamplingParam)
    async def bad_sampling(request: Request, e: InvalidSamplingParam):
        return JSONResponse(APIError(400, str(e), param=e.field).body(), status_code=400)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone):
        log.info("%s", e)
        return Response(status_code=499)     # never delivered: nobody is listening

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):   # unknown route, wrong method
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        alive = server.loop._thread.is_alive()
        body = {"status": "ok" if alive else "error", "model": config.model_name,
                "requests_in_flight": server.loop.num_in_flight,
                "kv_blocks_used": server.loop.engine.block_manager.num_used_blocks}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        server.check_auth(request)
        return JSONResponse(app.openapi())

    @app.get("/metrics")
    async def metrics(request: Request):
        server.check_auth(request)
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": server.created, "owned_by": "localrun",
            "meta": {"n_ctx": llm.n_ctx, "n_vocab": llm.n_vocab, "architecture": llm.config.architecture,
                     "file": llm.model_path.name}}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        server.check_auth(request)
        body, name, prompt_ids, dropped, params = await server.prepare(await server.read_body(request), chat=True)
        sreq = server.submit(prompt_ids, params, "chatcmpl")
        if dropped:
            log.info("%s: dropped the %d oldest messages to fit the context of %d", sreq.request_id, dropped,
                     llm.n_ctx)
        return await respond(server, request, body, sreq, name, chat=True,
                             extra_timings={"dropped_messages": dropped})

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.check_auth(request)
        body, name, prompt_ids, _, params = await server.prepare(await server.read_body(request), chat=False)
        sreq = server.submit(prompt_ids, params, "cmpl")
        return await respond(server, request, body, sreq, name, chat=False, extra_timings={})

    return app


