"""Rendering of a bench summary: a rich table, stacked TTFT bars, and a matplotlib chart."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from localrun.bench.stats import PARTS, PERCENTILES

COLORS = {"queue": "yellow", "prefill": "cyan", "first_decode": "magenta", "transport": "green"}
BAR_WIDTH = 30


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def render(console: Console, summary: dict, title: str = "localrun bench") -> None:
    table = Table("metric", *(f"p{p} ms" for p in PERCENTILES), "mean ms", title=title)
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "end-to-end")):
        d = summary[key]
        table.add_row(label, *(_ms(d[f"p{p}"]) for p in PERCENTILES), _ms(d["mean"]))
    console.print(table)
    console.print(f"requests {summary['completed']}/{summary['requests']} ok, {summary['errors']} errors · "
                  f"{summary['request_throughput']:.2f} req/s · {summary['output_token_throughput']:.1f} output tok/s · "
                  f"wall {summary['wall_s']:.1f} s")
    for message in summary["error_messages"]:
        console.print(f"[red]error:[/red] {message}")
    parts = summary.get("ttft_breakdown_s")
    if not parts:
        console.print("[dim]no server timings: the TTFT breakdown needs a localrun server[/dim]")
        return
    longest = max(sum(b.values()) for b in parts.values()) or 1.0
    console.print("TTFT breakdown (the request at each percentile): " +
                  " ".join(f"[{COLORS[p]}]█ {p.replace('_', ' ')}[/{COLORS[p]}]" for p in PARTS))
    for name, b in parts.items():
        bar = Text(f"{name:>4} ")
        for p in PARTS:
            bar.append("█" * round(BAR_WIDTH * b[p] / longest), style=COLORS[p])
        bar.append("  " + " + ".join(f"{b[p] * 1000:.0f}" for p in PARTS) + f" = {sum(b.values()) * 1000:.0f} ms")
        console.print(bar)


def plot(summary: dict, results, path: str, title: str = "localrun bench") -> None:
    """TTFT distribution (left) and the TTFT breakdown per percentile (right), as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ttft = sorted(r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None)
    left.hist(ttft, bins=min(30, max(5, len(ttft) // 2)), color="#4477aa")
    left.set_xlabel("TTFT (ms)")
    left.set_ylabel("requests")
    left.set_title("TTFT distribution")
    parts = summary.get("ttft_breakdown_s")
    if parts:
        names = list(parts)
        bottom = [0.0] * len(names)
        for p, color in zip(PARTS, ("#ddaa33", "#44aacc", "#aa4499", "#66aa55")):
            values = [parts[n][p] * 1000 for n in names]
            right.bar(names, values, bottom=bottom, label=p.replace("_", " "), color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        right.set_ylabel("ms")
        right.set_title("TTFT breakdown")
        right.legend()
    else:
        right.text(0.5, 0.5, "no server timings", ha="center", va="center")
        right.set_axis_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
