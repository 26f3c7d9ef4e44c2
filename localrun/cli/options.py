"""The options chat, generate and serve share (and plan, --gpu-layers): each flag declared once
(name, default, help), one way from flags to an EngineConfig (checked before anything loads, so
a bad flag is one sentence and exit 2), the flag each option is called by in those sentences,
and one way to load the model (`load_llm`: the tuned profile fills what the flags leave unset)."""
from __future__ import annotations

import dataclasses

import typer
from rich.console import Console

from localrun.engine_config import DEFAULT_OUTPUT_RESERVE_TOKENS, DEFAULT_PROMPT_MATH, EngineConfig
from localrun.errors import OptionError, UserError

err = Console(stderr=True, highlight=False)

# --- the model and how it runs ------------------------------------------------------------------
ModelArg = typer.Argument(None, help="A .gguf path or a catalog name (default: smollm2-135m).")
CtxOpt = typer.Option(None, "--ctx", "-c", help="Context size in tokens per sequence (default: min(trained, 4096)).")
ThreadsOpt = typer.Option(None, "--threads", "-t", help="CPU threads (default: the tuned profile's, else "
                          "the physical cores).")
KvTypeOpt = typer.Option(None, "--kv-type", help="KV cache type: f32, bf16, f16, int8 (llama.cpp's q8_0), fp8 "
                         "(default: f16 for float32 models, else the compute dtype).")
PromptMathOpt = typer.Option(DEFAULT_PROMPT_MATH, "--prompt-math", help="Prompt rows times quantized weights: int8 "
                             "(activations rounded to 8 bits, as decode rows and llama.cpp; faster) or float32 "
                             "(the exact model, for evaluation).")
GpuLayersOpt = typer.Option("auto", "--gpu-layers", "-ngl", help="'auto' (layerplan chooses; all-CPU without a "
                            "GPU) or the number of layers on the GPU (llama.cpp's -ngl: the last N; n_layers+1 "
                            "adds the output head).")
# --- the prefix cache's tiers ---------------------------------------------------------------------
CacheDirOpt = typer.Option(None, "--cache-dir", help="Disk KV cache directory (default: $LOCALRUN_HOME/kv-cache).")
NoDiskCacheOpt = typer.Option(False, "--no-disk-cache", help="Do not keep prefix blocks on disk across restarts.")
CacheDiskOpt = typer.Option(None, "--cache-disk", help="Size bound of the disk KV cache, e.g. 20GiB "
                            "(default: 20GiB or half the free space).")
CacheRamOpt = typer.Option(None, "--cache-ram", help="Host RAM for prefix blocks the GPU's KV pool evicts, e.g. "
                           "4GiB (default: min(4GiB, 25% of free RAM) with a GPU; 0, off, on a CPU-only machine).")
# --- speculative decoding -------------------------------------------------------------------------
DraftModelOpt = typer.Option(None, "--draft-model", help="Speculative decoding with this draft model: a .gguf "
                             "path, a catalog name (same vocabulary), or self:N (the model's first N layers).")
SpecOpt = typer.Option(None, "--spec", help="Speculative decoding without a draft model: ngram (prompt lookup).")
DraftMaxOpt = typer.Option(4, "--draft-max", help="The most tokens drafted per step (speculation adapts below it).")
# --- batching and admission (serve) ---------------------------------------------------------------
ParallelOpt = typer.Option(16, "--parallel", "-np", help="Requests decoded together (continuous batching).")
MaxBatchedTokensOpt = typer.Option(None, "--max-batched-tokens", "-b", help="Tokens per engine step: the prefill "
                                   "chunk that shares a step with running decodes (default: the tuned profile's, "
                                   "else 512).")
NoChunkedPrefillOpt = typer.Option(False, "--no-chunked-prefill", help="Compute each prompt in one step (needs "
                                   "--max-batched-tokens >= --ctx).")
KvBudgetOpt = typer.Option(None, "--kv-budget", help="KV cache memory, e.g. 2GiB (default: the plan's budget per device, as `localrun plan` prints it).")
NoPrefixCacheOpt = typer.Option(False, "--no-prefix-cache", help="Recompute every prompt.")
ScheduleOpt = typer.Option("fcfs", "--schedule", help="Admission order: fcfs, or cache_aware (longest cached "
                           "prefix first, none passed over more than 16 times).")
OutputReserveOpt = typer.Option(DEFAULT_OUTPUT_RESERVE_TOKENS, "--output-reserve", help="Output tokens of KV a "
                                "request must find room for to be admitted (0: admit greedily and preempt when full).")


# The flag of each option (EngineConfig's fields) whose flag is not its name in dashes, as top_p's
# --top-p and n_cpu_moe's --n-cpu-moe are: a bad value's sentence names the flag the user typed.
FLAGS = {"n_ctx": "--ctx", "n_threads": "--threads", "n_gpu_layers": "--gpu-layers", "n_parallel": "--parallel",
         "max_num_batched_tokens": "--max-batched-tokens", "kv_budget_bytes": "--kv-budget",
         "scheduling": "--schedule", "output_reserve_tokens": "--output-reserve", "speculative": "--draft-model",
         "num_speculative_tokens": "--draft-max"}


def flag_of(option: str) -> str:
    return FLAGS.get(option, "--" + option.replace("_", "-"))


def in_flag_words(error: UserError) -> UserError:
    """The error as the user should read it: an option's bad value under the flag they typed
    (--kv-budget, not kv_budget_bytes); any other error as it is."""
    return error.named(flag_of(error.option)) if isinstance(error, OptionError) else error


def speculative_options(draft_model: str | None, spec: str | None) -> dict:
    """EngineConfig options for --draft-model / --spec (one of them at most)."""
    if draft_model and spec:
        raise UserError("Give either --draft-model or --spec, not both.")
    if spec is not None and spec != "ngram":
        raise UserError(f"Unknown --spec {spec!r}; the one method without a draft model is 'ngram'.")
    return {"speculative": draft_model or spec}


def engine_config(*, ctx=None, threads=None, kv_type=None, gpu_layers="auto", draft_model=None, spec=None,
                  draft_max=4, cache_dir=None, no_disk_cache=True, cache_disk=None, cache_ram=None,
                  **options) -> EngineConfig:
    """The EngineConfig of the shared flags (the names above, as the commands take them), plus
    EngineConfig fields by their own names; the disk cache is on unless no_disk_cache."""
    return EngineConfig(n_ctx=ctx, n_threads=threads, kv_type=kv_type, n_gpu_layers=gpu_layers,
                        num_speculative_tokens=draft_max, disk_cache=not no_disk_cache, cache_dir=cache_dir,
                        cache_disk=cache_disk, cache_ram=cache_ram, **speculative_options(draft_model, spec),
                        **options)


def load_llm(model: str | None, config: EngineConfig, *, max_batched_tokens: int | None = None,
             default_batched_tokens: int | None = None):
    """The model with its engine built (KV pool, disk index, speculation costs), not inside the
    first request's TTFT. The model's tuned profile (localrun tune) fills what the flags left
    unset: threads, GPU layers when 'auto', and the step's token budget when the flag
    (max_batched_tokens) was not given (then default_batched_tokens, else config's). Threads
    that neither -t nor a profile set follow layerplan's advice: the physical cores less those
    other work keeps busy (oversubscription collapses decode on a small machine)."""
    from layerplan.threads import advise_threads
    from localrun.gguf_file import open_gguf
    from localrun.models import resolve_model
    from localrun.tune import apply_profile
    file = open_gguf(resolve_model(model))     # a wrong name or a bad header: one sentence before torch loads (~3 s)
    from localrun.api import LLM
    asked = {"n_gpu_layers": config.n_gpu_layers, "max_num_batched_tokens": max_batched_tokens}
    threads, tuned, used_profile = apply_profile(model, config.n_threads, asked)
    advice = None
    if threads is None:
        advice = advise_threads()
        threads = advice.recommended
    batched = tuned.get("max_num_batched_tokens") or default_batched_tokens or config.max_num_batched_tokens
    config = dataclasses.replace(config, n_threads=threads, n_gpu_layers=tuned.get("n_gpu_layers", "auto"),
                                 max_num_batched_tokens=batched)
    with err.status("loading model..."):
        llm = LLM(file, config)
        llm.engine
    err.print(f"[dim]{llm.plan_summary}{' · tuned profile' if used_profile else ''}[/dim]")
    if llm.context_warning:
        err.print(f"[yellow]warning: {llm.context_warning}[/yellow]", soft_wrap=True)
    if advice is not None and advice.busy_cores:
        err.print(f"[dim]threads: {advice.reason} (set -t to choose)[/dim]")
    return llm


def warn_template(llm) -> None:
    """A chat template the sandbox refuses (checked now, at start, not at the first chat
    request): say so once; the built-in one is used."""
    if llm.config.chat_template_error:
        err.print(f"[yellow]warning: {llm.config.chat_template_error}; using the built-in ChatML template[/yellow]",
                  soft_wrap=True)
    elif llm.config.chat_template_notice:      # no template in the file: the family's turn format
        err.print(f"[yellow]note: {llm.config.chat_template_notice}[/yellow]", soft_wrap=True)
