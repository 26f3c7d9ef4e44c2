"""Admission and order policies on the seed's workload, in the engine (no HTTP): does reserving
KV blocks at admission replace preemptions with queueing, and what does it do to TTFT?

The workload of benchmarks/seed_ablation.py, step 3: N requests (default 16) arrive together,
each a chat with one shared 1024-token system prompt and its own question, 32 greedy output
tokens each; a 64 MiB KV budget, chunked prefill in 512-token steps, --parallel N. Each row is
a fresh engine over the same loaded model (cold prefix cache), differing only in:
  greedy:        admit whatever fits now (no output reserve, no watermark), FCFS;
  reserve:       the engine's default admission (prompt + 64 output tokens, 1% watermark), FCFS;
  reserve16:     the same with 16 output tokens reserved;
  +cache:        the cache-aware order (longest cached prefix first, age bound) instead of FCFS;
  +itlN:         --itl-target-ms N: steps with decodes sized from measured step times.

Prints a table, then one JSON object as the last line: each row's TTFT p50/p99, ITL p99, wall
time, output throughput, preemptions and deferred admissions, and how many of its outputs
equal the request run alone (greedy; a batch's float sums differ from a lone request's in the
last bits, so a near-tie may flip on a real model whatever the policy).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_vs_llamacpp import workload  # noqa: E402

from layerplan.units import parse_bytes  # noqa: E402
from localrun.api import LLM  # noqa: E402
from localrun.cpu_info import cpu_info  # noqa: E402
from localrun.engine.llm_engine import LLMEngine  # noqa: E402
from localrun.models import resolve_model  # noqa: E402
from localrun.sampling import SamplingParams  # noqa: E402

GREEDY = {"output_reserve_tokens": 0, "watermark": 0.0}
ROWS = {"greedy": {**GREEDY, "policy": "fcfs"},
        "greedy+cache": {**GREEDY, "policy": "cache_aware"},
        "reserve": {"policy": "fcfs"},
        "reserve+cache": {"policy": "cache_aware"},
        "reserve16": {"output_reserve_tokens": 16, "policy": "fcfs"},
        "reserve16+cache": {"output_reserve_tokens": 16, "policy": "cache_aware"},
        "reserve+itl50": {"policy": "fcfs", "itl_target_s": 0.050},
        "reserve+itl100": {"policy": "fcfs", "itl_target_s": 0.100}}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run(llm, prompts: list[list[int]], output_tokens: int, args, options: dict) -> tuple[dict, list]:
    options = dict(options)
    itl_target_s = options.pop("itl_target_s", None)
    engine = LLMEngine(llm.model, tokenizer_eog_ids=tuple(llm.tokenizer.eog_ids), max_model_len=args.ctx,
                       kv_type=llm.kv_type, max_num_seqs=len(prompts), clock=time.perf_counter,
                       max_num_batched_tokens=args.chunk_tokens, kv_budget_bytes=parse_bytes(args.kv_budget),
                       **options)
    engine.set_itl_target(itl_target_s)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.add_request(f"r{i}", p, params, arrival_time=start) for i, p in enumerate(prompts)]
    token_times: dict[str, list[float]] = {s.request_id: [] for s in seqs}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.token_id is not None:
                token_times[out.seq.request_id].append(now)
    wall = time.perf_counter() - start
    ttft = [s.timeline.first_token - start for s in seqs]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    stats = engine.stats()
    row = {"ttft_p50_s": statistics.median(ttft), "ttft_p99_s": percentile(ttft, 0.99),
           "itl_p99_s": percentile(itl, 0.99), "wall_s": wall,
           "output_tok_s": sum(s.num_generated_tokens for s in seqs) / wall,
           "preemptions": stats["num_preemptions"], "admissions_deferred": stats["num_admissions_deferred"],
           "num_blocks": stats["num_blocks_total"], "itl_target_misses": stats["itl_target_misses"],
           "itl_planned_steps": stats["itl_planned_steps"]}
    return row, [s.generated_token_ids for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1280)
    ap.add_argument("--kv-budget", default="64MiB")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    args = ap.parse_args()

    model_path = resolve_model(args.model)
    llm = LLM(str(model_path), n_ctx=args.ctx, n_threads=args.threads)
    prompts = [llm.chat_prompt_ids(list(r.messages)) for r in workload(model_path, args.requests,
                                                                       args.prefix_tokens, args.output_tokens)]
    run(llm, prompts[:1], 2, args, ROWS["greedy"])     # warm-up: first-call costs stay out of the rows
    solo = [run(llm, [p], args.output_tokens, args, ROWS["greedy"])[1][0] for p in prompts]
    rows = {}
    for name in args.rows.split(","):
        row, outputs = run(llm, prompts, args.output_tokens, args, ROWS[name])
        row["outputs_equal_solo"] = sum(a == b for a, b in zip(outputs, solo))
        rows[name] = row
        print(f"  {name}: {row}", file=sys.stderr)
    print("\n| admission | TTFT p50 (s) | TTFT p99 (s) | ITL p99 (ms) | wall (s) | tok/s | preemptions | deferred "
          "| outputs = solo |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['itl_p99_s'] * 1000:.0f} | "
              f"{r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['preemptions']} | {r['admissions_deferred']} | "
              f"{r['outputs_equal_solo']}/{len(prompts)} |")
    print(json.dumps({"cpu": cpu_info(), "rows": rows,
                      "scenario": {"requests": args.requests, "prefix_tokens": args.prefix_tokens,
                                   "output_tokens": args.output_tokens, "threads": args.threads, "ctx": args.ctx,
                                   "kv_budget": args.kv_budget, "chunk_tokens": args.chunk_tokens}}))


if __name__ == "__main__":
    main()
