"""`localrun cache` (size and hit counts of the disk KV cache) and `localrun cache clear`.
Thin: reads the cache directory through localrun.engine.disk_files; never imports torch or a model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from layerplan.units import format_bytes

cache_app = typer.Typer(add_completion=False, invoke_without_command=True,
                        help="Show the disk KV cache (prefix blocks kept across restarts), or clear it.")
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

CacheDirOpt = typer.Option(None, "--cache-dir", help="The disk KV cache directory "
                           "(default: $LOCALRUN_HOME/kv-cache).")


def cache_root(cache_dir: Optional[str]) -> Path:
    from localrun.models import localrun_home
    return Path(cache_dir).expanduser() if cache_dir else localrun_home() / "kv-cache"


@cache_app.callback()
def show(ctx: typer.Context, cache_dir: Optional[str] = CacheDirOpt,
         as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")):
    """Size of the disk KV cache per model and layout, and its hit and write counts."""
    if ctx.invoked_subcommand is not None:
        return
    from localrun.engine.disk_files import summarize
    summary = summarize(cache_root(cache_dir))
    if "stats_warning" in summary:         # a stats file not to be trusted: zero counts, said once
        err.print(f"[yellow]warning: {escape(summary['stats_warning'])}[/yellow]", soft_wrap=True)
    if as_json:
        out.print_json(json.dumps(summary))
        return
    stats = summary["stats"]
    out.print(f"{summary['cache_dir']}: {summary['files']:,} blocks, {format_bytes(summary['bytes'])}")
    if summary["namespaces"]:
        table = Table("namespace (model + KV layout)", "blocks", "size")
        for ns, entry in sorted(summary["namespaces"].items()):
            table.add_row(ns, f"{entry['files']:,}", format_bytes(entry["bytes"]))
        out.print(table)
    out.print(f"loaded {stats.get('num_loaded_blocks', 0):,} blocks "
              f"({format_bytes(stats.get('num_loaded_bytes', 0))}), written {stats.get('num_written_blocks', 0):,}, "
              f"dropped writes {stats.get('num_write_drops', 0):,}, corrupt files ignored "
              f"{stats.get('num_corrupt', 0):,}, evicted {stats.get('num_evicted_files', 0):,}")


@cache_app.command()
def clear(cache_dir: Optional[str] = CacheDirOpt):
    """Delete every block in the disk KV cache, and its counts."""
    from localrun.engine.disk_files import clear as clear_cache
    root = cache_root(cache_dir)
    num_files, num_bytes = clear_cache(root)
    out.print(f"removed {num_files:,} blocks ({format_bytes(num_bytes)}) from {root}")
