"""`localrun bench`: a load generator for any OpenAI-compatible endpoint."""
from __future__ import annotations

import asyncio
import json
import math
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from localrun.errors import UserError

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def run_scenario(url: str, scenario, *, model: str | None, api_key: str | None, ignore_eos: bool,
                 show_progress: bool = True):
    """Results and wall time of one scenario against url, with a progress bar on stderr."""
    from localrun.bench.loadgen import run_requests
    from localrun.bench.workload import build_requests

    requests = build_requests(scenario)
    with Progress(TextColumn("[dim]bench[/dim]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not show_progress) as progress:
        task = progress.add_task("requests", total=len(requests))
        return asyncio.run(run_requests(url, requests, concurrency=scenario.concurrency, model=model,
                                        ignore_eos=ignore_eos, api_key=api_key,
                                        on_done=lambda _: progress.advance(task)))


def bench(model: Optional[str] = typer.Argument(None, help="Model for the localrun server bench starts "
                                                "(ignored with --url)."),
          url: Optional[str] = typer.Option(None, "--url", help="Base URL of a running OpenAI-compatible "
                                            "server (localrun, llama-cpp-python, llama.cpp)."),
          served_model: Optional[str] = typer.Option(None, "--model-name", help="The 'model' field to send."),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LOCALRUN_API_KEY"),
          num_requests: int = typer.Option(32, "--requests", "-n", help="Number of requests."),
          prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Each request's own prompt (~tokens)."),
          output_tokens: int = typer.Option(64, "--output-tokens", help="Tokens to generate per request."),
          shared_prefix: int = typer.Option(0, "--shared-prefix", help="Shared prefix length (~tokens)."),
          num_prefixes: int = typer.Option(1, "--prefixes", help="Distinct shared prefixes."),
          concurrency: int = typer.Option(0, "--concurrency", "-c", help="Most requests in flight (0: no limit)."),
          rate: float = typer.Option(math.inf, "--rate", help="Requests per second, Poisson (default: all at once)."),
          seed: int = typer.Option(0, "--seed"),
          completions: bool = typer.Option(False, "--completions", help="Use /v1/completions instead of chat."),
          respect_eos: bool = typer.Option(False, "--respect-eos", help="Let requests stop at end of generation "
                                           "(default: always generate --output-tokens)."),
          parallel: Optional[int] = typer.Option(None, "--parallel", help="--parallel of the server bench starts."),
          json_path: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON to this file."),
          plot_path: Optional[str] = typer.Option(None, "--plot", help="Draw a PNG chart to this file.")):
    """Measure TTFT, TPOT, ITL, latency and throughput of a server under a synthetic workload."""
    from localrun.bench.report import plot, render
    from localrun.bench.servers import localrun_server
    from localrun.bench.stats import summarize
    from localrun.bench.workload import Scenario

    scenario = Scenario(num_requests=num_requests, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                        shared_prefix_tokens=shared_prefix, num_prefixes=num_prefixes, concurrency=concurrency,
                        request_rate=rate, seed=seed, chat=not completions)
    if plot_path and not plot_path.endswith(".png"):
        raise UserError("--plot must name a .png file")

    def go(base_url):
        results, wall = run_scenario(base_url, scenario, model=served_model, api_key=api_key,
                                     ignore_eos=not respect_eos)
        return results, wall, summarize(results, wall)

    if url:
        results, wall, summary = go(url)
    else:
        args = ["--parallel", str(parallel)] if parallel else []
        with err.status("starting a localrun server..."):
            server = localrun_server(model, *args)
            base_url = server.__enter__()
        try:
            results, wall, summary = go(base_url)
        finally:
            server.__exit__(None, None, None)
    render(out, summary, title=f"localrun bench · {url or 'localrun serve'}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"scenario": scenario.as_dict(), "url": url, "summary": summary,
                       "requests": [{"index": r.index, "ok": r.ok, "error": r.error, "ttft_s": r.ttft_s,
                                     "e2e_s": r.e2e_s, "completion_tokens": r.completion_tokens,
                                     "prompt_tokens": r.prompt_tokens, "timings": r.server_timings}
                                    for r in results]}, f, indent=1)
    if plot_path:
        plot(summary, results, plot_path)
        err.print(f"[dim]chart written to {plot_path}[/dim]")
    if summary["errors"] == summary["requests"]:
        raise UserError(f"every request failed: {summary['error_messages'][0]}")
