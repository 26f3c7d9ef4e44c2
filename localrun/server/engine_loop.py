"""One engine thread serving every HTTP request: continuous batching behind an asyncio API.

The engine is not thread-safe, so exactly one thread (`EngineLoop._run`) touches it. HTTP
handlers on the event loop `submit` a `ServerRequest` and read its events from an asyncio
queue; they `abort` it when the client goes away. The engine thread adds new requests and
drops aborted ones between steps, runs `engine.step()` while anything is unfinished, turns
each sampled token into text through the front end's RequestText (stop strings, end of
generation, finish reason) and hands the pieces back to the event loop with
`call_soon_threadsafe`. Torch releases the GIL inside its kernels, so the event loop keeps
serving while a step runs. The engine's stats are read on the engine thread too: a snapshot
after every turn of the loop, which /metrics and /health read (`stats`).

The queue is bounded: a request counts as queued from `try_submit` until the engine first
schedules it (it shows up in a step's outputs) or it ends unscheduled (aborted, refused).
Past `max_queue` queued requests `try_submit` refuses, and the server answers 503. A queued
request whose client leaves is aborted between steps, before it is ever scheduled.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localrun.errors import UserError
from localrun.frontend import FrontEnd, RequestText
from localrun.sampling_params import SamplingParams

if TYPE_CHECKING:
    from localrun.engine.llm_engine import LLMEngine

log = logging.getLogger("localrun.server")


@dataclass
class Event:
    kind: str                      # "text" | "done" | "error"
    text: str = ""
    finish_reason: str | None = None
    timings: dict | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    message: str = ""              # for "error"
    index: int = 0                 # the choice (n > 1) this event belongs to
    logprobs: list = field(default_factory=list)   # TokenLogprob of the tokens since the last event


@dataclass(eq=False)
class ServerRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    # engine-thread state
    text: RequestText | None = None
    last_token_at: float | None = None
    index: int = 0                 # its choice among the request's n (they may share `events`)
    group: str | None = None       # the client request it is a choice of (its n choices share seats)
    queued: bool = True            # not yet scheduled by the engine (counts against max_queue)

    def put(self, event: Event) -> None:
        """Thread-safe: hand an event to the handler waiting on the event loop."""
        event.index = self.index
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:       # the loop is closed: the server is shutting down
            pass


class EngineLoop:
    """Owns the engine thread. `observer` gets per-token and per-request callbacks (metrics)."""

    IDLE_WAIT_S = 0.05
    QUEUE_TIME_SMOOTHING = 0.2     # weight of the newest request in the mean queue time

    def __init__(self, engine: LLMEngine, frontend: FrontEnd, observer=None, max_queue: int | None = None):
        self.engine = engine
        self.frontend = frontend
        self.observer = observer
        self._stats = engine.stats()   # the engine thread replaces it (before it starts: no other thread)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._requests: dict[str, ServerRequest] = {}     # engine thread only
        self._thread = threading.Thread(target=self._run, name="localrun-engine", daemon=True)
        self.healthy = True
        self.last_error: str | None = None
        if max_queue is not None and max_queue < 1:
            raise UserError(f"the queue bound must be at least 1 request, got {max_queue}")
        self.max_queue = max_queue
        self._queue_lock = threading.Lock()
        self._num_queued = 0           # under _queue_lock: submitted, not yet scheduled
        self.mean_queue_s = 0.0        # smoothed arrival-to-first-scheduled time (engine thread writes)

    # --- called from the event loop ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ServerRequest) -> None:
        """Queue a request whatever the bound (see try_submit)."""
        with self._queue_lock:
            self._num_queued += 1
        self._commands.put(("add", request))
        self._wake.set()

    def try_submit(self, requests: list[ServerRequest]) -> bool:
        """Queue all of requests (one HTTP request's choices) or, past max_queue, none."""
        with self._queue_lock:
            if self.max_queue is not None and self._num_queued + len(requests) > self.max_queue:
                return False
            self._num_queued += len(requests)
        for request in requests:
            self._commands.put(("add", request))
        self._wake.set()
        return True

    def queue_full(self) -> bool:
        return self.max_queue is not None and self._num_queued >= self.max_queue

    def retry_after_s(self) -> int:
        """What a refused client should wait: the recent mean queue time, at least a second."""
        return max(1, math.ceil(self.mean_queue_s))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and join the thread."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def alive(self) -> bool:
        """The engine thread is running."""
        return self._thread.is_alive()

    def stats(self) -> dict:
        """engine.stats() as the engine thread last took it (after its last step, or while idle)."""
        return self._stats

    # --- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_commands()
            self._stats = self.engine.stats()
            if not self.engine.has_unfinished():
                self._wake.wait(self.IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:       # never leave handlers waiting on a dead engine
                log.exception("engine step failed")
                self.last_error = f"{type(e).__name__}: {e}"
                self._fail_all(f"the engine failed: {self.last_error}")
                continue
            now = time.perf_counter()
            for out in outputs:
                try:
                    self._handle(out, now)
                except Exception as e:     # noqa: BLE001 - one request's text, not everyone's
                    log.exception("post-processing %s failed", out.seq.request_id)
                    self._fail_one(out.seq.request_id, f"{type(e).__name__}: {e}")
        for rid in list(self._requests):
            self._finish_abort(rid, "the server is shutting down")

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(arg)
            elif kind == "abort" and arg in self._requests:
                self.engine.abort(arg)
                self._leave_queue(self._requests.pop(arg))
                if self.observer:
                    self.observer.on_abort()

    def _add(self, request: ServerRequest) -> None:
        request.text = self.frontend.request_text(request.params)
        try:
            self.engine.add_request(request.request_id, request.prompt_ids, request.params,
                                    arrival_time=request.arrival, group=request.group)
        except UserError as e:
            self._leave_queue(request)
            request.put(Event("error", message=str(e)))
            return
        self._requests[request.request_id] = request

    def _leave_queue(self, request: ServerRequest, now: float | None = None) -> None:
        """The request is scheduled (now: when) or ends unscheduled: it no longer counts as queued."""
        if not request.queued:
            return
        request.queued = False
        with self._queue_lock:
            self._num_queued -= 1
        if now is not None:
            a = self.QUEUE_TIME_SMOOTHING
            self.mean_queue_s = (1 - a) * self.mean_queue_s + a * (now - request.arrival)

    def _handle(self, out, now: float) -> None:
        seq = out.seq
        request = self._requests.get(seq.request_id)
        if request is None:
            return
        self._leave_queue(request, now)
        if out.error is not None:
            log.error("%s failed alone: %s", seq.request_id, out.error)
            del self._requests[seq.request_id]
            request.put(Event("error", message=f"this request failed: {out.error}"))
            return
        text = request.text
        delta = text.feed(out)
        if delta.token_id is not None:
            if self.observer:
                self.observer.on_token(None if request.last_token_at is None else now - request.last_token_at)
            request.last_token_at = now
            if delta.text:
                request.put(Event("text", text=delta.text, logprobs=text.take_logprobs()))
        if delta.stop_in_engine:
            self.engine.finish_request(seq.request_id, "stop")
        if not text.finished:
            return
        del self._requests[seq.request_id]
        done = text.finish(seq)
        logprobs = text.take_logprobs()
        if done.text or logprobs:
            request.put(Event("text", text=done.text, logprobs=logprobs))
        request.put(Event("done", finish_reason=done.finish_reason, timings=done.timings,
                          num_prompt_tokens=seq.num_prompt_tokens, num_generated_tokens=len(text.token_ids)))
        if self.observer:
            self.observer.on_finish(request, seq, done.finish_reason, now)

    def _finish_abort(self, request_id: str, message: str) -> None:
        request = self._requests.pop(request_id)
        self.engine.abort(request_id)
        self._leave_queue(request)
        request.put(Event("error", message=message))

    def _fail_one(self, request_id: str, error: str) -> None:
        if request_id in self._requests:
            self._finish_abort(request_id, f"this request failed: {error}")

    def _fail_all(self, message: str) -> None:
        for rid in list(self._requests):
            self._finish_abort(rid, message)
