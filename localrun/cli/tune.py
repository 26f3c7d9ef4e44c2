"""`localrun tune MODEL`: measure threads x prefill chunk (x GPU layers where a GPU exists) on
this machine, show measured against layerplan's predicted speed, store the best as the model's
profile. Thin: parses, calls localrun.tune, renders with rich."""
from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from localrun.errors import UserError


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{what} takes numbers separated by commas, not '{text}'") from None
    low = 0 if what == "--gpu-layers" else 1
    if not values or min(values) < low:
        raise UserError(f"{what} takes numbers from {low} up, not '{text}'")
    return values


def default_gpu_layers(n_layers: int) -> list[int]:
    import torch
    if not torch.cuda.is_available():
        return [0]
    return sorted({0, n_layers // 2, n_layers, n_layers + 1})


def tune(
    model: Annotated[Optional[str], typer.Argument(help="A .gguf path or a catalog name (default: smollm2-135m).",
                                                   show_default=False)] = None,
    threads: Annotated[Optional[str], typer.Option("--threads", "-t", help="Thread counts to try, e.g. 1,2,4 "
                                                   "[default: 1 up to the physical cores, doubling].",
                                                   show_default=False)] = None,
    chunks: Annotated[str, typer.Option("--chunks", help="Prefill chunk sizes to try (tokens per forward).")] = "64,128,256",
    gpu_layers: Annotated[Optional[str], typer.Option("--gpu-layers", "-ngl", help="GPU layer counts to try "
                                                      "[default: 0 without a GPU; 0, half, all, all+head with one].",
                                                      show_default=False)] = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt length timed per setting.")] = 256,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", help="Decode steps timed per setting.")] = 16,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Store the best settings as the model's profile.")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print the rows and the choice as one JSON object.")] = False,
) -> None:
    """Measure speed settings on this machine and store the best as the model's default profile."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from localrun.api import default_threads
    from localrun.gguf_file import open_gguf
    from localrun.models import resolve_model
    from localrun.tune import Forecast, best_row, save_profile, sweep

    path = resolve_model(model)
    n_layers = open_gguf(path).config.n_layers
    thread_list = _ints(threads, "--threads") if threads else _doubling(default_threads())
    chunk_list = _ints(chunks, "--chunks")
    gpu_list = _ints(gpu_layers, "--gpu-layers") if gpu_layers else default_gpu_layers(n_layers)
    if prompt_tokens < 8 or gen_tokens < 1:
        raise UserError("--prompt-tokens must be at least 8 and --gen-tokens at least 1")
    err = Console(stderr=True, highlight=False)
    rows = []
    forecast = Forecast(path, prompt_tokens, gen_tokens)
    total = len(gpu_list) * len(thread_list) * len(chunk_list)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        task = progress.add_task("tuning", total=total)
        for row in sweep(path, threads=thread_list, chunks=chunk_list, gpu_layers=gpu_list,
                         prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, forecast=forecast,
                         on_step=lambda text: progress.update(task, description=text)):
            rows.append(row)
            progress.advance(task)
    best = best_row(rows)
    saved = save_profile(path, best, rows, machine=_machine_name()) if save else None
    if json_out:
        typer.echo(json.dumps({"model": str(path), "rows": [r.__dict__ for r in rows], "best": best.__dict__,
                               "profile": str(saved) if saved else None, "calibration_threads": forecast.threads,
                               "host_speed_vs_calibration": forecast.host_speed}))
        return
    out = Console(highlight=False)
    table = Table("gpu layers", "threads", "chunk", "prefill tok/s", "predicted", "decode tok/s", "predicted",
                  title=f"localrun tune {path.name} (prompt {prompt_tokens}, decode {gen_tokens})")
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"   # noqa: E731
    for r in rows:
        style = "bold green" if r == best else None
        table.add_row(str(r.n_gpu_layers), str(r.n_threads), str(r.chunk), fmt(r.prefill_tok_s),
                      fmt(r.predicted_prefill_tok_s), fmt(r.decode_tok_s), fmt(r.predicted_decode_tok_s), style=style)
    out.print(table)
    if forecast.threads is None:
        out.print(f"predicted: no calibration of this machine yet (localrun plan {path.name} --measure makes one)")
    else:
        out.print(f"predicted: layerplan with this machine's calibration, taken at {forecast.threads} threads "
                  f"(other thread counts are not predicted)")
        if forecast.host_speed is not None:
            out.print(f"this machine now runs the calibration's reference step at {forecast.host_speed:.2f}x its "
                      f"speed then" + ("; measured over predicted moves with it" if abs(forecast.host_speed - 1) > 0.1
                                      else ""))
    out.print(f"best: --gpu-layers {best.n_gpu_layers} --threads {best.n_threads}, prefill chunk {best.chunk}"
              + (f"; saved to {saved}" if saved else ""))


def _doubling(limit: int) -> list[int]:
    values, n = [], 1
    while n < limit:
        values.append(n)
        n *= 2
    return values + [limit]


def _machine_name() -> str:
    import platform
    return f"{platform.machine()} {platform.processor() or platform.system()}"
