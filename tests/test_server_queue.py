"""The bounded queue of `localrun serve`: past --max-queue waiting requests a new one gets a 503
with Retry-After in OpenAI's error shape, counted in /metrics; a queued request whose client
leaves is dropped before the engine computes any of it.

The engine's step is held behind a gate while the burst arrives, so no request leaves the queue
before all of them are answered or queued: the counts are exact, not timing-dependent."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from localrun.api import LLM
from localrun.server.app import ServerConfig, create_app
from server_harness import health, running, wait_until
from test_server import metric


@pytest.fixture
def gated(tiny_gguf):
    """(llm, gate): the engine thread blocks at its next step until gate is set."""
    llm = LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=8)
    gate = threading.Event()
    step = llm.engine.step

    def gated_step():
        gate.wait(60)
        return step()

    llm.engine.step = gated_step
    yield llm, gate
    gate.set()


def test_a_burst_past_the_bound_gets_exactly_the_excess_as_503s(gated):
    llm, gate = gated
    num_requests, max_queue = 500, 64
    with running(create_app(llm, ServerConfig("tiny", max_queue=max_queue))) as url:
        async def one(client, i):
            return await client.post(f"{url}/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 2,
                                                                    "ignore_eos": True})

        async def main():
            limits = httpx.Limits(max_connections=num_requests)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                tasks = [asyncio.ensure_future(one(client, i)) for i in range(num_requests)]
                while sum(t.done() for t in tasks) < num_requests - max_queue:
                    await asyncio.sleep(0.05)
                assert health(url)["status"] == "ok"        # busy, not sick
                gate.set()
                return await asyncio.gather(*tasks)

        responses = asyncio.run(asyncio.wait_for(main(), 240))
        refused = [r for r in responses if r.status_code == 503]
        done = [r for r in responses if r.status_code == 200]
        assert (len(refused), len(done)) == (num_requests - max_queue, max_queue)
        r = refused[0]
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "queue_full"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert all(d.json()["usage"]["completion_tokens"] == 2 for d in done)
        assert metric(url, "localrun_requests_rejected_total", {"reason": "queue_full"}) == num_requests - max_queue
        assert wait_until(lambda: health(url)["requests_in_flight"] == 0 and health(url)["kv_blocks_used"] == 0)
        assert health(url)["status"] == "ok"
        # the queue is empty again: a new request is served
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "after", "max_tokens": 1},
                          timeout=60).status_code == 200


def test_a_queued_request_whose_client_left_costs_no_compute(gated):
    llm, gate = gated
    engine = llm.engine
    with running(create_app(llm, ServerConfig("tiny"))) as url:
        first_prompt = "a request that is being served"
        results = {}

        def first():
            results["first"] = httpx.post(f"{url}/v1/completions", timeout=60,
                                          json={"prompt": first_prompt, "max_tokens": 3, "ignore_eos": True})

        client = threading.Thread(target=first)
        client.start()
        assert wait_until(lambda: health(url)["requests_in_flight"] == 1)   # the engine holds it, gated
        prefill_before = engine.stats()["num_prefill_tokens"]
        with pytest.raises(httpx.ReadTimeout):      # a second client gives up while queued
            httpx.post(f"{url}/v1/completions", timeout=0.5,
                       json={"prompt": "another prompt entirely, never computed", "max_tokens": 3})
        threading.Event().wait(0.3)          # the server sees the disconnect and queues the abort
        gate.set()
        client.join(60)
        assert results["first"].status_code == 200
        assert wait_until(lambda: health(url)["requests_in_flight"] == 0 and health(url)["kv_blocks_used"] == 0)
        num_first = results["first"].json()["usage"]["prompt_tokens"]
        assert engine.stats()["num_prefill_tokens"] - prefill_before == num_first
        assert engine.stats()["num_aborted"] == 1
