"""The candidate placements the planner chooses among: every n_gpu_layers (or, for a MoE model,
every count of layers whose experts stay in RAM) placed and predicted, the best of them, and the
largest context a placement fits. planner.py chooses and explain.py says why, both from here."""
from __future__ import annotations

from dataclasses import dataclass, replace

from layerplan.devices import Machine
from layerplan.model_profile import ModelProfile
from layerplan.placement import LayerSizes, Placement, place
from layerplan.settings import DEFAULT_PROMPT_TOKENS, PlanSettings
from layerplan.speed import Predicted, predict

TIE = 0.01            # decode speeds this close count as equal; the plan with more GPU layers wins


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    predicted: Predicted

    @property
    def n_gpu_layers(self) -> int:
        return self.placement.n_gpu_layers

    @property
    def n_cpu_moe(self) -> int:
        return self.placement.n_cpu_moe

    @property
    def fits(self) -> bool:
        return self.placement.fits


def candidates(profile: ModelProfile, machine: Machine, settings: PlanSettings,
               prompt_tokens: int = DEFAULT_PROMPT_TOKENS, n_cpu_moe: int = 0) -> list[Candidate]:
    """Every n_gpu_layers this machine allows (0 only, without a GPU), placed and predicted;
    the list's index is n_gpu_layers."""
    sizes = LayerSizes(profile, settings)
    top = profile.n_layers + 1 if machine.gpus else 0
    result = []
    for n_gpu_layers in range(top + 1):
        placement = place(profile, machine, settings, n_gpu_layers, sizes, n_cpu_moe=n_cpu_moe)
        result.append(Candidate(placement, predict(profile, machine, placement, settings, prompt_tokens=prompt_tokens)))
    return result


def moe_candidates(profile: ModelProfile, machine: Machine, settings: PlanSettings,
                   prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> list[Candidate]:
    """For a MoE model on a machine with a GPU: every layer on the GPU with the routed experts of
    the first N layers in host memory, N = 1 .. n_layers (llama.cpp's -ngl all --n-cpu-moe N;
    N = n_layers is --cpu-moe). Empty for a dense model or without a GPU."""
    if not profile.is_moe or not machine.gpus:
        return []
    sizes, n = LayerSizes(profile, settings), profile.n_layers
    result = []
    for n_cpu_moe in range(1, n + 1):
        placement = place(profile, machine, settings, n + 1, sizes, n_cpu_moe=n_cpu_moe)
        result.append(Candidate(placement, predict(profile, machine, placement, settings, prompt_tokens=prompt_tokens)))
    return result


def best_candidate(cands: list[Candidate]) -> Candidate | None:
    """The fitting candidate with the best decode speed (on a near tie, more GPU layers, then fewer
    experts in RAM); None if none fits."""
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return None
    best = max(c.predicted.decode_tok_s for c in fitting)
    return max((c for c in fitting if c.predicted.decode_tok_s >= best * (1 - TIE)),
               key=lambda c: (c.n_gpu_layers, -c.n_cpu_moe))


def max_context(profile: ModelProfile, machine: Machine, settings: PlanSettings, n_gpu_layers: int,
                limit: int | None = None) -> int:
    """The largest context per sequence (at most `limit`, default the trained context) that fits
    with `n_gpu_layers` at the other settings; 0 when not even one token does."""
    limit = limit or profile.n_ctx_train

    def fits(n_ctx: int) -> bool:
        return place(profile, machine, replace(settings, n_ctx=n_ctx), n_gpu_layers).fits

    if not fits(1):
        return 0
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
