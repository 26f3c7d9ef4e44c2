"""`localrun top`: a live terminal view of a running localrun server, built from its /metrics."""
from __future__ import annotations

import time
from typing import Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from localrun.errors import UserError

out = Console(highlight=False)

# The memory a server planned (layerplan's ledger of the engine, one sample per device and part) and
# what its process holds; `top` shows them side by side when the server exports both.
PLANNED_METRIC = "localrun_memory_planned_bytes"
ACTUAL_METRIC = "process_resident_memory_bytes"


def memory_row(now: dict) -> tuple[str, str] | None:
    """('memory planned / actual', text) from the planned ledger and the process's RSS; None when the
    server exports neither. Memory-mapped weights count once their pages are touched, as RSS does."""
    planned = now.get(PLANNED_METRIC) or []
    actual = now.get(ACTUAL_METRIC)
    if not planned and actual is None:
        return None
    mib = 1 << 20
    host = sum(v for device, _, v in planned if device == "CPU")
    parts = ", ".join(f"{part} {v / mib:,.0f}" for device, part, v in planned if device == "CPU" and v)
    text = (f"{host / mib:,.0f} MiB planned" if planned else "- planned") + " / " + (
        f"{actual / mib:,.0f} MiB resident" if actual is not None else "- resident")
    if planned and actual:
        text += f" ({actual / host:.2f}x)" if host else ""
    if parts:
        text += f"  [{parts}]"
    return "host memory planned / actual", text


def scrape(url: str, api_key: str | None = None) -> dict:
    """{metric sample name -> value}, histogram buckets as {name: [(le, cumulative count), ...]}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=5, headers=headers)
    except httpx.HTTPError as e:
        raise UserError(f"cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise UserError(f"{url}/metrics answered HTTP {r.status_code}")
    values: dict = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                values.setdefault(s.name, []).append((float(s.labels["le"]), s.value))
            elif s.labels and "finish_reason" in s.labels:
                values[f"{s.name}:{s.labels['finish_reason']}"] = s.value
            elif s.name == PLANNED_METRIC:
                values.setdefault(PLANNED_METRIC, []).append((s.labels.get("device", "?"), s.labels.get("part", "?"),
                                                              s.value))
            else:
                values[s.name] = s.value
    return values


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket holding rank q."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def window(now: dict, before: dict | None, name: str) -> list[tuple[float, float]]:
    """Bucket counts since the previous scrape (all time when nothing new happened)."""
    cur = now.get(name, [])
    if before is None or name not in before:
        return cur
    old = dict(before[name])
    diff = [(le, c - old.get(le, 0)) for le, c in cur]
    return diff if diff and diff[-1][1] > 0 else cur


def view(url: str, now: dict, before: dict | None, dt: float) -> Table:
    def rate(name):
        if before is None or dt <= 0:
            return None
        return (now.get(name, 0) - before.get(name, 0)) / dt

    ttft = window(now, before, "localrun_time_to_first_token_seconds_bucket")
    itl = window(now, before, "localrun_inter_token_latency_seconds_bucket")
    queries = now.get("localrun_prefix_cache_queries_total", 0)
    hits = now.get("localrun_prefix_cache_hits_total", 0)
    used, total = now.get("localrun_kv_blocks_used", 0), now.get("localrun_kv_blocks_total", 0)

    def ms(v):
        return "-" if v is None else f"{v * 1000:,.0f} ms"

    tok_s = rate("localrun_generation_tokens_total")
    table = Table(show_header=False, title=f"localrun top · {url}")
    rows = [
        ("requests running / waiting", f"{now.get('localrun_num_requests_running', 0):.0f} / "
                                       f"{now.get('localrun_num_requests_waiting', 0):.0f}"),
        ("TTFT p50 / p99", f"{ms(histogram_quantile(0.5, ttft))} / {ms(histogram_quantile(0.99, ttft))}"),
        ("inter-token p50 / p99", f"{ms(histogram_quantile(0.5, itl))} / {ms(histogram_quantile(0.99, itl))}"),
        ("generated tokens/s", "-" if tok_s is None else f"{tok_s:,.1f}"),
        ("KV blocks used", f"{used:,.0f} / {total:,.0f} ({100 * used / total if total else 0:.1f}%)"),
        ("prefix cache hit rate", f"{100 * hits / queries:.1f}% of {queries:,.0f} prompt tokens" if queries else "-"),
        ("requests done (stop / length / abort)",
         " / ".join(f"{now.get(f'localrun_requests_total:{r}', 0):.0f}" for r in ("stop", "length", "abort"))),
        ("preemptions", f"{now.get('localrun_num_preemptions_total', 0):.0f}"),
    ]
    memory = memory_row(now)
    if memory is not None:
        rows.append(memory)
    for k, v in rows:
        table.add_row(k, v)
    return table


def top(url: str = typer.Option("http://127.0.0.1:8080", "--url", help="Base URL of a localrun server."),
        interval: float = typer.Option(1.0, "--interval", help="Seconds between scrapes."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LOCALRUN_API_KEY"),
        once: bool = typer.Option(False, "--once", help="Print one snapshot and exit.")):
    """Live view of a running server: requests, TTFT, tokens/s, KV use, cache hit rate."""
    if interval <= 0:
        raise UserError(f"--interval must be > 0, got {interval}")
    before, t_before = None, time.monotonic()
    now = scrape(url, api_key)
    if once:
        out.print(view(url, now, None, 0))
        return
    with Live(view(url, now, None, 0), console=out, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                before, t_before, now = now, t_before, scrape(url, api_key)
                t_now = time.monotonic()
                live.update(view(url, now, before, t_now - t_before))
                t_before = t_now
        except KeyboardInterrupt:
            pass
