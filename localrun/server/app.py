"""`localrun serve`: the OpenAI-compatible HTTP API over one continuously batched engine.

The event loop only moves bytes: a request passes the access policy (guard: Host, Origin,
Content-Type), its body is read within a size and time limit (json_body), and everything
heavier (JSON decoding, validation, and the front end's chat template and tokenization) runs
in a few worker threads (`prepare`, PREPARE_WORKERS). The request then goes to the engine thread (`EngineLoop`) and the handler relays
its events (responses): as SSE chunks (sse-starlette) for streams, as one JSON body otherwise. Every response carries the request's `timings` (queue, prefill, TTFT,
decode speed, cached prompt tokens); streams carry them in the chunk with the finish reason.
A client that goes away aborts its request, which frees its KV blocks at the next step.

OpenAI's fields beyond plain sampling (issue 19): `n` choices become n engine sequences
(`submit`), `response_format`/`grammar`/`json_schema` a token mask (localrun.grammar), `tools`
a template render plus a parse of the reply (localrun.tools), logprobs ride on the engine's
outputs. Any model name is served by the one model unless `strict_model_name`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from localrun.errors import UserError
from localrun.frontend import ContextLengthExceeded, FrontEnd, choice_params
from localrun.grammar import GrammarError
from localrun.sampling_params import InvalidSamplingParam, SamplingParams
from localrun.tools import ToolError, ToolPlan
from localrun.server import DEFAULT_MAX_QUEUE
from localrun.server.engine_loop import EngineLoop, Event, ServerRequest
from localrun.server.guard import AccessPolicy, RequestGuard, api_key_problem
from localrun.server.json_body import ClientGone, decode, read_body
from localrun.server.metrics import ServerMetrics
from localrun.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse
from localrun.server.responses import respond

if TYPE_CHECKING:
    from localrun.api import LLM
    from localrun.engine.llm_engine import LLMEngine

log = logging.getLogger("localrun.server")

MAX_BODY_BYTES = 8 * 2**20
BODY_TIMEOUT_S = 30.0
# A body cannot hold more prompt than this many bytes per token of the context: a token is at
# most the longest piece of the vocabulary, and JSON spells a byte in at most 6 (\u0041).
JSON_BYTES_PER_TEXT_BYTE = 6
JSON_OVERHEAD_BYTES = 64 * 1024         # the body's keys, other fields, message framing
PREPARE_WORKERS = 4                     # requests whose body, template and grammar are prepared at once
MAX_MESSAGES = 2048                     # per chat request, as OpenAI's API (each render walks them all)


@dataclass
class ServerConfig:
    model_name: str                      # the id /v1/models reports
    aliases: frozenset[str] = frozenset()    # other names a request may use for the model
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    access: AccessPolicy = AccessPolicy()
    strict_model_name: bool = False      # True: a request naming another model gets a 404
    max_queue: int | None = DEFAULT_MAX_QUEUE    # queued requests past which a new one gets 503; None: no bound

    def __post_init__(self):
        if self.api_key is not None and (problem := api_key_problem(self.api_key)):
            raise UserError(f"the API key {problem}; give another key or none")


@dataclass
class Prepared:
    """A request checked and ready for the engine."""
    body: object
    model: str                  # the real id, whatever name the request used
    prompt_ids: list[int]
    dropped: int                # chat: oldest messages left out to fit the context
    params: SamplingParams
    tool_plan: ToolPlan | None = None


class Server:
    """State shared by the handlers: the front end, the engine thread, the metrics."""

    def __init__(self, engine: LLMEngine, frontend: FrontEnd, config: ServerConfig):
        self.frontend, self.config = frontend, config
        self.loop = EngineLoop(engine, frontend, max_queue=config.max_queue)
        self.metrics = ServerMetrics(self.loop.stats)
        self.loop.observer = self.metrics
        self.created = int(time.time())
        self.body_limit = min(config.max_body_bytes, context_body_bytes(frontend))
        # prompt preparation: a few requests at a time, so that one heavy request (a long
        # template render, a costly grammar) never holds a small one behind it
        self.worker = anyio.CapacityLimiter(PREPARE_WORKERS)
        self.names_seen: set[str] = set()          # other model names clients used (logged once each)

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
        """The real id. One model is served: any name gets it (as llama.cpp's server does, for
        scripts that hard-code a cloud model's name), logged once per name; with
        strict_model_name an unknown name gets a 404."""
        if name is None or name == self.config.model_name or name in self.config.aliases:
            return self.config.model_name
        if self.config.strict_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.config.model_name}'", code="model_not_found", param="model")
        if name not in self.names_seen and len(self.names_seen) < 1024:
            self.names_seen.add(name)
            log.info("requests name the model %r: serving %r (start with --strict-model-name to refuse)",
                     name[:100], self.config.model_name)
        return self.config.model_name

    def check_queue(self) -> None:
        """A 503 with Retry-After when the queue is full (before any work on the body)."""
        if self.loop.queue_full():
            self.refuse_queue_full()

    def refuse_queue_full(self):
        self.metrics.rejected.labels("queue_full").inc()
        retry = self.loop.retry_after_s()
        raise APIError(503, f"the server is busy: {self.loop.max_queue} requests are already waiting; "
                            f"retry in {retry} s", type="server_error", code="queue_full",
                       headers={"Retry-After": str(retry)})

    async def read_body(self, request: Request) -> bytes:
        return await read_body(request, self.body_limit, self.config.body_timeout_s)

    async def prepare(self, raw: bytes, chat: bool) -> Prepared:
        """Off the event loop: the checked body, its prompt ids and its SamplingParams."""
        return await anyio.to_thread.run_sync(self._prepare, raw, chat, limiter=self.worker)

    def _prepare(self, raw: bytes, chat: bool) -> Prepared:
        body = parse(ChatCompletionRequest if chat else CompletionRequest, raw, decode(raw))
        body.refuse_unsupported()
        if chat and len(body.messages) > MAX_MESSAGES:
            raise APIError(400, f"messages holds {len(body.messages):,} messages; the limit is {MAX_MESSAGES:,}",
                           param="messages", code="too_many_messages")
        name = self.check_model(body.model)
        check_sampling(body, self.frontend)       # before the costly part
        try:
            plan = self.tool_plan(body) if chat else None
            constraint = self.constraint(body, plan)
        except (GrammarError, ToolError) as e:
            raise APIError(400, str(e), param=e.field) from None
        if chat:
            prompt_ids, dropped = self.chat_prompt(body, plan)
        else:
            prompt_ids, dropped = self.completion_prompt(body), 0
        try:
            max_tokens = self.frontend.reply_room(prompt_ids, body.requested_max_tokens())
        except UserError as e:
            raise prompt_error(e, "max_tokens") from None
        params = SamplingParams(max_tokens=max_tokens, **body.sampling_kwargs())
        if constraint is not None:
            params = dataclasses.replace(params, constraint=constraint)
        return Prepared(body, name, prompt_ids, dropped, params, plan)

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        if not body.tools:
            if body.tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice", "tool_choice asks for a tool call but no tools were given")
            return None
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        return self.frontend.tool_plan(tools, choice, body.parallel_tool_calls)

    def constraint(self, body, plan: ToolPlan | None):
        """The one output constraint the body asks for (schema, grammar, forced tool call)."""
        asked = body.constraint_fields()
        if plan is not None and plan.forced:
            asked.append(("tool_choice", "tools", plan.constraint))
        if len(asked) > 1:
            raise GrammarError(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output; give one")
        if not asked:
            return None
        field, kind, source = asked[0]
        compiler = self.frontend.grammar_compiler
        if kind == "tools":
            return source
        if kind == "json_object":
            return compiler.json_object()
        if kind == "json_schema":
            return compiler.json_schema(source, field)
        return compiler.grammar(source, field)

    # --- prompts -------------------------------------------------------------------------
    def chat_prompt(self, body: ChatCompletionRequest, plan: ToolPlan | None) -> tuple[list[int], int]:
        """The prompt's token ids, and how many of the oldest messages were left out so that the
        conversation fits the context (system messages and the last turn always stay)."""
        messages = [template_message(m) for m in body.messages]
        try:
            prompt = self.frontend.chat_ids(messages, max_tokens=body.requested_max_tokens(),
                                            tools=plan.tools if plan is not None else None)
        except UserError as e:
            raise prompt_error(e, "messages") from None
        return prompt.ids, prompt.num_dropped

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        try:
            return self.frontend.prompt_ids(body.single_prompt())
        except UserError as e:
            raise prompt_error(e, "prompt") from None

    # --- running ---------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str, n: int = 1) -> list[ServerRequest]:
        """n engine sequences for one request's n choices, sharing one event queue. Choice i
        samples with seed + i, so a seeded request is reproducible choice by choice; the
        siblings' prompt is computed once (the scheduler holds them until its blocks are
        cached, then they hit the prefix cache)."""
        request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        events: asyncio.Queue = asyncio.Queue()
        requests = [ServerRequest(request_id if i == 0 else f"{request_id}-{i}", prompt_ids, choice,
                                  asyncio.get_running_loop(), events=events, index=i, group=request_id)
                    for i, choice in enumerate(choice_params(params, n))]
        if not self.loop.try_submit(requests):
            self.refuse_queue_full()
        return requests

    def log_request(self, request: ServerRequest, event: Event | None, status: str) -> None:
        if event is None or event.timings is None:
            log.info("%s %s prompt=%d", request.request_id, status, len(request.prompt_ids))
            return
        t = event.timings
        log.info("%s %s finish=%s prompt=%d cached=%d generated=%d queue=%.0fms ttft=%.0fms "
                 "decode=%.1ftok/s", request.request_id, status, event.finish_reason,
                 t["prompt_tokens"], t["cached_tokens"] or 0, event.num_generated_tokens,
                 (t["queue_s"] or 0) * 1000, (t["ttft_s"] or 0) * 1000, t["decode_tok_s"] or 0.0)


def template_message(m) -> dict:
    """A request message as chat templates take it (HF's convention: a call's arguments as
    an object, not the JSON text OpenAI sends)."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                raise APIError(400, f"the arguments of tool call {call.id or call.function.name!r} are not JSON",
                               param="messages") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


def prompt_error(e: UserError, param: str) -> APIError:
    """A prompt the front end refused, as a 400 naming the field (OpenAI's code when it is too long)."""
    if isinstance(e, ContextLengthExceeded):
        return APIError(400, str(e), code="context_length_exceeded", param=e.field)
    return APIError(400, str(e), param=param)


def context_body_bytes(frontend: FrontEnd) -> int:
    """The largest body whose prompt could fit the context (see JSON_BYTES_PER_TEXT_BYTE)."""
    return frontend.n_ctx * frontend.max_piece_bytes * JSON_BYTES_PER_TEXT_BYTE + JSON_OVERHEAD_BYTES


def check_sampling(body, frontend: FrontEnd) -> None:
    """The sampling fields' ranges (SamplingParams's rule), as a 400 naming the field."""
    try:
        frontend.check_logit_bias(SamplingParams(**body.sampling_kwargs(frontend.n_ctx)))
    except InvalidSamplingParam as e:
        raise APIError(400, str(e), param=e.field) from None


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    """The app serving llm's engine through its front end."""
    server = Server(llm.engine, llm.frontend, config)
    model_meta = {"n_ctx": llm.n_ctx, "n_vocab": llm.n_vocab, "architecture": llm.config.architecture,
                  "file": llm.model_path.name}

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
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

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
        alive = server.loop.alive
        body = {"status": "ok" if alive else "error", "model": config.model_name,
                "requests_in_flight": server.loop.num_in_flight,
                "kv_blocks_used": server.loop.stats()["num_blocks_used"]}
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
            "meta": model_meta}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        server.check_auth(request)
        server.check_queue()
        p = await server.prepare(await server.read_body(request), chat=True)
        sreqs = server.submit(p.prompt_ids, p.params, "chatcmpl", p.body.num_choices)
        if p.dropped:
            log.info("%s: dropped the %d oldest messages to fit the context of %d", sreqs[0].request_id, p.dropped,
                     server.frontend.n_ctx)
        return await respond(server, request, p.body, sreqs, p.model, chat=True,
                             extra_timings={"dropped_messages": p.dropped}, tool_plan=p.tool_plan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.check_auth(request)
        server.check_queue()
        p = await server.prepare(await server.read_body(request), chat=False)
        sreqs = server.submit(p.prompt_ids, p.params, "cmpl", p.body.num_choices)
        return await respond(server, request, p.body, sreqs, p.model, chat=False, extra_timings={})

    return app


