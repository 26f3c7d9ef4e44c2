"""One hostile request beside others, over HTTP (issue 76): grammars refused at the door with a
400 and one short sentence, a chat body with too many messages refused before any render, a
request with n=16 that cannot hold every seat while another request waits, and heavy
preparation that does not hold a small request behind it."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from localrun.api import LLM
from localrun.server.app import MAX_MESSAGES, ServerConfig, create_app
from localrun.server.timeouts import uvicorn_options
from server_harness import serving

CHAT = "/v1/chat/completions"
HOSTILE_BODIES = {
    "grammar cycle": {"grammar": "root ::= a\na ::= b\nb ::= a"},
    "self reference": {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}}},
    "million repetitions": {"grammar": 'root ::= "x"{1000000}'},
    "20,000 alternatives": {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))},
    "500 KB const": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "c", "schema": {"const": "y" * 500_000}}}},
}


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=4)


@pytest.fixture(scope="module")
def app(llm):
    return create_app(llm, ServerConfig("tiny"))


@pytest.fixture(scope="module")
def url(app):
    with serving(app, **uvicorn_options()) as served:
        yield served.url


def chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **kw}


@pytest.mark.parametrize("case", list(HOSTILE_BODIES))
def test_hostile_grammars_are_a_400_with_one_short_sentence(url, app, case):
    """A 400 naming the field; a body past what the server reads at all is a 413 first."""
    body = json.dumps(chat(**HOSTILE_BODIES[case])).encode()
    r = httpx.post(url + CHAT, content=body, headers={"Content-Type": "application/json"}, timeout=120)
    error = r.json()["error"]
    assert len(error["message"]) < 300 and "\n" not in error["message"], error["message"]
    if len(body) > app.state.server.body_limit:
        assert (r.status_code, error["code"]) == (413, "body_too_large")
    else:
        assert r.status_code == 400, r.text[:300]
        assert error["param"] in ("grammar", "response_format") and error["code"]


def test_too_many_messages_is_a_400_before_any_render(url, llm, monkeypatch):
    renders = []
    monkeypatch.setattr(llm.frontend, "chat_ids", lambda *a, **k: renders.append(1))
    messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    r = httpx.post(url + CHAT, json=chat(messages=messages), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert f"{MAX_MESSAGES:,}" in r.json()["error"]["message"] and not renders


def test_a_request_with_16_choices_leaves_a_seat_for_the_next(url, llm):
    """4 seats. A chat with n=16 and no max_tokens fills them (each choice may run to the end of
    the context); a one-token request sent after it is admitted within a few steps instead of
    waiting for a choice to end."""
    big = {}

    def send_big():
        big["response"] = httpx.post(url + CHAT, timeout=600, json={
            "model": "tiny", "n": 16, "messages": [{"role": "user", "content": "go on"}],
            "temperature": 1.0, "ignore_eos": True, "max_tokens": 300})
    thread = threading.Thread(target=send_big)
    thread.start()
    deadline = time.monotonic() + 60
    while llm.engine.scheduler.num_running < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.engine.scheduler.num_running == 4
    steps_before = llm.engine.scheduler.stats.num_steps
    r = httpx.post(url + CHAT, json=chat(max_tokens=1), timeout=600)
    assert r.status_code == 200
    waited_steps = llm.engine.scheduler.stats.num_steps - steps_before
    # it needs a seat (one step to give it, one for its prompt) but not a choice's 300 tokens
    assert waited_steps < 50, waited_steps
    assert r.json()["timings"]["preemptions"] == 0
    thread.join()
    assert big["response"].status_code == 200 and len(big["response"].json()["choices"]) == 16


def test_a_small_request_is_not_held_behind_a_heavy_preparation(url, llm, monkeypatch):
    """A request whose preparation takes long (its template render, held here on an event) does
    not hold a small request behind it: preparation runs in several workers."""
    release = threading.Event()
    real = llm.frontend.chat_ids

    def chat_ids(messages, **kw):
        if messages[0]["content"] == "heavy":
            release.wait(60)
        return real(messages, **kw)
    monkeypatch.setattr(llm.frontend, "chat_ids", chat_ids)
    heavy = {}
    thread = threading.Thread(target=lambda: heavy.update(r=httpx.post(url + CHAT, timeout=120, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "heavy"}]})))
    thread.start()
    time.sleep(0.3)
    try:
        r = httpx.post(url + CHAT, json=chat(max_tokens=2), timeout=30)
        assert r.status_code == 200 and thread.is_alive()      # answered while the heavy one is held
    finally:
        release.set()
        thread.join()
    assert heavy["r"].status_code == 200
    assert json.loads(heavy["r"].text)["choices"]
