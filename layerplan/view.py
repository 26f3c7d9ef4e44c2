"""The plan for a person: rich tables per device, the predicted speeds, the reasons, a compact
sweep of the trade-off, and the equivalent llama.cpp flags."""
from __future__ import annotations

import shlex

from rich import box
from rich.console import Console
from rich.table import Table

from layerplan.emit import llama_cpp_flags
from layerplan.planner import Plan, SweepRow
from layerplan.units import GiB, MiB
from layerplan.units import format_bytes as fb

SWEEP_COLUMNS = 11


def _sweep_rows(plan: Plan) -> list[SweepRow]:
    """About SWEEP_COLUMNS rows: evenly spread, plus the chosen one and the edges of what fits."""
    rows = plan.sweep
    if len(rows) <= SWEEP_COLUMNS:
        return list(rows)
    keep = {0, len(rows) - 1, plan.n_gpu_layers}
    fitting = [r.n_gpu_layers for r in rows if r.fits]
    if fitting:
        keep |= {max(fitting), min(max(fitting) + 1, len(rows) - 1)}
    step = max(1, len(rows) // (SWEEP_COLUMNS - len(keep)))
    keep |= set(range(0, len(rows), step))
    return [rows[i] for i in sorted(keep)]


def _header(plan: Plan) -> str:
    p, s = plan.profile, plan.settings
    kv_total = sum(u.kv_bytes for u in plan.usage)
    where = f"  [dim]{p.path}[/dim]" if p.path else " (built-in shape)"
    return (f"[bold]{p.name}[/bold]{where}\n"
            f"{p.architecture}, {p.n_layers} layers, {p.n_params / 1e9:.2f}B parameters, {fb(p.weight_bytes)} "
            f"{p.quantization} ({p.bits_per_weight:.2f} bits/weight), trained context {p.n_ctx_train}\n"
            f"context {s.n_ctx} x {s.n_parallel} sequence{'s' if s.n_parallel > 1 else ''}, KV cache {s.kv.name}: "
            f"{fb(plan.kv_bytes_per_token)}/token, {fb(kv_total)} in all; batch {s.n_ubatch}, "
            f"margin {fb(s.margin_bytes)} per device")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _tokens(n: int) -> str:
    if n >= 10_000:
        return f"{n // 1024}k"
    return str(n) if n else "-"


def _speed(tok_s: float) -> str:
    return f"{tok_s:.1f}" if tok_s < 100 else f"{tok_s:.0f}"


def _devices_table(plan: Plan) -> Table:
    table = Table(title="Memory per device (GiB)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("device", "layers", "weights", "KV", "buffers", "total", "free", "headroom"):
        table.add_column(column, justify="left" if column == "device" else "right")
    for i, u in enumerate(plan.usage):
        layers = f"{u.n_layers}" + ("+head" if u.holds_head else "")
        if u.device.kind == "cpu" and plan.n_cpu_moe:
            layers += f" +{plan.n_cpu_moe} experts"
        headroom = _gib(u.headroom_bytes)
        headroom = f"[green]{headroom}[/green]" if u.fits else f"[bold red]{headroom}[/bold red]"
        name = u.device.name if u.device.kind == "cpu" else f"{i}: {u.device.name}"
        table.add_row(name, layers, _gib(u.weights_bytes), _gib(u.kv_bytes), _gib(u.buffer_bytes),
                      _gib(u.total_bytes), _gib(u.device.free_bytes), headroom)
    return table


def _sweep_table(plan: Plan) -> Table:
    rows = _sweep_rows(plan)
    table = Table(title="Sweep: GPU layers, predicted decode tok/s here, largest context that fits",
                  title_justify="left", show_header=False, box=box.SIMPLE, pad_edge=False)
    table.add_column("", style="bold", no_wrap=True)
    for _ in rows:
        table.add_column("", justify="right", no_wrap=True)

    def mark(row: SweepRow, text: str) -> str:
        if row.n_gpu_layers == plan.n_gpu_layers:
            return f"[bold reverse]{text}[/bold reverse]"
        return text if row.fits else f"[dim]{text}[/dim]"

    table.add_row("-ngl", *[mark(r, str(r.n_gpu_layers)) for r in rows])
    table.add_row("tok/s", *[mark(r, _speed(r.decode_tok_s) if r.fits else "-") for r in rows])
    table.add_row("ctx", *[mark(r, _tokens(r.max_ctx)) for r in rows])
    return table


MENU_ROWS = 8


def menu_rows(plan: Plan) -> list:
    """The entries shown: those at the plan's parallel count (at most MENU_ROWS, spread over the
    contexts), and the fastest entry of each other parallel count. --json carries them all."""
    same = [e for e in plan.menu if e.n_parallel == plan.settings.n_parallel]
    if len(same) > MENU_ROWS:
        step = (len(same) - 1) / (MENU_ROWS - 1)
        same = [same[round(i * step)] for i in range(MENU_ROWS)]
    others = {}
    for e in plan.menu:
        if e.n_parallel != plan.settings.n_parallel and (
                e.n_parallel not in others or e.decode_tok_s > others[e.n_parallel].decode_tok_s):
            others[e.n_parallel] = e
    return same + [others[k] for k in sorted(others)]


def _menu_table(plan: Plan) -> Table:
    s = plan.settings
    title = (f"Menu: trade-offs that fit (decode with {s.n_ctx // 2} tokens cached per sequence; "
             f"--prefer speed|context|parallel picks one; --json has all {len(plan.menu)})")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    moe = any(e.n_cpu_moe for e in plan.menu)
    columns = ["ctx", "KV", "seqs", "-ngl"] + (["experts in RAM"] if moe else []) + [
        "decode tok/s", "prefill tok/s", "GPU GiB", "RAM GiB"]
    for column in columns:
        table.add_column(column, justify="right")
    for e in menu_rows(plan):
        current = (e.n_ctx, e.kv_type, e.n_parallel, e.n_gpu_layers, e.n_cpu_moe) == (
            s.n_ctx, s.kv.name, s.n_parallel, plan.n_gpu_layers, plan.n_cpu_moe)
        cells = [_tokens(e.n_ctx), e.kv_type, str(e.n_parallel), str(e.n_gpu_layers)]
        cells += [str(e.n_cpu_moe)] if moe else []
        cells += [_speed(e.decode_tok_s), _speed(e.prefill_tok_s), _gib(e.gpu_bytes), _gib(e.host_bytes)]
        table.add_row(*[f"[bold reverse]{c}[/bold reverse]" if current else c for c in cells])
    return table


def _ledger_table(plan: Plan) -> Table:
    table = Table(title="Memory ledger: what localrun's engine holds, per device (MiB)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("device", "part", "MiB"):
        table.add_column(column, justify="right" if column == "MiB" else "left")
    for k, (device, items) in enumerate(plan.ledger.by_device()):
        if not items:
            continue
        for i, item in enumerate(items):
            table.add_row(device.name if i == 0 else "", item.what, f"{item.n_bytes / MiB:,.1f}")
        mapped = plan.ledger.device_bytes(k, mapped=True)
        note = f" ({mapped / MiB:,.1f} of it file-backed)" if mapped else ""
        table.add_row("", f"[bold]total{note}[/bold]", f"[bold]{plan.ledger.device_bytes(k) / MiB:,.1f}[/bold]")
    return table


def _sources(plan: Plan) -> str:
    return "; ".join(f"{u.device.name} {u.device.source}" for u in plan.usage)


def render_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    console.print(_header(plan))
    console.print(_devices_table(plan))
    console.print(f"[dim]figures: {_sources(plan)}[/dim]", highlight=False)
    n = plan.n_layers
    how = "auto" if plan.auto else "pinned"
    verdict = "[green]fits[/green]" if plan.fits else "[bold red]does not fit[/bold red]"
    p = plan.predicted
    parallel = f" ({p.decode_tok_s_total:.1f} in all)" if plan.settings.n_parallel > 1 else ""
    moe = ""
    if plan.n_cpu_moe:
        which = "all layers" if plan.n_cpu_moe >= n else f"the first {plan.n_cpu_moe} layers"
        moe = f", the routed experts of {which} in RAM"
    console.print(f"[bold]Plan:[/bold] n_gpu_layers {plan.n_gpu_layers} of {n + 1}{moe} ({how}), {verdict}")
    console.print(f"[bold]Predicted:[/bold] decode {p.decode_tok_s:.1f} tok/s per sequence{parallel} with "
                  f"{p.decode_context} tokens cached; prefill {p.prefill_tok_s:.0f} tok/s; time to first token "
                  f"{p.ttft_s:.2f} s for a {p.prompt_tokens}-token prompt")
    if plan.threads is not None:
        console.print(f"[bold]Threads:[/bold] {plan.threads.reason} (chat and serve -t; llama.cpp -t "
                      f"{plan.threads.recommended})", highlight=False)
    for reason in plan.reasons:
        console.print(f" - {reason}", highlight=False)
    if len(plan.sweep) > 1:
        console.print(_sweep_table(plan))
    elif plan.sweep:
        console.print(f"[bold]Largest context that fits:[/bold] {plan.sweep[0].max_ctx} tokens per sequence")
    if plan.ledger is not None:
        console.print(_ledger_table(plan))
    if plan.menu:
        console.print(_menu_table(plan))
    console.print(f"[bold]llama.cpp:[/bold] {shlex.join(llama_cpp_flags(plan))}", highlight=False)
