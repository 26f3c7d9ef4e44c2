"""The engine: requests in, one token per running sequence per step out.

LLMEngine wires the torch-free core (BlockManager, Scheduler) to the torch half (PagedKVCache,
ModelRunner). A caller adds requests at any time and calls `step()` in a loop; each step
schedules one batch (decodes first, then prefill chunks, then new requests), runs one forward
over it, samples, and reports what every sequence in the batch got.

KV capacity: `num_blocks`, or a KV byte budget (`kv_budget_bytes`), or by default the plan's
budget for each device the model's DeviceMap carries (layerplan, localrun/placement.py; what
`localrun plan` prints), or, for a model placed without a plan, a fraction of each device's
free memory; capped at `max_num_seqs` full contexts (more could never be used at once).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from layerplan.kv_cache import default_kv_type, num_window_blocks
from localrun.engine.block_manager import BlockManager
from localrun.engine.disk_cache import DiskCacheConfig, DiskKVCache, compute_signature, namespace
from localrun.engine.model_runner import ModelRunner
from localrun.engine.paged_kv import PagedKVCache, pool_layout
from localrun.engine.ram_cache import HostKVCache, default_ram_bytes
from localrun.engine.scheduler import Scheduler
from localrun.engine.sequence import Sequence, SequenceStatus
from localrun.engine.step_cost import MixedStepCost
from localrun.engine.speculative import SpeculativeConfig, make_speculator, measure_forward_seconds
from localrun.engine_config import DEFAULT_OUTPUT_RESERVE_TOKENS, DEFAULT_WATERMARK, EngineConfig  # noqa: F401
from localrun.errors import UserError
from localrun.model.llama import Transformer
from localrun.sampling import InvalidSamplingParam, SamplerState, SamplingParams, TokenLogprob

HOST_MEMORY_FRACTION = 0.25     # of available RAM, for layers on the CPU
DEVICE_MEMORY_FRACTION = 0.5    # of free accelerator memory (the weights are already there)
DISK_WRITE_SHARE = 0.1          # under load, without an ITL target: disk-cache writes per step, as a share of it
GRAMMAR_WAIT_S = 0.005         # a step with every running sequence waiting for its grammar mask waits this long, at most


class StepOutput(NamedTuple):
    seq: Sequence
    token_id: int | None     # sampled this step; None for a prefill chunk short of the prompt's end
                             # (a speculative step that keeps n tokens reports n outputs, in order)
    finished: bool           # seq.finish_reason says why ("stop", "length", "abort", "error")
    error: str | None = None  # finish_reason "error": what failed (this request alone)
    logprob: TokenLogprob | None = None   # the token's logprobs, when its params ask for them


def free_memory_bytes(device: torch.device) -> int:
    """Memory a KV cache on device may take by default."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEVICE_MEMORY_FRACTION)
    import psutil
    return int(psutil.virtual_memory().available * HOST_MEMORY_FRACTION)


def default_num_tokens(devices: list[torch.device], bytes_per_layer_token: float,
                       planned: Callable[[str], int | None] = lambda device: None,
                       reserved: Callable[[str], int] = lambda device: 0) -> int:
    """Tokens the pool holds by default: the device with the least room per token decides.
    A device's room is the plan's KV budget for it (`planned`, DeviceMap.kv_budget_on), less
    what is `reserved` there (the sliding-window pool); without a plan, a share of its free memory."""
    layers_on: dict[torch.device, int] = {}
    for device in devices:
        layers_on[device] = layers_on.get(device, 0) + 1

    def room(device: torch.device) -> int:
        budget = planned(str(device))
        return max(0, (free_memory_bytes(device) if budget is None else budget) - reserved(str(device)))
    if not layers_on:       # every layer slides: the pool never grows with the context
        return 2 ** 62
    return min(int(room(d) // (n * bytes_per_layer_token)) for d, n in layers_on.items())


class LLMEngine:

    def __init__(self, model: Transformer, engine_config: EngineConfig | None = None, *,
                 tokenizer_eog_ids: tuple[int, ...] | frozenset[int] = (),
                 clock: Callable[[], float] = time.monotonic, disk_cache: DiskCacheConfig | None = None,
                 speculative: SpeculativeConfig | None = None, draft_model: Transformer | None = None,
                 num_blocks: int | None = None, block_size: int = 16, **options):
        """engine_config: the options (localrun/engine_config.py), checked there; or, as keywords,
        the engine's own names for them (max_num_seqs, max_model_len, kv_type, kv_budget_bytes,
        max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill, policy,
        ram_cache_bytes, output_reserve_tokens, watermark: EngineConfig.for_engine). The other
        arguments are what the engine is given: end-of-generation ids, a clock, the disk
        cache's place, the speculation method with its built draft model, and the pool's exact
        shape (num_blocks, block_size) for tests."""
        if engine_config is None:
            engine_config = EngineConfig.for_engine(**options)
        elif options:
            raise TypeError(f"give the options in engine_config, not also as keywords: {', '.join(options)}")
        self.engine_config = c = engine_config     # under the names the pool sizing below reads
        kv_type, kv_budget_bytes, max_num_seqs = c.kv_type, c.kv_budget_bytes, c.n_parallel
        max_num_batched_tokens, max_model_len = c.max_num_batched_tokens, c.n_ctx
        enable_prefix_caching, ram_cache_bytes = c.enable_prefix_caching, c.cache_ram
        config = model.config
        layout = pool_layout(kv_type or default_kv_type(model.dtype))    # EngineConfig checked the name
        kv_type = layout.name
        max_positions = model.freqs.shape[0]
        self.max_model_len = max_model_len or max_positions
        if self.max_model_len > max_positions:
            raise UserError(f"max_model_len {self.max_model_len} exceeds the {max_positions} positions "
                            f"the model was built for; build it with a larger context.")
        if block_size < 1:
            raise UserError(f"block_size must be at least 1, got {block_size}.")
        devices = [layer.attention.wqkv.device for layer in model.layers]
        # one token's K and V in one layer, scales included: the layout layerplan plans with
        layer_token_bytes = layout.bytes_per_token(config.n_head_kv, config.head_dim, config.head_dim, block_size)
        # sliding-window layers keep their KV in a pool of their own, sized by the window
        # (localrun/engine/window_blocks.py); the rest grows with the context
        self.num_local_blocks = (num_window_blocks(config.sliding_window, block_size, max_num_seqs,
                                                   max_num_batched_tokens) if config.local_layers else 0)
        self.local_pool_bytes = math.ceil(self.num_local_blocks * block_size * config.num_local_layers
                                          * layer_token_bytes)
        if kv_budget_bytes is not None and self.local_pool_bytes:
            kv_budget_bytes = max(0, kv_budget_bytes - self.local_pool_bytes)
        self.bytes_per_token = math.ceil((config.n_layers - config.num_local_layers) * layer_token_bytes)
        local = config.local_layers or (False,) * config.n_layers

        def reserved(device: str) -> int:     # the sliding-window pool's bytes on `device`
            on = sum(is_local and str(d) == device for d, is_local in zip(devices, local))
            return on * self.num_local_blocks * block_size * layer_token_bytes
        self.num_blocks = self._num_blocks(num_blocks, kv_budget_bytes, block_size, max_num_seqs,
                                           [d for d, is_local in zip(devices, local) if not is_local],
                                           layer_token_bytes, model.device_map.kv_budget_on, reserved)
        self.kv_cache = PagedKVCache(num_blocks=self.num_blocks, block_size=block_size,
                                     n_layers=config.n_layers, n_head_kv=config.n_head_kv,
                                     head_dim=config.head_dim, kv_type=kv_type,
                                     compute_dtype=model.dtype, devices=devices,
                                     local_layers=config.local_layers, num_local_blocks=self.num_local_blocks,
                                     sliding_window=config.sliding_window)
        self.block_manager = BlockManager(self.num_blocks, block_size, enable_prefix_caching,
                                          hash_seed=f"{config.name}|{kv_type}".encode(),
                                          num_local_blocks=self.num_local_blocks,
                                          sliding_window=config.sliding_window)
        self.ram_cache: HostKVCache | None = None      # the prefix cache's host-RAM tier, if on
        ram_bytes = default_ram_bytes(devices) if ram_cache_bytes is None else ram_cache_bytes
        if ram_bytes > 0 and enable_prefix_caching:     # checked before the disk: faster to load
            self.ram_cache = HostKVCache(self.kv_cache, ram_bytes)
            self.block_manager.lower_tiers.append(self.ram_cache)
        self.disk_cache: DiskKVCache | None = None     # the prefix cache's disk tier, if enabled
        if disk_cache is not None and enable_prefix_caching:
            ns = namespace(disk_cache.model_fingerprint, compute_signature(model), kv_type, block_size,
                           self.block_manager.hash_seed.hex())
            self.disk_cache = DiskKVCache(disk_cache, ns, self.kv_cache)
            self.block_manager.lower_tiers.append(self.disk_cache)
        scheduler_config = engine_config.scheduler_config(self.max_model_len)
        self.scheduler = Scheduler(scheduler_config, self.block_manager, tuple(sorted(tokenizer_eog_ids)), clock)
        self.runner = ModelRunner(model, self.kv_cache, local_block_tables=self.block_manager.local_block_table
                                  if self.num_local_blocks else None)
        self.speculator = None if speculative is None else make_speculator(
            speculative, model, max_model_len=self.max_model_len, draft_model=draft_model)
        self.model = model
        self.kv_type = kv_type
        self.clock = clock
        self._finished_at_add: list[Sequence] = []   # max_tokens=0: reported by the next step
        self.step_cost: MixedStepCost | None = None     # measured step times, under an ITL target
        self._busy_end: float | None = None
        # LOCALRUN_STEP_LOG=path: one JSON line per step (what it ran, how long), to trace a schedule
        step_log = os.environ.get("LOCALRUN_STEP_LOG")
        self._step_log = open(step_log, "a", buffering=1) if step_log else None
        self.itl_stats = {"itl_planned_steps": 0, "itl_target_misses": 0, "step_planned_s": 0.0,
                          "step_actual_s": 0.0}

    def _num_blocks(self, num_blocks, kv_budget_bytes, block_size, max_num_seqs, global_devices,
                    bytes_per_layer_token, planned, reserved) -> int:
        if num_blocks is not None and kv_budget_bytes is not None:
            raise UserError("Give either num_blocks or kv_budget_bytes, not both.")
        if num_blocks is not None:
            if num_blocks < 1:
                raise UserError(f"num_blocks must be at least 1, got {num_blocks}.")
            return num_blocks
        if kv_budget_bytes is not None:
            num_tokens = int(kv_budget_bytes // self.bytes_per_token)
        else:
            num_tokens = default_num_tokens(global_devices, bytes_per_layer_token, planned, reserved)
        num_blocks = min(num_tokens // block_size, -(-max_num_seqs * self.max_model_len // block_size))
        if num_blocks * block_size < self.max_model_len:
            raise UserError(f"The KV budget holds {num_blocks * block_size} tokens, fewer than the "
                            f"context length {self.max_model_len}; give the KV cache more memory or "
                            f"lower the context.")
        return num_blocks

    def set_itl_target(self, seconds: float | None) -> None:
        """Hold steps that carry decodes to `seconds` (None: off), composed from measured step
        times: the decodes, then the prompt tokens that fit (scheduler.py). Each such step's
        planned and actual time is recorded; a step slower than the target is a miss."""
        config = dataclasses.replace(self.scheduler.config, itl_target_s=seconds)
        if seconds is not None and self.step_cost is None:
            model = self.model
            self.step_cost = MixedStepCost(lambda n: measure_forward_seconds(model, n, rowwise=True),
                                           lambda n: measure_forward_seconds(model, n))
            self.step_cost.warm_up(self.scheduler.config.max_num_seqs)     # not in the serving path
        self.scheduler.config = config
        self.scheduler.step_cost = self.step_cost.bound if seconds is not None else None

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None, group: str | None = None) -> Sequence:
        """Queue a request; arrival_time is on the engine's clock (default: now). Requests with
        the same `group` (one client request's n choices) share one request's seats
        (fair_share.py); by default each request is its own group."""
        params = params or SamplingParams()
        n_vocab = self.model.config.n_vocab
        bad = [t for t in prompt_ids if not 0 <= t < n_vocab]
        if bad:
            raise UserError(f"Token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1}).")
        if params.logit_bias and params.logit_bias[-1][0] >= n_vocab:
            raise InvalidSamplingParam("logit_bias", f"logit_bias names token id {params.logit_bias[-1][0]}, "
                                                     f"outside the vocabulary (0..{n_vocab - 1})")
        if params.constraint is not None and params.ignore_eos:   # the grammar's end is the reply's end
            params = dataclasses.replace(params, ignore_eos=False)
        if params.needs_state:     # its own copy of the params, with its own sampler state
            matcher = params.constraint.new_matcher() if params.constraint is not None else None
            # drafts would be checked against one distribution for several prefixes: a grammar
            # matcher and recorded logprobs follow one token at a time
            speculative = params.speculative and matcher is None and params.logprobs is None
            banned_early = self.scheduler.eos_token_ids if params.min_tokens else ()  # with ignore_eos too
            params = dataclasses.replace(params, state=SamplerState(len(prompt_ids), matcher, banned_early),
                                         speculative=speculative)
        seq = Sequence(request_id, prompt_ids, params, arrival_time, group=group or "")
        if params.max_tokens == 0:      # nothing to compute: done as soon as it arrives
            if seq.timeline.arrival is None:
                seq.timeline.arrival = self.clock()
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
            seq.timeline.finish = self.clock()
            self._finished_at_add.append(seq)
            return seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is and free its blocks; None if unknown or already done."""
        return self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, finish_reason: str) -> Sequence | None:
        """End a request for a reason found outside the engine (e.g. a stop string)."""
        seq = self.scheduler.finish_request(request_id, finish_reason)
        if seq is not None:
            self._release(seq)
            if not self.scheduler.has_unfinished():
                self._set_tiers_busy(False)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished_at_add)

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule one batch, run it, and report each of its sequences in batch order."""
        outputs = [StepOutput(seq, None, True) for seq in self._finished_at_add]
        self._finished_at_add = []
        if self.block_manager.lower_tiers:
            self._load_waiting_prefixes()
        if self.speculator is not None:     # drafts for the decoding sequences worth it
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch.is_empty:
            waiting_on = [s.sampling_params.state for s in self.scheduler.running if not s.is_sampler_ready]
            assert waiting_on or not self.scheduler.has_unfinished(), "requests wait but nothing was scheduled"
            if waiting_on:      # every running sequence waits for its grammar: let one finish
                waiting_on[0].wait(GRAMMAR_WAIT_S)
            else:
                self._set_tiers_busy(False)
            return outputs
        self._set_tiers_busy(True)
        start = time.perf_counter()
        if self.step_cost is not None and self._busy_end is not None:
            self.step_cost.observe_between(start - self._busy_end)
        sampled = self.runner.execute(batch)
        execute_s = time.perf_counter() - start
        if self.step_cost is not None:
            self.step_cost.observe(*batch.cost_shape(), execute_s)
        if batch.planned_s is not None:
            self.itl_stats["itl_planned_steps"] += 1
            self.itl_stats["itl_target_misses"] += execute_s > self.scheduler.config.itl_target_s
            self.itl_stats["step_planned_s"] += batch.planned_s
            self.itl_stats["step_actual_s"] += execute_s
        if self._step_log is not None:
            self._log_step(batch, start, execute_s)
        errors = self._finish_failed(batch, sampled)
        finished = self.scheduler.postprocess(batch, sampled)
        for entry in batch.entries:     # start the next grammar masks now, off this thread
            state = entry.seq.sampling_params.state if entry.seq.sampling_params is not None else None
            if state is not None and entry.output_token_ids and not entry.seq.is_finished:
                state.sync(entry.seq.token_ids)
        if self.speculator is not None:
            self.speculator.observe(batch, execute_s)
        for entry in batch.entries:     # a verify step may append several tokens: one output each
            if entry.seq.request_id in errors:
                outputs.append(StepOutput(entry.seq, None, True, errors[entry.seq.request_id]))
                continue
            token_ids = entry.output_token_ids or [None]
            state = entry.seq.sampling_params.state if entry.seq.sampling_params is not None else None
            for i, token_id in enumerate(token_ids):
                logprob = state.take_logprob() if state is not None and token_id is not None else None
                outputs.append(StepOutput(entry.seq, token_id, entry.seq.is_finished and i == len(token_ids) - 1,
                                          logprob=logprob))
        for seq in finished:
            self._release(seq)
        writing_s = 0.0
        if not self.scheduler.has_unfinished():
            self._set_tiers_busy(False)
        elif self.disk_cache is not None:     # busy: let the disk writer use this step's slack
            target = self.scheduler.config.itl_target_s
            between = self.step_cost.between_s() if self.step_cost is not None else 0.0
            writing_s = time.perf_counter()
            self.disk_cache.write_window(max(target - execute_s - between, 0.0) if target
                                         else DISK_WRITE_SHARE * execute_s)
            writing_s = time.perf_counter() - writing_s
        # while requests wait for the next step, the time from this one's end to its start (less
        # the disk writer's, which fits the slack on its own) is part of their inter-token gaps
        # (step_cost.bound); None after the last step, which is followed by idle time
        self._busy_end = start + execute_s + writing_s if self.scheduler.has_unfinished() else None
        return outputs

    def _log_step(self, batch, start: float, execute_s: float) -> None:
        """One line per step: its start (perf_counter), run time, plan, the queue, and each entry
        as [request id, first position, new tokens, prompt tokens]."""
        self._step_log.write(json.dumps({
            "start": round(start, 4), "execute_s": round(execute_s, 4), "planned_s": batch.planned_s,
            "waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
            "entries": [[e.seq.request_id, e.start_position, e.num_new_tokens, e.seq.num_prompt_tokens] for e in batch.entries],
        }) + "\n")

    def _finish_failed(self, batch, sampled: list) -> dict[str, str]:
        """End each request whose sampling raised (finish_reason "error", blocks freed) and
        put a placeholder in its place, which postprocess skips (the sequence is finished).
        Returns request_id -> the error, for its StepOutput."""
        errors = {}
        entries = [e for e in batch.entries if e.samples_token]
        for i, (entry, value) in enumerate(zip(entries, sampled)):
            if isinstance(value, Exception):
                errors[entry.seq.request_id] = f"{type(value).__name__}: {value}"
                self.finish_request(entry.seq.request_id, "error")
                sampled[i] = []
        return errors

    def _set_tiers_busy(self, busy: bool) -> None:
        for tier in self.block_manager.lower_tiers:
            tier.set_busy(busy)

    def _release(self, seq: Sequence) -> None:
        """Forget a finished request's sampler and speculation state."""
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _load_waiting_prefixes(self) -> None:
        """Before admission, copy the prefix blocks that the sequences next in line may reuse
        from the lower tiers (disk) into the pool, so the scheduler sees them as cache hits."""
        room = self.scheduler.config.max_num_seqs - self.scheduler.num_running
        for seq in self.scheduler.waiting[:max(room, 0)]:
            self.block_manager.load_prefix(seq)

    def flush(self) -> None:
        """Wait until the disk tier has written every block it was given."""
        if self.disk_cache is not None:
            self.disk_cache.flush()

    # --- state for metrics ------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody uses (to measure without the cache)."""
        self.block_manager.reset_prefix_cache()

    def stats(self) -> dict[str, int | float | str]:
        bm, cache, sched = self.block_manager, self.block_manager.stats, self.scheduler.stats
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_blocks_total": bm.num_blocks,
            "num_blocks_used": bm.num_used_blocks,
            "num_blocks_cached": bm.num_cached_blocks,
            "block_size": bm.block_size,
            "kv_type": self.kv_type,
            "kv_cache_bytes": self.kv_cache.num_bytes,
            "kv_usage": bm.num_used_blocks / bm.num_blocks,
            "prefix_cache_queries": cache.num_queries,
            "prefix_cache_query_tokens": cache.num_query_tokens,
            "prefix_cache_hit_tokens": cache.num_hit_tokens,
            "prefix_cache_hit_rate": cache.hit_rate,
            "prefix_cache_evictions": cache.num_evictions,
            "ram_cache_enabled": int(self.ram_cache is not None),
            "ram_cache_hit_tokens": cache.num_tier_hit_tokens.get("ram", 0),
            **({"ram_cache_bytes": self.ram_cache.num_bytes, "ram_cache_max_bytes": self.ram_cache.max_bytes,
                "ram_cache_blocks": self.ram_cache.num_blocks,
                "ram_cache_evicted_blocks": self.ram_cache.stats.num_evicted_blocks}
               if self.ram_cache is not None else {}),
            "disk_cache_enabled": int(self.disk_cache is not None),
            "disk_cache_hit_tokens": cache.num_tier_hit_tokens.get("disk", 0),
            "disk_cache_loaded_blocks": cache.num_tier_loaded_blocks.get("disk", 0),
            **({"disk_cache_bytes": self.disk_cache.num_bytes,
                "disk_cache_files": self.disk_cache.num_files,
                "disk_cache_max_bytes": self.disk_cache.max_bytes,
                "disk_cache_written_blocks": self.disk_cache.stats.num_written_blocks,
                "disk_cache_write_drops": self.disk_cache.stats.num_write_drops,
                "disk_cache_window_s": self.disk_cache.stats.window_s,
                "disk_cache_corrupt_files": self.disk_cache.stats.num_corrupt,
                "disk_cache_load_s": self.disk_cache.stats.load_s} if self.disk_cache is not None else {}),
            "num_preemptions": sched.num_preemptions,
            "num_admissions_deferred": sched.num_admissions_deferred,
            "itl_target_ms": (self.scheduler.config.itl_target_s or 0.0) * 1000,
            **self.itl_stats,
            "num_steps": sched.num_steps,
            "num_prefill_tokens": sched.num_prefill_tokens,
            "num_decode_tokens": sched.num_decode_tokens,
            "num_generated_tokens": sched.num_generated_tokens,
            "num_finished": sched.num_finished,
            "num_aborted": sched.num_aborted,
            "spec_draft_tokens": sched.num_draft_tokens,
            "spec_accepted_tokens": sched.num_accepted_tokens,
            "spec_acceptance_rate": sched.num_accepted_tokens / sched.num_draft_tokens if sched.num_draft_tokens else 0.0,
            **(self.speculator.stats() if self.speculator is not None else {}),
        }
