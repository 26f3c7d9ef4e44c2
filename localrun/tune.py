"""`localrun tune`: a short measured sweep on this machine, and the model's default profile.

For each GPU-layer count (only 0 without a GPU), each thread count and each prefill chunk
size, it runs a prompt and a few decode steps through the engine that chat and serve run
(`LLMEngine`, the chunk as its step token budget), next to what layerplan predicts for that
setting with this machine's calibration of the model's engine (`localrun plan MODEL --measure`).
A calibration is taken at one thread count, so only the rows of that count get a prediction.
The best settings (decode speed first, then prefill) are stored as the model's profile under
$LOCALRUN_HOME/profiles/, and `load_profile(model_path)` gives them back to chat and serve
as their defaults.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from localrun.models import localrun_home

PROFILE_VERSION = 1
ROUNDS = 3              # runs of the prompt per setting, the median counting
HOST_CHECK_CTX = 64     # positions Forecast.check_host's engine needs (calibrate_engine.SHORT_FILL + its steps)


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


def sweep_context(prompt_tokens: int, gen_tokens: int) -> int:
    """The context a sweep's engines are built for: the prompt, its decode steps and a few spare."""
    return prompt_tokens + gen_tokens + 8


class Forecast:
    """layerplan's (prefill, decode) tok/s for one sequence of this machine's calibrated engine,
    per GPU-layer count and chunk; None where there is no calibration of this machine, or the
    thread count is not the one it was taken at (its figures are that many threads' speed)."""

    def __init__(self, model_path, prompt_tokens: int, gen_tokens: int):
        self.n_ctx, self.prompt_tokens, self.gen_tokens = sweep_context(prompt_tokens, gen_tokens), prompt_tokens, gen_tokens
        self.host_speed: float | None = None     # check_host's figure
        try:
            import layerplan
            from layerplan import calibrate
            from localrun.calibrate_engine import engine_profile
            from localrun.engine_build import engine_build
            local = layerplan.build_machine()
            self.calibration = calibrate.load(local, model=model_path, engine_build=engine_build())
            self.machine = layerplan.build_machine(calibration=self.calibration)
            self.profile = engine_profile(model_path)
        except (ValueError, OSError):
            self.calibration = None

    @property
    def threads(self) -> int | None:
        """The thread count the calibration was taken at (None: no calibration here)."""
        if self.calibration is None:
            return None
        return self.calibration.threads or None

    def check_host(self, model) -> None:
        """Time the calibration's first timing again (one sequence's decode step after SHORT_FILL
        prompt tokens) on `model`, at the calibration's thread count (the caller's torch threads):
        `host_speed` is then the calibration's step over today's (below 1: this machine runs
        slower now than when it was calibrated, and the predictions are high by about that)."""
        self.host_speed = None
        reference = self.calibration.engine_reference_s if self.calibration is not None else None
        if not reference:
            return
        from localrun.calibrate_engine import DECODE_STEPS, SHORT_FILL, decode_step_seconds, synthetic_prompt, timed_steps
        assert SHORT_FILL + DECODE_STEPS + 8 <= HOST_CHECK_CTX
        from localrun.engine.llm_engine import LLMEngine
        from localrun.sampling_params import SamplingParams
        engine = LLMEngine(model, max_model_len=HOST_CHECK_CTX, max_num_seqs=1, enable_prefix_caching=False)
        params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True)
        prompt = synthetic_prompt(SHORT_FILL, model.config.n_vocab, 0)
        timed_steps(engine, [prompt], params)                                   # warm
        steps = [decode_step_seconds(timed_steps(engine, [prompt], params)[0], 1) for _ in range(ROUNDS)]
        self.host_speed = reference / statistics.median(steps)

    def __call__(self, n_gpu_layers: int, n_threads: int, chunk: int) -> tuple[float | None, float | None]:
        if self.threads is None or n_threads != self.threads:
            return None, None
        import layerplan
        plan = layerplan.plan(self.profile, self.machine, n_ctx=self.n_ctx, n_gpu_layers=n_gpu_layers,
                              prompt_tokens=self.prompt_tokens, with_sweep=False, n_ubatch=chunk)
        speed = layerplan.predict(self.profile, self.machine, plan.placement, plan.settings,
                                  prompt_tokens=self.prompt_tokens,
                                  decode_context=self.prompt_tokens + self.gen_tokens // 2)   # the median step's cache
        return speed.prefill_tok_s, speed.decode_tok_s


def sweep(model_path, *, threads: list[int], chunks: list[int], gpu_layers: list[int], prompt_tokens: int = 256,
          gen_tokens: int = 16, on_step: Callable[[str], None] = lambda _: None,
          forecast: Forecast | None = None) -> Iterator[TuneRow]:
    """Measure every (gpu layers, threads, chunk) through the engine: prefill tok/s of the prompt's
    steps, and the median decode step. The chunk does not touch decode, so a thread count's rows
    all carry the median of its runs' decode steps; they are yielded once its chunks are done. Each
    figure is the median of ROUNDS runs, the chunks taken in turn."""
    import torch

    from localrun.api import LLM
    from localrun.calibrate_engine import decode_step_seconds, prefill_seconds, timed_steps
    from localrun.engine.llm_engine import LLMEngine
    from localrun.sampling_params import SamplingParams
    n_ctx = sweep_context(prompt_tokens, gen_tokens)
    forecast = forecast or Forecast(model_path, prompt_tokens, gen_tokens)
    params = SamplingParams(max_tokens=gen_tokens + 1, temperature=0, ignore_eos=True)
    for n_gpu_layers in gpu_layers:
        on_step(f"loading with {n_gpu_layers} GPU layers")
        llm = LLM(model_path, n_ctx=max(n_ctx, HOST_CHECK_CTX), n_threads=max(threads), n_gpu_layers=n_gpu_layers)
        ids = (llm.tokenize("The history of the city is long. " * (prompt_tokens // 4)))[:prompt_tokens]
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            engines = {chunk: LLMEngine(llm.model, max_model_len=n_ctx, max_num_seqs=1, max_num_batched_tokens=chunk,
                                        enable_prefix_caching=False) for chunk in chunks}
            prefill, decode = {chunk: [] for chunk in chunks}, []
            for r in range(ROUNDS):          # rounds over the chunks: a host that speeds up or slows down lands on all
                for chunk, engine in engines.items():
                    on_step(f"{n_threads} threads, chunk {chunk} ({r + 1}/{ROUNDS})")
                    if r == 0:
                        timed_steps(engine, [ids[:32]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
                    steps, _ = timed_steps(engine, [ids], params)
                    tokens, seconds = prefill_seconds(steps)
                    prefill[chunk].append(tokens / seconds)
                    decode.append(decode_step_seconds(steps, 1))
            del engines
            if n_gpu_layers == gpu_layers[0] and n_threads == forecast.threads:
                on_step("this machine's speed against its calibration")
                forecast.check_host(llm.model)
            decode_tok_s = 1.0 / statistics.median(decode)
            for chunk in chunks:
                yield TuneRow(n_gpu_layers, n_threads, chunk, statistics.median(prefill[chunk]), decode_tok_s,
                              *forecast(n_gpu_layers, n_threads, chunk))
        del llm


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
