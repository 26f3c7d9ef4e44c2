"""`localrun serve` on a tiny synthetic model: protocol, bad input, auth, load, disconnects, metrics.

The server runs on loopback through uvicorn in a thread, so SSE framing and client disconnects
are the real thing."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localrun.api import LLM
from localrun.server.app import ServerConfig, create_app
from server_harness import health, running, sse_payloads, wait_until

MODEL = "tiny"
KEY = "sekret-key"


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=8)


@pytest.fixture(scope="module")
def ref(tiny_gguf):
    """A second LLM on the same file for reference outputs: the server's engine is its own thread's."""
    return LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=1)


@pytest.fixture(scope="module")
def url(llm):
    with running(create_app(llm, ServerConfig(MODEL, max_body_bytes=64 * 1024))) as url:
        yield url


def chat_body(content="hello there", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def metric(url: str, name: str, labels: dict | None = None) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(sample.labels.get(k) == v for k, v in labels.items())):
                return sample.value
    raise KeyError(name)


# --- protocol -------------------------------------------------------------------------------
def test_chat_completion_has_usage_finish_reason_and_timings(url, llm):
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=7, temperature=0, ignore_eos=True),
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    prompt_ids = llm.chat_prompt_ids([{"role": "user", "content": "hello there"}])
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 7
    t = body["timings"]
    assert t["prompt_tokens"] == len(prompt_ids) and t["generated_tokens"] == 7
    assert t["ttft_ms"] >= t["queue_ms"] >= 0 and t["prefill_ms"] > 0 and t["decode_tok_s"] > 0


def test_greedy_completion_matches_the_library(url, ref):
    """Same prompt, same greedy params: the HTTP text equals LLM.generate's."""
    want = ref.generate("abc abc", max_tokens=6, temperature=0, ignore_eos=True)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "abc abc", "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True}, timeout=60)
    assert r.json()["choices"][0]["text"] == want.text


def test_second_request_reuses_the_prefix_cache(url):
    prompt = "shared prefix " * 12
    bodies = [httpx.post(f"{url}/v1/completions", json={"prompt": prompt + s, "max_tokens": 2},
                         timeout=60).json() for s in ("one", "two")]
    assert bodies[0]["timings"]["cached_tokens"] == 0 or bodies[0]["timings"]["cached_tokens"] is not None
    assert bodies[1]["timings"]["cached_tokens"] >= 16     # at least one full block
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == bodies[1]["timings"]["cached_tokens"]


def test_stream_chunks_end_with_finish_timings_usage_and_done(url):
    with httpx.stream("POST", f"{url}/v1/chat/completions",
                      json=chat_body(max_tokens=5, stream=True, ignore_eos=True,
                                     stream_options={"include_usage": True}), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and "ttft_ms" in final["timings"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


def test_stop_string_ends_the_completion(url, ref):
    full = ref.generate("stop test", max_tokens=12, temperature=0, ignore_eos=True).text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's output has no usable stop string here")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "stop test", "max_tokens": 12, "temperature": 0,
                                                   "ignore_eos": True, "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == full[:full.find(stop)]


def test_models_and_health(url):
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert health(url)["status"] == "ok"


# --- bad input: one OpenAI error object, the right 4xx, and the server keeps working ----------
BAD_INPUTS = [
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, "invalid_request_error"),
    ("body not an object", "/v1/chat/completions", b'[1, 2]', 400, "invalid_request_error"),
    ("wrong type", "/v1/chat/completions", chat_body(temperature="hot"), 400, "invalid_request_error"),
    ("string for int", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "invalid_request_error"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "invalid_request_error"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "invalid_request_error"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_request_error"),
    ("prompt longer than context", "/v1/completions", {"prompt": "word " * 1200}, 400, "invalid_request_error"),
    ("max_tokens beyond context", "/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400,
     "invalid_request_error"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "invalid_request_error"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999]}, 400, "invalid_request_error"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "invalid_request_error"),
    ("n above the bound", "/v1/chat/completions", chat_body(n=17), 400, "invalid_request_error"),
    ("top_logprobs above 20", "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=21), 400,
     "invalid_request_error"),
    ("malformed schema", "/v1/chat/completions", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}}), 400,
     "invalid_request_error"),
    ("completions logprobs above 20", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 21}, 400,
     "invalid_request_error"),
    ("malformed grammar", "/v1/completions", {"prompt": "x", "grammar": "root ::= (("}, 400, "invalid_request_error"),
    ("unknown tool name in tool_choice", "/v1/chat/completions",
     chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
               tool_choice={"type": "function", "function": {"name": "g"}}), 400, "invalid_request_error"),
    ("tools without template support", "/v1/chat/completions",
     chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "invalid_request_error"),
    ("temperature out of range", "/v1/chat/completions", chat_body(temperature=5), 400, "invalid_request_error"),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "invalid_request_error"),
    ("oversized body", "/v1/completions", {"prompt": "x" * 70_000}, 413, "invalid_request_error"),
    ("unknown route", "/v1/nothing", {}, 404, "invalid_request_error"),
]


@pytest.mark.parametrize("name,path,body,status,err_type", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_an_openai_error(url, name, path, body, status, err_type):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == err_type and isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]


def test_any_model_name_is_served_by_the_one_model_and_answered_with_its_real_id(url):
    for name in ("gpt-4o", "gpt-4o", "claude-3-opus"):
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=2) | {"model": name}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == MODEL


def test_strict_model_name_keeps_the_404(ref):
    with running(create_app(ref, ServerConfig(MODEL, strict_model_name=True))) as strict:
        r = httpx.post(f"{strict}/v1/chat/completions", json=chat_body(max_tokens=2) | {"model": "gpt-9"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        ok = httpx.post(f"{strict}/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30)
        assert ok.status_code == 200 and ok.json()["model"] == MODEL


def test_wrong_method_is_405(url):
    r = httpx.get(f"{url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_bad_input_leaves_the_engine_idle_and_healthy(url):
    for _, path, body, _, _ in BAD_INPUTS:
        httpx.post(f"{url}{path}", content=body if isinstance(body, bytes) else json.dumps(body).encode())
    h = health(url)
    assert h["status"] == "ok" and h["requests_in_flight"] == 0 and h["kv_blocks_used"] == 0


def test_api_key(llm):
    with running(create_app(llm, ServerConfig(MODEL, api_key=KEY))) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200     # probes need no key


# --- load: 64 concurrent streams, a quarter of them hang up early -----------------------------
async def _client(url: str, i: int, rng: random.Random) -> dict:
    leaves = i % 4 == 0
    words = rng.randint(1, 40)
    max_tokens = 200 if leaves else rng.randint(1, 24)
    body = {"model": MODEL, "prompt": " ".join(f"w{rng.randint(0, 50)}" for _ in range(words)),
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": rng.choice([0, 0.8]), "seed": i}
    if i % 2:
        body = {"model": MODEL, "messages": [{"role": "user", "content": body.pop("prompt")}], **body}
    path = "/v1/chat/completions" if i % 2 else "/v1/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{url}{path}", json=body) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if leaves and sum(l.startswith("data:") for l in lines) >= 3:
                    return {"left": True}
    return {"left": False, "events": sse_payloads(lines), "max_tokens": max_tokens, "chat": bool(i % 2)}


def test_64_concurrent_streams_with_early_disconnects(url):
    aborted_before = metric(url, "localrun_requests_total", {"finish_reason": "abort"})
    rng = random.Random(7)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*[_client(url, i, rng) for i in range(64)]), 300)

    results = asyncio.run(main())
    stayed = [r for r in results if not r["left"]]
    assert len(stayed) == 48
    for r in stayed:
        events = r["events"]
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["timings"]["generated_tokens"] == r["max_tokens"]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # the 16 that left were aborted and their blocks came back
    assert wait_until(lambda: health(url)["requests_in_flight"] == 0 and health(url)["kv_blocks_used"] == 0)
    assert health(url)["status"] == "ok"
    assert metric(url, "localrun_requests_total", {"finish_reason": "abort"}) - aborted_before == 16
    assert metric(url, "localrun_num_requests_running") == 0


def test_non_stream_client_disconnect_aborts_the_request(url):
    # The client gives up after the time a whole 240-token request took on this host, while its
    # request asks for 900 tokens: it goes mid-request on a host of any speed (a fixed 0.3 s was
    # longer than 240 tokens on a fast one).
    start = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json={"prompt": "long one", "max_tokens": 240, "ignore_eos": True}, timeout=60)
    whole = time.perf_counter() - start

    async def main():
        async with httpx.AsyncClient(timeout=whole) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"{url}/v1/completions",
                                  json={"prompt": "long one", "max_tokens": 900, "ignore_eos": True})

    asyncio.run(main())
    assert wait_until(lambda: health(url)["requests_in_flight"] == 0 and health(url)["kv_blocks_used"] == 0)


def test_metrics_count_tokens_and_requests(url):
    before_gen = metric(url, "localrun_generation_tokens_total")
    before_prompt = metric(url, "localrun_prompt_tokens_total")
    before_ttft = metric(url, "localrun_time_to_first_token_seconds_count")
    body = httpx.post(f"{url}/v1/completions", json={"prompt": "count me", "max_tokens": 4, "ignore_eos": True},
                      timeout=60).json()
    assert metric(url, "localrun_generation_tokens_total") - before_gen == 4
    assert metric(url, "localrun_prompt_tokens_total") - before_prompt == body["usage"]["prompt_tokens"]
    assert metric(url, "localrun_time_to_first_token_seconds_count") - before_ttft == 1
    assert metric(url, "localrun_kv_blocks_total") > 0
    for name in ("localrun_prefix_cache_queries_total", "localrun_prefix_cache_hits_total",
                 "localrun_num_requests_waiting", "localrun_kv_blocks_used", "localrun_num_preemptions_total",
                 "localrun_inter_token_latency_seconds_count", "localrun_e2e_request_latency_seconds_count",
                 "localrun_request_queue_time_seconds_count"):
        metric(url, name)      # present


def test_top_shows_the_server_state(url):
    from typer.testing import CliRunner

    from localrun.cli.main import app
    httpx.post(f"{url}/v1/completions", json={"prompt": "for top", "max_tokens": 3, "ignore_eos": True}, timeout=60)
    result = CliRunner().invoke(app, ["top", "--url", url, "--once"])
    assert result.exit_code == 0, result.output
    assert "requests running / waiting" in result.output and "0 / 0" in result.output
    total = metric(url, "localrun_kv_blocks_total")
    assert f"0 / {total:,.0f}" in result.output
    assert "TTFT p50 / p99" in result.output and " ms / " in result.output
    down = CliRunner().invoke(app, ["top", "--url", "http://127.0.0.1:9", "--once"])
    assert down.exit_code != 0 and "cannot reach" in str(down.exception)


def test_a_chat_longer_than_the_context_drops_the_oldest_turns(url, llm):
    """The system prompt stays, the oldest turns go, and the response says how many."""
    turns = [{"role": "system", "content": "sys prompt stays"}]
    for i in range(60):
        turns += [{"role": "user", "content": f"question {i} " + "x y z " * 10},
                  {"role": "assistant", "content": f"answer {i} " + "a b c " * 10}]
    turns.append({"role": "user", "content": "last question"})
    assert len(llm.chat_prompt_ids(turns)) > llm.n_ctx
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    dropped = body["timings"]["dropped_messages"]
    assert dropped > 0
    kept = [turns[0]] + turns[1 + dropped:]
    assert body["usage"]["prompt_tokens"] == len(llm.chat_prompt_ids(kept))
    assert body["usage"]["prompt_tokens"] + 8 <= llm.n_ctx


def test_speculative_requests_report_drafts_in_timings_and_metrics(tiny_gguf):
    spec = LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=4,
               speculative="ngram")
    with running(create_app(spec, ServerConfig(MODEL))) as url:
        prompt = "a b c d a b c d a b c d a b c d"
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60).json()
        t = plain["timings"]
        assert {"draft_tokens", "accepted_tokens"} <= set(t)
        assert 0 <= t["accepted_tokens"] <= t["draft_tokens"]
        assert metric(url, "localrun_engine_spec_draft_tokens") == t["draft_tokens"]
        assert metric(url, "localrun_engine_spec_accepted_tokens") == t["accepted_tokens"]


# --- issue 19: n, logprobs, penalties over HTTP -----------------------------------------------------
def test_n_choices_follow_the_library_by_seed_streamed_or_not(url, ref):
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 5,
            "n": 3, "ignore_eos": True}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    expected = [r.text for r in ref.generate("once upon a time", n=3, max_tokens=6, temperature=1.0, seed=5,
                                             ignore_eos=True)]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["text"] for c in whole["choices"]] == expected
    assert whole["usage"]["completion_tokens"] == 18
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        chunks = sse_payloads(r.iter_lines())
    texts = ["", "", ""]
    finishes = {}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == expected and finishes == {0: "length", 1: "length", 2: "length"}


def test_logprobs_streamed_and_whole_agree_and_spell_the_text(url, ref):
    body = chat_body(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    content = whole["logprobs"]["content"]
    text = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace")
    assert len(content) == 6 and text == whole["message"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] == e["logprob"]   # greedy: the top
        assert bytes(e["bytes"]).decode("utf-8", errors="replace") == e["token"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        chunks = sse_payloads(r.iter_lines())
    streamed = [e for c in chunks[:-1] for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    # the second request reuses the cached prompt: equal up to float32 rounding
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in streamed] == \
        [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    # completions' shape: tokens, token_logprobs, top_logprobs, text_offset
    comp = httpx.post(f"{url}/v1/completions", json={"prompt": "once upon a time", "max_tokens": 4, "temperature": 0,
                                                      "logprobs": 2, "ignore_eos": True}, timeout=60).json()
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == 4
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    expected = ref.generate("once upon a time", max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    assert lp["token_logprobs"] == pytest.approx([r.logprob for r in expected.logprobs], abs=1e-4)


def test_penalties_over_http_match_the_library(url, ref):
    body = {"prompt": "once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "presence_penalty": 1.5, "frequency_penalty": 0.5}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    expected = ref.generate("once upon a time", max_tokens=8, temperature=0, ignore_eos=True,
                            presence_penalty=1.5, frequency_penalty=0.5)
    assert r["choices"][0]["text"] == expected.text
    assert expected.text != ref.generate("once upon a time", max_tokens=8, temperature=0, ignore_eos=True).text
