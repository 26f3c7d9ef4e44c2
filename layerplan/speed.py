"""Roofline speed model: predicted decode tok/s, prefill tok/s and time to first token of a placement.

Each layer costs max(bytes read / its device's bandwidth, flops / its device's compute) for
its matmuls, the same again for its attention over the KV cache (on the device that holds
that cache), plus a fixed per-layer overhead. Each time the activations cross between devices
they pay the link's latency and bytes / link bandwidth. Decode reads every weight once per
step for all n_parallel sequences together; prefill reads them once per ubatch.

A device may compute the few rows of a decode step at another rate than a prompt chunk
(`decode_flops`: row-by-row kernels against a big GEMM), may unpack its quantized weights
once per prompt step for that GEMM (`unpack_bandwidth`): a fixed cost per step that makes
bigger prompt steps cheaper per token, and may compute attention at its own rate
(`attention_flops`). Prompts that arrive together (`prompts_together`) are
prefilled in shared steps of up to n_ubatch tokens, first come first served, as localrun's
scheduler and llama.cpp's server batch them.
"""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.devices import Device, Machine
from layerplan.kv_cache import ENGINE_KV_ALIASES, layer_kv_bytes_per_token
from layerplan.model_profile import LayerProfile, ModelProfile
from layerplan.placement import Placement
from layerplan.settings import PlanSettings

F32 = 4
OP_OFFLOAD_MIN_BATCH = 32  # llama.cpp runs host-resident matmuls of a batch this big on the GPU


@dataclass(frozen=True)
class Predicted:
    decode_tok_s: float          # tokens/s each sequence sees while n_parallel sequences decode together
    decode_tok_s_total: float    # tokens/s summed over the n_parallel sequences
    prefill_tok_s: float         # prompt tokens/s of prompts_together prompts of prompt_tokens (default one)
    ttft_s: float                # time until each of them has its first token, on an idle runner
    prompt_tokens: int
    decode_context: int          # tokens already in each sequence's cache at the decode figure
    decode_s_by_device: tuple[float, ...]  # one decode step's time spent on each device (machine order)
    prompts_together: int = 1    # prompts of prompt_tokens prefilled together in the prefill figures


def _active_fraction(profile: ModelProfile, n_tokens: int) -> float:
    """Share of a MoE layer's experts that n_tokens tokens touch (all of them for a dense model)."""
    if not profile.n_expert or not profile.n_expert_used:
        return 1.0
    return 1.0 - (1.0 - profile.n_expert_used / profile.n_expert) ** n_tokens


def _dense_matmul(layer: LayerProfile, n_tokens: int) -> tuple[float, float]:
    """(weight bytes read, flops) of one layer's matmuls besides its routed experts."""
    return layer.weight_bytes - layer.expert_bytes, 2 * n_tokens * (layer.params - layer.expert_params)


def _expert_matmul(profile: ModelProfile, layer: LayerProfile, n_tokens: int) -> tuple[float, float]:
    """(weight bytes read, flops) of one layer's routed experts for n_tokens tokens: each token
    multiplies by n_expert_used experts, and the batch reads the union of the experts it touches."""
    if not layer.expert_bytes:
        return 0.0, 0.0
    used = profile.n_expert_used / profile.n_expert if profile.n_expert and profile.n_expert_used else 1.0
    return layer.expert_bytes * _active_fraction(profile, n_tokens), 2 * n_tokens * layer.expert_params * used


def _matmul(profile: ModelProfile, layer: LayerProfile, n_tokens: int) -> tuple[float, float]:
    """(weight bytes read, flops) of one layer's matmuls for n_tokens tokens."""
    (dense_bytes, dense_flops), (expert_bytes, expert_flops) = (_dense_matmul(layer, n_tokens),
                                                                _expert_matmul(profile, layer, n_tokens))
    return dense_bytes + expert_bytes, dense_flops + expert_flops


def _attention(layer: LayerProfile, kv_bytes_per_token: float, n_queries: int, n_cached: float,
               n_sequences: int) -> tuple[float, float]:
    """(KV bytes read and written, flops) of attention: n_queries new tokens per sequence against
    n_cached cached tokens (the mean over the new tokens, for causal prefill)."""
    if not layer.n_kv_head:
        return 0.0, 0.0
    seen = min(n_cached, layer.sliding_window) if layer.sliding_window else n_cached
    n_bytes = kv_bytes_per_token * n_sequences * (seen + n_queries)
    flops = 2 * n_sequences * n_queries * seen * layer.n_head * (layer.head_dim_k + layer.head_dim_v)
    return n_bytes, flops


def _rows_rate(one: float, batch: float, batch_rows: int, rows: int) -> float:
    """A rate measured for one decode row (`one`) and for a batch of batch_rows (`batch`; 0: not
    measured), at `rows` rows: linear in the rows between the two, the batch's from batch_rows on."""
    if not batch or batch_rows <= 1:
        return one
    share = min(1.0, max(0, rows - 1) / (batch_rows - 1))
    return one + share * (batch - one)


def _kv_rate(device: Device, rows: int) -> float:
    """Bytes/s a step with `rows` decode rows reads its KV (beyond the caches) at: kv_bandwidth for
    one row, kv_batch_bandwidth from kv_batch_rows rows on, linear in the rows between (the two row
    counts an engine calibration times). On 2 Zen 3 cores four sequences over 2060 cached tokens read
    their KV about twice as fast per byte as one sequence did (docs/layerplan.md)."""
    return _rows_rate(device.kv_bandwidth or device.memory_bandwidth, device.kv_batch_bandwidth,
                      device.kv_batch_rows, rows)


def decode_attention_rate(device: Device, kv_name: str, rows: int) -> float:
    """Flop/s of the attention of a decode step of `rows` rows over a cache of type kv_name, where the
    device's kv_decode_flops has that type (0: it has not). On 2 Zen 3 cores an int8 cache's decode
    attention took as long as float16's at 2048 cached tokens: its bytes, half float16's, then nearly
    fit the CPU's caches, but each is widened and scaled in the kernel (docs/layerplan.md)."""
    for name, one, batch, batch_rows in device.kv_decode_flops:
        if ENGINE_KV_ALIASES.get(name, name) == ENGINE_KV_ALIASES.get(kv_name, kv_name):    # q8_0 is the engine's int8
            return _rows_rate(one, batch, batch_rows, rows)
    return 0.0


def _link(a: Device, b: Device) -> Device:
    """The device whose host link a transfer between a and b goes over (the slower GPU side)."""
    gpus = [d for d in (a, b) if d.kind == "gpu"]
    return min(gpus, key=lambda d: d.link_bandwidth) if gpus else a


def _transfer_s(a: Device, b: Device, n_bytes: float) -> float:
    if a is b:
        return 0.0
    link = _link(a, b)
    return link.link_latency_s + n_bytes / link.link_bandwidth if link.link_bandwidth else 0.0


class _Step:
    """Time of one forward step over a placement: for each sequence in it, n_queries new tokens
    after n_cached cached ones (for a decode step, the cached tokens each row reads)."""

    def __init__(self, profile: ModelProfile, machine: Machine, placement: Placement, settings: PlanSettings):
        self.profile, self.placement, self.settings = profile, placement, settings
        self.devices = machine.devices
        self.kv_per_token = [layer_kv_bytes_per_token(layer, settings.kv) for layer in profile.layers]
        self.op_offload_gpu = machine.gpus[0] if machine.gpus else None

    def seconds(self, n_queries: int, n_cached: float, n_sequences: int, n_logits: int) -> tuple[float, list[float]]:
        """A step of n_sequences alike sequences: decode when n_queries is 1, else prompt chunks."""
        return self.entries_seconds(((n_queries, n_cached),) * n_sequences, n_logits, decode=n_queries == 1)

    def entries_seconds(self, entries: tuple[tuple[int, float], ...], n_logits: int,
                        decode: bool) -> tuple[float, list[float]]:
        """A step of (n_queries, n_cached) per sequence; decode: its rows are decode rows (one new
        token per sequence, through the device's decode kernels), else prompt chunks (attending
        as chunk_parts says, a causal part at the device's causal rate)."""
        profile, placement, devices = self.profile, self.placement, self.devices
        n_tokens = sum(q for q, _ in entries)
        per_device = [0.0] * len(devices)
        host = devices[-1]
        previous = host  # the token embedding lookup runs in host memory
        attention = [self._layer_attention(il, layer, entries, decode) for il, layer in enumerate(profile.layers)]
        read_share = self._kv_read_share(attention)
        for il, layer in enumerate(profile.layers):
            device, kv_device = devices[placement.layer_devices[il]], devices[placement.kv_devices[il]]
            per_device[placement.layer_devices[il]] += _transfer_s(previous, device, n_tokens * profile.d_model * F32)
            expert_index = placement.expert_device(il)
            if expert_index == placement.layer_devices[il]:
                matmul_s = self._matmul_s(device, *_matmul(profile, layer, n_tokens), n_tokens, decode)
            else:  # --n-cpu-moe: the routed experts run where they live, the activations go there and back
                expert_device = devices[expert_index]
                matmul_s = self._matmul_s(device, *_dense_matmul(layer, n_tokens), n_tokens, decode)
                expert_s = (self._matmul_s(expert_device, *_expert_matmul(profile, layer, n_tokens), n_tokens, decode)
                            + 2 * _transfer_s(device, expert_device, n_tokens * profile.d_model * F32)
                            + layer.n_expert_matmuls * expert_device.matmul_overhead_s)
                per_device[expert_index] += expert_s
                matmul_s -= layer.n_expert_matmuls * device.matmul_overhead_s  # counted where they run
            a_bytes, flops_s = attention[il]
            a_bytes *= read_share[placement.kv_devices[il]]
            attention_s = max(a_bytes / _kv_rate(kv_device, n_tokens if decode else 1), flops_s)
            if kv_device is not device:  # q, k, v out to the cache's device and the result back
                q_kv_dims = layer.n_head * layer.head_dim_k + 2 * layer.n_kv_head * layer.head_dim_k
                attention_s += 2 * _transfer_s(device, kv_device, n_tokens * q_kv_dims * F32)
            matmul_s += layer.n_matmuls * device.matmul_overhead_s
            per_device[placement.layer_devices[il]] += matmul_s + device.layer_overhead_s
            per_device[placement.kv_devices[il]] += attention_s
            previous = device
        if n_logits:  # the output head runs only for the positions whose logits are wanted (rows, like decode)
            head = devices[placement.head_device]
            per_device[placement.head_device] += (
                _transfer_s(previous, head, n_logits * profile.d_model * F32)
                + max(profile.head_bytes / head.memory_bandwidth,
                      2 * n_logits * profile.head_params / (head.decode_flops or head.compute_flops))
                + head.matmul_overhead_s + _transfer_s(head, host, n_logits * profile.n_vocab * F32))
        else:
            per_device[-1] += _transfer_s(previous, host, 0)
        per_device[-1] += host.step_overhead_s
        return sum(per_device), per_device

    def _layer_attention(self, il: int, layer: LayerProfile, entries, decode: bool) -> tuple[float, float]:
        """(KV bytes read, seconds of its flops) of layer il's attention in a step of `entries`; decode
        rows over a cache of a type the device's kv_decode_flops names run at its rate."""
        kv_device = self.devices[self.placement.kv_devices[il]]
        masked_rate = kv_device.attention_flops or kv_device.compute_flops
        causal_rate = kv_device.causal_attention_flops or masked_rate
        if decode:
            masked_rate = decode_attention_rate(kv_device, self.settings.kv.name, len(entries)) or masked_rate
        a_bytes, flops_s = 0.0, 0.0
        for n_queries, n_cached in entries:
            parts = ((n_cached, False),) if decode else chunk_parts(n_cached, n_queries, layer.sliding_window)
            for i, (keys, causal) in enumerate(parts):
                b, f = _attention(layer, self.kv_per_token[il], n_queries, keys, 1)
                a_bytes += b if i == 0 else 0.0     # the chunk's own keys are read with the cached ones
                flops_s += f / (causal_rate if causal else masked_rate)
        return a_bytes, flops_s

    def _kv_read_share(self, attention: list[tuple[float, float]]) -> list[float]:
        """Per device, the share of the step's KV bytes it reads from memory: those beyond what its
        caches keep between steps (kv_cached_bytes), spread over its layers by their bytes. On a
        2-core Zen 3 (32 MB L3) one sequence's decode step cost the same at 32 and 1024 cached tokens
        (23.6 MB of SmolLM2's f16 KV) and 2-4 us more per token past it (docs/layerplan.md)."""
        total = [0.0] * len(self.devices)
        for il, (a_bytes, _) in enumerate(attention):
            total[self.placement.kv_devices[il]] += a_bytes
        return [max(0.0, t - d.kv_cached_bytes) / t if t > 0 else 1.0 for t, d in zip(total, self.devices)]

    def _matmul_s(self, device: Device, w_bytes: float, w_flops: float, n_tokens: int, decode: bool) -> float:
        """Roofline of matmuls on `device` (decode rows at its decode rate; a prompt chunk at its GEMM
        rate after unpacking the weights); a big batch of host-resident matmuls runs on the GPU with
        its weights streamed over PCIe when that is faster, as llama.cpp does."""
        rate = (device.decode_flops or device.compute_flops) if decode else device.compute_flops
        seconds = max(w_bytes / device.memory_bandwidth, w_flops / rate)
        if not decode and device.unpack_bandwidth:
            seconds += w_bytes / device.unpack_bandwidth
        if device.kind == "cpu" and self.op_offload_gpu and n_tokens >= OP_OFFLOAD_MIN_BATCH:
            gpu = self.op_offload_gpu
            seconds = min(seconds, w_bytes / gpu.link_bandwidth + w_flops / gpu.compute_flops)
        return seconds


def step_seconds(profile: ModelProfile, machine: Machine, placement: Placement, settings: PlanSettings,
                 entries: tuple[tuple[int, float], ...], *, n_logits: int, decode: bool) -> float:
    """Predicted seconds of one forward step: (n_queries, n_cached) for each sequence in it; decode:
    one new token per sequence (decode rows) reading n_cached tokens, else prompt chunks after
    n_cached cached tokens; n_logits rows through the head."""
    return _Step(profile, machine, placement, settings).entries_seconds(tuple(entries), n_logits, decode)[0]


def step_kv_bytes(profile: ModelProfile, machine: Machine, placement: Placement, settings: PlanSettings,
                  entries: tuple[tuple[int, float], ...], *, decode: bool) -> float:
    """KV bytes one step of `entries` (as step_seconds takes them) reads over all its layers."""
    step = _Step(profile, machine, placement, settings)
    return sum(step._layer_attention(il, layer, tuple(entries), decode)[0] for il, layer in enumerate(profile.layers))


def chunk_parts(n_cached: int, n_new: int, window: int | None = None) -> tuple[tuple[float, bool], ...]:
    """The attention of a prompt chunk of n_new tokens after n_cached cached ones, as the runtime
    computes it: (keys each new token is attended over on average, causal kernel or not) per
    kernel call. From an empty cache a causal kernel skips the masked half (n_new / 2). After
    cached tokens, localrun's engine attends the cached keys unmasked (n_cached) and the chunk's
    own keys causally (n_new / 2), two calls merged by log-sum-exp. A sliding-window layer
    attends its window in one masked call per block of queries (n_cached + n_new keys, which
    `_attention` clips to the window)."""
    if n_cached == 0:
        return ((n_new / 2, True),)
    if window:
        return ((n_cached + n_new, False),)
    return ((n_cached, False), (n_new / 2, True))


def prefill_steps(prompt_tokens: int, prompts_together: int, n_ubatch: int) -> list[tuple[tuple[tuple[int, float], ...], int]]:
    """The prompt steps that prefill `prompts_together` prompts of prompt_tokens arriving together:
    each step takes up to n_ubatch tokens, the oldest prompt first (a prompt's chunks in order).
    Each step is ((n_queries, n_cached before the chunk) per prompt in it, number of prompts it finishes)."""
    done = [0] * prompts_together
    steps = []
    while done[-1] < prompt_tokens:
        budget, entries, finished = n_ubatch, [], 0
        for i in range(prompts_together):
            if budget == 0:
                break
            take = min(prompt_tokens - done[i], budget)
            if take <= 0:
                continue
            entries.append((take, done[i]))
            done[i] += take
            budget -= take
            finished += done[i] == prompt_tokens
        steps.append((tuple(entries), finished))
    return steps


def predict(profile: ModelProfile, machine: Machine, placement: Placement, settings: PlanSettings, *,
            prompt_tokens: int = 512, decode_context: int | None = None, prompts_together: int = 1) -> Predicted:
    """Predicted speeds of `placement`. Decode is for n_parallel sequences each holding
    `decode_context` tokens (default: half the context, the mean over filling it); prefill and
    TTFT are for `prompts_together` prompts of `prompt_tokens` (default one) arriving together at
    an otherwise idle runner, prefilled in steps of up to n_ubatch tokens."""
    step = _Step(profile, machine, placement, settings)
    n_seq = settings.n_parallel
    decode_context = settings.n_ctx // 2 if decode_context is None else decode_context
    decode_s, by_device = step.seconds(1, decode_context, n_seq, n_logits=n_seq)

    prompt_tokens = max(1, min(prompt_tokens, settings.n_ctx))
    prefill_s = sum(step.entries_seconds(entries, n_logits, decode=False)[0]
                    for entries, n_logits in prefill_steps(prompt_tokens, prompts_together, settings.n_ubatch))
    return Predicted(
        decode_tok_s=1.0 / decode_s, decode_tok_s_total=n_seq / decode_s,
        prefill_tok_s=prompts_together * prompt_tokens / prefill_s, ttft_s=prefill_s,
        prompt_tokens=prompt_tokens, decode_context=decode_context,
        decode_s_by_device=tuple(by_device), prompts_together=prompts_together,
    )
