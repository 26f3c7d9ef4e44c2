"""Continuous batching at token granularity, with chunked prefill and preemption.

Each step fills a token budget (`max_num_batched_tokens`) in this order:
  1. running sequences that decode, one token each, oldest first (a long prompt never
     delays them: the budget is at least `max_num_seqs`);
  2. running sequences part-way through their prompt, their next chunk, oldest first;
  3. waiting sequences, FCFS or longest cached prefix first (SGLang's order: a shared
     prefix is computed once and reused at once), while `max_num_seqs`, the budget and the
     free blocks allow. Age bound: a waiting sequence that `max_bypass` later arrivals have
     been admitted ahead of goes first, and none is admitted past it, so nothing waits forever.
When a running sequence needs a block and none is free, the newest running sequence that
is newer than it and not yet in this step's batch is preempted: its blocks are freed and it
waits to be recomputed (its full blocks usually stay in the prefix cache, so recomputing is
cheap). With no such victim, a decode preempts itself and a prefill takes a smaller chunk.
No new request is admitted in a step that preempted for blocks.

Seats are shared between requests (fair_share.py): a waiting request below its share of
`max_num_seqs` is admitted first, and when every seat is taken it gets one from the request
furthest above its share (whose newest sequence is preempted).

Admission reserves (`output_reserve_tokens`, `watermark`): while anything runs, a waiting
sequence is admitted only if the free blocks cover its whole prompt and its next
`output_reserve_tokens` tokens, the same look-ahead for every running sequence (what each
still needs to finish its prompt and grow that far), and a watermark of free blocks on top
(vLLM's rule, with the output reserve added). Under a tight KV budget requests then queue
instead of being admitted and preempted a few steps later; preemption remains the last
resort for sequences that outgrow their reserve. With nothing running, a request that fits
at all is admitted, so the queue always moves.

Inter-token latency target (`itl_target_s`, with a measured `step_cost(d, p, a) -> seconds` of a
step carrying d decode rows and p prompt tokens that attend a keys: step_cost.py): a step that
carries decodes takes only as many prompt tokens as the cost model says fit in the target
beside them: the decodes first (always, even past it), then prompt tokens up to it (at least
one block, so prompts never starve), priced on the context of the first prompt in line: chunk
sizes follow the load instead of a fixed budget. A step with no decodes may use the whole
budget. The plan's predicted time of a step with decodes rides on the Batch (`planned_s`) for
the engine to compare.

Speculative decoding: a decoding sequence may carry draft tokens (`seq.draft_token_ids`, set
by the speculator before the step). Its entry then computes the last token plus the drafts,
and the runner samples at every one of those rows. Drafts are optional work: they take only
the budget left after one token per decode, only the free blocks (they never preempt), and
never reach past the context length or max_tokens. postprocess() appends the accepted drafts
and the token after them, and frees the slots the rejected ones took.

Grammars: a decode whose grammar mask for its next token is still being computed (off the
engine thread, grammar.Matcher) sits the step out, so one costly grammar never holds a step
for everyone.

The model runner consumes the `Batch` that `schedule()` returns, then hands the sampled
tokens to `postprocess()`, which appends them, checks stop conditions and frees finished
sequences.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localrun.engine.block_manager import BlockManager, slot_mapping
from localrun.engine.fair_share import seat_share, seat_victims, seats_held, under_share
from localrun.engine.sequence import Sequence, SequenceStatus
from localrun.engine.step_cost import attended_keys
from localrun.errors import OptionError, UserError

POLICIES = ("fcfs", "cache_aware")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16                 # sequences in one batch (--parallel)
    max_num_batched_tokens: int = 2048     # token budget of one step
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"                   # or "cache_aware": longest cached prefix first
    max_model_len: int | None = None       # context length; default: the whole KV cache
    output_reserve_tokens: int = 0         # admission reserves blocks for this many output tokens per sequence
    watermark: float = 0.0                 # and keeps this fraction of all blocks free (0.0: admit greedily)
    max_bypass: int = 16                   # later arrivals admitted ahead of a waiting sequence, at most
    itl_target_s: float | None = None      # a step with decodes fits this time (needs a step_cost)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise OptionError("max_num_seqs", f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise OptionError("max_num_batched_tokens", f"max_num_batched_tokens ({self.max_num_batched_tokens}) "
                              f"must be at least the number of sequences batched together ({self.max_num_seqs}), "
                              "so every decode fits a step.")
        if self.itl_target_s is not None and not self.itl_target_s > 0:
            raise UserError(f"the inter-token latency target must be positive, got {self.itl_target_s} s.")
        if self.max_bypass < 0:
            raise UserError(f"max_bypass must be at least 0, got {self.max_bypass}.")
        if self.output_reserve_tokens < 0:
            raise OptionError("output_reserve_tokens",
                              f"output_reserve_tokens must be at least 0, got {self.output_reserve_tokens}.")
        if not 0.0 <= self.watermark < 1.0:
            raise OptionError("watermark", f"watermark must be a fraction of the KV blocks in [0, 1), got {self.watermark}.")
        if self.policy not in POLICIES:
            raise OptionError("policy", f"policy takes {' or '.join(POLICIES)} (the admission order), "
                              f"not {self.policy!r}.")


@dataclass
class BatchEntry:
    """The tokens of `seq` at positions start_position .. end_position - 1 go through the model."""
    seq: Sequence
    start_position: int
    num_new_tokens: int
    is_prefill: bool       # False: a decode (one query token after a generated one)
    samples_token: bool    # reaches the sequence's end: sample the next token from its last position
    draft_token_ids: tuple[int, ...] = ()   # computed after the sequence's tokens, to verify
    draft_probs: object = None              # the proposer's (k, V) distribution, None if deterministic
    output_token_ids: list[int] = field(default_factory=list)   # appended by postprocess()

    @property
    def end_position(self) -> int:
        return self.start_position + self.num_new_tokens

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Rows whose logits are sampled: the last token's and each draft's (0 if not sampling)."""
        return 1 + self.num_draft_tokens if self.samples_token else 0

    def input_token_ids(self) -> list[int]:
        end = self.end_position - self.num_draft_tokens
        return self.seq.token_ids[self.start_position:end] + list(self.draft_token_ids)


@dataclass
class Batch:
    """One step's work for the model runner. The lists below are flat over the entries, in
    entry order; read them before postprocess(), which may free finished sequences' blocks."""
    entries: list[BatchEntry]
    block_size: int
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV this step
    planned_s: float | None = None     # the step's predicted time under an ITL target

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries

    def input_token_ids(self) -> list[int]:
        return [t for e in self.entries for t in e.input_token_ids()]

    def positions(self) -> list[int]:
        return [p for e in self.entries for p in range(e.start_position, e.end_position)]

    def slot_mapping(self) -> list[int]:
        """Where each input token's K and V are written: block_id * block_size + offset."""
        return [s for e in self.entries
                for s in slot_mapping(e.seq.block_table, self.block_size, e.start_position, e.num_new_tokens)]

    def query_start_locs(self) -> list[int]:
        """Offsets of each entry's tokens in the flat input (len(entries) + 1 values)."""
        return [0, *itertools.accumulate(e.num_new_tokens for e in self.entries)]

    def cost_shape(self) -> tuple[int, int, int]:
        """What the step cost model prices: (decode and verify rows, prompt tokens, the keys those
        prompt tokens attend)."""
        prompt = [e for e in self.entries if e.is_prefill]
        return (sum(e.num_new_tokens for e in self.entries if not e.is_prefill),
                sum(e.num_new_tokens for e in prompt),
                sum(attended_keys(e.start_position, e.num_new_tokens) for e in prompt))

    def context_lens(self) -> list[int]:
        """Keys each entry attends over, its new tokens included."""
        return [e.end_position for e in self.entries]

    def block_tables(self) -> list[list[int]]:
        return [list(e.seq.block_table) for e in self.entries]

    def sample_indices(self) -> list[int]:
        """Flat indices of the tokens whose logits are sampled: per sampling entry, its last
        num_sample_rows tokens (one row, or 1 + k rows when it verifies k drafts)."""
        ends = self.query_start_locs()[1:]
        return [i for e, end in zip(self.entries, ends) for i in range(end - e.num_sample_rows, end)]


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_admissions_deferred: int = 0   # steps in which the reserve rule held back a request that fit
    num_finished: int = 0      # aborted ones included
    num_aborted: int = 0
    num_draft_tokens: int = 0      # drafted tokens verified
    num_accepted_tokens: int = 0   # of those, accepted


class Scheduler:

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: tuple[int, ...] = (),
                 clock: Callable[[], float] = time.monotonic,
                 step_cost: Callable[[int, int, int], float] | None = None):
        capacity = block_manager.num_blocks * block_manager.block_size
        self.max_model_len = config.max_model_len or capacity
        if self.max_model_len > capacity:
            raise UserError(f"The context length {self.max_model_len} does not fit the KV cache "
                            f"({capacity} tokens); lower it or give the KV cache more memory.")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise OptionError("max_num_batched_tokens", f"max_num_batched_tokens ({config.max_num_batched_tokens}) "
                              f"must cover the context length ({self.max_model_len}) without chunked prefill.")
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = tuple(eos_token_ids)
        self.clock = clock
        self.step_cost = step_cost     # (decode rows, prompt tokens, their keys) -> seconds, for itl_target_s
        self.waiting: list[Sequence] = []    # by arrival_index
        self.running: list[Sequence] = []    # by arrival_index
        self.requests: dict[str, Sequence] = {}
        self.num_added = 0
        self.stats = SchedulerStats()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise UserError(f"A request with id {seq.request_id!r} is already queued or running.")
        if seq.num_tokens == 0:
            raise UserError("The prompt is empty; give at least one token.")
        if seq.num_tokens >= self.max_model_len:
            raise UserError(f"The prompt has {seq.num_tokens} tokens, leaving no room to generate "
                            f"within the context length {self.max_model_len}.")
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        seq.arrival_index = self.num_added
        self.num_added += 1
        if seq.timeline.arrival is None:
            seq.timeline.arrival = self.clock()
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is and free its blocks; None if it is unknown or done."""
        return self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, finish_reason: str) -> Sequence | None:
        """End a request for a reason found outside the scheduler (e.g. a stop string)."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self._finish(seq, finish_reason)
        return seq

    # --- one step -------------------------------------------------------------------
    def step_token_budget(self) -> int:
        """Tokens this step may carry: the whole budget, or under an ITL target with decodes
        running, the decodes and the most prompt tokens whose predicted step time fits it,
        priced on the context of the first prompt in line (a running one, else the next to be
        admitted, from its start)."""
        limit = self.config.max_num_batched_tokens
        target, cost = self.config.itl_target_s, self.step_cost
        num_decodes = sum(1 for s in self.running if not s.is_prefill)
        if target is None or cost is None or num_decodes == 0 or num_decodes >= limit:
            return limit
        start = next((s.num_computed_tokens for s in self.running if s.is_prefill), 0)

        def fits(p: int) -> bool:
            return cost(num_decodes, p, attended_keys(start, p)) <= target

        if fits(limit - num_decodes):
            return limit
        # find the most prompt tokens that fit, but never fewer than one block, so a prompt
        # moves on however slow the step
        lo, hi = min(self.block_manager.block_size, limit - num_decodes), limit - num_decodes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return num_decodes + lo

    def schedule(self) -> Batch:
        budget = self.step_token_budget()
        entries: list[BatchEntry] = []
        preempted: list[Sequence] = []
        scheduled: set[int] = set()   # arrival_index of the sequences in this batch
        for victim in seat_victims(self.running, self.waiting, self.config.max_num_seqs):
            self._preempt(victim)       # a seat for a request below its share (fair_share.py)
            preempted.append(victim)
        num_seat_preempted = len(preempted)
        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        draft_budget = budget - len(decodes)    # what one token per decode leaves
        for seq in decodes + prefills:
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            if not seq.is_prefill and not seq.is_sampler_ready:
                continue     # its grammar mask is still being computed: the others go on
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            if drafts and not seq.is_prefill:
                drafts = drafts[:self._num_usable_drafts(seq, len(drafts), draft_budget)]
            else:
                drafts = []
            num_new = self._reserve_slots(seq, num_new + len(drafts), scheduled, preempted)
            if num_new:
                entries.append(self._entry(seq, num_new, drafts))
                scheduled.add(seq.arrival_index)
                budget -= num_new
                draft_budget -= len(drafts)
        if len(preempted) == num_seat_preempted:    # else blocks are short: let the running ones finish first
            self._admit_waiting(budget, entries)
        if entries:
            self.stats.num_steps += 1
        for e in entries:
            if e.is_prefill:
                self.stats.num_prefill_tokens += e.num_new_tokens
            else:
                self.stats.num_decode_tokens += e.num_new_tokens
        assert sum(e.num_new_tokens for e in entries) <= self.config.max_num_batched_tokens
        batch = Batch(entries, self.block_manager.block_size, preempted)
        if (self.config.itl_target_s is not None and self.step_cost is not None
                and any(not e.is_prefill for e in entries)):      # the target holds steps with decodes
            batch.planned_s = self.step_cost(*batch.cost_shape())
        return batch

    def _num_usable_drafts(self, seq: Sequence, num_drafts: int, draft_budget: int) -> int:
        """How many of a decode's drafts fit: the spare budget, the free blocks (drafts never
        preempt), the context length, and max_tokens (more tokens than that are never kept)."""
        num = min(num_drafts, draft_budget, self.max_model_len - seq.num_tokens,
                  self.block_manager.num_appendable_tokens(seq) - seq.num_uncomputed_tokens)
        params = seq.sampling_params
        if params is not None and params.max_tokens is not None:
            num = min(num, params.max_tokens - seq.num_generated_tokens - 1)
        return max(num, 0)

    def _reserve_slots(self, seq: Sequence, num_new: int, scheduled: set[int],
                       preempted: list[Sequence]) -> int:
        """Blocks for num_new more tokens of a running seq; returns how many tokens it got."""
        block_manager = self.block_manager
        while not block_manager.can_append_slots(seq, num_new):
            victim = next((s for s in reversed(self.running)
                           if s.arrival_index > seq.arrival_index and s.arrival_index not in scheduled), None)
            if victim is not None:
                self._preempt(victim)
                preempted.append(victim)
            elif seq.is_prefill and self.config.enable_chunked_prefill:
                num_new = min(num_new, block_manager.num_appendable_tokens(seq))   # a smaller chunk
            else:
                self._preempt(seq)
                preempted.append(seq)
                return 0
        if num_new:
            block_manager.append_slots(seq, num_new)
        return num_new

    def _final_len(self, seq: Sequence) -> int:
        """The length seq reaches if it runs to max_tokens (or the context length)."""
        params = seq.sampling_params
        if params is not None and params.max_tokens is not None:
            return min(self.max_model_len, seq.num_prompt_tokens + params.max_tokens)
        return self.max_model_len

    def _reserve_target(self, seq: Sequence) -> int:
        """Tokens whose blocks admission keeps for seq: its whole prompt, and
        output_reserve_tokens past its current length (never past where it ends)."""
        return min(self._final_len(seq), seq.num_tokens + self.config.output_reserve_tokens)

    def _num_reserved_blocks(self, seq: Sequence) -> int:
        """Blocks a running seq will still take to reach its reserve target."""
        target = self.block_manager.num_blocks_needed(self._reserve_target(seq))
        return max(target - len(seq.block_table), 0)

    def _reserving(self) -> bool:
        return self.config.output_reserve_tokens > 0 or self.config.watermark > 0

    def _admit_waiting(self, budget: int, entries: list[BatchEntry]) -> None:
        block_manager = self.block_manager
        reserving = self._reserving()
        num_watermark = int(self.config.watermark * block_manager.num_blocks)
        num_committed = sum(self._num_reserved_blocks(s) for s in self.running) if reserving else 0
        max_bypass = self.config.max_bypass
        order = list(self.waiting)
        if self.config.policy == "cache_aware":
            order.sort(key=lambda s: (-block_manager.num_cached_prefix_tokens(s), s.arrival_index))
        share = seat_share(self.config.max_num_seqs, self.running, self.waiting)
        held = seats_held(self.running)
        order.sort(key=lambda s: not under_share(s, held, share))    # stable: the policy's order within
        rest = iter(order)
        while len(self.running) < self.config.max_num_seqs and budget > 0:
            # an overdue sequence (passed max_bypass times) first, the oldest of them; else the
            # policy's next. Re-chosen after every admission: one may have just become overdue.
            seq = next((s for s in self.waiting if s.num_bypassed >= max_bypass), None) or next(
                (s for s in rest if s.status is not SequenceStatus.RUNNING), None)
            if seq is None:
                break
            num_cached = block_manager.num_cached_prefix_tokens(seq)
            if seq.num_bypassed < max_bypass and self._prefix_in_flight(seq, num_cached):
                continue   # wait a step or two and take those blocks from the cache instead
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not block_manager.can_allocate(seq, num_new):
                break
            if reserving and self.running:
                num_needed = block_manager.num_blocks_to_admit(seq, self._reserve_target(seq))
                if block_manager.num_free_blocks - num_needed - num_committed < num_watermark:
                    self.stats.num_admissions_deferred += 1
                    break
            self.waiting.remove(seq)
            for other in self.waiting:     # passed over: only a request below its share is owed a seat
                if other.arrival_index < seq.arrival_index and under_share(other, held, share):
                    other.num_bypassed += 1
            held[seq.group] += 1
            block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival_index)
            if seq.timeline.first_scheduled is None:
                seq.timeline.first_scheduled = self.clock()
                seq.timeline.num_cached_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
            entries.append(self._entry(seq, num_new))
            budget -= num_new
            if reserving:
                num_committed += self._num_reserved_blocks(seq)

    def _prefix_in_flight(self, seq: Sequence, num_cached: int) -> bool:
        """True when a running sequence is still prefilling the next full block of seq's prompt
        (requests that arrive together with a shared system prompt): admitting seq now would
        compute that block twice, while waiting lets it hit the prefix cache."""
        if not self.block_manager.enable_prefix_caching:
            return False
        end = num_cached + self.block_manager.block_size
        if end > seq.num_tokens - 1:       # the last token is always computed anyway
            return False
        head = seq.token_ids[:end]
        return any(other.num_computed_tokens < end <= other.num_prompt_tokens
                   and other.token_ids[:end] == head for other in self.running)

    def _entry(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> BatchEntry:
        start = seq.num_computed_tokens
        seq.timeline.num_scheduled_steps += 1
        probs = seq.draft_probs[:len(drafts)] if drafts and seq.draft_probs is not None else None
        seq.draft_probs = None
        return BatchEntry(seq, start, num_new, seq.is_prefill,
                          start + num_new - len(drafts) == seq.num_tokens, tuple(drafts), probs)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.timeline.num_preemptions += 1
        self.stats.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival_index)

    # --- after the forward pass -----------------------------------------------------
    def postprocess(self, batch: Batch, sampled_token_ids: list) -> list[Sequence]:
        """Advance each entry, append its sampled tokens and return the finished sequences.

        sampled_token_ids has one item per sampling entry, in entry order: a token id, or for
        an entry that verified k drafts the list the runner kept (the accepted drafts, then
        one token from the target model: 1..k+1 ids). The tokens appended land in
        entry.output_token_ids; a stop condition met part-way drops the rest."""
        assert len(sampled_token_ids) == sum(e.samples_token for e in batch.entries)
        now = self.clock()
        samples = iter(sampled_token_ids)
        finished = []
        for entry in batch.entries:
            sampled = next(samples) if entry.samples_token else []
            token_ids = [sampled] if isinstance(sampled, int) else list(sampled)
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue   # aborted after schedule()
            assert seq.num_computed_tokens == entry.start_position, "postprocess once per batch"
            num_drafts = entry.num_draft_tokens
            num_accepted = len(token_ids) - 1 if num_drafts else 0
            assert 0 <= num_accepted <= num_drafts and token_ids[:num_accepted] == list(
                entry.draft_token_ids[:num_accepted]), "only a prefix of the drafts is accepted"
            seq.num_computed_tokens += entry.num_new_tokens - num_drafts
            timeline = seq.timeline
            if entry.is_prefill:
                timeline.prefill_chunks.append((now, entry.num_new_tokens))
            if timeline.prefill_done is None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                timeline.prefill_done = now
            if num_drafts:
                seq.num_draft_tokens += num_drafts
                seq.num_accepted_tokens += num_accepted
                self.stats.num_draft_tokens += num_drafts
                self.stats.num_accepted_tokens += num_accepted
            finish_reason = None
            for i, token_id in enumerate(token_ids):
                seq.append_token(token_id)
                entry.output_token_ids.append(token_id)
                if i < num_accepted:    # an accepted draft: its K/V were computed this step
                    seq.num_computed_tokens += 1
                self.stats.num_generated_tokens += 1
                if timeline.first_token is None:
                    timeline.first_token = now
                finish_reason = self._finish_reason(seq)
                if finish_reason is not None:
                    break
            if num_drafts:
                self.block_manager.rollback(seq, 0)   # free the slots of the rejected drafts
            self.block_manager.cache_full_blocks(seq)
            if finish_reason is not None:
                self._finish(seq, finish_reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence) -> str | None:
        params = seq.sampling_params
        if seq.last_token_id in self.eos_token_ids and not (params and params.ignore_eos):
            return "stop"
        if params and params.max_tokens is not None and seq.num_generated_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, finish_reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
        seq.timeline.finish = self.clock()
        del self.requests[seq.request_id]
        self.stats.num_finished += 1
        if finish_reason == "abort":
            self.stats.num_aborted += 1
