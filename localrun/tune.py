"""`localrun tune`: a short measured sweep on this machine, and the model's default profile.

For each GPU-layer count (only 0 without a GPU), each thread count and each prefill chunk
size, it times a prompt's prefill and a few decode steps on the model itself (the reference
`SequenceRunner`, no scheduler), next to what layerplan predicts for that placement. The
best settings (decode speed first, then prefill) are stored as the model's profile under
$LOCALRUN_HOME/profiles/, and `load_profile(model_path)` gives them back to chat and serve
as their defaults.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from localrun.models import localrun_home

PROFILE_VERSION = 1


@dataclass(frozen=True)
class TuneRow:
    n_gpu_layers: int
    n_threads: int
    chunk: int                       # prompt tokens per prefill forward (the engine's max_num_batched_tokens)
    prefill_tok_s: float
    decode_tok_s: float
    predicted_prefill_tok_s: float | None
    predicted_decode_tok_s: float | None


def profile_path(model_path: str | Path) -> Path:
    """Where a model's profile lives: keyed by its file name and size (a re-downloaded or
    re-quantized file with another size gets its own profile)."""
    p = Path(model_path)
    return localrun_home() / "profiles" / f"{p.stem}-{p.stat().st_size}.json"


def load_profile(model_path: str | Path) -> dict:
    """The tuned defaults for this model ({} if `localrun tune` never ran or the file is unreadable):
    keys n_threads, n_gpu_layers, max_num_batched_tokens (LLM's keyword names)."""
    try:
        data = json.loads(profile_path(model_path).read_text())
    except (OSError, ValueError):
        return {}
    if data.get("version") != PROFILE_VERSION:
        return {}
    return dict(data.get("settings", {}))


def save_profile(model_path: str | Path, best: TuneRow, rows: list[TuneRow], machine: str) -> Path:
    path = profile_path(model_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {"n_threads": best.n_threads, "n_gpu_layers": best.n_gpu_layers, "max_num_batched_tokens": best.chunk}
    path.write_text(json.dumps({"version": PROFILE_VERSION, "model": str(model_path), "machine": machine,
                                "settings": settings, "rows": [asdict(r) for r in rows]}, indent=1))
    return path


def best_row(rows: list[TuneRow]) -> TuneRow:
    """Fastest decode; among settings within 3% of it (timing noise), the fastest prefill."""
    top = max(r.decode_tok_s for r in rows)
    return max((r for r in rows if r.decode_tok_s >= 0.97 * top), key=lambda r: r.prefill_tok_s)


def predicted(model_path, n_gpu_layers: int, n_ctx: int, prompt_tokens: int) -> tuple[float | None, float | None]:
    """layerplan's (prefill, decode) tok/s for this placement, with this machine's calibration
    (`localrun plan MODEL --measure` calibrates it with the engine's own layers)."""
    try:
        import layerplan
        from layerplan import calibrate
        from localrun.calibrate_engine import engine_profile
        local = layerplan.build_machine()
        machine = layerplan.build_machine(calibration=calibrate.load(local, model=model_path))
        plan = layerplan.plan(engine_profile(model_path), machine, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers,
                              prompt_tokens=prompt_tokens, with_sweep=False)
        return plan.predicted.prefill_tok_s, plan.predicted.decode_tok_s
    except (ValueError, OSError):
        return None, None


def sweep(model_path, *, threads: list[int], chunks: list[int], gpu_layers: list[int], prompt_tokens: int = 256,
          gen_tokens: int = 16, on_step: Callable[[str], None] = lambda _: None) -> Iterator[TuneRow]:
    """Measure every (gpu layers, threads, chunk); yields rows as they are measured. Decode is
    timed once per (gpu layers, threads): the chunk size does not touch it."""
    import torch

    from localrun.api import LLM
    n_ctx = prompt_tokens + gen_tokens + 8
    for n_gpu_layers in gpu_layers:
        on_step(f"loading with {n_gpu_layers} GPU layers")
        llm = LLM(model_path, n_ctx=n_ctx, n_threads=max(threads), n_gpu_layers=n_gpu_layers)
        ids = (llm.tokenize("The history of the city is long. " * (prompt_tokens // 4)))[:prompt_tokens]
        pred_prefill, pred_decode = predicted(model_path, n_gpu_layers, n_ctx, prompt_tokens)
        runner = llm.runner
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            runner.cached_ids = []
            runner.prefill(ids[:32], chunk=32)                      # warm-up
            on_step(f"decode, {n_threads} threads")
            decode = _decode_tok_s(runner, ids[:32], gen_tokens)
            for chunk in chunks:
                on_step(f"prefill, {n_threads} threads, chunk {chunk}")
                runner.cached_ids = []
                t0 = time.perf_counter()
                runner.prefill(ids, chunk=chunk)
                prefill = len(ids) / (time.perf_counter() - t0)
                yield TuneRow(n_gpu_layers, n_threads, chunk, prefill, decode, pred_prefill, pred_decode)
        del llm, runner


def _decode_tok_s(runner, prompt: list[int], n: int) -> float:
    runner.cached_ids = []
    logits = runner.prefill(prompt)
    token, position = int(logits.argmax()), len(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        token = int(runner.forward([token], position)[-1].argmax())
        position += 1
    return n / (time.perf_counter() - t0)


def apply_profile(model, n_threads: int | None, options: dict) -> tuple[int | None, dict, bool]:
    """Fill in what the user left unset from the model's tuned profile: threads when not given,
    GPU layers when left at 'auto', and the step token budget when no flag set it.
    Returns (n_threads, options, whether a profile was used)."""
    from localrun.models import resolve_model
    profile = load_profile(resolve_model(model))
    if not profile:
        return n_threads, options, False
    options = dict(options)
    if n_threads is None and profile.get("n_threads"):
        n_threads = profile["n_threads"]
    if options.get("n_gpu_layers", "auto") == "auto" and profile.get("n_gpu_layers") is not None:
        options["n_gpu_layers"] = profile["n_gpu_layers"]
    if options.get("max_num_batched_tokens") is None and profile.get("max_num_batched_tokens"):
        options["max_num_batched_tokens"] = profile["max_num_batched_tokens"]
    options = {k: v for k, v in options.items() if v is not None or k != "max_num_batched_tokens"}
    return n_threads, options, True
