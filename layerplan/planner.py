"""The planner: choose n_gpu_layers for a model on a machine, or check the user's pins, and say why.

`--gpu-layers auto` evaluates every n_gpu_layers from 0 to n_layers + 1, keeps those whose
predicted peak fits every device's budget (free memory minus the margin), and takes the one
with the best predicted decode speed at the requested context x parallel (on a near tie,
within TIE, the one with more layers on the GPU). It does not maximize bytes on the GPU: the
KV cache lives with its layer, so each offloaded layer brings its share of the cache along.
Pins (n_gpu_layers, n_ctx, kv_type, n_parallel) are never changed; a pin that cannot fit
gives a plan with fits=False and one sentence naming what to change.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from layerplan.candidates import TIE, Candidate, best_candidate, candidates, max_context, moe_candidates  # noqa: F401
from layerplan.devices import Machine
from layerplan.explain import explain_auto, explain_moe, explain_pinned, explain_unfit
from layerplan.kv_cache import DEFAULT_KV_TYPE, LLAMA_CPP, kv_bytes_per_token
from layerplan.model_profile import ModelProfile
from layerplan.placement import DeviceUsage, LayerSizes, Placement
from layerplan.settings import DEFAULT_CTX, DEFAULT_MARGIN, DEFAULT_PROMPT_TOKENS, DEFAULT_UBATCH, PlanSettings
from layerplan.speed import Predicted
from layerplan.units import format_bytes as fb

MIN_AUTO_CTX = 256    # an unpinned context is halved down to this when the default does not fit


class PlanError(ValueError):
    """A request no plan can answer (layers pinned to a GPU on a machine without one, bad values)."""


@dataclass(frozen=True)
class SweepRow:
    n_gpu_layers: int
    fits: bool             # at the requested context and parallel
    decode_tok_s: float    # predicted at the requested context and parallel
    max_ctx: int           # the largest context per sequence that fits at this n_gpu_layers (0: none),
                           # searched up to max(trained context, requested context)


@dataclass(frozen=True)
class Plan:
    profile: ModelProfile
    machine: Machine
    settings: PlanSettings
    placement: Placement
    predicted: Predicted
    fits: bool
    reasons: tuple[str, ...]
    sweep: tuple[SweepRow, ...]
    auto: bool             # n_gpu_layers was chosen by the planner, not pinned
    menu: tuple = ()       # the Pareto menu of trade-offs (layerplan.frontier.MenuEntry), when asked for
    preference: str | None = None  # --prefer speed|context|parallel, when the plan is the menu's pick
    threads: object = None # layerplan.threads.ThreadAdvice for this machine, when asked for
    ledger: object = None  # layerplan.ledger.Ledger: the memory as localrun's engine holds it, when asked for

    @property
    def n_gpu_layers(self) -> int:
        return self.placement.n_gpu_layers

    @property
    def n_cpu_moe(self) -> int:
        return self.placement.n_cpu_moe

    @property
    def n_layers(self) -> int:
        return self.profile.n_layers

    @property
    def usage(self) -> tuple[DeviceUsage, ...]:
        return self.placement.usage

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers at the plan's KV type."""
        return kv_bytes_per_token(self.profile, self.settings.kv)

    def kv_budget_bytes(self) -> tuple[int, ...]:
        """Per device (machine order), the bytes localrun's engine may give its KV pool there:
        what the plan puts there plus the headroom left (less when the device is over budget,
        so the pool holds what there is instead of failing later), for devices that hold KV
        cache; 0 elsewhere. The engine sizes its pool with these (localrun/placement.py)."""
        return tuple(max(0, u.kv_bytes + u.headroom_bytes) if u.kv_bytes else 0 for u in self.usage)


def sweep(profile: ModelProfile, machine: Machine, settings: PlanSettings, cands: list[Candidate]) -> tuple[SweepRow, ...]:
    limit = max(profile.n_ctx_train, settings.n_ctx)
    return tuple(SweepRow(c.n_gpu_layers, c.fits, c.predicted.decode_tok_s,
                          max_context(profile, machine, settings, c.n_gpu_layers, limit)) for c in cands)


def _pinned_moe(profile: ModelProfile, n_cpu_moe: int | None, notes: list[str]) -> int | None:
    if n_cpu_moe is None:
        return None
    if n_cpu_moe < 0:
        raise PlanError("--n-cpu-moe must be 'auto' or a number from 0 up")
    if n_cpu_moe and not profile.is_moe:
        raise PlanError(f"--n-cpu-moe {n_cpu_moe} applies to MoE models only, and {profile.name} has no expert tensors")
    if n_cpu_moe > profile.n_layers:
        notes.append(f"--n-cpu-moe {n_cpu_moe} means all {profile.n_layers} layers' experts (--cpu-moe).")
    return min(n_cpu_moe, profile.n_layers)


MAX_DEVICE_BYTES = 1 << 42  # 4 TiB: more than any GPU or desktop has; a bigger --vram or --ram is a typo


def check_machine(machine: Machine, margin_bytes: int) -> None:
    """Memory sizes a user described (--vram, --ram) that no plan could use: one sentence each."""
    described = [(f"--vram {fb(g.free_bytes)}", g) for g in machine.gpus if g.index is None]
    if "--ram" in machine.host.source:
        described.append((f"--ram {fb(machine.host.free_bytes)}", machine.host))
    for flag, device in described:
        if device.free_bytes > MAX_DEVICE_BYTES:
            raise PlanError(f"{flag} is more memory than any {device.kind.upper()} has; write the size like 24GiB")
        if device.free_bytes <= margin_bytes:
            raise PlanError(f"{flag} leaves nothing once the {fb(margin_bytes)} margin is kept free; give the "
                            "device's free memory (more than the margin) or lower --margin")


def check_pins_can_fit(profile: ModelProfile, machine: Machine, settings: PlanSettings, pinned: list[str]) -> None:
    """Pins (context, parallel count, KV type) whose KV cache alone exceeds all of the machine's
    memory (every GPU and the host, less margins) fit in no placement and with no weights at all.
    (A pin that fits some other way, with fewer GPU layers or a smaller context, gives a plan that
    does not fit and says what to change, instead.)"""
    if not pinned:
        return
    kv = sum(LayerSizes(profile, settings).kv)
    everything = sum(max(0, d.free_bytes - settings.margin_bytes) for d in machine.devices)
    if kv > everything:
        raise PlanError(f"{' '.join(pinned)} can never fit: its KV cache alone ({fb(kv)} at {settings.kv.name}) is "
                        f"more than the {fb(everything)} this machine has in all (GPUs and RAM, less margins); lower "
                        "--ctx or --parallel, or use a smaller --kv-type")


def _evaluate(profile: ModelProfile, machine: Machine, settings: PlanSettings, prompt_tokens: int,
              n_gpu_layers: int | None, n_cpu_moe: int | None) -> tuple[list[Candidate], list[Candidate]]:
    """(the n_gpu_layers sweep at the pinned or zero n_cpu_moe, the experts-in-RAM placements
    that may also be chosen: only when neither pin rules them out)."""
    cands = candidates(profile, machine, settings, prompt_tokens, n_cpu_moe=n_cpu_moe or 0)
    free_moe = n_cpu_moe is None and n_gpu_layers in (None, profile.n_layers + 1)
    return cands, moe_candidates(profile, machine, settings, prompt_tokens) if free_moe else []


def plan(profile: ModelProfile, machine: Machine, *, n_ctx: int | None = None, n_parallel: int = 1,
         kv_type: str = DEFAULT_KV_TYPE, n_ubatch: int = DEFAULT_UBATCH, margin_bytes: int = DEFAULT_MARGIN,
         n_gpu_layers: int | None = None, kv_offload: bool = True, flash_attention: bool = True,
         prompt_tokens: int = DEFAULT_PROMPT_TOKENS, with_sweep: bool = True,
         n_cpu_moe: int | None = None, runtime: str = LLAMA_CPP) -> Plan:
    """Plan `profile` on `machine`. None for n_ctx, n_gpu_layers or n_cpu_moe means: the planner
    chooses (n_cpu_moe: the routed experts of the first N layers kept in host memory, MoE only).
    runtime: whose KV layouts size the cache, "llama.cpp" or "localrun" (the engine's; PlanSettings).

    n_ctx is per sequence (n_parallel sequences each get n_ctx tokens of KV cache). The
    unpinned context is min(trained context, 4096), halved while nothing fits.
    """
    n = profile.n_layers
    notes = []
    if profile.is_moe:
        notes.append(f"localrun's engine does not run MoE models yet ({profile.n_expert} experts, "
                     f"{profile.n_expert_used} used per token): this plan is for llama.cpp (--emit llama-server).")
    if n_gpu_layers is not None:
        if n_gpu_layers < 0:
            raise PlanError("--gpu-layers must be 'auto' or a number from 0 up")
        if n_gpu_layers > n + 1:
            notes.append(f"--gpu-layers {n_gpu_layers} means all: {n + 1} ({n} layers and the output head).")
            n_gpu_layers = n + 1
        if n_gpu_layers and not machine.gpus:
            raise PlanError(f"--gpu-layers {n_gpu_layers} needs a GPU and none was found; pass --vram 24GiB or "
                            "--gpu rtx4090 to plan for one, or use --gpu-layers 0")
    n_cpu_moe = _pinned_moe(profile, n_cpu_moe, notes)
    try:
        settings = PlanSettings(n_ctx=n_ctx or min(profile.n_ctx_train, DEFAULT_CTX), n_parallel=n_parallel,
                                kv_type=kv_type, n_ubatch=n_ubatch, margin_bytes=margin_bytes,
                                kv_offload=kv_offload, flash_attention=flash_attention, runtime=runtime)
    except ValueError as err:
        raise PlanError(str(err)) from None
    if n_ctx and n_ctx > profile.n_ctx_train:
        notes.append(f"--ctx {n_ctx} is beyond the {profile.n_ctx_train} tokens the model was trained for; "
                     "quality may drop past that.")

    cands, moe = _evaluate(profile, machine, settings, prompt_tokens, n_gpu_layers, n_cpu_moe)
    if n_gpu_layers is None and n_ctx is None:
        requested = settings.n_ctx
        while best_candidate(cands + moe) is None and settings.n_ctx > MIN_AUTO_CTX:
            settings = replace(settings, n_ctx=max(MIN_AUTO_CTX, settings.n_ctx // 2))
            cands, moe = _evaluate(profile, machine, settings, prompt_tokens, n_gpu_layers, n_cpu_moe)
        if settings.n_ctx != requested and best_candidate(cands + moe):
            notes.append(f"The context was lowered from {requested} to {settings.n_ctx} tokens so that the KV "
                         "cache fits; pass --ctx to choose it.")

    best = best_candidate(cands + moe)
    if n_gpu_layers is not None:
        chosen = best_candidate([cands[n_gpu_layers]] + moe) or cands[n_gpu_layers]
        reasons = (explain_pinned(profile, machine, settings, cands, chosen, best) if chosen.fits or best
                   else explain_unfit(profile, machine, settings, cands, pinned=chosen))
    elif best is not None:
        chosen = best
        reasons = (explain_moe(profile, machine, settings, cands, chosen) if chosen.n_cpu_moe
                   else explain_auto(profile, machine, settings, cands, chosen))
    else:  # nothing fits: show the plan with the most on the GPUs that still fits them, and say what to change
        gpus_fit = [c for c in cands + moe if all(u.fits for u in c.placement.usage[:-1])]
        chosen = max(gpus_fit or cands[:1], key=lambda c: (c.n_gpu_layers, -c.n_cpu_moe))
        reasons = explain_unfit(profile, machine, settings, cands)
    return Plan(profile, machine, settings, chosen.placement, chosen.predicted, chosen.fits,
                tuple(notes + reasons), sweep(profile, machine, settings, cands) if with_sweep else (),
                auto=n_gpu_layers is None)
