"""The load generator: stream each request of a workload to an OpenAI-compatible endpoint and
time it from the client's side.

Each request records when it was sent, when its first text arrived, when every later piece
arrived, and when its stream ended, plus the token counts the server reported (usage, or the
number of text chunks when a server sends no usage) and the server's own `timings` when it
returns them (localrun does), which split the TTFT into queue, prefill, first decode and
transport.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from localrun.bench.workload import BenchRequest


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    error: str | None = None
    sent: float = 0.0                  # perf_counter seconds
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)   # arrival of each text piece
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    server_timings: dict | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2e_s(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.first_token is None or self.end is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def request_body(req: BenchRequest, model: str | None, ignore_eos: bool,
                 extra_body: dict | None = None) -> tuple[str, dict]:
    body: dict = {**(extra_body or {}), "max_tokens": req.max_tokens, "temperature": req.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if ignore_eos:      # exactly max_tokens tokens, none of them an end of turn (whose hidden
        body["ignore_eos"] = True       # special tokens would send no text: no chunk, a long gap)
        body["min_tokens"] = req.max_tokens
    if req.messages is not None:
        return "/v1/chat/completions", {**body, "messages": list(req.messages)}
    return "/v1/completions", {**body, "prompt": req.prompt}


def _piece(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


async def send(client: httpx.AsyncClient, base_url: str, req: BenchRequest, *, model: str | None = None,
               ignore_eos: bool = True, headers: dict | None = None,
               extra_body: dict | None = None) -> RequestResult:
    path, body = request_body(req, model, ignore_eos, extra_body)
    result = RequestResult(req.index, sent=time.perf_counter())
    n_chunks, usage_seen = 0, False
    try:
        async with client.stream("POST", base_url.rstrip("/") + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result
                now = time.perf_counter()
                if _piece(chunk):
                    n_chunks += 1
                    result.chunk_times.append(now)
                    if result.first_token is None:
                        result.first_token = now
                if chunk.get("timings"):
                    result.server_timings = chunk["timings"]
                if chunk.get("usage"):
                    usage_seen = True
                    result.completion_tokens = chunk["usage"].get("completion_tokens", 0)
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
        result.end = time.perf_counter()
        result.completion_tokens = result.completion_tokens or n_chunks
        # no text is fine only when the server says it generated nothing (an immediate end of
        # generation); a stream cut short without usage is an error
        result.ok = result.first_token is not None or (usage_seen and result.completion_tokens == 0)
        if not result.ok:
            result.error = "the stream ended without text"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_requests(base_url: str, requests: list[BenchRequest], *, concurrency: int = 0,
                       model: str | None = None, ignore_eos: bool = True, api_key: str | None = None,
                       timeout_s: float = 600.0, extra_body: dict | None = None,
                       on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival offset (at most `concurrency` in flight when > 0).
    `extra_body` adds server-specific fields (e.g. llama-cpp-python's min_tokens).
    Returns the results in request order and the wall time of the whole run."""
    limit = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=pool) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                result = await send(client, base_url, req, model=model, ignore_eos=ignore_eos, headers=headers,
                                    extra_body=extra_body)
            else:
                async with limit:
                    result = await send(client, base_url, req, model=model, ignore_eos=ignore_eos, headers=headers,
                                    extra_body=extra_body)
            if on_done:
                on_done(result)
            return result

        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - start
