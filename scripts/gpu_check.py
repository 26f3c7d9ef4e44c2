"""One prepared check for a machine with an NVIDIA GPU (a few minutes): layerplan's predictions
against what the engine does, with 0, half and all layers on the GPU.

For each model (synthetic llamas of random Q4_0 blocks, written here with gguf.GGUFWriter, by
default 32 layers of 2048 and 24 of 4096; --model adds a GGUF file or catalog model found
locally), and each GPU layer count (0, half, all + the output head, as llama.cpp's -ngl), a fresh
process loads the engine, prefills a prompt and decodes, and reports:
- GPU memory: the device's used memory (NVML) after the run minus before the process touched
  CUDA (so its CUDA context is counted, as the ledger counts it), against the ledger's bytes for
  the GPU (layerplan.ledger.engine_ledger of the plan the engine ran); torch's reserved and peak
  allocated bytes beside it;
- host memory: RSS after the run minus RSS once torch, CUDA and the kernels were set up, against
  the ledger's bytes for the host (the tokenizer, host layers' weights as the engine holds them,
  their KV pool);
- prefill and decode tok/s (the engine's own timings of one request) against the plan's
  prediction for the same placement, prompt and context, as benchmarks/plan_accuracy.py times
  them (the engine's steps; random token ids, so no tokenizer is needed). The host has no `--measure`
  calibration there and the GPU none at all: the speed predictions are the uncalibrated model's.
Prints a table, then one JSON object as the last line.

    python scripts/gpu_check.py [--synthetic 32x2048,24x4096] [--model smollm2-135m] [--prompt-tokens 512]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))     # synthetic_model: the random llamas
sys.path.insert(0, str(ROOT))
WORKER_TIMEOUT_S = 300
GIB = 2 ** 30


def write_synthetic_q4_0(path: Path, n_layers: int, n_embd: int, n_vocab: int = 320) -> Path:
    """A llama GGUF of random Q4_0 blocks (benchmarks/synthetic_model.py), heads of 128, a KV head per 4."""
    from synthetic_model import Shape, write_llama

    n_head = n_embd // 128
    return write_llama(path, Shape(n_layers=n_layers, n_embd=n_embd, n_ff=(n_embd * 8 // 3 + 255) // 256 * 256,
                                   n_head=n_head, n_head_kv=max(1, n_head // 4), n_vocab=n_vocab, mix="q4_0"))


def _gpu_used_bytes() -> int:
    """Device 0's used memory, by NVML (no CUDA context needed)."""
    import pynvml
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def predicted(path, n_gpu_layers: int, n_ctx: int, prompt_tokens: int, gen_tokens: int, kv_type: str,
              machine=None) -> dict:
    """The plan the engine ran (as placement.plan_device_map asks for it), its ledger per device
    and its speed for this request, on `machine` (None: this one, probed)."""
    import layerplan
    from layerplan.ledger import EngineOptions, engine_ledger
    from localrun.calibrate_engine import engine_profile
    from localrun.engine_config import EngineConfig

    profile = engine_profile(path)
    machine = machine or layerplan.probe_machine()
    plan = layerplan.plan(profile, machine, n_ctx=n_ctx, n_parallel=1, kv_type=kv_type, n_gpu_layers=n_gpu_layers,
                          prompt_tokens=prompt_tokens, with_sweep=False, n_ubatch=EngineConfig().max_num_batched_tokens,
                          runtime="localrun")
    ledger = engine_ledger(plan, EngineOptions(dtype_bytes=4, kv_type=kv_type))
    speed = layerplan.predict(profile, machine, plan.placement, plan.settings, prompt_tokens=prompt_tokens,
                              decode_context=prompt_tokens + gen_tokens // 2, prompts_together=1)
    gpu = next(i for i, d in enumerate(plan.machine.devices) if d.kind == "gpu")
    host = next(i for i, d in enumerate(plan.machine.devices) if d.kind != "gpu")

    def resident(device: int) -> int:   # what is held once a request ran (the head's buffer is not: see ledger)
        return sum(i.n_bytes for i in ledger.items if i.device == device and i.what != "compute buffers")
    return {"gpu_bytes": ledger.device_bytes(gpu), "host_bytes": resident(host),
            "gpu_items": {i.what: i.n_bytes for i in ledger.items if i.device == gpu},
            "prefill_tok_s": speed.prefill_tok_s, "decode_tok_s": speed.decode_tok_s}


def _engine(llm):
    """The LLM's engine, built without the tokenizer (llama-cpp-python may be missing on a GPU
    machine): the token ids are made here, and generation runs to max_tokens."""
    from localrun.engine.llm_engine import LLMEngine
    if llm._engine is None:
        llm._engine = LLMEngine(llm.model, llm.engine_config, tokenizer_eog_ids=(), clock=time.perf_counter)
    return llm._engine


def worker(path: str, label: str, n_gpu_layers: int, prompt_tokens: int, gen_tokens: int) -> dict:
    """One placement in this fresh process (so the GPU and host memory it reports are its own)."""
    gpu_before = _gpu_used_bytes()
    import torch

    from localrun import LLM, kernels
    from localrun.calibrate_engine import decode_step_seconds, prefill_seconds, timed_steps
    from localrun.executor import release_free_memory
    from localrun.sampling_params import SamplingParams
    kernels.available()
    torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")   # context, cuBLAS, allocator
    torch.cuda.synchronize()
    rng = np.random.default_rng(0)
    warm = LLM(path, n_ctx=64, n_gpu_layers=0)           # the runtime's one-time costs (modules imported on
    timed_steps(_engine(warm), [[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))   # first use, op
    del warm                                             # set-up) are not the model's
    release_free_memory()
    rss_before = _rss()
    t0 = time.perf_counter()
    llm = LLM(path, n_ctx=prompt_tokens + gen_tokens + 16, n_gpu_layers=n_gpu_layers, n_parallel=1)
    load_s = time.perf_counter() - t0
    n_vocab = llm.model.config.n_vocab
    engine = _engine(llm)
    params = SamplingParams(max_tokens=gen_tokens + 1, ignore_eos=True, seed=0)
    timed_steps(engine, [rng.integers(4, n_vocab, 16).tolist()], params)                    # warm-up
    ids = rng.integers(4, n_vocab, prompt_tokens).tolist()                                 # no shared prefix
    torch.cuda.synchronize()
    steps, _ = timed_steps(engine, [ids], params)
    torch.cuda.synchronize()
    gpu_used = _gpu_used_bytes() - gpu_before
    host_used = _rss() - rss_before
    n_prompt, prefill_s = prefill_seconds(steps)
    prefill_tok_s, decode_tok_s = n_prompt / prefill_s, 1.0 / decode_step_seconds(steps, 1)
    kv_type = llm.kv_type
    pred = predicted(path, n_gpu_layers, llm.n_ctx, len(ids), gen_tokens, kv_type)
    return {"model": label, "n_gpu_layers": n_gpu_layers, "plan": llm.plan_summary, "threads": llm.n_threads,
            "kv_type": kv_type, "load_s": round(load_s, 1), "prompt_tokens": len(ids),
            "gpu_gib": round(gpu_used / GIB, 3), "predicted_gpu_gib": round(pred["gpu_bytes"] / GIB, 3),
            "gpu_ratio": round(gpu_used / pred["gpu_bytes"], 3) if pred["gpu_bytes"] else None,
            "torch_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
            "torch_peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
            "host_gib": round(host_used / GIB, 3), "predicted_host_gib": round(pred["host_bytes"] / GIB, 3),
            "host_ratio": round(host_used / pred["host_bytes"], 3) if pred["host_bytes"] else None,
            "prefill_tok_s": round(prefill_tok_s, 1), "predicted_prefill_tok_s": round(pred["prefill_tok_s"], 1),
            "prefill_ratio": round(prefill_tok_s / pred["prefill_tok_s"], 3),
            "decode_tok_s": round(decode_tok_s, 1), "predicted_decode_tok_s": round(pred["decode_tok_s"], 1),
            "decode_ratio": round(decode_tok_s / pred["decode_tok_s"], 3),
            "predicted_gpu_items_mib": {k: round(v / 2**20, 1) for k, v in pred["gpu_items"].items()},
            "weights": type(llm.model.layers[-1].attention.wqkv).__name__}


def run_worker(path, label: str, n_gpu_layers: int, prompt_tokens: int, gen_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(path), label, str(n_gpu_layers), str(prompt_tokens),
           str(gen_tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"model": label, "n_gpu_layers": n_gpu_layers, "error": f"took over {WORKER_TIMEOUT_S} s"}
    if proc.returncode != 0:
        return {"model": label, "n_gpu_layers": n_gpu_layers, "error": proc.stderr.strip()[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        path, label, n, prompt, gen = sys.argv[2:7]
        print(json.dumps(worker(path, label, int(n), int(prompt), int(gen))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", default="32x2048,24x4096", help="LAYERSxWIDTH,... ('' for none)")
    ap.add_argument("--model", default=None, help="a GGUF file, or a catalog model already downloaded")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU here (torch.cuda.is_available() is False); this check needs one", file=sys.stderr)
        print(json.dumps({"benchmark": "gpu_check", "error": "no CUDA GPU"}))
        sys.exit(1)
    import layerplan
    from localrun.cpu_info import cpu_info
    from localrun.model.quant import int4_backend
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, int4 kernel on cuda: "
          f"{int4_backend('cuda') is not None}; CPU {cpu_info()['model']}", flush=True)
    print(f"layerplan sees: {[getattr(d, 'name', d) for d in layerplan.probe_machine().devices]}", flush=True)
    rows = []

    def placements(path, label: str, n_layers: int) -> None:
        for n in (0, n_layers // 2, n_layers + 1):
            rows.append(run_worker(path, label, n, args.prompt_tokens, args.gen_tokens))
            print(json.dumps(rows[-1]), flush=True)

    if args.model:
        from localrun.models import resolve_model
        path = resolve_model(args.model, pull_missing=False)     # nothing can be fetched on a GPU machine
        placements(path, path.name, layerplan.profile_gguf(path).n_layers)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in filter(None, args.synthetic.split(",")):
            n_layers, width = (int(v) for v in spec.split("x"))
            t0 = time.perf_counter()
            path = write_synthetic_q4_0(Path(tmp) / f"synthetic-{spec}.gguf", n_layers, width)
            print(f"wrote {path.stat().st_size / GIB:.2f} GiB synthetic {spec} in {time.perf_counter() - t0:.0f}s",
                  flush=True)
            placements(path, f"synthetic {spec} Q4_0", n_layers)
            os.unlink(path)

    cols = ["model", "n_gpu_layers", "gpu_gib", "predicted_gpu_gib", "gpu_ratio", "host_gib", "predicted_host_gib",
            "host_ratio", "prefill_tok_s", "predicted_prefill_tok_s", "prefill_ratio", "decode_tok_s",
            "predicted_decode_tok_s", "decode_ratio", "weights"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "error" if c == "gpu_gib" and "error" in r else "")) for c in cols) + " |")
    print(json.dumps({"benchmark": "gpu_check", "gpu": torch.cuda.get_device_name(), "cpu": cpu_info(),
                      "rows": rows}))


if __name__ == "__main__":
    main()
