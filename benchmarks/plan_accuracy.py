"""How well layerplan predicts the localrun engine: resident memory and decode speed.

For SmolLM2-135M (Q4_1) on this CPU, at two context sizes: the planner's prediction (the
profile re-expressed as the engine stores it, the host calibrated with `--measure`'s
micro-benchmarks in the engine's compute dtype, saved as `--measure` saves them) against a
fresh engine process. Memory:
RSS after loading and generating minus RSS before loading, with freed heap returned to the
OS (malloc_trim), against the plan's weights + KV cache + host I/O buffers. Decode: the
engine's own decode_tok_s against the predicted decode speed at the same cache fill.

Targets (issue 3): memory within 10%, decode within 30%. Prints a table, then one JSON
object as the last line.

    .venv/bin/python benchmarks/plan_accuracy.py [--ctx 512 4096] [--tokens 64]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

from localrun.cpu_info import cpu_info

MODEL = "smollm2-135m"
PROMPT = ("The history of the city begins with a small settlement on an island in the river, where "
          "fishermen and traders built their houses and a wall to keep them safe.")
FUSED_MATMULS_PER_LAYER = 4  # localrun's llama block: wqkv, wo, w13 (gate|up), w2


def _rss_bytes(trim: bool) -> int:
    import psutil

    gc.collect()
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
    return psutil.Process().memory_info().rss


def worker(path: str, n_ctx: int, max_tokens: int) -> dict:
    """Load the engine, generate, and report its memory and speed (runs in its own process)."""
    import resource

    import localrun

    import torch  # noqa: F401  (part of the baseline, not of the model)
    before = _rss_bytes(trim=True)
    llm = localrun.LLM(path, n_ctx=n_ctx)
    timings = llm.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True).timings
    prompt_tokens = timings["prompt_tokens"]
    after_raw = _rss_bytes(trim=False)
    after = _rss_bytes(trim=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"n_ctx": n_ctx, "resident_bytes": after - before, "resident_untrimmed_bytes": after_raw - before,
            "peak_bytes": peak - before, "decode_tok_s": timings["decode_tok_s"],
            "prefill_tok_s": timings["prefill_tok_s"], "prompt_tokens": prompt_tokens,
            "generated_tokens": timings["generated_tokens"], "dtype": str(llm.dtype).removeprefix("torch."),
            "threads": llm.n_threads}


def _run_worker(path: Path, n_ctx: int, max_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(path), "--ctx", str(n_ctx), "--tokens", str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker for n_ctx={n_ctx} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predict(path: Path, measured: dict, calibration) -> dict:
    import layerplan
    from layerplan.calibrate import apply
    from layerplan.probe import probe_host
    from layerplan.weight_format import as_weight_dtype

    profile = as_weight_dtype(layerplan.profile_gguf(path), measured["dtype"], FUSED_MATMULS_PER_LAYER)
    machine = apply(layerplan.Machine(gpus=(), host=probe_host()), calibration)
    plan = layerplan.plan(profile, machine, n_ctx=measured["n_ctx"], kv_type=measured["dtype"], n_gpu_layers=0,
                          margin_bytes=0, prompt_tokens=measured["prompt_tokens"], with_sweep=False)
    host = plan.usage[-1]
    fill = measured["prompt_tokens"] + measured["generated_tokens"] // 2
    speed = layerplan.predict(profile, machine, plan.placement, plan.settings,
                              prompt_tokens=measured["prompt_tokens"], decode_context=fill)
    return {"resident_bytes": host.weights_bytes + host.kv_bytes,
            "peak_bytes": host.total_bytes, "weights_bytes": host.weights_bytes, "kv_bytes": host.kv_bytes,
            "buffer_bytes": host.buffer_bytes, "decode_tok_s": speed.decode_tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ctx", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--tokens", type=int, default=64, help="tokens to generate per run")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.ctx[0], args.tokens)))
        return

    from layerplan import calibrate
    from layerplan.probe import probe_host
    import layerplan
    from localrun.api import default_dtype, default_threads
    from localrun.models import pull

    path = pull(MODEL, quiet=True)
    dtype = str(default_dtype()).removeprefix("torch.")
    local = layerplan.Machine(gpus=(), host=probe_host())
    started = time.perf_counter()
    calibration = calibrate.measure(local, dtype=dtype, threads=default_threads())
    calibrate.save(calibration)
    measure_s = time.perf_counter() - started

    rows = []
    for n_ctx in args.ctx:
        measured = _run_worker(path, n_ctx, args.tokens)
        predicted = predict(path, measured, calibration)
        rows.append({"n_ctx": n_ctx, "measured": measured, "predicted": predicted,
                     "memory_ratio": predicted["resident_bytes"] / measured["resident_bytes"],
                     "decode_ratio": predicted["decode_tok_s"] / measured["decode_tok_s"]
                     if measured["decode_tok_s"] else None})

    mib = 1 << 20
    print(f"layerplan vs the localrun engine: {MODEL}, {rows[0]['measured']['dtype']} weights and KV, "
          f"{rows[0]['measured']['threads']} threads; host measured in {calibration.dtype} via "
          f"{calibration.backend} ({measure_s:.0f} s): {calibration.host_bandwidth / 1e9:.1f} GB/s, "
          f"{calibration.host_matmul_overhead_s * 1e6:.0f} us per matvec call, {calibration.host_flops / 1e9:.1f} GFLOP/s, "
          f"{(calibration.host_layer_overhead_s or 0) * 1e3:.2f} ms per layer besides matmuls "
          f"(attention call {(calibration.host_attention_call_s or 0) * 1e3:.2f} ms)")
    print(f"{'n_ctx':>6} {'resident MiB':>13} {'predicted':>10} {'ratio':>6}   {'decode tok/s':>12} {'predicted':>10} {'ratio':>6}")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        decode_ratio = f"{r['decode_ratio']:.2f}" if r["decode_ratio"] else "-"
        print(f"{r['n_ctx']:>6} {m['resident_bytes'] / mib:>13.1f} {p['resident_bytes'] / mib:>10.1f} "
              f"{r['memory_ratio']:>6.2f}   {m['decode_tok_s']:>12.2f} {p['decode_tok_s']:>10.2f} {decode_ratio:>6}")
    memory_ok = all(abs(r["memory_ratio"] - 1) <= 0.10 for r in rows)
    decode_ok = all(r["decode_ratio"] and abs(r["decode_ratio"] - 1) <= 0.30 for r in rows)
    print(json.dumps({
        "cpu": cpu_info(),
        "model": MODEL, "dtype": rows[0]["measured"]["dtype"], "threads": rows[0]["measured"]["threads"],
        "calibration": {"dtype": calibration.dtype, "backend": calibration.backend,
                        "host_bandwidth_gb_s": round(calibration.host_bandwidth / 1e9, 2),
                        "matvec_overhead_us": round(calibration.host_matmul_overhead_s * 1e6, 1),
                        "host_gflops": round(calibration.host_flops / 1e9, 1),
                        "layer_overhead_ms": round((calibration.host_layer_overhead_s or 0) * 1e3, 3),
                        "attention_call_ms": round((calibration.host_attention_call_s or 0) * 1e3, 3)},
        "runs": [{"n_ctx": r["n_ctx"],
                  "resident_mib": round(r["measured"]["resident_bytes"] / mib, 1),
                  "predicted_resident_mib": round(r["predicted"]["resident_bytes"] / mib, 1),
                  "memory_ratio": round(r["memory_ratio"], 3),
                  "peak_mib": round(r["measured"]["peak_bytes"] / mib, 1),
                  "predicted_peak_mib": round(r["predicted"]["peak_bytes"] / mib, 1),
                  "decode_tok_s": round(r["measured"]["decode_tok_s"], 2),
                  "predicted_decode_tok_s": round(r["predicted"]["decode_tok_s"], 2),
                  "decode_ratio": round(r["decode_ratio"], 3) if r["decode_ratio"] else None} for r in rows],
        "memory_within_10pct": memory_ok, "decode_within_30pct": decode_ok,
    }))


if __name__ == "__main__":
    main()
