"""Prefix caching and continuous batching on the paged engine: time to first token with a
shared system prompt, TTFT over a growing chat, and decode throughput with many sequences.

Three measurements, one run, one loaded model (every configuration is its own LLMEngine on
`llm.model`, so they share the weights and nothing else):

1. Shared prefix: N requests (default 16) arrive together, each a shared system prompt
   (default 1024 tokens of real text) plus its own question (32 tokens), 32 output tokens
   each, greedy, ignore_eos. TTFT is measured from the common arrival time, so queueing counts.
   - baseline:  prefix caching off, max_num_seqs=1 (requests queue and run one at a time);
                its token budget is --baseline-batched-tokens (default 2048: each prompt in one
                forward, the baseline's best case).
   - optimized: prefix caching on, max_num_seqs=N, budget --max-batched-tokens (default 512).
   - reference row: optimized with the engine's default budget 2048, to show what the budget
     does (a larger budget admits the second request in the first step, before the first
     one's blocks are in the cache, so it recomputes the shared prefix).
   ttft_p50_reduction = 1 - p50(optimized) / p50(baseline); p99 likewise (numpy's linear
   percentile over N values, i.e. close to the max).
2. Chat: a T-turn conversation (default 10) through `llm.chat_prompt_ids` and `llm.generate`
   on one engine with prefix caching on; each turn appends the user message and the assistant
   reply (greedy, up to 32 tokens, stops at end of turn). The conversation is repeated
   (--chat-repeats) with the prefix cache reset in between; per-turn TTFT is the median over
   repeats. turn10_over_turn1 = TTFT(turn T) / TTFT(turn 1).
3. Throughput: S short prompts (default 16 distinct 32-token prompts) with 64 output tokens
   each, against one such prompt alone, on engines with max_num_seqs=S and 1.
   Definition: aggregate decode tokens/s = tokens sampled in decode-only steps (steps that
   computed no prompt token) / wall time of those steps (engine.step() calls, timed one by
   one). The prefill step and its first token are excluded on both sides. Best of --repeats.
   throughput_16_over_1 = aggregate(S) / aggregate(1).

Prints a table, then one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import CODE, CODE_2, FOREIGN, NUMBERS, NUMBERS_2, PROSE, PROSE_2  # noqa: E402
from localrun.cpu_info import cpu_info  # noqa: E402

# the system prompt: real, varied text, repeated as needed and cut to exactly --prefix-tokens
SYSTEM_TEXT = ("You are a careful assistant. Answer questions about the following reference "
               "material, quoting it where useful.\n\n" + PROSE + CODE + NUMBERS + PROSE_2 + CODE_2
               + NUMBERS_2 + FOREIGN)

QUESTIONS = [
    "What does the text say about how early computers were programmed before stored programs?",
    "Explain what the fibonacci function returns when it is called with n equal to ten.",
    "Which customers does the SQL query select, and how is the result ordered?",
    "Why does sourdough bread taste slightly sour, according to the passage?",
    "What was the world population in 2023 according to the numbers given?",
    "Translate the German sentence about the quick brown fox into English.",
    "By how much did revenue grow from 2021 to 2022 in the table?",
    "What does the JavaScript snippet print to the console, and why?",
    "How do compilers and operating systems fit into the story of abstraction?",
    "Which gas makes bread rise, and where does it come from?",
    "Compute 17 times 23 and check it against the value stated in the text.",
    "Name the capital of Japan as written in the Japanese sentence.",
    "What is the HAVING clause in the SQL query filtering on?",
    "Summarize the history of computing paragraph in a single short sentence.",
    "Which year in the table had the highest revenue, and what was it?",
    "What is the value of pi given in the text, to how many decimal places?",
]
PAD_TEXT = " Please answer briefly and precisely, and cite the relevant part of the reference text."

CHAT_TURNS = [
    "Hi! Can you tell me what a compiler does?",
    "How is that different from an interpreter?",
    "Give me an example of a language that uses each.",
    "What is just-in-time compilation?",
    "Why is JIT compilation often faster than interpretation?",
    "What are the downsides of a JIT compiler?",
    "How does garbage collection relate to this?",
    "What is reference counting?",
    "Can reference counting handle cycles?",
    "Thanks. Can you summarize our conversation in two sentences?",
]


def exact_tokens(llm, text: str, n: int, add_special: bool) -> list[int]:
    ids = llm.tokenize(text, add_special=add_special)
    while len(ids) < n:
        ids += llm.tokenize(text, add_special=False)
    return ids[:n]


def question_ids(llm, i: int, n: int) -> list[int]:
    q = f"\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}"
    ids = llm.tokenize(q, add_special=False)
    while len(ids) < n:
        ids += llm.tokenize(PAD_TEXT, add_special=False)
    return ids[:n]


def make_engine(llm, *, max_model_len, max_num_seqs, max_num_batched_tokens, enable_prefix_caching):
    from localrun.engine.llm_engine import LLMEngine
    return LLMEngine(llm.model, tokenizer_eog_ids=tuple(llm.tokenizer.eog_ids), max_model_len=max_model_len,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     enable_prefix_caching=enable_prefix_caching, clock=time.perf_counter)


def run_batch(engine, prompts: list[list[int]], max_tokens: int, tag: str):
    """Add every prompt with one common arrival time and step until all finish.
    Returns (per-request timings, per-step records, wall seconds)."""
    from localrun.sampling import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    sched = engine.scheduler.stats
    arrival = time.perf_counter()
    seqs = [engine.add_request(f"{tag}-{i}", ids, params, arrival_time=arrival) for i, ids in enumerate(prompts)]
    steps = []
    while engine.has_unfinished():
        prefill0, decode0 = sched.num_prefill_tokens, sched.num_decode_tokens
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        steps.append({"s": dt, "prefill_tokens": sched.num_prefill_tokens - prefill0,
                      "decode_tokens": sched.num_decode_tokens - decode0,
                      "sampled": sum(o.token_id is not None for o in outs)})
    wall = time.perf_counter() - arrival
    timings = [s.timings() for s in seqs]
    for t in timings:
        assert t["generated_tokens"] == max_tokens, t
    return timings, steps, wall


def warm_up(engine, llm) -> None:
    """One tiny request (first-call costs: allocator, kernels), then forget what it cached."""
    run_batch(engine, [llm.tokenize("Warm-up: the quick brown fox jumps over the lazy dog.")], 4, "warm")
    engine.reset_prefix_cache()


def pct(values, q) -> float:
    return float(np.percentile(values, q))


def shared_prefix(llm, args):
    system = exact_tokens(llm, SYSTEM_TEXT, args.prefix_tokens, add_special=True)
    prompts = [system + question_ids(llm, i, args.question_tokens) for i in range(args.requests)]
    max_len = args.prefix_tokens + args.question_tokens + args.output_tokens + 16
    configs = [
        ("baseline", dict(max_num_seqs=1, max_num_batched_tokens=args.baseline_batched_tokens,
                          enable_prefix_caching=False)),
        ("optimized", dict(max_num_seqs=args.requests, max_num_batched_tokens=args.max_batched_tokens,
                           enable_prefix_caching=True)),
    ]
    if args.max_batched_tokens != 2048 and not args.skip_budget_reference:
        configs.append(("optimized_b2048", dict(max_num_seqs=args.requests, max_num_batched_tokens=2048,
                                                enable_prefix_caching=True)))
    out = {}
    for name, cfg in configs:
        engine = make_engine(llm, max_model_len=max_len, **cfg)
        warm_up(engine, llm)
        timings, steps, wall = run_batch(engine, prompts, args.output_tokens, name)
        ttft = [t["ttft_s"] for t in timings]
        out[name] = {
            "config": cfg, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "ttft_min_s": min(ttft), "ttft_max_s": max(ttft), "wall_s": wall,
            "cached_tokens": sum(t["cached_tokens"] for t in timings),
            "prefill_tokens_computed": sum(s["prefill_tokens"] for s in steps),
            "steps": len(steps),
            "prefill_steps": [(s["prefill_tokens"], round(s["s"], 3)) for s in steps if s["prefill_tokens"]],
        }
        del engine
        print(f"  [{name}] p50 {out[name]['ttft_p50_s']:.2f}s, wall {wall:.1f}s", file=sys.stderr, flush=True)
    return out


def chat(llm, args):
    per_turn = []   # [repeat][turn] -> timings
    for rep in range(args.chat_repeats):
        llm.reset()
        messages = []
        turns = []
        for i in range(args.turns):
            messages.append({"role": "user", "content": CHAT_TURNS[i % len(CHAT_TURNS)]})
            ids = llm.chat_prompt_ids(messages)
            r = llm.generate(ids, max_tokens=args.turn_tokens, temperature=0)
            messages.append({"role": "assistant", "content": r.text})
            t = dict(r.timings)
            turns.append(t)
        per_turn.append(turns)
        print(f"  [chat {rep + 1}/{args.chat_repeats}] turn1 {turns[0]['ttft_s'] * 1e3:.0f} ms, "
              f"turn{args.turns} {turns[-1]['ttft_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    rows = []
    for i in range(args.turns):
        ts = [per_turn[r][i] for r in range(args.chat_repeats)]
        first = ts[0]
        rows.append({"turn": i + 1, "prompt_tokens": first["prompt_tokens"], "cached_tokens": first["cached_tokens"],
                     "generated_tokens": first["generated_tokens"],
                     "ttft_s": statistics.median(t["ttft_s"] for t in ts),
                     "ttft_all_s": [round(t["ttft_s"], 4) for t in ts]})
        assert all(t["cached_tokens"] == first["cached_tokens"] for t in ts), "repeats diverged"
    return rows


def throughput(llm, args):
    prompts = [question_ids(llm, i, args.tput_prompt_tokens) for i in range(args.tput_seqs)]
    max_len = args.tput_prompt_tokens + args.tput_tokens + 16
    out = {}
    for n in (1, args.tput_seqs):
        engine = make_engine(llm, max_model_len=max_len, max_num_seqs=n,
                             max_num_batched_tokens=max(512, n * args.tput_prompt_tokens),
                             enable_prefix_caching=True)
        warm_up(engine, llm)
        best = None
        for rep in range(args.repeats):
            engine.reset_prefix_cache()
            _, steps, wall = run_batch(engine, prompts[:n], args.tput_tokens, f"tput{n}-{rep}")
            dec = [s for s in steps if s["prefill_tokens"] == 0]
            assert all(s["decode_tokens"] == n for s in dec[:-1]), "decode steps not full"
            tokens, secs = sum(s["sampled"] for s in dec), sum(s["s"] for s in dec)
            res = {"decode_tok_s": tokens / secs, "decode_steps": len(dec), "decode_tokens": tokens,
                   "decode_s": secs, "step_ms": 1e3 * secs / len(dec),
                   "end_to_end_tok_s": n * args.tput_tokens / wall, "wall_s": wall}
            if best is None or res["decode_tok_s"] > best["decode_tok_s"]:
                best = res
        out[n] = best
        del engine
        print(f"  [throughput x{n}] {best['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="compute dtype (default: chosen for this CPU)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="optimized engine's token budget per step")
    ap.add_argument("--baseline-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-budget-reference", action="store_true", help="skip the optimized run with budget 2048")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--chat-repeats", type=int, default=3)
    ap.add_argument("--tput-seqs", type=int, default=16)
    ap.add_argument("--tput-prompt-tokens", type=int, default=32)
    ap.add_argument("--tput-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="throughput runs per configuration (best kept)")
    args = ap.parse_args()

    import torch

    from localrun import LLM
    from localrun.models import resolve_model

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    path = resolve_model(args.model)
    n_ctx = max(2048, args.prefix_tokens + args.question_tokens + args.output_tokens + 16)
    llm = LLM(path, n_ctx=n_ctx, n_threads=args.threads, dtype=args.dtype, n_parallel=1,
              enable_prefix_caching=True)
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"model {path.name}, {args.threads} threads, dtype {llm.dtype}, torch CPU capability {cap}, "
          f"torch {torch.__version__}, load average at start {load_start[0]:.2f}", file=sys.stderr, flush=True)

    sp = shared_prefix(llm, args)
    turns = chat(llm, args)
    tp = throughput(llm, args)
    load_end = os.getloadavg()
    total_s = time.perf_counter() - t_start

    base, opt = sp["baseline"], sp["optimized"]
    red50 = 1 - opt["ttft_p50_s"] / base["ttft_p50_s"]
    red99 = 1 - opt["ttft_p99_s"] / base["ttft_p99_s"]
    t1, tn = turns[0]["ttft_s"], turns[-1]["ttft_s"]
    ratio_turn = tn / t1
    ratio_tp = tp[args.tput_seqs]["decode_tok_s"] / tp[1]["decode_tok_s"]

    print(f"model {path.name}, {args.threads} threads, dtype {str(llm.dtype).replace('torch.', '')}, "
          f"kv {make_kv_name(llm)}, torch CPU capability {cap}, load average {load_start[0]:.2f} -> "
          f"{load_end[0]:.2f}, total {total_s:.0f} s")
    print()
    print(f"Shared prefix: {args.requests} requests x ({args.prefix_tokens} shared + {args.question_tokens} own "
          f"tokens), {args.output_tokens} output tokens, arriving together")
    print("| config          | seqs | budget | cache | TTFT p50 s | TTFT p99 s | TTFT min s | cached tok "
          "| prefill tok computed | wall s |")
    print("|-----------------|------|--------|-------|------------|------------|------------|------------"
          "|----------------------|--------|")
    for name, r in sp.items():
        c = r["config"]
        print(f"| {name:<15} | {c['max_num_seqs']:4d} | {c['max_num_batched_tokens']:6d} | "
              f"{'on' if c['enable_prefix_caching'] else 'off':<5} | {r['ttft_p50_s']:10.3f} | {r['ttft_p99_s']:10.3f} | "
              f"{r['ttft_min_s']:10.3f} | {r['cached_tokens']:10d} | {r['prefill_tokens_computed']:20d} | "
              f"{r['wall_s']:6.1f} |")
    print(f"TTFT p50 reduction {red50:.3f} (target >= 0.77), p99 reduction {red99:.3f}")
    for name in sp:
        if name != "baseline":
            print(f"  {name} prefill steps (tokens, s): {sp[name]['prefill_steps']}")
    if "optimized_b2048" in sp:
        print(f"  with budget 2048: p50 reduction {1 - sp['optimized_b2048']['ttft_p50_s'] / base['ttft_p50_s']:.3f}")
    print()
    print(f"Chat: {args.turns} turns, up to {args.turn_tokens} output tokens per turn, median of "
          f"{args.chat_repeats} conversations")
    print("| turn | prompt tok | cached tok | computed tok | generated | TTFT ms | TTFT ms (each run) |")
    print("|------|------------|------------|--------------|-----------|---------|--------------------|")
    for r in turns:
        each = ", ".join(f"{x * 1e3:.0f}" for x in r["ttft_all_s"])
        print(f"| {r['turn']:4d} | {r['prompt_tokens']:10d} | {r['cached_tokens']:10d} | "
              f"{r['prompt_tokens'] - r['cached_tokens']:12d} | {r['generated_tokens']:9d} | "
              f"{r['ttft_s'] * 1e3:7.1f} | {each:<18} |")
    print(f"TTFT turn {args.turns} / turn 1: {ratio_turn:.2f} (target <= 1.5)")
    print()
    print(f"Decode throughput: {args.tput_prompt_tokens}-token prompts, {args.tput_tokens} output tokens each, "
          f"best of {args.repeats}")
    print("| seqs | decode tok/s | ms / step | decode steps | end-to-end tok/s |")
    print("|------|--------------|-----------|--------------|------------------|")
    for n, r in tp.items():
        print(f"| {n:4d} | {r['decode_tok_s']:12.1f} | {r['step_ms']:9.1f} | {r['decode_steps']:12d} | "
              f"{r['end_to_end_tok_s']:16.1f} |")
    print(f"throughput {args.tput_seqs} / 1: {ratio_tp:.2f}x (target >= 4)")

    print(json.dumps({
        "cpu": cpu_info(), "benchmark": "prefix_cache", "model": path.name, "threads": args.threads,
        "dtype": str(llm.dtype).replace("torch.", ""), "kv_type": make_kv_name(llm),
        "cpu_capability": cap, "torch": torch.__version__,
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in load_end],
        "total_s": round(total_s, 1),
        "requests": args.requests, "prefix_tokens": args.prefix_tokens, "question_tokens": args.question_tokens,
        "output_tokens": args.output_tokens, "max_batched_tokens": args.max_batched_tokens,
        "baseline_batched_tokens": args.baseline_batched_tokens,
        "ttft_p50_baseline_s": round(base["ttft_p50_s"], 4), "ttft_p50_optimized_s": round(opt["ttft_p50_s"], 4),
        "ttft_p99_baseline_s": round(base["ttft_p99_s"], 4), "ttft_p99_optimized_s": round(opt["ttft_p99_s"], 4),
        "ttft_p50_reduction": round(red50, 4), "ttft_p99_reduction": round(red99, 4),
        **({"ttft_p50_reduction_budget2048": round(1 - sp["optimized_b2048"]["ttft_p50_s"] / base["ttft_p50_s"], 4)}
           if "optimized_b2048" in sp else {}),
        "turns": args.turns, "turn_tokens": args.turn_tokens, "chat_repeats": args.chat_repeats,
        "turn_ttft_ms": [round(r["ttft_s"] * 1e3, 1) for r in turns],
        "turn_prompt_tokens": [r["prompt_tokens"] for r in turns],
        "turn_cached_tokens": [r["cached_tokens"] for r in turns],
        "turn10_over_turn1": round(ratio_turn, 4),
        "tput_seqs": args.tput_seqs, "tput_tokens": args.tput_tokens,
        "decode_tok_s_1": round(tp[1]["decode_tok_s"], 1),
        "decode_tok_s_n": round(tp[args.tput_seqs]["decode_tok_s"], 1),
        "throughput_16_over_1": round(ratio_tp, 4),
    }))


def make_kv_name(llm) -> str:
    return llm.kv_type


if __name__ == "__main__":
    main()
