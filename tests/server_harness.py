"""Run a localrun server app on loopback in a background thread (real HTTP, real SSE)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    loop: asyncio.AbstractEventLoop      # the server's event loop (its own thread)

    def num_tasks(self) -> int:
        """Tasks pending on the server's loop, not counting the one asking."""
        async def count() -> int:
            return len(asyncio.all_tasks()) - 1
        return asyncio.run_coroutine_threadsafe(count(), self.loop).result(10)

    def task_names(self) -> list[str]:
        async def names() -> list[str]:
            return [repr(t.get_coro()) for t in asyncio.all_tasks()]
        return asyncio.run_coroutine_threadsafe(names(), self.loop).result(10)


@contextlib.contextmanager
def serving(app, port: int | None = None, **options):
    """Serve `app` with uvicorn on 127.0.0.1 in a thread with its own event loop; yield a
    Served; stop it afterwards. options: more uvicorn.Config keywords."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2, **options))
    loop = asyncio.new_event_loop()

    async def serve():
        await server.serve()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:        # e.g. sse-starlette's shutdown watcher, one per loop
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", loop)
    finally:
        server.should_exit = True
        thread.join(15)
        if not thread.is_alive():
            loop.close()


@contextlib.contextmanager
def running(app, port: int | None = None, **options):
    """Yield the base URL of `app` served by uvicorn on 127.0.0.1; stop it afterwards."""
    with serving(app, port, **options) as served:
        yield served.url


def sse_payloads(lines) -> list:
    """The `data:` payloads of an SSE stream, JSON-decoded except the final [DONE]."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()
