"""The disk KV cache under load that never pauses: N distinct prompts (default 48 x 512 tokens,
32 output tokens each, greedy) all queued at once against an engine with 16 sequences, so the
engine is busy from the first step to the last. Three runs, same work, same process:
  off        no disk cache;
  idle-only  the disk cache as before: the writer waits for an idle engine (none comes), so
             blocks past the queue's 256 are dropped;
  window     the engine opens a write window between its steps (a tenth of the step, or the
             slack below --itl-target-ms; disk_cache.py).
Reports wall time, tokens/s, blocks written while busy and dropped, and the time given to the
windows, then one JSON object as the last line (ratios: each run's wall time over `off`'s)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batched_decode import prompts  # noqa: E402


def run(llm, path, work, mode: str, args) -> dict:
    from localrun.engine.disk_cache import DiskCacheConfig, model_fingerprint
    from localrun.engine.llm_engine import LLMEngine
    from localrun.sampling import SamplingParams
    with tempfile.TemporaryDirectory() as tmp:
        config = DiskCacheConfig(tmp, model_fingerprint(path, llm.file.header.data_offset)) if mode != "off" else None
        engine = LLMEngine(llm.model, max_model_len=args.prompt_tokens + args.output_tokens + 16, max_num_seqs=16,
                           max_num_batched_tokens=512, disk_cache=config)
        if args.itl_target_ms:
            engine.set_itl_target(args.itl_target_ms / 1000)
        if mode == "idle-only":
            engine.disk_cache.write_window = lambda seconds: 0
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        for i, p in enumerate(work):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - start
        stats = engine.stats()
        if engine.disk_cache is not None:
            engine.disk_cache.files.close()
    return {"mode": mode, "wall_s": round(wall, 2), "tok_s": round(len(work) * args.output_tokens / wall, 1),
            "written_while_busy": stats.get("disk_cache_written_blocks", 0),
            "drops": stats.get("disk_cache_write_drops", 0), "window_s": round(stats.get("disk_cache_window_s", 0.0), 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--itl-target-ms", type=float, default=0.0)
    args = ap.parse_args()

    import torch

    from localrun import LLM
    from localrun.cpu_info import cpu_info
    from localrun.models import resolve_model

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    llm = LLM(path, n_ctx=args.prompt_tokens + args.output_tokens + 16, n_threads=args.threads)
    work = prompts(llm, args.requests, args.prompt_tokens)
    rows = [run(llm, path, work, mode, args) for mode in ("off", "idle-only", "window")]
    print("| run | wall (s) | tok/s | blocks written while busy | dropped | window time (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_s']} | {r['tok_s']} | {r['written_while_busy']} | {r['drops']} | {r['window_s']} |")
    base = rows[0]["wall_s"]
    print(json.dumps({"benchmark": "disk_cache_load", "cpu": cpu_info(), "model": path.name, "threads": args.threads,
                      "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                      "itl_target_ms": args.itl_target_ms, "runs": rows,
                      "wall_over_off": {r["mode"]: round(r["wall_s"] / base, 3) for r in rows}}))


if __name__ == "__main__":
    main()
