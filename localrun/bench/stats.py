"""Statistics of a load-generator run: percentiles, throughput, and the TTFT breakdown.

Percentiles interpolate linearly between order statistics (numpy's default "linear" method):
for sorted values x[0..n-1], p-th percentile = x[i] + (x[i+1] - x[i]) * f, with
i + f = (n - 1) * p / 100.

The TTFT breakdown uses the server's `timings` (localrun returns them): queue (arrival to
first scheduled), prefill (first scheduled to the prompt's last K/V), first decode (the rest
of the server's TTFT: sampling the first token and anything between), transport (client
TTFT minus server TTFT: HTTP, tokenization, SSE framing, the client's own event loop).
"""
from __future__ import annotations

import math

from localrun.bench.loadgen import RequestResult

PERCENTILES = (50, 90, 99)
PARTS = ("queue", "prefill", "first_decode", "transport")


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict:
    out = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def breakdown(r: RequestResult) -> dict | None:
    """Seconds of each part of one request's TTFT, or None without server timings."""
    t = r.server_timings
    if not t or r.ttft_s is None or t.get("ttft_ms") is None:
        return None
    queue = (t.get("queue_ms") or 0) / 1000
    prefill = (t.get("prefill_ms") or 0) / 1000
    server_ttft = t["ttft_ms"] / 1000
    return {"queue": queue, "prefill": prefill, "first_decode": max(0.0, server_ttft - queue - prefill),
            "transport": max(0.0, r.ttft_s - server_ttft)}


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.completion_tokens for r in ok)
    summary = {
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "error_messages": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "ttft_s": distribution(ttft),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": distribution([g for r in ok for g in r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "output_token_throughput": tokens / wall_s if wall_s > 0 else None,
        "completion_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
    }
    parts = [(r.ttft_s, b) for r in ok if (b := breakdown(r)) is not None]
    if parts:
        parts.sort(key=lambda x: x[0])
        # the breakdown of the request AT each TTFT percentile (parts of different requests don't add up)
        summary["ttft_breakdown_s"] = {f"p{p}": parts[round((len(parts) - 1) * p / 100)][1] for p in PERCENTILES}
        summary["cached_prompt_tokens"] = sum(r.server_timings.get("cached_tokens") or 0 for r in ok
                                              if r.server_timings)
    return summary
