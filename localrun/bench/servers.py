"""Servers for benchmarks: `localrun serve` or llama-cpp-python's server in a child process."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from localrun.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log_path: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise UserError(f"the server exited with status {proc.returncode} before it was ready: {tail.strip()}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise UserError(f"the server at {url} was not ready after {timeout_s:.0f} s")


@contextlib.contextmanager
def child_server(cmd: list[str], port: int, env: dict | None = None):
    """Run `cmd` (a server listening on `port`), yield its base URL, stop it with SIGINT."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log.name)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(2)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        os.unlink(log.name)


def localrun_server(model: str | None, *args: str, port: int | None = None):
    port = port or free_port()
    cmd = [sys.executable, "-m", "localrun.cli", "serve", *([model] if model else []), "--port", str(port),
           "--log-level", "warning", *args]
    return child_server(cmd, port)


def llama_cpp_server(model_path: str, *, n_threads: int, n_ctx: int, port: int | None = None):
    """llama-cpp-python's own server (one request at a time behind a lock), the peer. By default
    a new request cuts off the one streaming; interrupt_requests=False makes it queue instead."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--port", str(port),
           "--host", "127.0.0.1", "--n_threads", str(n_threads), "--n_threads_batch", str(n_threads),
           "--n_ctx", str(n_ctx), "--verbose", "False", "--interrupt_requests", "False"]
    return child_server(cmd, port)
