"""`localrun serve` against llama-cpp-python's server, over HTTP, on the shared-prefix scenario.

The scenario of the engine-core issue: N requests (default 16) arrive together, each a chat
with one shared system prompt (default 1024 tokens of real text) and its own question (~32
tokens), 32 output tokens each (greedy unless --temperature). Both servers get min_tokens =
max_tokens, so both generate exactly that many tokens and no end of turn among them. With
ignore_eos instead, localrun went on past the model's end-of-turn token; the special tokens
after it (end and start of turn) send no text, so the next text chunk came two or three steps
after the last and counted as one inter-token gap: ITL p99 0.19-0.23 s where no step took 0.09 s. Each server runs alone on the machine with
the same GGUF and thread count; each gets one unrelated warm-up request first. TTFT is
measured by the client from the moment it sends (all at once), so queueing counts.

llama-cpp-python's server runs one request at a time behind a lock; it does reuse the KV of
the longest common prefix with the previous prompt, so it also skips the shared system prompt
after the first request. localrun batches all requests and shares the prefix blocks.

Prints a table, then one JSON object as the last line:
  ttft_p50_ratio = localrun p50 TTFT / llama-cpp-python p50 TTFT (target <= 0.2), p99 likewise,
  throughput_ratio = localrun output tokens/s / llama-cpp-python's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_cache import QUESTIONS, SYSTEM_TEXT  # noqa: E402

from localrun.bench.loadgen import run_requests  # noqa: E402
from localrun.bench.servers import llama_cpp_server, localrun_server  # noqa: E402
from localrun.bench.stats import summarize  # noqa: E402
from localrun.bench.workload import BenchRequest  # noqa: E402
from localrun.models import resolve_model  # noqa: E402
from localrun.tokenizer import Tokenizer  # noqa: E402
from localrun.cpu_info import cpu_info, cpu_time_shares, cpu_times, steal_ok  # noqa: E402


def workload(model_path, n: int, prefix_tokens: int, output_tokens: int,
             temperature: float = 0.0) -> list[BenchRequest]:
    tok = Tokenizer(model_path)
    ids = tok.encode(SYSTEM_TEXT * 4, add_special=False)[:prefix_tokens]
    system = tok.decode(ids, special=False)
    return [BenchRequest(i, 0.0, output_tokens, temperature=temperature,
                         messages=({"role": "system", "content": system},
                                   {"role": "user", "content": f"Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]} "
                                                               "Please answer briefly and precisely."}))
            for i in range(n)]


WARM_UP = [BenchRequest(0, 0.0, 4, messages=({"role": "user", "content": "Warm-up: say hello."},))]


def exactly(output_tokens: int) -> dict:
    """The request body's fields that make either server generate exactly output_tokens tokens."""
    return {"min_tokens": output_tokens}


def measure(url: str, requests, extra_body: dict | None) -> dict:
    asyncio.run(run_requests(url, WARM_UP, ignore_eos=False))
    times = cpu_times()
    results, wall = asyncio.run(run_requests(url, requests, extra_body=extra_body, ignore_eos=False))
    shares = cpu_time_shares(times)
    s = summarize(results, wall)
    return {"ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"], "ttft_mean_s": s["ttft_s"]["mean"],
            "itl_p99_s": s["itl_s"]["p99"], "tpot_p50_s": s["tpot_s"]["p50"], "e2e_p50_s": s["e2e_s"]["p50"], "wall_s": wall,
            "output_tok_s": s["output_token_throughput"], "completion_tokens": s["completion_tokens"],
            "errors": s["errors"], "error_messages": s["error_messages"],
            "ttft_breakdown_p50_s": (s.get("ttft_breakdown_s") or {}).get("p50"),
            "cpu_time_shares": shares,   # steal: the hypervisor's share; figures under it are slower
            "steal_ok": steal_ok(shares)}


def workload_parser(description: str, ctx: int) -> argparse.ArgumentParser:
    """The options every serving benchmark shares: model, the workload, threads and context."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=ctx)
    return ap


def itl_flags(itl_target_ms: float | None) -> list[str]:
    return [] if itl_target_ms is None else ["--itl-target-ms", str(itl_target_ms)]


def main() -> None:
    ap = workload_parser(__doc__.split("\n\n")[0], ctx=2048)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--itl-target-ms", type=float, default=None, help="localrun serve's --itl-target-ms "
                    "(default: the server's own default)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (default 0: greedy; "
                    "1.0 is what an OpenAI client that sets none gets); both servers then sample with their "
                    "default top-k, top-p and min-p")
    args = ap.parse_args()

    model_path = resolve_model(args.model)
    requests = workload(model_path, args.requests, args.prefix_tokens, args.output_tokens, args.temperature)
    rows = {}
    with localrun_server(str(model_path), "--threads", str(args.threads), "--ctx", str(args.ctx),
                         "--parallel", str(args.parallel), "--max-batched-tokens", str(args.max_batched_tokens),
                         "--no-disk-cache", *itl_flags(args.itl_target_ms)) as url:
        rows["localrun"] = measure(url, requests, exactly(args.output_tokens))
    if not args.skip_peer:
        with llama_cpp_server(str(model_path), n_threads=args.threads, n_ctx=args.ctx) as url:
            rows["llama_cpp"] = measure(url, requests, exactly(args.output_tokens))

    print(f"{'server':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8} {'tok/s':>7} {'wall':>6} errors")
    for name, r in rows.items():
        print(f"{name:<10} {r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>8.2f}s {r['itl_p99_s']:>7.2f}s "
              f"{r['output_tok_s']:>7.1f} {r['wall_s']:>5.1f}s {r['errors']}")
    out = {"cpu": cpu_info(), "scenario": {"requests": args.requests, "prefix_tokens": args.prefix_tokens,
                        "output_tokens": args.output_tokens, "threads": args.threads,
                        "parallel": args.parallel, "max_batched_tokens": args.max_batched_tokens,
                        "itl_target_ms": args.itl_target_ms, "temperature": args.temperature},
           **rows}
    if "llama_cpp" in rows:
        peer, ours = rows["llama_cpp"], rows["localrun"]
        out["ttft_p50_ratio"] = ours["ttft_p50_s"] / peer["ttft_p50_s"]
        out["ttft_p99_ratio"] = ours["ttft_p99_s"] / peer["ttft_p99_s"]
        out["throughput_ratio"] = ours["output_tok_s"] / peer["output_tok_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
