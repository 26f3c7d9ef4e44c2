"""`localrun serve`: load a model and serve the OpenAI API on localhost with uvicorn."""
from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import sys
from typing import Optional

import typer
from rich.console import Console

from localrun.errors import UserError

err = Console(stderr=True, highlight=False)

DEFAULT_PARALLEL = 16


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """One clear sentence instead of uvicorn's traceback-and-exit when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(model: Optional[str] = typer.Argument(None, help="A .gguf path or a catalog name (default: smollm2-135m)."),
          host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
          port: int = typer.Option(8080, "--port", help="TCP port."),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LOCALRUN_API_KEY",
                                                help="Require 'Authorization: Bearer KEY' on every route but /health."),
          parallel: int = typer.Option(DEFAULT_PARALLEL, "--parallel", "-np",
                                       help="Requests decoded together (continuous batching)."),
          ctx: Optional[int] = typer.Option(None, "--ctx", "-c", help="Context size in tokens per request."),
          threads: Optional[int] = typer.Option(None, "--threads", "-t", help="CPU threads."),
          kv_type: Optional[str] = typer.Option(None, "--kv-type", help="KV cache type: f32, bf16, f16, int8, fp8."),
          no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Recompute every prompt."),
          alias: Optional[str] = typer.Option(None, "--alias", help="The model id clients use (default: the name given)."),
          max_body: int = typer.Option(8 * 2**20, "--max-body", help="Largest request body in bytes."),
          log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error.")):
    """Serve the OpenAI API (chat, completions, models), /health and /metrics, batching all requests."""
    import uvicorn

    from localrun.api import LLM
    from localrun.server.app import ServerConfig, create_app

    if not 0 < port < 65536:
        raise UserError(f"--port must be between 1 and 65535, got {port}")
    if log_level not in ("debug", "info", "warning", "error"):
        raise UserError(f"--log-level must be debug, info, warning or error, got '{log_level}'")
    if not is_loopback(host) and not api_key:
        err.print(f"[yellow]warning:[/yellow] listening on {host} without --api-key: anyone who can reach "
                  "this address can use the model")
    check_port_free(host, port)
    with err.status("loading model..."):
        llm = LLM(model, n_ctx=ctx, n_threads=threads, kv_type=kv_type, n_parallel=parallel,
                  enable_prefix_caching=not no_prefix_cache)
        llm.engine    # build the KV pool now, not on the first request
    name = alias or (model if model and not model.endswith(".gguf") else llm.model_path.stem)
    aliases = frozenset({llm.model_path.name, llm.model_path.stem, str(llm.model_path)} - {name})
    app = create_app(llm, ServerConfig(name, aliases, api_key, max_body))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("localrun").setLevel(log_level.upper())
    stats = llm.engine.stats()
    err.print(f"[dim]{name} · ctx {llm.n_ctx} · {parallel} parallel · KV {stats['num_blocks_total']} blocks of "
              f"{stats['block_size']} ({stats['kv_type']}) · {llm.n_threads} threads[/dim]")
    err.print(f"serving on http://{host}:{port}/v1  (metrics at /metrics; Ctrl-C stops)")
    # uvicorn re-raises the signal that stopped it once it is done; after a clean shutdown that
    # should be exit status 0, not "killed by SIGTERM" or a KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                access_log=log_level == "debug")
