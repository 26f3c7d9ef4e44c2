"""Prefill and decode speed: localrun vs llama.cpp (llama-cpp-python), same model, same
threads, same run. Runs alternate between the two engines; the best of N is kept for each.
Greedy by default (argmax on both sides); --sampled draws every token through each engine's own
sampler at llama.cpp's default chain (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8), as
`localrun chat` and llama.cpp's own generate loop do, so the sampler's cost per token counts.
Prints a table, then one JSON object as the last line."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import CORPUS  # noqa: E402
from localrun.cpu_info import cpu_info  # noqa: E402


def prompt_ids(llm, n: int) -> list[int]:
    ids = llm.tokenize(CORPUS)
    while len(ids) < n:
        ids += llm.tokenize(CORPUS, add_special=False)
    return ids[:n]


def last_logits(ref) -> np.ndarray:
    """llama.cpp's logits of the last evaluated token (without logits_all only that row exists)."""
    return np.ctypeslib.as_array(ref._ctx.get_logits(), shape=(ref.n_vocab(),))


def bench_llama_cpp(ref, ids: list[int], n_gen: int) -> tuple[float, float]:
    ref.reset()
    t0 = time.perf_counter()
    ref.eval(ids)
    prefill_s = time.perf_counter() - t0
    token = int(np.argmax(last_logits(ref)))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        ref.eval([token])
        token = int(np.argmax(last_logits(ref)))
    decode_s = time.perf_counter() - t0
    return len(ids) / prefill_s, n_gen / decode_s


SAMPLED = {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}   # llama.cpp's defaults
TEMPERATURE = 0.8


def bench_llama_cpp_sampled(ref, ids: list[int], n_gen: int) -> tuple[float, float]:
    """llama-cpp-python's generate loop: its sampler chain built once, then per token an
    evaluation of the last token and a draw (the first draw comes with the prompt)."""
    ref.reset()
    t0 = time.perf_counter()
    tokens = ref.generate(ids, temp=TEMPERATURE, reset=True, **SAMPLED)
    next(tokens)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_gen):
        next(tokens)
    decode_s = time.perf_counter() - t0
    return len(ids) / prefill_s, n_gen / decode_s


def bench_localrun(llm, ids: list[int], n_gen: int, sampled: bool = False) -> tuple[float, float]:
    llm.reset()
    options = {"temperature": TEMPERATURE, "seed": 0, **SAMPLED} if sampled else {"temperature": 0}
    r = llm.generate(ids, max_tokens=n_gen + 1, ignore_eos=True, **options)
    t = r.timings
    assert t["cached_tokens"] == 0 and t["generated_tokens"] == n_gen + 1
    return t["prefill_tok_s"], t["decode_tok_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m",
                    help="a catalog name, a .gguf path, or synthetic-1b-q4_k_m (benchmarks/synthetic_model.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="localrun compute dtype (default: chosen for this CPU)")
    ap.add_argument("--kv-type", default=None, help="localrun's KV type (default: the engine's)")
    ap.add_argument("--prompt-math", default="int8", help="localrun's prompt math: int8 (default) or float32")
    ap.add_argument("--sampled", action="store_true", help="sample at llama.cpp's default chain instead of argmax")
    ap.add_argument("--parallel", type=int, default=1,
                    help="sequences localrun's engine is built for (default 1: `localrun chat`'s engine, one "
                         "stream as llama.cpp's context here; an engine built for more picks the layouts that "
                         "pay off in batches, docs/measurements.md)")
    ap.add_argument("--llamacpp-repack", choices=("on", "off"), default="on",
                    help="llama.cpp's load-time repack of Q4_0/IQ4_NL/Q4_K weights into 8-row interleaved "
                         "copies (its CPU_REPACK buffer, on by default); off: it reads the file's blocks in "
                         "place, as localrun does")
    args = ap.parse_args()

    import llama_cpp
    import llama_cpp.llama_cpp as llama_lib
    import torch

    from localrun import LLM
    from synthetic_model import resolve as resolve_model   # catalog names, paths, synthetic-*

    path = resolve_model(args.model)
    llm = LLM(path, n_ctx=args.prompt_tokens + args.gen_tokens + 8, n_threads=args.threads, dtype=args.dtype,
              kv_type=args.kv_type, prompt_math=args.prompt_math, n_parallel=args.parallel)
    defaults = llama_lib.llama_model_default_params
    if args.llamacpp_repack == "off":      # Llama() takes its model parameters from this function
        def no_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params
        llama_lib.llama_model_default_params = no_repack
    try:
        ref = llama_cpp.Llama(str(path), n_ctx=args.prompt_tokens + args.gen_tokens + 8, n_batch=512,
                              n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    finally:
        llama_lib.llama_model_default_params = defaults
    ids = prompt_ids(llm, args.prompt_tokens)
    bench_localrun(llm, ids[:64], 4)              # warm-up both
    bench_llama_cpp(ref, ids[:64], 4)
    runs = {"localrun": [], "llama.cpp": []}
    reference = bench_llama_cpp_sampled if args.sampled else bench_llama_cpp
    for _ in range(args.repeats):
        runs["llama.cpp"].append(reference(ref, ids, args.gen_tokens))
        runs["localrun"].append(bench_localrun(llm, ids, args.gen_tokens, args.sampled))
    best = {k: (max(r[0] for r in v), max(r[1] for r in v)) for k, v in runs.items()}
    ratio_prefill = best["localrun"][0] / best["llama.cpp"][0]
    ratio_decode = best["localrun"][1] / best["llama.cpp"][1]

    print(f"model {path.name}, {args.threads} threads, prompt {args.prompt_tokens} tokens, "
          f"decode {args.gen_tokens} tokens, best of {args.repeats}, localrun dtype {llm.dtype}, "
          f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| engine    | prefill tok/s | decode tok/s |")
    print("|-----------|---------------|--------------|")
    for k, (p, d) in best.items():
        print(f"| {k:<9} | {p:13.1f} | {d:12.1f} |")
    print(f"| ratio     | {ratio_prefill:12.2f}x | {ratio_decode:11.2f}x |")
    print(json.dumps({
        "cpu": cpu_info(), "benchmark": "speed_vs_llamacpp", "model": path.name, "threads": args.threads,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
        "sampling": f"top-k 40, top-p 0.95, min-p 0.05, temperature {TEMPERATURE}" if args.sampled else "greedy",
        "localrun_dtype": str(llm.dtype).replace("torch.", ""), "localrun_kv_type": llm.engine.kv_type,
        "localrun_prompt_math": args.prompt_math, "localrun_parallel": args.parallel,
        "llamacpp_repack": args.llamacpp_repack,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "localrun_prefill_tok_s": round(best["localrun"][0], 1),
        "llamacpp_prefill_tok_s": round(best["llama.cpp"][0], 1),
        "localrun_decode_tok_s": round(best["localrun"][1], 1),
        "llamacpp_decode_tok_s": round(best["llama.cpp"][1], 1),
        "prefill_ratio": round(ratio_prefill, 3), "decode_ratio": round(ratio_decode, 3),
    }))


if __name__ == "__main__":
    main()
