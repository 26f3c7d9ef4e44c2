"""The `localrun` app (typer + rich): chat, generate, info, pull and models, with the other
commands attached, and main(), the console script. Thin: parse, call the API, render.

Torch is imported only by commands that run a model, so `plan`, `pull`, `models` and `info`
start fast."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from localrun.cli.cache import cache_app
from localrun.cli.options import (CacheDirOpt, CacheDiskOpt, CacheRamOpt, CtxOpt, DraftMaxOpt, DraftModelOpt,
                                   GpuLayersOpt, KvTypeOpt, ModelArg, NoDiskCacheOpt, PromptMathOpt, SpecOpt, ThreadsOpt, engine_config,
                                   in_flag_words, load_llm, warn_template)
from localrun.cli.plan import plan
from localrun.cli.tune import tune
from localrun.cli.bench import bench
from localrun.cli.serve import serve
from localrun.cli.top import top
from localrun.errors import UserError
from localrun.sampling_params import SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Run GGUF language models locally: chat, generate, serve, plan.")
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def _stats_line(t: dict) -> str:
    tiers = [f"{t[f'cached_tokens_{tier}']} from {tier}" for tier in ("ram", "disk") if t.get(f"cached_tokens_{tier}")]
    disk = f" ({', '.join(tiers)})" if tiers else ""
    cached = f", {t['cached_tokens']} cached{disk}" if t["cached_tokens"] else ""
    drafts = (f" · drafts {t['accepted_tokens']}/{t['draft_tokens']} accepted"
              if t.get("draft_tokens") else "")
    return (f"ttft {t['ttft_s'] * 1000:.0f} ms · {t['decode_tok_s']:.1f} tok/s · "
            f"prompt {t['prompt_tokens']} tokens{cached} · reply {t['generated_tokens']} tokens{drafts}")


@app.command()
def chat(model: Optional[str] = ModelArg,
         system: Optional[str] = typer.Option(None, "--system", "-s", help="System prompt."),
         temperature: float = typer.Option(0.7, "--temperature", "--temp"),
         top_k: int = typer.Option(40, "--top-k", help="Keep the k most likely tokens (0: all)."),
         top_p: float = typer.Option(0.95, "--top-p", help="Keep the most likely tokens up to this mass (1: all)."),
         min_p: float = typer.Option(0.05, "--min-p", help="Drop tokens under this share of the top one's probability."),
         repeat_penalty: float = typer.Option(1.0, "--repeat-penalty",
                                              help="Penalize the last 64 tokens' repeats (1: off; 1.1 is common)."),
         max_tokens: int = typer.Option(512, "--max-tokens", "-n"),
         seed: Optional[int] = typer.Option(None, "--seed"),
         ctx: Optional[int] = CtxOpt, threads: Optional[int] = ThreadsOpt,
         kv_type: Optional[str] = KvTypeOpt, cache_dir: Optional[str] = CacheDirOpt,
         no_disk_cache: bool = NoDiskCacheOpt, cache_disk: Optional[str] = CacheDiskOpt,
         cache_ram: Optional[str] = CacheRamOpt,
         draft_model: Optional[str] = DraftModelOpt, spec: Optional[str] = SpecOpt,
         draft_max: int = DraftMaxOpt, gpu_layers: str = GpuLayersOpt, prompt_math: str = PromptMathOpt):
    """Interactive chat with history. Commands: /reset, /stats, /exit. Ctrl-C stops a reply.
    A full context drops the oldest turns (never the system prompt), with a notice."""
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repeat_penalty=repeat_penalty, max_tokens=max_tokens, seed=seed)
    SamplingParams(**sampling)      # a bad value is one sentence now, not after the load and at every turn
    config = engine_config(ctx=ctx, threads=threads, kv_type=kv_type, gpu_layers=gpu_layers, draft_model=draft_model,
                           spec=spec, draft_max=draft_max, cache_dir=cache_dir, no_disk_cache=no_disk_cache,
                           cache_disk=cache_disk, cache_ram=cache_ram, prompt_math=prompt_math, n_parallel=1)
    llm = load_llm(model, config)
    warn_template(llm)
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    last = None
    err.print(f"[dim]{llm.config.name} · {llm.model_path.name} · ctx {llm.n_ctx} · "
              f"{llm.n_threads} threads · loaded in {llm.load_s:.1f}s. /exit to quit, /reset, /stats.[/dim]")
    while True:
        try:
            line = out.input("[bold green]> [/bold green]")
        except (EOFError, KeyboardInterrupt):
            out.print()
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return
        if text == "/reset":
            history = list(base)
            out.print("[dim]history cleared[/dim]")
            continue
        if text == "/stats":
            engine = llm.engine.stats()
            cache = {k: engine[k] for k in ("prefix_cache_hit_rate", "prefix_cache_hit_tokens",
                                             "prefix_cache_query_tokens", "num_blocks_used",
                                             "num_blocks_cached", "num_blocks_total", "kv_type")}
            speculation = {k: v for k, v in engine.items() if k.startswith("spec_")}
            out.print_json(json.dumps({"last_reply": last, "kv_cache": cache, "speculative": speculation}))
            continue
        if text.startswith("/"):
            out.print(f"[dim]unknown command {text}; use /reset, /stats or /exit[/dim]")
            continue
        history.append({"role": "user", "content": text})
        try:   # drop to half the room at once, so the next turns reuse the cached prefix
            history, dropped = llm.fit_chat(history, max_tokens,
                                            target=(llm.n_ctx + min(max_tokens, llm.n_ctx // 2)) // 2)
        except UserError as e:
            history.pop()
            err.print(f"[red]{in_flag_words(e)}[/red]")
            continue
        if dropped:
            err.print(f"[yellow]context full: dropped the {dropped} oldest messages"
                      f"{' (the system prompt stays)' if base else ''}[/yellow]")
        reply = []
        try:
            for piece in llm.chat(history, stream=True, **sampling):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            last = llm.last_result.timings
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            err.print("[dim](stopped)[/dim]")
            last = None
        except UserError as e:        # e.g. the conversation outgrew the context
            history.pop()
            err.print(f"[red]{in_flag_words(e)}[/red]")
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
        if last:
            err.print(f"[dim]{_stats_line(last)}[/dim]")


@app.command()
def generate(model: Optional[str] = ModelArg,
             prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
             max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
             temperature: float = typer.Option(0.8, "--temperature", "--temp"),
             top_k: int = typer.Option(40, "--top-k"),
             top_p: float = typer.Option(0.95, "--top-p"),
             min_p: float = typer.Option(0.05, "--min-p"),
             repeat_penalty: float = typer.Option(1.0, "--repeat-penalty"),
             seed: Optional[int] = typer.Option(None, "--seed"),
             stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
             ignore_eos: bool = typer.Option(False, "--ignore-eos"),
             as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
             ctx: Optional[int] = CtxOpt, threads: Optional[int] = ThreadsOpt,
             kv_type: Optional[str] = KvTypeOpt, draft_model: Optional[str] = DraftModelOpt,
             spec: Optional[str] = SpecOpt, draft_max: int = DraftMaxOpt, gpu_layers: str = GpuLayersOpt,
             prompt_math: str = PromptMathOpt):
    """One-shot completion of a prompt."""
    config = engine_config(ctx=ctx, threads=threads, kv_type=kv_type, gpu_layers=gpu_layers, draft_model=draft_model,
                           spec=spec, draft_max=draft_max, prompt_math=prompt_math, n_parallel=1)
    llm = load_llm(model, config)
    opts = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repeat_penalty=repeat_penalty, seed=seed, stop=stop, ignore_eos=ignore_eos)
    if as_json:
        r = llm.generate(prompt, **opts)
        out.print_json(json.dumps({"text": r.text, "token_ids": r.token_ids,
                                   "finish_reason": r.finish_reason, "timings": r.timings}))
        return
    for piece in llm.stream(prompt, **opts):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    err.print(f"[dim]{_stats_line(llm.last_result.timings)} · finish {llm.last_result.finish_reason}[/dim]")


@app.command()
def info(model: Optional[str] = ModelArg,
         as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
         families: bool = typer.Option(False, "--families", help="List the model families localrun runs.")):
    """Architecture, shapes and tensor types of a model (from its header; no weights read)."""
    from collections import Counter
    if families:
        from layerplan.architectures import ARCHITECTURES
        if as_json:
            out.print_json(json.dumps({name: a.description for name, a in ARCHITECTURES.items()}))
            return
        table = Table("architecture", "family", title="supported model families")
        for name, a in ARCHITECTURES.items():
            table.add_row(name, a.description)
        out.print(table)
        return

    from localrun.gguf_file import open_gguf, type_name
    from localrun.models import resolve_model
    f = open_gguf(resolve_model(model))
    c = f.config
    n_bytes, n_tensors = Counter(), Counter()
    for t in f.tensors.values():
        n_bytes[type_name(t.type_id)] += t.n_bytes
        n_tensors[type_name(t.type_id)] += 1
    fields = {"file": str(f.path), "file_bytes": f.header.file_bytes, "name": c.name,
              "architecture": c.architecture, "n_layers": c.n_layers, "n_embd": c.n_embd,
              "n_head": c.n_head, "n_head_kv": c.n_head_kv, "head_dim": c.head_dim, "n_ff": c.n_ff,
              "context_length": c.context_length, "n_vocab": c.n_vocab, "rope_base": c.rope_base,
              "rope_scaling": c.rope_scaling_type, "tied_output": c.tied_output,
              "sliding_window": (f"{c.sliding_window} tokens in {c.num_local_layers} of {c.n_layers} layers"
                                 if c.sliding_window else "none"),
              "chat_template": _template_summary(c),
              "chat_template_chars": len(c.chat_template) if c.chat_template_origin == "file" else None,
              "tensor_types": {k: {"tensors": n_tensors[k], "bytes": n_bytes[k]} for k in n_bytes}}
    if as_json:
        out.print_json(json.dumps(fields))
        return
    table = Table(title=f"{c.name}  ({f.path.name})", show_header=False)
    for k, v in fields.items():
        if k != "tensor_types" and v is not None:
            table.add_row(k, f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
    out.print(table)
    types = Table("type", "tensors", "bytes", title="tensor types")
    for k in sorted(n_bytes, key=n_bytes.get, reverse=True):
        types.add_row(k, str(n_tensors[k]), f"{n_bytes[k]:,}")
    out.print(types)


def _template_summary(c) -> str:
    """Which chat template a chat would use, from the header alone: a file's template is only
    measured here (compiling and checking it is the first chat's work, not info's)."""
    from localrun.chat_template import size_refusal
    if c.chat_template_origin == "none":
        return "built-in ChatML (the file has none)"
    if c.chat_template_origin == "family":
        return f"{c.arch.chat_format} turn format (the file has none)"
    refusal = size_refusal(c.chat_template)
    if refusal:
        return f"built-in ChatML ({refusal})"
    return f"the file's ({len(c.chat_template):,} characters; compiled and checked when a chat starts)"


@app.command()
def pull(name: str = typer.Argument(..., help="Catalog name, e.g. smollm2-135m.")):
    """Fetch a catalog model into $LOCALRUN_HOME/models, verify it; print its path last."""
    from localrun.models import pull as pull_model
    path = pull_model(name)
    print(path)


@app.command()
def models():
    """List the catalog and the models in the local cache."""
    from localrun.models import catalog, is_verified, list_cached, models_dir
    table = Table("name", "description", "cached", title="catalog")
    for entry in catalog().values():
        table.add_row(entry.name, entry.description, "yes" if is_verified(entry) else "no")
    out.print(table)
    cached = list_cached()
    if not cached:
        out.print(f"[dim]no models in {models_dir()} yet; `localrun pull NAME` fetches one[/dim]")
        return
    files = Table("name", "path", "size", title=f"cached in {models_dir()}")
    for name, path, size in cached:
        files.add_row(name, str(path), f"{size / 2**20:,.1f} MiB")
    out.print(files)


app.command("plan")(plan)
app.command("tune")(tune)
app.add_typer(cache_app, name="cache")
app.command("serve")(serve)
app.command("top")(top)
app.command("bench")(bench)


def main():
    try:
        app()
    except UserError as e:
        err.print(f"[red]error:[/red] {in_flag_words(e)}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
