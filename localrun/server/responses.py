"""How a submitted request's engine events reach the client: one JSON body (`collect`) or an
SSE stream (`stream_events`), both aborting the request when the client goes away. Waiting
tasks never outlive their request (`next_event`), so a disconnect storm leaks none."""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import anyio
from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from localrun.server.engine_loop import Event, ServerRequest
from localrun.server.json_body import ClientGone
from localrun.server.protocol import APIError

if TYPE_CHECKING:
    from localrun.server.app import Server


def timings_ms(t: dict) -> dict:
    """A sequence's timings in the response's units: *_s durations become *_ms."""
    out = {}
    for key, value in t.items():
        if key.endswith("_s") and not key.endswith("tok_s"):
            out[key[:-2] + "_ms"] = None if value is None else round(value * 1000, 3)
        else:
            out[key] = round(value, 3) if isinstance(value, float) else value
    return out


def sse(events, shutdown: anyio.Event) -> EventSourceResponse:
    return EventSourceResponse(events, ping=15, shutdown_event=shutdown, shutdown_grace_period=2)


def usage(event: Event) -> dict:
    t = event.timings or {}
    return {"prompt_tokens": event.num_prompt_tokens, "completion_tokens": event.num_generated_tokens,
            "total_tokens": event.num_prompt_tokens + event.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": t.get("cached_tokens") or 0}}


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def next_event(sreq: ServerRequest, other: asyncio.Future) -> Event | None:
    """The request's next event, or None when `other` finishes first. The getter task never
    outlives the call (cancelled here, even when the caller is cancelled)."""
    get = asyncio.ensure_future(sreq.events.get())
    try:
        await asyncio.wait({get, other}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():
            get.cancel()
    return get.result() if get.done() and not get.cancelled() else None


async def collect(server: Server, http_request: Request, request: ServerRequest) -> tuple[str, Event]:
    """Wait for a whole (non-streamed) completion; abort it if the client goes away."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(http_request))
    pieces, finished = [], False
    try:
        while True:
            event = await next_event(request, disconnect)
            if event is None:
                raise ClientGone(f"{request.request_id} client-disconnected prompt={len(request.prompt_ids)}")
            if event.kind == "text":
                pieces.append(event.text)
            elif event.kind == "error":
                finished = True
                raise APIError(503, event.message, type="server_error", code="engine_error")
            else:
                finished = True
                return "".join(pieces), event
    finally:
        disconnect.cancel()
        if not finished:
            server.loop.abort(request.request_id)


def choice(text: str | None, finish: str | None, *, chat: bool, stream: bool) -> dict:
    """The one choice of either endpoint: chat carries its text in `message` (or a stream's
    `delta`), completions in `text`. text None: a stream's final chunk, which has none."""
    if not chat:
        content = {"text": text or ""}
    elif stream:
        content = {"delta": {} if text is None else {"content": text}}
    else:
        content = {"message": {"role": "assistant", "content": text}}
    return {"index": 0, **content, "finish_reason": finish, "logprobs": None}


async def respond(server: Server, http_request: Request, body, sreq: ServerRequest, model: str, *,
                  chat: bool, extra_timings: dict):
    """The response to a submitted request of either endpoint: an SSE stream or one JSON body."""
    created = int(time.time())
    object_name = "chat.completion" if chat else "text_completion"
    chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def timings(event: Event) -> dict:
        return {**timings_ms(event.timings), **extra_timings}

    def chunk(one_choice: dict, **extra) -> dict:
        return {"data": json.dumps({"id": sreq.request_id, "object": chunk_object, "created": created,
                                    "model": model, "choices": [one_choice], **extra})}

    if body.stream:
        first = chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                       "logprobs": None}) if chat else None
        events = stream_events(server, sreq, body, first,
                               lambda text: chunk(choice(text, None, chat=chat, stream=True)),
                               lambda ev: chunk(choice(None, ev.finish_reason, chat=chat, stream=True),
                                                timings=timings(ev)),
                               chunk_object, model, created, shutdown := anyio.Event())
        return sse(events, shutdown)
    text, event = await collect(server, http_request, sreq)
    server.log_request(sreq, event, "ok")
    return {"id": sreq.request_id, "object": object_name, "created": created, "model": model,
            "choices": [choice(text, event.finish_reason, chat=chat, stream=False)],
            "usage": usage(event), "timings": timings(event)}


async def stream_events(server: Server, sreq: ServerRequest, body, first: dict | None, text_chunk,
                        final_chunk, object_name: str, model: str, created: int, shutdown: anyio.Event):
    """SSE events of one streamed completion. sse-starlette cancels this generator when the
    client disconnects; `finally` then aborts the request. On server shutdown it sets
    `shutdown`: the stream then ends with an error event and [DONE] instead of being cut."""
    done = False
    stop = asyncio.ensure_future(shutdown.wait())
    try:
        if first is not None:
            yield first
        while True:
            event = await next_event(sreq, stop)
            if event is None:
                yield {"data": json.dumps(APIError(503, "the server is shutting down", type="server_error",
                                                   code="server_shutdown").body())}
                yield {"data": "[DONE]"}
                return
            if event.kind == "text":
                yield text_chunk(event.text)
            elif event.kind == "error":
                done = True
                yield {"data": json.dumps(APIError(503, event.message, type="server_error",
                                                   code="engine_error").body())}
                return
            else:
                done = True
                server.log_request(sreq, event, "ok")
                yield final_chunk(event)
                if body.include_usage:
                    yield {"data": json.dumps({"id": sreq.request_id, "object": object_name,
                                               "created": created, "model": model, "choices": [],
                                               "usage": usage(event)})}
                yield {"data": "[DONE]"}
                return
    finally:
        stop.cancel()
        if not done:
            server.loop.abort(sreq.request_id)
            server.log_request(sreq, None, "aborted")
