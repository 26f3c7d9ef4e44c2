"""How a submitted request's engine events reach the client: one JSON body (`collect`) or an
SSE stream (`stream_events`), both aborting the request when the client goes away. Waiting
tasks never outlive their request (`next_event`), so a disconnect storm leaks none.

A request with n choices is n engine sequences whose events share one queue, each event
tagged with its choice's index. Logprobs ride on the text events (`logprobs_*`); with tools,
each choice's text goes through a `ToolStream`, so a call is never shown as content, and
its calls are sent as `tool_calls` deltas in the shape the openai SDK accumulates."""
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
from localrun.tools import HERMES_CLOSE

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


def usage(events: list[Event]) -> dict:
    """Usage of a request's choices: the prompt once, the completions summed."""
    first = events[0]
    t = first.timings or {}
    completion = sum(e.num_generated_tokens for e in events)
    return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": t.get("cached_tokens") or 0}}


LOWEST_LOGPROB = -9999.0     # JSON has no -inf: a token the mask forbids gets this (as OpenAI does)


def _finite(value: float) -> float:
    return value if value > LOWEST_LOGPROB else LOWEST_LOGPROB


def logprobs_chat(tokenizer, records: list) -> list[dict]:
    """OpenAI's chat `logprobs.content` entries for TokenLogprob records."""
    def entry(token_id: int, logprob: float) -> dict:
        piece = tokenizer.piece(token_id)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(piece)}
    return [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(i, v) for i, v in r.top]} for r in records]


def logprobs_completion(tokenizer, records: list, offset: int) -> dict:
    """OpenAI's completions `logprobs` object; offset: the text's length before these tokens."""
    tokens, offsets = [], []
    for r in records:
        text = tokenizer.piece(r.token_id).decode("utf-8", errors="replace")
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_finite(r.logprob) for r in records],
            "top_logprobs": [{tokenizer.piece(i).decode("utf-8", errors="replace"): _finite(v) for i, v in r.top}
                             for r in records],
            "text_offset": offsets}


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


class Choice:
    """One choice's text, logprobs and tool calls as its events arrive."""

    def __init__(self, index: int, tool_plan):
        self.index = index
        self.pieces: list[str] = []
        self.logprobs: list = []
        self.tool_plan = tool_plan
        self.tools = tool_plan.stream() if tool_plan is not None and tool_plan.tools else None
        self.done: Event | None = None
        self.num_calls_sent = 0        # streamed: calls already sent as deltas

    def new_calls(self, final: bool) -> list:
        """Streamed: the calls complete so far (hermes closes each with </tool_call>; other
        formats are judged at the end) that were not sent yet."""
        if self.tools is None or not self.tools.capturing:
            return [] if not final else self._unsent(self.finish()[1])
        text = self.text
        if not final:
            if self.tool_plan.family != "hermes" or HERMES_CLOSE not in text:
                return []
            text = text[:text.rindex(HERMES_CLOSE) + len(HERMES_CLOSE)]
        return self._unsent(self.tool_plan.parse(text)[1])

    def _unsent(self, calls: list) -> list:
        new = calls[self.num_calls_sent:]
        self.num_calls_sent = max(self.num_calls_sent, len(calls))
        return new

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, event: Event) -> str:
        """Record a text event; return the content that may be shown now."""
        self.pieces.append(event.text)
        self.logprobs.extend(event.logprobs)
        return event.text if self.tools is None else self.tools.feed(event.text)

    def finish(self) -> tuple[str | None, list]:
        """(content, tool calls) of the whole reply."""
        if self.tools is None:
            return self.text, []
        return self.tool_plan.parse(self.text)


async def collect(server: Server, http_request: Request, sreqs: list[ServerRequest], tool_plan) -> list[Choice]:
    """Wait for whole (non-streamed) choices; abort them if the client goes away."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(http_request))
    choices = [Choice(i, tool_plan) for i in range(len(sreqs))]
    first, finished = sreqs[0], False
    try:
        while any(c.done is None for c in choices):
            event = await next_event(first, disconnect)
            if event is None:
                raise ClientGone(f"{first.request_id} client-disconnected prompt={len(first.prompt_ids)}")
            choice = choices[event.index]
            if event.kind == "text":
                choice.feed(event)
            elif event.kind == "error":
                raise APIError(503, event.message, type="server_error", code="engine_error")
            else:
                choice.done = event
        finished = True
        return choices
    finally:
        disconnect.cancel()
        if not finished:
            for sreq in sreqs:
                server.loop.abort(sreq.request_id)


def finish_reason(choice: Choice, calls: list) -> str:
    """tool_calls when the reply made calls and ended on its own; length stays length."""
    return "tool_calls" if calls and choice.done.finish_reason == "stop" else choice.done.finish_reason


async def respond(server: Server, http_request: Request, body, sreqs: list[ServerRequest], model: str, *,
                  chat: bool, extra_timings: dict, tool_plan=None):
    """The response to a submitted request of either endpoint: an SSE stream or one JSON body."""
    created = int(time.time())
    tokenizer = server.frontend.tokenizer
    want_logprobs = body.num_logprobs() is not None

    def timings(event: Event) -> dict:
        return {**timings_ms(event.timings), **extra_timings}

    if body.stream:
        return sse(stream_events(server, sreqs, body, chat, model, created, tool_plan, extra_timings,
                                 shutdown := anyio.Event()),
                   shutdown)
    choices = await collect(server, http_request, sreqs, tool_plan)
    for sreq, choice in zip(sreqs, choices):
        server.log_request(sreq, choice.done, "ok")
    out = []
    for choice in choices:
        content, calls = choice.finish()
        if chat:
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
            one = {"index": choice.index, "message": message,
                   "logprobs": {"content": logprobs_chat(tokenizer, choice.logprobs), "refusal": None}
                   if want_logprobs else None}
        else:
            one = {"index": choice.index, "text": content or "",
                   "logprobs": logprobs_completion(tokenizer, choice.logprobs, 0) if want_logprobs else None}
        out.append({**one, "finish_reason": finish_reason(choice, calls)})
    events = [c.done for c in choices]
    return {"id": sreqs[0].request_id, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": out, "usage": usage(events),
            "timings": timings(events[0])}


async def stream_events(server: Server, sreqs: list[ServerRequest], body, chat: bool, model: str, created: int,
                        tool_plan, extra_timings: dict, shutdown: anyio.Event):
    """SSE events of one streamed completion. sse-starlette cancels this generator when the
    client disconnects; `finally` then aborts the request. On server shutdown it sets
    `shutdown`: the stream then ends with an error event and [DONE] instead of being cut."""
    first = sreqs[0]
    object_name = "chat.completion.chunk" if chat else "text_completion"
    tokenizer = server.frontend.tokenizer
    want_logprobs = body.num_logprobs() is not None
    choices = [Choice(i, tool_plan) for i in range(len(sreqs))]
    offsets = [0] * len(sreqs)

    def chunk(one_choice: dict, **extra) -> dict:
        return {"data": json.dumps({"id": first.request_id, "object": object_name, "created": created,
                                    "model": model, "choices": [one_choice], **extra})}

    def text_chunk(index: int, text: str | None, records: list, finish: str | None = None, **extra) -> dict:
        if chat:
            one = {"index": index, "delta": {} if text is None else {"content": text}}
            one["logprobs"] = {"content": logprobs_chat(tokenizer, records), "refusal": None} \
                if want_logprobs and records else None
        else:
            one = {"index": index, "text": text or ""}
            one["logprobs"] = logprobs_completion(tokenizer, records, offsets[index]) if want_logprobs and records \
                else None
            offsets[index] += len(text or "")
        return chunk({**one, "finish_reason": finish}, **extra)

    def tool_call_chunks(index: int, calls: list, first: int) -> list[dict]:
        """Each call as the SDK accumulates it: id, type and name first, then the arguments;
        `first`: the index of the first of these calls in the reply."""
        out = []
        for k, call in enumerate(calls, start=first):
            out.append(chunk({"index": index, "delta": {"tool_calls": [
                {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]},
                "logprobs": None, "finish_reason": None}))
            out.append(chunk({"index": index, "delta": {"tool_calls": [
                {"index": k, "function": {"arguments": call.arguments}}]}, "logprobs": None, "finish_reason": None}))
        return out

    done = False
    stop = asyncio.ensure_future(shutdown.wait())
    try:
        if chat:
            for choice in choices:
                yield chunk({"index": choice.index, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None, "logprobs": None})
        while any(c.done is None for c in choices):
            event = await next_event(first, stop)
            if event is None:
                yield {"data": json.dumps(APIError(503, "the server is shutting down", type="server_error",
                                                   code="server_shutdown").body())}
                yield {"data": "[DONE]"}
                return
            choice = choices[event.index]
            if event.kind == "text":
                shown = choice.feed(event)
                if shown or (event.logprobs and choice.tools is None):
                    yield text_chunk(choice.index, shown, event.logprobs)
                sent = choice.num_calls_sent
                for c in tool_call_chunks(choice.index, choice.new_calls(final=False), sent):
                    yield c
            elif event.kind == "error":
                done = True
                yield {"data": json.dumps(APIError(503, event.message, type="server_error",
                                                   code="engine_error").body())}
                return
            else:
                choice.done = event
                server.log_request(sreqs[choice.index], event, "ok")
                calls = []
                if choice.tools is not None:
                    content, calls = choice.finish()
                    sent = choice.num_calls_sent
                    for c in tool_call_chunks(choice.index, choice.new_calls(final=True), sent):
                        yield c
                    if not calls and choice.text[choice.tools.shown:]:    # held back, and not a call after all
                        yield text_chunk(choice.index, choice.text[choice.tools.shown:], [])
                yield text_chunk(choice.index, None, [], finish_reason(choice, calls),
                                 timings={**timings_ms(event.timings), **extra_timings})
        done = True
        if body.include_usage:
            yield {"data": json.dumps({"id": first.request_id, "object": object_name, "created": created,
                                       "model": model, "choices": [], "usage": usage([c.done for c in choices])})}
        yield {"data": "[DONE]"}
    finally:
        stop.cancel()
        if not done:
            for sreq in sreqs:
                server.loop.abort(sreq.request_id)
            server.log_request(first, None, "aborted")
