"""The menu of trade-offs: a small Pareto frontier over context x KV type x parallel sequences,
each with the GPU layers (and, for MoE, experts in RAM) the planner would choose for it.

Every setting of the grid that fits is planned as `--gpu-layers auto` would plan it. An entry
stays on the menu unless another entry is at least as good on every axis a user trades
(more context, more parallel sequences, a more precise KV type, faster decode per sequence)
and better on one: so "32k f16 KV, 41 tok/s" and "64k q8_0 KV, 35 tok/s" both stay, while
"16k q8_0 KV, 35 tok/s" goes when "16k f16 KV, 41 tok/s" fits. Prefill speed and memory are
shown for each entry but are not traded on.

`--prefer` picks one entry:
- `speed`: the fastest decode per sequence; on a tie (within 1%) the larger context, then the
  more precise KV type;
- `context`: the largest context per sequence; on a tie the faster decode;
- `parallel`: the most parallel sequences; on a tie the larger total decode throughput.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from layerplan.devices import Machine
from layerplan.kv_cache import DEFAULT_KV_TYPE, LLAMA_CPP, LOCALRUN, kv_type
from layerplan.model_profile import ModelProfile
from layerplan.placement import LayerSizes, place
from layerplan.settings import PlanSettings
from layerplan.speed import predict

KV_CHOICES = {LLAMA_CPP: ("f16", "q8_0"), LOCALRUN: ("f16", "int8")}  # per runtime; others when pinned with --kv-type
PARALLEL_CHOICES = (1, 2, 4)
MAX_CONTEXTS = 5          # the requested context and up to four doublings, within the trained context
PREFERENCES = ("speed", "context", "parallel")
TIE = 0.01


@dataclass(frozen=True)
class MenuEntry:
    n_ctx: int                # per sequence
    kv_type: str
    n_parallel: int
    n_gpu_layers: int
    n_cpu_moe: int
    decode_tok_s: float       # per sequence, at the same cache fill for every entry (see frontier())
    decode_tok_s_total: float
    prefill_tok_s: float
    gpu_bytes: int            # weights + KV + buffers over all GPUs
    host_bytes: int

    @property
    def kv_precision(self) -> float:
        """Bytes per cached value as llama.cpp stores it: more is more precise (f16 2, q8_0 and the
        engine's int8 1.06, q4_0 0.56): a ranking, the same for either runtime's names."""
        return kv_type(self.kv_type).bytes_for(1)


def dominates(a: MenuEntry, b: MenuEntry) -> bool:
    """a is at least as good as b on every traded axis (decode speed within TIE counts as equal)
    and strictly better on one."""
    ge = (a.n_ctx >= b.n_ctx and a.n_parallel >= b.n_parallel and a.kv_precision >= b.kv_precision
          and a.decode_tok_s >= b.decode_tok_s * (1 - TIE))
    gt = (a.n_ctx > b.n_ctx or a.n_parallel > b.n_parallel or a.kv_precision > b.kv_precision
          or a.decode_tok_s > b.decode_tok_s)
    return ge and gt


def pareto(entries: Iterable[MenuEntry]) -> list[MenuEntry]:
    """The entries no other entry dominates, in (context, parallel, KV precision) order."""
    entries = list(dict.fromkeys(entries))
    kept = [e for e in entries if not any(dominates(o, e) for o in entries)]
    return sorted(kept, key=lambda e: (e.n_ctx, e.n_parallel, -e.kv_precision, -e.decode_tok_s))


def context_choices(base: int, n_ctx_train: int) -> list[int]:
    """The requested context, then doublings up to the trained context (MAX_CONTEXTS at most)."""
    result = [base]
    while len(result) < MAX_CONTEXTS and result[-1] * 2 <= n_ctx_train:
        result.append(result[-1] * 2)
    return result


def best_entry(profile: ModelProfile, machine: Machine, settings: PlanSettings, prompt_tokens: int,
               n_gpu_layers: int | None = None, n_cpu_moe: int | None = None,
               decode_context: int | None = None) -> MenuEntry | None:
    """The placement `--gpu-layers auto` would choose at these settings (only fitting placements are
    predicted), as a menu entry; None when nothing fits."""
    from layerplan.candidates import TIE as PLAN_TIE

    sizes, n = LayerSizes(profile, settings), profile.n_layers
    top = n + 1 if machine.gpus else 0
    options = [(k, n_cpu_moe or 0) for k in range(top + 1)] if n_gpu_layers is None else [(n_gpu_layers, n_cpu_moe or 0)]
    if profile.is_moe and machine.gpus and n_cpu_moe is None and n_gpu_layers in (None, n + 1):
        options += [(n + 1, k) for k in range(1, n + 1)]
    fitting = [p for p in (place(profile, machine, settings, k, sizes, n_cpu_moe=m) for k, m in options) if p.fits]
    if not fitting:
        return None
    scored = [(predict(profile, machine, p, settings, prompt_tokens=prompt_tokens, decode_context=decode_context), p)
              for p in fitting]
    top_speed = max(s.decode_tok_s for s, _ in scored)
    speed, chosen = max(((s, p) for s, p in scored if s.decode_tok_s >= top_speed * (1 - PLAN_TIE)),
                        key=lambda sp: (sp[1].n_gpu_layers, -sp[1].n_cpu_moe))
    return MenuEntry(settings.n_ctx, settings.kv.name, settings.n_parallel, chosen.n_gpu_layers, chosen.n_cpu_moe,
                     speed.decode_tok_s, speed.decode_tok_s_total, speed.prefill_tok_s,
                     sum(u.total_bytes for u in chosen.usage[:-1]), chosen.host.total_bytes)


def frontier(profile: ModelProfile, machine: Machine, settings: PlanSettings, *, prompt_tokens: int,
             pinned: frozenset[str] = frozenset(), n_gpu_layers: int | None = None,
             n_cpu_moe: int | None = None) -> list[MenuEntry]:
    """The Pareto menu around `settings`. Axes named in `pinned` ("ctx", "kv_type", "parallel")
    keep the value in `settings`; the others range over the grid. Every entry's decode speed is
    predicted with half of `settings.n_ctx` cached in each sequence, so a larger context costs
    speed only where it moves weights off the GPU, not for tokens the user has not sent yet."""
    contexts = [settings.n_ctx] if "ctx" in pinned else context_choices(settings.n_ctx, profile.n_ctx_train)
    kv_types = ([settings.kv.name] if "kv_type" in pinned
                else list(dict.fromkeys((settings.kv.name, *KV_CHOICES[settings.runtime]))))
    parallels = [settings.n_parallel] if "parallel" in pinned else sorted({settings.n_parallel, *PARALLEL_CHOICES})
    entries = []
    for n_ctx in contexts:
        for kv in kv_types:
            for n_parallel in parallels:
                entry = best_entry(profile, machine, replace(settings, n_ctx=n_ctx, kv_type=kv, n_parallel=n_parallel),
                                   prompt_tokens, n_gpu_layers, n_cpu_moe, decode_context=settings.n_ctx // 2)
                if entry is not None:
                    entries.append(entry)
    return pareto(entries)


def prefer(entries: list[MenuEntry], preference: str) -> MenuEntry | None:
    """The entry `--prefer` picks (see the module docstring); None for an empty menu."""
    if preference not in PREFERENCES:
        raise ValueError(f"--prefer takes {', '.join(PREFERENCES)}, not '{preference}'")
    if not entries:
        return None
    if preference == "speed":
        top = max(e.decode_tok_s for e in entries)
        return max((e for e in entries if e.decode_tok_s >= top * (1 - TIE)), key=lambda e: (e.n_ctx, e.kv_precision))
    if preference == "context":
        top = max(e.n_ctx for e in entries)
        return max((e for e in entries if e.n_ctx == top), key=lambda e: (e.decode_tok_s, e.kv_precision))
    top = max(e.n_parallel for e in entries)
    return max((e for e in entries if e.n_parallel == top), key=lambda e: (e.decode_tok_s_total, e.n_ctx))


def plan_menu(profile: ModelProfile, machine: Machine, *, preference: str | None = None, n_ctx: int | None = None,
              n_parallel: int | None = None, kv_type: str | None = None, n_gpu_layers: int | None = None,
              n_cpu_moe: int | None = None, prompt_tokens: int | None = None, **options):
    """`plan()` with the menu, as `localrun plan` runs it: None for n_ctx, n_parallel or kv_type means
    that axis is free on the menu (and planned at its default); with `preference`, the plan is the
    menu's pick. Described memory no plan can use (--vram below the margin) and pins whose KV cache
    alone exceeds the machine raise PlanError (exit 2), where plan() would return an unfit plan."""
    from layerplan.planner import check_machine, check_pins_can_fit, plan
    from layerplan.settings import DEFAULT_CTX, DEFAULT_MARGIN, DEFAULT_PROMPT_TOKENS

    prompt_tokens = prompt_tokens or DEFAULT_PROMPT_TOKENS
    margin = options.get("margin_bytes", DEFAULT_MARGIN)
    check_machine(machine, margin)
    pins_given = [f"{flag} {value}" for flag, value in (("--ctx", n_ctx), ("--parallel", n_parallel),
                                                         ("--kv-type", kv_type)) if value is not None]
    if pins_given:
        try:
            asked = PlanSettings(n_ctx=n_ctx or min(profile.n_ctx_train, DEFAULT_CTX), n_parallel=n_parallel or 1,
                                 kv_type=kv_type or DEFAULT_KV_TYPE, margin_bytes=margin,
                                 runtime=options.get("runtime", LLAMA_CPP))
        except ValueError:
            asked = None  # plan() says what is wrong with the values
        if asked is not None:
            check_pins_can_fit(profile, machine, asked, pins_given)
    pins = dict(n_gpu_layers=n_gpu_layers, n_cpu_moe=n_cpu_moe, prompt_tokens=prompt_tokens, **options)
    first = plan(profile, machine, n_ctx=n_ctx, n_parallel=n_parallel or 1, kv_type=kv_type or DEFAULT_KV_TYPE, **pins)
    pinned = frozenset(axis for axis, value in (("ctx", n_ctx), ("kv_type", kv_type), ("parallel", n_parallel))
                       if value is not None)
    if preference is not None and preference not in PREFERENCES:
        raise ValueError(f"--prefer takes {', '.join(PREFERENCES)}, not '{preference}'")
    menu = frontier(profile, machine, first.settings, prompt_tokens=prompt_tokens, pinned=pinned,
                    n_gpu_layers=n_gpu_layers, n_cpu_moe=n_cpu_moe)
    pick = prefer(menu, preference) if preference else None
    if pick is None:
        return replace(first, menu=tuple(menu), preference=preference)
    chosen = plan(profile, machine, n_ctx=pick.n_ctx, n_parallel=pick.n_parallel, kv_type=pick.kv_type, **pins)
    why = (f"--prefer {preference} picks {pick.n_ctx} tokens x {pick.n_parallel} sequence"
           f"{'s' if pick.n_parallel > 1 else ''} with {pick.kv_type} KV from the menu.")
    return replace(chosen, reasons=(why, *chosen.reasons), menu=tuple(menu), preference=preference)
