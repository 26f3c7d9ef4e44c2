"""Calibrate layerplan's speed model with localrun's engine itself (torch side of `--measure`).

layerplan's micro-benchmarks time matrix-vector products; the engine's real per-layer work is
more: fused matmuls through localrun's in-place kernels, norms, RoPE, attention over the cache,
and the Python around ~240 calls per token. So this builds the model of a GGUF file the way the
engine builds it (`localrun.LLM`: weights held as the engine holds them, the paged KV cache, the
scheduler) and times, at two depths of the same stack (its first n1 layers, then all of them,
each with the output head), the prefill of a SHORT_FILL-token prompt and the decode steps after
it; then the whole stack's decode after a LONG_FILL-token prompt. A straight line through the two
depths gives the cost of one layer (the slope) and of everything per step that is not a layer
(the intercept: embedding, output head, sampling, Python); the two fills give what one cached
token costs a layer's attention. With the host's measured bandwidth and matmul overhead these
become layerplan's per-layer fixed cost, per-step overhead, prefill throughput and the
bandwidth attention reads the KV cache at.
"""
from __future__ import annotations

import time
from dataclasses import replace

FUSED_MATMULS_PER_LAYER = 4   # localrun's llama block: wqkv, wo, w13 (gate|up), w2
SHORT_FILL, LONG_FILL = 256, 2048   # cache fills of the two decode timings of the whole stack
PREFILL_TOKENS = 256
DECODE_STEPS = 24
KV_BYTES_PER_VALUE = 2        # the engine's default KV pool for a float32 model: f16


def _time_engine(path, n_layers: int | None, prompt_tokens: int, threads: int | None) -> tuple[float, float]:
    """(seconds per decode step, seconds of the prompt's prefill) of the engine running the
    model's first n_layers layers (None: all) on one sequence of prompt_tokens."""
    import localrun
    from localrun.engine.draft_model import self_draft

    llm = localrun.LLM(path, n_ctx=prompt_tokens + DECODE_STEPS + 8, n_parallel=1, n_threads=threads)
    if n_layers is not None and n_layers < llm.config.n_layers:
        llm.model = self_draft(llm.model, n_layers)   # before the engine is built from it
    n_vocab = llm.config.n_vocab
    llm.generate([[(5 * i + 3) % n_vocab for i in range(32)]], max_tokens=4, ignore_eos=True)   # warm-up
    ids = [(7 * i + 11) % n_vocab for i in range(prompt_tokens)]
    timings = llm.generate([ids], max_tokens=DECODE_STEPS, ignore_eos=True)[0].timings
    return 1.0 / timings["decode_tok_s"], timings["prefill_s"]


def fit_engine(depths: tuple[int, int], decode_s: tuple[float, float], prefill_s: tuple[float, float],
               fills: tuple[int, int], full_decode_s: tuple[float, float]) -> dict:
    """Per-layer and per-step seconds from the two depths (decode and prefill: slope and
    intercept), and the seconds one cached token costs a layer's decode attention from the
    whole stack's decode at two cache fills."""
    (n1, n2), (d1, d2), (p1, p2), (f1, f2), (a1, a2) = depths, decode_s, prefill_s, fills, full_decode_s
    layer_decode = max(0.0, (d2 - d1) / (n2 - n1))
    layer_prefill = max(0.0, (p2 - p1) / (n2 - n1))
    return {"decode_layer_s": layer_decode, "decode_step_s": max(0.0, d1 - n1 * layer_decode),
            "prefill_layer_s": layer_prefill, "prefill_step_s": max(0.0, p1 - n1 * layer_prefill),
            "cached_token_layer_s": max(0.0, (a2 - a1) / (n2 * (f2 - f1)))}


def measure_engine(path, calibration, threads: int | None = None):
    """`calibration` (layerplan.calibrate.Calibration of this host) with the engine's own figures
    for the model at `path`: per-layer fixed cost, per-step overhead and prefill throughput."""
    import layerplan

    n_layers = layerplan.profile_gguf(path).n_layers
    depths = (max(1, n_layers // 3), n_layers)
    short = [_time_engine(path, n, SHORT_FILL, threads) for n in depths]   # decode with SHORT_FILL cached
    long_decode, _ = _time_engine(path, None, LONG_FILL, threads)
    fit = fit_engine(depths, (short[0][0], short[1][0]),
                     tuple(p * PREFILL_TOKENS / SHORT_FILL for _, p in short),   # per PREFILL_TOKENS tokens
                     (SHORT_FILL, LONG_FILL), (short[1][0], long_decode))

    profile = layerplan.profile_gguf(path)
    layer = max(profile.layers, key=lambda l: l.weight_bytes)
    kv_token = layer.n_kv_head * (layer.head_dim_k + layer.head_dim_v) * KV_BYTES_PER_VALUE
    stream_s = layer.weight_bytes / calibration.host_bandwidth
    matmul_s = FUSED_MATMULS_PER_LAYER * calibration.host_matmul_overhead_s
    layer_flops = 2 * PREFILL_TOKENS * layer.params
    return replace(
        calibration,
        # the slope holds the layer's weights, its matmul calls and its attention over SHORT_FILL tokens:
        # layerplan models those three on their own, so the fixed cost is what is left
        host_layer_overhead_s=max(0.0, fit["decode_layer_s"] - stream_s - matmul_s
                                  - SHORT_FILL * fit["cached_token_layer_s"]),
        host_flops=layer_flops / fit["prefill_layer_s"] if fit["prefill_layer_s"] else calibration.host_flops,
        host_kv_bandwidth=kv_token / fit["cached_token_layer_s"] if fit["cached_token_layer_s"] else None,
        host_step_overhead_s=max(0.0, fit["decode_step_s"] - profile.head_bytes / calibration.host_bandwidth
                                 - calibration.host_matmul_overhead_s),  # the head is modelled on its own
        engine_model=f"{profile.name}: {n_layers} layers of {layer.weight_bytes:,} bytes, depths {depths[0]} and "
                     f"{depths[1]}; decode {fit['decode_layer_s'] * 1e3:.3f} ms/layer + {fit['decode_step_s'] * 1e3:.2f} ms, "
                     f"prefill {fit['prefill_layer_s'] * 1e3:.2f} ms/layer per {PREFILL_TOKENS} tokens, attention "
                     f"{fit['cached_token_layer_s'] * 1e9:.1f} ns per cached token and layer",
        backend="engine",
    )
