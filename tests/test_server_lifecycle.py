"""`localrun serve` as a user runs it: a child process that stops cleanly on SIGINT/SIGTERM,
even with a stream in flight, and refuses a busy port with one sentence."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from server_harness import free_port, wait_until


def start(model, port, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "localrun.cli", "serve", str(model), "--port", str(port),
                             "--threads", "1", "--ctx", "1024", "--no-disk-cache", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def up(url):
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_with_a_stream_in_flight_exits_cleanly(tiny_gguf, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(tiny_gguf("F32", context_length=1024), port)
    try:
        assert wait_until(lambda: up(url) or proc.poll() is not None, timeout=60) and proc.poll() is None
        seen = []

        def stream():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                                  json={"prompt": "go", "max_tokens": 1000, "stream": True, "ignore_eos": True}) as r:
                    for line in r.iter_lines():
                        seen.append(line)
            except httpx.HTTPError:
                pass

        client = threading.Thread(target=stream)
        client.start()
        assert wait_until(lambda: len(seen) >= 3, timeout=30)
        proc.send_signal(sig)
        output = proc.communicate(timeout=30)[0]
        client.join(30)
        assert not client.is_alive()
        assert proc.returncode == 0, output
        assert "Traceback" not in output and "without completing response" not in output, output
        assert [line for line in seen if line][-1] == "data: [DONE]" and any("server_shutdown" in line for line in seen)
        assert not up(url)
    finally:
        if proc.poll() is None:
            proc.kill()


def _busy_port(host):
    import socket
    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s


def test_busy_port_is_one_sentence_and_exit_2(tiny_gguf):
    with _busy_port("127.0.0.1") as s:
        proc = start(tiny_gguf("F32"), s.getsockname()[1])
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2
    assert "cannot listen on 127.0.0.1" in output and "Traceback" not in output


def test_public_bind_without_key_warns(tiny_gguf):
    with _busy_port("0.0.0.0") as s:     # the bind then fails fast, after the warning
        proc = start(tiny_gguf("F32"), s.getsockname()[1], "--host", "0.0.0.0")
        output = proc.communicate(timeout=60)[0]
    assert "without --api-key" in output and proc.returncode == 2
