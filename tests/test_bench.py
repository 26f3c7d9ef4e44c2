"""The load generator: statistics against hand-computed numbers, and a run against an
in-process fake OpenAI server with known answers and known failures."""
from __future__ import annotations

import asyncio
import json
import math

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from localrun.bench.loadgen import RequestResult, run_requests
from localrun.bench.stats import breakdown, percentile, summarize
from localrun.bench.workload import Scenario, build_requests
from localrun.cli.top import histogram_quantile
from server_harness import running


def test_percentile_matches_hand_computation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)      # (n-1)*0.5 = 1.5 -> 2 + 0.5*(3-2)
    assert percentile(xs, 90) == pytest.approx(3.7)      # 2.7 -> 3 + 0.7*(4-3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


def test_histogram_quantile_matches_hand_computation():
    buckets = [(0.1, 2), (0.5, 6), (1.0, 10), (math.inf, 10)]
    # rank 5 of 10 lies in (0.1, 0.5] holding counts 2..6: 0.1 + 0.4 * (5-2)/4 = 0.4
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.4)
    # rank 9.9 lies in (0.5, 1.0] holding 6..10: 0.5 + 0.5 * 3.9/4
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.9875)
    assert histogram_quantile(0.5, [(1.0, 0), (math.inf, 0)]) is None


def test_tpot_itl_and_breakdown_of_one_request():
    r = RequestResult(0, ok=True, sent=10.0, first_token=10.5, end=11.5, chunk_times=[10.5, 10.75, 11.5],
                      completion_tokens=5, server_timings={"queue_ms": 100, "prefill_ms": 300, "ttft_ms": 450})
    assert r.ttft_s == 0.5 and r.e2e_s == 1.5
    assert r.tpot_s == pytest.approx(1.0 / 4)
    assert r.itl_s == pytest.approx([0.25, 0.75])
    b = breakdown(r)
    assert b == pytest.approx({"queue": 0.1, "prefill": 0.3, "first_decode": 0.05, "transport": 0.05})


def test_workload_shapes():
    s = Scenario(num_requests=6, prompt_tokens=10, shared_prefix_tokens=20, num_prefixes=2, seed=3)
    reqs = build_requests(s)
    assert len(reqs) == 6 and all(r.arrival_s == 0 for r in reqs)
    systems = [r.messages[0]["content"] for r in reqs]
    assert systems[0] == systems[2] == systems[4] != systems[1] == systems[3]
    assert len(systems[0].split()) == 20 and len({r.messages[1]["content"] for r in reqs}) == 6
    assert build_requests(s) == reqs                       # seeded
    poisson = build_requests(Scenario(num_requests=200, request_rate=50.0, chat=False))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(poisson, poisson[1:])]
    assert all(g >= 0 for g in gaps) and 0.01 < sum(gaps) / len(gaps) < 0.03    # mean 1/50 s
    assert poisson[0].prompt is not None and poisson[0].messages is None


# --- a fake OpenAI server: request i streams (i % 4) + 1 pieces; i % 5 == 3 answers 500;
# i % 7 == 6 breaks the stream with an error event -------------------------------------------
def fake_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        i = int(body["messages"][-1]["content"].split(":")[0].split()[-1])
        if i % 5 == 3:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = i % 4 + 1

        async def events():
            for k in range(n):
                await asyncio.sleep(0.01)
                yield "data: " + json.dumps({"choices": [{"delta": {"content": f"t{k} "}, "finish_reason": None}]}) + "\n\n"
                if i % 7 == 6:
                    yield "data: " + json.dumps({"error": {"message": "engine failed"}}) + "\n\n"
                    return
            yield "data: " + json.dumps({"choices": [{"delta": {}, "finish_reason": "length"}],
                                         "timings": {"queue_ms": 1.0, "prefill_ms": 2.0, "ttft_ms": 4.0}}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_run_against_a_fake_server_counts_tokens_and_errors():
    reqs = build_requests(Scenario(num_requests=20, prompt_tokens=3, output_tokens=4))
    with running(fake_app()) as url:
        results, wall = asyncio.run(run_requests(url, reqs, concurrency=5))
    failing_http = {i for i in range(20) if i % 5 == 3}
    failing_stream = {i for i in range(20) if i % 7 == 6} - failing_http
    ok = set(range(20)) - failing_http - failing_stream
    assert {r.index for r in results if r.ok} == ok
    assert all(results[i].error.startswith("HTTP 500") for i in failing_http)
    assert all("engine failed" in results[i].error for i in failing_stream)
    assert all(results[i].completion_tokens == i % 4 + 1 and results[i].prompt_tokens == 9 for i in ok)
    assert all(len(results[i].chunk_times) == i % 4 + 1 for i in ok)
    s = summarize(results, wall)
    assert (s["requests"], s["completed"], s["errors"]) == (20, len(ok), 20 - len(ok))
    assert s["completion_tokens"] == sum(i % 4 + 1 for i in ok)
    assert s["output_token_throughput"] == pytest.approx(s["completion_tokens"] / wall)
    assert s["ttft_breakdown_s"]["p50"]["queue"] == pytest.approx(0.001)
    assert s["ttft_s"]["p50"] >= 0.01        # the fake sleeps 10 ms before the first piece


def test_bench_cli_against_a_fake_server(tmp_path):
    from typer.testing import CliRunner

    from localrun.cli.main import app
    with running(fake_app()) as url:
        result = CliRunner().invoke(app, ["bench", "--url", url, "-n", "8", "--json", str(tmp_path / "r.json"),
                                          "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["requests"] == 8 and data["summary"]["errors"] == 2    # i = 3 and 6
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "TTFT" in result.output


def test_a_fixed_length_request_bans_the_end_of_turn_until_its_last_token():
    """ignore_eos (the bench's default) also sends min_tokens = max_tokens: past an end of turn a
    model writes hidden special tokens, which send no text, so each gap around them counted as
    one long inter-token latency."""
    from localrun.bench.loadgen import request_body
    from localrun.bench.workload import BenchRequest
    req = BenchRequest(0, 0.0, 32, messages=({"role": "user", "content": "hi"},))
    _, body = request_body(req, None, ignore_eos=True)
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 32
    _, body = request_body(req, None, ignore_eos=False)
    assert "ignore_eos" not in body and "min_tokens" not in body
