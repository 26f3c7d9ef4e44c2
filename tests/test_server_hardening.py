"""`localrun serve` against a hostile client (issues 21 and 22), each case from its reproduction:
Host/Origin policy and CORS, JSON-only bodies, JSON limits, refused fields and sampling
ranges, the API key as bytes, slow clients, clean aborts without leaked tasks, and one
request's sampling fault that must not touch the others."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

import localrun.engine.model_runner as model_runner
import localrun.frontend as frontend
from localrun.api import LLM
from localrun.errors import UserError
from localrun.server.app import ServerConfig, create_app
from localrun.server.guard import AccessPolicy
from localrun.server.json_body import MAX_JSON_DEPTH
from localrun.server.timeouts import uvicorn_options
from server_harness import health, running, serving, sse_payloads, wait_until

MODEL = "tiny"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=8)


@pytest.fixture(scope="module")
def llm2(tiny_gguf):
    """For the servers a test starts beside `served`: one engine thread per engine."""
    return LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=8)


@pytest.fixture(scope="module")
def served(llm):
    with serving(create_app(llm, ServerConfig(MODEL)), **uvicorn_options()) as served:
        yield served


@pytest.fixture(scope="module")
def url(served):
    return served.url


def chat(content="hello there", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def post(url, body, path=CHAT, headers=None, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=30, **kw)


def error_of(r) -> dict:
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    return error


# --- Host and Origin (DNS rebinding, cross-origin pages) -----------------------------------------
@pytest.mark.parametrize("host,status", [("evil.example:8080", 403), ("localhost.evil.com", 403),
                                         ("localhost:8080", 200), ("127.0.0.1", 200), ("127.3.4.5:1", 200),
                                         ("[::1]:8080", 200), ("LOCALHOST.", 200), ("localhost", 200),
                                         ("127.0.0.1:8080", 200), ("[::1]", 200), ("127.1", 403)])
def test_only_loopback_host_names_are_accepted(url, host, status):
    r = post(url, chat(), headers={"host": host})
    assert r.status_code == status, r.text
    if status == 403:
        assert error_of(r)["code"] == "host_not_allowed" and "--allow-host" in error_of(r)["message"]


# Each names a loopback host somewhere, but is not one host and an optional port (issue 76)
MALFORMED_HOSTS = ["localhost:8080@evil.com", "evil.com@localhost:8080", "[::1]evil.com:8080", "localhost:80:90",
                   "localhost/evil", "localhost:8080/x", "local host", "localhost:99999", "localhost:+80",
                   "[127.0.0.1]:80", "localhost..", ".localhost", "[::1", "::1", "localhost?x", "localhost#x",
                   "localhost\\evil", "localhost;evil", "lo%63alhost"]


@pytest.mark.parametrize("host", MALFORMED_HOSTS)
def test_a_host_header_is_one_host_and_an_optional_port(url, llm, host):
    before = llm.engine.stats()["num_finished"]
    r = post(url, chat(), headers={"host": host})
    assert r.status_code == 403, r.text
    assert error_of(r)["code"] == "host_not_allowed" and "not one host name" in error_of(r)["message"]
    assert llm.engine.stats()["num_finished"] == before


@pytest.mark.parametrize("header", [b"host", b"origin"])
def test_a_repeated_host_or_origin_header_is_refused(url, header):
    first = b"evil.example" if header == b"host" else b"https://evil.example"
    second = b"localhost" if header == b"host" else url.encode()
    sock = raw_connection(url)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\n" + (b"Host: localhost\r\n" if header == b"origin" else b"")
                 + header + b": " + first + b"\r\n" + header + b": " + second + b"\r\nConnection: close\r\n\r\n")
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    if header == b"host":           # h11 refuses it before the app (RFC 9112: a 400); the guard would too
        assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    else:
        assert answer.startswith(b"HTTP/1.1 403") and b"more than one Origin header" in answer, answer[:300]


def test_allow_host_entries_are_parsed_like_the_header(llm2):
    policy = AccessPolicy(allowed_hosts=("MyHost.lan.",))
    with running(create_app(llm2, ServerConfig(MODEL, access=policy))) as url:
        assert post(url, chat(), headers={"host": "myhost.lan:8080"}).status_code == 200
        assert post(url, chat(), headers={"host": "myhost.lan:8080@evil.com"}).status_code == 403
        assert post(url, chat(), headers={"host": "evil.com@myhost.lan"}).status_code == 403
    with running(create_app(llm2, ServerConfig(MODEL, access=AccessPolicy(check_host=False)))) as url:
        assert post(url, chat(), headers={"host": "anything.example:1"}).status_code == 200    # no name check
        assert post(url, chat(), headers={"host": "anything.example:1:2"}).status_code == 403  # still one host


def test_cross_origin_simple_post_is_refused_before_it_runs(url, llm):
    before = llm.engine.stats()["num_finished"]
    r = httpx.post(f"{url}{CHAT}", content=json.dumps(chat()), timeout=30,
                   headers={"origin": "https://evil.example", "content-type": "text/plain"})
    assert r.status_code == 403 and error_of(r)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert llm.engine.stats()["num_finished"] == before            # nothing was generated


def test_same_origin_and_no_origin_are_accepted(url):
    assert post(url, chat(), headers={"origin": url}).status_code == 200
    assert post(url, chat()).status_code == 200


def test_same_origin_means_the_same_scheme_host_and_port(url):
    port = int(url.rsplit(":", 1)[1])
    for origin in (f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}", f"http://localhost:{port}",
                   f"http://127.0.0.1:{port}@evil.com", f"http://evil.com@127.0.0.1:{port}",
                   f"http://127.0.0.1:{port}/x", "http://127.0.0.1", "null", f"ws://127.0.0.1:{port}"):
        r = post(url, chat(), headers={"origin": origin})
        assert r.status_code == 403 and error_of(r)["code"] == "origin_not_allowed", (origin, r.text)
    # the port the page's origin leaves out is its scheme's default: http's 80
    assert post(url, chat(), headers={"origin": "http://localhost", "host": "localhost:80"}).status_code == 200
    assert post(url, chat(), headers={"origin": "http://LocalHost:80", "host": "localhost"}).status_code == 200
    assert post(url, chat(), headers={"origin": "https://localhost", "host": "localhost:443"}).status_code == 403


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_non_json_bodies_are_415(url, content_type):
    r = post(url, chat(), headers={"content-type": content_type})
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"


def test_allowed_origins_get_cors_and_preflight(llm2):
    policy = AccessPolicy(allowed_origins=("http://localhost:3000",), allowed_hosts=("myhost.lan",))
    with running(create_app(llm2, ServerConfig(MODEL, access=policy))) as url:
        pre = httpx.options(f"{url}{CHAT}", headers={"origin": "http://localhost:3000",
                                                      "access-control-request-method": "POST",
                                                      "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"]
        r = post(url, chat(), headers={"origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.options(f"{url}{CHAT}", headers={"origin": "http://localhost:4000",
                                                        "access-control-request-method": "POST"})
        assert other.status_code == 403
        assert post(url, chat(), headers={"host": "myhost.lan:8080"}).status_code == 200
    with running(create_app(llm2, ServerConfig(MODEL, access=AccessPolicy(allowed_origins=("*",))))) as url:
        r = post(url, chat(), headers={"origin": "https://anything.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_openapi_follows_the_api_key_and_docs_are_off(llm2):
    with running(create_app(llm2, ServerConfig(MODEL, api_key="k1"))) as url:
        assert httpx.get(f"{url}/openapi.json").status_code == 401
        assert httpx.get(f"{url}/openapi.json", headers={"authorization": "Bearer k1"}).status_code == 200
        assert httpx.get(f"{url}/docs").status_code == 404 and httpx.get(f"{url}/redoc").status_code == 404


# --- API key ----------------------------------------------------------------------------------
def test_api_keys_compare_as_utf8_bytes(llm2):
    key = "clé-🔑-ключ"
    with running(create_app(llm2, ServerConfig(MODEL, api_key=key))) as url:
        good = {"authorization": b"Bearer " + key.encode("utf-8")}
        assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"authorization": b"bearer " + key.encode()}).status_code == 200
        wrong = {"authorization": b"Bearer " + key.encode("utf-8")[:-1]}
        assert httpx.get(f"{url}/v1/models", headers=wrong).status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401


def serve_refusal(tiny_gguf, *args, env=None) -> str:
    """stderr of a `localrun serve` that must refuse to start (exit 2, one sentence)."""
    environ = {k: v for k, v in os.environ.items() if k != "LOCALRUN_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "localrun.cli", "serve", str(tiny_gguf("F32")), "--port", "1", *args],
                       capture_output=True, text=True, timeout=120, env={**environ, **(env or {})})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "serving on" not in r.stderr
    return " ".join(r.stderr.split())


def test_an_empty_api_key_is_a_user_error_at_start(tiny_gguf):
    for key in ("", "  "):
        assert "--api-key must not be empty" in serve_refusal(tiny_gguf, "--api-key", key)


@pytest.mark.parametrize("source", ["flag", "env"])
@pytest.mark.parametrize("key,why", [(" clé ", "must not start or end with whitespace"),
                                     ("key\t", "must not start or end with whitespace"),
                                     ("\u00a0key", "must not start or end with whitespace"),
                                     ("  ", "must not be empty or only whitespace"),
                                     ("a\x1bb", "must not contain control characters"),
                                     ("k" * 4097, "must be at most 4096 bytes")])
def test_a_key_that_could_never_match_is_refused_at_start(tiny_gguf, source, key, why):
    if source == "flag":
        message = serve_refusal(tiny_gguf, "--api-key", key)
        assert message.startswith(f"error: --api-key {why}") or f"--api-key {why}" in message, message
    else:
        assert f"LOCALRUN_API_KEY {why}" in serve_refusal(tiny_gguf, env={"LOCALRUN_API_KEY": key})


def test_an_empty_api_key_environment_variable_is_refused_not_ignored(tiny_gguf):
    message = serve_refusal(tiny_gguf, env={"LOCALRUN_API_KEY": ""})
    assert "LOCALRUN_API_KEY is set but empty" in message
    # a key on the command line stands on its own: the empty variable is not what it serves with,
    # and the start goes on to the next check (a busy port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = serve_refusal(tiny_gguf, "--api-key", "k1", "--port", str(port), env={"LOCALRUN_API_KEY": ""})
    assert f"cannot listen on 127.0.0.1:{port}" in message


def test_server_config_refuses_keys_that_cannot_travel_in_a_header():
    for key, why in (("", "empty"), (" k", "whitespace"), ("k\n", "whitespace"), ("a\x00b", "control"),
                     ("a\udcffb", "UTF-8")):
        with pytest.raises(UserError, match=why):
            ServerConfig(MODEL, api_key=key)
    assert ServerConfig(MODEL, api_key="clé with inner spaces").api_key == "clé with inner spaces"


def test_a_key_with_inner_spaces_matches_as_sent(llm2):
    with running(create_app(llm2, ServerConfig(MODEL, api_key="a b  c"))) as url:
        assert httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer a b  c"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer a b c"}).status_code == 401


# --- JSON limits, refused fields, sampling ranges ----------------------------------------------
HOSTILE = [
    ("deep nesting", b'{"messages": ' + b"[" * 60_000 + b"]" * 60_000 + b"}", 400, "json_too_deep"),
    ("nesting past the limit", json.dumps(chat(user=json.loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)))).encode(),
     400, "json_too_deep"),
    ("5000-digit integer", b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 5000 + b"}", 400,
     "number_too_long"),
    ("long float", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 0.' + b"1" * 100 + b"}", 400,
     "number_too_long"),
    ("NaN", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("top_p 0", chat(top_p=0), 400, "top_p"),
    ("top_p 5e-324", chat(top_p=5e-324), 200, None),
    ("repeat_penalty 5e-324", chat(repeat_penalty=5e-324), 400, "repeat_penalty"),
    ("temperature 2.5", chat(temperature=2.5), 400, "temperature"),
    ("min_p 1.5", chat(min_p=1.5), 400, "min_p"),
    ("top_k -1", chat(top_k=-1), 400, "top_k"),
    ("seed 10**30", chat(seed=10**30, temperature=1), 200, None),
    ("seed -2**70", chat(seed=-2**70, temperature=1), 200, None),
    ("max_tokens 0", chat(max_tokens=0), 400, "max_tokens"),
    ("presence_penalty 3", chat(presence_penalty=3), 400, "presence_penalty"),
    ("presence_penalty 0.5", chat(presence_penalty=0.5), 200, None),
    ("frequency_penalty -2.5", chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("frequency_penalty 0", chat(frequency_penalty=0), 200, None),
    ("logit_bias", chat(logit_bias={"5": 10}), 200, None),
    ("logit_bias out of vocab", chat(logit_bias={"99999": 10}), 400, "logit_bias"),
    ("logit_bias key not an id", chat(logit_bias={"abc": 10}), 400, "logit_bias"),
    ("logit_bias value 101", chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("best_of 2", chat(best_of=2), 400, "best_of"),
    ("n 2", chat(n=2), 200, None),
    ("n 1", chat(n=1), 200, None),
    ("n above the bound", chat(n=17), 400, "n"),
    ("n 0", chat(n=0), 400, "n"),
    ("logprobs", chat(logprobs=True), 200, None),
    ("top_logprobs without logprobs", chat(top_logprobs=3), 400, "top_logprobs"),
    ("top_logprobs 20", chat(logprobs=True, top_logprobs=20), 200, None),
    ("top_logprobs 21", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("tools without template support", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("tool_choice names an unknown tool", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                               tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice"),
    ("tools not functions", chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    ("tools empty", chat(tools=[]), 200, None),
    ("tool_choice auto without tools", chat(tool_choice="auto"), 200, None),
    ("tool_choice required without tools", chat(tool_choice="required"), 400, "tool_choice"),
    ("response_format json", chat(response_format={"type": "json_object"}), 200, None),
    ("response_format text", chat(response_format={"type": "text"}), 200, None),
    ("response_format unknown type", chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("llama.cpp json_object with an unsupported schema", chat(response_format={
        "type": "json_object", "schema": {"type": "object", "minProperties": 2}}), 400, "response_format"),
    ("json_schema unsupported keyword", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "patternProperties": {"^a": {}}}}}), 400, "response_format"),
    ("json_schema without schema", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "response_format"),
    ("json_schema malformed", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}), 400, "response_format"),
    ("llama.cpp json_schema unsupported format", chat(json_schema={"type": "string", "format": "hostname"}), 400,
     "json_schema"),
    ("grammar undefined rule", chat(grammar="root ::= x"), 400, "grammar"),
    ("grammar malformed", chat(grammar='root ::= "a'), 400, "grammar"),
    ("grammar and response_format", chat(grammar='root ::= "a"', response_format={"type": "json_object"}), 400,
     "response_format"),
    ("empty stop", chat(stop=[""]), 400, "stop"),
    ("min_tokens over max_tokens", chat(max_tokens=4, min_tokens=5), 400, "min_tokens"),
    ("min_tokens negative", chat(min_tokens=-1), 400, "min_tokens"),
    ("min_tokens up to max_tokens", chat(max_tokens=4, min_tokens=4), 200, None),
    ("min_tokens past the whole context", {k: v for k, v in chat(min_tokens=1025).items() if k != "max_tokens"},
     400, "min_tokens"),
]


@pytest.mark.parametrize("name,body,status,named", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_a_4xx_naming_the_problem(url, name, body, status, named):
    r = post(url, body)
    assert r.status_code == status, r.text
    if status != 200 and named is not None:
        error = error_of(r)
        assert named in (error["param"], error["code"]), error
    assert health(url)["status"] == "ok"


@pytest.mark.parametrize("path,body,num_generated", [
    (CHAT, chat(max_tokens=300, min_tokens=280, ignore_eos=False), (280, 300)),     # issue 76's case
    (CHAT, chat(max_tokens=300, min_tokens=300), (300, 300)),                      # localrun bench --output-tokens 300
    (CHAT, {**chat(min_tokens=300), "max_tokens": None, "max_completion_tokens": 301}, (300, 301)),
    (CHAT, {k: v for k, v in chat(min_tokens=300).items() if k != "max_tokens"}, (300, 1024)),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 300, "min_tokens": 257}, (257, 300))])
def test_min_tokens_is_checked_against_the_requests_own_max_tokens(url, path, body, num_generated):
    """Not against SamplingParams' default max_tokens (256): the door's check once did (issue 76)."""
    r = post(url, body, path=path)
    assert r.status_code == 200, r.text
    low, high = num_generated
    assert low <= r.json()["usage"]["completion_tokens"] <= high


def test_min_tokens_past_the_default_reply_is_refused_naming_both(url):
    # a completion without max_tokens gets OpenAI's 16
    r = post(url, {"prompt": "hi", "min_tokens": 17}, path="/v1/completions")
    assert r.status_code == 400 and error_of(r)["param"] == "min_tokens"
    assert "min_tokens (17) must be at most max_tokens (16)" in error_of(r)["message"]
    r = post(url, chat(max_tokens=300, min_tokens=301))
    assert r.status_code == 400 and "min_tokens (301) must be at most max_tokens (300)" in error_of(r)["message"]


def test_a_body_the_context_cannot_hold_is_refused_before_it_is_read(url, llm):
    # 1024 tokens of at most 13 bytes each, 6 JSON bytes per text byte, 64 KiB of framing: 145,408 bytes
    body = json.dumps(chat("word " * 40_000)).encode()
    assert len(body) > 145_408
    r = post(url, body)
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
    assert "145408" in error_of(r)["message"]


def test_malformed_json_never_gives_a_500(url):
    for raw in (b"", b"{", b'{"messages": [', b"\x00" * 10, b"[]" * 1000, b'{"a": 1e999999}',
                b'{"messages": "x"}', b'{"messages": [{"role": "user", "content": {"a": 1}}]}'):
        r = post(url, raw)
        assert 400 <= r.status_code < 500, (raw[:40], r.text)


# --- every refusal names itself: a 4xx always has a string `code` (issue 76) ---------------------
def refusals(url: str, n_ctx: int):
    """(name, response) for each way this server refuses a request, one of each."""
    long_text = "word " * n_ctx                 # at least one token a word: past the context
    yield "foreign host", post(url, chat(), headers={"host": "evil.example"})
    yield "malformed host", post(url, chat(), headers={"host": "localhost:1@evil.example"})
    yield "foreign origin", post(url, chat(), headers={"origin": "https://evil.example"})
    yield "foreign preflight", httpx.options(f"{url}{CHAT}", headers={"origin": "https://evil.example",
                                                                      "access-control-request-method": "POST"})
    yield "form body", post(url, chat(), headers={"content-type": "application/x-www-form-urlencoded"})
    yield "unknown route", httpx.get(f"{url}/v1/nothing")
    yield "unknown POST route", post(url, chat(), path="/v1/embeddings")
    yield "wrong method", httpx.get(f"{url}{CHAT}")
    yield "wrong method on /health", post(url, {}, path="/health")
    for raw in (b"", b"{", b"[]", b'{"messages": "x"}', b"\xff", b'{"a": NaN}'):
        yield f"malformed JSON {raw!r}", post(url, raw)
    yield "no messages", post(url, {"model": MODEL})
    yield "a number too long", post(url, b'{"messages": [], "seed": ' + b"9" * 5000 + b"}")
    yield "nesting too deep", post(url, b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}")
    yield "body too large", post(url, chat("word " * 40_000))
    yield "chat prompt over the context", post(url, chat(long_text))
    yield "completion prompt over the context", post(url, {"prompt": long_text, "max_tokens": 4}, path="/v1/completions")
    yield "max_tokens over the room", post(url, chat(max_tokens=n_ctx))
    yield "token ids outside the vocabulary", post(url, {"prompt": [10**9], "max_tokens": 1}, path="/v1/completions")
    yield "a batch of prompts", post(url, {"prompt": ["a", "b"]}, path="/v1/completions")
    yield "an empty prompt", post(url, {"prompt": ""}, path="/v1/completions")
    yield "image content", post(url, chat([{"type": "image_url", "image_url": {"url": "x"}}]))
    yield "tool arguments not JSON", post(url, {**chat(), "messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
        {"role": "user", "content": "x"}]})
    for name, body, status, _ in HOSTILE:
        if status != 200:
            yield name, post(url, body)


def test_every_refusal_has_a_code(url, llm2):
    seen = []
    for name, r in refusals(url, n_ctx=1024):
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        error = error_of(r)
        assert isinstance(error["code"], str) and error["code"], (name, error)
        seen.append((name, r.status_code, error["code"]))
    codes = {name: code for name, _, code in seen}
    assert codes["completion prompt over the context"] == "context_length_exceeded"
    assert codes["max_tokens over the room"] == "context_length_exceeded"
    assert codes["unknown route"] == "not_found" and codes["wrong method"] == "method_not_allowed"
    assert codes["no messages"] == "invalid_request" and codes["form body"] == "unsupported_media_type"
    assert {status for _, status, _ in seen} >= {400, 403, 404, 405, 413, 415}
    with running(create_app(llm2, ServerConfig(MODEL, api_key="k1", strict_model_name=True))) as other:
        no_key = httpx.get(f"{other}/v1/models")
        assert no_key.status_code == 401 and error_of(no_key)["code"] == "invalid_api_key"
        other_model = post(other, chat(model="gpt-4"), headers={"authorization": "Bearer k1"})
        assert other_model.status_code == 404 and error_of(other_model)["code"] == "model_not_found"


def test_a_chat_prompt_over_the_context_is_context_length_exceeded(url):
    r = post(url, chat("word " * 1024))
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    assert error_of(r)["param"] == "messages"


# --- slow clients -----------------------------------------------------------------------------
def raw_connection(url: str) -> socket.socket:
    host, port = url.rsplit("/", 1)[-1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (reading and dropping any answer)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True
    return False


def test_slow_headers_slow_bodies_and_idle_connections_are_closed(llm2):
    config = ServerConfig(MODEL, body_timeout_s=0.5)
    with running(create_app(llm2, config), **uvicorn_options(header_timeout_s=0.5, keep_alive_s=0.5)) as url:
        slowloris = raw_connection(url)
        slowloris.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        time.sleep(0.2)
        slowloris.sendall(b"X-a: 1\r\n")                 # still dribbling headers
        assert closed_within(slowloris, 3)

        slow_body = raw_connection(url)
        slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mess")
        slow_body.settimeout(5)
        answer = b""
        while chunk := slow_body.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer

        idle = raw_connection(url)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert closed_within(idle, 3)                     # answered, then closed after 0.5 s idle
        assert health(url)["status"] == "ok"


# --- clean aborts: no leaked tasks, no tracebacks ----------------------------------------------
class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


async def _leave_after_first_chunk(url: str, i: int) -> None:
    body = {**chat(f"storm {i}"), "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{url}{CHAT}", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return


async def _leave_mid_body(url: str) -> None:
    host, port = url.rsplit("/", 1)[-1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 5000\r\n\r\n{\"messages\": [")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()


async def _leave_before_answer(url: str) -> None:
    async with httpx.AsyncClient(timeout=0.2) as client:
        try:
            await client.post(f"{url}{CHAT}", json={**chat(), "max_tokens": 300, "ignore_eos": True})
        except httpx.TimeoutException:
            pass


def test_a_disconnect_storm_leaks_no_task_and_logs_no_traceback(served):
    url = served.url
    handler = Records()
    for name in ("localrun", "uvicorn", "asyncio", "sse_starlette"):
        logging.getLogger(name).addHandler(handler)
    level = logging.getLogger("localrun").level
    logging.getLogger("localrun").setLevel(logging.INFO)
    try:
        r = post(url, chat(stream=True))           # sse-starlette's one shutdown watcher starts here
        assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")
        before = served.num_tasks()

        async def storm():
            await asyncio.gather(*[_leave_after_first_chunk(url, i) for i in range(24)],
                                 *[_leave_before_answer(url) for _ in range(8)],
                                 *[_leave_mid_body(url) for _ in range(8)])

        asyncio.run(storm())
        assert wait_until(lambda: health(url)["requests_in_flight"] == 0 and health(url)["kv_blocks_used"] == 0)
        assert wait_until(lambda: served.num_tasks() <= before, timeout=10), served.task_names()
    finally:
        for name in ("localrun", "uvicorn", "asyncio", "sse_starlette"):
            logging.getLogger(name).removeHandler(handler)
        logging.getLogger("localrun").setLevel(level)
    bad = [r for r in handler.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    messages = [r.getMessage() for r in handler.records]
    # one line per client that left: mid-body, waiting for a whole answer, mid-stream
    assert sum("disconnected while sending its body" in m for m in messages) == 8, messages
    assert sum(" client-disconnected prompt=" in m for m in messages) == 8, messages
    assert sum(" aborted prompt=" in m for m in messages) == 24, messages


# --- one request's sampling fault ----------------------------------------------------------------
@pytest.mark.parametrize("where", ["sampling", "detokenizing"])
def test_a_fault_in_one_request_fails_only_that_request(url, monkeypatch, where):
    real = model_runner.sample

    def sample(logits, params, generator, recent=()):
        if params.seed == 4242:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator, recent)

    class FaultyTextStream(frontend.TextStream):
        def __init__(self, tokenizer, stop=()):
            super().__init__(tokenizer, stop)
            self.poisoned = "POISON" in stop

        def feed(self, token_id):
            if self.poisoned:
                raise UnicodeError("a broken piece")
            return super().feed(token_id)

    if where == "sampling":
        monkeypatch.setattr(model_runner, "sample", sample)
        poison_body, message = chat("poison", seed=4242, temperature=1), "this request failed: RuntimeError"
    else:
        monkeypatch.setattr(frontend, "TextStream", FaultyTextStream)
        # ignore_eos: a first token that ends the generation is never detokenized (the request
        # would end cleanly, 200, with no text), as sampling without a seed sometimes draws
        poison_body, message = chat("poison", stop=["POISON"], ignore_eos=True), "this request failed: UnicodeError"

    async def stream(client, body):
        async with client.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}) as r:
            return r.status_code, sse_payloads([line async for line in r.aiter_lines()])

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            victims = [stream(client, chat(f"victim {i}", max_tokens=24, ignore_eos=True, temperature=0))
                       for i in range(6)]
            poison = client.post(f"{url}{CHAT}", json=poison_body)
            return await asyncio.gather(poison, *victims)

    poison, *victims = asyncio.run(main())
    assert poison.status_code == 503 and message in error_of(poison)["message"]
    for status, events in victims:
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["timings"]["generated_tokens"] == 24
    assert wait_until(lambda: health(url)["kv_blocks_used"] == 0 and health(url)["requests_in_flight"] == 0)


def test_logit_bias_forces_the_same_tokens_as_the_library(url, llm2):
    r = post(url, {"prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                   "logit_bias": {"7": 100}}, path="/v1/completions")
    assert r.status_code == 200, r.text
    ref = llm2.generate("hello", max_tokens=5, temperature=0, ignore_eos=True, logit_bias={7: 100})
    assert ref.token_ids == [7] * 5 and r.json()["choices"][0]["text"] == ref.text
