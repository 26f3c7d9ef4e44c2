"""Two versions of the compiled kernels side by side: engine decode steps of the same model and
workload, each version in its own processes (torch cannot load two libraries of the same ops),
the processes alternating A, B, A, B, ... so that a drift of the host lands on both.

A and B are git revisions of localrun/kernels/csrc (--a, default HEAD) or "." for the working
tree (--b, default); each is built once (localrun/kernels/build.py, keyed by its sources) and
loaded through LOCALRUN_KERNEL_LIBRARY. --isa-a / --isa-b run a side with LOCALRUN_ISA set
(e.g. --a . --isa-a avx2 --isa-b avxvnni: one build, two instruction sets). Everything else
(the model code, the engine) is the working tree's, so only the kernels differ. Per round and
version, one process builds the model for max(--sizes) sequences and, for each size S,
prefills S prompts of --context tokens (benchmarks/batched_decode.py's workload: timed too,
each prompt to its first token) and times --steps decode steps: median step, ms.

On these 2-core VMs one run of either version moves by 10-30% between processes; a change
under that size shows only as the medians over several rounds (--rounds), which this prints
with each side's spread, the ratio b / a per size (below 1: B is faster), and the CPU steal
over the whole run. Prints a table, then one JSON object as the last line."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))


def sources(rev: str, into: Path) -> Path:
    """The kernels' sources at git revision rev ("." : the working tree's)."""
    from localrun.kernels.build import CSRC
    if rev == ".":
        return CSRC
    archive = into / f"{rev.replace('/', '_')}.tar"
    with open(archive, "wb") as f:
        done = subprocess.run(["git", "archive", rev, "localrun/kernels/csrc"], cwd=ROOT, stdout=f, stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise SystemExit(f"kernel_ab: git archive {rev} failed: {done.stderr.decode().strip()}")
    out = into / rev.replace("/", "_")
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out / "localrun" / "kernels" / "csrc"


def child(args) -> None:
    """One process: median decode step (ms) per size, as one JSON line."""
    import time

    import torch

    from batched_decode import prompts, start
    from localrun import LLM
    from localrun.engine.llm_engine import LLMEngine
    from synthetic_model import resolve as resolve_model   # catalog names, paths, synthetic-*
    from localrun.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(resolve_model(args.model), n_ctx=args.context + args.steps + 64, n_threads=args.threads,
              n_parallel=max(sizes))
    work = prompts(llm, max(sizes), args.context, args.shared_prefix)
    result = {}
    for s in sizes:
        engine = LLMEngine(llm.model, max_model_len=args.context + args.steps + 64, max_num_seqs=s,
                           max_num_batched_tokens=2048, enable_prefix_caching=args.shared_prefix > 0)
        params = SamplingParams(max_tokens=args.steps + 32, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        start(engine, work[:s], params, args.shared_prefix)
        result[f"prefill_{s}"] = (time.perf_counter() - t0) * 1e3
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        result[f"step_{s}"] = statistics.median(times) * 1e3
    print(json.dumps(result))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="HEAD", help="git revision of the kernels' sources, or . for the working tree")
    ap.add_argument("--b", default=".", help="the other version (default: the working tree)")
    ap.add_argument("--model", default="smollm2-135m",
                    help="a catalog name, a .gguf path, or synthetic-1b-q4_k_m (benchmarks/synthetic_model.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sizes", default="1,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="the first N tokens of --context are the same in every prompt, cached once")
    ap.add_argument("--isa-a", default=None, help="LOCALRUN_ISA for side a (default: as the environment sets it)")
    ap.add_argument("--isa-b", default=None, help="LOCALRUN_ISA for side b")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 0 <= args.shared_prefix < args.context:
        ap.error(f"--shared-prefix must be at least 0 and below --context ({args.context}), got {args.shared_prefix}")
    if args.child:
        return child(args)
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")

    from localrun.cpu_info import cpu_info
    from localrun.kernels.build import BuildError, build

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {}
        for side, rev in (("a", args.a), ("b", args.b)):
            try:
                libraries[side] = build(quiet=False, csrc=sources(rev, Path(tmp)))
            except BuildError as e:
                raise SystemExit(f"kernel_ab: the kernels at {rev} did not compile: {e}")
    runs = {"a": [], "b": []}
    forward = ["--model", args.model, "--threads", str(args.threads), "--context", str(args.context),
               "--steps", str(args.steps), "--sizes", args.sizes, "--shared-prefix", str(args.shared_prefix)]
    for r in range(args.rounds):
        for side in ("a", "b"):
            env = {**os.environ, "LOCALRUN_KERNEL_LIBRARY": str(libraries[side])}
            isa = getattr(args, f"isa_{side}")
            if isa:
                env["LOCALRUN_ISA"] = isa
            done = subprocess.run([sys.executable, __file__, *forward, "--child", side], env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"kernel_ab: the {side} run failed: {done.stderr.strip()[-800:]}")
            times = json.loads(done.stdout.strip().splitlines()[-1])
            runs[side].append(times)
            print(f"round {r + 1} {side}: " + ", ".join(f"{s} seq {times[f'step_{s}']:.1f} ms" for s in sizes),
                  file=sys.stderr)

    label = {side: rev + (f" (LOCALRUN_ISA={isa})" if isa else "")
             for side, rev, isa in (("a", args.a, args.isa_a), ("b", args.b, args.isa_b))}
    print(f"kernels a = {label['a']}, b = {label['b']}; {args.model}, {args.threads} threads, context {args.context} "
          f"(shared prefix {args.shared_prefix}), "
          f"median of {args.steps} decode steps per process, {args.rounds} alternated rounds")
    result = {"benchmark": "kernel_ab", "cpu": cpu_info(), "a": args.a, "b": args.b, "isa_a": args.isa_a,
              "isa_b": args.isa_b, "model": args.model, "threads": args.threads, "context": args.context,
              "shared_prefix": args.shared_prefix, "steps": args.steps, "rounds": args.rounds}
    for what, key, out in (("median decode step", "step", "step_ms"), ("prefill, every prompt to its first token",
                                                                        "prefill", "prefill_ms")):
        print(f"| sequences | a: {what} (ms) | a: range | b: {what} (ms) | b: range | b / a |")
        print("|---|---|---|---|---|---|")
        for s in sizes:
            a = [run[f"{key}_{s}"] for run in runs["a"]]
            b = [run[f"{key}_{s}"] for run in runs["b"]]
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"| {s} | {ma:.1f} | {min(a):.1f}-{max(a):.1f} | {mb:.1f} | {min(b):.1f}-{max(b):.1f} | {mb / ma:.3f} |")
            result[f"{out}_a_{s}"], result[f"{out}_b_{s}"] = round(ma, 2), round(mb, 2)
            result[f"{key}_b_over_a_{s}" if key == "prefill" else f"b_over_a_{s}"] = round(mb / ma, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
