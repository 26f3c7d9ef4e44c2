"""`localrun plan`: where each part of a model goes on this (or a described) machine, and how fast
it will run. Thin: parses options, asks layerplan, renders with rich. Never imports torch
(except `--measure`, which may time a CUDA GPU through torch)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from localrun.cli.options import GpuLayersOpt
from localrun.errors import UserError
from localrun.placement import parse_layer_count

EMIT_TARGETS = ("llama-server", "vllm")


def load_profile(model: str):
    """A .gguf path, a catalog name, or a built-in shape ('llama3.1-8b:q4_k_m') -> ModelProfile."""
    import layerplan
    from layerplan.builtin_shapes import parse_shape_name
    from localrun.models import catalog, resolve_model

    try:
        path = Path(model).expanduser()
        if path.is_file():
            return layerplan.profile_gguf(path)
        if parse_shape_name(model) is not None:
            return layerplan.profile_builtin(model)
        if model in catalog():
            return layerplan.profile_gguf(resolve_model(model, pull_missing=False))
    except (layerplan.GGUFFormatError, ValueError) as err:
        raise UserError(str(err)) from None
    raise UserError(f"'{model}' is not a .gguf file, a catalog model ({', '.join(sorted(catalog()))}) or a "
                    f"built-in shape ({', '.join(layerplan.SHAPES)}, with a suffix such as :f16, :q8_0 or :q4_k_m)")


def _engine_compute() -> tuple[str, int | None]:
    """The engine's compute dtype and thread count, for `--measure` (which may import torch)."""
    try:
        from localrun.api import default_dtype, default_threads
    except ImportError:  # no torch: numpy measures f32
        return "f32", None
    return str(default_dtype()).removeprefix("torch."), default_threads()


def plan(
    model: Annotated[str, typer.Argument(help="A .gguf file, a catalog name, or a built-in shape such as "
                                              "llama3.1-8b:q4_k_m.", show_default=False)],
    gpu_layers: str = GpuLayersOpt,
    cpu_moe: Annotated[str, typer.Option("--n-cpu-moe", help="MoE models: 'auto', or keep the routed experts of "
                                         "the first N layers in RAM (llama.cpp's --n-cpu-moe).")] = "auto",
    ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", help="Context per sequence, in tokens "
                                               "[default: min(trained, 4096), lowered if it does not fit].",
                                               show_default=False)] = None,
    parallel: Annotated[Optional[int], typer.Option("--parallel", "-np", help="Sequences decoding together, each "
                                                    "with --ctx tokens of KV cache [default: 1].",
                                                    show_default=False)] = None,
    kv_type: Annotated[Optional[str], typer.Option("--kv-type", help="KV cache type: f32, bf16, f16, int8 (q8_0), "
                                                   "fp8 [default: f16]; with --emit, also llama.cpp's q4_0, q5_1, ...",
                                                   show_default=False)] = None,
    prefer: Annotated[Optional[str], typer.Option("--prefer", help="Take the menu's entry with the best: speed, "
                                                  "context or parallel (of what --ctx, --kv-type and --parallel "
                                                  "leave free).", show_default=False)] = None,
    batch: Annotated[int, typer.Option("--batch", help="Prompt tokens per prefill step (llama.cpp's -ub).")] = 512,
    vram: Annotated[Optional[list[str]], typer.Option("--vram", help="Plan for a GPU with this much free memory "
                                                      "(repeat for several GPUs), e.g. 24GiB.", show_default=False)] = None,
    gpu: Annotated[Optional[list[str]], typer.Option("--gpu", help="Plan for a GPU preset (repeatable): rtx4090, "
                                                     "rtx3090, rtx4060ti-16, a100-80, ...", show_default=False)] = None,
    ram: Annotated[Optional[str], typer.Option("--ram", help="Plan for this much host memory, e.g. 64GiB.",
                                               show_default=False)] = None,
    margin: Annotated[str, typer.Option("--margin", help="Memory kept free on every device.")] = "512MiB",
    no_kv_offload: Annotated[bool, typer.Option("--no-kv-offload", "-nkvo", help="Keep all KV cache in host "
                                                "memory (llama.cpp's -nkvo).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON object.")] = False,
    emit: Annotated[Optional[str], typer.Option("--emit", help="Print a launch command instead: llama-server or vllm.",
                                                show_default=False)] = None,
    measure: Annotated[bool, typer.Option("--measure", help="Measure this machine's bandwidth and compute first "
                                          "(cached under $LOCALRUN_HOME).")] = False,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt length for the predicted "
                                               "prefill speed and time to first token.")] = 512,
) -> None:
    """Plan where each layer, its KV cache and the buffers go (GPU or host), with predicted speed."""
    import layerplan
    from layerplan import calibrate
    from layerplan.frontier import PREFERENCES, plan_menu
    from layerplan.kv_cache import LLAMA_CPP, LOCALRUN, engine_kv_type
    from layerplan.units import parse_bytes

    from localrun.engine_build import engine_build

    if emit is not None and emit not in EMIT_TARGETS:
        raise UserError(f"--emit takes {' or '.join(EMIT_TARGETS)}, not '{emit}'")
    if prefer is not None and prefer not in PREFERENCES:
        raise UserError(f"--prefer takes {', '.join(PREFERENCES)}, not '{prefer}'")
    for flag, value in (("--ctx", ctx), ("--parallel", parallel), ("--batch", batch), ("--prompt-tokens", prompt_tokens)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be an integer >= 1, got {value}.")
    n_gpu_layers = parse_layer_count(gpu_layers)
    n_cpu_moe = parse_layer_count(cpu_moe, "n_cpu_moe")
    profile = load_profile(model)
    # a plan for localrun's engine sizes its KV layouts and takes its KV types; one for another
    # runtime (--emit, or a MoE model, which the engine does not run) sizes llama.cpp's
    runtime = LLAMA_CPP if emit is not None or profile.is_moe else LOCALRUN
    if runtime == LOCALRUN and kv_type is not None:
        try:
            kv_type = engine_kv_type(kv_type, option="--kv-type")
        except ValueError as err:
            raise UserError(str(err)) from None
    try:
        local = layerplan.build_machine()
        # this model's engine figures, where timed with the kernels this localrun runs
        calibration = calibrate.load(local, model=profile.path, engine_build=engine_build())
        stale = calibrate.load(local, model=profile.path)
        if not measure and stale is not None and stale.engine_key and stale != calibration:
            typer.echo("the engine calibration here was taken with another build of localrun's kernels, so its "
                       "speeds are not used; --measure retakes it (a few minutes)", err=True)
        if measure:
            dtype, threads = _engine_compute()
            calibration = calibrate.measure(local, dtype=dtype, threads=threads)
            if profile.path and not profile.is_moe and threads is not None:  # the engine runs it: time the engine
                from localrun.calibrate_engine import measure_engine
                typer.echo(f"timing localrun's engine on {profile.name}: a few minutes (each timing is taken in rounds "
                           "spread over them, as the host's speed moves)", err=True)
                calibration = measure_engine(profile.path, calibration, threads, say=lambda line: typer.echo(line, err=True))
            saved = calibrate.save(calibration)
            where = (f"saved to {saved}" if saved else f"NOT saved: {calibration.suspect_reason}; "
                     "rerun --measure when the machine is quiet")
            typer.echo(f"measured: host {calibration.host_bandwidth / 1e9:.1f} GB/s, {calibration.host_flops / 1e9:.0f} "
                       f"GFLOP/s; {len(calibration.gpus)} GPU(s); {where}", err=True)
        machine = layerplan.build_machine(vram=vram, gpu=gpu, ram=ram, calibration=calibration)
        result = plan_menu(profile, machine, preference=prefer, n_ctx=ctx, n_parallel=parallel, kv_type=kv_type,
                           n_ubatch=batch, margin_bytes=parse_bytes(margin), n_gpu_layers=n_gpu_layers,
                           kv_offload=not no_kv_offload, prompt_tokens=prompt_tokens, n_cpu_moe=n_cpu_moe,
                           runtime=runtime)
    except ValueError as err:  # PlanError, bad sizes, unknown presets or KV types
        raise UserError(str(err)) from None
    from dataclasses import replace

    from layerplan.ledger import engine_ledger
    from layerplan.threads import advise_threads
    ledger = engine_ledger(result) if runtime == LOCALRUN else None
    result = replace(result, threads=advise_threads(), ledger=ledger)

    if emit == "llama-server":
        typer.echo(layerplan.llama_server_command(result))
    elif emit == "vllm":
        from layerplan.builtin_shapes import parse_shape_name
        shape = parse_shape_name(profile.name) if profile.source == "built-in" else None
        typer.echo(layerplan.vllm_command(result, hf_repo=shape[0].hf_repo if shape else None))
    elif json_out:
        typer.echo(json.dumps(layerplan.plan_to_dict(result)))
    else:
        from layerplan.view import render_plan
        render_plan(result)
    if not result.fits:
        raise typer.Exit(1)
