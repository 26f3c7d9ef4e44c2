"""`localrun serve`: load a model and serve the OpenAI API on localhost with uvicorn."""
from __future__ import annotations

import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
from typing import List, Optional

import typer
from rich.console import Console

from localrun.cli.options import (CacheDirOpt, CacheDiskOpt, CacheRamOpt, CtxOpt, DraftMaxOpt, DraftModelOpt,
                                   GpuLayersOpt, KvBudgetOpt, KvTypeOpt, MaxBatchedTokensOpt, ModelArg,
                                   NoChunkedPrefillOpt, NoDiskCacheOpt, NoPrefixCacheOpt, OutputReserveOpt, ParallelOpt,
                                   PromptMathOpt, ScheduleOpt, SpecOpt, ThreadsOpt, engine_config, load_llm, warn_template)
from localrun.errors import UserError
from localrun.server import DEFAULT_MAX_QUEUE

err = Console(stderr=True, highlight=False)

API_KEY_ENV = "LOCALRUN_API_KEY"
DEFAULT_BATCHED_TOKENS = 512    # serve's step budget: a prompt chunk that keeps running decodes moving


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


def check_api_key(api_key: str | None, from_env: bool) -> None:
    """A key that cannot work (server.guard.api_key_problem) is refused at start, naming where it
    came from. click reads an empty LOCALRUN_API_KEY as unset: that must not start a server
    without authentication either."""
    from localrun.server.guard import api_key_problem
    if api_key is None:
        if os.environ.get(API_KEY_ENV) is not None:
            raise UserError(f"{API_KEY_ENV} is set but empty (an empty key would let every request in); "
                            "give a key or unset it")
        return
    problem = api_key_problem(api_key)
    if problem is not None and from_env:
        raise UserError(f"{API_KEY_ENV} {problem}; give another key or unset it")
    if problem is not None:
        raise UserError(f"--api-key {problem}; give another key or leave the option out")


def access_policy(host: str, origins: list[str], hosts: list[str]):
    """The Host/Origin policy (server.guard): loopback Host names only while bound to loopback."""
    from localrun.server.guard import AccessPolicy, parse_host
    for origin in origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise UserError(f"--allow-origin takes an origin such as http://localhost:3000 or '*', got '{origin}'")
    for name in hosts:
        if name != "*" and parse_host(name) is None:
            raise UserError(f"--allow-host takes a host name such as myhost.lan or '*', got '{name}'")
    return AccessPolicy(allowed_hosts=tuple(hosts), allowed_origins=tuple(origins),
                        check_host=is_loopback(host), scheme="http")     # uvicorn runs without TLS here


def serve(command: typer.Context, model: Optional[str] = ModelArg,
          host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
          port: int = typer.Option(8080, "--port", help="TCP port."),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV,
                                                help="Require 'Authorization: Bearer KEY' on every route but /health."),
          parallel: int = ParallelOpt, ctx: Optional[int] = CtxOpt, threads: Optional[int] = ThreadsOpt,
          kv_type: Optional[str] = KvTypeOpt, max_batched_tokens: Optional[int] = MaxBatchedTokensOpt,
          no_chunked_prefill: bool = NoChunkedPrefillOpt, kv_budget: Optional[str] = KvBudgetOpt,
          no_prefix_cache: bool = NoPrefixCacheOpt, cache_dir: Optional[str] = CacheDirOpt,
          no_disk_cache: bool = NoDiskCacheOpt, cache_disk: Optional[str] = CacheDiskOpt,
          cache_ram: Optional[str] = CacheRamOpt, gpu_layers: str = GpuLayersOpt, prompt_math: str = PromptMathOpt,
          draft_model: Optional[str] = DraftModelOpt, spec: Optional[str] = SpecOpt, draft_max: int = DraftMaxOpt,
          alias: Optional[str] = typer.Option(None, "--alias", help="The model id clients use (default: the name given)."),
          strict_model_name: bool = typer.Option(False, "--strict-model-name", help="Answer 404 to requests naming "
                                                 "another model (default: serve the one model under any name)."),
          itl_target_ms: float = typer.Option(0.0, "--itl-target-ms", help="Hold each step that carries "
                                              "decodes to this many ms, prompt chunks sized from measured step "
                                              "times (default 0: off, fixed --max-batched-tokens chunks)."),
          max_queue: int = typer.Option(DEFAULT_MAX_QUEUE, "--max-queue", help="Requests waiting for their first step past "
                                        "which new ones get 503 with Retry-After (at least 1)."),
          schedule: str = ScheduleOpt, output_reserve: int = OutputReserveOpt,
          max_body: int = typer.Option(8 * 2**20, "--max-body", help="Largest request body in bytes (also "
                                       "bounded by what the context can hold)."),
          allow_origin: Optional[List[str]] = typer.Option(None, "--allow-origin", help="A web origin allowed to "
                                                           "call the API from a browser (CORS), e.g. "
                                                           "http://localhost:3000; repeatable; '*' allows any."),
          allow_host: Optional[List[str]] = typer.Option(None, "--allow-host", help="A Host name accepted besides "
                                                         "loopback ones (DNS-rebinding guard); repeatable; '*' any."),
          log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error.")):
    """Serve the OpenAI API (chat, completions, models), /health and /metrics, batching all requests."""
    if not 0 < port < 65536:
        raise UserError(f"--port must be between 1 and 65535, got {port}")
    if itl_target_ms < 0:
        raise UserError(f"--itl-target-ms must be positive (or 0 for off), got {itl_target_ms}")
    if max_queue < 1:
        raise UserError(f"--max-queue must be at least 1, got {max_queue}")
    if log_level not in ("debug", "info", "warning", "error"):
        raise UserError(f"--log-level must be debug, info, warning or error, got '{log_level}'")
    check_api_key(api_key, from_env=command.get_parameter_source("api_key").name == "ENVIRONMENT")
    access = access_policy(host, allow_origin or [], allow_host or [])
    if not is_loopback(host) and not api_key:
        err.print(f"[yellow]warning:[/yellow] listening on {host} without --api-key: anyone who can reach "
                  "this address can use the model")
    config = engine_config(ctx=ctx, threads=threads, kv_type=kv_type, gpu_layers=gpu_layers, draft_model=draft_model,
                           spec=spec, draft_max=draft_max, cache_dir=cache_dir, no_disk_cache=no_disk_cache,
                           cache_disk=cache_disk, cache_ram=cache_ram, prompt_math=prompt_math, n_parallel=parallel,
                           max_num_batched_tokens=max_batched_tokens or DEFAULT_BATCHED_TOKENS,
                           enable_chunked_prefill=not no_chunked_prefill, kv_budget_bytes=kv_budget,
                           enable_prefix_caching=not no_prefix_cache, scheduling=schedule,
                           output_reserve_tokens=output_reserve)
    check_port_free(host, port)
    llm = load_llm(model, config, max_batched_tokens=max_batched_tokens, default_batched_tokens=DEFAULT_BATCHED_TOKENS)
    if itl_target_ms:
        llm.engine.set_itl_target(itl_target_ms / 1000)
    warn_template(llm)     # the template's check (its compile, seconds for a large one) before serving
    import uvicorn    # the server after the model: a bad model name is refused before torch loads

    from localrun.models import DEFAULT_MODEL
    from localrun.server.app import ServerConfig, create_app
    from localrun.server.timeouts import uvicorn_options
    given = model or DEFAULT_MODEL
    name = alias or (given if not given.endswith(".gguf") else llm.model_path.stem)
    aliases = frozenset({llm.model_path.name, llm.model_path.stem, str(llm.model_path)} - {name})
    app = create_app(llm, ServerConfig(name, aliases, api_key, max_body, access=access,
                                       strict_model_name=strict_model_name, max_queue=max_queue))
    # What start-up made (torch, the model, the app: ~200k objects with SmolLM2) moves to the
    # collector's permanent generation, so a full collection walks only what serving made since:
    # 1.7 ms instead of 88 ms, a pause of the event loop and the engine alike (vLLM does the same)
    gc.collect()
    gc.freeze()
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
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                    access_log=log_level == "debug", **uvicorn_options())
    finally:
        llm.close()       # pending disk-cache writes
