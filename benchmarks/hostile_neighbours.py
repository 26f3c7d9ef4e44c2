"""A victim stream beside one hostile request at a time (issue 76's fairness targets).

`localrun serve` runs in a child process (SmolLM2 by default, --parallel 16). The victim is a
streamed completion of --victim-tokens tokens (greedy, ignore_eos); its inter-token gaps are
measured at the client. First alone (twice; the better run is the baseline), then beside each
hostile request, sent just before the victim:
- `const`: a chat whose JSON schema is one `const` string of --const-bytes (under the size
  bound: it is enforced, each of its masks costly);
- `const_over`: the same at 500 KB (over the bound: refused at the door);
- `messages`: a chat body of 20,000 short messages (~800 KB; over the bound: refused);
- `messages_2k`: 2,000 of them (the most a request may hold): rendered, turns dropped to fit;
- `n16`: a chat with n=16 and no max_tokens;
and, in a second pass beside each hostile request, a small chat (one token): its latency shows
what preparation and seats cost a cheap request.

Prints a table, then one JSON object as the last line: per scenario the victim's worst and
p99 gap, their ratios to the baseline (target: worst under 2x), the hostile request's status,
and the small request's latency.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

from localrun.bench.servers import localrun_server
from localrun.cpu_info import cpu_info, cpu_time_shares, cpu_times, steal_ok


def victim(url: str, tokens: int, out: dict) -> None:
    """Stream a completion; record the gaps between text chunks."""
    body = {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    out["gaps"] = gaps


def gap_summary(gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    return {"gap_p50_ms": round(statistics.median(ordered) * 1000, 2),
            "gap_p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 2),
            "gap_max_ms": round(ordered[-1] * 1000, 2), "num_gaps": len(ordered)}


def messages(n: int) -> dict:
    return {"model": "x", "max_tokens": 8,
            "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} hello there"}
                         for i in range(n)]}


def hostile_bodies(const_bytes: int) -> dict[str, dict]:
    def schema(n):
        return {"model": "x", "max_tokens": 64, "messages": [{"role": "user", "content": "Say it."}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "c", "schema": {"const": "y" * n}}}}
    return {
        "const": schema(const_bytes),
        "const_over": schema(500_000),
        "messages": messages(20_000),
        "messages_2k": messages(2_000),
        "n16": {"model": "x", "n": 16, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "temperature": 1.0},
    }


def run_scenario(url: str, name: str, body: dict | None, tokens: int) -> dict:
    out: dict = {}
    hostile: dict = {}

    victim_done = threading.Event()

    def send_hostile():
        """Streamed, so that it can be dropped (and aborted by the server) once the victim is done."""
        start = time.perf_counter()
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=900) as r:
                if r.status_code >= 400:
                    r.read()
                    message = (r.json().get("error") or {}).get("message", "")[:200]
                else:
                    message = ""
                    for _ in r.iter_lines():
                        if victim_done.is_set():
                            message = "dropped when the victim was done"
                            break
                hostile.update(status=r.status_code, seconds=round(time.perf_counter() - start, 2), message=message)
        except httpx.HTTPError as e:
            hostile.update(status=None, seconds=round(time.perf_counter() - start, 2), message=str(e)[:200])

    def with_hostile(probe):
        """Run probe() while the hostile request (if any) is in flight; then drop it."""
        thread = None
        if body is not None:
            thread = threading.Thread(target=send_hostile)
            thread.start()
            time.sleep(0.3)
        result = probe()
        victim_done.set()
        if thread is not None:
            thread.join()
        victim_done.clear()
        return result

    def small():
        """A one-token chat (its own pass: its prompt step would be counted in the victim's gaps)."""
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=900, json={
            "model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
        return round(time.perf_counter() - start, 3) if r.status_code == 200 else None

    with_hostile(lambda: victim(url, tokens, out))
    row = {"scenario": name, **gap_summary(out["gaps"]), "hostile": dict(hostile) or None}
    row["small_request_s"] = with_hostile(small) if body is not None else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--victim-tokens", type=int, default=200)
    ap.add_argument("--const-bytes", type=int, default=100_000)
    ap.add_argument("--scenarios", default="const,const_over,messages,messages_2k,n16")
    args = ap.parse_args()
    times = cpu_times()
    rows = []
    with localrun_server(args.model, "-t", str(args.threads), "--parallel", str(args.parallel),
                         "-c", str(args.ctx), "--no-disk-cache") as url:
        run_scenario(url, "warm-up", None, 16)
        alone = [run_scenario(url, "alone", None, args.victim_tokens) for _ in range(2)]
        base = min(alone, key=lambda r: r["gap_max_ms"])
        rows.append(base)
        bodies = hostile_bodies(args.const_bytes)
        for name in args.scenarios.split(","):
            row = run_scenario(url, name, bodies[name], args.victim_tokens)
            row["gap_max_ratio"] = round(row["gap_max_ms"] / base["gap_max_ms"], 2)
            row["gap_p99_ratio"] = round(row["gap_p99_ms"] / base["gap_p99_ms"], 2)
            rows.append(row)
    shares = cpu_time_shares(times)
    print(f"{'scenario':<12}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'max/alone':>11}{'hostile':>9}{'small s':>9}")
    for r in rows:
        print(f"{r['scenario']:<12}{r['gap_p50_ms']:>9}{r['gap_p99_ms']:>9}{r['gap_max_ms']:>9}"
              f"{r.get('gap_max_ratio', 1.0):>11}{(r['hostile'] or {}).get('status', '-')!s:>9}"
              f"{r['small_request_s']!s:>9}")
    print(json.dumps({"benchmark": "hostile_neighbours", "cpu": {**cpu_info(), "time_shares": shares,
                                                                  "steal_ok": steal_ok(shares)},
                      "model": args.model, "threads": args.threads, "parallel": args.parallel,
                      "victim_tokens": args.victim_tokens, "scenarios": rows}))


if __name__ == "__main__":
    main()
