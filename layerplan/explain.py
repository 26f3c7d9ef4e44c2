"""The plan's reasons: one sentence each, in the field's words, naming what to change when a pin
cannot fit."""
from __future__ import annotations

from dataclasses import replace

from layerplan.candidates import Candidate, best_candidate, candidates, max_context
from layerplan.devices import Machine
from layerplan.kv_cache import LLAMA_CPP, LOCALRUN, kv_spec
from layerplan.model_profile import ModelProfile
from layerplan.placement import DeviceUsage, place
from layerplan.settings import PlanSettings
from layerplan.units import format_bytes as fb

SMALLER_KV = {LLAMA_CPP: "q8_0", LOCALRUN: "int8"}   # the 8-bit KV type a fix names, in each runtime's words


def smaller_kv(settings: PlanSettings) -> str:
    return SMALLER_KV[settings.runtime]


def _gpu_word(machine: Machine) -> str:
    return "GPUs" if len(machine.gpus) > 1 else "GPU"


def _which_end(profile: ModelProfile, k: int, machine: Machine) -> str:
    return (f"The {_gpu_word(machine)} take{'' if len(machine.gpus) > 1 else 's'} the last {k} layers, as "
            f"llama.cpp's -ngl does: activations cross to the GPU once per step, and the output head "
            f"({fb(profile.head_bytes)}) stays in RAM until every layer is on the GPU (-ngl {profile.n_layers + 1}).")


def _kv_total(usage: tuple[DeviceUsage, ...]) -> int:
    return sum(u.kv_bytes for u in usage)


def _over(usage: tuple[DeviceUsage, ...]) -> DeviceUsage:
    return next(u for u in usage if not u.fits)


def _need(u: DeviceUsage, margin: int) -> str:
    return (f"the {u.device.name} would need {fb(u.total_bytes)} of its {fb(u.budget_bytes)} budget "
            f"({fb(u.device.free_bytes)} free less the {fb(margin)} margin)")


def _with(settings: PlanSettings, **changes) -> PlanSettings:
    return replace(settings, **changes)


def _weights_only_layers(profile: ModelProfile, machine: Machine, settings: PlanSettings) -> int:
    """The most layers whose weights fit on the GPUs when their KV cache is not counted there."""
    no_kv = _with(settings, kv_offload=False)
    best = 0
    for k in range(profile.n_layers + 2):
        if all(u.fits for u in place(profile, machine, no_kv, k).usage[:-1]):
            best = k
    return best


def _smaller_kv_fits(profile: ModelProfile, machine: Machine, settings: PlanSettings, n_gpu_layers: int) -> bool:
    smaller = smaller_kv(settings)
    if settings.kv.bytes_for(32) <= kv_spec(smaller, settings.runtime).bytes_for(32):
        return False
    return place(profile, machine, _with(settings, kv_type=smaller), n_gpu_layers).fits


def explain_auto(profile: ModelProfile, machine: Machine, settings: PlanSettings, cands: list["Candidate"],
                 chosen: "Candidate") -> list[str]:

    n, k = profile.n_layers, chosen.n_gpu_layers
    usage, speed = chosen.placement.usage, chosen.predicted.decode_tok_s
    kv_name = settings.kv.name
    if not machine.gpus:
        return [f"There is no GPU, so all {n} layers and the KV cache ({fb(_kv_total(usage))} at {kv_name}) "
                "stay in host memory; pass --vram or --gpu to plan for one."]
    gpu_usage = usage[:-1]
    kv_gpu = sum(u.kv_bytes for u in gpu_usage)
    most = max(c.n_gpu_layers for c in cands if c.fits)
    reasons = []
    if k == n + 1:
        reasons.append(f"All {n} layers and the output head fit on the {_gpu_word(machine)} with their KV cache "
                       f"({fb(kv_gpu)} at {kv_name}), leaving {fb(min(u.headroom_bytes for u in gpu_usage))} "
                       "of headroom.")
    elif k < most:
        faster = next(c for c in cands if c.n_gpu_layers == most).predicted.decode_tok_s
        reasons.append(f"{k} GPU layers predict {speed:.1f} tok/s; up to {most} would fit, but are predicted "
                       f"no faster ({faster:.1f} tok/s), so that memory stays free.")
    else:
        weights_only = _weights_only_layers(profile, machine, settings) if settings.kv_offload else k
        if weights_only > k:
            shown = min(weights_only, n)
            reasons.append(f"{k} of {n} layers go to the {_gpu_word(machine)} so that their KV cache "
                           f"({fb(kv_gpu)} of {fb(_kv_total(usage))} at {kv_name}) fits beside them: the weights "
                           f"of {shown} layers would fit alone, but not with their KV cache.")
            alt = best_candidate(candidates(profile, machine, _with(settings, kv_offload=False),
                                            chosen.predicted.prompt_tokens))
            if alt is not None:
                alt_speed = alt.predicted.decode_tok_s
                verdict = ("faster; pass --no-kv-offload to take it" if alt_speed > speed
                           else "so keeping the KV cache beside its layers wins")
                reasons.append(f"Keeping all of the KV cache in RAM instead (--no-kv-offload) would put "
                               f"{min(alt.n_gpu_layers, n)} layers on the GPU at a predicted {alt_speed:.1f} "
                               f"tok/s against {speed:.1f}, {verdict}.")
        elif k == 0:
            gpu = gpu_usage[0]
            reasons.append(f"Not even one layer fits on the {gpu.device.name} beside its buffers "
                           f"({fb(cands[1].placement.usage[0].buffer_bytes)}), so everything runs on the CPU.")
        else:
            over = _over(cands[k + 1].placement.usage)
            reasons.append(f"{k} of {n} layers fit on the {_gpu_word(machine)} with their KV cache "
                           f"({fb(kv_gpu)} at {kv_name}); one more would overrun the {over.device.name} "
                           f"by {fb(-over.headroom_bytes)}.")
    if 0 < k <= n:
        reasons.append(_which_end(profile, k, machine))
    if not settings.kv_offload:
        reasons.append("All of the KV cache stays in host memory (--no-kv-offload), so attention reads it there.")
    return reasons


def moe_flag(profile: ModelProfile, n_cpu_moe: int) -> str:
    return "--cpu-moe" if n_cpu_moe >= profile.n_layers else f"--n-cpu-moe {n_cpu_moe}"


def explain_moe(profile: ModelProfile, machine: Machine, settings: PlanSettings, cands: list["Candidate"],
                chosen: "Candidate") -> list[str]:
    """All layers on the GPU with the routed experts of the first N layers in host memory."""

    n, k = profile.n_layers, chosen.n_cpu_moe
    host = chosen.placement.host
    in_ram = sum(layer.expert_bytes for layer in profile.layers[:k])
    read = in_ram * profile.n_expert_used / profile.n_expert
    which = "all" if k >= n else f"the first {k}"
    reasons = [f"All {n} layers and the output head go to the {_gpu_word(machine)} with the routed experts of "
               f"{which} layers in RAM ({moe_flag(profile, k)}: {fb(in_ram)}); a token reads only "
               f"{profile.n_expert_used} of {profile.n_expert} experts, {fb(read)} from RAM, so this predicts "
               f"{chosen.predicted.decode_tok_s:.1f} tok/s with {fb(host.headroom_bytes)} of RAM headroom."]
    layer_split = best_candidate(cands)
    if layer_split is not None and layer_split.n_gpu_layers <= n:
        reasons.append(f"Moving whole layers instead (-ngl {layer_split.n_gpu_layers}) would predict "
                       f"{layer_split.predicted.decode_tok_s:.1f} tok/s.")
    elif layer_split is None:
        reasons.append("No whole-layer split (-ngl) fits with this context; keeping experts in RAM is what makes "
                       "it fit.")
    return reasons


def explain_pinned(profile: ModelProfile, machine: Machine, settings: PlanSettings, cands: list["Candidate"],
                   chosen: "Candidate", best: "Candidate | None") -> list[str]:
    k = chosen.n_gpu_layers
    if chosen.fits:
        sentence = f"--gpu-layers {k} fits: predicted {chosen.predicted.decode_tok_s:.1f} tok/s"
        if best is not None and best.n_gpu_layers != k:
            sentence += f"; auto would choose {best.n_gpu_layers} at {best.predicted.decode_tok_s:.1f} tok/s"
        reasons = [sentence + "."]
        if chosen.n_cpu_moe:
            reasons.append(f"The routed experts of the first {chosen.n_cpu_moe} layers stay in RAM "
                           f"({moe_flag(profile, chosen.n_cpu_moe)}).")
        if 0 < k <= profile.n_layers:
            reasons.append(_which_end(profile, k, machine))
        return reasons
    over = _over(chosen.placement.usage)
    fixes = []
    fitting = [c.n_gpu_layers for c in cands if c.fits]
    if over.device.kind == "gpu" and any(f < k for f in fitting):
        fixes.append(f"lower --gpu-layers to {max(f for f in fitting if f < k)}")
    elif over.device.kind == "cpu" and any(f > k for f in fitting):
        fixes.append(f"raise --gpu-layers to {min(f for f in fitting if f > k)}")
    ctx = _max_ctx_below(profile, machine, settings, k)
    if ctx:
        fixes.append(f"lower --ctx to {ctx}")
    if _smaller_kv_fits(profile, machine, settings, k):
        fixes.append(f"use --kv-type {smaller_kv(settings)}")
    if not fixes:
        fixes.append("use a smaller quantization or a machine with more memory")
    return [f"--gpu-layers {k} does not fit: {_need(over, settings.margin_bytes)}; {', or '.join(fixes)}."]


def _max_ctx_below(profile: ModelProfile, machine: Machine, settings: PlanSettings, n_gpu_layers: int) -> int:

    return max_context(profile, machine, settings, n_gpu_layers, limit=settings.n_ctx - 1) if settings.n_ctx > 1 else 0


def explain_unfit(profile: ModelProfile, machine: Machine, settings: PlanSettings, cands: list["Candidate"],
                  pinned: "Candidate | None" = None) -> list[str]:
    """Nothing fits at any n_gpu_layers: say which device overflows and what to change."""
    shown = pinned or max((c for c in cands if all(u.fits for u in c.placement.usage[:-1])),
                          key=lambda c: c.n_gpu_layers, default=cands[0])
    over = _over(shown.placement.usage)
    fixes = []
    ctx = max(_max_ctx_below(profile, machine, settings, c.n_gpu_layers) for c in cands)
    if ctx:
        fixes.append(f"lower --ctx to {ctx}")
    if settings.n_parallel > 1:
        fixes.append("lower --parallel")
    if any(_smaller_kv_fits(profile, machine, settings, c.n_gpu_layers) for c in cands):
        fixes.append(f"use --kv-type {smaller_kv(settings)}")
    if not fixes:
        fixes.append("use a smaller quantization or a machine with more memory")
    where = f"with {shown.n_gpu_layers} layers on the GPU, " if machine.gpus else ""
    what = (f"{fb(over.weights_bytes)} weights, {fb(over.kv_bytes)} KV cache for "
            f"{settings.n_ctx} x {settings.n_parallel} tokens at {settings.kv.name}")
    return [f"Nothing fits at --ctx {settings.n_ctx} --parallel {settings.n_parallel}: {where}"
            f"{_need(over, settings.margin_bytes)} ({what}); {', or '.join(fixes)}."]
