"""torch.compile of the decode step, against the step as it runs (eager): does compiling help on
top of the fused kernels (one localrun::decode_block call a layer)?

Per size S (sequences, each with a --context-token prompt, benchmarks/batched_decode.py's
workload), one engine, one process, and two measurements, each alternating call by call (a host
whose speed moves lands on both sides):
- forward_<backend>: engine steps with the model's forward as it is and compiled by
  torch.compile(dynamic=True) with that backend ("eager": TorchDynamo's graph run as it is, which
  takes the Python out of the forward; "eager-unguarded": the same with none of its guards checked
  before each call, unsafe, the least a compiled forward can cost; "inductor": torch's default
  compiler). Median step, ms.
- layers_inductor: the 30 blocks and the head of one decode step, the same tensors each call,
  eager against inductor. torch 2.13's inductor fails on the forward itself ("auto_functionalized
  was not removed": a complex64 argument, the rotary table, to an op that writes the KV pool), so
  here each block goes through a small Python op that takes the table as float32 pairs; both sides
  call that op, so the ratio is inductor's alone.
A ratio below 1 means compiled is faster. Prints a table, then one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batched_decode import prompts, started_engine  # noqa: E402


def alternate(a, b, calls: int) -> tuple[float, float]:
    """Median seconds of a() and of b(), called in turn `calls` times each."""
    ta, tb = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        a()
        ta.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b()
        tb.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def compiled_forward(model, engine, backend: str, calls: int) -> dict:
    """Engine steps with model.forward as it is against compiled (the first compiled step,
    which compiles, is timed apart)."""
    import torch
    plain = model.forward
    name, unguarded = backend.removesuffix("-unguarded"), backend.endswith("-unguarded")
    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe} if unguarded else None
    torch._dynamo.reset()                                    # compile afresh (dynamo caches by code object)
    compiled = torch.compile(plain, dynamic=True, backend=name, options=options)
    try:
        t0 = time.perf_counter()
        model.forward = compiled
        engine.step()
        compile_s = time.perf_counter() - t0

        def with_plain():
            model.forward = plain
            engine.step()

        def with_compiled():
            model.forward = compiled
            engine.step()
        eager, comp = alternate(with_plain, with_compiled, calls)
    except Exception as e:                                   # report what torch says, go on
        return {"error": _first_line(e)}
    finally:
        model.forward = plain
    return {"compile_s": round(compile_s, 1), "eager_ms": round(eager * 1e3, 3), "compiled_ms": round(comp * 1e3, 3),
            "ratio": round(comp / eager, 3)}


def _first_line(e: Exception) -> str:
    """What an exception says, in its first line."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


_BLOCKS: list = []        # the blocks the op below runs, by index


def _define_block_op():
    """bench::block(x, i, freqs as float32 pairs, pools, rows' metadata): block i's decode_block."""
    import torch
    lib = torch.library.Library("compile_decode_bench", "DEF")
    lib.define("block(Tensor x, int i, Tensor freqs, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
               "Tensor tables, Tensor row_seq, Tensor row_len, int block_size) -> Tensor")

    def block(x, i, freqs, k_pool, v_pool, slots, tables, row_seq, row_len, block_size):
        from localrun.model.llama import PagedRows
        paged = PagedRows(x.shape[0], slots, tables, row_seq, row_len, block_size, lambda layer: (k_pool, v_pool))
        return _BLOCKS[i](x, torch.view_as_complex(freqs), paged)          # FusedDecode's own call
    lib.impl("block", block, "CPU")
    torch.library.register_fake("compile_decode_bench::block")(lambda x, *rest: torch.empty_like(x))
    return lib


def compiled_layers(model, engine, calls: int) -> dict:
    """One decode step's blocks and head, eager against inductor, on the step's own tensors."""
    import torch
    seen = {}
    plain = model.forward

    def record(*args, **kwargs):
        seen.update(kwargs, tokens=args[0], positions=args[1])
        return plain(*args, **kwargs)
    model.forward = record
    try:
        engine.step()
    finally:
        model.forward = plain
    paged = seen["paged"]
    if paged is None or any(layer.fused_decode is None or layer.fused_decode.window for layer in model.layers):
        return {"error": "this model's decode step does not run one fused call per block"}
    _BLOCKS[:] = [layer.fused_decode for layer in model.layers]
    pools = [paged.pools(i) for i in range(len(_BLOCKS))]
    x = model.tok_embeddings.rows(seen["tokens"]).float()
    freqs = torch.view_as_real(model.rope_tables[0, seen["positions"]].contiguous())
    head, norm = model.output, model.norm

    def layers(x, freqs, slots, tables, row_seq, row_len):
        for i, (k_pool, v_pool) in enumerate(pools):
            x = torch.ops.compile_decode_bench.block(x, i, freqs, k_pool, v_pool, slots, tables, row_seq, row_len,
                                                     paged.block_size)
        return torch.ops.localrun.qmatmul(torch.ops.localrun.rms_norm(x, norm.weight, norm.eps), head.parts,
                                          head.kernel_types)
    inputs = (x, freqs, paged.slots, paged.block_tables, paged.row_seq, paged.row_len)
    with torch.inference_mode():
        compiled = torch.compile(layers, dynamic=True, fullgraph=True)
        try:
            t0 = time.perf_counter()
            out = compiled(*inputs)
            compile_s = time.perf_counter() - t0
        except Exception as e:
            return {"error": _first_line(e)}
        same = torch.equal(out, layers(*inputs))
        eager, comp = alternate(lambda: layers(*inputs), lambda: compiled(*inputs), calls)
    return {"compile_s": round(compile_s, 1), "same_bits": same, "eager_ms": round(eager * 1e3, 3),
            "compiled_ms": round(comp * 1e3, 3), "ratio": round(comp / eager, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,16")
    ap.add_argument("--calls", type=int, default=40, help="alternations per measurement")
    ap.add_argument("--backends", default="eager,eager-unguarded,inductor",
                    help="torch.compile backends for the whole forward; NAME-unguarded: with every guard skipped "
                         "(torch.compiler.skip_all_guards_unsafe), the least a compiled call can cost")
    args = ap.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes takes sequence counts separated by commas, got {args.sizes!r}")
    if min(sizes) < 1 or args.calls < 1:
        ap.error("--sizes and --calls must be at least 1")

    import torch

    from localrun import LLM, kernels
    from localrun.cpu_info import cpu_info
    from localrun.models import resolve_model
    if not kernels.available():
        raise SystemExit("compile_decode: the compiled kernels are unavailable; there is no fused step to compile")
    from localrun.kernels import meta
    meta.register()                                          # the ops' output shapes, for the tracer
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    steps = args.calls * 2 * (len(args.backends.split(",")) + 1) + 16
    llm = LLM(path, n_ctx=args.context + steps + 600, n_threads=args.threads, n_parallel=max(sizes))
    work = prompts(llm, max(sizes), args.context)
    lib = _define_block_op()                                 # noqa: F841 (the op lives as long as lib)
    result = {"benchmark": "compile_decode", "model": path.name, "threads": args.threads, "context": args.context,
              "calls": args.calls, "torch": torch.__version__}
    print(f"model {path.name}, {args.threads} threads, context {args.context}, torch {torch.__version__}, "
          f"medians of {args.calls} alternated calls")
    print("| sequences | what | eager ms | compiled ms | compiled / eager | compile s |")
    print("|---|---|---|---|---|---|")
    for s in sizes:
        engine, _ = started_engine(llm, work[:s], steps)
        for _ in range(3):
            engine.step()
        runs = {f"forward_{b}": compiled_forward(llm.model, engine, b, args.calls) for b in args.backends.split(",")}
        runs["layers_inductor"] = compiled_layers(llm.model, engine, args.calls)
        for what, r in runs.items():
            if "error" in r:
                print(f"| {s} | {what} | failed: {r['error']} | | | |")
            else:
                print(f"| {s} | {what} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['ratio']:.3f} | "
                      f"{r['compile_s']} |")
            result[f"{what}_{s}"] = r
        del engine
        torch._dynamo.reset()
    result["cpu"] = cpu_info()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
