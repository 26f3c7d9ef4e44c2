"""Time to first token of a long prompt in a fresh process, without and with the disk KV cache.

Each measurement is a new Python process that loads the model and runs one request: a prompt
of --prompt-tokens tokens (default 1500, real text cut to that many tokens), greedy, 16 output
tokens. TTFT is the request's own `timings["ttft_s"]` (arrival to first token; model loading
is not in it).
  - cold:        disk cache off (what every restart costs today);
  - cold_write:  disk cache on, empty directory (the run that fills it: writes must not slow it);
  - warm:        disk cache on, filled by cold_write (a restart with the cache).
Runs alternate (cold, cold_write on a fresh directory, warm) --repeats times; each figure is
the best of its repeats. warm_over_cold = warm_ttft_s / cold_ttft_s (target: <= 0.25).
identical_output says whether all runs produced the same tokens.

Prints a table, then one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus import CODE, CODE_2, FOREIGN, NUMBERS, NUMBERS_2, PROSE, PROSE_2  # noqa: E402
from localrun.cpu_info import cpu_info  # noqa: E402

TEXT = ("You are a careful assistant. Answer questions about the following reference material, "
        "quoting it where useful.\n\n" + PROSE + CODE + NUMBERS + PROSE_2 + CODE_2 + NUMBERS_2 + FOREIGN)


def child(args) -> None:
    """One fresh process: load, run the prompt once, print a JSON line."""
    from localrun.api import LLM
    llm = LLM(args.model, n_threads=args.threads, disk_cache=args.cache_dir is not None,
              cache_dir=args.cache_dir)
    ids = []
    while len(ids) < args.prompt_tokens:
        ids += llm.tokenize(TEXT, add_special=not ids)
    ids = ids[:args.prompt_tokens]
    result = llm.generate(ids, max_tokens=16, temperature=0, ignore_eos=True)
    llm.close()                                   # the writes finish after the request, not in it
    t = result.timings
    print(json.dumps({"ttft_s": t["ttft_s"], "cached_tokens": t["cached_tokens"],
                      "cached_tokens_disk": t["cached_tokens_disk"], "ids": result.token_ids,
                      "load_s": llm.load_s, "disk_load_s": llm.engine.stats().get("disk_cache_load_s", 0.0)}))


def run_child(args, cache_dir: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--prompt-tokens", str(args.prompt_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        sys.exit(f"child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path or catalog name (default: smollm2-135m)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    runs: dict[str, list[dict]] = {"cold": [], "cold_write": [], "warm": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="localrun-warm-restart-") as cache_dir:
            runs["cold"].append(run_child(args, None))
            runs["cold_write"].append(run_child(args, cache_dir))
            runs["warm"].append(run_child(args, cache_dir))
    best = {name: min(r["ttft_s"] for r in rs) for name, rs in runs.items()}
    outputs = {tuple(r["ids"]) for rs in runs.values() for r in rs}
    warm = min(runs["warm"], key=lambda r: r["ttft_s"])
    result = {
        "cpu": cpu_info(),
        "prompt_tokens": args.prompt_tokens,
        "cold_ttft_s": round(best["cold"], 4),
        "cold_write_ttft_s": round(best["cold_write"], 4),
        "warm_ttft_s": round(best["warm"], 4),
        "warm_over_cold": round(best["warm"] / best["cold"], 4),
        "write_over_cold": round(best["cold_write"] / best["cold"], 4),
        "warm_cached_tokens_disk": warm["cached_tokens_disk"],
        "warm_disk_load_s": round(warm["disk_load_s"], 4),
        "identical_output": len(outputs) == 1,
        "repeats": args.repeats,
    }
    print(f"{'run':<12}{'best ttft (s)':>14}{'all runs (s)':>30}")
    for name, rs in runs.items():
        all_runs = ", ".join(f"{r['ttft_s']:.3f}" for r in rs)
        print(f"{name:<12}{best[name]:>14.3f}{all_runs:>30}")
    print(f"warm/cold {result['warm_over_cold']:.3f} (target <= 0.25); warm took "
          f"{warm['cached_tokens_disk']} of {args.prompt_tokens} prompt tokens from disk, loading them in "
          f"{warm['disk_load_s'] * 1000:.0f} ms; identical output: {result['identical_output']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
