"""Long prompts arriving while streams decode: what `--itl-target-ms` buys, over HTTP.

The workload the ITL target exists for (issue 18): S chat streams (default 8) start together
with short prompts and decode `--stream-tokens` tokens each (greedy, ignore_eos); while they
run, L long prompts (default 4, ~`--long-tokens` tokens of distinct text, no shared prefix, 16
output tokens) arrive one every `--gap` seconds from `--first-long` on. Each configuration is
a fresh `localrun serve` (same GGUF, threads, context, `--parallel S + L`, `--max-batched-tokens`)
with one warm-up request. Per configuration: the streams' ITL p50/p99 and TPOT p50, the long
prompts' TTFT p50/p99, output tokens/s, and the server's ITL-target misses.

Prints a table, then one JSON object as the last line (rows keyed by the target, "off" for none).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import FIDELITY_TEXT  # noqa: E402
from prefix_cache import QUESTIONS  # noqa: E402
from seed_ablation import scrape  # noqa: E402

from localrun.bench.loadgen import run_requests  # noqa: E402
from localrun.bench.servers import localrun_server  # noqa: E402
from localrun.bench.stats import summarize  # noqa: E402
from localrun.bench.workload import BenchRequest  # noqa: E402
from localrun.cpu_info import cpu_info  # noqa: E402
from localrun.models import resolve_model  # noqa: E402
from localrun.tokenizer import Tokenizer  # noqa: E402


def workload(model_path, args) -> list[BenchRequest]:
    tok = Tokenizer(model_path)
    text = tok.encode(FIDELITY_TEXT * 40, add_special=False)
    streams = [BenchRequest(i, 0.0, args.stream_tokens, messages=(
        {"role": "user", "content": f"Stream {i + 1}: {QUESTIONS[i % len(QUESTIONS)]} Answer at length."},))
        for i in range(args.streams)]
    longs = []
    for j in range(args.long):
        start = j * 97 % max(1, len(text) - args.long_tokens)       # a different stretch each
        body = tok.decode(text[start:start + args.long_tokens], special=False)
        longs.append(BenchRequest(args.streams + j, args.first_long + j * args.gap, 16, messages=(
            {"role": "user", "content": f"Document {j + 1}:\n{body}\n\nSummarize document {j + 1} in one sentence."},)))
    return streams + longs


def measure(url: str, requests: list[BenchRequest], num_streams: int) -> dict:
    warm_up = [BenchRequest(0, 0.0, 4, messages=({"role": "user", "content": "Warm-up: say hello."},))]
    asyncio.run(run_requests(url, warm_up))
    results, wall = asyncio.run(run_requests(url, requests))
    streams, longs = summarize(results[:num_streams], wall), summarize(results[num_streams:], wall)
    every = summarize(results, wall)
    return {"stream_itl_p50_s": streams["itl_s"]["p50"], "stream_itl_p99_s": streams["itl_s"]["p99"],
            "stream_tpot_p50_s": streams["tpot_s"]["p50"], "long_ttft_p50_s": longs["ttft_s"]["p50"],
            "long_ttft_p99_s": longs["ttft_s"]["p99"], "output_tok_s": every["output_token_throughput"],
            "wall_s": wall, "errors": every["errors"], "error_messages": every["error_messages"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--first-long", type=float, default=1.0)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--targets", default="off,100,200", help="ITL targets in ms to compare, 'off' for none")
    args = ap.parse_args()

    model_path = resolve_model(args.model)
    requests = workload(model_path, args)
    rows = {}
    for target in args.targets.split(","):
        flags = [] if target == "off" else ["--itl-target-ms", target]
        with localrun_server(str(model_path), "--threads", str(args.threads), "--ctx", str(args.ctx),
                             "--parallel", str(args.streams + args.long), "--max-batched-tokens", str(args.max_batched_tokens),
                             "--no-disk-cache", *flags) as url:
            row = measure(url, requests, args.streams)
            row["itl_target_misses"] = scrape(url, "localrun_itl_target_misses_total")
        rows[target] = row
        print(f"  [{target}] ITL p99 {row['stream_itl_p99_s'] * 1000:.0f} ms, long TTFT p50 "
              f"{row['long_ttft_p50_s']:.2f} s", file=sys.stderr)

    print("| ITL target (ms) | stream ITL p50 (ms) | stream ITL p99 (ms) | stream TPOT p50 (ms) | "
          "long TTFT p50 (s) | long TTFT p99 (s) | output tok/s | target misses |")
    print("|---|---|---|---|---|---|---|---|")
    for target, r in rows.items():
        print(f"| {target} | {r['stream_itl_p50_s'] * 1000:.0f} | {r['stream_itl_p99_s'] * 1000:.0f} | "
              f"{r['stream_tpot_p50_s'] * 1000:.0f} | {r['long_ttft_p50_s']:.2f} | {r['long_ttft_p99_s']:.2f} | "
              f"{r['output_tok_s']:.1f} | {r['itl_target_misses']:.0f} |")
    print(json.dumps({"benchmark": "mixed_load", "cpu": cpu_info(), "model": model_path.name,
                      "scenario": {k: getattr(args, k) for k in ("threads", "ctx", "streams", "stream_tokens", "long",
                                                                 "long_tokens", "first_long", "gap", "max_batched_tokens")},
                      "rows": rows}))


if __name__ == "__main__":
    main()
